// Torch-free vocabulary shared by the CPU and CUDA kernels: the host/device qualifier macro, the dtype codes
// the kernels understand, the plain descriptors the loops and launchers take (no CUDA header: the CPU build uses
// them too), the bit casts, and a fast-math-proof finiteness test.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define AMPKIT_HOST_DEVICE __host__ __device__
#define AMPKIT_INLINE __forceinline__
#else
#define AMPKIT_HOST_DEVICE
#define AMPKIT_INLINE inline
#endif

namespace ampkit::kernels {

// The floating dtypes a kernel can read or write. The numbering is part of the launch metadata.
// kUInt8 marks a packed 8-bit block-wise optimizer state in a launch's metadata (kernels/blockwise8.h).
enum class DType : uint8_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3, kUInt8 = 4 };

AMPKIT_HOST_DEVICE constexpr int dtype_size(DType t) {
  return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : t == DType::kUInt8 ? 1 : 2;
}

// One dense run of `numel` elements of `dtype` starting at `data` (the caller guarantees density).
struct TensorRef {
  void* data;
  int64_t numel;
  DType dtype;
};

// The streams of one parameter for a fused optimizer step. `master`, `remainder`, `kahan_comp`, `sr_seed`,
// `exp_avg_sq`, `max_exp_avg_sq` are null when unused (at most one of master, remainder, kahan_comp and sr_seed is
// set: the way the weight is kept); `param` and `grad` share a dtype (FP16, BF16 or FP32); every other stream is
// FP32; `step` points at the tensor's FP32 step count (null: none; never null with sr_seed).
// How an optimizer state stream (exp_avg / momentum buffer, exp_avg_sq) is stored; its OptimTensor pointer then
// points to FP32 values, BF16 values, or one packed 8-bit block-wise state (NOTE [8-bit block-wise states] in
// kernels/blockwise8.h). max_exp_avg_sq is always FP32.
enum class StateType : uint8_t { kFloat32, kBFloat16, kBlockwise8 };

// NOTE [FP32 grads of low-precision params]
// A FP16/BF16 parameter may accumulate its gradient in FP32 (torch's Tensor.grad_dtype, torch >= 2.10). The CPU
// loops and the CUDA kernels then read (and, unscaled, write) the grad as FP32 and do everything else as they do for
// a grad of the parameter's dtype: the grad enters the formulas as FP32 either way, so the step is the one the FP32
// path makes from the same master and grad, bit for bit (tested against it on the CPU and in emulated CUDA). The
// grad is not rounded to the parameter's dtype first, which is the point: a small update survives in the master.
struct OptimTensor {
  void* param;
  void* grad;  // written only with write_unscaled_grads
  float* master;
  int16_t* remainder;  // BF16 params only: the master's low half (NOTE [BF16 weight + 16-bit remainder])
  float* exp_avg;      // Adam: first moment; SGD: momentum buffer
  float* exp_avg_sq;   // Adam only
  float* max_exp_avg_sq;
  float* step;
  int64_t numel;
  DType dtype;
  // BF16 params only: the Kahan compensation (NOTE [Kahan-compensated BF16 weight]) or the stochastic rounding
  // seed (NOTE [Counter-based stochastic rounding]), both in kernels/stochastic_rounding.h.
  uint16_t* kahan_comp = nullptr;
  const int64_t* sr_seed = nullptr;
  StateType exp_avg_type = StateType::kFloat32;
  StateType exp_avg_sq_type = StateType::kFloat32;
  // FP16/BF16 params only: the grad is FP32 (NOTE [FP32 grads of low-precision params]); otherwise the grad has
  // the parameter's dtype.
  bool grad_fp32 = false;
};

// The one bit cast of the kernels (std::bit_cast is C++20; kernels/ is C++17 for nvcc): a byte copy that both the
// host compiler and nvcc lower to a register move.
template <typename To, typename From>
AMPKIT_HOST_DEVICE AMPKIT_INLINE To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs types of one size");
  To out;
  __builtin_memcpy(&out, &v, sizeof(To));
  return out;
}

// NOTE [Finiteness test]
// Inf/NaN detection compares exponent bits instead of calling isfinite(): a compiler told to assume finite
// math (-ffast-math, --use_fast_math) may fold isfinite() to true, and the overflow check is the one thing
// AMP cannot afford to lose. Bit tests survive any floating-point flag.
AMPKIT_HOST_DEVICE AMPKIT_INLINE bool is_non_finite(float v) {
  return (bit_cast<uint32_t>(v) & 0x7f800000u) == 0x7f800000u;
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE bool is_non_finite(double v) {
  return (bit_cast<uint64_t>(v) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

}  // namespace ampkit::kernels
