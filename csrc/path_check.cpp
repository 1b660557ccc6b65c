// paths_hold: the per-replay path check of graphctl/graphs/rebinding.py as one C call.
//
// Before each replay a runner re-resolves every path to a tensor its forward reached through its
// arguments, self, closures or globals (cache.layers[3].keys), and refuses to replay when one no
// longer leads to the capture's tensor object at the capture's address. In Python that walk is
// bytecode per step; measured on the H200 host between synchronized steps (cold caches) 66 paths
// cost ~70 us a call, where a tight loop reads 9 us. Here each step is one C-API lookup.
//
// The program (built by rebinding.py, whose Python walk is the reference) is a tuple of entries
//   (root, keep, steps, tensor_ref, ptr)
// root: None (same root as the previous entry: keep its first `keep` steps), a cell (its
// contents), a 1-tuple (a constant), a (dict, key) pair (a global) or a callable taking
// (args, kwargs) (an argument); steps: ((is_attribute, name or key), ...) after the kept ones;
// tensor_ref: a weak reference to the capture's tensor; ptr: its data address; or, for an object
// that is not a tensor (a declared generator, a manager), the object itself and ptr None: compared
// by identity.
// A lookup that raises AttributeError, IndexError, KeyError or TypeError means "moved" (False);
// anything else (a property that raised KeyboardInterrupt) propagates as itself.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <vector>

namespace graphctl {
namespace {

// A strong reference that releases itself (no pybind11 needed here).
struct Ref {
  PyObject* p = nullptr;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  Ref(Ref&& o) noexcept : p(o.p) { o.p = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  Ref(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
};

// 1: resolved, 0: a lookup error (cleared: the path moved), -1: another exception (set).
int lookup_failed() {
  if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_IndexError) ||
      PyErr_ExceptionMatches(PyExc_KeyError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    return 0;
  }
  return -1;
}

int resolve_root(PyObject* root, PyObject* args, PyObject* kwargs, Ref& out) {
  PyObject* v = nullptr;
  if (PyCell_Check(root)) {
    v = PyCell_Get(root);  // new reference; NULL without an exception when the cell is empty
    if (v == nullptr && !PyErr_Occurred()) return 0;
  } else if (PyTuple_Check(root) && PyTuple_GET_SIZE(root) == 1) {
    v = Py_NewRef(PyTuple_GET_ITEM(root, 0));
  } else if (PyTuple_Check(root) && PyTuple_GET_SIZE(root) == 2) {
    v = PyObject_GetItem(PyTuple_GET_ITEM(root, 0), PyTuple_GET_ITEM(root, 1));
  } else {
    v = PyObject_CallFunctionObjArgs(root, args, kwargs, nullptr);
  }
  if (v == nullptr) return lookup_failed();
  out = Ref(v);
  return 1;
}

// `leaf` is a tensor whose data starts at the address `ptr` holds.
bool at_address(PyObject* leaf, PyObject* ptr) {
  if (!THPVariable_Check(leaf)) return false;
  const at::Tensor& t = THPVariable_Unpack(leaf);
  if (!t.has_storage()) return false;
  return PyLong_AsUnsignedLongLong(ptr) == reinterpret_cast<uintptr_t>(t.const_data_ptr());
}

// The tensor a weak reference points to is `leaf`, and it still has the capture's address; or,
// with ptr None, `leaf` is the object itself.
bool same_tensor(PyObject* leaf, PyObject* tensor_ref, PyObject* ptr) {
  if (ptr == Py_None) return leaf == tensor_ref;
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* got = nullptr;  // PyWeakref_GetObject is deprecated from 3.13
  if (PyWeakref_GetRef(tensor_ref, &got) < 0) PyErr_Clear();
  Ref want(got);
  return leaf == want.p && at_address(leaf, ptr);
#else
  PyObject* want = PyWeakref_GetObject(tensor_ref);  // borrowed; Py_None once the tensor died
  return leaf == want && at_address(leaf, ptr);
#endif
}

PyObject* paths_hold(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 3 || !PyTuple_Check(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "paths_hold(program: tuple, args, kwargs)");
    return nullptr;
  }
  PyObject *program = argv[0], *args = argv[1], *kwargs = argv[2];
  std::vector<Ref> along;  // the root, then the object after each step of the current path
  along.reserve(16);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(program); ++i) {
    PyObject* e = PyTuple_GET_ITEM(program, i);
    PyObject* root = PyTuple_GET_ITEM(e, 0);
    if (root != Py_None) {
      along.clear();
      Ref r;
      int rc = resolve_root(root, args, kwargs, r);
      if (rc <= 0) return rc < 0 ? nullptr : Py_NewRef(Py_False);
      along.push_back(std::move(r));
    } else {
      along.resize(static_cast<size_t>(PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 1))) + 1);
    }
    PyObject* steps = PyTuple_GET_ITEM(e, 2);
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(steps); ++s) {
      PyObject* step = PyTuple_GET_ITEM(steps, s);
      PyObject* cur = along.back().p;
      PyObject* key = PyTuple_GET_ITEM(step, 1);
      PyObject* v = PyTuple_GET_ITEM(step, 0) == Py_True ? PyObject_GetAttr(cur, key) : PyObject_GetItem(cur, key);
      if (v == nullptr) return lookup_failed() < 0 ? nullptr : Py_NewRef(Py_False);
      along.emplace_back(v);
    }
    if (!same_tensor(along.back().p, PyTuple_GET_ITEM(e, 3), PyTuple_GET_ITEM(e, 4))) return Py_NewRef(Py_False);
  }
  return Py_NewRef(Py_True);
}

// tensors_hold(refs, ptrs): every weak reference of `refs` still points to a live tensor at the
// address of the same position of `ptrs` (a model's weights between two module-registration
// events: their paths cannot have changed, their storage can: `p.data = ...`).
PyObject* tensors_hold(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[0]) || !PyTuple_Check(argv[1]) ||
      PyTuple_GET_SIZE(argv[0]) != PyTuple_GET_SIZE(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "tensors_hold(refs: tuple, ptrs: tuple of the same length)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(argv[0]); ++i) {
    PyObject* ref = PyTuple_GET_ITEM(argv[0], i);
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* got = nullptr;
    if (PyWeakref_GetRef(ref, &got) < 0) PyErr_Clear();
    Ref t(got);
    PyObject* leaf = t.p;
#else
    PyObject* leaf = PyWeakref_GetObject(ref);  // borrowed; Py_None once the tensor died
#endif
    if (leaf == nullptr || !at_address(leaf, PyTuple_GET_ITEM(argv[1], i))) return Py_NewRef(Py_False);
  }
  return Py_NewRef(Py_True);
}

PyMethodDef methods[] = {
    {"paths_hold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(paths_hold)), METH_FASTCALL,
     "paths_hold(program, args, kwargs) -> bool: every path still leads to its capture's tensor (rebinding.py)"},
    {"tensors_hold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tensors_hold)), METH_FASTCALL,
     "tensors_hold(refs, ptrs) -> bool: every weakly referenced tensor alive at its address (rebinding.py)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

int add_path_check(PyObject* module) {
  return PyModule_AddFunctions(module, methods);
}

}  // namespace graphctl
