// CUDA kernels of adamw_step_, sgd_step_, lamb_step_ and grad_norm: device guard, current stream, the launches of
// optim_cuda_launch.h; the skip on found_inf happens on the device (no sync).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda_launch.h"
#include "descriptors.h"
#include "op_kernels.h"
#include "optim_cuda_launch.h"

namespace ampkit::detail {
namespace {

// The device guard, the device check and the current stream around a step's launches (optim_cuda_launch.h).
template <typename Args, typename Launch>
void step_cuda(const Args& a, const std::vector<kernels::OptimTensor>& tensors, Launch launch) {
  if (a.lists.params.empty()) {
    return;
  }
  const at::Device device = a.lists.params[0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  if (a.scalars.lr_tensor.has_value() && a.scalars.lr_tensor->is_cpu()) {
    // A CPU lr_tensor is read here, on the host (a captured CUDA graph keeps the value read at capture).
    Args on_host = a;
    on_host.hparams.lr = static_cast<double>(*float_ptr(a.scalars.lr_tensor));
    on_host.scalars.lr_tensor = std::nullopt;
    check_launch(a.op, launch(on_host, tensors, c10::cuda::getCurrentCUDAStream()));
    return;
  }
  check_launch(a.op, launch(a, tensors, c10::cuda::getCurrentCUDAStream()));
}

void adam_step_cuda(const AdamStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cuda(a, tensors, launch_adam_step_args);
}

void sgd_step_cuda(const SgdStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cuda(a, tensors, launch_sgd_step_args);
}

void lamb_step_cuda(const LambStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cuda(a, tensors, launch_lamb_step_args);
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
