// CUDA kernels of the FP8 ops: the quantize (the saturating cast, the amax and the optional transposed copy in one
// pass), the scale computation, and the delayed-scaling update of many amax histories on the multi-tensor apply.
// The formulas are the functors of kernels/fp8_functors.h, which the CPU loops call too.
#include <algorithm>

#include "convert.cuh"
#include "fp8_launch.h"
#include "launch.cuh"
#include "multi_tensor_apply.cuh"

namespace ampkit::kernels {
namespace {

constexpr int kFp8Threads = 256;
constexpr int64_t kFp8MaxBlocks = 4096;
constexpr int kTile = 32;        // the transposed copy goes through 32 x 32 tiles
constexpr int kTileStride = 36;  // bytes per tile row in shared memory: a column's 32 bytes fall in 32 banks
constexpr int kTileRowsPerPass = kFp8Threads / kTile;

// The block's largest amax bits, merged into *p.amax with one unsigned atomicMax (the order of the merges never
// matters): the warp's lanes by shuffles, then the warps through shared memory.
__device__ AMPKIT_INLINE void merge_amax(uint32_t amax, unsigned* warp_amax, float* out) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, amax, offset);
    amax = other > amax ? other : amax;
  }
  if (threadIdx.x % 32 == 0) {
    warp_amax[threadIdx.x / 32] = amax;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned w = 1; w < blockDim.x / 32; ++w) {
      amax = warp_amax[w] > amax ? warp_amax[w] : amax;
    }
    if (amax != 0) {
      atomicMax(reinterpret_cast<unsigned*>(out), static_cast<unsigned>(amax));
    }
  }
}

// NOTE [FP8 quantize kernel]
// Without the transposed copy: a grid-stride loop over the elements, each warp reading and writing 32 consecutive
// ones (the row of an element is computed only for a rowwise scale). With it: the matrix is cut into 32 x 32
// tiles, a block walks tiles (one division per tile); its 8 warps read a tile's rows (lane = column: coalesced),
// write the codes to q and keep them in shared memory, then write the tile's columns as rows of q_t (lane = row
// of the tile: 32 consecutive bytes per warp instruction) where the naive transposed store would touch one
// sector per byte. Either way each thread keeps its amax as bits (fp8_abs_bits) and the block merges them once
// (merge_amax). The codes are those of fp8_quantize_value on every element, as on the CPU.
template <typename T>
__global__ void __launch_bounds__(kFp8Threads) fp8_quantize_kernel(const Fp8QuantizeParams p) {
  AMPKIT_SHARED(unsigned, warp_amax, kFp8Threads / 32);
  AMPKIT_SHARED(float, block_scale, 1);
  const T* x = static_cast<const T*>(p.x);
  const int64_t n = p.rows * p.cols;
  if (!p.rowwise && threadIdx.x == 0) {
    block_scale[0] = cuda::global_load(p.scale);  // read once per block, not once per thread
  }
  __syncthreads();
  const float tensor_scale = p.rowwise ? 0.f : block_scale[0];
  uint32_t amax = 0;
  if (p.q_t == nullptr) {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float v = cuda::to_opmath(cuda::global_load(x + i));
      const uint32_t b = fp8_abs_bits(v);
      amax = b > amax ? b : amax;
      const float s = p.rowwise ? cuda::global_load(p.scale + i / p.cols) : tensor_scale;
      cuda::global_store(p.q + i, fp8_quantize_value(v, s, p.format));
    }
    merge_amax(amax, warp_amax, p.amax);
    return;
  }
  AMPKIT_SHARED(uint8_t, tile, kTile * kTileStride);
  const int lane = static_cast<int>(threadIdx.x % kTile);
  const int row0 = static_cast<int>(threadIdx.x / kTile);
  const int64_t tile_cols = (p.cols + kTile - 1) / kTile;
  const int64_t tiles = (p.rows + kTile - 1) / kTile * tile_cols;
  for (int64_t tile_index = blockIdx.x; tile_index < tiles; tile_index += gridDim.x) {  // uniform over the block
    const int64_t r0 = tile_index / tile_cols * kTile;
    const int64_t c0 = (tile_index % tile_cols) * kTile;
    const int64_t c = c0 + lane;
    for (int k = row0; k < kTile; k += kTileRowsPerPass) {
      const int64_t r = r0 + k;
      if (r < p.rows && c < p.cols) {
        const int64_t i = r * p.cols + c;
        const float v = cuda::to_opmath(cuda::global_load(x + i));
        const uint32_t b = fp8_abs_bits(v);
        amax = b > amax ? b : amax;
        const uint8_t q = fp8_quantize_value(v, p.rowwise ? cuda::global_load(p.scale + r) : tensor_scale, p.format);
        cuda::global_store(p.q + i, q);
        tile[k * kTileStride + lane] = q;
      }
    }
    __syncthreads();
    // Row k of the tile's transpose: column c0 + k of the matrix, its rows r0 + lane.
    for (int k = row0; k < kTile; k += kTileRowsPerPass) {
      const int64_t r = r0 + lane;
      if (c0 + k < p.cols && r < p.rows) {
        cuda::global_store(p.q_t + (c0 + k) * p.rows + r, tile[lane * kTileStride + k]);
      }
    }
    __syncthreads();
  }
  merge_amax(amax, warp_amax, p.amax);
}

__global__ void __launch_bounds__(kFp8Threads)
    fp8_compute_scale_kernel(const float* amax, float* scale, int64_t n, const Fp8ScaleOp op) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    cuda::global_store(scale + i, op(cuda::global_load(amax + i), 1.f));
  }
}

// One chunk of columns of one (scale, history) pair: a thread per column, which walks the column's rows.
struct Fp8HistoryChunkOp {
  // Streams of the chunk table: the scales (numel = the history's columns), the histories.
  static constexpr int kScalesIdx = 0;
  static constexpr int kHistoriesIdx = 1;

  Fp8HistoryOp op;

  template <typename Args>
  __device__ void operator()(const Args& args, int t, int64_t start, int64_t n) const {
    float* scales = static_cast<float*>(args.data[kScalesIdx][t]);
    float* history = static_cast<float*>(args.data[kHistoriesIdx][t]);
    const int64_t cols = args.numel[t];
    for (int64_t c = start + threadIdx.x; c < start + n; c += blockDim.x) {
      op(history + c, cols, scales + c);
    }
  }
};

int64_t blocks_for(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>((n + kFp8Threads - 1) / kFp8Threads, kFp8MaxBlocks));
}

}  // namespace

LaunchStatus launch_fp8_quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  const int64_t tiles = (p.rows + kTile - 1) / kTile * ((p.cols + kTile - 1) / kTile);
  const dim3 grid(static_cast<unsigned>(p.q_t == nullptr ? blocks_for(p.rows * p.cols)
                                                         : std::max<int64_t>(1, std::min(tiles, kFp8MaxBlocks))));
  LaunchStatus status;
  switch (p.dtype) {
    case DType::kFloat16:
      status.error = cuda::launch_kernel(fp8_quantize_kernel<__half>, grid, dim3(kFp8Threads), stream, p);
      break;
    case DType::kBFloat16:
      status.error = cuda::launch_kernel(fp8_quantize_kernel<__nv_bfloat16>, grid, dim3(kFp8Threads), stream, p);
      break;
    default:
      status.error = cuda::launch_kernel(fp8_quantize_kernel<float>, grid, dim3(kFp8Threads), stream, p);
      break;
  }
  status.launches = status.ok() ? 1 : 0;
  return status;
}

LaunchStatus launch_fp8_compute_scale(const float* amax, float* scale, int64_t n, const Fp8ScaleOp& op,
                                      cudaStream_t stream) {
  LaunchStatus status;
  if (n == 0) {
    return status;
  }
  status.error = cuda::launch_kernel(fp8_compute_scale_kernel, dim3(static_cast<unsigned>(blocks_for(n))),
                                     dim3(kFp8Threads), stream, amax, scale, n, op);
  status.launches = status.ok() ? 1 : 0;
  return status;
}

LaunchStatus launch_fp8_update_history(const TensorRef* scales, const TensorRef* histories, int64_t n,
                                       const Fp8HistoryOp& op, cudaStream_t stream) {
  const TensorRef* lists[2];
  lists[Fp8HistoryChunkOp::kScalesIdx] = scales;
  lists[Fp8HistoryChunkOp::kHistoriesIdx] = histories;
  return cuda::multi_tensor_apply<2>(lists, n, Fp8HistoryChunkOp{op}, stream);
}

}  // namespace ampkit::kernels
