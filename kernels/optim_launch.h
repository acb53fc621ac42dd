// Host entry points of the fused optimizer kernels on CUDA (Torch-free; see optim_functors.h for the math).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.h"
#include "optim_functors.h"

namespace ampkit::kernels {

// The streams of one parameter for a fused step. `master`, `remainder`, `exp_avg_sq`, `max_exp_avg_sq` are null
// when unused (at most one of master and remainder is set); `param` and `grad` share a dtype (FP16, BF16 or FP32); every other stream is FP32; `step` points
// at the tensor's FP32 step count.
struct OptimTensor {
  void* param;
  const void* grad;
  float* master;
  int16_t* remainder;  // BF16 params only: the master's low half (NOTE [BF16 weight + 16-bit remainder])
  float* exp_avg;      // Adam: first moment; SGD: momentum buffer
  float* exp_avg_sq;   // Adam only
  float* max_exp_avg_sq;
  float* step;
  int64_t numel;
  DType dtype;
};

// One Adam/AdamW step over all tensors: reads the grads (divided by *grad_scale when given), updates masters and
// moments in FP32 and writes the params (rounded once); then each step count += 1. When *found_inf != 0 nothing
// at all is written.
// `lr` (a device FP32, may be null) replaces params.lr when given.
cudaError_t launch_adam_step(const OptimTensor* tensors, int64_t n, const AdamParams& params, const float* grad_scale,
                             const float* found_inf, const float* lr, cudaStream_t stream);

// One SGD step over all tensors (momentum buffers in exp_avg), same skipping rule.
cudaError_t launch_sgd_step(const OptimTensor* tensors, int64_t n, const SgdParams& params, const float* grad_scale,
                            const float* found_inf, const float* lr, cudaStream_t stream);

}  // namespace ampkit::kernels
