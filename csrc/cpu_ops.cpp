// CPU kernels: plain memcpy loops over raw bytes. These also serve pinned host mirrors, so a
// switch copies all of its host buffers in one call rather than one Python call per buffer.
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "graphctl.h"

namespace graphctl {
namespace {

// Large host mirrors (8 MiB block tables) go through torch's own CPU copy, which libtorch runs
// on all intra-op threads; small ones are one memcpy on the calling thread (no dispatch).
constexpr int64_t kThreadedBytes = 1 << 20;

at::Tensor flat_bytes(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

void copy_bytes(const at::Tensor& dst, const at::Tensor& src, int64_t n) {
  if (n >= kThreadedBytes) {
    flat_bytes(dst).copy_(flat_bytes(src));
  } else {
    std::memmove(dst.data_ptr(), src.const_data_ptr(), n);
  }
}

void swap_through_cpu(at::TensorList stat, at::TensorList arena, at::TensorList source) {
  check_lists("swap_through_", stat, "static", arena, "arena");
  check_lists("swap_through_", stat, "static", source, "source");
  check_on(stat, "swap_through_", c10::DeviceType::CPU, "");
  check_swap_overlaps(stat, arena, source);  // before any write: a failure leaves every buffer untouched
  for (size_t i = 0; i < stat.size(); ++i) {
    int64_t n = nbytes(stat[i]);
    if (n == 0) continue;
    copy_bytes(arena[i], stat[i], n);
    if (source[i].const_data_ptr() != stat[i].const_data_ptr()) copy_bytes(stat[i], source[i], n);
  }
}

void copy_cpu(at::TensorList dst, at::TensorList src) {
  check_lists("copy_", dst, "dst", src, "src");
  check_on(dst, "copy_", c10::DeviceType::CPU, "");
  for (size_t i = 0; i < dst.size(); ++i) {
    int64_t n = nbytes(dst[i]);
    if (n == 0 || dst[i].data_ptr() == src[i].const_data_ptr()) continue;
    copy_bytes(dst[i], src[i], n);
  }
}

at::Tensor fingerprint_cpu(at::TensorList bufs) {
  check_on(bufs, "fingerprint", c10::DeviceType::CPU, "");
  at::Tensor out = at::empty({static_cast<int64_t>(bufs.size())}, at::TensorOptions().dtype(at::kLong));
  auto* o = out.data_ptr<int64_t>();
  for (size_t b = 0; b < bufs.size(); ++b) {
    uint64_t n = static_cast<uint64_t>(dense_nbytes(bufs[b], "fingerprint", "bufs", b));
    auto* p = static_cast<const unsigned char*>(bufs[b].const_data_ptr());
    uint64_t h = mix64(n);
    for (uint64_t i = 0; i * 8 < n; ++i) {
      uint64_t w = 0;
      uint64_t take = n - i * 8 < 8 ? n - i * 8 : 8;
      std::memcpy(&w, p + i * 8, take);  // little-endian host: byte k lands in bits 8k..8k+7
      h += fingerprint_term(i, w);
    }
    o[b] = static_cast<int64_t>(h);
  }
  return out;
}

template <typename O, typename S>
void token_to_request_impl(O* out, int64_t out_n, const S* lens, int64_t n_seq, int64_t num_tokens, O pad) {
  // a negative length counts as 0, as in the reference and the CUDA kernel (the cumulative ends never decrease)
  auto len = [&](int64_t i) { return std::max<int64_t>(0, static_cast<int64_t>(lens[i])); };
  int64_t r = 0;
  int64_t end = n_seq > 0 ? len(0) : 0;  // cumulative end of request r
  for (int64_t t = 0; t < num_tokens; ++t) {
    while (r < n_seq && t >= end) {
      ++r;
      if (r < n_seq) end += len(r);
    }
    out[t] = static_cast<O>(r);
  }
  for (int64_t t = num_tokens; t < out_n; ++t) out[t] = pad;
}

void loop_condition_cpu(at::Tensor& flag, const at::Tensor& counter, int64_t limit, const at::Tensor& active,
                        int64_t handle) {
  TORCH_CHECK(flag.device().is_cpu(), "graphctl::loop_condition_ CPU kernel got flag on ", flag.device());
  TORCH_CHECK(handle == 0,
              "graphctl::loop_condition_: a conditional handle needs a CUDA graph; on the CPU pass "
              "handle=0 (flag only)");
  check_loop_condition(flag, counter, active);
  const bool* a = active.const_data_ptr<bool>();
  bool any = false;
  for (int64_t i = 0; i < active.numel() && !any; ++i) any = a[i];
  flag.data_ptr<int32_t>()[0] = (counter.const_data_ptr<int64_t>()[0] < limit && any) ? 1 : 0;
}

void token_to_request_cpu(at::Tensor& out, const at::Tensor& seq_lens, int64_t num_tokens, int64_t pad_value) {
  TORCH_CHECK(out.device().is_cpu(), "graphctl::token_to_request_ CPU kernel got out on ", out.device());
  check_token_to_request(out, seq_lens, num_tokens);
  AT_DISPATCH_INDEX_TYPES(out.scalar_type(), "token_to_request_out", [&] {
    using O = index_t;
    AT_DISPATCH_INDEX_TYPES(seq_lens.scalar_type(), "token_to_request_lens", [&] {
      token_to_request_impl<O, index_t>(out.data_ptr<O>(), out.numel(), seq_lens.const_data_ptr<index_t>(),
                                        seq_lens.numel(), num_tokens, static_cast<O>(pad_value));
    });
  });
}

}  // namespace
}  // namespace graphctl

TORCH_LIBRARY_IMPL(graphctl, CPU, m) {
  m.impl("swap_through_", &graphctl::swap_through_cpu);
  m.impl("copy_", &graphctl::copy_cpu);
  m.impl("fingerprint", &graphctl::fingerprint_cpu);
  m.impl("token_to_request_", &graphctl::token_to_request_cpu);
  m.impl("loop_condition_", &graphctl::loop_condition_cpu);
}
