// The decisions of ampkit's optimizers (see <ampkit/optim_core.h>), shared by the LibTorch and Python classes.
#include "ampkit/optim_core.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <deque>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "ampkit/ops.h"
#include "borrowed_tensors.h"

namespace ampkit::optim {

const char* MasterWeights::name() const {
  switch (mode_) {
    case kOn:
      return "on";
    case kOff:
      return "off";
    case kRemainder:
      return "remainder";
    default:
      return "auto";
  }
}

MasterWeights MasterWeights::from_name(const std::string& name) {
  for (const Mode m : {kAuto, kOn, kOff, kRemainder}) {
    if (name == MasterWeights(m).name()) {
      return MasterWeights(m);
    }
  }
  TORCH_CHECK_VALUE(false, "ampkit::optim::MasterWeights: expected 'auto', 'on', 'off' or 'remainder', but got '",
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

at::Tensor fp32_zeros_like(const at::Tensor& p) {
  return at::zeros_like(p, at::TensorOptions().dtype(at::kFloat), at::MemoryFormat::Preserve);
}

at::Tensor fp32_copy(const at::Tensor& p) { return p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true); }

// Creates the entries a fused step needs (a fresh state, or one loaded from torch.optim).
void complete_state(const GroupConfig& c, const at::Tensor& p, ParamState& s, MasterMode mode) {
  const bool adam = c.algorithm != Algorithm::kSGD;  // Adam's state: LAMB's too
  if ((adam || c.momentum != 0) && !s.step.defined()) {
    // A state loaded from torch.optim.SGD has its momentum buffer but no step: the buffer is initialised, so the
    // next step must use it (step 1), not restart it from the grad (step 0).
    const bool started = !adam && s.momentum_buffer.defined();
    s.step = at::full({}, started ? 1.0 : 0.0, p.options().dtype(at::kFloat));
  }
  if (adam) {
    for (at::Tensor* t : {&s.exp_avg, &s.exp_avg_sq}) {
      if (!t->defined()) {
        *t = fp32_zeros_like(p);
      }
    }
    if (c.amsgrad && !s.max_exp_avg_sq.defined()) {
      s.max_exp_avg_sq = fp32_zeros_like(p);
    }
  } else if (c.momentum != 0 && !s.momentum_buffer.defined()) {
    s.momentum_buffer = fp32_zeros_like(p);
  }
  if (mode == MasterMode::kMaster && !s.master_param.defined()) {
    s.master_param = fp32_copy(p);
  }
  if (mode == MasterMode::kRemainder && !s.param_remainder.defined()) {
    s.param_remainder = s.master_param.defined()
                            ? remainder_of(p, s.master_param)
                            : at::zeros_like(p, at::TensorOptions().dtype(at::kShort), at::MemoryFormat::Preserve);
    s.master_param = at::Tensor();
  }
}

// The learning rate of one fused call on `device`: (host value, device tensor or nullopt).
std::pair<double, std::optional<at::Tensor>> lr_for(const GroupConfig& c, const at::Device& device) {
  if (!c.lr_tensor.defined()) {
    return {c.lr, std::nullopt};
  }
  const at::Tensor& lr = c.lr_tensor;
  if (lr.device().is_cpu() && !device.is_cpu()) {
    return {lr.item<double>(), std::nullopt};
  }
  if (lr.device() == device && lr.scalar_type() == at::kFloat) {
    return {0.0, lr};
  }
  return {0.0, lr.to(device, at::kFloat)};
}

std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const at::Device& device) {
  if (!t) {
    return std::nullopt;
  }
  return t->device() == device ? *t : t->to(device, /*non_blocking=*/true);
}

// A parameter of a step: the tensors outlive the step (the caller's list, the parameter's grad or its staging copy).
struct Entry {
  const at::Tensor* param;
  const at::Tensor* grad;
  ParamState* state;
};

void fused_call(const GroupConfig& c, const at::Device& device, MasterMode mode, const std::vector<Entry>& entries,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  // NOTE [Borrowed tensor lists]
  detail::BorrowedTensors params, grads, masters, remainders, first, second, third, steps;
  const bool adam = c.algorithm != Algorithm::kSGD;
  const bool stateful = adam || c.momentum != 0;
  for (auto* list : {&params, &grads, &first, &steps}) {
    list->reserve(entries.size());
  }
  if (adam) {
    second.reserve(entries.size());
  }
  for (const auto& e : entries) {
    params.push_back(*e.param);
    grads.push_back(*e.grad);
    if (mode == MasterMode::kMaster) {
      masters.push_back(e.state->master_param);
    } else if (mode == MasterMode::kRemainder) {
      remainders.push_back(e.state->param_remainder);
    }
    if (adam) {
      first.push_back(e.state->exp_avg);
      second.push_back(e.state->exp_avg_sq);
      if (c.amsgrad) {
        third.push_back(e.state->max_exp_avg_sq);
      }
    } else if (stateful) {
      first.push_back(e.state->momentum_buffer);
    }
    if (stateful) {
      steps.push_back(e.state->step);
    }
  }
  const auto [lr, lr_tensor] = lr_for(c, device);
  if (c.algorithm == Algorithm::kLamb) {
    const std::optional<at::Tensor> norm =
        c.grad_norm.defined() ? on_device(c.grad_norm, device) : std::optional<at::Tensor>();
    lamb_step_(params, grads, masters, remainders, first, second, steps, lr, c.beta1, c.beta2, c.weight_decay,
               c.eps, c.bias_correction, c.decoupled_weight_decay, c.grad_averaging, c.use_nvlamb, c.max_grad_norm,
               norm, on_device(grad_scale, device), on_device(found_inf, device), lr_tensor);
  } else if (adam) {
    adamw_step_(params, grads, masters, remainders, first, second, third, steps, lr, c.beta1, c.beta2,
                c.weight_decay, c.eps, c.amsgrad, c.maximize, c.decoupled_weight_decay, on_device(grad_scale, device),
                on_device(found_inf, device), lr_tensor, c.write_unscaled_grads);
  } else {
    sgd_step_(params, grads, masters, remainders, first, steps, lr, c.momentum, c.dampening, c.weight_decay,
              c.nesterov, c.maximize, on_device(grad_scale, device), on_device(found_inf, device), lr_tensor,
              c.write_unscaled_grads);
  }
}

// The learning rate as torch's single-tensor functions see it: a float, or a 0-dim tensor (tensor arithmetic).
struct Lr {
  double value;
  at::Tensor tensor;  // defined: a tensor lr
};

// torch.optim.Adam's single-tensor step (torch/optim/adam.py, _single_tensor_adam, capturable=False,
// differentiable=False), for one parameter the fused kernels do not take.
void single_tensor_adam(const GroupConfig& c, const Lr& lr, at::Tensor param, at::Tensor grad, ParamState& s) {
  if (c.maximize) {
    grad = -grad;
  }
  s.step.add_(1);
  if (c.weight_decay != 0) {
    if (c.decoupled_weight_decay) {
      if (lr.tensor.defined()) {
        param.mul_(1 - lr.tensor * c.weight_decay);
      } else {
        param.mul_(1 - lr.value * c.weight_decay);
      }
    } else {
      grad = grad.add(param, c.weight_decay);
    }
  }
  at::Tensor exp_avg = s.exp_avg, exp_avg_sq = s.exp_avg_sq, max_exp_avg_sq = s.max_exp_avg_sq;
  if (param.is_complex()) {
    grad = at::view_as_real(grad);
    exp_avg = at::view_as_real(exp_avg);
    exp_avg_sq = at::view_as_real(exp_avg_sq);
    if (c.amsgrad) {
      max_exp_avg_sq = at::view_as_real(max_exp_avg_sq);
    }
    param = at::view_as_real(param);
  }
  exp_avg.lerp_(grad, 1 - c.beta1);
  exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, 1 - c.beta2);
  const double step = s.step.item<double>();
  const double bias_correction1 = 1 - std::pow(c.beta1, step);
  const double bias_correction2 = 1 - std::pow(c.beta2, step);
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  at::Tensor denom;
  if (c.amsgrad) {
    at::maximum_out(max_exp_avg_sq, max_exp_avg_sq, exp_avg_sq);
    denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(c.eps);
  } else {
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(c.eps);
  }
  if (lr.tensor.defined()) {
    const at::Tensor step_size = lr.tensor / bias_correction1;
    param.addcdiv_(exp_avg, denom, (-step_size).item());
  } else {
    param.addcdiv_(exp_avg, denom, -(lr.value / bias_correction1));
  }
}

// torch.optim.SGD's single-tensor step (torch/optim/sgd.py, _single_tensor_sgd), for one parameter the fused
// kernels do not take; its state is torch's (a momentum buffer started from the grad, no step).
void single_tensor_sgd(const GroupConfig& c, const Lr& lr, const at::Tensor& param, at::Tensor grad, ParamState& s) {
  if (c.maximize) {
    grad = -grad;
  }
  if (c.weight_decay != 0) {
    grad = grad.add(param, c.weight_decay);
  }
  if (c.momentum != 0) {
    if (!s.momentum_buffer.defined()) {
      s.momentum_buffer = grad.detach().clone();
    } else {
      s.momentum_buffer.mul_(c.momentum).add_(grad, 1 - c.dampening);
    }
    grad = c.nesterov ? grad.add(s.momentum_buffer, c.momentum) : s.momentum_buffer;
  }
  if (lr.tensor.defined()) {
    param.add_(grad, (-lr.tensor).item());
  } else {
    param.add_(grad, -lr.value);
  }
}

void single_tensor_step(const GroupConfig& c, const std::vector<Entry>& entries,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  if (found_inf && found_inf->item<double>() != 0.0) {
    return;  // the scaler's skip, read on the host on this path only
  }
  if (grad_scale) {  // as torch's fused optimizers leave them: unscaled
    for (const auto& e : entries) {
      e.grad->div_(grad_scale->to(e.grad->device()));
    }
  }
  Lr lr{c.lr, {}};
  if (c.lr_tensor.defined()) {
    lr.tensor = c.lr_tensor.dim() != 0 ? c.lr_tensor.squeeze() : c.lr_tensor;
  }
  for (const auto& e : entries) {
    ParamState& s = *e.state;
    if (c.algorithm == Algorithm::kAdam) {
      if (!s.step.defined()) {  // torch's state: the parameter's dtype, the step on the CPU
        s.step = at::zeros({}, at::TensorOptions().dtype(at::kFloat));
        s.exp_avg = at::zeros_like(*e.param, at::MemoryFormat::Preserve);
        s.exp_avg_sq = at::zeros_like(*e.param, at::MemoryFormat::Preserve);
      }
      if (c.amsgrad && !s.max_exp_avg_sq.defined()) {
        s.max_exp_avg_sq = at::zeros_like(*e.param, at::MemoryFormat::Preserve);
      }
      single_tensor_adam(c, lr, *e.param, *e.grad, s);
    } else {
      single_tensor_sgd(c, lr, *e.param, *e.grad, s);
    }
  }
}

// The master_weights option as the caller wrote it (Python's keyword or the C++ option).
const char* spelled(const GroupConfig& c) {
  static const char* const python[] = {"master_weights=None", "master_weights=True", "master_weights=False",
                                       "master_weights='remainder'"};
  static const char* const cxx[] = {"master_weights(kAuto)", "master_weights(true)", "master_weights(false)",
                                    "master_weights(MasterWeights::remainder())"};
  return (c.python_spelling ? python : cxx)[c.master_weights.mode()];
}

bool fp32_entry(const std::string& name) { return name != "param_remainder"; }

// A double as Python's repr spells it (1.0, 0.001, 1e-05, inf, nan): torch.optim's messages print Python floats.
std::string spell(double v) {
  if (std::isnan(v)) {
    return "nan";
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  std::string s(buf, ec == std::errc() ? end : buf);
  if (s.find_first_of(".ein") == std::string::npos) {
    s += ".0";
  }
  return s;
}

}  // namespace

bool ParamState::empty() const {
  return !(step.defined() || exp_avg.defined() || exp_avg_sq.defined() || max_exp_avg_sq.defined() ||
           momentum_buffer.defined() || master_param.defined() || param_remainder.defined());
}

const std::vector<std::pair<const char*, ParamState::Field>>& ParamState::fields() {
  static const std::vector<std::pair<const char*, Field>> f{
      {"step", &ParamState::step},
      {"exp_avg", &ParamState::exp_avg},
      {"exp_avg_sq", &ParamState::exp_avg_sq},
      {"max_exp_avg_sq", &ParamState::max_exp_avg_sq},
      {"momentum_buffer", &ParamState::momentum_buffer},
      {"master_param", &ParamState::master_param},
      {"param_remainder", &ParamState::param_remainder}};
  return f;
}

at::Tensor* ParamState::entry(const std::string& name) {
  for (const auto& [n, field] : fields()) {
    if (name == n) {
      return &(this->*field);
    }
  }
  return nullptr;
}

const std::vector<std::string>& ParamState::names() {
  static const std::vector<std::string> n = [] {
    std::vector<std::string> out;
    for (const auto& f : fields()) {
      out.emplace_back(f.first);
    }
    return out;
  }();
  return n;
}

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
                        "Invalid max_grad_norm value: ", spell(c.max_grad_norm), " (a finite number >= 0; 0: no "
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
    case MasterWeights::kOn:
      return MasterMode::kMaster;
    case MasterWeights::kOff:
      return MasterMode::kNone;
    default:
      return low_precision(dtype) ? MasterMode::kMaster : MasterMode::kNone;
  }
}

namespace {

// check_group's checks of one parameter with a grad, in master mode `mode`.
void check_param(const GroupConfig& c, const at::Tensor& p, const at::Tensor& g, MasterMode mode) {
  const bool fused = takes_fused(p, g);
  TORCH_CHECK_VALUE(c.algorithm != Algorithm::kLamb || fused, c.optimizer, " needs FP16, BF16 or "
                    "FP32 parameters dense in memory with dense grads (its fused kernels), but a ", p.scalar_type(),
                    " parameter of shape ", p.sizes(), g.is_sparse() ? " has a sparse grad"
                    : fused_dtype(p.scalar_type()) ? " has gaps in memory" : "");
  TORCH_CHECK(c.algorithm == Algorithm::kSGD || !g.is_sparse(), c.optimizer,
              " does not support sparse gradients, please consider SparseAdam instead");
  // torch.optim.SGD's own error, raised here before anything is written instead of half-way through a step.
  TORCH_CHECK(!g.is_sparse() || c.weight_decay == 0, "add(sparse, dense) is not supported. Use add(dense, sparse) "
              "instead. (", c.optimizer, ": weight_decay on a sparse grad)");
  TORCH_CHECK_VALUE(fused || mode == MasterMode::kNone || c.master_weights == MasterWeights::kAuto,
                    c.optimizer, ": ", spelled(c), " needs a parameter dense in memory with a dense grad (the "
                    "fused kernels), but a ", p.scalar_type(), " parameter of shape ", p.sizes(), " has ",
                    g.is_sparse() ? "a sparse grad" : "gaps in memory");
  TORCH_CHECK_VALUE(g.sizes() == p.sizes(), c.optimizer, ": a parameter of shape ", p.sizes(),
                    " has a grad of shape ", g.sizes());
}

// A parameter with a grad that passed check_param, and what the checks found.
struct Checked {
  size_t index;
  const at::Tensor* grad;
  MasterMode mode;
  bool fused;
};

// check_group's checks, recording each parameter that has a grad.
std::vector<Checked> check_params(const GroupConfig& c, at::TensorList params) {
  check_config(c);
  std::vector<Checked> checked;
  checked.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& grad = p.grad();
    if (grad.defined()) {
      const MasterMode mode = master_mode(c, p);
      check_param(c, p, grad, mode);
      checked.push_back({i, &grad, mode, takes_fused(p, grad)});
    }
  }
  return checked;
}

}  // namespace

void check_group(const GroupConfig& c, at::TensorList params) { check_params(c, params); }

void step(const GroupConfig& c, at::TensorList params, const std::vector<ParamState*>& states,
          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK_VALUE(states.size() == params.size(), c.optimizer, ": ", params.size(), " parameters but ",
                    states.size(), " states");
  // Every parameter is checked (as check_group does) before any state is completed: completing a remainder from
  // a master rewrites the BF16 weight.
  const std::vector<Checked> checked = check_params(c, params);
  // Fused calls by (device, master mode), in order of first appearance.
  std::vector<std::tuple<at::Device, MasterMode, std::vector<Entry>>> buckets;
  std::vector<Entry> single;
  // (grad, staging copy in the parameter's layout); a deque: entries point into it
  std::deque<std::pair<at::Tensor, at::Tensor>> staged;
  // A single-tensor parameter's state (torch.optim's format) must be whole.
  for (const Checked& k : checked) {
    const ParamState& s = *states[k.index];
    if (!k.fused && c.algorithm == Algorithm::kAdam &&
        (s.step.defined() || s.exp_avg.defined() || s.exp_avg_sq.defined())) {
      TORCH_CHECK_VALUE(s.step.defined() && s.exp_avg.defined() && s.exp_avg_sq.defined(), c.optimizer,
                        ": the state of params[", k.index, "] has only some of step, exp_avg and exp_avg_sq");
    }
  }
  for (const Checked& k : checked) {
    const at::Tensor& p = params[k.index];
    const at::Tensor* grad = k.grad;
    ParamState& s = *states[k.index];
    if (!k.fused) {
      single.push_back({&p, grad, &s});
      continue;
    }
    if (!(grad->is_contiguous() && p.is_contiguous()) && grad->strides() != p.strides()) {
      // The kernels read the grad in the parameter's layout: a staging copy for such (rare) grads.
      staged.emplace_back(*grad, at::empty_like(p).copy_(*grad));
      grad = &staged.back().second;
    }
    const MasterMode mode = k.mode;
    const bool stateless = c.algorithm == Algorithm::kSGD && c.momentum == 0 && mode == MasterMode::kNone && s.empty();
    if (!stateless) {
      complete_state(c, p, s, mode);
    }
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const auto& b) {
      return std::get<0>(b) == p.device() && std::get<1>(b) == mode;
    });
    if (it == buckets.end()) {
      buckets.emplace_back(p.device(), mode, std::vector<Entry>{});
      it = std::prev(buckets.end());
    }
    std::get<2>(*it).push_back({&p, grad, &s});
  }
  for (const auto& [device, mode, entries] : buckets) {
    fused_call(c, device, mode, entries, grad_scale, found_inf);
  }
  if (grad_scale && c.write_unscaled_grads) {
    for (auto& [grad, staging] : staged) {
      grad.copy_(staging);  // the unscaled grads, as torch's fused optimizers leave them
    }
  }
  if (!single.empty()) {
    single_tensor_step(c, single, grad_scale, found_inf);
  }
}

at::Tensor global_grad_norm(at::TensorList grads, const std::optional<at::Tensor>& grad_scale) {
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> by_device;
  for (const auto& g : grads) {
    if (!g.defined()) {
      continue;
    }
    auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& d) { return d.first == g.device(); });
    if (it == by_device.end()) {
      by_device.emplace_back(g.device(), std::vector<at::Tensor>{});
      it = std::prev(by_device.end());
    }
    it->second.push_back(g);
  }
  if (by_device.empty()) {
    return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
  }
  if (by_device.size() == 1) {
    return ampkit::grad_norm(by_device[0].second, on_device(grad_scale, by_device[0].first));
  }
  std::vector<at::Tensor> norms;
  for (const auto& [device, list] : by_device) {
    norms.push_back(ampkit::grad_norm(list, on_device(grad_scale, device)).to(by_device[0].first, at::kDouble));
  }
  return at::stack(norms).square().sum().sqrt().to(at::kFloat);
}

void init_master(const at::Tensor& param, ParamState& state) { state.master_param = fp32_copy(param); }

at::Tensor remainder_of(const at::Tensor& param, const at::Tensor& master) {
  TORCH_CHECK_VALUE(param.scalar_type() == at::kBFloat16 && master.scalar_type() == at::kFloat &&
                        param.sizes() == master.sizes(),
                    "ampkit::optim::core::remainder_of: expected a BFloat16 parameter and an FP32 master of its "
                    "shape, but got ", param.scalar_type(), " ", param.sizes(), " and ", master.scalar_type(), " ",
                    master.sizes());
  const at::Tensor weight16 = param.detach();
  const at::Tensor bits = master.contiguous().view(at::kInt).to(at::kLong).bitwise_and(0xFFFFFFFFLL);
  const at::Tensor high = weight16.contiguous().view(at::kShort).to(at::kLong).bitwise_and(0xFFFF).__lshift__(16);
  at::Tensor rem = bits - high;
  const at::Tensor foreign = rem.lt(-32768).logical_or(rem.gt(32768));
  const at::Tensor split_weight = (bits.__rshift__(16) + bits.bitwise_and(0xFFFF).__rshift__(15)).bitwise_and(0xFFFF);
  const at::Tensor split_rem = bits.bitwise_and(0xFFFF);
  const at::Tensor weight = at::where(foreign, split_weight, high.__rshift__(16));
  rem = at::where(foreign, split_rem, rem.clamp_max(32767));
  weight16.view(at::kShort).copy_(weight.to(at::kShort).view(param.sizes()));  // the same bits unless foreign
  return at::empty_like(param, at::TensorOptions().dtype(at::kShort), at::MemoryFormat::Preserve)
      .copy_(rem.to(at::kShort).view(param.sizes()));
}

at::Tensor master_from_remainder(const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK_VALUE(param.scalar_type() == at::kBFloat16 && remainder.scalar_type() == at::kShort &&
                        param.sizes() == remainder.sizes(),
                    "ampkit::optim::core::master_from_remainder: expected a BFloat16 parameter and an int16 "
                    "remainder of its shape, but got ", param.scalar_type(), " ", param.sizes(), " and ",
                    remainder.scalar_type(), " ", remainder.sizes());
  const at::Tensor bits =
      param.detach().contiguous().view(at::kShort).to(at::kInt).__lshift__(16) + remainder.contiguous().to(at::kInt);
  return bits.view(at::kFloat).view(param.sizes());
}

void check_loaded_state(const GroupConfig& c, const std::string& where, const at::Tensor& p,
                        const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  const std::string prefix = std::string(c.optimizer) + ".load_state_dict: " + where;
  bool has[3] = {false, false, false};  // step, exp_avg, exp_avg_sq
  for (const auto& [name, value] : entries) {
    if (name == "step") {
      TORCH_CHECK_VALUE(value.numel() == 1, prefix, "['step'] must have one element, but has ", value.numel());
    } else if (ParamState().entry(name) != nullptr) {
      TORCH_CHECK_VALUE(value.sizes() == p.sizes(), prefix, "['", name, "'] must have the parameter's shape ",
                        p.sizes(), ", but has ", value.sizes());
    }
    if (ParamState().entry(name) != nullptr) {
      if (fp32_entry(name)) {
        TORCH_CHECK_VALUE(value.is_floating_point() || (value.is_complex() && p.is_complex()), prefix, "['", name,
                          "'] must be a floating tensor, but is ", value.scalar_type());
      } else {
        TORCH_CHECK_VALUE(value.scalar_type() == at::kShort, prefix, "['", name, "'] must be int16, but is ",
                          value.scalar_type());
      }
    }
    has[0] |= name == "step";
    has[1] |= name == "exp_avg";
    has[2] |= name == "exp_avg_sq";
  }
  if (c.algorithm != Algorithm::kSGD && (has[0] || has[1] || has[2])) {
    TORCH_CHECK_VALUE(has[0] && has[1] && has[2], prefix, " has", has[0] ? " step" : "", has[1] ? " exp_avg" : "",
                      has[2] ? " exp_avg_sq" : "", " but not", has[0] ? "" : " step", has[1] ? "" : " exp_avg",
                      has[2] ? "" : " exp_avg_sq", ": a partial state would silently restart from zeros");
  }
}

at::Tensor loaded_entry(const std::string& name, const at::Tensor& value, const at::Tensor& p) {
  const at::ScalarType dtype = fp32_entry(name) ? at::kFloat : value.scalar_type();
  if (value.dim() != 0 && value.sizes() == p.sizes() && value.strides() != p.strides()) {
    // e.g. a channels_last state for a contiguous parameter: the kernels take the parameter's layout.
    return at::empty_like(p, p.options().dtype(dtype)).copy_(value);
  }
  return value.to(p.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace core
}  // namespace ampkit::optim
