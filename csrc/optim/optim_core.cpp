// The decisions of ampkit's optimizers (see <ampkit/optim_core.h>), shared by the LibTorch and Python classes.
#include "ampkit/optim_core.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <charconv>
#include <deque>
#include <functional>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "ampkit/ops.h"
#include "borrowed_tensors.h"
#include "core_internal.h"

namespace ampkit::optim {

const char* MasterWeights::name() const {
  switch (mode_) {
    case kOn:
      return "on";
    case kOff:
      return "off";
    case kRemainder:
      return "remainder";
    case kStochastic:
      return "stochastic";
    case kKahan:
      return "kahan";
    default:
      return "auto";
  }
}

MasterWeights MasterWeights::from_name(const std::string& name) {
  for (const Mode m : {kAuto, kOn, kOff, kRemainder, kStochastic, kKahan}) {
    if (name == MasterWeights(m).name()) {
      return MasterWeights(m);
    }
  }
  TORCH_CHECK_VALUE(false,
                    "ampkit::optim::MasterWeights: expected 'auto', 'on', 'off', 'remainder', 'stochastic' or 'kahan', "
                    "but got '",
                    name, "'");
}

namespace core {
namespace {

bool low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
bool fused_dtype(at::ScalarType t) { return low_precision(t) || t == at::kFloat; }

// Whether t's elements fill one block of memory without gaps or overlap (any permutation of contiguous).
bool dense(const at::Tensor& t) {
  if (t.is_contiguous()) {
    return true;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that are not 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1) {
      dims.emplace_back(t.stride(d), t.size(d));
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) {
      return false;
    }
    expected *= size;
  }
  return true;
}

// The learning rate of one fused call on `device`: (the value, or 0 and the tensor the op reads).
std::pair<double, std::optional<at::Tensor>> lr_for(const GroupConfig& c, const at::Device& device) {
  if (!c.lr_tensor.defined()) {
    return {c.lr, std::nullopt};
  }
  // A CPU lr stays on the CPU, where the ops read it on the host (no copy to the device per step).
  const at::Tensor& lr = c.lr_tensor;
  return {0.0, lr.to(lr.is_cpu() ? lr.device() : device, at::kFloat)};
}

std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const at::Device& device) {
  if (!t) {
    return std::nullopt;
  }
  return t->device() == device ? *t : t->to(device, /*non_blocking=*/true);
}

}  // namespace

const std::vector<EntryList>& entry_lists(Algorithm algorithm) {
  using P = ParamState;
  static const std::vector<EntryList> adam = {
      {P::kStep, &P::step, OpList::kSteps},
      {P::kExpAvg, &P::exp_avg, OpList::kFirst},
      {P::kExpAvgSq, &P::exp_avg_sq, OpList::kSecond},
      {P::kMaxExpAvgSq, &P::max_exp_avg_sq, OpList::kThird},
      {P::kMasterParam, &P::master_param, OpList::kMasters},
      {P::kParamRemainder, &P::param_remainder, OpList::kRemainders},
      {P::kKahanComp, &P::kahan_comp, OpList::kRemainders},
      {P::kSrSeed, &P::sr_seed, OpList::kRemainders},
  };
  static const std::vector<EntryList> lamb = [] {  // Adam's, without max_exp_avg_sq (its op has no such list)
    std::vector<EntryList> l;
    std::copy_if(adam.begin(), adam.end(), std::back_inserter(l),
                 [](const EntryList& e) { return e.entry != P::kMaxExpAvgSq; });
    return l;
  }();
  static const std::vector<EntryList> sgd = {
      {P::kStep, &P::step, OpList::kSteps},
      {P::kMomentumBuffer, &P::momentum_buffer, OpList::kFirst},
      {P::kMasterParam, &P::master_param, OpList::kMasters},
      {P::kParamRemainder, &P::param_remainder, OpList::kRemainders},
      {P::kKahanComp, &P::kahan_comp, OpList::kRemainders},
      {P::kSrSeed, &P::sr_seed, OpList::kRemainders},
  };
  return algorithm == Algorithm::kSGD ? sgd : (algorithm == Algorithm::kLamb ? lamb : adam);
}

const char* op_list_name(Algorithm algorithm, OpList list) {
  switch (list) {
    case OpList::kMasters:
      return "master_params";
    case OpList::kRemainders:
      return "param_remainders";
    case OpList::kFirst:
      return algorithm == Algorithm::kSGD ? "momentum_buffers" : "exp_avgs";
    case OpList::kSecond:
      return algorithm == Algorithm::kSGD ? nullptr : "exp_avg_sqs";
    case OpList::kThird:
      return algorithm == Algorithm::kAdam ? "max_exp_avg_sqs" : nullptr;
    default:
      return "state_steps";
  }
}

namespace {

// The fused call of one bucket: the op of the group's algorithm over the entries the bucket reads.
void fused_call(const GroupConfig& c, const StepPlan::Bucket& bucket, const std::vector<detail::Entry>& entries,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const at::Device& device = bucket.device;
  // NOTE [Borrowed tensor lists]; `first` holds the moments' first (SGD: the momentum buffers)
  ampkit::detail::BorrowedTensors params, grads, masters, remainders, first, second, third, steps;
  params.reserve(entries.size());
  grads.reserve(entries.size());
  const auto fill = [&](ampkit::detail::BorrowedTensors& list, uint32_t bit, ParamState::Field field) {
    if (bucket.reads & bit) {
      list.reserve(entries.size());
      for (const auto& e : entries) {
        list.push_back(e.state->*field);
      }
    }
  };
  for (const auto& e : entries) {
    params.push_back(*e.param);
    grads.push_back(*e.grad);
  }
  ampkit::detail::BorrowedTensors* lists[] = {&masters, &remainders, &first, &second, &third, &steps};  // OpList
  for (const EntryList& e : entry_lists(c.algorithm)) {  // NOTE [State lists of the fused ops]
    fill(*lists[static_cast<int>(e.list)], e.entry, e.field);
  }
  const auto [lr, lr_tensor] = lr_for(c, device);
  if (c.algorithm == Algorithm::kLamb) {
    const std::optional<at::Tensor> norm =
        c.grad_norm.defined() ? on_device(c.grad_norm, device) : std::optional<at::Tensor>();
    lamb_step_(params, grads, masters, remainders, first, second, steps, lr, c.beta1, c.beta2, c.weight_decay, c.eps,
               c.bias_correction, c.decoupled_weight_decay, c.grad_averaging, c.use_nvlamb, c.max_grad_norm, norm,
               on_device(grad_scale, device), on_device(found_inf, device), lr_tensor);
  } else if (c.algorithm == Algorithm::kAdam) {
    adamw_step_(params, grads, masters, remainders, first, second, third, steps, lr, c.beta1, c.beta2, c.weight_decay,
                c.eps, c.amsgrad, c.maximize, c.decoupled_weight_decay, on_device(grad_scale, device),
                on_device(found_inf, device), lr_tensor, c.write_unscaled_grads);
  } else {
    sgd_step_(params, grads, masters, remainders, first, steps, lr, c.momentum, c.dampening, c.weight_decay, c.nesterov,
              c.maximize, on_device(grad_scale, device), on_device(found_inf, device), lr_tensor,
              c.write_unscaled_grads);
  }
}

// The master_weights option as the caller wrote it (Python's keyword or the C++ option).
const char* spelled(const GroupConfig& c) {
  static const char* const python[] = {"master_weights=None",         "master_weights=True",
                                       "master_weights=False",        "master_weights='remainder'",
                                       "master_weights='stochastic'", "master_weights='kahan'"};
  static const char* const cxx[] = {"master_weights(kAuto)",
                                    "master_weights(true)",
                                    "master_weights(false)",
                                    "master_weights(MasterWeights::remainder())",
                                    "master_weights(MasterWeights::stochastic())",
                                    "master_weights(MasterWeights::kahan())"};
  return (c.python_spelling ? python : cxx)[c.master_weights.mode()];
}

// A state dtype option as the caller wrote it: exp_avg_dtype=torch.uint8 (Python), exp_avg_dtype(at::kByte) (C++).
std::string spelled_dtype(const GroupConfig& c, const char* option, at::ScalarType dtype) {
  if (c.python_spelling) {
    return std::string(option) + "=torch." + std::string(c10::getDtypeNames(dtype).first);
  }
  return std::string(option) + "(at::k" + c10::toString(dtype) + ")";
}

// Whether the group keeps any moment in a dtype other than FP32.
bool lean_states(const GroupConfig& c) { return c.exp_avg_dtype != at::kFloat || c.exp_avg_sq_dtype != at::kFloat; }

// A double as Python's repr spells it (1.0, 0.001, 1e-05, inf, nan): torch.optim's messages print Python floats.
std::string spell(double v) {
  if (std::isnan(v)) {
    return "nan";
  }
  if (std::isinf(v)) {
    return v > 0 ? "inf" : "-inf";
  }
  // Python's repr: the shortest digits that round-trip, in fixed notation for decimal exponents -4 ... 15 and in
  // scientific notation (at least two exponent digits) outside.
  char buf[400];
  const auto sci_out = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  const std::string sci(buf, sci_out.ec == std::errc() ? sci_out.ptr : buf);
  const size_t e = sci.find('e');
  const int exponent = e == std::string::npos ? 0 : std::stoi(sci.substr(e + 1));
  if (exponent < -4 || exponent >= 16) {
    return sci;
  }
  const auto fixed_out = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  std::string s(buf, fixed_out.ec == std::errc() ? fixed_out.ptr : buf);
  if (s.find('.') == std::string::npos) {
    s += ".0";
  }
  return s;
}

// The state dtype options: Float, BFloat16 or Byte; LAMB keeps FP32 moments, SGD has no second moment.
void check_state_dtypes(const GroupConfig& c) {
  const char* first = c.algorithm == Algorithm::kSGD ? "momentum_dtype" : "exp_avg_dtype";
  for (const auto& [option, dtype] : {std::pair(first, c.exp_avg_dtype), {"exp_avg_sq_dtype", c.exp_avg_sq_dtype}}) {
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kByte, c.optimizer, ": ", option,
                      c.python_spelling ? " must be torch.float32, torch.bfloat16 or torch.uint8"
                                        : " must be at::kFloat, at::kBFloat16 or at::kByte",
                      " (8-bit block-wise), but got ", spelled_dtype(c, option, dtype));
  }
  TORCH_CHECK_VALUE(c.algorithm != Algorithm::kLamb || !lean_states(c), c.optimizer, ": ",
                    spelled_dtype(c, c.exp_avg_dtype != at::kFloat ? "exp_avg_dtype" : "exp_avg_sq_dtype",
                                  c.exp_avg_dtype != at::kFloat ? c.exp_avg_dtype : c.exp_avg_sq_dtype),
                    " is not supported (LAMB keeps FP32 moments; Adam, AdamW and SGD have it)");
  TORCH_CHECK_VALUE(c.algorithm != Algorithm::kSGD || c.exp_avg_sq_dtype == at::kFloat, c.optimizer,
                    ": SGD has no second moment (exp_avg_sq_dtype); its momentum buffer's dtype is momentum_dtype");
}

}  // namespace

void check_config(const GroupConfig& c) {
  // torch.optim's order of checks, so that the first bad value is the one named.
  TORCH_CHECK_VALUE(c.lr >= 0, "Invalid learning rate: ", spell(c.lr));
  if (c.lr_tensor.defined()) {
    TORCH_CHECK_VALUE(c.lr_tensor.numel() == 1, "Tensor lr must be 1-element");
  }
  if (c.algorithm != Algorithm::kSGD) {
    TORCH_CHECK_VALUE(c.eps >= 0, "Invalid epsilon value: ", spell(c.eps));
    TORCH_CHECK_VALUE(0 <= c.beta1 && c.beta1 < 1.0, "Invalid beta parameter at index 0: ", spell(c.beta1));
    TORCH_CHECK_VALUE(0 <= c.beta2 && c.beta2 < 1.0, "Invalid beta parameter at index 1: ", spell(c.beta2));
    TORCH_CHECK_VALUE(c.weight_decay >= 0, "Invalid weight_decay value: ", spell(c.weight_decay));
    if (c.algorithm == Algorithm::kLamb) {
      TORCH_CHECK_VALUE(c.max_grad_norm >= 0 && std::isfinite(c.max_grad_norm),
                        "Invalid max_grad_norm value: ", spell(c.max_grad_norm),
                        " (a finite number >= 0; 0: no "
                        "clipping)");
      TORCH_CHECK_VALUE(!c.amsgrad && !c.maximize, c.optimizer, " has no amsgrad or maximize");
    }
  } else {
    constexpr double inf = std::numeric_limits<double>::infinity();
    TORCH_CHECK_VALUE(0 <= c.momentum && c.momentum < inf, "Invalid momentum value: ", spell(c.momentum));
    TORCH_CHECK_VALUE(-inf < c.dampening && c.dampening < inf, "Invalid dampening value: ", spell(c.dampening));
    TORCH_CHECK_VALUE(c.weight_decay >= 0, "Invalid weight_decay value: ", spell(c.weight_decay));
    TORCH_CHECK_VALUE(!c.nesterov || (c.momentum > 0 && c.dampening == 0),
                      "Nesterov momentum requires a momentum and zero dampening");
  }
  check_state_dtypes(c);
}

bool takes_fused(const at::Tensor& param, const at::Tensor& grad) {
  return fused_dtype(param.scalar_type()) && !grad.is_sparse() && dense(param);
}

MasterMode master_mode(const GroupConfig& c, const at::Tensor& p) {
  const MasterWeights mw = c.master_weights;
  const auto dtype = p.scalar_type();
  if (mw == MasterWeights::kOn || mw == MasterWeights::kRemainder) {
    TORCH_CHECK_VALUE(fused_dtype(dtype), c.optimizer, ": ", spelled(c), " needs FP16, BF16 or FP32 parameters, but ",
                      "got a ", dtype, " parameter of shape ", p.sizes());
  }
  switch (mw.mode()) {
    case MasterWeights::kRemainder:
      TORCH_CHECK_VALUE(dtype == at::kBFloat16, c.optimizer, ": ", spelled(c), " needs BFloat16 parameters, but ",
                        "got ", dtype);
      return MasterMode::kRemainder;
    case MasterWeights::kStochastic:
    case MasterWeights::kKahan:
      TORCH_CHECK_VALUE(dtype == at::kBFloat16, c.optimizer, ": ", spelled(c), " needs BFloat16 parameters (the ",
                        "weight is kept without an FP32 master), but got a ", dtype, " parameter of shape ", p.sizes());
      return mw == MasterWeights::kKahan ? MasterMode::kKahan : MasterMode::kStochastic;
    case MasterWeights::kOn:
      return MasterMode::kMaster;
    case MasterWeights::kOff:
      return MasterMode::kNone;
    default:
      return low_precision(dtype) ? MasterMode::kMaster : MasterMode::kNone;
  }
}

namespace {

// check_group's checks of one parameter with a grad, in master mode `mode`; returns takes_fused(p, g).
bool check_param(const GroupConfig& c, const at::Tensor& p, const at::Tensor& g, MasterMode mode) {
  const bool fused = takes_fused(p, g);
  TORCH_CHECK_VALUE(c.algorithm != Algorithm::kLamb || fused, c.optimizer,
                    " needs FP16, BF16 or "
                    "FP32 parameters dense in memory with dense grads (its fused kernels), but a ",
                    p.scalar_type(), " parameter of shape ", p.sizes(),
                    g.is_sparse()                  ? " has a sparse grad"
                    : fused_dtype(p.scalar_type()) ? " has gaps in memory"
                                                   : "");
  TORCH_CHECK(c.algorithm == Algorithm::kSGD || !g.is_sparse(), c.optimizer,
              " does not support sparse gradients, please consider SparseAdam instead");
  // torch.optim.SGD's own error, raised here before anything is written instead of half-way through a step.
  TORCH_CHECK(!g.is_sparse() || c.weight_decay == 0,
              "add(sparse, dense) is not supported. Use add(dense, sparse) "
              "instead. (",
              c.optimizer, ": weight_decay on a sparse grad)");
  TORCH_CHECK_VALUE(
      fused || mode == MasterMode::kNone || c.master_weights == MasterWeights::kAuto, c.optimizer, ": ", spelled(c),
      " needs a parameter dense in memory with a dense grad (the "
      "fused kernels), but a ",
      p.scalar_type(), " parameter of shape ", p.sizes(), " has ", g.is_sparse() ? "a sparse grad" : "gaps in memory");
  TORCH_CHECK_VALUE(g.sizes() == p.sizes(), c.optimizer, ": a parameter of shape ", p.sizes(), " has a grad of shape ",
                    g.sizes());
  // torch's single-tensor formulas (the path of the parameters the kernels do not take) mix no dtypes: a grad of
  // another dtype (grad_dtype) steps through the fused kernels only.
  TORCH_CHECK_TYPE(fused || g.scalar_type() == p.scalar_type(), c.optimizer, ": a ", p.scalar_type(),
                   " parameter of shape ", p.sizes(), " has a ", g.scalar_type(),
                   " grad, which only the fused kernels ",
                   "take (FP16/BF16 parameters dense in memory with dense FP32 grads), but it ",
                   g.is_sparse() ? "is sparse" : "has gaps in memory");
  if (!fused && lean_states(c)) {
    const bool first = c.exp_avg_dtype != at::kFloat;
    const char* option =
        first ? (c.algorithm == Algorithm::kSGD ? "momentum_dtype" : "exp_avg_dtype") : "exp_avg_sq_dtype";
    TORCH_CHECK_VALUE(
        false, c.optimizer, ": ", spelled_dtype(c, option, first ? c.exp_avg_dtype : c.exp_avg_sq_dtype),
        " needs FP16, BF16 or FP32 parameters dense in memory with dense grads (the fused kernels), but a ",
        p.scalar_type(), " parameter of shape ", p.sizes(),
        g.is_sparse()                  ? " has a sparse grad"
        : fused_dtype(p.scalar_type()) ? " has gaps in memory"
                                       : "");
  }
  return fused;
}

// The plan's pass prefetches (NOTE [Metadata prefetch] in csrc/ops/checks.cpp) the TensorImpl of params[i + 8]
// and the TensorImpl of params[i + 4]'s grad, found through params[i + 4]'s TensorImpl (prefetched 4 parameters
// earlier) and its autograd metadata (read here: that miss comes 4 parameters before check_one reads the grad).
void prefetch_ahead(at::TensorList params, at::TensorList grads, size_t i) {
  constexpr size_t kAhead = 8;
  const auto prefetch = [](const at::Tensor& t) {
    const auto* impl = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
    for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) {
      __builtin_prefetch(impl + offset);
    }
    __builtin_prefetch(impl + sizeof(c10::TensorImpl) - 1);
  };
  if (i + kAhead < params.size()) {
    prefetch(params[i + kAhead]);
  }
  if (i + kAhead / 2 < params.size()) {
    const at::Tensor& p = params[i + kAhead / 2];
    // (TensorImpl::grad: no warning for a non-leaf tensor, no error for an undefined one, as Tensor::grad has)
    const at::Tensor& grad = !grads.empty() ? grads[i + kAhead / 2] : p.defined() ? p.unsafeGetTensorImpl()->grad() : p;
    if (grad.defined()) {
      prefetch(grad);
    }
  }
}

// A parameter with a grad that passed check_param, and what the checks found.
struct Checked {
  const at::Tensor* grad;
  MasterMode mode;
  bool fused;
};

// check_group's checks of params[i]: its grad, grads[i] or params[i]'s own where `grads` is empty (grad == nullptr:
// none, nothing checked).
Checked check_one(const GroupConfig& c, at::TensorList params, at::TensorList grads, size_t i) {
  const at::Tensor& p = params[i];
  const at::Tensor& grad = grads.empty() ? p.grad() : grads[i];
  if (!grad.defined()) {
    return {nullptr, MasterMode::kNone, false};
  }
  const MasterMode mode = master_mode(c, p);
  return {&grad, mode, check_param(c, p, grad, mode)};
}

}  // namespace

void check_group(const GroupConfig& c, at::TensorList params) {
  check_config(c);
  for (size_t i = 0; i < params.size(); ++i) {
    check_one(c, params, {}, i);
  }
}

namespace {

uint32_t bit(bool on, uint32_t bits) { return on ? bits : 0u; }

// The entries plan_step() says a fused parameter's state lacks, created (ampkit::make_optim_state: the tensors a
// compiled step creates too) or, for a remainder derived from a loaded master, computed.
void complete_state(const GroupConfig& c, const StepPlan::Param& e, const at::Tensor& p, ParamState& s) {
  if (e.remainder_from_master) {
    s.param_remainder = remainder_of(p, s.master_param);
    s.master_param = at::Tensor();
  }
  if (e.missing == 0) {
    return;
  }
  const std::vector<std::string> names = StepPlan::entry_names(e.missing);
  std::vector<at::Tensor> made = make_optim_state(p, names, e.first_step, c.exp_avg_dtype, c.exp_avg_sq_dtype);
  for (size_t k = 0; k < names.size(); ++k) {
    *s.entry(names[k]) = std::move(made[k]);
  }
}

}  // namespace

std::vector<std::string> StepPlan::entry_names(uint32_t entries) {
  std::vector<std::string> names;
  const auto& fields = ParamState::fields();
  for (size_t k = 0; k < fields.size(); ++k) {
    if (entries & (1u << k)) {
      names.emplace_back(fields[k].first);
    }
  }
  return names;
}

bool may_replace_entries(const GroupConfig& c) { return c.master_weights == MasterWeights::kRemainder; }

StepPlan plan_step(const GroupConfig& c, at::TensorList params, const std::vector<const ParamState*>& states,
                   at::TensorList grads) {
  TORCH_CHECK_VALUE(states.size() == params.size(), c.optimizer, ": ", params.size(), " parameters but ", states.size(),
                    " states");
  TORCH_CHECK_VALUE(grads.empty() || grads.size() == params.size(), c.optimizer, ": ", params.size(),
                    " parameters but ", grads.size(), " grads");
  static const ParamState kNone;
  check_config(c);
  const bool adam = c.algorithm != Algorithm::kSGD;  // Adam's state: LAMB's too
  // Stochastic rounding's counter is the step count: SGD keeps one in that mode.
  const bool stateful = adam || c.momentum != 0 || c.master_weights == MasterWeights::kStochastic;
  StepPlan plan;
  plan.params.reserve(params.size());
  // One pass per parameter: its checks and its plan (every parameter's metadata read once). A partial
  // single-tensor state is refused after the pass, so that any parameter's check error comes first, as when every
  // parameter was checked before any was planned.
  std::optional<size_t> partial;
  for (size_t index = 0; index < params.size(); ++index) {
    prefetch_ahead(params, grads, index);
    const Checked k = check_one(c, params, grads, index);
    if (k.grad == nullptr) {
      continue;
    }
    const at::Tensor& p = params[index];
    const ParamState& s = states[index] != nullptr ? *states[index] : kNone;
    StepPlan::Param e{index, k.mode, k.fused};
    e.grad = k.grad;
    if (!k.fused) {  // torch.optim's single-tensor path: its state (torch.optim's format) must be whole
      if (c.algorithm == Algorithm::kAdam && (s.step.defined() || s.exp_avg.defined() || s.exp_avg_sq.defined()) &&
          !(s.step.defined() && s.exp_avg.defined() && s.exp_avg_sq.defined()) && !partial) {
        partial = index;
      }
      plan.params.push_back(e);
      continue;
    }
    const at::Tensor& g = *k.grad;
    // The kernels read the grad in the parameter's layout: a staging copy for such (rare) grads.
    e.staged = !(g.is_contiguous() && p.is_contiguous()) && g.strides() != p.strides();
    if (stateful && !s.step.defined()) {
      e.missing |= ParamState::kStep;
      // A state loaded from torch.optim.SGD has its momentum buffer but no step: the buffer is initialised, so
      // the next step must use it (step 1), not restart it from the grad (step 0).
      e.first_step = !adam && s.momentum_buffer.defined() ? 1.0 : 0.0;
    }
    if (adam) {
      e.missing |= bit(!s.exp_avg.defined(), ParamState::kExpAvg) |
                   bit(!s.exp_avg_sq.defined(), ParamState::kExpAvgSq) |
                   bit(c.amsgrad && !s.max_exp_avg_sq.defined(), ParamState::kMaxExpAvgSq);
    } else if (c.momentum != 0 && !s.momentum_buffer.defined()) {
      e.missing |= ParamState::kMomentumBuffer;
    }
    if (k.mode == MasterMode::kMaster && !s.master_param.defined()) {
      e.missing |= ParamState::kMasterParam;
    }
    if (k.mode == MasterMode::kRemainder && !s.param_remainder.defined()) {
      e.remainder_from_master = s.master_param.defined();
      e.missing |= bit(!e.remainder_from_master, ParamState::kParamRemainder);
    }
    e.missing |= bit(k.mode == MasterMode::kKahan && !s.kahan_comp.defined(), ParamState::kKahanComp) |
                 bit(k.mode == MasterMode::kStochastic && !s.sr_seed.defined(), ParamState::kSrSeed);
    auto it = std::find_if(plan.buckets.begin(), plan.buckets.end(),
                           [&](const StepPlan::Bucket& b) { return b.device == p.device() && b.mode == k.mode; });
    if (it == plan.buckets.end()) {
      // The entries the fused call reads: the step where the algorithm keeps one, the moments (SGD: the momentum
      // buffer), the master or the remainder.
      const uint32_t reads = bit(stateful, ParamState::kStep) | bit(adam, ParamState::kExpAvg | ParamState::kExpAvgSq) |
                             bit(adam && c.amsgrad, ParamState::kMaxExpAvgSq) |
                             bit(!adam && c.momentum != 0, ParamState::kMomentumBuffer) |
                             bit(k.mode == MasterMode::kMaster, ParamState::kMasterParam) |
                             bit(k.mode == MasterMode::kRemainder, ParamState::kParamRemainder) |
                             bit(k.mode == MasterMode::kKahan, ParamState::kKahanComp) |
                             bit(k.mode == MasterMode::kStochastic, ParamState::kSrSeed);
      plan.buckets.push_back({p.device(), k.mode, reads, {}});
      it = std::prev(plan.buckets.end());
    }
    it->params.push_back(plan.params.size());
    plan.params.push_back(e);
  }
  TORCH_CHECK_VALUE(!partial, c.optimizer, ": the state of params[", partial.value_or(0),
                    "] has only some of step, exp_avg and exp_avg_sq");
  return plan;
}

namespace {

// NOTE [Plain BF16 stagnation guard]
// A BF16 weight kept without any master (master_weights=False) moves only where the update exceeds half its unit
// in the last place: with |w| ~ 1 that is 2^-9, so an Adam step (whose first update is lr per element) of lr 1e-3
// already loses most updates (the stagnation bench/lean_training.py shows). On the step that creates such
// parameters' states (once per group, from its first step), the fraction of nonzero weights an update of lr (Adam;
// SGD: lr * |unscaled grad|) leaves where they are is measured (one host read, this step only), and above 1% a
// warning names the optimizer, the group's first such parameter and the remedies. Adam's normalized update is about
// lr at most, so those weights can never move; its later, smaller updates lose more (bench/lean_training.py's LM at
// lr 3e-4: 8% of the weights at the first step, a final loss 20% above FP32 masters). SGD without momentum keeps
// no state and is not measured.
void warn_if_updates_vanish(const GroupConfig& c, const StepPlan& plan, at::TensorList params,
                            const std::optional<at::Tensor>& grad_scale) {
  constexpr uint32_t kCreated = ParamState::kStep | ParamState::kExpAvg | ParamState::kMomentumBuffer;
  int64_t total = 0;
  at::Tensor stuck;
  const at::Tensor* first = nullptr;
  for (const StepPlan::Param& e : plan.params) {
    const at::Tensor& p = params[e.index];
    if (!e.fused || e.mode != MasterMode::kNone || p.scalar_type() != at::kBFloat16 || !(e.missing & kCreated) ||
        p.numel() == 0) {
      continue;
    }
    const at::Tensor w = p.detach().to(at::kFloat).flatten();
    at::Tensor update = at::full({}, c.lr_tensor.defined() ? c.lr_tensor.item<double>() : c.lr, w.options());
    if (c.algorithm == Algorithm::kSGD) {
      at::Tensor g = p.grad().detach().to(at::kFloat).flatten().abs();
      if (grad_scale) {
        g = g / grad_scale->to(g.device());
      }
      update = update * g;
    }
    // Half a BF16 unit in the last place of |w| = m * 2^e (m in [0.5, 1)): 2^(e - 9).
    const at::Tensor half_ulp = at::ldexp(at::ones_like(w), std::get<1>(at::frexp(w)) - 9);
    const at::Tensor count = (update < half_ulp).logical_and(w != 0).sum();
    stuck = stuck.defined() ? stuck + count.to(stuck.device()) : count;
    total += w.ne(0).sum().item<int64_t>();
    first = first != nullptr ? first : &p;
  }
  if (total == 0) {
    return;
  }
  const double fraction = static_cast<double>(stuck.item<int64_t>()) / static_cast<double>(total);
  if (fraction > 0.01) {
    TORCH_WARN(c.optimizer, ": ", spelled(c), " keeps BF16 weights without a master, and an update of lr ",
               spell(c.lr_tensor.defined() ? c.lr_tensor.item<double>() : c.lr), " leaves ",
               static_cast<int>(fraction * 100.0 + 0.5), "% of the nonzero weights of the group holding the ",
               first->scalar_type(), " parameter of shape ", first->sizes(),
               " where they are (below half a BF16 unit in the last place): those updates are lost. Keep a master ",
               "(the default, or the remainder mode) or use the kahan or stochastic mode.");
  }
}

}  // namespace

namespace {

// A group's step along its plan (made by plan_step on these params and states, nothing written since).
void run_plan(const GroupConfig& c, const StepPlan& plan, at::TensorList params, const std::vector<ParamState*>& states,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if (c.master_weights == MasterWeights::kOff) {
    warn_if_updates_vanish(c, plan, params, grad_scale);  // NOTE [Plain BF16 stagnation guard]
  }
  // (grad, staging copy in the parameter's layout); a deque: entries point into it
  std::deque<std::pair<at::Tensor, at::Tensor>> staged;
  std::vector<const at::Tensor*> grads(plan.params.size());  // what the kernels read: the grad or its copy
  std::vector<detail::Entry> single;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const StepPlan::Param& e = plan.params[i];
    grads[i] = e.grad;
    if (!e.fused) {
      single.push_back({&params[e.index], grads[i], states[e.index]});
      continue;
    }
    if (e.staged) {
      const at::Tensor& p = params[e.index];
      // In the parameter's layout; a FP32 grad of a FP16/BF16 parameter stays FP32 (NOTE [FP32 grads of
      // low-precision params]).
      const at::ScalarType dtype = grads[i]->scalar_type() == at::kFloat ? at::kFloat : p.scalar_type();
      staged.emplace_back(*grads[i], at::empty_like(p, p.options().dtype(dtype)).copy_(*grads[i]));
      grads[i] = &staged.back().second;
    }
    complete_state(c, e, params[e.index], *states[e.index]);
  }
  for (const StepPlan::Bucket& bucket : plan.buckets) {
    std::vector<detail::Entry> entries;
    entries.reserve(bucket.params.size());
    for (const size_t i : bucket.params) {
      const size_t index = plan.params[i].index;
      entries.push_back({&params[index], grads[i], states[index]});
    }
    fused_call(c, bucket, entries, grad_scale, found_inf);
  }
  if (grad_scale && c.write_unscaled_grads) {
    for (auto& [grad, staging] : staged) {
      grad.copy_(staging);  // the unscaled grads, as torch's fused optimizers leave them
    }
  }
  if (!single.empty()) {
    detail::single_tensor_step(c, single, grad_scale, found_inf);
  }
}

StepPlan plan_of(const GroupConfig& c, at::TensorList params, const std::vector<ParamState*>& states) {
  return plan_step(c, params, std::vector<const ParamState*>(states.begin(), states.end()));
}

}  // namespace

void step(const GroupConfig& c, at::TensorList params, const std::vector<ParamState*>& states,
          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  // Every parameter is checked before any state is completed: completing a remainder from a master rewrites the
  // BF16 weight.
  run_plan(c, plan_of(c, params, states), params, states, grad_scale, found_inf);
}

// NOTE [The policy across groups]
at::Tensor step_groups(std::vector<GroupStep>& groups, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf, const std::function<at::Tensor()>& global_norm) {
  std::vector<StepPlan> plans(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {  // every group checked before the first is written
    if (groups[g].check) {
      groups[g].check();
    } else {
      plans[g] = plan_of(groups[g].config, groups[g].params, groups[g].states);
    }
  }
  at::Tensor norm;
  if (std::any_of(groups.begin(), groups.end(), [](const GroupStep& g) { return g.config.max_grad_norm > 0; })) {
    if (global_norm) {
      norm = global_norm();
    } else {
      std::vector<at::Tensor> grads;
      for (const GroupStep& group : groups) {
        for (const at::Tensor& p : group.params) {
          if (p.grad().defined()) {
            grads.push_back(p.grad());
          }
        }
      }
      norm = ampkit::global_grad_norm(grads, grad_scale);
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupStep& group = groups[g];
    if (group.step) {
      group.step(norm);
      continue;
    }
    group.config.grad_norm = norm;
    run_plan(group.config, plans[g], group.params, group.states, grad_scale, found_inf);
  }
  return norm;
}

}  // namespace core
}  // namespace ampkit::optim
