// CPU kernels of unscale_and_check_, check_finite_, cast_divide_, cast_unscale_and_check_, update_scale_ and update_scale_hysteresis_: the shared loops
// and functors, after the checks of op_kernels.h.
#include <torch/library.h>

#include "cpu/cpu_loops.h"
#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

void unscale_cpu(const UnscaleArgs& a) {
  DenseList dense(a.grads);
  const bool unscale = a.inv_scale.defined();
  const float inv = unscale ? *a.inv_scale.const_data_ptr<float>() : 1.f;
  if (cpu_loops().unscale_and_check(dense.data(), dense.size(), inv, /*write=*/unscale)) {
    *a.found_inf.mutable_data_ptr<float>() = 1.f;
  }
  if (unscale && inv != 1.f) {
    dense.write_back();
  }
}

void cast_cpu(const CastArgs& a) {
  DensePairs pairs(a.src, a.out);
  const bool unscale = a.inv_scale.defined();
  const auto op = unscale ? kernels::CastOp::multiply_by(*a.inv_scale.const_data_ptr<float>())
                          : kernels::CastOp::divide_by(static_cast<float>(a.divisor));
  if (cpu_loops().cast_pass(pairs.src(), pairs.out(), pairs.size(), op, /*check=*/unscale)) {
    *a.found_inf.mutable_data_ptr<float>() = 1.f;
  }
  pairs.write_back();
}

at::Tensor grad_stats_cpu(const GradStatsArgs& a) {
  at::Tensor out = grad_stats_result(a);
  const DenseList grads(a.grads, /*keep_empty=*/true);  // a row per tensor; read only
  const float inv = a.inv_scale.has_value() ? *a.inv_scale->const_data_ptr<float>() : 1.f;
  cpu_loops().grad_stats(grads.data(), grads.size(), inv, out.mutable_data_ptr<double>());
  return out;
}

void update_scale_cpu(const UpdateScaleArgs& a) {
  update_scale_op(a)(a.scale.mutable_data_ptr<float>(), a.growth_tracker.mutable_data_ptr<int32_t>(),
                     a.hysteresis_tracker.defined() ? a.hysteresis_tracker.mutable_data_ptr<int32_t>() : nullptr,
                     a.stats.defined() ? a.stats.mutable_data_ptr<int64_t>() : nullptr,
                     *a.found_inf.const_data_ptr<float>());
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  using namespace ampkit::detail;
  m.impl("unscale_and_check_", &unscale_and_check_kernel<unscale_cpu>);
  m.impl("check_finite_", &check_finite_kernel<unscale_cpu>);
  m.impl("cast_divide_", &cast_divide_kernel<cast_cpu>);
  m.impl("cast_unscale_and_check_", &cast_unscale_and_check_kernel<cast_cpu>);
  m.impl("grad_stats", &grad_stats_kernel<grad_stats_cpu>);
  m.impl("update_scale_", &update_scale_kernel<update_scale_cpu>);
  m.impl("update_scale_hysteresis_", &update_scale_hysteresis_kernel<update_scale_cpu>);
}
