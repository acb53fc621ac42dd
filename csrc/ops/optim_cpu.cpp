// CPU kernels of adamw_step_ and sgd_step_: checks, the device-side skip (found_inf), then the shared loops.
#include <torch/library.h>

#include "cpu/amp_cpu_loops.hpp"
#include "optim_common.h"
#include "optim_ops.h"

namespace ampkit::detail {
namespace {

bool skipped(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && *found_inf->const_data_ptr<float>() != 0.f;
}

float scale_of(const std::optional<at::Tensor>& grad_scale) {
  return grad_scale.has_value() ? *grad_scale->const_data_ptr<float>() : 1.f;
}

void adamw_step_cpu(AMPKIT_ADAMW_STEP_ARGS) {
  AMPKIT_CHECK_ADAMW_STEP("adamw_step_");
  if (skipped(found_inf)) {
    return;
  }
  const auto tensors = optim_tensors(lists);
  const double step_lr = lr_tensor.has_value() ? *lr_tensor->const_data_ptr<float>() : lr;
  const kernels::AdamParams hp =
      adam_params(step_lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay);
  cpu_adam_step(tensors.data(), static_cast<int64_t>(tensors.size()), hp, scale_of(grad_scale));
}

void sgd_step_cpu(AMPKIT_SGD_STEP_ARGS) {
  AMPKIT_CHECK_SGD_STEP("sgd_step_");
  if (skipped(found_inf)) {
    return;
  }
  const auto tensors = optim_tensors(lists);
  const double step_lr = lr_tensor.has_value() ? *lr_tensor->const_data_ptr<float>() : lr;
  const kernels::SgdParams hp = sgd_params(step_lr, momentum, dampening, weight_decay, nesterov, maximize);
  cpu_sgd_step(tensors.data(), static_cast<int64_t>(tensors.size()), hp, scale_of(grad_scale));
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  m.impl("adamw_step_", &ampkit::detail::adamw_step_cpu);
  m.impl("sgd_step_", &ampkit::detail::sgd_step_cpu);
}
