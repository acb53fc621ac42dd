// CPU kernels of unscale_and_check_, check_finite_ and update_scale_: checks, then the shared loops/functors.
#include <torch/library.h>

#include "../../kernels/amp_functors.h"
#include "checks.h"
#include "cpu/amp_cpu_loops.hpp"

namespace ampkit::detail {
namespace {

void unscale_and_check_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_and_check_args(grads, found_inf, inv_scale);
  DenseList dense(grads);
  const float inv = *inv_scale.const_data_ptr<float>();
  if (cpu_unscale_and_check(dense.data(), dense.size(), inv, /*write=*/true)) {
    *found_inf.mutable_data_ptr<float>() = 1.f;
  }
  if (inv != 1.f) {
    dense.write_back();
  }
}

void check_finite_cpu(at::TensorList tensors, const at::Tensor& found_inf) {
  check_check_finite_args(tensors, found_inf);
  DenseList dense(tensors);
  if (cpu_unscale_and_check(dense.data(), dense.size(), 1.f, /*write=*/false)) {
    *found_inf.mutable_data_ptr<float>() = 1.f;
  }
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval) {
  check_update_scale_args(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
  const kernels::UpdateScaleOp op{growth_factor, backoff_factor, growth_interval};
  op(scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(), *found_inf.const_data_ptr<float>());
}

void update_scale_hysteresis_cpu(AMPKIT_UPDATE_SCALE_HYSTERESIS_ARGS) {
  AMPKIT_CHECK_UPDATE_SCALE_HYSTERESIS();
  const kernels::HysteresisScaleOp op =
      hysteresis_scale_op(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, dynamic);
  op(scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
     hysteresis_tracker.mutable_data_ptr<int32_t>(), stats.mutable_data_ptr<int64_t>(),
     *found_inf.const_data_ptr<float>());
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  m.impl("update_scale_hysteresis_", &ampkit::detail::update_scale_hysteresis_cpu);
  m.impl("unscale_and_check_", &ampkit::detail::unscale_and_check_cpu);
  m.impl("check_finite_", &ampkit::detail::check_finite_cpu);
  m.impl("update_scale_", &ampkit::detail::update_scale_cpu);
}
