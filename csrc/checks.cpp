// Argument checks shared by the CPU, CUDA and Meta kernels of every op (declared in graphctl.h).
// Each names the op, the argument and the index, what was expected and what was found.
#include "graphctl.h"

namespace graphctl {

void check_on(at::TensorList l, const char* op, c10::DeviceType type, const char* hint) {
  for (const auto& t : l) {
    TORCH_CHECK(t.device().type() == type, "graphctl::", op, " ", c10::DeviceTypeName(type), " kernel got a tensor on ",
                t.device(), hint);
  }
}

void check_lists(const char* op, at::TensorList a, const char* an, at::TensorList b, const char* bn) {
  TORCH_CHECK(a.size() == b.size(), "graphctl::", op, ": ", an, " has ", a.size(), " tensors but ", bn, " has ",
              b.size(), "; pass one entry per buffer in each list");
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t na = dense_nbytes(a[i], op, an, i);
    int64_t nb = dense_nbytes(b[i], op, bn, i);
    TORCH_CHECK(na == nb, "graphctl::", op, ": ", an, "[", i, "] has ", na, " bytes but ", bn, "[", i, "] has ", nb,
                " bytes; both sides of a copy must have the same byte size");
    TORCH_CHECK(a[i].device() == a[0].device() && b[i].device() == a[0].device(), "graphctl::", op,
                ": all tensors must be on one device (", an, "[0] is on ", a[0].device(), ", ", an, "[", i, "] on ",
                a[i].device(), ", ", bn, "[", i, "] on ", b[i].device(), "); call once per device");
  }
}

void check_swap_overlaps(at::TensorList stat, at::TensorList arena, at::TensorList source) {
  for (size_t i = 0; i < stat.size(); ++i) {
    auto* s = static_cast<const char*>(stat[i].const_data_ptr());
    auto* src = static_cast<const char*>(source[i].const_data_ptr());
    auto* a = static_cast<const char*>(arena[i].const_data_ptr());
    int64_t n = nbytes(stat[i]);
    TORCH_CHECK(src == s || !(src < s + n && s < src + n), "graphctl::swap_through_: source[", i,
                "] partially overlaps static[", i,
                "]; pass the static buffer itself (snapshot only) or a disjoint source");
    TORCH_CHECK(n == 0 || !(a < s + n && s < a + n), "graphctl::swap_through_: arena[", i, "] overlaps static[", i,
                "]; snapshot into a separate arena");
  }
}

void check_token_to_request(const at::Tensor& out, const at::Tensor& seq_lens, int64_t num_tokens) {
  TORCH_CHECK(out.device() == seq_lens.device(), "graphctl::token_to_request_: out is on ", out.device(),
              " but seq_lens on ", seq_lens.device());
  TORCH_CHECK(out.is_contiguous() && seq_lens.is_contiguous(),
              "graphctl::token_to_request_: out and seq_lens must be contiguous");
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= out.numel(), "graphctl::token_to_request_: num_tokens=", num_tokens,
              " must be in [0, out.numel()=", out.numel(), "]");
  TORCH_CHECK(out.scalar_type() == at::kInt || out.scalar_type() == at::kLong,
              "graphctl::token_to_request_: out must be int32 or int64, found ", out.scalar_type());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong,
              "graphctl::token_to_request_: seq_lens must be int32 or int64, found ", seq_lens.scalar_type());
}

void check_loop_condition(const at::Tensor& flag, const at::Tensor& counter, const at::Tensor& active) {
  TORCH_CHECK(flag.device() == counter.device() && flag.device() == active.device(),
              "graphctl::loop_condition_: flag, counter and active must be on one device (found ", flag.device(), ", ",
              counter.device(), ", ", active.device(), ")");
  TORCH_CHECK(flag.numel() == 1 && flag.scalar_type() == at::kInt,
              "graphctl::loop_condition_: flag must be one int32 "
              "element, found ",
              flag.numel(), " of ", flag.scalar_type());
  TORCH_CHECK(counter.numel() == 1 && counter.scalar_type() == at::kLong,
              "graphctl::loop_condition_: counter must be "
              "one int64 element, found ",
              counter.numel(), " of ", counter.scalar_type());
  TORCH_CHECK(active.scalar_type() == at::kBool && active.is_contiguous(),
              "graphctl::loop_condition_: active must be "
              "a contiguous bool mask, found ",
              active.scalar_type());
}

}  // namespace graphctl
