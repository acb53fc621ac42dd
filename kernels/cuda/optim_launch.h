// Host entry points of the fused optimizer kernels on CUDA (Torch-free; see optim_functors.h for the math and
// common.h for the OptimTensor descriptor).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common.h"
#include "../optim_functors.h"
#include "amp_launch.h"

namespace ampkit::kernels {

// One Adam/AdamW step over all tensors: reads the grads (divided by *grad_scale when given), updates masters and
// moments in FP32 and writes the params (rounded once); then each step count += 1. When *found_inf != 0 nothing
// at all is written. `lr` (a device FP32, may be null) replaces params.lr when given.
LaunchStatus launch_adam_step(const OptimTensor* tensors, int64_t n, const AdamParams& params,
                              const float* grad_scale, const float* found_inf, const float* lr, cudaStream_t stream);

// One SGD step over all tensors (momentum buffers in exp_avg), same skipping rule.
LaunchStatus launch_sgd_step(const OptimTensor* tensors, int64_t n, const SgdParams& params, const float* grad_scale,
                             const float* found_inf, const float* lr, cudaStream_t stream);

}  // namespace ampkit::kernels
