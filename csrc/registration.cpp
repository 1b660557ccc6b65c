// Schemas of every graphctl op, their Meta (shape-only) kernels, and the Python module
// entry point. CPU kernels live in cpu_ops.cpp, CUDA kernels in cuda/*.cu.
#include <Python.h>
#include <torch/library.h>

#include "graphctl.h"

namespace graphctl {

namespace {

void loop_condition_meta(at::Tensor& flag, const at::Tensor& counter, int64_t limit, const at::Tensor& active,
                         int64_t handle) {
  check_loop_condition(flag, counter, active);
}

void swap_through_meta(at::TensorList stat, at::TensorList arena, at::TensorList source) {
  check_lists("swap_through_", stat, "static", arena, "arena");
  check_lists("swap_through_", stat, "static", source, "source");
}

void copy_meta(at::TensorList dst, at::TensorList src) {
  check_lists("copy_", dst, "dst", src, "src");
}

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

namespace graphctl {
int add_switch_table(PyObject* module);  // switch_table.cpp
int add_path_check(PyObject* module);    // path_check.cpp
int add_handouts(PyObject* module);      // handouts.cpp
}  // namespace graphctl

// Importing graphctl._C registers the ops above (static initializers); the module itself only
// reports whether CUDA kernels were compiled in, and holds SwitchTable (switch_table.cpp, the one
// file that uses pybind11), paths_hold (path_check.cpp) and handed_held (handouts.cpp).
static struct PyModuleDef graphctl_module = {PyModuleDef_HEAD_INIT, "_C", "graphctl ops (see graphctl.ops)", -1,
                                             nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&graphctl_module);
  if (m == nullptr) return nullptr;
  if (graphctl::add_switch_table(m) != 0 || graphctl::add_path_check(m) != 0 || graphctl::add_handouts(m) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
#ifdef GRAPHCTL_WITH_CUDA
  PyModule_AddObject(m, "with_cuda", Py_NewRef(Py_True));
#else
  PyModule_AddObject(m, "with_cuda", Py_NewRef(Py_False));
#endif
  return m;
}
