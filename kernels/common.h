// Torch-free vocabulary shared by the CPU and CUDA kernels: the host/device qualifier macro, the dtype codes
// the kernels understand, the plain descriptors the loops and launchers take (no CUDA header: the CPU build uses
// them too), the bit casts, and a fast-math-proof finiteness test.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define AMPKIT_HOST_DEVICE __host__ __device__
#define AMPKIT_INLINE __forceinline__
#else
#define AMPKIT_HOST_DEVICE
#define AMPKIT_INLINE inline
#endif

namespace ampkit::kernels {

// The floating dtypes a kernel can read or write. The numbering is part of the launch metadata.
enum class DType : uint8_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

AMPKIT_HOST_DEVICE constexpr int dtype_size(DType t) {
  return t == DType::kFloat64 ? 8 : (t == DType::kFloat32 ? 4 : 2);
}

// One dense run of `numel` elements of `dtype` starting at `data` (the caller guarantees density).
struct TensorRef {
  void* data;
  int64_t numel;
  DType dtype;
};

// The streams of one parameter for a fused optimizer step. `master`, `remainder`, `exp_avg_sq`, `max_exp_avg_sq`
// are null when unused (at most one of master and remainder is set); `param` and `grad` share a dtype (FP16,
// BF16 or FP32); every other stream is FP32; `step` points at the tensor's FP32 step count (null: none).
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

// The bits of a float or double and back: one memcpy on the host (and in the emulated build), the intrinsics on
// the GPU.
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint32_t bits_of(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
#endif
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE uint64_t bits_of(double v) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(v));
#else
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
#endif
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

// NOTE [Finiteness test]
// Inf/NaN detection compares exponent bits instead of calling isfinite(): a compiler told to assume finite
// math (-ffast-math, --use_fast_math) may fold isfinite() to true, and the overflow check is the one thing
// AMP cannot afford to lose. Bit tests survive any floating-point flag.
AMPKIT_HOST_DEVICE AMPKIT_INLINE bool is_non_finite(float v) {
  return (bits_of(v) & 0x7f800000u) == 0x7f800000u;
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE bool is_non_finite(double v) {
  return (bits_of(v) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

}  // namespace ampkit::kernels
