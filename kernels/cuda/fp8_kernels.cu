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

// A grid-stride loop over the elements; each thread keeps its amax as bits (fp8_abs_bits) and merges it into
// *p.amax with one unsigned atomicMax (the order of the merges never matters).
template <typename T>
__global__ void __launch_bounds__(kFp8Threads) fp8_quantize_kernel(const Fp8QuantizeParams p) {
  const T* x = static_cast<const T*>(p.x);
  const int64_t n = p.rows * p.cols;
  const float tensor_scale = p.rowwise ? 0.f : cuda::global_load(p.scale);
  uint32_t amax = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.cols;
    const int64_t c = i - r * p.cols;
    const float v = cuda::to_opmath(cuda::global_load(x + i));
    const uint32_t b = fp8_abs_bits(v);
    amax = b > amax ? b : amax;
    const float s = p.rowwise ? cuda::global_load(p.scale + r) : tensor_scale;
    const uint8_t q = fp8_quantize_value(v, s, p.format);
    cuda::global_store(p.q + i, q);
    if (p.q_t != nullptr) {
      cuda::global_store(p.q_t + c * p.rows + r, q);
    }
  }
  if (amax != 0) {
    atomicMax(reinterpret_cast<unsigned*>(p.amax), static_cast<unsigned>(amax));
  }
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
  const dim3 grid(static_cast<unsigned>(blocks_for(p.rows * p.cols)));
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
