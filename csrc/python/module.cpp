// The pybind11 module ampkit._C: assembles the component bindings (bind_scaler.cpp, bind_autocast.cpp,
// bind_monitor.cpp; shared helpers in binding.h) and holds, for now, the optimizer bridge of ampkit.optim (Python
// groups to core::GroupConfig, borrowed states) and the GradientAllReduce binding. The ops reach Python through
// the dispatcher (torch.ops.ampkit.*), registered when this module's dependency libampkit is loaded.
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <cstring>
#include <tuple>

#include "ampkit/ampkit.h"
#include "../optim/borrowed_tensors.h"
#include "binding.h"
#include "tensor_hparams.h"

namespace py = pybind11;

namespace {

using ampkit::python::GilFreeDelete;
using ampkit::python::guarded;

// NOTE [State lookups by known hash]
// torch.Tensor.__hash__ is a Python method (`return id(self)`), so a dict lookup keyed by a parameter calls into
// the interpreter: about 60 ns, a tenth of a step's time per parameter of a small tensor. The hash of a plain
// tensor (torch.Tensor, nn.Parameter; subclasses may define their own) is its address, as CPython turns the int
// __hash__ returns into the hash, so the group step looks states up by that hash, once the call's first
// parameter of that class has shown that its hash is its address (otherwise, and for other types, by the
// ordinary lookup).
class StateLookup {
 public:
  StateLookup(PyObject* dict, const py::tuple& plain_types)
      : dict_(dict), known_(static_cast<size_t>(PyTuple_GET_SIZE(plain_types.ptr())), -1) {}

  // state.get(item) (borrowed; nullptr and no error when absent); `plain`: the index of item's exact type in
  // plain_types, -1 for another type.
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

// The index of item's exact type in `types` (a tuple of classes), or -1.
int plain_type(PyObject* item, const py::tuple& types) {
  for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(types.ptr()); ++t) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(item)) == PyTuple_GET_ITEM(types.ptr(), t)) {
      return static_cast<int>(t);
    }
  }
  return -1;
}






namespace core = ampkit::optim::core;

double number(const py::handle& v) { return ampkit::python::hparam_value(v); }  // tensor betas: tensor_hparams.h

// group[key], or `fallback` where the group (a constructor's partial one) has no such key.
py::object get(const py::dict& group, const char* key, py::object fallback) {
  return group.contains(key) ? py::object(group[key]) : std::move(fallback);
}

// A param group of ampkit.optim (a dict with torch.optim's keys) as the core's config; `optimizer` must outlive it.
core::GroupConfig group_config(const std::string& kind, const std::string& optimizer, const py::dict& group,
                               bool write_unscaled_grads) {
  TORCH_CHECK_VALUE(kind == "adam" || kind == "sgd" || kind == "lamb", "ampkit.optim: unknown algorithm '", kind,
                    "'");
  core::GroupConfig c;
  c.optimizer = optimizer.c_str();
  c.algorithm = kind == "sgd" ? core::Algorithm::kSGD : kind == "lamb" ? core::Algorithm::kLamb : core::Algorithm::kAdam;
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
  if (c.algorithm == core::Algorithm::kLamb) {
    const py::object yes = py::bool_(true);
    const py::sequence betas = group["betas"];
    c.beta1 = number(betas[0]);
    c.beta2 = number(betas[1]);
    c.eps = number(group["eps"]);
    c.decoupled_weight_decay = get(group, "adam_w_mode", yes).cast<bool>();
    c.bias_correction = get(group, "bias_correction", yes).cast<bool>();
    c.grad_averaging = get(group, "grad_averaging", yes).cast<bool>();
    c.use_nvlamb = get(group, "use_nvlamb", no).cast<bool>();
    c.max_grad_norm = number(get(group, "max_grad_norm", zero));
  } else if (c.algorithm == core::Algorithm::kAdam) {
    const py::sequence betas = group["betas"];
    c.beta1 = number(betas[0]);
    c.beta2 = number(betas[1]);
    c.eps = number(group["eps"]);
    c.amsgrad = get(group, "amsgrad", no).cast<bool>();
    c.decoupled_weight_decay = get(group, "decoupled_weight_decay", no).cast<bool>();
  } else {
    c.momentum = number(get(group, "momentum", zero));
    c.dampening = number(get(group, "dampening", zero));
    c.nesterov = get(group, "nesterov", no).cast<bool>();
  }
  const py::object mw = group.contains("master_weights") ? py::object(group["master_weights"]) : py::none();
  if (mw.is_none()) {
    c.master_weights = ampkit::optim::MasterWeights::kAuto;
  } else if (py::isinstance<py::str>(mw)) {
    c.master_weights = mw.cast<std::string>() == "remainder" ? ampkit::optim::MasterWeights::kRemainder
                                                               : ampkit::optim::MasterWeights::kAuto;
  } else {
    c.master_weights = ampkit::optim::MasterWeights(mw.cast<bool>());
  }
  c.write_unscaled_grads = write_unscaled_grads;
  c.python_spelling = true;
  return c;
}

// A state dict entry of ampkit.optim (torch.optim's names; None or absent: no entry) to the core's, and back.
// `borrowed` (one flag per ParamState::fields() entry): the plain tensors are borrowed (NOTE [Borrowed states])
// instead of referenced, and their flags set.
core::ParamState state_from_py(const py::dict& d, uint8_t* borrowed = nullptr) {
  // One walk over the dict's few entries (no key objects built per parameter: this runs for every parameter of
  // every step).
  // (name, its length, member) of every entry: compared by length first, no std::string built.
  static const auto fields = [] {
    std::vector<std::tuple<const char*, size_t, core::ParamState::Field>> f;
    for (const auto& [name, field] : core::ParamState::fields()) {
      f.emplace_back(name, std::strlen(name), field);
    }
    return f;
  }();
  core::ParamState s;
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
      const auto& [entry, length, field] = fields[k];
      if (static_cast<size_t>(size) == length && std::memcmp(name, entry, length) == 0) {
        const at::Tensor& t = THPVariable_Unpack(value);
        if (borrowed != nullptr && Py_TYPE(value) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
          s.*field = c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t);
          borrowed[k] = 1;
        } else {
          s.*field = t;
        }
        break;
      }
    }
  }
  return s;
}

// The TensorImpl of each entry of `s` (nullptr: absent), in ParamState::fields() order: what a state held before
// a step, without a reference.
void entry_impls(const core::ParamState& s, const c10::TensorImpl** out) {
  for (const auto& [name, field] : core::ParamState::fields()) {
    const at::Tensor& t = s.*field;
    *out++ = t.defined() ? t.unsafeGetTensorImpl() : nullptr;
  }
}

// Writes into `d` the entries of `after` that are new or replaced since `before` (entry_impls), and deletes the
// entries it no longer has.
void state_to_py(const c10::TensorImpl* const* before, const core::ParamState& after, py::dict& d) {
  for (const auto& [name, field] : core::ParamState::fields()) {
    const c10::TensorImpl* old = *before++;
    const at::Tensor& now = after.*field;
    if (now.defined() && now.unsafeGetTensorImpl() != old) {
      d[py::str(name)] = now;
    } else if (!now.defined() && old != nullptr) {
      PyDict_DelItemString(d.ptr(), name);
    }
  }
}


// NOTE [update_scale_ by position]
// ampkit.ops.update_scale_ runs once per iteration, on three one-element tensors: through torch.ops its call costs
// twice torch._amp_update_scale_'s (the schema-driven argument parsing and boxing of torch.ops). This binding
// takes the arguments by position (METH_FASTCALL, no keyword parsing), checks their types as torch.ops would
// (TypeError naming the argument) and calls the op through the dispatcher, unboxed: the same kernel and checks.
// Tensor subclasses and torch function modes go through torch.ops; under torch.compile the Python wrapper calls
// torch.ops itself.
PyObject* update_scale_by_position(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  static const char* const names[] = {"scale", "growth_tracker", "found_inf", "growth_factor", "backoff_factor",
                                      "growth_interval"};
  if (nargs != 6) {
    PyErr_Format(PyExc_TypeError, "ampkit.ops.update_scale_() takes 6 positional arguments but %zd were given",
                 nargs);
    return nullptr;
  }
  bool plain = !at::impl::torch_function_mode_enabled();
  for (int i = 0; i < 3; ++i) {
    if (!THPVariable_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "ampkit.ops.update_scale_(): argument '%s' must be a Tensor, not %s", names[i],
                   Py_TYPE(args[i])->tp_name);
      return nullptr;
    }
    plain = plain && Py_TYPE(args[i]) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
  }
  if (!plain) {  // tensor subclasses and torch function modes: torch.ops, which gives them their say
    static PyObject* op = nullptr;
    if (op == nullptr) {
      op = py::object(py::module_::import("torch").attr("ops").attr("ampkit").attr("update_scale_")).release().ptr();
    }
    return PyObject_Vectorcall(op, args, static_cast<size_t>(nargs), nullptr);
  }
  double factors[2];
  for (int i = 0; i < 2; ++i) {
    PyObject* a = args[3 + i];
    if (!PyFloat_Check(a) && !PyLong_Check(a)) {
      PyErr_Format(PyExc_TypeError, "ampkit.ops.update_scale_(): argument '%s' must be a float, not %s",
                   names[3 + i], Py_TYPE(a)->tp_name);
      return nullptr;
    }
    factors[i] = PyFloat_AsDouble(a);
    if (factors[i] == -1.0 && PyErr_Occurred()) {
      return nullptr;
    }
  }
  if (!PyLong_Check(args[5]) || PyBool_Check(args[5])) {
    PyErr_Format(PyExc_TypeError, "ampkit.ops.update_scale_(): argument 'growth_interval' must be an int, not %s",
                 Py_TYPE(args[5])->tp_name);
    return nullptr;
  }
  const long long interval = PyLong_AsLongLong(args[5]);
  if (interval == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  ampkit::update_scale_(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]),
                        factors[0], factors[1], static_cast<int64_t>(interval));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef positional_methods[] = {
    {"_update_scale_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(update_scale_by_position)),
     METH_FASTCALL,
     "update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval): "
     "torch.ops.ampkit.update_scale_ by position (NOTE [update_scale_ by position])."},
    {nullptr, nullptr, 0, nullptr}};

// Steps `params` (core::step) with the states `dicts` hold (a null object: none yet), then writes into each dict
// the entries the step created or replaced; `created(i, d)` is given the dict made for a parameter that had none
// and has a state now.
template <typename Created>
void step_with_states(const core::GroupConfig& config, at::TensorList params, const std::vector<py::object>& dicts,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                      const Created& created) {
  const auto& fields = core::ParamState::fields();
  // NOTE [Borrowed states]
  // The states' tensors are borrowed from the state dicts (which the caller holds) as the parameters are: a
  // reference to a tensor Python holds costs a GIL round trip each way, three or four per parameter here. A
  // borrowed entry must never be assigned over (the assignment would drop a reference never taken): the core only
  // fills entries a state lacks, except when it turns a master into BF16 + remainder, so groups whose
  // master_weights is "remainder" take references. `Release` gives the borrowed entries back unreferenced on
  // every exit; an entry the core replaced would already have lost a reference it never had, so that stops the
  // process (an internal assert in a destructor) rather than go on with a tensor freed under Python. Python code
  // that could free a state (a key's __hash__) runs only before the borrows are taken or after they are released;
  // writing back the entries the step created stores str-keyed items into the dicts the caller holds.
  const bool borrow = config.master_weights != ampkit::optim::MasterWeights::kRemainder;
  std::vector<std::pair<size_t, py::dict>> made;  // the dicts made for parameters that had no state
  {
    // Room for every state first: they never move (Release reads them where they were borrowed into).
    std::vector<core::ParamState> states;
    states.reserve(dicts.size());
    // The entries each state had (their TensorImpls, compared after the step; no reference taken).
    std::vector<const c10::TensorImpl*> before(dicts.size() * fields.size(), nullptr);
    std::vector<uint8_t> borrowed(dicts.size() * fields.size(), 0);
    struct Release {
      std::vector<core::ParamState>& states;
      const std::vector<const c10::TensorImpl*>& before;
      const std::vector<uint8_t>& borrowed;
      const std::vector<std::pair<const char*, core::ParamState::Field>>& fields;
      ~Release() {
        for (size_t i = 0; i < states.size(); ++i) {
          for (size_t k = 0; k < fields.size(); ++k) {
            if (borrowed[i * fields.size() + k] != 0) {
              at::Tensor& t = states[i].*(fields[k].second);
              TORCH_INTERNAL_ASSERT(t.unsafeGetTensorImpl() == before[i * fields.size() + k],
                                    "ampkit: a borrowed optimizer state entry was replaced");
              t.unsafeReleaseTensorImpl();  // unreferenced: borrowed
            }
          }
        }
      }
    } release{states, before, borrowed, fields};
    for (size_t k = 0; k < dicts.size(); ++k) {
      states.push_back(dicts[k] ? state_from_py(py::reinterpret_borrow<py::dict>(dicts[k]),
                                                borrow ? &borrowed[k * fields.size()] : nullptr)
                                : core::ParamState());
      entry_impls(states[k], &before[k * fields.size()]);
    }
    std::vector<core::ParamState*> ptrs;
    ptrs.reserve(states.size());
    for (auto& st : states) {
      ptrs.push_back(&st);
    }
    guarded([&] { core::step(config, params, ptrs, grad_scale, found_inf); });
    for (size_t i = 0; i < states.size(); ++i) {
      if (dicts[i]) {
        py::dict d = py::reinterpret_borrow<py::dict>(dicts[i]);
        state_to_py(&before[i * fields.size()], states[i], d);
      } else if (!states[i].empty()) {  // (an SGD parameter without momentum or master gets none)
        made.emplace_back(i, py::dict());
        state_to_py(&before[i * fields.size()], states[i], made.back().second);
      }
    }
  }
  for (const auto& [i, d] : made) {
    created(i, d);  // may run Python code (the key's __hash__): no borrow is held
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ampkit C++ core";
  if (PyModule_AddFunctions(m.ptr(), positional_methods) != 0) {
    throw py::error_already_set();
  }
  m.def(
      "build_info",
      []() {
        const ampkit::BuildInfo info = ampkit::build_info();
        py::dict d;
        d["cuda_compiled"] = info.cuda_compiled;
        d["cuda_archs"] = std::string(info.cuda_archs);
        d["cpu_isa"] = std::string(info.cpu_isa);
        d["torch_version"] = std::string(info.torch_version);
        d["cpu_optim_tail_width"] = info.cpu_optim_tail_width;
        return d;
      },
      "What this build contains: CUDA kernels compiled and for which architectures, the CPU loops' instruction "
      "set on this machine, the torch version it was built against, and the scalar-tail width of the CPU "
      "optimizer steps (that of torch's fused CPU kernels: 8 under AVX2 and AVX-512).");
  m.def("cuda_arch_supported", &ampkit::cuda_arch_supported, py::arg("major"), py::arg("minor"),
        "Whether this build's CUDA kernels run on a GPU of compute capability major.minor.");


  // ampkit::distributed::GradientAllReduce, for ampkit.distributed.GradientAllReduce. Destroyed without the GIL:
  // dropping the last reference to a Gloo process group joins its worker thread, which may need the GIL to free
  // Python state of finished work.
  py::class_<ampkit::distributed::GradientAllReduce, GilFreeDelete<ampkit::distributed::GradientAllReduce>::Ptr>(
      m, "GradientAllReduce")
      .def(py::init([](std::vector<at::Tensor> params, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const std::string& compression, int64_t bucket_bytes, bool overlap,
                       ampkit::GradScaler* scaler) {
             using ampkit::distributed::Compression;
             TORCH_CHECK_VALUE(compression == "none" || compression == "fp16" || compression == "bf16",
                               "GradientAllReduce: compression must be None, 'fp16' or 'bf16', but got '",
                               compression, "'");
             const Compression c = compression == "fp16"   ? Compression::kFP16
                                    : compression == "bf16" ? Compression::kBF16
                                                            : Compression::kNone;
             return guarded([&] {
               return GilFreeDelete<ampkit::distributed::GradientAllReduce>::Ptr(new ampkit::distributed::GradientAllReduce(
                   std::move(params), group,
                   ampkit::distributed::GradientAllReduceOptions().compression(c).bucket_bytes(bucket_bytes).overlap(
                       overlap),
                   scaler));
             });
           }),
           py::arg("params"), py::arg("process_group"), py::arg("compression"), py::arg("bucket_bytes"),
           py::arg("overlap"), py::arg("scaler").none(true), py::keep_alive<1, 7>())
      .def("synchronize",
           [](ampkit::distributed::GradientAllReduce& g) {
             guarded([&] {
               const py::gil_scoped_release release;  // waits on the process group
               g.synchronize();
             });
           })
      .def("set_require_sync", &ampkit::distributed::GradientAllReduce::set_require_sync)
      .def("require_sync", &ampkit::distributed::GradientAllReduce::require_sync)
      .def("bucket_indices", &ampkit::distributed::GradientAllReduce::bucket_indices)
      .def("bytes_reduced", &ampkit::distributed::GradientAllReduce::bytes_reduced)
      .def("allreduces", &ampkit::distributed::GradientAllReduce::allreduces);

  // ampkit.optim's decisions, made by ampkit::optim::core (the LibTorch optimizers' too).
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
  // having done nothing, for a group with DTensor parameters (instances of `dtensor_type`).
  m.def("_optim_step_group", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                                const py::dict& state, const std::optional<at::Tensor>& grad_scale,
                                const std::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                                const std::optional<at::Tensor>& grad_norm, const py::tuple& plain_types,
                                const py::object& dtensor_type) {
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
    StateLookup lookup(state.ptr(), plain_types);
    // Two passes over the parameters (NOTE [One pass per parameter] in csrc/ops/checks.cpp): this one reads each
    // one's type, grad and state dict, and is the only one that may run Python code (an isinstance, a subclass's
    // __hash__); step_with_states then borrows the states' entries (NOTE [Borrowed states]).
    // The list's size is read on every iteration: Python code may change it.
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list.ptr()); ++i) {
      PyObject* item = PyList_GET_ITEM(list.ptr(), i);
      // The plain tensor class it is an instance of (-1: none), tested first: isinstance costs several times more.
      const int plain = plain_type(item, plain_types);
      // A DTensor parameter (FSDP2): False, nothing done; the caller steps the local shards.
      if (!dtensor_type.is_none() && plain < 0) {
        const int is = PyObject_IsInstance(item, dtensor_type.ptr());
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
  m.def("_optim_global_grad_norm", [](const std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& scale) {
    return guarded([&] { return core::global_grad_norm(grads, scale); });
  });
  // The master mode ("none", "master", "remainder") the core gives a parameter of `dtype` ("float16", "bfloat16",
  // "float32") in `group`, for a compiled step's plan (NOTE [Compiled steps] in ampkit/_compile.py), which checks
  // the group's options itself; ValueError where master_weights refuses the dtype.
  m.def("_optim_master_mode", [](const std::string& kind, const std::string& optimizer, const py::dict& group,
                                 const std::string& dtype) {
    return guarded([&] {
      const core::GroupConfig c = group_config(kind, optimizer, group, true);
      const at::ScalarType type = dtype == "float16" ? at::kHalf : dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
      TORCH_CHECK_VALUE(type != at::kFloat || dtype == "float32", optimizer, ": no fused kernel for ", dtype);
      const auto mode = core::master_mode(c, at::empty({0}, at::TensorOptions().dtype(type).device(at::kMeta)));
      return std::string(mode == core::MasterMode::kMaster      ? "master"
                         : mode == core::MasterMode::kRemainder ? "remainder"
                                                                 : "none");
    });
  });
  m.def("_optim_takes_fused", [](const at::Tensor& p) { return core::takes_fused(p, p); });
  m.def("_optim_remainder_of",
        [](const at::Tensor& p, const at::Tensor& master) { return guarded([&] { return core::remainder_of(p, master); }); });
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
    std::vector<const c10::TensorImpl*> before(core::ParamState::fields().size());
    entry_impls(s, before.data());
    guarded([&] { core::init_master(p, s); });
    state_to_py(before.data(), s, state);
  });
  m.def("_optim_state_names", [] { return core::ParamState::names(); });
  m.def("_optim_loaded_entry", [](const std::string& name, const at::Tensor& value, const at::Tensor& p) {
    return guarded([&] { return core::loaded_entry(name, value, p); });
  });

  ampkit::python::bind_scaler(m);
  ampkit::python::bind_autocast(m);
  ampkit::python::bind_monitor(m);
}
