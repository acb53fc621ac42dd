// CUDA kernels of unscale_and_check_, check_finite_, cast_divide_, cast_unscale_and_check_, update_scale_ and update_scale_hysteresis_: device guard,
// current stream and the launchers of kernels/cuda (host code only; nvcc compiles the device code in kernels/).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda_launch.h"
#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

void unscale_cuda(const UnscaleArgs& a) {
  const c10::cuda::OptionalCUDAGuard guard(a.found_inf.device());
  check_cuda_device(a.op, a.found_inf.device());
  DenseList dense(a.grads);
  const bool unscale = a.inv_scale.defined();
  float* found_inf = a.found_inf.mutable_data_ptr<float>();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  check_launch(a.op, unscale ? kernels::launch_unscale_and_check(dense.data(), dense.size(), found_inf,
                                                                 a.inv_scale.const_data_ptr<float>(), stream)
                             : kernels::launch_check_finite(dense.data(), dense.size(), found_inf, stream));
  if (unscale) {
    // inv_scale lives on the device, so whether the kernel wrote is not known here: stage back unconditionally.
    dense.write_back();
  }
}

void cast_cuda(const CastArgs& a) {
  if (a.src.empty()) {
    return;
  }
  const bool unscale = a.inv_scale.defined();
  const at::Device device = unscale ? a.found_inf.device() : a.src[0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  DensePairs pairs(a.src, a.out);
  check_launch(a.op, kernels::launch_cast(pairs.src(), pairs.out(), pairs.size(), static_cast<float>(a.divisor),
                                          unscale ? a.inv_scale.const_data_ptr<float>() : nullptr,
                                          unscale ? a.found_inf.mutable_data_ptr<float>() : nullptr,
                                          c10::cuda::getCurrentCUDAStream()));
  pairs.write_back();
}

at::Tensor grad_stats_cuda(const GradStatsArgs& a) {
  const at::Device device = !a.grads.empty() ? a.grads[0].device() : a.inv_scale->device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  at::Tensor out = grad_stats_result(a);
  const DenseList grads(a.grads, /*keep_empty=*/true);  // a row per tensor; read only
  int64_t rows = 0;
  for (int64_t i = 0; i < grads.size(); ++i) {
    rows += kernels::grad_stats_chunks(grads.data()[i].numel);
  }
  const auto options = at::TensorOptions().device(device).dtype(at::kLong);
  at::Tensor counters = at::zeros({grads.size(), kernels::kGradStatsCounterColumns}, options);
  at::Tensor partials = at::empty({std::max<int64_t>(rows, 1), kernels::kNormLanes}, options.dtype(at::kDouble));
  check_launch(a.op,
               kernels::launch_grad_stats(grads.data(), grads.size(),
                                          a.inv_scale.has_value() ? a.inv_scale->const_data_ptr<float>() : nullptr,
                                          out.mutable_data_ptr<double>(),
                                          reinterpret_cast<unsigned long long*>(counters.mutable_data_ptr<int64_t>()),
                                          partials.mutable_data_ptr<double>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

void update_scale_cuda(const UpdateScaleArgs& a) {
  const c10::cuda::OptionalCUDAGuard guard(a.scale.device());
  check_cuda_device(a.op, a.scale.device());
  check_launch(a.op, kernels::launch_update_scale(
                         a.scale.mutable_data_ptr<float>(), a.growth_tracker.mutable_data_ptr<int32_t>(),
                         a.hysteresis_tracker.defined() ? a.hysteresis_tracker.mutable_data_ptr<int32_t>() : nullptr,
                         a.stats.defined() ? a.stats.mutable_data_ptr<int64_t>() : nullptr,
                         a.found_inf.const_data_ptr<float>(), update_scale_op(a), c10::cuda::getCurrentCUDAStream()));
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  using namespace ampkit::detail;
  m.impl("unscale_and_check_", &unscale_and_check_kernel<unscale_cuda>);
  m.impl("check_finite_", &check_finite_kernel<unscale_cuda>);
  m.impl("cast_divide_", &cast_divide_kernel<cast_cuda>);
  m.impl("cast_unscale_and_check_", &cast_unscale_and_check_kernel<cast_cuda>);
  m.impl("grad_stats", &grad_stats_kernel<grad_stats_cuda>);
  m.impl("update_scale_", &update_scale_kernel<update_scale_cuda>);
  m.impl("update_scale_hysteresis_", &update_scale_hysteresis_kernel<update_scale_cuda>);
}
