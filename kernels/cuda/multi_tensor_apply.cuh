// ampkit's multi-tensor apply: one launch walks many tensors, one CUDA block per fixed-size chunk of one tensor.
// The chunk table travels by value in the kernel's parameters (no device allocation, no host sync, so a launch
// can be captured in a CUDA graph), tensors of different dtypes share a launch, and sizes are 64-bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "amp_launch.h"
#include "launch.cuh"

namespace ampkit::kernels::cuda {

// Elements of one tensor handled by one block. A multiple of every vector width, so every chunk of a tensor
// whose base is 16-byte aligned is 16-byte aligned too. (The emulated tests build a second copy with small
// chunks, to reach lists that need several launches without gigabytes of data.)
#if defined(AMPKIT_MTA_CHUNK_SIZE)
constexpr int64_t kChunkSize = AMPKIT_MTA_CHUNK_SIZE;
#else
constexpr int64_t kChunkSize = 65536;
#endif
static_assert(kChunkSize % 8 == 0, "chunks must keep 16-byte alignment for 2-byte elements");
#if !defined(AMPKIT_MTA_CHUNK_SIZE)
static_assert(kChunkSize == kNormChunk,
              "the CPU sums a norm in the chunks of the CUDA kernel (NOTE [Deterministic norm])");
#endif
constexpr int kBlockThreads = 512;

// NOTE [Kernel parameter budget]
// Since CUDA 12.1 a kernel on Volta or newer may take 32764 bytes of parameters (4 KB before; every GPU and
// driver CUDA 13 supports has the larger limit, and ampkit refuses older toolkits at configure time). The chunk
// table fills 32000 of them minus the functor: half for the tensors, half for the blocks. That is 936 tensors and
// 2664 chunks per launch for the one-list passes (unscale_and_check_, check_finite_), 608 tensors for the
// two-list ones (the cast passes, grad_norm), 456 for grad_stats and 192 tensors and 2744 chunks for the
// optimizer steps (8 streams per tensor), where a 4 KB table took a few dozen; static_asserts next to the
// functors keep these figures true. Lists beyond one table are split across launches.
constexpr size_t kParamLimit = 32764;
constexpr size_t kParamBudget = 32000;

template <int kDepth, size_t kOpBytes = 0>
struct MultiTensorArgs {
  // Per tensor: kDepth pointers, one numel, kDepth dtype codes. Per block: a tensor index and a chunk index.
  static constexpr int kTensorBytes = kDepth * (8 + 1) + 8;
  static constexpr size_t kBudget = kParamBudget - kOpBytes;
  static constexpr int kMaxTensors = static_cast<int>((kBudget / 2) / kTensorBytes) / 8 * 8;
  static constexpr int kMaxBlocks =
      static_cast<int>((kBudget - static_cast<size_t>(kMaxTensors) * kTensorBytes - 64) / 6) / 8 * 8;

  void* data[kDepth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t block_chunk[kMaxBlocks];
  uint16_t block_tensor[kMaxBlocks];
  DType dtype[kDepth][kMaxTensors];
};

// The chunk table sized for functor `Op`: table and functor together stay within the launch's parameter limit.
template <int kDepth, typename Op>
using MultiTensorArgsFor = MultiTensorArgs<kDepth, (sizeof(Op) + 7) / 8 * 8>;

// Calls `op(args, tensor, start, n)` for the block's chunk: elements [start, start + n) of tensor `tensor`.
template <int kDepth, typename Op>
__global__ void __launch_bounds__(kBlockThreads)
    multi_tensor_kernel(AMPKIT_GRID_CONSTANT(MultiTensorArgsFor<kDepth, Op>) args, const Op op) {
  const int tensor = args.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunkSize;
  const int64_t left = args.numel[tensor] - start;
  op(args, tensor, start, left < kChunkSize ? left : kChunkSize);
}

// Launches `op` over `n_tensors` tensors; lists[d][i] is stream d of tensor i (all streams of a tensor have
// lists[0][i].numel elements). Zero-size tensors are skipped. Stops at the first launch error and reports how
// many launches were queued before it.
template <int kDepth, typename Op>
LaunchStatus multi_tensor_apply(const TensorRef* const* lists, int64_t n_tensors, const Op& op, cudaStream_t stream) {
  using Args = MultiTensorArgsFor<kDepth, Op>;
  static_assert(sizeof(Args) + sizeof(Op) <= kParamLimit, "chunk table and functor exceed the parameter limit");
  static_assert(Args::kMaxTensors < 65536, "block_tensor is 16-bit");
  constexpr int64_t kMaxChunks = int64_t{1} << 31;
  Args args;
  int tensors = 0;
  int blocks = 0;
  LaunchStatus status;
  auto launch = [&]() {
    status.error = launch_kernel(multi_tensor_kernel<kDepth, Op>, dim3(blocks), dim3(kBlockThreads), stream, args, op);
    status.launches += status.ok() ? 1 : 0;
    return status.ok();
  };
  for (int64_t i = 0; i < n_tensors; ++i) {
    const int64_t numel = lists[0][i].numel;
    if (numel == 0) {
      continue;
    }
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    if (chunks > kMaxChunks) {
      status.error = cudaErrorInvalidValue;
      return status;
    }
    for (int d = 0; d < kDepth; ++d) {
      args.data[d][tensors] = lists[d][i].data;
      args.dtype[d][tensors] = lists[d][i].dtype;
    }
    args.numel[tensors] = numel;
    ++tensors;
    for (int64_t c = 0; c < chunks; ++c) {
      args.block_tensor[blocks] = static_cast<uint16_t>(tensors - 1);
      args.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool tensors_full = tensors == Args::kMaxTensors && c == chunks - 1;
      if (blocks == Args::kMaxBlocks || tensors_full) {
        if (!launch()) {
          return status;
        }
        blocks = 0;
        if (c == chunks - 1) {
          tensors = 0;
        } else {
          // The tensor continues in the next launch: it becomes that launch's first tensor.
          for (int d = 0; d < kDepth; ++d) {
            args.data[d][0] = args.data[d][tensors - 1];
            args.dtype[d][0] = args.dtype[d][tensors - 1];
          }
          args.numel[0] = numel;
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) {
    launch();
  }
  return status;
}

}  // namespace ampkit::kernels::cuda
