// handed_counts / handed_held: the per-call part of the default stale-output check of
// graphctl/graphs/replay/stale.py, one C call each.
//
// A bucket hands out its outputs as a set of Python objects (containers and tensors) on storage
// objects of their own. Before the next replay of the bucket the set counts as held when any of
// those objects has more references than when graphctl alone held it, or any of those storages
// more users (a view the caller took). In Python that is a map over sys.getrefcount and one over
// torch._C._storage_Use_Count (~0.6 us on the project's CPU); here it is a loop over pointers.
// The baseline and the check are both taken here (Py_REFCNT), so they count the same way on
// every Python version; stale.py's Python path is the reference, with its own baseline.
//
// caller: the innermost frame outside torch's and graphctl's machinery, as (code, line), for the
// lines the check's message names (graphs/findings/frames.py's caller is the reference). A call
// records its caller at every call; a Python walk of four frames costs ~0.4 us, a code object's
// verdict is cached here by address (the code object kept alive, so the address stays its own).
#include <Python.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <frameobject.h>

#include <unordered_map>

namespace graphctl {
namespace {

size_t uses(PyObject* cdata) {
  // the address of a StorageImpl, as torch._C._storage_Use_Count takes it
  auto* impl = reinterpret_cast<c10::StorageImpl*>(PyLong_AsSize_t(cdata));
  return c10::raw::intrusive_ptr::use_count(impl);
}

// handed_counts(objs) -> tuple of each object's reference count
PyObject* handed_counts(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 1 || !PyTuple_Check(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "handed_counts(objs: tuple)");
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(argv[0]);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* c = PyLong_FromSsize_t(Py_REFCNT(PyTuple_GET_ITEM(argv[0], i)));
    if (c == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i, c);
  }
  return out;
}

// handed_held(objs, counts, cdatas, own) -> bool: a count differs from `counts`, or the storages'
// users sum to other than `own`
PyObject* handed_held(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4 || !PyTuple_Check(argv[0]) || !PyTuple_Check(argv[1]) || !PyTuple_Check(argv[2]) ||
      PyTuple_GET_SIZE(argv[0]) != PyTuple_GET_SIZE(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "handed_held(objs: tuple, counts: tuple of the same length, cdatas: tuple, own)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(argv[0]); ++i) {
    const Py_ssize_t want = PyLong_AsSsize_t(PyTuple_GET_ITEM(argv[1], i));
    if (want == -1 && PyErr_Occurred()) return nullptr;
    if (Py_REFCNT(PyTuple_GET_ITEM(argv[0], i)) != want) return Py_NewRef(Py_True);
  }
  size_t total = 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(argv[2]); ++i) {
    total += uses(PyTuple_GET_ITEM(argv[2], i));
    if (PyErr_Occurred()) return nullptr;
  }
  const size_t own = PyLong_AsSize_t(argv[3]);
  if (own == static_cast<size_t>(-1) && PyErr_Occurred()) return nullptr;
  return Py_NewRef(total != own ? Py_True : Py_False);
}

// Whether a code object's file is machinery: its name starts with one of `prefixes` or contains
// one of `parts`. -1 on an error.
int internal(PyCodeObject* code, PyObject* prefixes, PyObject* parts) {
  static std::unordered_map<PyCodeObject*, bool> known;
  auto it = known.find(code);
  if (it != known.end()) return it->second;
  PyObject* file = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename");
  if (file == nullptr) return -1;
  bool inside = false;
  for (Py_ssize_t i = 0; !inside && i < PyTuple_GET_SIZE(prefixes); ++i) {
    const Py_ssize_t hit = PyUnicode_Tailmatch(file, PyTuple_GET_ITEM(prefixes, i), 0, PY_SSIZE_T_MAX, -1);
    if (hit < 0) {
      Py_DECREF(file);
      return -1;
    }
    inside = hit == 1;
  }
  for (Py_ssize_t i = 0; !inside && i < PyTuple_GET_SIZE(parts); ++i) {
    const int hit = PySequence_Contains(file, PyTuple_GET_ITEM(parts, i));
    if (hit < 0) {
      Py_DECREF(file);
      return -1;
    }
    inside = hit == 1;
  }
  Py_DECREF(file);
  if (known.size() > 65536) return inside;  // a process compiling code without end: stop caching
  Py_INCREF(code);                          // kept for good: its address is never another code object's
  known.emplace(code, inside);
  return inside;
}

// caller(prefixes, parts) -> (code, line), or (None, 0) when every frame is machinery
PyObject* caller(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[0]) || !PyTuple_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "caller(prefixes: tuple of str, parts: tuple of str)");
    return nullptr;
  }
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const int inside = internal(code, argv[0], argv[1]);
    if (inside < 0) {
      Py_DECREF(code);
      Py_DECREF(frame);
      return nullptr;
    }
    if (!inside) {
      PyObject* out = Py_BuildValue("(Oi)", reinterpret_cast<PyObject*>(code), PyFrame_GetLineNumber(frame));
      Py_DECREF(code);
      Py_DECREF(frame);
      return out;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference, or nullptr
    Py_DECREF(code);
    Py_DECREF(frame);
    frame = back;
  }
  return Py_BuildValue("(Oi)", Py_None, 0);
}

PyMethodDef methods[] = {
    {"handed_counts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(handed_counts)), METH_FASTCALL,
     "handed_counts(objs) -> tuple: each object's reference count (graphs/replay/stale.py)"},
    {"handed_held", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(handed_held)), METH_FASTCALL,
     "handed_held(objs, counts, cdatas, own) -> bool: a handed-out set is referenced beyond graphctl (stale.py)"},
    {"caller", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(caller)), METH_FASTCALL,
     "caller(prefixes, parts) -> (code, line): the innermost frame outside the machinery (frames.py)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

int add_handouts(PyObject* module) {
  return PyModule_AddFunctions(module, methods);
}

}  // namespace graphctl
