// The kernel of each ampkit op for the dispatcher, written once as a template over the backend's run function:
// it gathers the call's arguments into the op's struct (op_args.h), checks them, and runs the backend
// (`Run == nullptr` for Meta: checks only). m.impl infers each kernel's signature from these templates, and
// static_asserts tie them to the public C++ entry points of <ampkit/ops.h>, so a signature has one spelling per
// role: the schema (registration.cpp), the public declaration, and this file.
#pragma once

#include <ATen/ops/empty_like.h>

#include <tuple>
#include <type_traits>

#include "ampkit/ops.h"
#include "op_args.h"

namespace ampkit::detail {

template <typename Args>
using RunFn = void (*)(const Args&);

template <typename Args, RunFn<Args> Run>
void check_and_run(const Args& args) {
  check(args);
  if constexpr (Run != nullptr) {
    Run(args);
  }
}

// The fused optimizer steps' backends take the kernel descriptors their check built.
template <typename Args>
using StepRunFn = void (*)(const Args&, const std::vector<kernels::OptimTensor>&);

template <typename Args, StepRunFn<Args> Run>
void check_and_run_step(const Args& args) {
  if constexpr (Run != nullptr) {
    std::vector<kernels::OptimTensor> tensors;
    check_and_build_descriptors(args, &tensors);
    Run(args, tensors);
  } else {
    check_and_build_descriptors(args);
  }
}

template <RunFn<UnscaleArgs> Run>
void unscale_and_check_kernel(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_and_run<UnscaleArgs, Run>({"unscale_and_check_", grads, found_inf, inv_scale});
}

template <RunFn<UnscaleArgs> Run>
void check_finite_kernel(at::TensorList tensors, const at::Tensor& found_inf) {
  check_and_run<UnscaleArgs, Run>({"check_finite_", tensors, found_inf, at::Tensor()});
}

template <RunFn<CastArgs> Run>
void cast_divide_kernel(at::TensorList src, at::TensorList out, double divisor) {
  check_and_run<CastArgs, Run>({"cast_divide_", src, out, divisor, at::Tensor(), at::Tensor()});
}

template <RunFn<CastArgs> Run>
void cast_unscale_and_check_kernel(at::TensorList src, at::TensorList out, const at::Tensor& found_inf,
                                   const at::Tensor& inv_scale) {
  check_and_run<CastArgs, Run>({"cast_unscale_and_check_", src, out, 1.0, found_inf, inv_scale});
}

template <at::Tensor (*Run)(const GradStatsArgs&)>
at::Tensor grad_stats_kernel(at::TensorList grads, const std::optional<at::Tensor>& inv_scale) {
  const GradStatsArgs args{"grad_stats", grads, inv_scale};
  check(args);
  return Run(args);
}

// The shape of grad_stats' result, on the device of its arguments (the Meta kernel's whole work).
at::Tensor grad_stats_result(const GradStatsArgs& a);

template <RunFn<UpdateScaleArgs> Run>
void update_scale_kernel(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                         double growth_factor, double backoff_factor, int64_t growth_interval) {
  check_and_run<UpdateScaleArgs, Run>({"update_scale_", scale, growth_tracker, at::Tensor(), at::Tensor(), found_inf,
                                       growth_factor, backoff_factor, growth_interval});
}

template <RunFn<UpdateScaleArgs> Run>
void update_scale_hysteresis_kernel(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                    const at::Tensor& hysteresis_tracker, const at::Tensor& stats,
                                    const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                                    int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale,
                                    bool dynamic) {
  check_and_run<UpdateScaleArgs, Run>({"update_scale_hysteresis_", scale, growth_tracker, hysteresis_tracker, stats,
                                       found_inf, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                                       max_scale, dynamic});
}

template <StepRunFn<AdamStepArgs> Run>
void adamw_step_kernel(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                       at::TensorList param_remainders, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                       at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1,
                       double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                       bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor,
                       bool write_unscaled_grads) {
  check_and_run_step<AdamStepArgs, Run>(
      {"adamw_step_",
       {params, grads, master_params, param_remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps},
       {lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay, /*tail_width=*/0,
        write_unscaled_grads},
       {grad_scale, found_inf, lr_tensor}});
}

template <StepRunFn<SgdStepArgs> Run>
void sgd_step_kernel(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                     at::TensorList param_remainders, at::TensorList momentum_buffers, at::TensorList state_steps,
                     double lr, double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& lr_tensor, bool write_unscaled_grads) {
  check_and_run_step<SgdStepArgs, Run>(
      {"sgd_step_",
       {params, grads, master_params, param_remainders, momentum_buffers, {}, {}, state_steps},
       {lr, momentum, dampening, weight_decay, nesterov, maximize, /*tail_width=*/0, write_unscaled_grads},
       {grad_scale, found_inf, lr_tensor}});
}

template <StepRunFn<LambStepArgs> Run>
void lamb_step_kernel(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                      at::TensorList param_remainders, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList state_steps, double lr, double beta1, double beta2, double weight_decay,
                      double eps, bool bias_correction, bool adam_w_mode, bool grad_averaging, bool use_nvlamb,
                      double max_grad_norm, const std::optional<at::Tensor>& grad_norm,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& lr_tensor) {
  check_and_run_step<LambStepArgs, Run>(
      {"lamb_step_",
       {params, grads, master_params, param_remainders, exp_avgs, exp_avg_sqs, {}, state_steps},
       {lr, beta1, beta2, weight_decay, eps, bias_correction, adam_w_mode, grad_averaging, use_nvlamb, max_grad_norm},
       grad_norm,
       {grad_scale, found_inf, lr_tensor}});
}

template <at::Tensor (*Run)(const GradNormArgs&)>
at::Tensor grad_norm_kernel(at::TensorList grads, const std::optional<at::Tensor>& grad_scale) {
  const GradNormArgs args{"grad_norm", grads, grad_scale};
  check(args);
  return Run(args);
}

// The 0-dim FP32 result of grad_norm on the device of its arguments (the Meta kernel's whole work).
at::Tensor grad_norm_result(const GradNormArgs& a);

// fp8_quantize's results (q, amax, q_t), allocated on x's device: amax zeroed, q_t only with transpose.
using Fp8QuantizeResult = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>>;
Fp8QuantizeResult fp8_quantize_result(const Fp8QuantizeArgs& a);
// The quantize functor's parameters for checked arguments, the CPU's and the CUDA kernel's alike: `x` and `scale`
// are the contiguous tensors the kernel reads (the caller keeps them alive), `out` the op's results.
kernels::Fp8QuantizeParams fp8_quantize_params(const Fp8QuantizeArgs& a, const at::Tensor& x, const at::Tensor& scale,
                                               const Fp8QuantizeResult& out);

template <void (*Run)(const Fp8QuantizeArgs&, const Fp8QuantizeResult&)>
Fp8QuantizeResult fp8_quantize_kernel(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                                      bool transpose) {
  const Fp8QuantizeArgs args{"fp8_quantize", x, scale, dtype, transpose};
  check(args);
  Fp8QuantizeResult out = fp8_quantize_result(args);
  if constexpr (Run != nullptr) {
    Run(args, out);
  }
  return out;
}

template <void (*Run)(const Fp8ComputeScaleArgs&, const at::Tensor&)>
at::Tensor fp8_compute_scale_kernel(const at::Tensor& amax, double fp8_max, double margin, double epsilon,
                                    bool power_of_2) {
  const Fp8ComputeScaleArgs args{"fp8_compute_scale", amax, fp8_max, margin, epsilon, power_of_2};
  check(args);
  at::Tensor scale = at::empty_like(amax, at::MemoryFormat::Contiguous);
  if constexpr (Run != nullptr) {
    Run(args, scale);
  }
  return scale;
}

template <RunFn<Fp8UpdateArgs> Run>
void fp8_update_amax_history_and_scale_kernel(at::TensorList amax_histories, at::TensorList scales,
                                              c10::string_view amax_compute_algo, c10::ArrayRef<double> fp8_maxes,
                                              double margin) {
  check_and_run<Fp8UpdateArgs, Run>({"fp8_update_amax_history_and_scale_", amax_histories, scales,
                                     std::string_view(amax_compute_algo.data(), amax_compute_algo.size()), fp8_maxes,
                                     margin});
}

// Each kernel has exactly the signature of its public entry point.
static_assert(std::is_same_v<decltype(unscale_and_check_kernel<nullptr>), decltype(ampkit::unscale_and_check_)>);
static_assert(std::is_same_v<decltype(check_finite_kernel<nullptr>), decltype(ampkit::check_finite_)>);
static_assert(std::is_same_v<decltype(cast_divide_kernel<nullptr>), decltype(ampkit::cast_divide_)>);
static_assert(
    std::is_same_v<decltype(cast_unscale_and_check_kernel<nullptr>), decltype(ampkit::cast_unscale_and_check_)>);
static_assert(std::is_same_v<decltype(grad_stats_kernel<grad_stats_result>), decltype(ampkit::grad_stats)>);
static_assert(std::is_same_v<decltype(update_scale_kernel<nullptr>), decltype(ampkit::update_scale_)>);
static_assert(
    std::is_same_v<decltype(update_scale_hysteresis_kernel<nullptr>), decltype(ampkit::update_scale_hysteresis_)>);
static_assert(std::is_same_v<decltype(adamw_step_kernel<nullptr>), decltype(ampkit::adamw_step_)>);
static_assert(std::is_same_v<decltype(sgd_step_kernel<nullptr>), decltype(ampkit::sgd_step_)>);
static_assert(std::is_same_v<decltype(lamb_step_kernel<nullptr>), decltype(ampkit::lamb_step_)>);
static_assert(std::is_same_v<decltype(grad_norm_kernel<grad_norm_result>), decltype(ampkit::grad_norm)>);
static_assert(std::is_same_v<decltype(fp8_quantize_kernel<nullptr>), decltype(ampkit::fp8_quantize)>);
static_assert(std::is_same_v<decltype(fp8_compute_scale_kernel<nullptr>), decltype(ampkit::fp8_compute_scale)>);
static_assert(std::is_same_v<decltype(fp8_update_amax_history_and_scale_kernel<nullptr>),
                             decltype(ampkit::fp8_update_amax_history_and_scale_)>);

}  // namespace ampkit::detail
