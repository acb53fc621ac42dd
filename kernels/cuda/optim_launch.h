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
LaunchStatus launch_adam_step(const OptimTensor* tensors, int64_t n, const AdamParams& params, const float* grad_scale,
                              const float* found_inf, const float* lr, cudaStream_t stream);

// One SGD step over all tensors (momentum buffers in exp_avg), same skipping rule.
LaunchStatus launch_sgd_step(const OptimTensor* tensors, int64_t n, const SgdParams& params, const float* grad_scale,
                             const float* found_inf, const float* lr, cudaStream_t stream);

// NOTE [LAMB passes]: the chunks of a tensor of `numel` elements, i.e. its rows of norm scratch.
int64_t norm_chunks(int64_t numel);

// *out = the L2 norm of all grads divided by *grad_scale (when given), in the order of NOTE [Deterministic norm]
// with chunk sums added in list order. Scratch: `lanes` (kNormLanes doubles per chunk) and `sums` (one double per
// chunk), chunks summed over norm_chunks() of every tensor.
LaunchStatus launch_grad_norm(const TensorRef* grads, int64_t n, const float* grad_scale, float* out, double* lanes,
                              double* sums, cudaStream_t stream);

// One LAMB step over all tensors (exp_avg / exp_avg_sq the moments, max_exp_avg_sq unused), grads divided by
// *grad_scale and clipped by *grad_norm (both may be null), then each step count += 1; nothing is written when
// *found_inf != 0. Scratch: `lanes` (2 * kNormLanes doubles per chunk) and `sums` (2 per chunk).
LaunchStatus launch_lamb_step(const OptimTensor* tensors, int64_t n, const LambParams& params, const float* grad_scale,
                              const float* found_inf, const float* lr, const float* grad_norm, double* lanes,
                              double* sums, cudaStream_t stream);

}  // namespace ampkit::kernels
