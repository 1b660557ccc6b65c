// SwitchTable: one phase of a bound state's switch (snapshot + copy-in-place sources, attribute
// swaps, recomputes) as one call per direction. Built by graphctl/state/native.py at the first
// switch of a phase, from the same plan the Python steps (the reference) are built from.
//
// apply() checks every copy source first (identity against the object validated last time, and that
// object's dtype, device, sizes, strides and address; the ones that changed are handed back to
// Python to validate, nothing written), then runs, in order:
// one graphctl::swap_through_ per device group (through the dispatcher, so dispatch modes and
// profilers see it as they see the Python-issued op), the attribute puts, the recompute calls.
// What has been applied is counted here, so undo() is right whenever it runs: after a complete
// apply, after one that raised partway, or when nothing ran. A group whose swap raised partway may
// have written part of its buffers, which nothing can undo: undo() reports it and the caller
// poisons the state. undo() never raises: it returns (what, exception) for every failure, so the
// caller keeps restoring and reports all of them. No Python bytecode of graphctl runs in between,
// so an interrupt cannot land between a step and its record; a user callable (a recompute fn, a
// property setter) that raises, interrupt or not, is undone like any failure.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>  // pybind11 and torch's tensor casters

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "graphctl.h"

namespace py = pybind11;

namespace graphctl {
namespace {

using ListOp = void(at::TensorList, at::TensorList, at::TensorList);
using CopyOp = void(at::TensorList, at::TensorList);

const c10::TypedOperatorHandle<ListOp>& swap_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("graphctl::swap_through_", "").typed<ListOp>();
  return op;
}

const c10::TypedOperatorHandle<CopyOp>& copy_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("graphctl::copy_", "").typed<CopyOp>();
  return op;
}

// What validation looked at: a tensor changed in place (x.data = ..., resize_, set_) keeps its
// Python identity but not these, so the identity shortcut re-checks them on every switch.
struct Meta {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::kCPU);
  std::vector<int64_t> sizes, strides;
  const void* ptr = nullptr;

  static Meta of(const at::Tensor& t) {
    if (!t.defined()) return {};
    return {t.scalar_type(), t.device(), t.sizes().vec(), t.strides().vec(),
            t.has_storage() ? t.const_data_ptr() : nullptr};
  }
  bool same(const at::Tensor& t) const {
    return t.defined() && t.scalar_type() == dtype && t.device() == device && t.sizes() == sizes &&
           t.strides() == strides && (t.has_storage() ? t.const_data_ptr() : nullptr) == ptr;
  }
};

// A copy-in-place source: read by attribute name (a str) or by calling a getter (a path).
struct Source {
  size_t index;
  py::object getter;
  py::object last;  // the object validated last time; the tensor in `sources` is its own
  Meta meta;        // that tensor's metadata when validated
};

struct Group {
  std::string name;
  std::vector<at::Tensor> statics, arenas, sources;
  std::vector<Source> copies;
};

// One recompute: a Python callable with its pre-resolved arguments, or one op called boxed with
// fixed arguments (an OpCall declaration: no Python runs).
struct Recompute {
  py::object fn;
  py::tuple args;
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> stack;
};

c10::IValue to_ivalue(const py::handle& v) {
  if (THPVariable_Check(v.ptr())) return THPVariable_Unpack(v.ptr());
  if (PyBool_Check(v.ptr())) return v.cast<bool>();
  if (PyLong_Check(v.ptr())) return v.cast<int64_t>();
  if (PyFloat_Check(v.ptr())) return v.cast<double>();
  TORCH_CHECK(false, "SwitchTable: an op argument must be a tensor, bool, int or float, found ",
              py::str(py::type::of(v)).cast<std::string>());
}

// One rebind: `target` is an attribute name (str) set on the object, or a setter called with
// the value (a path or a container item).
struct Put {
  py::object target, value, original;
};

py::object exception_object(const char* what) {
  return py::reinterpret_steal<py::object>(PyObject_CallFunction(PyExc_RuntimeError, "s", what));
}

// The Python exception a failed call left: its own object when it came from Python (a dispatch
// mode, a user callable), else a RuntimeError with the C++ message.
py::object caught() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    return e.value();
  } catch (python_error& e) {
    e.restore();
    return py::error_already_set().value();
  } catch (const c10::Error& e) {
    return exception_object(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return exception_object(e.what());
  }
}

class SwitchTable {
 public:
  SwitchTable(py::object obj, const py::list& groups, const py::list& puts, const py::list& recomputes)
      : obj_(std::move(obj)) {
    for (auto g : groups) {
      auto t = g.cast<py::tuple>();  // (name, statics, arenas, sources, ((index, getter, source), ...))
      Group grp{t[0].cast<std::string>(),
                t[1].cast<std::vector<at::Tensor>>(),
                t[2].cast<std::vector<at::Tensor>>(),
                t[3].cast<std::vector<at::Tensor>>(),
                {}};
      TORCH_CHECK(grp.statics.size() == grp.arenas.size() && grp.statics.size() == grp.sources.size(),
                  "SwitchTable: group ", grp.name, " has lists of different lengths");
      for (auto c : t[4]) {
        auto ct = c.cast<py::tuple>();
        auto i = ct[0].cast<size_t>();
        TORCH_CHECK(i < grp.sources.size(), "SwitchTable: copy index ", i, " out of range in ", grp.name);
        grp.copies.push_back({i, ct[1], ct[2]});
      }
      groups_.push_back(std::move(grp));
    }
    for (auto p : puts) {
      auto t = p.cast<py::tuple>();  // (target, value, original)
      puts_.push_back({t[0], t[1], t[2]});
    }
    for (auto r : recomputes) {
      auto t = r.cast<py::tuple>();  // ("py", callable, args) or ("op", name, overload, args)
      Recompute rc;
      if (t[0].cast<std::string>() == "op") {
        rc.op = c10::Dispatcher::singleton().findSchemaOrThrow(t[1].cast<std::string>().c_str(),
                                                               t[2].cast<std::string>().c_str());
        for (auto a : t[3]) rc.stack.push_back(to_ivalue(a));
      } else {
        rc.fn = t[1];
        rc.args = t[2].cast<py::tuple>();
      }
      recomputes_.push_back(std::move(rc));
    }
  }

  // None when applied; else [(group, copy, object)] for the sources to validate (nothing written).
  // check=false trusts the sources set last (the caller validated them just now).
  py::object apply(bool check) {
    TORCH_CHECK(!busy(), "SwitchTable.apply: the previous apply was not undone");
    py::list stale;
    for (size_t g = 0; check && g < groups_.size(); ++g) {
      for (size_t c = 0; c < groups_[g].copies.size(); ++c) {
        const Source& s = groups_[g].copies[c];
        py::object cur = py::isinstance<py::str>(s.getter) ? obj_.attr(s.getter) : s.getter();
        if (!cur.is(s.last) || !s.meta.same(groups_[g].sources[s.index])) stale.append(py::make_tuple(g, c, cur));
      }
    }
    if (!stale.empty()) return std::move(stale);
    for (auto& grp : groups_) {
      partial_ = true;  // until the op returns: a swap that raised may have written part of its buffers
      swap_op().call(grp.statics, grp.arenas, grp.sources);
      partial_ = false;
      ++groups_done_;
    }
    for (auto& p : puts_) {
      ++puts_done_;  // counted first: undo puts the original back whether or not the set completed
      put(p.target, p.value);
    }
    for (auto& r : recomputes_) {  // undone by the snapshot, which holds their outputs
      if (r.op) {
        std::vector<c10::IValue> stack = r.stack;
        r.op->callBoxed(&stack);
      } else {
        r.fn(*r.args);
      }
    }
    return py::none();
  }

  // Every applied step undone in reverse; [(what, exception)] for those that could not be.
  py::list undo() {
    py::list failures;
    while (puts_done_ > 0) {
      Put& p = puts_[--puts_done_];
      try {
        put(p.target, p.original);
      } catch (...) {
        failures.append(py::make_tuple(put_name(p), caught()));
      }
    }
    if (partial_) {
      partial_ = false;
      failures.append(py::make_tuple(groups_[groups_done_].name + " (raised partway)",
                                     exception_object("its swap_through_ raised partway")));
    }
    while (groups_done_ > 0) {
      Group& grp = groups_[--groups_done_];
      try {
        copy_op().call(grp.statics, grp.arenas);
      } catch (...) {
        failures.append(py::make_tuple(grp.name, caught()));
      }
    }
    return failures;
  }

  // After Python validated a changed source: remember it, and copy from its tensor.
  void set_source(size_t g, size_t c, py::object obj, const at::Tensor& t) {
    TORCH_CHECK(g < groups_.size() && c < groups_[g].copies.size(), "SwitchTable.set_source: no copy ", g, "/", c);
    Source& s = groups_[g].copies[c];
    groups_[g].sources[s.index] = t;
    s.last = std::move(obj);
    s.meta = Meta::of(t);
  }

  bool busy() const { return groups_done_ > 0 || puts_done_ > 0 || partial_; }

  // The garbage collector's view: a table holds the bound object and the state's bound method, and
  // the state holds the table, so without these the cycle would never be collected.
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(obj_.ptr());
    for (const auto& g : groups_) {
      for (const auto& c : g.copies) {
        Py_VISIT(c.getter.ptr());
        Py_VISIT(c.last.ptr());
      }
    }
    for (const auto& p : puts_) {
      Py_VISIT(p.target.ptr());
      Py_VISIT(p.value.ptr());
      Py_VISIT(p.original.ptr());
    }
    for (const auto& r : recomputes_) {
      Py_VISIT(r.fn.ptr());
      Py_VISIT(r.args.ptr());
    }
    return 0;
  }

  void clear() {  // only ever on an unreachable table
    obj_ = py::none();
    groups_.clear();
    puts_.clear();
    recomputes_.clear();
    groups_done_ = puts_done_ = 0;
    partial_ = false;
  }

 private:
  static std::string put_name(const Put& p) { return "swap(" + py::str(p.target).cast<std::string>() + ")"; }

  void put(const py::object& target, const py::object& value) {
    if (py::isinstance<py::str>(target)) {
      py::setattr(obj_, target, value);
    } else {
      target(value);
    }
  }

  py::object obj_;
  std::vector<Group> groups_;
  std::vector<Put> puts_;
  std::vector<Recompute> recomputes_;
  size_t groups_done_ = 0, puts_done_ = 0;
  bool partial_ = false;
};

// The table inside a Python SwitchTable object, or nullptr before its constructor ran.
SwitchTable* table_of(PyObject* self) {
  auto vh = reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder();
  return vh.holder_constructed() ? vh.value_ptr<SwitchTable>() : nullptr;
}

// True when obj.<name> is want for every (name, want) pair: the fast path of the binding check
// run on every switch entry and write (graphctl/state/validate.py names the offender otherwise).
bool all_bound(const py::object& obj, const py::tuple& pairs) {
  for (auto p : pairs) {
    auto t = p.cast<py::tuple>();
    PyObject* cur = PyObject_GetAttr(obj.ptr(), t[0].ptr());
    if (cur == nullptr) {
      PyErr_Clear();  // a deleted attribute: the slow path names it
      return false;
    }
    bool same = cur == t[1].ptr();
    Py_DECREF(cur);
    if (!same) return false;
  }
  return true;
}

}  // namespace

// Adds SwitchTable to the plain C-API module graphctl._C (registration.cpp); 0 on success.
int add_switch_table(PyObject* module) {
  try {
    auto m = py::reinterpret_borrow<py::module_>(module);
    // An op that raised in a Python dispatch mode (a profiler, a fault injector) reaches the caller as the
    // exception it was, a KeyboardInterrupt included; torch's own errors without their C++ backtrace.
    py::register_local_exception_translator([](std::exception_ptr p) {
      try {
        if (p) std::rethrow_exception(p);
      } catch (python_error& e) {
        e.restore();
      } catch (const c10::Error& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
      }
    });
    py::class_<SwitchTable>(m, "SwitchTable", py::custom_type_setup([](PyHeapTypeObject* heap) {
                              auto* type = &heap->ht_type;
                              type->tp_flags |= Py_TPFLAGS_HAVE_GC;
                              type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
                                Py_VISIT(Py_TYPE(self));
                                SwitchTable* t = table_of(self);
                                return t == nullptr ? 0 : t->traverse(visit, arg);
                              };
                              type->tp_clear = [](PyObject* self) {
                                if (SwitchTable* t = table_of(self)) t->clear();
                                return 0;
                              };
                            }))
        .def(py::init<py::object, const py::list&, const py::list&, const py::list&>())
        .def("apply", &SwitchTable::apply, py::arg("check"))
        .def("undo", &SwitchTable::undo)
        .def("set_source", &SwitchTable::set_source)
        .def_property_readonly("busy", &SwitchTable::busy);
    m.def("all_bound", &all_bound, py::arg("obj"), py::arg("pairs"));
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return -1;
  }
  return 0;
}

}  // namespace graphctl
