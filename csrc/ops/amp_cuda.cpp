// CUDA kernels of unscale_and_check_, check_finite_ and update_scale_: checks, device guard, current stream, and
// the launchers of kernels/cuda (host code only; the device code is compiled by nvcc in kernels/).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../kernels/amp_launch.h"
#include "checks.h"

namespace ampkit::detail {
namespace {

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "ampkit::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void unscale_and_check_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_and_check_args(grads, found_inf, inv_scale);
  const c10::cuda::OptionalCUDAGuard guard(found_inf.device());
  DenseList dense(grads);
  check_launch("unscale_and_check_",
               kernels::launch_unscale_and_check(dense.data(), dense.size(), found_inf.mutable_data_ptr<float>(),
                                                 inv_scale.const_data_ptr<float>(),
                                                 c10::cuda::getCurrentCUDAStream()));
  // inv_scale lives on the device, so whether the kernel wrote is not known here: stage back unconditionally.
  dense.write_back();
}

void check_finite_cuda(at::TensorList tensors, const at::Tensor& found_inf) {
  check_check_finite_args(tensors, found_inf);
  const c10::cuda::OptionalCUDAGuard guard(found_inf.device());
  DenseList dense(tensors);
  check_launch("check_finite_", kernels::launch_check_finite(dense.data(), dense.size(),
                                                             found_inf.mutable_data_ptr<float>(),
                                                             c10::cuda::getCurrentCUDAStream()));
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
  check_update_scale_args(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
  const c10::cuda::OptionalCUDAGuard guard(scale.device());
  check_launch("update_scale_",
               kernels::launch_update_scale(scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
                                            found_inf.const_data_ptr<float>(),
                                            kernels::UpdateScaleOp{growth_factor, backoff_factor, growth_interval},
                                            c10::cuda::getCurrentCUDAStream()));
}

void update_scale_hysteresis_cuda(AMPKIT_UPDATE_SCALE_HYSTERESIS_ARGS) {
  AMPKIT_CHECK_UPDATE_SCALE_HYSTERESIS();
  const c10::cuda::OptionalCUDAGuard guard(scale.device());
  const kernels::HysteresisScaleOp op =
      hysteresis_scale_op(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, dynamic);
  check_launch("update_scale_hysteresis_",
               kernels::launch_update_scale_hysteresis(
                   scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
                   hysteresis_tracker.mutable_data_ptr<int32_t>(), stats.mutable_data_ptr<int64_t>(),
                   found_inf.const_data_ptr<float>(), op, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  m.impl("update_scale_hysteresis_", &ampkit::detail::update_scale_hysteresis_cuda);
  m.impl("unscale_and_check_", &ampkit::detail::unscale_and_check_cuda);
  m.impl("check_finite_", &ampkit::detail::check_finite_cuda);
  m.impl("update_scale_", &ampkit::detail::update_scale_cuda);
}
