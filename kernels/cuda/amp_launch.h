// Host entry points of the AMP gradient kernels on CUDA: Torch-free, they take raw tensor descriptors and a
// stream, never synchronise, and return the launch's cudaError_t for the caller to report.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../amp_functors.h"
#include "../common.h"

namespace ampkit::kernels {

// What a launcher did before it failed: multi-tensor launchers queue several kernels for long lists, and an
// error after the first leaves the tensors of the earlier launches updated (or about to be).
struct LaunchStatus {
  cudaError_t error = cudaSuccess;
  int64_t launches = 0;  // kernels queued successfully
  bool ok() const { return error == cudaSuccess; }
};

// Multiplies every element of `grads` by *inv_scale in place (reads only, when *inv_scale == 1) and stores
// 1.0f to *found_inf if any element read is Inf or NaN. *found_inf is never cleared.
LaunchStatus launch_unscale_and_check(const TensorRef* grads, int64_t n, float* found_inf, const float* inv_scale,
                                      cudaStream_t stream);

// Stores 1.0f to *found_inf if any element of `tensors` is Inf or NaN; writes nothing else.
LaunchStatus launch_check_finite(const TensorRef* tensors, int64_t n, float* found_inf, cudaStream_t stream);

// NOTE [Compressed all-reduce passes]: out[i] = the cast of src[i], element for element (both dense, of one numel
// each pair; FP16, BF16 or FP32 each), divided by `divisor` when inv_scale is null (cast_divide_); otherwise
// multiplied by *inv_scale (read on the device), storing 1.0f to *found_inf if any element of Out(src) is Inf or
// NaN (never clearing it: cast_unscale_and_check_).
LaunchStatus launch_cast(const TensorRef* src, const TensorRef* out, int64_t n, float divisor, const float* inv_scale,
                         float* found_inf, cudaStream_t stream);

// NOTE [Gradient statistics]: out is n rows of kGradStatsColumns doubles (written whole, zero-size tensors
// included). Workspace, zeroed by the caller: `counters`, n rows of kGradStatsCounterColumns uint64, and
// `partials`, kNormLanes doubles per chunk of every tensor (grad_stats_chunks). `inv_scale` may be null (1).
LaunchStatus launch_grad_stats(const TensorRef* grads, int64_t n, const float* inv_scale, double* out,
                               unsigned long long* counters, double* partials, cudaStream_t stream);

// Columns of one counter row: [0] the max's float bits, [1] the tensor's first partials row, [2] non-finite count,
// [3] zeros, the histogram, then the tensor's numel.
constexpr int kGradStatsCounterColumns = kGradStatsColumns + 1;

// Rows of kNormLanes partial sums a tensor of `numel` elements needs (its chunks of the multi-tensor apply).
int64_t grad_stats_chunks(int64_t numel);

// One single-thread kernel applying UpdateScaleOp (hysteresis_tracker and stats may be null, see UpdateScaleOp).
LaunchStatus launch_update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, int64_t* stats,
                                 const float* found_inf, const UpdateScaleOp& op, cudaStream_t stream);

}  // namespace ampkit::kernels
