// Host entry points of the AMP gradient kernels on CUDA: Torch-free, they take raw tensor descriptors and a
// stream, never synchronise, and return the launch's cudaError_t for the caller to report.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "amp_functors.h"
#include "common.h"

namespace ampkit::kernels {

// Multiplies every element of `grads` by *inv_scale in place (reads only, when *inv_scale == 1) and stores
// 1.0f to *found_inf if any element read is Inf or NaN. *found_inf is never cleared.
cudaError_t launch_unscale_and_check(const TensorRef* grads, int64_t n, float* found_inf, const float* inv_scale,
                                     cudaStream_t stream);

// Stores 1.0f to *found_inf if any element of `tensors` is Inf or NaN; writes nothing else.
cudaError_t launch_check_finite(const TensorRef* tensors, int64_t n, float* found_inf, cudaStream_t stream);

// One single-thread kernel applying UpdateScaleOp to *scale and *growth_tracker, reading *found_inf.
cudaError_t launch_update_scale(float* scale, int32_t* growth_tracker, const float* found_inf, UpdateScaleOp op,
                                cudaStream_t stream);

// One single-thread kernel applying HysteresisScaleOp (stats: kNumStats int64 slots).
cudaError_t launch_update_scale_hysteresis(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                           int64_t* stats, const float* found_inf, HysteresisScaleOp op,
                                           cudaStream_t stream);

}  // namespace ampkit::kernels
