// The CUDA launches of the fused optimizer steps from checked arguments (op_args.h): the kernels' parameters as
// the GPU gets them (NOTE [torch's scalar tail]: no scalar tail), the device scalars and LAMB's norm scratch.
// optim_cuda.cpp runs these under its device guard on the current stream; the emulated tests run the same
// functions, through the same op kernel templates (op_kernels.h), on the host build of the kernels, so that what
// they compare with the CPU is what the GPU computes. No CUDA runtime call here.
#pragma once

#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "../../kernels/cuda/optim_launch.h"
#include "descriptors.h"
#include "op_args.h"

namespace ampkit::detail {

// NOTE [torch's scalar tail]: the CUDA steps take the vector formulas on every element, as torch's CUDA fused
// kernels (which have no scalar tail loop) do.
constexpr int kCudaOptimTailWidth = 0;

inline kernels::LaunchStatus launch_adam_step_args(const AdamStepArgs& a,
                                                   const std::vector<kernels::OptimTensor>& tensors,
                                                   cudaStream_t stream) {
  const StepScalars& s = a.scalars;
  return kernels::launch_adam_step(tensors.data(), static_cast<int64_t>(tensors.size()),
                                   adam_params(a, a.hparams.lr, kCudaOptimTailWidth), float_ptr(s.grad_scale),
                                   float_ptr(s.found_inf), float_ptr(s.lr_tensor), stream);
}

inline kernels::LaunchStatus launch_sgd_step_args(const SgdStepArgs& a,
                                                  const std::vector<kernels::OptimTensor>& tensors,
                                                  cudaStream_t stream) {
  const StepScalars& s = a.scalars;
  return kernels::launch_sgd_step(tensors.data(), static_cast<int64_t>(tensors.size()),
                                  sgd_params(a, a.hparams.lr, kCudaOptimTailWidth), float_ptr(s.grad_scale),
                                  float_ptr(s.found_inf), float_ptr(s.lr_tensor), stream);
}

// LAMB with norm scratch (NOTE [LAMB passes]) from the caching allocator on the parameters' device (no sync;
// capturable in a CUDA graph). Needs a non-empty list.
inline kernels::LaunchStatus launch_lamb_step_args(const LambStepArgs& a,
                                                   const std::vector<kernels::OptimTensor>& tensors,
                                                   cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  int64_t rows = 0;
  for (const kernels::OptimTensor& t : tensors) {
    rows += kernels::norm_chunks(t.numel);
  }
  const at::Tensor lanes = at::empty({std::max<int64_t>(rows, 1), 2, kernels::kNormLanes},
                                     at::TensorOptions().device(a.lists.params[0].device()).dtype(at::kDouble));
  const at::Tensor sums = at::empty({std::max<int64_t>(rows, 1), 2}, lanes.options());
  const StepScalars& s = a.scalars;
  return kernels::launch_lamb_step(tensors.data(), n, lamb_params(a, a.hparams.lr), float_ptr(s.grad_scale),
                                   float_ptr(s.found_inf), float_ptr(s.lr_tensor), float_ptr(a.grad_norm),
                                   lanes.data_ptr<double>(), sums.data_ptr<double>(), stream);
}

}  // namespace ampkit::detail
