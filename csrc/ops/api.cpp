// The typed C++ entry points of <ampkit/ops.h>: thin calls through the dispatcher.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/version.h>

#include "../ops/cpu/amp_cpu_loops.hpp"
#include "ampkit/ops.h"

namespace ampkit {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

void unscale_and_check_(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  static const auto op =
      find_op<void(at::TensorList, const at::Tensor&, const at::Tensor&)>("ampkit::unscale_and_check_");
  op.call(grads, found_inf, inv_scale);
}

void check_finite_(at::TensorList tensors, const at::Tensor& found_inf) {
  static const auto op = find_op<void(at::TensorList, const at::Tensor&)>("ampkit::check_finite_");
  op.call(tensors, found_inf);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval) {
  static const auto op =
      find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, int64_t)>(
          "ampkit::update_scale_");
  op.call(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
}

void update_scale_hysteresis_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                              const at::Tensor& hysteresis_tracker, const at::Tensor& stats,
                              const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                              int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale,
                              bool dynamic) {
  static const auto op =
      find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   double, double, int64_t, int64_t, double, double, bool)>("ampkit::update_scale_hysteresis_");
  op.call(scale, growth_tracker, hysteresis_tracker, stats, found_inf, growth_factor, backoff_factor,
          growth_interval, hysteresis, min_scale, max_scale, dynamic);
}

void adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                 at::TensorList param_remainders, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,
                 double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                 bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor) {
  static const auto op =
      find_op<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                   at::TensorList, at::TensorList, double, double, double, double, double, bool, bool, bool,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&)>("ampkit::adamw_step_");
  op.call(params, grads, master_params, param_remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, decoupled_weight_decay, grad_scale, found_inf, lr_tensor);
}

void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
               at::TensorList param_remainders, at::TensorList momentum_buffers, at::TensorList state_steps, double lr, double momentum,
               double dampening, double weight_decay, bool nesterov, bool maximize,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& lr_tensor) {
  static const auto op =
      find_op<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                   double, double, double, double, bool, bool, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>(
          "ampkit::sgd_step_");
  op.call(params, grads, master_params, param_remainders, momentum_buffers, state_steps, lr, momentum, dampening, weight_decay, nesterov,
          maximize, grad_scale, found_inf, lr_tensor);
}

BuildInfo build_info() {
#if defined(AMPKIT_WITH_CUDA)
  constexpr bool kCuda = true;
  constexpr const char* kArchs = AMPKIT_CUDA_ARCHS_STRING;
#else
  constexpr bool kCuda = false;
  constexpr const char* kArchs = "";
#endif
  return BuildInfo{kCuda, kArchs, detail::cpu_loop_isa(), TORCH_VERSION};
}

}  // namespace ampkit
