// Host entry points of the FP8 kernels on CUDA (Torch-free; the formulas in kernels/fp8_functors.h): they take raw
// pointers and a stream, never synchronise, and return the launch's status for the caller to report.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fp8_functors.h"
#include "amp_launch.h"

namespace ampkit::kernels {

// fp8_quantize over one dense tensor (Fp8QuantizeParams; *p.amax zeroed by the caller; numel > 0).
LaunchStatus launch_fp8_quantize(const Fp8QuantizeParams& p, cudaStream_t stream);

// scale[i] = op(amax[i], 1) for n elements (NOTE [FP8 scale]).
LaunchStatus launch_fp8_compute_scale(const float* amax, float* scale, int64_t n, const Fp8ScaleOp& op,
                                      cudaStream_t stream);

// NOTE [Delayed scaling update] for n (scale, history) pairs on the multi-tensor apply: scales[i] holds one FP32
// per column of histories[i] (op.rows x scales[i].numel, row-major), each column updated by one thread.
LaunchStatus launch_fp8_update_history(const TensorRef* scales, const TensorRef* histories, int64_t n,
                                       const Fp8HistoryOp& op, cudaStream_t stream);

}  // namespace ampkit::kernels
