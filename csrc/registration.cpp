// Schemas of every graphctl op, their Meta (shape-only) kernels, and the Python module
// entry point. CPU kernels live in cpu_ops.cpp, CUDA kernels in cuda/*.cu.
#include <Python.h>
#include <torch/library.h>

#include "graphctl.h"

namespace graphctl {

void check_lists(const char* op, at::TensorList a, const char* an, at::TensorList b, const char* bn) {
  TORCH_CHECK(a.size() == b.size(), "graphctl::", op, ": ", an, " has ", a.size(), " tensors but ", bn,
              " has ", b.size(), "; pass one entry per buffer in each list");
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t na = dense_nbytes(a[i], op, an, i);
    int64_t nb = dense_nbytes(b[i], op, bn, i);
    TORCH_CHECK(na == nb, "graphctl::", op, ": ", an, "[", i, "] has ", na, " bytes but ", bn, "[", i,
                "] has ", nb, " bytes; both sides of a copy must have the same byte size");
    TORCH_CHECK(a[i].device() == a[0].device() && b[i].device() == a[0].device(), "graphctl::", op,
                ": all tensors must be on one device (", an, "[0] is on ", a[0].device(), ", ", an, "[", i,
                "] on ", a[i].device(), ", ", bn, "[", i, "] on ", b[i].device(),
                "); call once per device");
  }
}

void check_swap_overlaps(at::TensorList stat, at::TensorList arena, at::TensorList source) {
  for (size_t i = 0; i < stat.size(); ++i) {
    auto* s = static_cast<const char*>(stat[i].const_data_ptr());
    auto* src = static_cast<const char*>(source[i].const_data_ptr());
    auto* a = static_cast<const char*>(arena[i].const_data_ptr());
    int64_t n = stat[i].numel() * stat[i].element_size();
    TORCH_CHECK(src == s || !(src < s + n && s < src + n), "graphctl::swap_through_: source[", i,
                "] partially overlaps static[", i, "]; pass the static buffer itself (snapshot only) or a disjoint source");
    TORCH_CHECK(n == 0 || !(a < s + n && s < a + n), "graphctl::swap_through_: arena[", i, "] overlaps static[", i,
                "]; snapshot into a separate arena");
  }
}

void check_token_to_request(const at::Tensor& out, const at::Tensor& seq_lens, int64_t num_tokens) {
  TORCH_CHECK(out.device() == seq_lens.device(), "graphctl::token_to_request_: out is on ", out.device(),
              " but seq_lens on ", seq_lens.device());
  TORCH_CHECK(out.is_contiguous() && seq_lens.is_contiguous(),
              "graphctl::token_to_request_: out and seq_lens must be contiguous");
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= out.numel(), "graphctl::token_to_request_: num_tokens=",
              num_tokens, " must be in [0, out.numel()=", out.numel(), "]");
  TORCH_CHECK(out.scalar_type() == at::kInt || out.scalar_type() == at::kLong,
              "graphctl::token_to_request_: out must be int32 or int64, found ", out.scalar_type());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong,
              "graphctl::token_to_request_: seq_lens must be int32 or int64, found ", seq_lens.scalar_type());
}

void check_loop_condition(const at::Tensor& flag, const at::Tensor& counter, const at::Tensor& active) {
  TORCH_CHECK(flag.device() == counter.device() && flag.device() == active.device(),
              "graphctl::loop_condition_: flag, counter and active must be on one device (found ", flag.device(), ", ",
              counter.device(), ", ", active.device(), ")");
  TORCH_CHECK(flag.numel() == 1 && flag.scalar_type() == at::kInt, "graphctl::loop_condition_: flag must be one int32 "
              "element, found ", flag.numel(), " of ", flag.scalar_type());
  TORCH_CHECK(counter.numel() == 1 && counter.scalar_type() == at::kLong, "graphctl::loop_condition_: counter must be "
              "one int64 element, found ", counter.numel(), " of ", counter.scalar_type());
  TORCH_CHECK(active.scalar_type() == at::kBool && active.is_contiguous(), "graphctl::loop_condition_: active must be "
              "a contiguous bool mask, found ", active.scalar_type());
}

namespace {

void loop_condition_meta(at::Tensor& flag, const at::Tensor& counter, int64_t limit, const at::Tensor& active,
                         int64_t handle) {
  check_loop_condition(flag, counter, active);
}

void swap_through_meta(at::TensorList stat, at::TensorList arena, at::TensorList source) {
  check_lists("swap_through_", stat, "static", arena, "arena");
  check_lists("swap_through_", stat, "static", source, "source");
}

void copy_meta(at::TensorList dst, at::TensorList src) { check_lists("copy_", dst, "dst", src, "src"); }

at::Tensor fingerprint_meta(at::TensorList bufs) {
  return at::empty({static_cast<int64_t>(bufs.size())}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
}

void token_to_request_meta(at::Tensor& out, const at::Tensor& seq_lens, int64_t num_tokens, int64_t pad_value) {
  check_token_to_request(out, seq_lens, num_tokens);
}

}  // namespace
}  // namespace graphctl

TORCH_LIBRARY(graphctl, m) {
  // arena[i] = static[i]; static[i] = source[i], bytewise, every buffer in one pass. An entry
  // whose source is its static buffer is a snapshot only.
  m.def("swap_through_(Tensor(a!)[] static, Tensor(b!)[] arena, Tensor[] source) -> ()");
  // dst[i] = src[i], bytewise (the restore direction).
  m.def("copy_(Tensor(a!)[] dst, Tensor[] src) -> ()");
  // One 64-bit hash per buffer over its bytes (see graphctl.h for the definition).
  m.def("fingerprint(Tensor[] bufs) -> Tensor");
  // out[t] = request owning token t in the cumulative layout of seq_lens, t < num_tokens;
  // out[num_tokens:] = pad_value.
  m.def("token_to_request_(Tensor(a!) out, Tensor seq_lens, int num_tokens, int pad_value) -> ()");
  // flag[0] = counter[0] < limit and any(active); with a nonzero handle (a cudaGraphConditionalHandle)
  // the CUDA kernel also sets that conditional node's value: the predicate of a device-side loop.
  m.def("loop_condition_(Tensor(a!) flag, Tensor counter, int limit, Tensor active, int handle) -> ()");
}

TORCH_LIBRARY_IMPL(graphctl, Meta, m) {
  m.impl("swap_through_", &graphctl::swap_through_meta);
  m.impl("copy_", &graphctl::copy_meta);
  m.impl("fingerprint", &graphctl::fingerprint_meta);
  m.impl("token_to_request_", &graphctl::token_to_request_meta);
  m.impl("loop_condition_", &graphctl::loop_condition_meta);
}

// Importing graphctl._C registers the ops above (static initializers); the module itself only
// reports whether CUDA kernels were compiled in. Plain C API: no pybind11 headers to compile.
static struct PyModuleDef graphctl_module = {PyModuleDef_HEAD_INIT, "_C", "graphctl ops (see graphctl.ops)", -1,
                                             nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&graphctl_module);
  if (m == nullptr) return nullptr;
#ifdef GRAPHCTL_WITH_CUDA
  PyModule_AddObject(m, "with_cuda", Py_NewRef(Py_True));
#else
  PyModule_AddObject(m, "with_cuda", Py_NewRef(Py_False));
#endif
  return m;
}
