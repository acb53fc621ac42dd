// What the component bindings of ampkit._C share (module.cpp assembles them): the error translation every bound
// call goes through, the holder that releases the GIL on destruction, and the Python view of optional tensors.
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <memory>
#include <string>
#include <string_view>

#include "ampkit/grad_scaler.h"

namespace ampkit::python {

namespace py = pybind11;

// Runs f under torch's warning handler (TORCH_WARN becomes a Python warning) and translates errors: c10 errors
// keep their Python types (ValueError, TypeError, ...), ScalerAssertionError becomes AssertionError (where
// torch.amp.GradScaler raises one).
template <typename F>
decltype(auto) guarded(F&& f) {
  try {
    torch::PyWarningHandler warnings;
    try {
      return f();
    } catch (...) {
      warnings.set_in_exception();
      throw;
    }
  } catch (py::error_already_set&) {
    throw;
  } catch (py::builtin_exception&) {
    throw;
  } catch (const ampkit::ScalerAssertionError& e) {
    PyErr_SetString(PyExc_AssertionError, e.python_message());
    throw py::error_already_set();
  } catch (const std::exception&) {
    torch::translate_exception_to_python(std::current_exception());
    throw py::error_already_set();
  }
}

// guarded, reporting the value and type errors of C++ checks in Python's spelling: a message that starts with
// `cxx` (e.g. "ampkit::GradScaler", as a C++ caller reads it) starts with `python` ("ampkit.GradScaler") instead.
template <typename F>
decltype(auto) guarded_as(std::string_view cxx, std::string_view python, F&& f) {
  const auto respelled = [&](const c10::Error& e, PyObject* type) {
    std::string msg = e.what_without_backtrace();
    if (msg.compare(0, cxx.size(), cxx) == 0) {
      msg.replace(0, cxx.size(), python);
    }
    PyErr_SetString(type, msg.c_str());
    return py::error_already_set();
  };
  return guarded([&]() -> decltype(auto) {
    try {
      return f();
    } catch (const c10::ValueError& e) {
      throw respelled(e, PyExc_ValueError);
    } catch (const c10::TypeError& e) {
      throw respelled(e, PyExc_TypeError);
    }
  });
}

// A holder whose deleter releases the GIL while the object is destroyed.
template <typename T>
struct GilFreeDelete {
  void operator()(T* p) const {
    if (PyGILState_Check()) {
      const py::gil_scoped_release release;
      delete p;
    } else {
      delete p;
    }
  }
  using Ptr = std::unique_ptr<T, GilFreeDelete>;
};

inline py::object optional_tensor(const at::Tensor& t) { return t.defined() ? py::cast(t) : py::object(py::none()); }

// The component bindings, each in its own file.
void bind_scaler(py::module_& m);       // bind_scaler.cpp: GradScaler, scaler checkpoints
void bind_autocast(py::module_& m);     // bind_autocast.cpp: overrides, register_autocast, precision_support
void bind_monitor(py::module_& m);      // bind_monitor.cpp: GradStatsLog, OpStatsGuard
void bind_optim(py::module_& m);        // bind_optim.cpp: ampkit.optim's bridge to ampkit::optim::core
void bind_distributed(py::module_& m);  // bind_distributed.cpp: GradientAllReduce
void bind_fp8(py::module_& m);          // bind_fp8.cpp: FP8 recipe checks and shape rule

}  // namespace ampkit::python
