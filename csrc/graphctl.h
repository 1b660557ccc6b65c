// Shared declarations of graphctl._C: the byte count, the argument checks used by every
// backend (checks.cpp) and the fingerprint mixing function, which must be bit-identical on CPU, CUDA and in the
// pure-PyTorch reference (graphctl/ops/reference.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>

#if defined(__CUDACC__)
#define GRAPHCTL_HD __host__ __device__ __forceinline__
#else
#define GRAPHCTL_HD inline
#endif

namespace graphctl {

// splitmix64 finalizer: a fast, well-distributed 64-bit mix (public-domain constants).
GRAPHCTL_HD uint64_t mix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Contribution of 8-byte little-endian word `w` at word index `i` to a buffer's
// fingerprint. The fingerprint is mix64(nbytes) + sum_i term(i, w_i) mod 2^64, so it can be
// reduced in any order (one CUDA launch, parallel over words) and still depends on position.
GRAPHCTL_HD uint64_t fingerprint_term(uint64_t i, uint64_t w) {
  return mix64(w ^ mix64(i + 1));
}

// The one byte count of a buffer: every op here works on raw bytes, so any dtype mix works.
inline int64_t nbytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

// nbytes of a buffer that must be dense (contiguous), checked first.
inline int64_t dense_nbytes(const at::Tensor& t, const char* op, const char* arg, size_t idx) {
  TORCH_CHECK(t.is_contiguous(), "graphctl::", op, ": ", arg, "[", idx, "] must be contiguous (found sizes ", t.sizes(),
              ", strides ", t.strides(), "); static buffers are validated contiguous at bind time");
  return nbytes(t);
}

// Every tensor of `l` is on a device of `type` (`hint` ends the message: what to do instead).
// The checks below live in checks.cpp.
void check_on(at::TensorList l, const char* op, c10::DeviceType type, const char* hint);

// Checks shared by swap_through_ and copy_: equal list lengths, equal byte sizes per index,
// one device for the whole call (the state layer groups buffers per device).
void check_lists(const char* op, at::TensorList a, const char* an, at::TensorList b, const char* bn);

// swap_through_'s per-entry checks, made before anything is written: a source must be the static
// buffer itself (snapshot only) or disjoint from it, and the arena must not overlap the static.
void check_swap_overlaps(at::TensorList stat, at::TensorList arena, at::TensorList source);

// Checks of loop_condition_ shared by the CPU, CUDA and Meta kernels.
void check_loop_condition(const at::Tensor& flag, const at::Tensor& counter, const at::Tensor& active);

// Checks of token_to_request_ shared by the CPU, CUDA and Meta kernels.
void check_token_to_request(const at::Tensor& out, const at::Tensor& seq_lens, int64_t num_tokens);

}  // namespace graphctl
