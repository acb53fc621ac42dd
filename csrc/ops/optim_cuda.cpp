// CUDA kernels of adamw_step_ and sgd_step_: device guard, current stream, one launch sequence; the skip on
// found_inf happens on the device (no sync).
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
void step_cuda(const Args& a, const Params& hparams, Launch launch) {
  if (a.lists.params.empty()) {
    return;
  }
  const at::Device device = a.lists.params[0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  const auto tensors = optim_tensors(a.lists);
  const StepScalars& s = a.scalars;
  check_launch(a.op, launch(tensors.data(), static_cast<int64_t>(tensors.size()), hparams, float_ptr(s.grad_scale),
                            float_ptr(s.found_inf), float_ptr(s.lr_tensor), c10::cuda::getCurrentCUDAStream()));
}

void adam_step_cuda(const AdamStepArgs& a) { step_cuda(a, adam_params(a, a.lr, 0), kernels::launch_adam_step); }

void sgd_step_cuda(const SgdStepArgs& a) { step_cuda(a, sgd_params(a, a.lr, 0), kernels::launch_sgd_step); }

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  using namespace ampkit::detail;
  m.impl("adamw_step_", &adamw_step_kernel<adam_step_cuda>);
  m.impl("sgd_step_", &sgd_step_kernel<sgd_step_cuda>);
}
