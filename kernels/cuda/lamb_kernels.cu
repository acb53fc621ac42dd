// CUDA kernels of the LAMB step (NOTE [LAMB passes] in optim_functors.h) and of the global grad norm, on ampkit's
// multi-tensor apply, with norms summed in the fixed order of NOTE [Deterministic norm].
#include "optim_passes.cuh"

namespace ampkit::kernels {
namespace {

// The chunk table of the moments and apply passes has the streams of the other steps (launch_step), with stream
// kNormRowIdx (max_exp_avg_sq's: LAMB has none) pointing at the tensor's first row of scratch: lane sums in the
// moments pass, the tensor's norms in the apply pass. One CUDA thread is one lane of NOTE [Deterministic norm].
// Between the two, lane_sums_kernel turns each chunk's lanes into its chunk sums and tensor_norms_kernel each
// tensor's chunk sums (in chunk order) into its two sums of squares, stored over its first row: the apply pass
// reads two doubles per chunk instead of every thread re-adding all chunk sums of its tensor (O(chunks^2) per
// tensor).
static_assert(cuda::kBlockThreads == kNormLanes, "a block's threads are the lanes of the deterministic norm");
constexpr int kNormRowIdx = kMaxExpAvgSqIdx;

// The FP32 weight of element i: the master, the BF16 weight joined with its remainder, or the parameter (with a
// Kahan compensation or stochastic rounding: the BF16 weight itself).
template <typename T, typename Args>
__device__ AMPKIT_INLINE float load_weight(const Args& a, int t, int64_t i, WeightStore store) {
  if (a.data[kMasterIdx][t] != nullptr) {
    return global_load(static_cast<const float*>(a.data[kMasterIdx][t]) + i);
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (store == WeightStore::kRemainder) {
      return join_remainder(global_load(static_cast<const uint16_t*>(a.data[kParamIdx][t]) + i),
                            global_load(static_cast<const int16_t*>(a.data[kRemainderIdx][t]) + i));
    }
  }
  return to_opmath(global_load(static_cast<const T*>(a.data[kParamIdx][t]) + i));
}

// Stores the updated weight w of element i (w0: the weight load_weight read) as the launch keeps it; `step`: the
// step count the update reaches (stochastic rounding's counter, NOTE [Counter-based stochastic rounding]).
template <typename T, typename Args>
__device__ AMPKIT_INLINE void store_weight(const Args& a, int t, int64_t i, float w0, float w, WeightStore store,
                                           uint32_t step) {
  if (a.data[kMasterIdx][t] != nullptr) {
    global_store(static_cast<float*>(a.data[kMasterIdx][t]) + i, w);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    auto* bits = static_cast<uint16_t*>(a.data[kParamIdx][t]) + i;
    if (store == WeightStore::kRemainder) {
      uint16_t b;
      int16_t rem;
      split_remainder(w, &b, &rem);
      global_store(bits, b);
      global_store(static_cast<int16_t*>(a.data[kRemainderIdx][t]) + i, rem);
      return;
    }
    if (store == WeightStore::kKahan) {
      auto* comp = static_cast<uint16_t*>(a.data[kRemainderIdx][t]) + i;
      uint16_t b;
      uint16_t c = global_load(comp);
      kahan_store(w0, w, &b, &c);
      global_store(bits, b);
      global_store(comp, c);
      return;
    }
    if (store == WeightStore::kStochastic) {
      const auto seed = static_cast<uint64_t>(*static_cast<const int64_t*>(a.data[kRemainderIdx][t]));
      global_store(bits, bf16_bits_stochastic(w, rounding_bits(seed, step, i)));
      return;
    }
  }
  global_store(static_cast<T*>(a.data[kParamIdx][t]) + i, from_opmath<T>(w));
}

// Calls chunk(T{}) with T the element type of stream `stream` of tensor t.
template <typename Args, typename Chunk>
__device__ AMPKIT_INLINE void dispatch_stream_dtype(const Args& a, int stream, int t, const Chunk& chunk) {
  switch (a.dtype[stream][t]) {
    case DType::kFloat16:
      chunk(__half{});
      break;
    case DType::kBFloat16:
      chunk(__nv_bfloat16{});
      break;
    default:
      chunk(float{});
      break;
  }
}

__device__ AMPKIT_INLINE double add_square(double sum, float x) {
  const double d = static_cast<double>(x);
  return __dadd_rn(sum, __dmul_rn(d, d));  // no contraction: the CPU's rounding
}

struct LambMomentsChunkOp {
  LambOp op;
  DeviceScalars dev;
  const float* grad_norm;
  WeightStore store;

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    // Per thread, not once per block (NOTE [Step factors once per block]): with the block's copy, ptxas gave this
    // kernel 40 registers and spilled; per thread it takes 46 and none.
    const LambStepFactors f = LambStepFactors::at_step(op.p, *static_cast<const float*>(a.data[kStepIdx][t]) + 1.f);
    const float divisor =
        lamb_grad_divisor(dev.grad_scale != nullptr ? *dev.grad_scale : 1.f, grad_norm, op.p.max_grad_norm);
    float* m = static_cast<float*>(a.data[kExpAvgIdx][t]);
    float* v = static_cast<float*>(a.data[kExpAvgSqIdx][t]);
    double w_sq = 0.0;
    double u_sq = 0.0;
    with_param_and_grad_types(a, t, [&](auto param_zero, auto grad_zero) {
      using T = decltype(param_zero);
      const auto* grad = static_cast<const decltype(grad_zero)*>(a.data[kGradIdx][t]);
      // Lane threadIdx.x of NOTE [Deterministic norm]: elements threadIdx.x, + blockDim.x, ... of the chunk.
      for (int64_t i = start + threadIdx.x; i < start + n; i += blockDim.x) {
        const float w = load_weight<T>(a, t, i, store);
        float g = to_opmath(global_load(grad + i));
        if (divisor != 1.f) {
          g = g / divisor;
        }
        float mi = global_load(m + i);
        float vi = global_load(v + i);
        const float u = op.moments(w, g, mi, vi, f);
        global_store(m + i, mi);
        global_store(v + i, vi);
        w_sq = add_square(w_sq, w);
        u_sq = add_square(u_sq, u);
      }
    });
    if (op.trust_ratio()) {
      double* row = static_cast<double*>(a.data[kNormRowIdx][t]) + (start / cuda::kChunkSize) * 2 * kNormLanes;
      global_store(row + threadIdx.x, w_sq);
      global_store(row + kNormLanes + threadIdx.x, u_sq);
    }
  }
};

// sums[r] = the lane sums of row r in lane order (one thread per row).
__global__ void lane_sums_kernel(const double* lanes, double* sums, int64_t rows, const float* found_inf) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows || (found_inf != nullptr && *found_inf != 0.f)) {
    return;
  }
  double s = 0.0;
  for (int l = 0; l < kNormLanes; ++l) {
    s = __dadd_rn(s, lanes[r * kNormLanes + l]);
  }
  sums[r] = s;
}

// The rows of norm scratch of up to kMaxNormTensorsPerLaunch tensors with chunks: tensor j owns rows
// [first[j], first[j + 1]) (rows are consecutive in list order).
constexpr int kMaxNormTensorsPerLaunch = 2000;
struct TensorRows {
  int64_t first[kMaxNormTensorsPerLaunch + 1];
  int n;
};

// sums[2 * first[j]] and sums[2 * first[j] + 1] = tensor j's ||w||^2 and ||u||^2: its chunk sums added in chunk
// order (one thread per tensor; it reads every row of its tensor before it writes the first).
__global__ void tensor_norms_kernel(AMPKIT_GRID_CONSTANT(TensorRows) rows, double* sums, const float* found_inf) {
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= rows.n || (found_inf != nullptr && *found_inf != 0.f)) {
    return;
  }
  double w_sq = 0.0;
  double u_sq = 0.0;
  for (int64_t r = rows.first[j]; r < rows.first[j + 1]; ++r) {
    w_sq = __dadd_rn(w_sq, sums[2 * r]);
    u_sq = __dadd_rn(u_sq, sums[2 * r + 1]);
  }
  sums[2 * rows.first[j]] = w_sq;
  sums[2 * rows.first[j] + 1] = u_sq;
}

// tensor_norms_kernel over every tensor of the list that has chunks, kMaxNormTensorsPerLaunch per launch.
LaunchStatus launch_tensor_norms(const OptimTensor* tensors, int64_t n, double* sums, const float* found_inf,
                                 cudaStream_t stream) {
  constexpr unsigned kThreads = 128;
  LaunchStatus status;
  TensorRows rows;
  rows.n = 0;
  int64_t row = 0;
  auto flush = [&]() {
    rows.first[rows.n] = row;
    const unsigned blocks = (static_cast<unsigned>(rows.n) + kThreads - 1) / kThreads;
    status.error =
        cuda::launch_kernel(tensor_norms_kernel, dim3(blocks), dim3(kThreads), stream, rows, sums, found_inf);
    status.launches += status.ok() ? 1 : 0;
    rows.n = 0;
  };
  for (int64_t i = 0; i < n && status.ok(); ++i) {
    const int64_t chunks = norm_chunks(tensors[i].numel);
    if (chunks == 0) {
      continue;
    }
    rows.first[rows.n++] = row;
    row += chunks;
    if (rows.n == kMaxNormTensorsPerLaunch) {
      flush();
    }
  }
  if (status.ok() && rows.n > 0) {
    flush();
  }
  return status;
}

struct LambApplyChunkOp {
  LambOp op;
  DeviceScalars dev;
  WeightStore store;

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    const LambStepFactors f = block_factors<LambStepFactors>([&] {  // NOTE [Step factors once per block]
      return LambStepFactors::at_step(op.p, *static_cast<const float*>(a.data[kStepIdx][t]) + 1.f);
    });
    // The tensor's norms, summed once by tensor_norms_kernel.
    double w_sq = 0.0;
    double u_sq = 0.0;
    if (op.trust_ratio()) {
      const double* norms = static_cast<const double*>(a.data[kNormRowIdx][t]);
      w_sq = norms[0];
      u_sq = norms[1];
    }
    const float factor = lamb_update_factor(dev.lr_or(op.p.lr), w_sq, u_sq, op.trust_ratio());
    const float* m = static_cast<const float*>(a.data[kExpAvgIdx][t]);
    const float* v = static_cast<const float*>(a.data[kExpAvgSqIdx][t]);
    const auto step = static_cast<uint32_t>(*static_cast<const float*>(a.data[kStepIdx][t]) + 1.f);
    dispatch_stream_dtype(a, kParamIdx, t, [&](auto zero) {
      using T = decltype(zero);
      for (int64_t i = start + threadIdx.x; i < start + n; i += blockDim.x) {
        const float w = load_weight<T>(a, t, i, store);
        const float u = op.direction(w, global_load(m + i), global_load(v + i), f);
        store_weight<T>(a, t, i, w, fmaf(factor, u, w), store, step);
      }
    });
  }
};

static_assert(cuda::MultiTensorArgsFor<kStreams, LambMomentsChunkOp>::kMaxTensors == 192 &&
                  cuda::MultiTensorArgsFor<kStreams, LambApplyChunkOp>::kMaxTensors == 192,
              "LAMB's passes take 192 tensors per launch (NOTE [Kernel parameter budget])");

// The global norm from the chunk sums in the finish-lane order of NOTE [Deterministic norm]: thread k is finish
// lane k (a warp reads 32 consecutive sums), thread 0 adds the lanes in lane order.
__global__ void __launch_bounds__(kNormFinishLanes)
    grad_norm_finish_kernel(const double* sums, int64_t rows, const float* grad_scale, float* out) {
  AMPKIT_SHARED(double, lane_sums, kNormFinishLanes);
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kNormFinishLanes) {
    s = __dadd_rn(s, global_load(sums + r));
  }
  lane_sums[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x != 0) {
    return;
  }
  double total = 0.0;
  for (int k = 0; k < kNormFinishLanes; ++k) {
    total = __dadd_rn(total, lane_sums[k]);
  }
  *out = static_cast<float>(sqrt(total) / (grad_scale != nullptr ? static_cast<double>(*grad_scale) : 1.0));
}

// The lane sums of the squares of the raw grads.
struct GradSquaresChunkOp {
  // Streams of the chunk table: the grads, and the tensor's first row of lane sums.
  static constexpr int kGradsIdx = 0;
  static constexpr int kLaneRowsIdx = 1;

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    double sum = 0.0;
    dispatch_stream_dtype(a, kGradsIdx, t, [&](auto zero) {
      using T = decltype(zero);
      const T* grad = static_cast<const T*>(a.data[kGradsIdx][t]) + start;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        sum = add_square(sum, to_opmath(global_load(grad + i)));
      }
    });
    global_store(static_cast<double*>(a.data[kLaneRowsIdx][t]) + (start / cuda::kChunkSize) * kNormLanes + threadIdx.x,
                 sum);
  }
};

LaunchStatus launch_lane_sums(const double* lanes, double* sums, int64_t rows, const float* found_inf,
                              cudaStream_t stream) {
  LaunchStatus status;
  if (rows == 0) {
    return status;
  }
  constexpr unsigned kThreads = 128;
  status.error = cuda::launch_kernel(lane_sums_kernel, dim3(static_cast<unsigned>((rows + kThreads - 1) / kThreads)),
                                     dim3(kThreads), stream, lanes, sums, rows, found_inf);
  status.launches = status.ok() ? 1 : 0;
  return status;
}

}  // namespace

int64_t norm_chunks(int64_t numel) { return (numel + cuda::kChunkSize - 1) / cuda::kChunkSize; }

LaunchStatus launch_grad_norm(const TensorRef* grads, int64_t n, const float* grad_scale, float* out, double* lanes,
                              double* sums, cudaStream_t stream) {
  std::vector<TensorRef> rows(static_cast<size_t>(n));
  int64_t row = 0;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = {lanes + row * kNormLanes, grads[i].numel, DType::kFloat64};
    row += norm_chunks(grads[i].numel);
  }
  const TensorRef* lists[2];
  lists[GradSquaresChunkOp::kGradsIdx] = grads;
  lists[GradSquaresChunkOp::kLaneRowsIdx] = rows.data();
  LaunchStatus status = cuda::multi_tensor_apply<2>(lists, n, GradSquaresChunkOp{}, stream);
  auto then = [&status](LaunchStatus next) {
    status.error = next.error;
    status.launches += next.launches;
  };
  if (status.ok()) {
    then(launch_lane_sums(lanes, sums, row, nullptr, stream));
  }
  if (status.ok()) {
    LaunchStatus finish;
    finish.error = cuda::launch_kernel(grad_norm_finish_kernel, dim3(1), dim3(kNormFinishLanes), stream, sums, row,
                                       grad_scale, out);
    finish.launches = finish.ok() ? 1 : 0;
    then(finish);
  }
  return status;
}

LaunchStatus launch_lamb_step(const OptimTensor* tensors, int64_t n, const LambParams& params, const float* grad_scale,
                              const float* found_inf, const float* lr, const float* grad_norm, double* lanes,
                              double* sums, cudaStream_t stream) {
  const LambOp op{params};
  const DeviceScalars dev{grad_scale, found_inf, lr};
  // Stream kNormRowIdx of each tensor: its first row of lane sums (moments pass), then of sums (the apply pass
  // reads the tensor's norms there).
  std::vector<OptimTensor> with_rows(tensors, tensors + n);
  std::vector<OptimTensor> with_sums(tensors, tensors + n);
  int64_t row = 0;
  for (int64_t i = 0; i < n; ++i) {
    with_rows[i].max_exp_avg_sq = reinterpret_cast<float*>(lanes + row * 2 * kNormLanes);
    with_sums[i].max_exp_avg_sq = reinterpret_cast<float*>(sums + row * 2);
    row += norm_chunks(tensors[i].numel);
  }
  const WeightStore store = weight_store(tensors, n);
  LaunchStatus status = launch_passes(with_rows.data(), n, LambMomentsChunkOp{op, dev, grad_norm, store}, stream);
  auto then = [&status](LaunchStatus next) {
    status.error = next.error;
    status.launches += next.launches;
  };
  if (status.ok() && op.trust_ratio()) {
    then(launch_lane_sums(lanes, sums, row * 2, found_inf, stream));
  }
  if (status.ok() && op.trust_ratio()) {
    then(launch_tensor_norms(tensors, n, sums, found_inf, stream));
  }
  if (status.ok()) {
    then(launch_step(with_sums.data(), n, LambApplyChunkOp{op, dev, store}, found_inf, stream));
  }
  return status;
}

}  // namespace ampkit::kernels
