// Declarations of the per-instruction-set CPU loops (amp_cpu_loops.h) and the dispatcher that picks one at run
// time from what the processor supports.
#pragma once

#include <cstdint>

#include "../../../kernels/common.h"
#include "../../../kernels/optim_launch.h"

namespace ampkit::detail {

// Elements per CPU work item, and the list size under which the loop runs on the calling thread alone.
constexpr int64_t kCpuChunk = 32768;
constexpr int64_t kCpuParallelThreshold = 65536;

namespace cpu_default {
bool unscale_and_check(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write);
void adam_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale);
void sgd_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale);
}
namespace cpu_avx2 {
bool unscale_and_check(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write);
void adam_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale);
void sgd_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale);
}
namespace cpu_avx512 {
bool unscale_and_check(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write);
void adam_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale);
void sgd_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale);
}

// Checks every element of `tensors` for Inf/NaN and, when `write` and inv_scale != 1, multiplies it by
// inv_scale in place. Returns whether any element read was non-finite.
bool cpu_unscale_and_check(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write);

// One fused Adam/AdamW or SGD step over `tensors` on the CPU (grads divided by grad_scale), then step += 1.
void cpu_adam_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale);
void cpu_sgd_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale);

// The instruction set the CPU loops run with on this machine ("avx512", "avx2" or "default").
const char* cpu_loop_isa();

}  // namespace ampkit::detail
