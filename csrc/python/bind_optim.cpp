// ampkit._C's optimizer bridge for ampkit.optim: a Python param group as the core's core::GroupConfig, a state
// dict as a core::ParamState, and the core's checks, plan and step over them (ampkit::optim::core makes every
// decision, for the LibTorch optimizers too). The tensors of a step are borrowed, not referenced (NOTE [Borrowed
// tensor lists], NOTE [Borrowed states] in csrc/optim/borrowed_tensors.h).
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../optim/borrowed_tensors.h"
#include "ampkit/ops.h"
#include "ampkit/optim.h"
#include "ampkit/optim_core.h"
#include "binding.h"
#include "tensor_hparams.h"

namespace ampkit::python {
namespace {

namespace core = ampkit::optim::core;

// The plain tensor classes, torch.Tensor and torch.nn.Parameter: their instances' hash is their address (NOTE
// [State lookups by known hash]) and they are never DTensors.
const std::vector<PyObject*>& plain_types() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<std::vector<PyObject*>> types;
  return types
      .call_once_and_store_result([] {
        PyObject* parameter = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();  // kept
        return std::vector<PyObject*>{THPVariableClass, parameter};
      })
      .get_stored();
}

// torch.distributed.tensor.DTensor, or None where torch has no distributed support.
const py::object& dtensor_type() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> type;
  return type
      .call_once_and_store_result([] {
        try {
          return py::object(py::module_::import("torch.distributed.tensor").attr("DTensor"));
        } catch (py::error_already_set&) {
          return py::object(py::none());
        }
      })
      .get_stored();
}

// NOTE [State lookups by known hash]
// torch.Tensor.__hash__ is a Python method (`return id(self)`), so a dict lookup keyed by a parameter calls into
// the interpreter: about 60 ns, a tenth of a step's time per parameter of a small tensor. The hash of a plain
// tensor (torch.Tensor, nn.Parameter; subclasses may define their own) is its address, as CPython turns the int
// __hash__ returns into the hash, so the group step looks states up by that hash, once the call's first
// parameter of that class has shown that its hash is its address (otherwise, and for other types, by the
// ordinary lookup).
class StateLookup {
 public:
  explicit StateLookup(PyObject* dict) : dict_(dict), known_(plain_types().size(), -1) {}

  // state.get(item) (borrowed; nullptr and no error when absent); `plain`: the index of item's exact type in
  // plain_types(), -1 for another type.
  PyObject* get(PyObject* item, int plain) {
#if PY_VERSION_HEX < 0x030F0000  // _PyDict_GetItem_KnownHash: CPython 3.11-3.14
    if (plain >= 0) {
      int& known = known_[static_cast<size_t>(plain)];
      if (known < 0) {
        const Py_hash_t h = PyObject_Hash(item);
        if (h == -1) {
          return nullptr;  // the error is set
        }
        known = h == address_hash(item) ? 1 : 0;
      }
      if (known == 1) {
        return _PyDict_GetItem_KnownHash(dict_, item, address_hash(item));
      }
    }
#else
    (void)plain;
#endif
    return PyDict_GetItemWithError(dict_, item);
  }

 private:
  static Py_hash_t address_hash(PyObject* item) { return static_cast<Py_hash_t>(reinterpret_cast<intptr_t>(item)); }

  PyObject* dict_;
  std::vector<int> known_;  // per plain type: whether its hash is the address (-1: not known yet)
};

// The index of item's exact type in plain_types(), or -1.
int plain_type(PyObject* item) {
  const auto& types = plain_types();
  for (size_t t = 0; t < types.size(); ++t) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(item)) == types[t]) {
      return static_cast<int>(t);
    }
  }
  return -1;
}

double number(const py::handle& v) { return ampkit::python::hparam_value(v); }  // tensor betas: tensor_hparams.h

// group[key], or `fallback` where the group (a constructor's partial one) has no such key.
py::object get(const py::dict& group, const char* key, py::object fallback) {
  return group.contains(key) ? py::object(group[key]) : std::move(fallback);
}

// A state dtype option of a group (None: FP32), as a ScalarType; its range is the core's check.
at::ScalarType state_dtype_option(const std::string& optimizer, const py::dict& group, const char* key) {
  const py::object v = get(group, key, py::none());
  if (v.is_none()) {
    return at::kFloat;
  }
  if (!THPDtype_Check(v.ptr())) {
    throw py::type_error(optimizer + ": " + key + " must be a torch.dtype (torch.float32, torch.bfloat16 or " +
                         "torch.uint8) or None, but got " + std::string(py::str(py::type::of(v).attr("__name__"))) +
                         " " + std::string(py::repr(v)));
  }
  return reinterpret_cast<THPDtype*>(v.ptr())->scalar_type;
}

// A param group of ampkit.optim (a dict with torch.optim's keys) as the core's config; `optimizer` must outlive it.
core::GroupConfig group_config(const std::string& kind, const std::string& optimizer, const py::dict& group,
                               bool write_unscaled_grads) {
  TORCH_CHECK_VALUE(kind == "adam" || kind == "sgd" || kind == "lamb", "ampkit.optim: unknown algorithm '", kind, "'");
  core::GroupConfig c;
  c.optimizer = optimizer.c_str();
  c.algorithm = kind == "sgd"    ? core::Algorithm::kSGD
                : kind == "lamb" ? core::Algorithm::kLamb
                                 : core::Algorithm::kAdam;
  const py::object lr = group["lr"];
  if (THPVariable_Check(lr.ptr())) {
    c.lr_tensor = THPVariable_Unpack(lr.ptr());
    c.lr = c.lr_tensor.is_cpu() && c.lr_tensor.numel() == 1 ? c.lr_tensor.item<double>() : 0.0;  // range check
  } else {
    c.lr = number(lr);
  }
  const py::object no = py::bool_(false);
  const py::object zero = py::float_(0.0);
  c.weight_decay = number(group["weight_decay"]);
  c.maximize = get(group, "maximize", no).cast<bool>();
  if (c.algorithm != core::Algorithm::kSGD) {  // Adam's and LAMB's moments
    const py::sequence betas = group["betas"];
    c.beta1 = number(betas[0]);
    c.beta2 = number(betas[1]);
    c.eps = number(group["eps"]);
  }
  if (c.algorithm == core::Algorithm::kLamb) {
    const py::object yes = py::bool_(true);
    c.decoupled_weight_decay = get(group, "adam_w_mode", yes).cast<bool>();
    c.bias_correction = get(group, "bias_correction", yes).cast<bool>();
    c.grad_averaging = get(group, "grad_averaging", yes).cast<bool>();
    c.use_nvlamb = get(group, "use_nvlamb", no).cast<bool>();
    c.max_grad_norm = number(get(group, "max_grad_norm", zero));
  } else if (c.algorithm == core::Algorithm::kAdam) {
    c.amsgrad = get(group, "amsgrad", no).cast<bool>();
    c.decoupled_weight_decay = get(group, "decoupled_weight_decay", no).cast<bool>();
    c.exp_avg_dtype = state_dtype_option(optimizer, group, "exp_avg_dtype");
    c.exp_avg_sq_dtype = state_dtype_option(optimizer, group, "exp_avg_sq_dtype");
  } else {
    c.momentum = number(get(group, "momentum", zero));
    c.dampening = number(get(group, "dampening", zero));
    c.nesterov = get(group, "nesterov", no).cast<bool>();
    c.exp_avg_dtype = state_dtype_option(optimizer, group, "momentum_dtype");
  }
  const py::object mw = group.contains("master_weights") ? py::object(group["master_weights"]) : py::none();
  if (mw.is_none()) {
    c.master_weights = ampkit::optim::MasterWeights::kAuto;
  } else if (py::isinstance<py::str>(mw)) {
    c.master_weights = ampkit::optim::MasterWeights::from_name(mw.cast<std::string>());
  } else {
    c.master_weights = ampkit::optim::MasterWeights(mw.cast<bool>());
  }
  c.write_unscaled_grads = write_unscaled_grads;
  c.python_spelling = true;
  return c;
}

// Reads a state dict of ampkit.optim (torch.optim's entry names; other keys and non-tensor values are ignored):
// set(k, value, tensor) for each entry, k its index in ParamState::fields(). One walk over the dict's few
// entries, no key object built: this runs for every parameter of every step.
template <typename Set>
void read_state(const py::dict& d, const Set& set) {
  static const auto fields = [] {  // (name, its length) of every entry: compared by length first
    std::vector<std::pair<const char*, size_t>> f;
    for (const auto& [name, field] : core::ParamState::fields()) {
      f.emplace_back(name, std::strlen(name));
    }
    return f;
  }();
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(d.ptr(), &pos, &key, &value)) {
    if (!PyUnicode_Check(key) || !THPVariable_Check(value)) {
      continue;
    }
    Py_ssize_t size = 0;
    const char* name = PyUnicode_AsUTF8AndSize(key, &size);
    if (name == nullptr) {
      PyErr_Clear();
      continue;
    }
    for (size_t k = 0; k < fields.size(); ++k) {
      if (static_cast<size_t>(size) == fields[k].second && std::memcmp(name, fields[k].first, size) == 0) {
        set(k, value, THPVariable_Unpack(value));
        break;
      }
    }
  }
}

// A state dict as a core::ParamState holding references.
core::ParamState state_from_py(const py::dict& d) {
  core::ParamState s;
  read_state(d, [&](size_t k, PyObject*, const at::Tensor& t) { s.*(core::ParamState::fields()[k].second) = t; });
  return s;
}

// Writes into `d` the entries of `after` that differ from what `before(k)` held (new or replaced), and deletes
// the entries it no longer has.
template <typename Before>
void state_to_py(const Before& before, const core::ParamState& after, py::dict& d) {
  const auto& fields = core::ParamState::fields();
  for (size_t k = 0; k < fields.size(); ++k) {
    const c10::TensorImpl* old = before(k);
    const at::Tensor& now = after.*(fields[k].second);
    if (now.defined() && now.unsafeGetTensorImpl() != old) {
      d[py::str(fields[k].first)] = now;
    } else if (!now.defined() && old != nullptr) {
      PyDict_DelItemString(d.ptr(), fields[k].first);
    }
  }
}

// Steps `params` (core::step) with the states `dicts` hold (a null object: none yet), then writes into each dict
// the entries the step created or replaced; `created(i, d)` is given the dict made for a parameter that had none
// and has a state now. The states' plain tensors are borrowed where the core allows it (NOTE [Borrowed states] in
// csrc/optim/borrowed_tensors.h). Python code that could free a state (a key's __hash__) runs only before the
// borrows are taken or after they are released; writing back stores str-keyed items into the caller's dicts.
template <typename Created>
void step_with_states(const core::GroupConfig& config, at::TensorList params, const std::vector<py::object>& dicts,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                      const Created& created) {
  std::vector<std::pair<size_t, py::dict>> made;  // the dicts made for parameters that had no state
  {
    core::BorrowedStates states(dicts.size(), !core::may_replace_entries(config));
    const auto* plain = reinterpret_cast<PyTypeObject*>(THPVariableClass);
    for (size_t i = 0; i < dicts.size(); ++i) {
      if (dicts[i]) {
        read_state(py::reinterpret_borrow<py::dict>(dicts[i]), [&](size_t k, PyObject* value, const at::Tensor& t) {
          states.set(i, k, t, Py_TYPE(value) == plain);  // a subclass may hold its tensor elsewhere: referenced
        });
      }
    }
    guarded([&] { core::step(config, params, states.pointers(), grad_scale, found_inf); });
    for (size_t i = 0; i < dicts.size(); ++i) {
      const auto before = [&](size_t k) { return states.before(i, k); };
      if (dicts[i]) {
        py::dict d = py::reinterpret_borrow<py::dict>(dicts[i]);
        state_to_py(before, states[i], d);
      } else if (!states[i].empty()) {  // (an SGD parameter without momentum or master gets none)
        made.emplace_back(i, py::dict());
        state_to_py(before, states[i], made.back().second);
      }
    }
  }
  for (const auto& [i, d] : made) {
    created(i, d);  // may run Python code (the key's __hash__): no borrow is held
  }
}

const char* mode_name(core::MasterMode mode) {
  switch (mode) {
    case core::MasterMode::kMaster:
      return "master";
    case core::MasterMode::kRemainder:
      return "remainder";
    case core::MasterMode::kStochastic:
      return "stochastic";
    case core::MasterMode::kKahan:
      return "kahan";
    default:
      return "none";
  }
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def("_optim_check", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                           const std::vector<at::Tensor>& params) {
    guarded([&] { core::check_group(group_config(kind, optimizer, group, true), params); });
  });
  m.def("_optim_check_config", [](const std::string& kind, const std::string& optimizer, const py::dict& group) {
    guarded([&] { core::check_config(group_config(kind, optimizer, group, true)); });
  });
  m.def("_optim_step", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                          const std::vector<at::Tensor>& params, const std::vector<py::dict>& states,
                          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                          bool write_unscaled_grads, const std::optional<at::Tensor>& grad_norm) {
    core::GroupConfig config = guarded([&] { return group_config(kind, optimizer, group, write_unscaled_grads); });
    if (grad_norm.has_value()) {
      config.grad_norm = *grad_norm;
    }
    const std::vector<py::object> dicts(states.begin(), states.end());
    step_with_states(config, params, dicts, grad_scale, found_inf, [](size_t, const py::dict&) {});
  });
  // One group's step with the lists assembled here (NOTE [Group steps from Python]): `state` is the optimizer's
  // state mapping (a dict: parameter -> dict of entries); states the step creates are added to it. Returns False,
  // having done nothing, for a group with DTensor parameters.
  m.def("_optim_step_group", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                                const py::dict& state, const std::optional<at::Tensor>& grad_scale,
                                const std::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                                const std::optional<at::Tensor>& grad_norm) {
    // NOTE [Group steps from Python]
    // ampkit.optim's step over thousands of small parameters spent a third of its time building Python lists
    // (the parameters with a grad, their states) and converting them. Here the parameters' grads are read from
    // the C++ tensors, states looked up in the optimizer's dict (dict.get: no default entry is created) and
    // read in place; only the entries the step creates or replaces are written back.
    core::GroupConfig config = guarded([&] { return group_config(kind, optimizer, group, write_unscaled_grads); });
    if (grad_norm.has_value()) {
      config.grad_norm = *grad_norm;
    }
    const py::object list = group["params"];
    if (!PyList_Check(list.ptr())) {
      throw py::type_error(optimizer + ".step: param_groups[i]['params'] must be a list, but got " +
                           std::string(py::str(py::type::of(list))));
    }
    const Py_ssize_t n = PyList_GET_SIZE(list.ptr());
    // NOTE [Borrowed tensor lists]: `keys` holds the parameters' Python objects, which keep their tensors alive
    // (Python references: no atomic count, no GIL round trip).
    ampkit::detail::BorrowedTensors params;
    std::vector<py::object> keys;
    std::vector<py::object> dicts;  // the states (None: none yet)
    params.reserve(n);
    keys.reserve(n);
    dicts.reserve(n);
    StateLookup lookup(state.ptr());
    const py::object& dtensor = dtensor_type();
    // Two passes over the parameters (NOTE [One pass per parameter] in csrc/ops/checks.cpp): this one reads each
    // one's type, grad and state dict, and is the only one that may run Python code (an isinstance, a subclass's
    // __hash__); step_with_states then borrows the states' entries (NOTE [Borrowed states]).
    // The list's size is read on every iteration: Python code may change it.
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list.ptr()); ++i) {
      PyObject* item = PyList_GET_ITEM(list.ptr(), i);
      // The plain tensor class it is an instance of (-1: none), tested first: isinstance costs several times more.
      const int plain = plain_type(item);
      // A DTensor parameter (FSDP2): False, nothing done; the caller steps the local shards.
      if (!dtensor.is_none() && plain < 0) {
        const int is = PyObject_IsInstance(item, dtensor.ptr());
        if (is < 0) {
          throw py::error_already_set();
        }
        if (is == 1) {
          return false;
        }
      }
      if (!THPVariable_Check(item)) {
        throw py::type_error(optimizer + ".step: params[" + std::to_string(i) + "] is not a tensor but " +
                             std::string(py::str(py::type::of(py::handle(item)))));
      }
      py::object key = py::reinterpret_borrow<py::object>(item);  // held while Python code may run
      const at::Tensor& p = THPVariable_Unpack(item);
      if (!p.grad().defined()) {
        continue;
      }
      PyObject* d = lookup.get(item, plain);
      if (d == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      if (d != nullptr && !PyDict_Check(d)) {
        throw py::type_error(optimizer + ".step: the state of params[" + std::to_string(i) +
                             "] must be a dict, but got " + std::string(py::str(py::type::of(py::handle(d)))));
      }
      params.push_back(p);
      keys.push_back(std::move(key));
      dicts.push_back(d != nullptr ? py::reinterpret_borrow<py::object>(d) : py::object());
    }
    step_with_states(config, params, dicts, grad_scale, found_inf, [&](size_t i, const py::dict& d) {
      if (PyDict_SetItem(state.ptr(), keys[i].ptr(), d.ptr()) != 0) {
        throw py::error_already_set();
      }
    });
    return true;
  });
  // The core's plan of a group's step (core::plan_step), for a compiled step (NOTE [Compiled steps] in
  // ampkit/_compile.py): `grads` one tensor or None per parameter (what the step will read; a trace passes meta
  // tensors of the traced grads' layout), `states` one dict or None. Returns (params, buckets): for each parameter
  // with a grad (index, master mode, fused, staged, the names of the entries to create, the first step, whether
  // its remainder is made from a loaded master); for each fused call (master mode, the names of the entries it
  // reads, positions in params).
  m.def("_optim_plan", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                          const std::vector<at::Tensor>& params, const std::vector<std::optional<at::Tensor>>& grads,
                          const std::vector<std::optional<py::dict>>& states) {
    std::vector<core::ParamState> held(states.size());
    std::vector<const core::ParamState*> pointers(states.size(), nullptr);
    for (size_t i = 0; i < states.size(); ++i) {
      if (states[i]) {
        held[i] = state_from_py(*states[i]);
        pointers[i] = &held[i];
      }
    }
    std::vector<at::Tensor> grad_list;
    grad_list.reserve(grads.size());
    for (const auto& g : grads) {
      grad_list.push_back(g.value_or(at::Tensor()));
    }
    const core::StepPlan plan = guarded(
        [&] { return core::plan_step(group_config(kind, optimizer, group, true), params, pointers, grad_list); });
    py::list out_params;
    for (const auto& e : plan.params) {
      out_params.append(py::make_tuple(e.index, mode_name(e.mode), e.fused, e.staged,
                                       core::StepPlan::entry_names(e.missing), e.first_step, e.remainder_from_master));
    }
    py::list out_buckets;
    for (const auto& b : plan.buckets) {
      out_buckets.append(py::make_tuple(mode_name(b.mode), core::StepPlan::entry_names(b.reads), b.params));
    }
    return py::make_tuple(out_params, out_buckets);
  });
  m.def("_optim_takes_fused", [](const at::Tensor& p) { return core::takes_fused(p, p); });
  m.def("_optim_takes_master", [](const std::string& kind, const std::string& optimizer, const py::dict& group) {
    return guarded([&] { return core::takes_master(group_config(kind, optimizer, group, true)); });
  });
  m.def("_optim_remainder_of", [](const at::Tensor& p, const at::Tensor& master) {
    return guarded([&] { return core::remainder_of(p, master); });
  });
  m.def("_optim_master_from_remainder", [](const at::Tensor& p, const at::Tensor& rem) {
    return guarded([&] { return core::master_from_remainder(p, rem); });
  });
  m.def("_optim_check_loaded_state",
        [](const std::string& kind, const std::string& optimizer, const py::dict& group, const std::string& where,
           const at::Tensor& p, const std::vector<std::pair<std::string, at::Tensor>>& entries) {
          guarded([&] { core::check_loaded_state(group_config(kind, optimizer, group, true), where, p, entries); });
        });
  m.def("_optim_init_master", [](const at::Tensor& p, py::dict state) {
    core::ParamState s = state_from_py(state);
    const core::ParamState before = s;
    guarded([&] { core::init_master(p, s); });
    const auto& fields = core::ParamState::fields();
    state_to_py(
        [&](size_t k) {
          const at::Tensor& t = before.*(fields[k].second);
          return t.defined() ? t.unsafeGetTensorImpl() : nullptr;
        },
        s, state);
  });
  m.def("_optim_state_names", [] { return core::ParamState::names(); });
  m.def("_optim_loaded_entry", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                                  const std::string& name, const at::Tensor& value, const at::Tensor& p) {
    return guarded([&] { return core::loaded_entry(group_config(kind, optimizer, group, true), name, value, p); });
  });
  m.def("_blockwise8_quantize", [](const at::Tensor& values, bool is_signed) {
    return guarded([&] { return ampkit::blockwise8_quantize(values, is_signed); });
  });
  m.def("_blockwise8_dequantize", [](const at::Tensor& state, bool is_signed, const at::Tensor& like) {
    return guarded([&] { return ampkit::blockwise8_dequantize(state, is_signed, like); });
  });
}

}  // namespace ampkit::python
