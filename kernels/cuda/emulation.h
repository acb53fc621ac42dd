// The emulated CUDA execution model behind the host build of kernels/cuda (AMPKIT_CUDA_EMULATION): the same
// kernel sources compiled by the host compiler and run on the CPU, so that every kernel executes in tests on
// machines without a GPU. It supplies the CUDA keywords, the built-in index variables and a grid runner; the
// FP16/BF16 types and their host conversions come from the toolkit's own cuda_fp16.h / cuda_bf16.h.
//
// NOTE [Emulated execution]
// A grid runs block after block and, inside a block, thread after thread, each thread to completion. That is
// one legal schedule of a kernel that never synchronises its threads, which is every kernel in kernels/cuda
// today (global-memory atomics included: with one thread at a time they are plain read-modify-writes, and a kernel
// may only use them where the result does not depend on their order): no __syncthreads, shared memory or warp
// shuffles are defined here, so a kernel that starts using them
// fails to compile in the emulated build until this model grows phases (or fibers) for them, instead of
// passing on a schedule the GPU would not run. Kernel parameters declared AMPKIT_GRID_CONSTANT are const
// references here (they are read-only views of the parameter space on the GPU too), so a 32 KB chunk table is
// not copied once per emulated thread. Memory traffic of tensor data (global_load / global_store) is counted
// per host thread, so a test can read the bytes a kernel moved.
#pragma once

#if defined(__CUDACC__)
#error "kernels/cuda/emulation.h is the host build of the CUDA kernels; nvcc compiles them for real"
#endif

#include <cuda_runtime_api.h>  // plain C declarations: cudaError_t, cudaStream_t, dim3 (nothing is called)

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

// The runtime API header defines these for host compilers as attributes nvcc alone understands.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define AMPKIT_GRID_CONSTANT(...) const __VA_ARGS__&

inline thread_local uint3 threadIdx{};
inline thread_local uint3 blockIdx{};
inline thread_local dim3 blockDim{};
inline thread_local dim3 gridDim{};

// The device intrinsics the kernels use, as the host computes them.
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}
inline unsigned long long atomicMax(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old < value ? value : old;
  return old;
}
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }

namespace ampkit::kernels::emulation {

// The limits a launch is checked against, as the driver does on every GPU ampkit supports.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxGridX = 2147483647u;
constexpr unsigned kMaxGridYZ = 65535u;
constexpr size_t kMaxParamBytes = 32764;

// Bytes of tensor data read and written by kernels on this host thread since the last reset.
struct Traffic {
  uint64_t read = 0;
  uint64_t written = 0;
  uint64_t launches = 0;
};
inline thread_local Traffic traffic{};

inline Traffic reset_traffic() {
  const Traffic seen = traffic;
  traffic = Traffic{};
  return seen;
}

// Runs `kernel(args...)` for every thread of every block (NOTE [Emulated execution]).
template <typename... Params, typename... Args>
cudaError_t run_grid(void (*kernel)(Params...), dim3 grid, dim3 block, const Args&... args) {
  static_assert((sizeof(std::decay_t<Params>) + ... + 0) <= kMaxParamBytes,
                "kernel parameters exceed the 32764-byte budget of a CUDA launch");
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > kMaxGridX || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) {
    return cudaErrorInvalidConfiguration;
  }
  traffic.launches += 1;
  gridDim = grid;
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = uint3{bx, by, bz};
        for (unsigned tz = 0; tz < block.z; ++tz) {
          for (unsigned ty = 0; ty < block.y; ++ty) {
            for (unsigned tx = 0; tx < block.x; ++tx) {
              threadIdx = uint3{tx, ty, tz};
              kernel(args...);
            }
          }
        }
      }
    }
  }
  return cudaSuccess;
}

}  // namespace ampkit::kernels::emulation
