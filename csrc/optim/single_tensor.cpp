// torch.optim's own single-tensor Adam and SGD formulas, for the parameters ampkit's fused kernels do not take
// (FP64 and complex parameters, sparse grads, parameters with gaps in memory): the path core::step gives them.
#include <ATen/ATen.h>

#include <cmath>

#include "core_internal.h"

namespace ampkit::optim::core::detail {
namespace {

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

}  // namespace

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

}  // namespace ampkit::optim::core::detail
