// The conversions between the storage types of tensor data and their opmath type (FP32 for FP16, BF16 and FP32,
// FP64 for FP64), written once for every kernel of kernels/cuda: up exactly, down with one rounding to
// nearest-even. The emulated build takes the same intrinsics from the toolkit's cuda_fp16.h / cuda_bf16.h.
#pragma once

#include "../amp_functors.h"
#include "launch.cuh"

namespace ampkit::kernels::cuda {

__device__ AMPKIT_INLINE float to_opmath(__half v) { return __half2float(v); }
__device__ AMPKIT_INLINE float to_opmath(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ AMPKIT_INLINE float to_opmath(float v) { return v; }
__device__ AMPKIT_INLINE double to_opmath(double v) { return v; }

template <typename T>
__device__ AMPKIT_INLINE T from_opmath(opmath_t<T> v);
template <>
__device__ AMPKIT_INLINE __half from_opmath<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ AMPKIT_INLINE __nv_bfloat16 from_opmath<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ AMPKIT_INLINE float from_opmath<float>(float v) {
  return v;
}
template <>
__device__ AMPKIT_INLINE double from_opmath<double>(double v) {
  return v;
}

}  // namespace ampkit::kernels::cuda
