// CUDA kernels of adamw_step_ and sgd_step_: checks, device guard, current stream, one launch sequence; the skip
// on found_inf happens on the device (no sync).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "optim_common.h"
#include "optim_ops.h"

namespace ampkit::detail {
namespace {

const float* ptr_of(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "ampkit::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void adamw_step_cuda(AMPKIT_ADAMW_STEP_ARGS) {
  AMPKIT_CHECK_ADAMW_STEP("adamw_step_");
  if (params.empty()) {
    return;
  }
  const c10::cuda::OptionalCUDAGuard guard(params[0].device());
  const auto tensors = optim_tensors(lists);
  const kernels::AdamParams hp =
      adam_params(lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay);
  check_launch("adamw_step_", kernels::launch_adam_step(tensors.data(), static_cast<int64_t>(tensors.size()), hp,
                                                        ptr_of(grad_scale), ptr_of(found_inf), ptr_of(lr_tensor),
                                                        c10::cuda::getCurrentCUDAStream()));
}

void sgd_step_cuda(AMPKIT_SGD_STEP_ARGS) {
  AMPKIT_CHECK_SGD_STEP("sgd_step_");
  if (params.empty()) {
    return;
  }
  const c10::cuda::OptionalCUDAGuard guard(params[0].device());
  const auto tensors = optim_tensors(lists);
  const kernels::SgdParams hp = sgd_params(lr, momentum, dampening, weight_decay, nesterov, maximize);
  check_launch("sgd_step_", kernels::launch_sgd_step(tensors.data(), static_cast<int64_t>(tensors.size()), hp,
                                                     ptr_of(grad_scale), ptr_of(found_inf), ptr_of(lr_tensor),
                                                     c10::cuda::getCurrentCUDAStream()));
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  m.impl("adamw_step_", &ampkit::detail::adamw_step_cuda);
  m.impl("sgd_step_", &ampkit::detail::sgd_step_cuda);
}
