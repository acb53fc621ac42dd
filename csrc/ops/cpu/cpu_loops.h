// The CPU loops of ampkit's ops, compiled once per instruction set (loops_<isa>.cpp, each in its own namespace
// named by AMPKIT_CPU_NS) and picked once per process from what the processor supports (cpu_loops.cpp), as
// ATen's DispatchStub does: one table of entry points per instruction set.
#pragma once

#include <cstdint>

#include "../../../kernels/amp_functors.h"
#include "../../../kernels/common.h"
#include "../../../kernels/fp8_functors.h"
#include "../../../kernels/optim_functors.h"

namespace ampkit::detail {

// Elements per CPU work item, and the list size under which the loop runs on the calling thread alone.
constexpr int64_t kCpuChunk = 32768;
constexpr int64_t kCpuParallelThreshold = 65536;

struct CpuLoops {
  // Checks every element of `tensors` for Inf/NaN and, when `write` and inv_scale != 1, multiplies it by
  // inv_scale in place. Returns whether any element read was non-finite.
  bool (*unscale_and_check)(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write);
  // One fused Adam/AdamW or SGD step over `tensors` (grads divided by grad_scale), then step += 1.
  void (*adam_step)(const kernels::OptimTensor* tensors, int64_t n, const kernels::AdamParams& params,
                    float grad_scale);
  void (*sgd_step)(const kernels::OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale);
  // The compressed all-reduce's cast passes (NOTE [Compressed all-reduce passes]): out[i] = op(float(Out(src[i])))
  // rounded to out's dtype, pairs of one numel. With `check`, returns whether any float(Out(src)) was non-finite.
  bool (*cast_pass)(const kernels::TensorRef* src, const kernels::TensorRef* out, int64_t n, const kernels::CastOp& op,
                    bool check);
  // NOTE [Gradient statistics]: one row of kGradStatsColumns doubles per tensor into `out` (zero-size tensors
  // included: their rows are zeros).
  void (*grad_stats)(const kernels::TensorRef* grads, int64_t n, float inv_scale, double* out);
  // NOTE [LAMB passes]: the global norm of the grads (divided by grad_scale), and one LAMB step over `tensors`
  // (grads divided by grad_scale and clipped by *grad_norm, which may be null), then step += 1.
  float (*grad_norm)(const kernels::TensorRef* grads, int64_t n, float grad_scale);
  void (*lamb_step)(const kernels::OptimTensor* tensors, int64_t n, const kernels::LambParams& params, float grad_scale,
                    const float* grad_norm);
  // NOTE [Saturating FP8 cast]: rows [begin, end) of an fp8_quantize pass (q, and q_t when asked for), returning
  // their amax as kernels::fp8_abs_bits.
  uint32_t (*fp8_quantize_rows)(const kernels::Fp8QuantizeParams& p, int64_t begin, int64_t end);
  const char* isa;  // "avx512", "avx2" or "default"
};

namespace cpu_default {
extern const CpuLoops kLoops;
}
namespace cpu_avx2 {
extern const CpuLoops kLoops;
}
namespace cpu_avx512 {
extern const CpuLoops kLoops;
}

// The widest variant this processor runs.
const CpuLoops& cpu_loops();

// The width of the scalar tail of the fused optimizer kernels torch's CPU dispatch runs in this process (its
// ATEN_CPU_CAPABILITY): the tail width of the CPU optimizer steps (NOTE [torch's scalar tail] in
// kernels/optim_functors.h).
int torch_cpu_float_vector_width();

}  // namespace ampkit::detail
