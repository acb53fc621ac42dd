// CUDA kernels of the fused optimizer steps on ampkit's multi-tensor apply: one pass per parameter reads the
// grad, unscales it in registers, updates the FP32 master and moments and writes the low-precision weight; a
// device-side found_inf skips every write, step counts included.
#include <type_traits>
#include <vector>

#include "launch.cuh"
#include "multi_tensor_apply.cuh"
#include "optim_launch.h"

namespace ampkit::kernels {
namespace {

// Streams in the chunk table: 0 param, 1 grad, 2 master, 3 exp_avg, 4 exp_avg_sq, 5 max_exp_avg_sq, 6 step,
// 7 remainder.
constexpr int kStreams = 8;

using cuda::global_load;
using cuda::global_store;

// FP32 values of FP16/BF16/FP32 elements, and back with one rounding to nearest-even.
__device__ AMPKIT_INLINE float to_float(__half v) { return __half2float(v); }
__device__ AMPKIT_INLINE float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ AMPKIT_INLINE float to_float(float v) { return v; }
template <typename T>
__device__ AMPKIT_INLINE T from_float(float v);
template <>
__device__ AMPKIT_INLINE __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ AMPKIT_INLINE __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ AMPKIT_INLINE float from_float<float>(float v) { return v; }

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Writes back the optimizer states of element i that exist.
__device__ AMPKIT_INLINE void store_moments(float* m, float* v, float* vmax, int64_t i, float mi, float vi,
                                            float vmi) {
  if (m) {
    global_store(m + i, mi);
  }
  if (v) {
    global_store(v + i, vi);
  }
  if (vmax) {
    global_store(vmax + i, vmi);
  }
}

// How the elements of one chunk read their grads: divided by the scale (when `unscale`), stored back unscaled
// (when `write`); elements from index `tail_from` of the tensor on take the scalar-tail formulas (NOTE [torch's
// scalar tail]).
struct GradIn {
  float scale;
  bool unscale;
  bool write;
  int tail_width;
};

// NOTE [Optimizer chunk loop]
// One block walks a 64K-element chunk in packs of kVec = 4 elements per stream (16 bytes for FP32 streams, 8 for
// the 16-bit ones). Each stream is accessed with one vector access per pack where its base is aligned for it and
// with kVec element accesses where it is not: the decision is per stream and chunk (uniform over the block), so a
// misaligned grad does not make the master and the moments go scalar. Each thread loads kUnroll = 2 packs of
// every stream before any arithmetic: with 512-thread blocks and the 65-128 registers these kernels take, one block
// fits an SM whatever the register count in that range (bench/results/*_ptxas_sm90.txt), so the second pack's
// loads cost no occupancy and double the bytes in flight. The BF16 weight + int16 remainder mode runs the same
// vector loop. Only the last n % kVec elements of a chunk take the scalar loop.
template <typename T, int kVec>
struct StreamIO {
  T* p;
  bool vec;  // the base is aligned for one access per pack

  __device__ AMPKIT_INLINE Pack<T, kVec> load(int64_t pack) const {
    if (vec) {
      return global_load(reinterpret_cast<const Pack<T, kVec>*>(p) + pack);
    }
    Pack<T, kVec> r;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      r.v[j] = global_load(p + pack * kVec + j);
    }
    return r;
  }
  __device__ AMPKIT_INLINE void store(int64_t pack, const Pack<T, kVec>& x) const {
    if (vec) {
      global_store(reinterpret_cast<Pack<T, kVec>*>(p) + pack, x);
      return;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      global_store(p + pack * kVec + j, x.v[j]);
    }
  }
};

template <int kVec, typename T>
__device__ AMPKIT_INLINE StreamIO<T, kVec> stream_io(T* p) {
  return {p, p != nullptr && reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0};
}

// Calls body(w, g, m, v, vmax, tail) on every element of chunk [start, start + n) of tensor t.
template <typename T, typename Args, typename Body>
__device__ void for_each_element(const Args& a, int t, int64_t start, int64_t n, const GradIn& gin,
                                 const Body& body) {
  constexpr int kVec = 4;
  constexpr int kUnroll = 2;
  using PackT = Pack<T, kVec>;
  using PackF = Pack<float, kVec>;
  using PackB = Pack<uint16_t, kVec>;
  using PackR = Pack<int16_t, kVec>;
  auto* param = static_cast<T*>(a.data[0][t]) + start;
  auto* grad = static_cast<T*>(a.data[1][t]) + start;
  // Index (in the chunk) of the first scalar-tail element.
  const int64_t tail_from = tail_start(a.numel[t], gin.tail_width) - start;
  auto offset = [&](int s) { return a.data[s][t] ? static_cast<float*>(a.data[s][t]) + start : nullptr; };
  float* master = offset(2);
  float* m = offset(3);
  float* v = offset(4);
  float* vmax = offset(5);
  // BF16 weight + int16 remainder: the exact FP32 master without a FP32 copy.
  int16_t* rem = nullptr;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    rem = a.data[7][t] ? static_cast<int16_t*>(a.data[7][t]) + start : nullptr;
  }
  auto* bits = reinterpret_cast<uint16_t*>(param);
  const auto param_io = stream_io<kVec>(param);
  const auto grad_io = stream_io<kVec>(grad);
  const auto bits_io = stream_io<kVec>(bits);
  const auto rem_io = stream_io<kVec>(rem);
  const auto master_io = stream_io<kVec>(master);
  const auto m_io = stream_io<kVec>(m);
  const auto v_io = stream_io<kVec>(v);
  const auto vmax_io = stream_io<kVec>(vmax);

  struct Packs {
    PackT g;
    PackF w, m, v, vm;
  };
  // Reads pack i of every stream (the param only when it holds the weight: a master-weight step only writes it).
  auto load = [&](int64_t i, Packs& r) {
    r.g = grad_io.load(i);
    if (master) {
      r.w = master_io.load(i);
    } else if (rem) {
      const PackB b = bits_io.load(i);
      const PackR q = rem_io.load(i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        r.w.v[j] = join_remainder(b.v[j], q.v[j]);
      }
    } else {
      const PackT p = param_io.load(i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        r.w.v[j] = to_float(p.v[j]);
      }
    }
    if (m) {
      r.m = m_io.load(i);
    }
    if (v) {
      r.v = v_io.load(i);
    }
    if (vmax) {
      r.vm = vmax_io.load(i);
    }
  };
  auto update = [&](int64_t i, Packs& r) {
    float gf[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      gf[j] = gin.unscale ? to_float(r.g.v[j]) / gin.scale : to_float(r.g.v[j]);
    }
    if (gin.unscale && gin.write) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        r.g.v[j] = from_float<T>(gf[j]);
      }
      grad_io.store(i, r.g);
    }
    PackT p4;
    PackB b4;
    PackR q4;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      // Scalars, not array elements, go to the functor: their addresses stay in registers.
      float w = r.w.v[j];
      float mj = r.m.v[j];
      float vj = r.v.v[j];
      float vmj = r.vm.v[j];
      body(w, gf[j], m ? &mj : nullptr, v ? &vj : nullptr, vmax ? &vmj : nullptr, i * kVec + j >= tail_from);
      r.m.v[j] = mj;
      r.v.v[j] = vj;
      r.vm.v[j] = vmj;
      r.w.v[j] = w;
      if (rem) {
        split_remainder(w, &b4.v[j], &q4.v[j]);
      } else {
        p4.v[j] = from_float<T>(w);
      }
    }
    if (rem) {
      bits_io.store(i, b4);
      rem_io.store(i, q4);
    } else {
      param_io.store(i, p4);
    }
    if (master) {
      master_io.store(i, r.w);
    }
    if (m) {
      m_io.store(i, r.m);
    }
    if (v) {
      v_io.store(i, r.v);
    }
    if (vmax) {
      vmax_io.store(i, r.vm);
    }
  };
  const int64_t n_vec = n / kVec;
  const int64_t stride = static_cast<int64_t>(blockDim.x);
  for (int64_t base = threadIdx.x; base < n_vec; base += kUnroll * stride) {
    Packs r[kUnroll]{};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < n_vec) {
        load(base + u * stride, r[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < n_vec) {
        update(base + u * stride, r[u]);
      }
    }
  }
  for (int64_t i = n_vec * kVec + threadIdx.x; i < n; i += stride) {
    float w = master ? global_load(master + i)
              : rem  ? join_remainder(global_load(bits + i), global_load(rem + i))
                     : to_float(global_load(param + i));
    float g = to_float(global_load(grad + i));
    if (gin.unscale) {
      g = g / gin.scale;
      if (gin.write) {
        global_store(grad + i, from_float<T>(g));
      }
    }
    float mi = m ? global_load(m + i) : 0.f;
    float vi = v ? global_load(v + i) : 0.f;
    float vmi = vmax ? global_load(vmax + i) : 0.f;
    body(w, g, m ? &mi : nullptr, v ? &vi : nullptr, vmax ? &vmi : nullptr, i >= tail_from);
    store_moments(m, v, vmax, i, mi, vi, vmi);
    if (rem) {
      uint16_t wb;
      int16_t rb;
      split_remainder(w, &wb, &rb);
      global_store(bits + i, wb);
      global_store(rem + i, rb);
    } else {
      if (master) {
        global_store(master + i, w);
      }
      global_store(param + i, from_float<T>(w));
    }
  }
}

template <typename Args, typename Body>
__device__ void dispatch_dtype(const Args& a, int t, int64_t start, int64_t n, const GradIn& gin,
                               const Body& body) {
  switch (a.dtype[0][t]) {
    case DType::kFloat16:
      for_each_element<__half>(a, t, start, n, gin, body);
      break;
    case DType::kBFloat16:
      for_each_element<__nv_bfloat16>(a, t, start, n, gin, body);
      break;
    default:
      for_each_element<float>(a, t, start, n, gin, body);
      break;
  }
}

// What every fused step reads from the device besides the tensors: the skip flag, the grad scale and the lr.
struct DeviceScalars {
  const float* grad_scale;
  const float* found_inf;
  const float* lr;

  __device__ bool skipped() const { return found_inf != nullptr && *found_inf != 0.f; }
  // Grads are divided by the scale, as torch's fused kernels do.
  __device__ GradIn grad_in(bool write, int tail_width) const {
    return GradIn{grad_scale != nullptr ? *grad_scale : 1.f, grad_scale != nullptr && *grad_scale != 1.f, write,
                  tail_width};
  }
  __device__ double lr_or(double lr_arg) const { return lr != nullptr ? static_cast<double>(*lr) : lr_arg; }
};

struct AdamChunkOp {
  AdamOp op;
  DeviceScalars dev;

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    const float step = *static_cast<const float*>(a.data[6][t]) + 1.f;
    const AdamStepFactors f = AdamStepFactors::at_step(op.p, dev.lr_or(op.p.lr), step);
    dispatch_dtype(a, t, start, n, dev.grad_in(op.p.write_unscaled_grads, op.p.tail_width),
                   [&](float& w, float g, float* m, float* v, float* vmax, bool tail) {
                     op(w, g, *m, *v, vmax, f, tail);
                   });
  }
};

struct SgdChunkOp {
  SgdOp op;
  DeviceScalars dev;

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    SgdParams p = op.p;
    p.lr = dev.lr_or(p.lr);
    const SgdOp step_op(p);
    const bool first = a.data[6][t] == nullptr || *static_cast<const float*>(a.data[6][t]) == 0.f;
    dispatch_dtype(a, t, start, n, dev.grad_in(p.write_unscaled_grads, p.tail_width),
                   [&](float& w, float g, float* buf, float*, float*, bool tail) {
                     step_op(w, g, buf, first, tail);
                   });
  }
};

// Step counts live in their own one-element tensors; they are bumped after the update kernel (which reads them).
constexpr int kMaxStepsPerLaunch = 2000;
struct StepList {
  float* step[kMaxStepsPerLaunch];
  int n;
};

__global__ void increment_steps_kernel(AMPKIT_GRID_CONSTANT(StepList) list, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) {
    return;
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < list.n; i += gridDim.x * blockDim.x) {
    *list.step[i] += 1.f;
  }
}

// One multi-tensor pass of `op` over the optimizer streams of `tensors`.
template <typename ChunkOp>
LaunchStatus launch_passes(const OptimTensor* tensors, int64_t n, const ChunkOp& op, cudaStream_t stream) {
  // The chunk table's stream lists: lists[s * n + i] is stream s of tensor i.
  std::vector<TensorRef> lists(static_cast<size_t>(kStreams * n));
  for (int64_t i = 0; i < n; ++i) {
    const OptimTensor& t = tensors[i];
    void* streams[kStreams] = {t.param, t.grad, t.master, t.exp_avg, t.exp_avg_sq,
                               t.max_exp_avg_sq, t.step, t.remainder};
    for (int s = 0; s < kStreams; ++s) {
      lists[s * n + i] = TensorRef{streams[s], t.numel, s < 2 ? t.dtype : DType::kFloat32};
    }
  }
  const TensorRef* heads[kStreams];
  for (int s = 0; s < kStreams; ++s) {
    heads[s] = lists.data() + s * n;
  }
  return cuda::multi_tensor_apply<kStreams>(heads, n, op, stream);
}

// The pass of `op`, then every step count += 1 (unless *found_inf != 0).
template <typename ChunkOp>
LaunchStatus launch_step(const OptimTensor* tensors, int64_t n, const ChunkOp& op, const float* found_inf,
                         cudaStream_t stream) {
  LaunchStatus status = launch_passes(tensors, n, op, stream);
  StepList steps;
  steps.n = 0;
  auto flush = [&]() {
    status.error = cuda::launch_kernel(increment_steps_kernel, dim3((steps.n + 255) / 256), dim3(256), stream, steps,
                                       found_inf);
    status.launches += status.ok() ? 1 : 0;
    steps.n = 0;
  };
  for (int64_t i = 0; i < n && status.ok(); ++i) {
    if (tensors[i].step != nullptr) {
      steps.step[steps.n++] = tensors[i].step;
      if (steps.n == kMaxStepsPerLaunch) {
        flush();
      }
    }
  }
  if (status.ok() && steps.n > 0) {
    flush();
  }
  return status;
}

// ---- LAMB (NOTE [LAMB passes] in optim_functors.h) ----
// The chunk table of the moments and apply passes has the streams of the other steps (launch_step), with stream 5
// (no max_exp_avg_sq in LAMB) pointing at the tensor's first row of scratch: lane sums in the moments pass, chunk
// sums in the apply pass. One CUDA thread is one lane of NOTE [Deterministic norm].
static_assert(cuda::kBlockThreads == kNormLanes, "a block's threads are the lanes of the deterministic norm");

template <typename T, typename Args>
__device__ AMPKIT_INLINE float load_weight(const Args& a, int t, int64_t i) {
  if (a.data[2][t] != nullptr) {
    return global_load(static_cast<const float*>(a.data[2][t]) + i);
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (a.data[7][t] != nullptr) {
      return join_remainder(global_load(static_cast<const uint16_t*>(a.data[0][t]) + i),
                            global_load(static_cast<const int16_t*>(a.data[7][t]) + i));
    }
  }
  return to_float(global_load(static_cast<const T*>(a.data[0][t]) + i));
}

template <typename T, typename Args>
__device__ AMPKIT_INLINE void store_weight(const Args& a, int t, int64_t i, float w) {
  if (a.data[2][t] != nullptr) {
    global_store(static_cast<float*>(a.data[2][t]) + i, w);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (a.data[7][t] != nullptr) {
      uint16_t bits;
      int16_t rem;
      split_remainder(w, &bits, &rem);
      global_store(static_cast<uint16_t*>(a.data[0][t]) + i, bits);
      global_store(static_cast<int16_t*>(a.data[7][t]) + i, rem);
      return;
    }
  }
  global_store(static_cast<T*>(a.data[0][t]) + i, from_float<T>(w));
}

template <typename Args, typename Chunk>
__device__ AMPKIT_INLINE void dispatch_weight_dtype(const Args& a, int t, const Chunk& chunk) {
  switch (a.dtype[0][t]) {
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

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    const LambStepFactors f = LambStepFactors::at_step(op.p, *static_cast<const float*>(a.data[6][t]) + 1.f);
    const float divisor = lamb_grad_divisor(dev.grad_scale != nullptr ? *dev.grad_scale : 1.f, grad_norm,
                                            op.p.max_grad_norm);
    float* m = static_cast<float*>(a.data[3][t]);
    float* v = static_cast<float*>(a.data[4][t]);
    double w_sq = 0.0;
    double u_sq = 0.0;
    dispatch_weight_dtype(a, t, [&](auto zero) {
      using T = decltype(zero);
      const T* grad = static_cast<const T*>(a.data[1][t]);
      // Lane threadIdx.x of NOTE [Deterministic norm]: elements threadIdx.x, + blockDim.x, ... of the chunk.
      for (int64_t i = start + threadIdx.x; i < start + n; i += blockDim.x) {
        const float w = load_weight<T>(a, t, i);
        float g = to_float(global_load(grad + i));
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
      double* row = static_cast<double*>(a.data[5][t]) + (start / cuda::kChunkSize) * 2 * kNormLanes;
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

struct LambApplyChunkOp {
  LambOp op;
  DeviceScalars dev;

  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    if (dev.skipped()) {
      return;
    }
    const LambStepFactors f = LambStepFactors::at_step(op.p, *static_cast<const float*>(a.data[6][t]) + 1.f);
    // The tensor's norms from its chunk sums in chunk order; every thread adds them alike (the chunk sums are a
    // few cached doubles per 64K elements).
    double w_sq = 0.0;
    double u_sq = 0.0;
    if (op.trust_ratio()) {
      const double* sums = static_cast<const double*>(a.data[5][t]);
      const int64_t chunks = (a.numel[t] + cuda::kChunkSize - 1) / cuda::kChunkSize;
      for (int64_t c = 0; c < chunks; ++c) {
        w_sq = __dadd_rn(w_sq, sums[2 * c]);
        u_sq = __dadd_rn(u_sq, sums[2 * c + 1]);
      }
    }
    const float factor = lamb_update_factor(dev.lr_or(op.p.lr), w_sq, u_sq, op.trust_ratio());
    const float* m = static_cast<const float*>(a.data[3][t]);
    const float* v = static_cast<const float*>(a.data[4][t]);
    dispatch_weight_dtype(a, t, [&](auto zero) {
      using T = decltype(zero);
      for (int64_t i = start + threadIdx.x; i < start + n; i += blockDim.x) {
        const float w = load_weight<T>(a, t, i);
        const float u = op.direction(w, global_load(m + i), global_load(v + i), f);
        store_weight<T>(a, t, i, fmaf(factor, u, w));
      }
    });
  }
};

// The global norm: chunk sums in list order, one thread.
__global__ void grad_norm_finish_kernel(const double* sums, int64_t rows, const float* grad_scale, float* out) {
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    total = __dadd_rn(total, sums[r]);
  }
  *out = static_cast<float>(sqrt(total) / (grad_scale != nullptr ? static_cast<double>(*grad_scale) : 1.0));
}

// The lane sums of the squares of the raw grads. Streams: 0 the grads, 1 the tensor's first row of lane sums.
struct GradSquaresChunkOp {
  template <typename Args>
  __device__ void operator()(const Args& a, int t, int64_t start, int64_t n) const {
    double sum = 0.0;
    dispatch_weight_dtype(a, t, [&](auto zero) {
      using T = decltype(zero);
      const T* grad = static_cast<const T*>(a.data[0][t]) + start;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        sum = add_square(sum, to_float(global_load(grad + i)));
      }
    });
    global_store(static_cast<double*>(a.data[1][t]) + (start / cuda::kChunkSize) * kNormLanes + threadIdx.x, sum);
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

LaunchStatus launch_adam_step(const OptimTensor* tensors, int64_t n, const AdamParams& params,
                              const float* grad_scale, const float* found_inf, const float* lr, cudaStream_t stream) {
  return launch_step(tensors, n, AdamChunkOp{AdamOp{params}, DeviceScalars{grad_scale, found_inf, lr}}, found_inf, stream);
}

LaunchStatus launch_sgd_step(const OptimTensor* tensors, int64_t n, const SgdParams& params, const float* grad_scale,
                             const float* found_inf, const float* lr, cudaStream_t stream) {
  return launch_step(tensors, n, SgdChunkOp{SgdOp{params}, DeviceScalars{grad_scale, found_inf, lr}}, found_inf, stream);
}

int64_t norm_chunks(int64_t numel) { return (numel + cuda::kChunkSize - 1) / cuda::kChunkSize; }

LaunchStatus launch_grad_norm(const TensorRef* grads, int64_t n, const float* grad_scale, float* out, double* lanes,
                              double* sums, cudaStream_t stream) {
  std::vector<TensorRef> rows(static_cast<size_t>(n));
  int64_t row = 0;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = {lanes + row * kNormLanes, grads[i].numel, DType::kFloat64};
    row += norm_chunks(grads[i].numel);
  }
  const TensorRef* lists[2] = {grads, rows.data()};
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
    finish.error = cuda::launch_kernel(grad_norm_finish_kernel, dim3(1), dim3(1), stream, sums, row, grad_scale, out);
    finish.launches = finish.ok() ? 1 : 0;
    then(finish);
  }
  return status;
}

LaunchStatus launch_lamb_step(const OptimTensor* tensors, int64_t n, const LambParams& params,
                              const float* grad_scale, const float* found_inf, const float* lr,
                              const float* grad_norm, double* lanes, double* sums, cudaStream_t stream) {
  const LambOp op{params};
  const DeviceScalars dev{grad_scale, found_inf, lr};
  // Stream 5 of each tensor: its first row of lane sums (moments pass), then of chunk sums (apply pass).
  std::vector<OptimTensor> with_rows(tensors, tensors + n);
  std::vector<OptimTensor> with_sums(tensors, tensors + n);
  int64_t row = 0;
  for (int64_t i = 0; i < n; ++i) {
    with_rows[i].max_exp_avg_sq = reinterpret_cast<float*>(lanes + row * 2 * kNormLanes);
    with_sums[i].max_exp_avg_sq = reinterpret_cast<float*>(sums + row * 2);
    row += norm_chunks(tensors[i].numel);
  }
  LaunchStatus status = launch_passes(with_rows.data(), n, LambMomentsChunkOp{op, dev, grad_norm}, stream);
  auto then = [&status](LaunchStatus next) {
    status.error = next.error;
    status.launches += next.launches;
  };
  if (status.ok() && op.trust_ratio()) {
    then(launch_lane_sums(lanes, sums, row * 2, found_inf, stream));
  }
  if (status.ok()) {
    then(launch_step(with_sums.data(), n, LambApplyChunkOp{op, dev}, found_inf, stream));
  }
  return status;
}

}  // namespace ampkit::kernels
