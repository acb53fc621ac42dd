// The CUDA vocabulary every kernel source of kernels/cuda includes first: the runtime (or, in the emulated host
// build, kernels/cuda/emulation.h), the FP16/BF16 types, the one kernel launcher, and the accessors of tensor
// data in global memory. Written once so that nvcc and the emulated build compile the same kernel bodies.
#pragma once

#if defined(AMPKIT_CUDA_EMULATION)
#include "emulation.h"
#else
#include <cuda_runtime.h>
#define AMPKIT_GRID_CONSTANT(...) const __grid_constant__ __VA_ARGS__
// Block-shared memory, written once for both builds (emulation.h defines the emulated ones).
#define AMPKIT_SHARED(type, name, count) __shared__ type name[count]
#define AMPKIT_DYNAMIC_SHARED(type, name)                                 \
  extern __shared__ __align__(16) unsigned char ampkit_dynamic_shared_[]; \
  type* name = reinterpret_cast<type*>(ampkit_dynamic_shared_)
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common.h"

namespace ampkit::kernels::cuda {

// Launches `kernel<<<grid, block, 0, stream>>>(args...)` and returns the launch's error; in the emulated build,
// runs it on the calling thread (NOTE [Emulated execution]).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, const Args&... args) {
#if defined(AMPKIT_CUDA_EMULATION)
  (void)stream;
  return emulation::run_grid(kernel, grid, block, args...);
#else
  kernel<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
#endif
}

// The same with `shared_bytes` of dynamic shared memory per block (AMPKIT_DYNAMIC_SHARED).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_shared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                                 cudaStream_t stream, const Args&... args) {
#if defined(AMPKIT_CUDA_EMULATION)
  (void)stream;
  return emulation::run_grid_shared(kernel, grid, block, shared_bytes, args...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
  return cudaGetLastError();
#endif
}

// Every read and write of tensor data goes through these two, so that the emulated build can count the bytes a
// kernel moves (bench/run.py --traffic) and tell the memory-transaction model where each lane's access lands, with
// the caller's source position (NOTE [Memory transaction model]). On the GPU they are plain accesses.
#if defined(AMPKIT_CUDA_EMULATION)
template <typename T>
AMPKIT_INLINE T global_load(const T* p, AMPKIT_EMULATED_SITE) {
  emulation::traffic.read += sizeof(T);
  if (emulation::detail::model_recording) {
    emulation::detail::model_record(p, sizeof(T), emulation::detail::Access::kLoad, file, line);
  }
  return *p;
}

template <typename T>
AMPKIT_INLINE void global_store(T* p, const T& v, AMPKIT_EMULATED_SITE) {
  emulation::traffic.written += sizeof(T);
  if (emulation::detail::model_recording) {
    emulation::detail::model_record(p, sizeof(T), emulation::detail::Access::kStore, file, line);
  }
  *p = v;
}
#else
template <typename T>
__device__ AMPKIT_INLINE T global_load(const T* p) {
  return *p;
}

template <typename T>
__device__ AMPKIT_INLINE void global_store(T* p, const T& v) {
  *p = v;
}
#endif

}  // namespace ampkit::kernels::cuda
