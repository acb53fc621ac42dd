// CUDA kernels of gradient unscaling, the read-only Inf/NaN check and the loss-scale update, on ampkit's
// multi-tensor apply. Element types are dispatched per tensor inside the kernel, so one launch takes a list
// of mixed FP16, BF16, FP32 and FP64 tensors.
#include <vector>

#include "amp_launch.h"
#include "convert.cuh"
#include "launch.cuh"
#include "multi_tensor_apply.cuh"

namespace ampkit::kernels {
namespace {

template <typename T, int kVec>
struct alignas(16) Pack {
  T v[kVec];
};

// Unscales (when `write`) and checks one chunk; returns whether this thread saw a non-finite element.
// 16-byte accesses when the chunk is aligned, a scalar loop for the tail and for misaligned tensors.
template <typename T>
__device__ bool unscale_chunk(T* p, int64_t n, float inv_scale, bool write) {
  using opmath = opmath_t<T>;
  constexpr int kVec = 16 / sizeof(T);
  const UnscaleOp<opmath> op(inv_scale);
  write = write && !op.identity;
  bool bad = false;
  int64_t scalar_begin = 0;
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    const int64_t n_vec = n / kVec;
    auto* packs = reinterpret_cast<Pack<T, kVec>*>(p);
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      Pack<T, kVec> pk = cuda::global_load(packs + i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const opmath x = cuda::to_opmath(pk.v[j]);
        bad |= is_non_finite(x);
        pk.v[j] = cuda::from_opmath<T>(op(x));
      }
      if (write) {
        cuda::global_store(packs + i, pk);
      }
    }
    scalar_begin = n_vec * kVec;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < n; i += blockDim.x) {
    const opmath x = cuda::to_opmath(cuda::global_load(p + i));
    bad |= is_non_finite(x);
    if (write) {
      cuda::global_store(p + i, cuda::from_opmath<T>(op(x)));
    }
  }
  return bad;
}

// The per-chunk functor of both the unscale and the check: `inv_scale == nullptr` means check only.
struct UnscaleChunkOp {
  // The one stream of the chunk table: the grads (check_finite_: the tensors).
  static constexpr int kGradsIdx = 0;

  float* found_inf;
  const float* inv_scale;

  template <typename Args>
  __device__ void operator()(const Args& args, int t, int64_t start, int64_t n) const {
    const float inv = inv_scale != nullptr ? *inv_scale : 1.f;
    const bool write = inv_scale != nullptr;
    bool bad = false;
    switch (args.dtype[kGradsIdx][t]) {
      case DType::kFloat16:
        bad = unscale_chunk(static_cast<__half*>(args.data[kGradsIdx][t]) + start, n, inv, write);
        break;
      case DType::kBFloat16:
        bad = unscale_chunk(static_cast<__nv_bfloat16*>(args.data[kGradsIdx][t]) + start, n, inv, write);
        break;
      case DType::kFloat32:
        bad = unscale_chunk(static_cast<float*>(args.data[kGradsIdx][t]) + start, n, inv, write);
        break;
      case DType::kFloat64:
        bad = unscale_chunk(static_cast<double*>(args.data[kGradsIdx][t]) + start, n, inv, write);
        break;
      case DType::kUInt8:  // an optimizer state's code, never a grad
        break;
    }
    if (bad) {
      // A plain store: every writer writes the same value, and found_inf is never cleared here.
      *found_inf = 1.f;
    }
  }
};

// One chunk of a cast pass (NOTE [Compressed all-reduce passes]): 8 elements per access when both streams are
// 16-byte aligned (one 16-byte access of a 2-byte stream, two of an FP32 one), a scalar loop for the tail and for
// misaligned pairs. Returns whether this thread saw a non-finite Out(src) (only when `check`).
template <typename TS, typename TO>
__device__ bool cast_chunk(const TS* s, TO* o, int64_t n, const CastOp& op, bool check) {
  constexpr int kVec = 8;
  bool bad = false;
  int64_t scalar_begin = 0;
  if (reinterpret_cast<uintptr_t>(s) % 16 == 0 && reinterpret_cast<uintptr_t>(o) % 16 == 0) {
    const int64_t n_vec = n / kVec;
    const auto* in_packs = reinterpret_cast<const Pack<TS, kVec>*>(s);
    auto* out_packs = reinterpret_cast<Pack<TO, kVec>*>(o);
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      const Pack<TS, kVec> in = cuda::global_load(in_packs + i);
      Pack<TO, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float y = cuda::to_opmath(cuda::from_opmath<TO>(cuda::to_opmath(in.v[j])));
        bad |= check && is_non_finite(y);
        out.v[j] = cuda::from_opmath<TO>(op(y));
      }
      cuda::global_store(out_packs + i, out);
    }
    scalar_begin = n_vec * kVec;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < n; i += blockDim.x) {
    const float y = cuda::to_opmath(cuda::from_opmath<TO>(cuda::to_opmath(cuda::global_load(s + i))));
    bad |= check && is_non_finite(y);
    cuda::global_store(o + i, cuda::from_opmath<TO>(op(y)));
  }
  return bad;
}

template <typename TS>
__device__ bool cast_chunk_to(const TS* s, void* o, DType out, int64_t n, const CastOp& op, bool check) {
  switch (out) {
    case DType::kFloat16:
      return cast_chunk(s, static_cast<__half*>(o), n, op, check);
    case DType::kBFloat16:
      return cast_chunk(s, static_cast<__nv_bfloat16*>(o), n, op, check);
    default:
      return cast_chunk(s, static_cast<float*>(o), n, op, check);
  }
}

// The per-chunk functor of the cast passes; `inv_scale == nullptr`: divide by `divisor`, no check.
// NOTE [Kernel parameter budget] states how many tensors one launch of each pass takes.
static_assert(cuda::MultiTensorArgsFor<1, UnscaleChunkOp>::kMaxTensors == 936,
              "one-list passes: 936 tensors per launch");

struct CastChunkOp {
  // Streams of the chunk table.
  static constexpr int kSrcIdx = 0;
  static constexpr int kOutIdx = 1;

  float divisor;
  const float* inv_scale;
  float* found_inf;

  template <typename Args>
  __device__ void operator()(const Args& args, int t, int64_t start, int64_t n) const {
    const CastOp op = inv_scale != nullptr ? CastOp::multiply_by(*inv_scale) : CastOp::divide_by(divisor);
    const DType out = args.dtype[kOutIdx][t];
    void* o = static_cast<char*>(args.data[kOutIdx][t]) + start * dtype_size(out);
    const bool check = inv_scale != nullptr;
    bool bad = false;
    switch (args.dtype[kSrcIdx][t]) {
      case DType::kFloat16:
        bad = cast_chunk_to(static_cast<const __half*>(args.data[kSrcIdx][t]) + start, o, out, n, op, check);
        break;
      case DType::kBFloat16:
        bad = cast_chunk_to(static_cast<const __nv_bfloat16*>(args.data[kSrcIdx][t]) + start, o, out, n, op, check);
        break;
      default:
        bad = cast_chunk_to(static_cast<const float*>(args.data[kSrcIdx][t]) + start, o, out, n, op, check);
        break;
    }
    if (bad) {
      *found_inf = 1.f;
    }
  }
};

// The chunk functor of grad_stats (NOTE [Gradient statistics], [Deterministic norm]). Each thread sums its lane
// in registers and stores it. The histogram is counted in the block's shared memory with one atomic per distinct
// bin of a warp instruction (the lanes of a bin found by __match_any_sync, the lowest adds their count) and added
// to the tensor's counter row once per bin and block; the other counts (integers and a maximum: any order gives
// the same result) are reduced over the warp by shuffles and over the block in shared memory, and go to the
// counter row with one atomic each per block. No atomic is made per element on a shared address.
struct GradStatsChunkOp {
  // Streams of the chunk table: the grads, the tensor's first row of partial sums, the tensor's counter row.
  static constexpr int kGradsIdx = 0;
  static constexpr int kPartialRowsIdx = 1;
  static constexpr int kCounterRowsIdx = 2;
  static constexpr int kNoBin = kGradHistBins;  // a lane with no element to count this round

  const float* inv_scale;
  const double* partials_base;

  struct Counts {  // trivial, as a __shared__ array's type must be
    unsigned long long non_finite;
    unsigned long long zeros;
    uint32_t max_bits;  // of the largest |x| (a non-negative float's bits order as the float)
  };

  template <typename T, typename Args>
  __device__ Counts chunk(const Args& args, int t, int64_t start, int64_t n, unsigned* hist) const {
    const T* g = static_cast<const T*>(args.data[kGradsIdx][t]) + start;
    auto* row = static_cast<unsigned long long*>(args.data[kCounterRowsIdx][t]);
    double* first_partial = static_cast<double*>(args.data[kPartialRowsIdx][t]);
    const int64_t chunk = start / cuda::kChunkSize;
    if (chunk == 0 && threadIdx.x == 0) {
      row[1] = static_cast<unsigned long long>((first_partial - partials_base) / kNormLanes);
      row[kGradStatsCounterColumns - 1] = static_cast<unsigned long long>(args.numel[t]);
    }
    const float inv = inv_scale != nullptr ? *inv_scale : 1.f;
    const int lane = static_cast<int>(threadIdx.x % 32);
    double sum = 0.0;
    Counts c{0, 0, 0};
    float max_abs = 0.f;
    // Lane threadIdx.x (NOTE [Deterministic norm]); the loop runs while its warp has an element, so that every
    // lane takes part in the match.
    for (int64_t i = threadIdx.x; i - lane < n; i += blockDim.x) {
      int bin = kNoBin;
      if (i < n) {
        const float x = cuda::to_opmath(cuda::global_load(g + i));
        if (is_non_finite(x)) {
          ++c.non_finite;
        } else if (x == 0.f) {
          ++c.zeros;
        } else {
          const double xd = static_cast<double>(x);
          sum = __dadd_rn(sum, __dmul_rn(xd, xd));  // no contraction: the CPU's order and rounding
          const float a = x < 0.f ? -x : x;
          max_abs = a > max_abs ? a : max_abs;
          bin = grad_hist_bin(x, inv);
        }
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin != kNoBin && __ffs(static_cast<int>(peers)) - 1 == lane) {
        atomicAdd(hist + bin, static_cast<unsigned>(__popc(peers)));
      }
    }
    cuda::global_store(first_partial + chunk * kNormLanes + threadIdx.x, sum);
    c.max_bits = bit_cast<uint32_t>(max_abs);
    return c;
  }

  template <typename Args>
  __device__ void operator()(const Args& args, int t, int64_t start, int64_t n) const {
    AMPKIT_SHARED(unsigned, hist, kGradHistBins);  // at most kChunkSize per bin
    AMPKIT_SHARED(Counts, warp_counts, cuda::kBlockThreads / 32);
    for (int b = threadIdx.x; b < kGradHistBins; b += blockDim.x) {
      hist[b] = 0u;
    }
    __syncthreads();
    Counts c{0, 0, 0};
    switch (args.dtype[kGradsIdx][t]) {
      case DType::kFloat16:
        c = chunk<__half>(args, t, start, n, hist);
        break;
      case DType::kBFloat16:
        c = chunk<__nv_bfloat16>(args, t, start, n, hist);
        break;
      default:
        c = chunk<float>(args, t, start, n, hist);
        break;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      c.non_finite += __shfl_xor_sync(0xffffffffu, c.non_finite, offset);
      c.zeros += __shfl_xor_sync(0xffffffffu, c.zeros, offset);
      const uint32_t other = __shfl_xor_sync(0xffffffffu, c.max_bits, offset);
      c.max_bits = other > c.max_bits ? other : c.max_bits;
    }
    if (threadIdx.x % 32 == 0) {
      warp_counts[threadIdx.x / 32] = c;
    }
    __syncthreads();
    auto* row = static_cast<unsigned long long*>(args.data[kCounterRowsIdx][t]);
    if (threadIdx.x == 0) {
      for (unsigned w = 1; w < blockDim.x / 32; ++w) {
        c.non_finite += warp_counts[w].non_finite;
        c.zeros += warp_counts[w].zeros;
        c.max_bits = warp_counts[w].max_bits > c.max_bits ? warp_counts[w].max_bits : c.max_bits;
      }
      if (c.non_finite != 0) {
        atomicAdd(row + kStatNonFinite, c.non_finite);
      }
      if (c.zeros != 0) {
        atomicAdd(row + kStatZeros, c.zeros);
      }
      if (c.max_bits != 0) {
        atomicMax(row, static_cast<unsigned long long>(c.max_bits));
      }
    }
    for (int b = threadIdx.x; b < kGradHistBins; b += blockDim.x) {
      if (hist[b] != 0u) {
        atomicAdd(row + 4 + b, static_cast<unsigned long long>(hist[b]));
      }
    }
  }
};

// One block per tensor: the norm from the partial sums in chunk and lane order (NOTE [Deterministic norm]), the
// row in doubles. Thread i adds the lanes of chunk i of a tile of blockDim.x chunks in lane order, and thread 0
// adds the tile's chunk sums in chunk order: the additions and order of one thread doing it all, with the lane
// sums of many chunks in parallel.
constexpr unsigned kFinishThreads = 128;

__global__ void __launch_bounds__(kFinishThreads)
    grad_stats_finish_kernel(const float* inv_scale, const unsigned long long* counters, const double* partials,
                             double* out) {
  AMPKIT_SHARED(double, chunk_sums, kFinishThreads);
  const int64_t t = blockIdx.x;
  const unsigned long long* row = counters + t * kGradStatsCounterColumns;
  const int64_t chunks =
      (static_cast<int64_t>(row[kGradStatsCounterColumns - 1]) + cuda::kChunkSize - 1) / cuda::kChunkSize;
  const double* p = partials + static_cast<int64_t>(row[1]) * kNormLanes;
  double total = 0.0;
  for (int64_t tile = 0; tile < chunks; tile += blockDim.x) {
    const int64_t c = tile + threadIdx.x;
    if (c < chunks) {
      double chunk_sum = 0.0;
      for (int l = 0; l < kNormLanes; ++l) {
        chunk_sum = __dadd_rn(chunk_sum, p[c * kNormLanes + l]);
      }
      chunk_sums[threadIdx.x] = chunk_sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t in_tile = chunks - tile < blockDim.x ? chunks - tile : blockDim.x;
      for (int64_t k = 0; k < in_tile; ++k) {
        total = __dadd_rn(total, chunk_sums[k]);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) {
    return;
  }
  double* o = out + t * kGradStatsColumns;
  const double inv = inv_scale != nullptr ? static_cast<double>(*inv_scale) : 1.0;
  o[kStatMaxAbs] = static_cast<double>(bit_cast<float>(static_cast<uint32_t>(row[0]))) * inv;
  o[kStatNorm] = sqrt(total) * inv;
  for (int k = kStatNonFinite; k < kGradStatsColumns; ++k) {
    o[k] = static_cast<double>(row[k]);
  }
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, int64_t* stats,
                                    const float* found_inf, UpdateScaleOp op) {
  op(scale, growth_tracker, hysteresis_tracker, stats, *found_inf);
}

}  // namespace

LaunchStatus launch_unscale_and_check(const TensorRef* grads, int64_t n, float* found_inf, const float* inv_scale,
                                      cudaStream_t stream) {
  const TensorRef* lists[1];
  lists[UnscaleChunkOp::kGradsIdx] = grads;
  return cuda::multi_tensor_apply<1>(lists, n, UnscaleChunkOp{found_inf, inv_scale}, stream);
}

LaunchStatus launch_check_finite(const TensorRef* tensors, int64_t n, float* found_inf, cudaStream_t stream) {
  const TensorRef* lists[1];
  lists[UnscaleChunkOp::kGradsIdx] = tensors;
  return cuda::multi_tensor_apply<1>(lists, n, UnscaleChunkOp{found_inf, nullptr}, stream);
}

LaunchStatus launch_cast(const TensorRef* src, const TensorRef* out, int64_t n, float divisor, const float* inv_scale,
                         float* found_inf, cudaStream_t stream) {
  const TensorRef* lists[2];
  lists[CastChunkOp::kSrcIdx] = src;
  lists[CastChunkOp::kOutIdx] = out;
  return cuda::multi_tensor_apply<2>(lists, n, CastChunkOp{divisor, inv_scale, found_inf}, stream);
}

int64_t grad_stats_chunks(int64_t numel) { return (numel + cuda::kChunkSize - 1) / cuda::kChunkSize; }

LaunchStatus launch_grad_stats(const TensorRef* grads, int64_t n, const float* inv_scale, double* out,
                               unsigned long long* counters, double* partials, cudaStream_t stream) {
  std::vector<TensorRef> partial_rows(static_cast<size_t>(n));
  std::vector<TensorRef> counter_rows(static_cast<size_t>(n));
  int64_t row = 0;
  for (int64_t i = 0; i < n; ++i) {
    partial_rows[i] = {partials + row * kNormLanes, grads[i].numel, DType::kFloat64};
    counter_rows[i] = {counters + i * kGradStatsCounterColumns, grads[i].numel, DType::kFloat64};
    row += grad_stats_chunks(grads[i].numel);
  }
  const TensorRef* lists[3];
  lists[GradStatsChunkOp::kGradsIdx] = grads;
  lists[GradStatsChunkOp::kPartialRowsIdx] = partial_rows.data();
  lists[GradStatsChunkOp::kCounterRowsIdx] = counter_rows.data();
  LaunchStatus status = cuda::multi_tensor_apply<3>(lists, n, GradStatsChunkOp{inv_scale, partials}, stream);
  if (!status.ok() || n == 0) {
    return status;
  }
  status.error = cuda::launch_kernel(grad_stats_finish_kernel, dim3(static_cast<unsigned>(n)), dim3(kFinishThreads),
                                     stream, inv_scale, counters, partials, out);
  status.launches += status.ok() ? 1 : 0;
  return status;
}

LaunchStatus launch_update_scale(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, int64_t* stats,
                                 const float* found_inf, const UpdateScaleOp& op, cudaStream_t stream) {
  LaunchStatus status;
  status.error = cuda::launch_kernel(update_scale_kernel, dim3(1), dim3(1), stream, scale, growth_tracker,
                                     hysteresis_tracker, stats, found_inf, op);
  status.launches = status.ok() ? 1 : 0;
  return status;
}

}  // namespace ampkit::kernels
