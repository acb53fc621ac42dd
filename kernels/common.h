// Torch-free vocabulary shared by the CPU and CUDA kernels: the host/device qualifier macro, the dtype codes
// the kernels understand, the plain tensor descriptor the launchers take, and a fast-math-proof finiteness test.
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

// NOTE [Finiteness test]
// Inf/NaN detection compares exponent bits instead of calling isfinite(): a compiler told to assume finite
// math (-ffast-math, --use_fast_math) may fold isfinite() to true, and the overflow check is the one thing
// AMP cannot afford to lose. Bit tests survive any floating-point flag.
AMPKIT_HOST_DEVICE AMPKIT_INLINE bool is_non_finite(float v) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
#endif
  return (bits & 0x7f800000u) == 0x7f800000u;
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE bool is_non_finite(double v) {
#if defined(__CUDA_ARCH__)
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(v));
#else
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
#endif
  return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

}  // namespace ampkit::kernels
