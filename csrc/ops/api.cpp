// The typed C++ entry points of <ampkit/ops.h>: thin calls through the dispatcher, each typed by the declaration
// of its own entry point.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/version.h>

#include <cmath>

#include "ampkit/ops.h"
#include "cpu/cpu_loops.h"
#include "cuda_archs.h"
#include "op_args.h"

namespace ampkit {
namespace {

template <auto& Fn>
const auto& op_handle(const char* name) {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<std::remove_reference_t<decltype(Fn)>>();
  return handle;
}

}  // namespace

void unscale_and_check_(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  op_handle<unscale_and_check_>("ampkit::unscale_and_check_").call(grads, found_inf, inv_scale);
}

void check_finite_(at::TensorList tensors, const at::Tensor& found_inf) {
  op_handle<check_finite_>("ampkit::check_finite_").call(tensors, found_inf);
}

void cast_divide_(at::TensorList src, at::TensorList out, double divisor) {
  if (src.empty() && out.empty()) {  // no tensor to dispatch on: checked here, nothing to do
    TORCH_CHECK_VALUE(std::isfinite(divisor) && divisor > 0 && std::isfinite(static_cast<float>(divisor)) &&
                          static_cast<float>(divisor) > 0,
                      "ampkit::cast_divide_: divisor must be a finite number > 0 that FP32 holds, but got ", divisor);
    return;
  }
  op_handle<cast_divide_>("ampkit::cast_divide_").call(src, out, divisor);
}

void cast_unscale_and_check_(at::TensorList src, at::TensorList out, const at::Tensor& found_inf,
                             const at::Tensor& inv_scale) {
  op_handle<cast_unscale_and_check_>("ampkit::cast_unscale_and_check_").call(src, out, found_inf, inv_scale);
}

at::Tensor grad_stats(at::TensorList grads, const std::optional<at::Tensor>& inv_scale) {
  if (grads.empty() && !inv_scale.has_value()) {  // no tensor to dispatch on
    return at::empty({0, kGradStatsColumns}, at::TensorOptions().dtype(at::kDouble));
  }
  return op_handle<grad_stats>("ampkit::grad_stats").call(grads, inv_scale);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval) {
  op_handle<update_scale_>("ampkit::update_scale_")
      .call(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
}

void update_scale_hysteresis_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                              const at::Tensor& hysteresis_tracker, const at::Tensor& stats,
                              const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                              int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale,
                              bool dynamic) {
  op_handle<update_scale_hysteresis_>("ampkit::update_scale_hysteresis_")
      .call(scale, growth_tracker, hysteresis_tracker, stats, found_inf, growth_factor, backoff_factor, growth_interval,
            hysteresis, min_scale, max_scale, dynamic);
}

void adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                 at::TensorList param_remainders, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& lr_tensor, bool write_unscaled_grads) {
  op_handle<adamw_step_>("ampkit::adamw_step_")
      .call(params, grads, master_params, param_remainders, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr,
            beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay, grad_scale, found_inf,
            lr_tensor, write_unscaled_grads);
}

void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
               at::TensorList param_remainders, at::TensorList momentum_buffers, at::TensorList state_steps, double lr,
               double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& lr_tensor, bool write_unscaled_grads) {
  op_handle<sgd_step_>("ampkit::sgd_step_")
      .call(params, grads, master_params, param_remainders, momentum_buffers, state_steps, lr, momentum, dampening,
            weight_decay, nesterov, maximize, grad_scale, found_inf, lr_tensor, write_unscaled_grads);
}

void lamb_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                at::TensorList param_remainders, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList state_steps, double lr, double beta1, double beta2, double weight_decay, double eps,
                bool bias_correction, bool adam_w_mode, bool grad_averaging, bool use_nvlamb, double max_grad_norm,
                const std::optional<at::Tensor>& grad_norm, const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor) {
  op_handle<lamb_step_>("ampkit::lamb_step_")
      .call(params, grads, master_params, param_remainders, exp_avgs, exp_avg_sqs, state_steps, lr, beta1, beta2,
            weight_decay, eps, bias_correction, adam_w_mode, grad_averaging, use_nvlamb, max_grad_norm, grad_norm,
            grad_scale, found_inf, lr_tensor);
}

at::Tensor grad_norm(at::TensorList grads, const std::optional<at::Tensor>& grad_scale) {
  if (grads.empty() && !grad_scale.has_value()) {  // no tensor to dispatch on
    return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
  }
  return op_handle<grad_norm>("ampkit::grad_norm").call(grads, grad_scale);
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> fp8_quantize(const at::Tensor& x, const at::Tensor& scale,
                                                                           at::ScalarType dtype, bool transpose) {
  return op_handle<fp8_quantize>("ampkit::fp8_quantize").call(x, scale, dtype, transpose);
}

at::Tensor fp8_compute_scale(const at::Tensor& amax, double fp8_max, double margin, double epsilon, bool power_of_2) {
  return op_handle<fp8_compute_scale>("ampkit::fp8_compute_scale").call(amax, fp8_max, margin, epsilon, power_of_2);
}

void fp8_update_amax_history_and_scale_(at::TensorList amax_histories, at::TensorList scales,
                                        c10::string_view amax_compute_algo, c10::ArrayRef<double> fp8_maxes,
                                        double margin) {
  if (amax_histories.empty() && scales.empty()) {  // no tensor to dispatch on: checked here, nothing to do
    detail::check(detail::Fp8UpdateArgs{"fp8_update_amax_history_and_scale_", amax_histories, scales,
                                        std::string_view(amax_compute_algo.data(), amax_compute_algo.size()), fp8_maxes,
                                        margin});
    return;
  }
  op_handle<fp8_update_amax_history_and_scale_>("ampkit::fp8_update_amax_history_and_scale_")
      .call(amax_histories, scales, amax_compute_algo, fp8_maxes, margin);
}

at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      c10::string_view fp8_format, double amax_epsilon, bool power_of_2,
                      std::optional<at::ScalarType> out_dtype, c10::string_view granularity) {
  return op_handle<fp8_linear>("ampkit::fp8_linear")
      .call(input, weight, bias, fp8_format, amax_epsilon, power_of_2, out_dtype, granularity);
}

at::Tensor fp8_linear_delayed(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              at::TensorList amax_histories, at::TensorList scales, c10::string_view fp8_format,
                              std::optional<at::ScalarType> out_dtype) {
  return op_handle<fp8_linear_delayed>("ampkit::fp8_linear_delayed")
      .call(input, weight, bias, amax_histories, scales, fp8_format, out_dtype);
}

GradStats grad_stats_by_name(const at::Tensor& rows) {
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(1) == kGradStatsColumns && rows.scalar_type() == at::kDouble,
                    "ampkit::grad_stats_by_name: rows must be grad_stats' [n, ", kGradStatsColumns,
                    "] float64 rows, but got a ", rows.scalar_type(), " tensor of shape ", rows.sizes());
  return {rows.select(1, 0), rows.select(1, 1), rows.select(1, 2), rows.select(1, 3),
          rows.narrow(1, kGradStatsHistFirst, kGradStatsColumns - kGradStatsHistFirst)};
}

BuildInfo build_info() {
#if defined(AMPKIT_WITH_CUDA)
  constexpr bool kCuda = true;
  constexpr const char* kArchs = AMPKIT_CUDA_ARCHS_STRING;
#else
  constexpr bool kCuda = false;
  constexpr const char* kArchs = "";
#endif
  return BuildInfo{kCuda, kArchs, detail::cpu_loops().isa, TORCH_VERSION, detail::torch_cpu_float_vector_width()};
}

bool cuda_arch_supported(int major, int minor) {
  const BuildInfo info = build_info();
  return info.cuda_compiled && detail::cuda_archs_cover(detail::parse_cuda_archs(info.cuda_archs), major, minor);
}

static_assert(kScaleStatSteps == kernels::kStatSteps && kScaleStatSkipped == kernels::kStatSkipped &&
                  kScaleStatLastOverflow == kernels::kStatLastOverflow &&
                  kScaleStatOverflowsAtMin == kernels::kStatOverflowsAtMin && kScaleStats == kernels::kNumStats,
              "<ampkit/ops.h>'s scale statistics slots are UpdateScaleOp's");
static_assert(kGradStatsColumns == kernels::kGradStatsColumns && kGradStatsHistMinExp == kernels::kGradHistMinExp &&
                  kGradStatsHistFirst == 4,
              "ampkit/ops.h states the grad_stats layout of kernels/amp_functors.h");

}  // namespace ampkit
