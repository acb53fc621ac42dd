// ampkit._C's optimizer bridge for ampkit.optim: a Python param group as the core's core::GroupConfig, a state
// dict as a core::ParamState, and the core's checks, plan and step over them (ampkit::optim::core makes every
// decision, for the LibTorch optimizers too). The tensors of a step are borrowed, not referenced (NOTE [Borrowed
// tensor lists], NOTE [Borrowed states] in csrc/optim/borrowed_tensors.h).
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <cstring>
#include <functional>
#include <memory>
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

// A param-group value as an option's type (the conversions of ampkit.optim's spellings).
void from_py(const std::string&, const char*, const py::handle& v, double& out) { out = number(v); }
void from_py(const std::string&, const char*, const py::handle& v, bool& out) { out = v.cast<bool>(); }
void from_py(const std::string&, const char*, const py::handle& v, std::tuple<double&, double&> out) {
  const py::sequence betas = py::reinterpret_borrow<py::object>(v);
  out = std::make_tuple(number(betas[0]), number(betas[1]));
}
void from_py(const std::string& optimizer, const char* key, const py::handle& v, ampkit::optim::MasterWeights& out) {
  using ampkit::optim::MasterWeights;
  if (v.is_none()) {
    out = MasterWeights::kAuto;
    return;
  }
  if (PyBool_Check(v.ptr())) {
    out = MasterWeights(v.ptr() == Py_True);
    return;
  }
  if (py::isinstance<py::str>(v)) {
    const std::string name = v.cast<std::string>();
    for (const MasterWeights mode : {MasterWeights::remainder(), MasterWeights::stochastic(), MasterWeights::kahan()}) {
      if (name == mode.name()) {
        out = mode;
        return;
      }
    }
  }
  throw py::value_error(optimizer + ": " + key +
                        " must be None, True, False or one of 'remainder', 'stochastic', 'kahan', but got " +
                        std::string(py::repr(v)));
}
// A state dtype option (None: FP32); its range is the core's check.
void from_py(const std::string& optimizer, const char* key, const py::handle& v, at::ScalarType& out) {
  if (v.is_none()) {
    out = at::kFloat;
    return;
  }
  if (!THPDtype_Check(v.ptr())) {
    throw py::type_error(optimizer + ": " + key + " must be a torch.dtype (torch.float32, torch.bfloat16 or " +
                         "torch.uint8) or None, but got " + std::string(py::str(py::type::of(v).attr("__name__"))) +
                         " " + std::string(py::repr(v)));
  }
  out = reinterpret_cast<THPDtype*>(v.ptr())->scalar_type;
}

// The learning rate: a number, or a tensor (lr_tensor; lr is its value where it can be read on the host, for the
// core's range check).
void lr_from_py(const py::handle& v, core::GroupConfig& c) {
  if (THPVariable_Check(v.ptr())) {
    c.lr_tensor = THPVariable_Unpack(v.ptr());
    c.lr = c.lr_tensor.is_cpu() && c.lr_tensor.numel() == 1 ? c.lr_tensor.item<double>() : 0.0;
  } else {
    c.lr = number(v);
  }
}

// The group's value of one row (NOTE [Optimizer option table]) into its field: a param-group key (the row's default
// where the group, a constructor's partial one, lacks it), the write_unscaled_grads attribute, or nothing.
template <ampkit::optim::OptionPython kPython, typename T, typename Field>
void read_row(const std::string& optimizer, const py::dict& group, PyObject* key, const char* name,
              const T& default_value, bool write_unscaled_grads, Field&& field, core::GroupConfig& c) {
  using Python = ampkit::optim::OptionPython;
  if constexpr (kPython == Python::kAttribute) {
    field = write_unscaled_grads;
  } else if constexpr (kPython != Python::kNone) {
    PyObject* v = PyDict_GetItemWithError(group.ptr(), key);
    if (v == nullptr) {
      if (PyErr_Occurred() != nullptr) {
        throw py::error_already_set();
      }
      field = default_value;
    } else if constexpr (kPython == Python::kLr) {
      lr_from_py(v, c);
    } else {
      from_py(optimizer, name, v, field);
    }
  }
}

// A param-group key made once (an interned str, kept for the process).
PyObject* interned(const char* name) {
  PyObject* key = PyUnicode_InternFromString(name);  // NOLINT(cppcoreguidelines-owning-memory)
  if (key == nullptr) {
    throw py::error_already_set();
  }
  return key;
}

// One row's read; its key made once.
#define AMPKIT_GROUP_FIELD(T, name, default_, archive, python, field)                                              \
  {                                                                                                                \
    static PyObject* const key = interned(#name);                                                                  \
    read_row<ampkit::optim::OptionPython::python>(optimizer, group, key, #name, T(default_), write_unscaled_grads, \
                                                  c.field, c);                                                     \
  }
#define AMPKIT_GROUP_PY_FIELD(T, name, default_, field) AMPKIT_GROUP_FIELD(T, name, default_, kOptional, kGroup, field)

// The rows of an algorithm read from a group into `c` (kDecoupled: the Adam list's defaults, AdamW's or Adam's).
template <core::Algorithm kAlgorithm, bool kDecoupled = false>
void read_group(const std::string& optimizer, const py::dict& group, bool write_unscaled_grads, core::GroupConfig& c) {
  using betas_t = std::tuple<double, double>;
  using ampkit::optim::MasterWeights;
  c.optimizer = optimizer.c_str();
  c.algorithm = kAlgorithm;
  c.python_spelling = true;
  if constexpr (kAlgorithm == core::Algorithm::kAdam) {
    AMPKIT_ADAM_OPTIONS(AMPKIT_GROUP_FIELD, AMPKIT_GROUP_PY_FIELD)
  } else if constexpr (kAlgorithm == core::Algorithm::kSGD) {
    AMPKIT_SGD_OPTIONS(AMPKIT_GROUP_FIELD, AMPKIT_GROUP_PY_FIELD)
  } else {
    AMPKIT_LAMB_OPTIONS(AMPKIT_GROUP_FIELD, AMPKIT_GROUP_PY_FIELD)
    c.write_unscaled_grads = false;  // LAMB only reads the grads
  }
}

// A row's default as ampkit.optim spells it: None for an unset master_weights and for FP32 states.
py::object py_default(double v) { return py::float_(v); }
py::object py_default(bool v) { return py::bool_(v); }
py::object py_default(const std::tuple<double, double>& v) { return py::make_tuple(std::get<0>(v), std::get<1>(v)); }
py::object py_default(ampkit::optim::MasterWeights v) {
  return v == ampkit::optim::MasterWeights::kAuto ? py::none() : py::object(py::str(v.name()));
}
py::object py_default(at::ScalarType v) { return v == at::kFloat ? py::none() : py::cast(v); }
py::object py_default(const at::Tensor&) { return py::none(); }

const char* python_name(ampkit::optim::OptionPython p) {
  switch (p) {
    case ampkit::optim::OptionPython::kGroup:
      return "group";
    case ampkit::optim::OptionPython::kLr:
      return "lr";
    case ampkit::optim::OptionPython::kAttribute:
      return "attribute";
    default:
      return "none";
  }
}

// The state entry whose dtype a state dtype option's field picks (core::state_dtype), else None.
py::object state_entry(const std::string& field, bool sgd) {
  if (field == "exp_avg_dtype") {
    return py::str(sgd ? "momentum_buffer" : "exp_avg");
  }
  return field == "exp_avg_sq_dtype" ? py::object(py::str("exp_avg_sq")) : py::object(py::none());
}

// The option table of an optimizer ("Adam", "AdamW", "SGD", "LAMB") for Python: (name, default, python, archive,
// field, state entry) per row, in row order; a PY_ROW's archive is "python only".
#define AMPKIT_TABLE_ROW(T, name, default_, archive, python, field)                                               \
  rows.append(py::make_tuple(                                                                                     \
      #name, py_default(T(default_)), python_name(ampkit::optim::OptionPython::python),                           \
      ampkit::optim::OptionArchive::archive == ampkit::optim::OptionArchive::kRequired ? "required" : "optional", \
      #field, state_entry(#field, sgd)));
#define AMPKIT_TABLE_PY_ROW(T, name, default_, field) \
  rows.append(py::make_tuple(#name, py_default(T(default_)), "group", "python only", #field, state_entry(#field, sgd)));

template <bool kDecoupled>
py::list adam_table() {
  using betas_t = std::tuple<double, double>;
  using ampkit::optim::MasterWeights;
  constexpr bool sgd = false;
  py::list rows;
  AMPKIT_ADAM_OPTIONS(AMPKIT_TABLE_ROW, AMPKIT_TABLE_PY_ROW)
  return rows;
}

py::list option_table(const std::string& optimizer) {
  using betas_t = std::tuple<double, double>;
  using ampkit::optim::MasterWeights;
  py::list rows;
  if (optimizer == "Adam") {
    return adam_table<false>();
  }
  if (optimizer == "AdamW") {
    return adam_table<true>();
  }
  if (optimizer == "SGD") {
    constexpr bool sgd = true;
    AMPKIT_SGD_OPTIONS(AMPKIT_TABLE_ROW, AMPKIT_TABLE_PY_ROW)
    return rows;
  }
  TORCH_CHECK_VALUE(optimizer == "LAMB", "ampkit._C._optim_options: optimizer must be 'Adam', 'AdamW', 'SGD' or ",
                    "'LAMB', but got '", optimizer, "'");
  constexpr bool sgd = false;
  AMPKIT_LAMB_OPTIONS(AMPKIT_TABLE_ROW, AMPKIT_TABLE_PY_ROW)
  return rows;
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

// The states of a group's parameters, read from their dicts (a null object: none yet) for a step and written back:
// the states' plain tensors are borrowed where the core allows it (NOTE [Borrowed states] in
// csrc/optim/borrowed_tensors.h). Python code that could free a borrowed entry (a key's __hash__, a store into
// these dicts) runs only before the borrows are taken or after they are released.
class GroupStates {
 public:
  GroupStates(const core::GroupConfig& config, const std::vector<py::object>& dicts)
      : dicts_(dicts), states_(dicts.size(), !core::may_replace_entries(config)) {
    const auto* plain = reinterpret_cast<PyTypeObject*>(THPVariableClass);
    for (size_t i = 0; i < dicts.size(); ++i) {
      if (dicts[i]) {
        read_state(py::reinterpret_borrow<py::dict>(dicts[i]), [&](size_t k, PyObject* value, const at::Tensor& t) {
          states_.set(i, k, t, Py_TYPE(value) == plain);  // a subclass may hold its tensor elsewhere: referenced
        });
      }
    }
  }

  const std::vector<core::ParamState*>& pointers() const { return states_.pointers(); }

  // Writes into each dict the entries the step created or replaced; a parameter that had no dict and has a state
  // now gets a new one, in `made` (stored by the caller once the borrows are released).
  void write_back(std::vector<std::pair<size_t, py::dict>>& made) {
    for (size_t i = 0; i < dicts_.size(); ++i) {
      const auto before = [&](size_t k) { return states_.before(i, k); };
      if (dicts_[i]) {
        py::dict d = py::reinterpret_borrow<py::dict>(dicts_[i]);
        state_to_py(before, states_[i], d);
      } else if (!states_[i].empty()) {  // (an SGD parameter without momentum or master gets none)
        made.emplace_back(i, py::dict());
        state_to_py(before, states_[i], made.back().second);
      }
    }
  }

 private:
  const std::vector<py::object>& dicts_;
  core::BorrowedStates states_;
};

// Steps `params` (core::step) with the states `dicts` hold, then writes into each dict the entries the step created
// or replaced; `created(i, d)` is given the dict made for a parameter that had none and has a state now.
template <typename Created>
void step_with_states(const core::GroupConfig& config, at::TensorList params, const std::vector<py::object>& dicts,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                      const Created& created) {
  std::vector<std::pair<size_t, py::dict>> made;
  {
    GroupStates states(config, dicts);
    guarded([&] { core::step(config, params, states.pointers(), grad_scale, found_inf); });
    states.write_back(made);
  }
  for (const auto& [i, d] : made) {
    created(i, d);  // may run Python code (the key's __hash__): no borrow is held
  }
}

// A param group's parameters with a grad, read for a step (NOTE [Group steps from Python]): the tensors (borrowed,
// NOTE [Borrowed tensor lists]: `keys` holds their Python objects), their state dicts (a null object: none yet);
// `dtensor`: the group holds a DTensor parameter, and nothing more was read.
struct GroupScan {
  ampkit::detail::BorrowedTensors params;
  std::vector<py::object> keys;
  std::vector<py::object> dicts;
  bool dtensor = false;
};

// The scan's prefetch (NOTE [Metadata prefetch] in csrc/ops/checks.cpp) at item i of `list`: the object of item
// i + 16, the TensorImpl of item i + 8 (found in its object, prefetched 8 items earlier) and the autograd metadata,
// which holds the grad, of item i + 4 (found in its TensorImpl, prefetched 4 items earlier). Plain tensors only:
// another type's object is not read here.
void prefetch_scan(PyObject* list, Py_ssize_t i) {
  constexpr Py_ssize_t kAhead = 8;
  const Py_ssize_t n = PyList_GET_SIZE(list);
  if (i + 2 * kAhead < n) {
    __builtin_prefetch(PyList_GET_ITEM(list, i + 2 * kAhead));
  }
  if (i + kAhead < n && plain_type(PyList_GET_ITEM(list, i + kAhead)) >= 0) {
    __builtin_prefetch(THPVariable_Unpack(PyList_GET_ITEM(list, i + kAhead)).unsafeGetTensorImpl());
  }
  if (i + kAhead / 2 < n && plain_type(PyList_GET_ITEM(list, i + kAhead / 2)) >= 0) {
    const c10::AutogradMetaInterface* meta =
        THPVariable_Unpack(PyList_GET_ITEM(list, i + kAhead / 2)).unsafeGetTensorImpl()->autograd_meta();
    if (meta != nullptr) {
      __builtin_prefetch(meta);
      __builtin_prefetch(reinterpret_cast<const char*>(meta) + 64);
    }
  }
}

void scan_group(const std::string& optimizer, const py::dict& group, StateLookup& lookup, GroupScan& scan) {
  const py::object list = group["params"];
  if (!PyList_Check(list.ptr())) {
    throw py::type_error(optimizer + ".step: param_groups[i]['params'] must be a list, but got " +
                         std::string(py::str(py::type::of(list))));
  }
  const Py_ssize_t n = PyList_GET_SIZE(list.ptr());
  scan.params.reserve(n);
  scan.keys.reserve(n);
  scan.dicts.reserve(n);
  const py::object& dtensor = dtensor_type();
  // Two passes over the parameters (NOTE [One pass per parameter] in csrc/ops/checks.cpp): this one reads each
  // one's type, grad and state dict, and is the only one that may run Python code (an isinstance, a subclass's
  // __hash__); the step then borrows the states' entries (NOTE [Borrowed states]).
  // The list's size is read on every iteration: Python code may change it.
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list.ptr()); ++i) {
    prefetch_scan(list.ptr(), i);
    PyObject* item = PyList_GET_ITEM(list.ptr(), i);
    // The plain tensor class it is an instance of (-1: none), tested first: isinstance costs several times more.
    const int plain = plain_type(item);
    if (!dtensor.is_none() && plain < 0) {
      const int is = PyObject_IsInstance(item, dtensor.ptr());
      if (is < 0) {
        throw py::error_already_set();
      }
      if (is == 1) {
        scan.dtensor = true;
        return;
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
    scan.params.push_back(p);
    scan.keys.push_back(std::move(key));
    scan.dicts.push_back(d != nullptr ? py::reinterpret_borrow<py::object>(d) : py::object());
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

// NOTE [The bound optimizer core]
// ampkit.optim reaches the C++ core through one object per optimizer class, _C.OptimizerCore(optimizer, name):
// `optimizer` names the option table it reads ('Adam', 'AdamW', 'SGD', 'LAMB': the algorithm and its defaults),
// `name` the optimizer in errors (the class's name). Its methods take a param group (a dict with torch.optim's
// keys, read through the option table, NOTE [Optimizer option table]; a key the group lacks takes the table's
// default) and make the core's decisions on it. What needs no group (whether the kernels take a parameter,
// remainders, masters, the entries' names) are static methods.
struct OptimizerCore {
  std::string optimizer;  // the table: "Adam", "AdamW", "SGD", "LAMB"
  std::string name;
  core::Algorithm algorithm = core::Algorithm::kAdam;
  bool decoupled = false;  // AdamW's defaults

  static OptimizerCore make(const std::string& optimizer, const std::string& name) {
    OptimizerCore self{optimizer, name};
    if (optimizer == "SGD") {
      self.algorithm = core::Algorithm::kSGD;
    } else if (optimizer == "LAMB") {
      self.algorithm = core::Algorithm::kLamb;
    } else {
      TORCH_CHECK_VALUE(optimizer == "Adam" || optimizer == "AdamW", "ampkit._C.OptimizerCore: optimizer must be ",
                        "'Adam', 'AdamW', 'SGD' or 'LAMB', but got '", optimizer, "'");
      self.decoupled = optimizer == "AdamW";
    }
    return self;
  }

  const char* algorithm_name() const {
    return algorithm == core::Algorithm::kSGD ? "sgd" : algorithm == core::Algorithm::kLamb ? "lamb" : "adam";
  }

  core::GroupConfig config(const py::dict& group, bool write_unscaled_grads = true) const {
    return guarded([&] {
      core::GroupConfig c;
      if (algorithm == core::Algorithm::kSGD) {
        read_group<core::Algorithm::kSGD>(name, group, write_unscaled_grads, c);
      } else if (algorithm == core::Algorithm::kLamb) {
        read_group<core::Algorithm::kLamb>(name, group, write_unscaled_grads, c);
      } else if (decoupled) {
        read_group<core::Algorithm::kAdam, true>(name, group, write_unscaled_grads, c);
      } else {
        read_group<core::Algorithm::kAdam, false>(name, group, write_unscaled_grads, c);
      }
      return c;
    });
  }
};

constexpr const char* kCoreDoc =
    "The C++ core of an ampkit optimizer (NOTE [The bound optimizer core]): optimizer 'Adam', 'AdamW', 'SGD' or "
    "'LAMB' (the option table it reads); name: the optimizer's name in errors.";

void bind_optim(py::module_& m) {
  m.def(
      "_optim_options", [](const std::string& optimizer) { return guarded([&] { return option_table(optimizer); }); },
      py::arg("optimizer"),
      "The option table of an ampkit optimizer ('Adam', 'AdamW', 'SGD', 'LAMB'): (name, default, python, archive, "
      "field, state entry) per option, in order (NOTE [Optimizer option table] in ampkit/optim_options.h).");
  py::class_<OptimizerCore> cls(m, "OptimizerCore", kCoreDoc);
  cls.def(py::init([](const std::string& optimizer, const std::string& name) {
            return guarded([&] { return OptimizerCore::make(optimizer, name); });
          }),
          py::arg("optimizer"), py::arg("name"));
  cls.def_readonly("optimizer", &OptimizerCore::optimizer);
  cls.def_readonly("name", &OptimizerCore::name);
  cls.def_property_readonly("algorithm", &OptimizerCore::algorithm_name, "'adam', 'sgd' or 'lamb'.");
  cls.def(
      "check_config",
      [](const OptimizerCore& self, const py::dict& group) {
        guarded([&] { core::check_config(self.config(group)); });
      },
      py::arg("group"), "torch.optim's range checks of the group's options (ValueError).");
  cls.def(
      "check",
      [](const OptimizerCore& self, const py::dict& group, const std::vector<at::Tensor>& params) {
        const core::GroupConfig config = self.config(group);
        guarded([&] { core::check_group(config, params); });
      },
      py::arg("group"), py::arg("params"),
      "Checks the group's options and every parameter with a grad, writing nothing (core::check_group).");
  cls.def(
      "step",
      [](const OptimizerCore& self, const py::dict& group, const std::vector<at::Tensor>& params,
         const std::vector<py::dict>& states, const std::optional<at::Tensor>& grad_scale,
         const std::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
         const std::optional<at::Tensor>& grad_norm) {
        core::GroupConfig config = self.config(group, write_unscaled_grads);
        if (grad_norm.has_value()) {
          config.grad_norm = *grad_norm;
        }
        const std::vector<py::object> dicts(states.begin(), states.end());
        step_with_states(config, params, dicts, grad_scale, found_inf, [](size_t, const py::dict&) {});
      },
      py::arg("group"), py::arg("params"), py::arg("states"), py::arg("grad_scale"), py::arg("found_inf"),
      py::arg("write_unscaled_grads"), py::arg("grad_norm"),
      "One step of `params` (each with a grad) with their state dicts `states`, completed in place.");
  // Every group's step (NOTE [The policy across groups] in ampkit/optim_core.h), with the lists assembled here
  // (NOTE [Group steps from Python]): `state` is the optimizer's state mapping (a dict: parameter -> dict of
  // entries); states the step creates are added to it. A group of DTensor parameters, or with differentiable=True,
  // is the caller's: check_own(i) checks group i before any group is written, step_own(i, grad_norm) steps it in
  // its turn (touching no other group's states). global_norm() (None: the core's) gives LAMB's clipping norm.
  // Returns the norm the groups were clipped with (None: none).
  cls.def(
      "step_groups",
      [](const OptimizerCore& self, const py::list& param_groups, const py::dict& state,
         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
         bool write_unscaled_grads, const py::object& check_own, const py::object& step_own,
         const py::object& global_norm) -> std::optional<at::Tensor> {
        // NOTE [Group steps from Python]
        // ampkit.optim's step over thousands of small parameters spent a third of its time building Python lists
        // (the parameters with a grad, their states) and converting them. Here the parameters' grads are read from
        // the C++ tensors, states looked up in the optimizer's dict (dict.get: no default entry is created) and
        // read in place; only the entries the step creates or replaces are written back.
        const size_t n = param_groups.size();
        std::vector<core::GroupStep> steps(n);
        std::vector<GroupScan> scans(n);
        StateLookup lookup(state.ptr());
        static PyObject* const differentiable = interned("differentiable");
        for (size_t g = 0; g < n; ++g) {
          const py::object item = param_groups[g];
          if (!PyDict_Check(item.ptr())) {
            throw py::type_error(self.name + ".step: param_groups[" + std::to_string(g) + "] must be a dict, but got " +
                                 std::string(py::str(py::type::of(item))));
          }
          const py::dict group = py::reinterpret_borrow<py::dict>(item);
          steps[g].config = self.config(group, write_unscaled_grads);
          PyObject* d = PyDict_GetItemWithError(group.ptr(), differentiable);
          if (d == nullptr && PyErr_Occurred() != nullptr) {
            throw py::error_already_set();
          }
          const int own = d == nullptr ? 0 : PyObject_IsTrue(d);
          if (own < 0) {
            throw py::error_already_set();
          }
          if (own == 0) {
            scan_group(self.name, group, lookup, scans[g]);
          }
          if (own == 1 || scans[g].dtensor) {
            steps[g].check = [&check_own, g] { check_own(g); };
            steps[g].step = [&step_own, g](const at::Tensor& norm) {
              step_own(g, norm.defined() ? py::cast(norm) : py::object(py::none()));
            };
          }
        }
        std::function<at::Tensor()> norm_of;
        if (!global_norm.is_none()) {
          norm_of = [&global_norm] { return global_norm().cast<at::Tensor>(); };
        }
        std::vector<std::vector<std::pair<size_t, py::dict>>> made(n);
        at::Tensor norm;
        {
          std::vector<std::unique_ptr<GroupStates>> states(n);
          for (size_t g = 0; g < n; ++g) {
            if (!steps[g].step) {
              states[g] = std::make_unique<GroupStates>(steps[g].config, scans[g].dicts);
              steps[g].params = scans[g].params;
              steps[g].states = states[g]->pointers();
            }
          }
          norm = guarded([&] { return core::step_groups(steps, grad_scale, found_inf, norm_of); });
          for (size_t g = 0; g < n; ++g) {
            if (states[g]) {
              states[g]->write_back(made[g]);
            }
          }
        }
        for (size_t g = 0; g < n; ++g) {  // may run Python code (the keys' __hash__): no borrow is held
          for (const auto& [i, d] : made[g]) {
            if (PyDict_SetItem(state.ptr(), scans[g].keys[i].ptr(), d.ptr()) != 0) {
              throw py::error_already_set();
            }
          }
        }
        return norm.defined() ? std::optional<at::Tensor>(norm) : std::nullopt;
      },
      py::arg("param_groups"), py::arg("state"), py::arg("grad_scale"), py::arg("found_inf"),
      py::arg("write_unscaled_grads"), py::arg("check_own"), py::arg("step_own"), py::arg("global_norm"),
      "Every group's step over the optimizer's state mapping (NOTE [The policy across groups]); returns the global "
      "grad norm the groups were clipped with, or None.");
  // The core's plan of a group's step (core::plan_step), for a compiled step (NOTE [Compiled steps] in
  // ampkit/_compile.py): `grads` one tensor or None per parameter (what the step will read; a trace passes meta
  // tensors of the traced grads' layout), `states` one dict or None. Returns (params, buckets): for each parameter
  // with a grad (index, master mode, fused, staged, the names of the entries to create, the first step, whether
  // its remainder is made from a loaded master); for each fused call (master mode, the names of the entries it
  // reads, positions in params).
  cls.def(
      "plan",
      [](const OptimizerCore& self, const py::dict& group, const std::vector<at::Tensor>& params,
         const std::vector<std::optional<at::Tensor>>& grads, const std::vector<std::optional<py::dict>>& states) {
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
        const core::GroupConfig config = self.config(group);
        const core::StepPlan plan = guarded([&] { return core::plan_step(config, params, pointers, grad_list); });
        py::list out_params;
        for (const auto& e : plan.params) {
          out_params.append(py::make_tuple(e.index, mode_name(e.mode), e.fused, e.staged,
                                           core::StepPlan::entry_names(e.missing), e.first_step,
                                           e.remainder_from_master));
        }
        py::list out_buckets;
        for (const auto& b : plan.buckets) {
          out_buckets.append(py::make_tuple(mode_name(b.mode), core::StepPlan::entry_names(b.reads), b.params));
        }
        return py::make_tuple(out_params, out_buckets);
      },
      py::arg("group"), py::arg("params"), py::arg("grads"), py::arg("states"),
      "The plan of a group's step (core::plan_step): (params, buckets).");
  cls.def(
      "takes_master",
      [](const OptimizerCore& self, const py::dict& group) {
        const core::GroupConfig config = self.config(group);
        return guarded([&] { return core::takes_master(config); });
      },
      py::arg("group"), "Whether init_master_params gives the group's parameters FP32 masters.");
  cls.def(
      "check_loaded_state",
      [](const OptimizerCore& self, const py::dict& group, const std::string& where, const at::Tensor& p,
         const std::vector<std::pair<std::string, at::Tensor>>& entries) {
        const core::GroupConfig config = self.config(group);
        guarded([&] { core::check_loaded_state(config, where, p, entries); });
      },
      py::arg("group"), py::arg("where"), py::arg("param"), py::arg("entries"),
      "Checks a loaded state's (name, tensor) entries for `param`; `where` names it in errors (ValueError).");
  cls.def(
      "loaded_entry",
      [](const OptimizerCore& self, const py::dict& group, const std::string& name, const at::Tensor& value,
         const at::Tensor& p) {
        const core::GroupConfig config = self.config(group);
        return guarded([&] { return core::loaded_entry(config, name, value, p); });
      },
      py::arg("group"), py::arg("name"), py::arg("value"), py::arg("param"),
      "A loaded entry as the step keeps it, in the group's state dtypes (core::loaded_entry).");
  cls.def(
      "state_lists",
      [](const OptimizerCore& self) {
        const core::Algorithm algorithm = self.algorithm;
        py::dict list_of;
        for (const core::EntryList& e : core::entry_lists(algorithm)) {
          for (const auto& [name, field] : core::ParamState::fields()) {
            if (field == e.field) {
              list_of[py::str(name)] = core::op_list_name(algorithm, e.list);
            }
          }
        }
        py::list lists;
        for (int l = 0; l <= static_cast<int>(core::OpList::kSteps); ++l) {
          if (const char* name = core::op_list_name(algorithm, static_cast<core::OpList>(l))) {
            lists.append(name);
          }
        }
        return py::make_tuple(list_of, py::tuple(lists));
      },
      "(the op list of each state entry, the op's state lists): NOTE [State lists of the fused ops].");
  cls.def_static(
      "takes_fused", [](const at::Tensor& p) { return core::takes_fused(p, p); }, py::arg("param"),
      "Whether the fused kernels take this parameter (else torch.optim's single-tensor formulas).");
  cls.def_static(
      "remainder_of",
      [](const at::Tensor& p, const at::Tensor& master) {
        return guarded([&] { return core::remainder_of(p, master); });
      },
      py::arg("param"), py::arg("master"), "The int16 remainder that, with the BF16 weight, holds the FP32 master.");
  cls.def_static(
      "master_from_remainder",
      [](const at::Tensor& p, const at::Tensor& rem) {
        return guarded([&] { return core::master_from_remainder(p, rem); });
      },
      py::arg("param"), py::arg("remainder"), "The exact FP32 master held by a BF16 weight and its int16 remainder.");
  cls.def_static(
      "init_master",
      [](const at::Tensor& p, py::dict state) {
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
      },
      py::arg("param"), py::arg("state"), "Gives the parameter's state dict an FP32 master copied from its value.");
  cls.def_static(
      "state_names", [] { return core::ParamState::names(); }, "The names of a state's entries (torch.optim's).");
  m.def("_blockwise8_quantize", [](const at::Tensor& values, bool is_signed) {
    return guarded([&] { return ampkit::blockwise8_quantize(values, is_signed); });
  });
  m.def("_blockwise8_dequantize", [](const at::Tensor& state, bool is_signed, const at::Tensor& like) {
    return guarded([&] { return ampkit::blockwise8_dequantize(state, is_signed, like); });
  });
}

}  // namespace ampkit::python
