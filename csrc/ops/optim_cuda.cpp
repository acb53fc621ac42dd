// CUDA kernels of adamw_step_, sgd_step_, lamb_step_ and grad_norm: device guard, current stream, one launch sequence; the skip on
// found_inf happens on the device (no sync).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../../kernels/cuda/optim_launch.h"
#include "cuda_launch.h"
#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

// The launch sequence both fused steps share; `launch` is the kernels/cuda launcher of the step.
template <typename Args, typename Params, typename Launch>
void step_cuda(const Args& a, const std::vector<kernels::OptimTensor>& tensors, const Params& hparams,
               Launch launch) {
  if (a.lists.params.empty()) {
    return;
  }
  const at::Device device = a.lists.params[0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  const StepScalars& s = a.scalars;
  check_launch(a.op, launch(tensors.data(), static_cast<int64_t>(tensors.size()), hparams, float_ptr(s.grad_scale),
                            float_ptr(s.found_inf), float_ptr(s.lr_tensor), c10::cuda::getCurrentCUDAStream()));
}

void adam_step_cuda(const AdamStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cuda(a, tensors, adam_params(a, a.lr, 0), kernels::launch_adam_step);
}

void sgd_step_cuda(const SgdStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cuda(a, tensors, sgd_params(a, a.lr, 0), kernels::launch_sgd_step);
}

// Rows of norm scratch (NOTE [LAMB passes]) for tensors of these sizes.
template <typename Numel>
int64_t norm_rows(int64_t n, Numel numel) {
  int64_t rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    rows += kernels::norm_chunks(numel(i));
  }
  return rows;
}

void lamb_step_cuda(const LambStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  if (a.lists.params.empty()) {
    return;
  }
  const at::Device device = a.lists.params[0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t rows = norm_rows(n, [&](int64_t i) { return tensors[i].numel; });
  // Scratch from the caching allocator (no sync; capturable in a CUDA graph).
  const at::Tensor lanes = at::empty({std::max<int64_t>(rows, 1), 2, kernels::kNormLanes},
                                     at::TensorOptions().device(device).dtype(at::kDouble));
  const at::Tensor sums = at::empty({std::max<int64_t>(rows, 1), 2}, lanes.options());
  const StepScalars& s = a.scalars;
  check_launch(a.op, kernels::launch_lamb_step(tensors.data(), n, lamb_params(a, a.lr), float_ptr(s.grad_scale),
                                               float_ptr(s.found_inf), float_ptr(s.lr_tensor), float_ptr(a.grad_norm),
                                               lanes.data_ptr<double>(), sums.data_ptr<double>(),
                                               c10::cuda::getCurrentCUDAStream()));
}

at::Tensor grad_norm_cuda(const GradNormArgs& a) {
  at::Tensor out = grad_norm_result(a);
  const c10::cuda::OptionalCUDAGuard guard(out.device());
  check_cuda_device(a.op, out.device());
  const DenseList grads(a.grads);  // read only
  const int64_t rows = norm_rows(grads.size(), [&](int64_t i) { return grads.data()[i].numel; });
  const at::Tensor lanes = at::empty({std::max<int64_t>(rows, 1), kernels::kNormLanes},
                                     at::TensorOptions().device(out.device()).dtype(at::kDouble));
  const at::Tensor sums = at::empty({std::max<int64_t>(rows, 1)}, lanes.options());
  check_launch(a.op, kernels::launch_grad_norm(grads.data(), grads.size(), float_ptr(a.grad_scale),
                                               out.mutable_data_ptr<float>(), lanes.data_ptr<double>(),
                                               sums.data_ptr<double>(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  using namespace ampkit::detail;
  m.impl("adamw_step_", &adamw_step_kernel<adam_step_cuda>);
  m.impl("sgd_step_", &sgd_step_kernel<sgd_step_cuda>);
  m.impl("lamb_step_", &lamb_step_kernel<lamb_step_cuda>);
  m.impl("grad_norm", &grad_norm_kernel<grad_norm_cuda>);
}
