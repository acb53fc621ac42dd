// The emulated CUDA execution model behind the host build of kernels/cuda (AMPKIT_CUDA_EMULATION): the same
// kernel sources compiled by the host compiler and run on the CPU, so that every kernel executes in tests on
// machines without a GPU. It supplies the CUDA keywords, the built-in index variables, block-shared memory, the
// barriers and warp primitives, and the grid runner; the FP16/BF16 types and their host conversions come from the
// toolkit's own cuda_fp16.h / cuda_bf16.h. The scheduler behind it lives in emulation_runtime.h (its interface),
// emulation_runtime.cpp (fibers, blocks, shared memory) and emulation_sync.cpp (barriers, error reports).
//
// NOTE [Emulated execution]
// A grid runs block after block on the calling host thread: in blockIdx order, or in a seeded random order with
// AMPKIT_EMULATION_BLOCK_ORDER=shuffled[:seed] (a kernel whose result depends on the order of its blocks shows it
// there). Inside a block the threads run on fibers: user-level contexts, each with its own stack, from a pool
// per host thread that is made once and reused by every block and launch. Threads start in thread order (x
// fastest); a thread runs until it exits or waits at a barrier or warp primitive. When one exits, its fiber goes
// on with the next thread not started yet, on the same stack and without a switch, so a kernel that never
// synchronises runs each thread to completion, one after another, on one fiber (two switches per block: about
// 5 ns per thread more than a plain loop, 20 ns under ASan). A thread that waits keeps its fiber and the next
// thread starts on another one (a block whose threads all reach a barrier holds one fiber per thread); once every
// thread has started, the scheduler resumes the runnable ones in thread order, round after round. The switch is a
// dozen instructions of assembly on x86-64 (swapcontext elsewhere), annotated for AddressSanitizer.
// __syncthreads() (and _count/_and/_or) completes when every thread of the block waits at it; a warp primitive
// (__syncwarp, __shfl*_sync, __ballot_sync, __any_sync, __all_sync, __match_any_sync) completes when every lane
// named in its mask waits at the same primitive with the same mask, then each lane gets CUDA's result for a full
// warp of 32 (lanes beyond the block's last thread do not exist: a mask may name them, they take no part, and a
// shuffle that reads one, or a lane outside the mask, returns 0xFF bytes). The schedule is one the GPU may run,
// and stricter: when no fiber can run and some still wait, the block is stuck as compute-sanitizer's synccheck
// would call it (a thread exited or waits elsewhere while others wait at __syncthreads, threads wait at
// __syncthreads of different lines, a mask names a lane that exited or waits at another primitive); the launch
// stops and returns cudaErrorIllegalInstruction, and emulation::last_error() names the block, the threads and each
// primitive's file:line. Block-shared memory (AMPKIT_SHARED, AMPKIT_DYNAMIC_SHARED) is one arena per host thread,
// handed out afresh to every block and filled with 0xFF bytes, so a read before any write shows (and, under
// AddressSanitizer, the arena outside the block's arrays is poisoned). Global-memory atomics are plain
// read-modify-writes: a fiber is never interrupted inside one, and a kernel may only use them where the result
// does not depend on their order. Kernel parameters declared AMPKIT_GRID_CONSTANT are const references here (they
// are read-only views of the parameter space on the GPU too), so a 32 KB chunk table is not copied once per
// emulated thread. Memory traffic of tensor data (global_load / global_store) is counted per host thread, so a
// test can read the bytes a kernel moved.
#pragma once

#if defined(__CUDACC__)
#error "kernels/cuda/emulation.h is the host build of the CUDA kernels; nvcc compiles them for real"
#endif

#include <cuda_runtime_api.h>  // plain C declarations: cudaError_t, cudaStream_t, dim3 (nothing is called)

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
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
constexpr int warpSize = 32;

#include "emulation_runtime.h"

// Block-shared memory: `AMPKIT_SHARED(float, sums, 512);` declares `float sums[512]`, one array per block (under
// nvcc, `__shared__ float sums[512]`); `AMPKIT_DYNAMIC_SHARED(float, buf);` declares `float* buf`, the launch's
// dynamic shared memory (under nvcc, the `extern __shared__` array). Both read 0xFF bytes until written.
#define AMPKIT_SHARED_CAT2(a, b) a##b
#define AMPKIT_SHARED_CAT(a, b) AMPKIT_SHARED_CAT2(a, b)
#define AMPKIT_SHARED(type, name, count)                                                                    \
  static_assert(sizeof(type) * (count) <= 48 * 1024, "static shared memory is limited to 48 KB per block"); \
  static constexpr char AMPKIT_SHARED_CAT(ampkit_shared_site_, __LINE__) = 0;                               \
  type(&name)[count] = *static_cast<type(*)[count]>(::ampkit::kernels::emulation::detail::block_shared(     \
      &AMPKIT_SHARED_CAT(ampkit_shared_site_, __LINE__), sizeof(type) * (count), alignof(type)))
#define AMPKIT_DYNAMIC_SHARED(type, name) \
  type* name = static_cast<type*>(::ampkit::kernels::emulation::detail::dynamic_shared())

// ---- barriers and warp primitives (NOTE [Emulated execution]) ---------------------------------------------------
// Each takes its caller's file and line as defaulted arguments, for the reports of a stuck block.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ampkit::kernels::emulation::detail::block_barrier(ampkit::kernels::emulation::detail::BarrierKind::kSync, 0, file,
                                                    line);
}
inline int __syncthreads_count(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ampkit::kernels::emulation::detail::block_barrier(ampkit::kernels::emulation::detail::BarrierKind::kCount,
                                                           pred, file, line);
}
inline int __syncthreads_and(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ampkit::kernels::emulation::detail::block_barrier(ampkit::kernels::emulation::detail::BarrierKind::kAnd, pred,
                                                           file, line);
}
inline int __syncthreads_or(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ampkit::kernels::emulation::detail::block_barrier(ampkit::kernels::emulation::detail::BarrierKind::kOr, pred,
                                                           file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  d::warp_op(d::WarpOp{d::WarpKind::kSync, mask, 0, 0, 32, 0, file, line});
}

namespace ampkit::kernels::emulation::detail {
template <typename T>
T warp_shuffle(WarpKind kind, unsigned mask, T var, int lane_arg, int width, const char* file, int line) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "warp shuffles move types of up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  const uint64_t out = warp_op(WarpOp{kind, mask, bits, lane_arg, width, static_cast<int>(sizeof(T)), file, line});
  T result;
  std::memcpy(&result, &out, sizeof(T));
  return result;
}
}  // namespace ampkit::kernels::emulation::detail

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return d::warp_shuffle(d::WarpKind::kShfl, mask, var, src_lane, width, file, line);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return d::warp_shuffle(d::WarpKind::kShflUp, mask, var, static_cast<int>(delta), width, file, line);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return d::warp_shuffle(d::WarpKind::kShflDown, mask, var, static_cast<int>(delta), width, file, line);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, const char* file = __builtin_FILE(),
                  int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return d::warp_shuffle(d::WarpKind::kShflXor, mask, var, lane_mask, width, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return static_cast<unsigned>(
      d::warp_op(d::WarpOp{d::WarpKind::kBallot, mask, pred != 0 ? 1u : 0u, 0, 32, 0, file, line}));
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return static_cast<int>(d::warp_op(d::WarpOp{d::WarpKind::kAny, mask, pred != 0 ? 1u : 0u, 0, 32, 0, file, line}));
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  namespace d = ampkit::kernels::emulation::detail;
  return static_cast<int>(d::warp_op(d::WarpOp{d::WarpKind::kAll, mask, pred != 0 ? 1u : 0u, 0, 32, 0, file, line}));
}
template <typename T>
unsigned __match_any_sync(unsigned mask, T value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_integral_v<T> || std::is_floating_point_v<T>, "__match_any_sync compares 32/64-bit values");
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "__match_any_sync compares 32/64-bit values");
  namespace d = ampkit::kernels::emulation::detail;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return static_cast<unsigned>(
      d::warp_op(d::WarpOp{d::WarpKind::kMatchAny, mask, bits, 0, 32, static_cast<int>(sizeof(T)), file, line}));
}
// Bit counts as the device computes them.
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
// The lanes of the caller's warp that have not exited (fibers do not diverge, so a lane in another branch counts).
inline unsigned __activemask() { return ampkit::kernels::emulation::detail::active_mask(); }

// The device intrinsics the kernels use, as the host computes them (a fiber is never interrupted inside one).
// Atomics tell the memory-transaction model (emulation_runtime.h) where they land, with their caller's position.
#define AMPKIT_EMULATED_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()
namespace ampkit::kernels::emulation::detail {
template <typename T, typename Op>
inline T emulated_atomic(T* address, Op op, const char* file, int line) {
  // The read and write below are the atomic's, not requests of their own: the recorder ignores the
  // instrumentation's reports until model_atomic_done() (both out of line, so that the compiler keeps the order).
  const bool recording = model_recording;
  if (recording) {
    model_record(address, sizeof(T), Access::kAtomic, file, line);
  }
  const T old = *address;
  *address = op(old);
  if (recording) {
    model_atomic_done();
  }
  return old;
}
}  // namespace ampkit::kernels::emulation::detail
template <typename T>
inline T ampkit_emulated_atomic_add(T* address, T value, const char* file, int line) {
  return ampkit::kernels::emulation::detail::emulated_atomic(
      address, [value](T old) { return static_cast<T>(old + value); }, file, line);
}
template <typename T>
inline T ampkit_emulated_atomic_max(T* address, T value, const char* file, int line) {
  return ampkit::kernels::emulation::detail::emulated_atomic(
      address, [value](T old) { return old < value ? value : old; }, file, line);
}
// CUDA's overloads of atomicAdd and atomicMax, one per type it defines them for (a template would take types CUDA
// refuses).
#define AMPKIT_EMULATED_ATOMIC(name, T, emulated) \
  inline T name(T* address, T value, AMPKIT_EMULATED_SITE) { return emulated(address, value, file, line); }
AMPKIT_EMULATED_ATOMIC(atomicAdd, int, ampkit_emulated_atomic_add)
AMPKIT_EMULATED_ATOMIC(atomicAdd, unsigned, ampkit_emulated_atomic_add)
AMPKIT_EMULATED_ATOMIC(atomicAdd, unsigned long long, ampkit_emulated_atomic_add)
AMPKIT_EMULATED_ATOMIC(atomicAdd, float, ampkit_emulated_atomic_add)
AMPKIT_EMULATED_ATOMIC(atomicAdd, double, ampkit_emulated_atomic_add)
AMPKIT_EMULATED_ATOMIC(atomicMax, unsigned, ampkit_emulated_atomic_max)
AMPKIT_EMULATED_ATOMIC(atomicMax, unsigned long long, ampkit_emulated_atomic_max)
#undef AMPKIT_EMULATED_ATOMIC
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

// Runs `kernel(args...)` for every thread of every block, each thread a fiber (NOTE [Emulated execution]), with
// `dynamic_shared_bytes` of dynamic shared memory per block.
template <typename... Params, typename... Args>
cudaError_t run_grid_shared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_shared_bytes,
                            const Args&... args) {
  static_assert((sizeof(std::decay_t<Params>) + ... + 0) <= kMaxParamBytes,
                "kernel parameters exceed the 32764-byte budget of a CUDA launch");
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > kMaxGridX || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) {
    return cudaErrorInvalidConfiguration;
  }
  traffic.launches += 1;
  const auto body = [&]() { kernel(args...); };
  using Body = decltype(body);
  return detail::run_blocks(
      grid, block, dynamic_shared_bytes, [](const void* b) { (*static_cast<const Body*>(b))(); }, &body);
}

template <typename... Params, typename... Args>
cudaError_t run_grid(void (*kernel)(Params...), dim3 grid, dim3 block, const Args&... args) {
  return run_grid_shared(kernel, grid, block, 0, args...);
}

}  // namespace ampkit::kernels::emulation
