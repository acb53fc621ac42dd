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

// Calls body(w, g, m, v, vmax, tail) on every element of chunk [start, start + n) of tensor t.
template <typename T, typename Args, typename Body>
__device__ void for_each_element(const Args& a, int t, int64_t start, int64_t n, const GradIn& gin,
                                 const Body& body) {
  auto* param = static_cast<T*>(a.data[0][t]) + start;
  auto* grad = static_cast<T*>(a.data[1][t]) + start;
  // Index (in the chunk) of the first scalar-tail element.
  const int64_t tail_from = tail_start(a.numel[t], gin.tail_width) - start;
  auto grad_at = [&](int64_t i) {
    float g = to_float(global_load(grad + i));
    if (gin.unscale) {
      g = g / gin.scale;
      if (gin.write) {
        global_store(grad + i, from_float<T>(g));
      }
    }
    return g;
  };
  auto offset = [&](int s) { return a.data[s][t] ? static_cast<float*>(a.data[s][t]) + start : nullptr; };
  float* master = offset(2);
  float* m = offset(3);
  float* v = offset(4);
  float* vmax = offset(5);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (a.data[7][t] != nullptr) {
      // BF16 weight + int16 remainder: the exact FP32 master without a FP32 copy.
      auto* rem = static_cast<int16_t*>(a.data[7][t]) + start;
      auto* bits = reinterpret_cast<uint16_t*>(param);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float w = join_remainder(global_load(bits + i), global_load(rem + i));
        float mi = m ? global_load(m + i) : 0.f;
        float vi = v ? global_load(v + i) : 0.f;
        float vmi = vmax ? global_load(vmax + i) : 0.f;
        body(w, grad_at(i), m ? &mi : nullptr, v ? &vi : nullptr, vmax ? &vmi : nullptr, i >= tail_from);
        uint16_t wb;
        int16_t rb;
        split_remainder(w, &wb, &rb);
        store_moments(m, v, vmax, i, mi, vi, vmi);
        global_store(bits + i, wb);
        global_store(rem + i, rb);
      }
      return;
    }
  }
  // Four elements per thread and iteration with one access per stream (16 bytes for the FP32 streams, 8 for the
  // 16-bit ones) when every stream of the chunk is aligned for it; the scalar loop does the tail, or everything.
  constexpr int kVec = 4;
  auto aligned = [](const void* p, size_t bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  int64_t first_scalar = 0;
  if (aligned(param, sizeof(T) * kVec) && aligned(grad, sizeof(T) * kVec) && aligned(master, 16) &&
      aligned(m, 16) && aligned(v, 16) && aligned(vmax, 16)) {
    using PackT = Pack<T, kVec>;
    using PackF = Pack<float, kVec>;
    const int64_t n_vec = n / kVec;
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      // The param is read only when it is the weight (no master): a master-weight step only writes it.
      PackT p4{};
      if (!master) {
        p4 = global_load(reinterpret_cast<const PackT*>(param) + i);
      }
      PackT g4 = global_load(reinterpret_cast<const PackT*>(grad) + i);
      float gf[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        gf[j] = gin.unscale ? to_float(g4.v[j]) / gin.scale : to_float(g4.v[j]);
      }
      if (gin.unscale && gin.write) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          g4.v[j] = from_float<T>(gf[j]);
        }
        global_store(reinterpret_cast<PackT*>(grad) + i, g4);
      }
      PackF w4{};
      PackF m4{};
      PackF v4{};
      PackF vm4{};
      if (master) {
        w4 = global_load(reinterpret_cast<const PackF*>(master) + i);
      }
      if (m) {
        m4 = global_load(reinterpret_cast<const PackF*>(m) + i);
      }
      if (v) {
        v4 = global_load(reinterpret_cast<const PackF*>(v) + i);
      }
      if (vmax) {
        vm4 = global_load(reinterpret_cast<const PackF*>(vmax) + i);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        // Scalars, not array elements, go to the functor: their addresses stay in registers.
        float w = master ? w4.v[j] : to_float(p4.v[j]);
        float mj = m4.v[j];
        float vj = v4.v[j];
        float vmj = vm4.v[j];
        body(w, gf[j], m ? &mj : nullptr, v ? &vj : nullptr, vmax ? &vmj : nullptr, i * kVec + j >= tail_from);
        m4.v[j] = mj;
        v4.v[j] = vj;
        vm4.v[j] = vmj;
        w4.v[j] = w;
        p4.v[j] = from_float<T>(w);
      }
      global_store(reinterpret_cast<PackT*>(param) + i, p4);
      if (master) {
        global_store(reinterpret_cast<PackF*>(master) + i, w4);
      }
      if (m) {
        global_store(reinterpret_cast<PackF*>(m) + i, m4);
      }
      if (v) {
        global_store(reinterpret_cast<PackF*>(v) + i, v4);
      }
      if (vmax) {
        global_store(reinterpret_cast<PackF*>(vmax) + i, vm4);
      }
    }
    first_scalar = n_vec * kVec;
  }
  for (int64_t i = first_scalar + threadIdx.x; i < n; i += blockDim.x) {
    float w = master ? global_load(master + i) : to_float(global_load(param + i));
    float mi = m ? global_load(m + i) : 0.f;
    float vi = v ? global_load(v + i) : 0.f;
    float vmi = vmax ? global_load(vmax + i) : 0.f;
    body(w, grad_at(i), m ? &mi : nullptr, v ? &vi : nullptr, vmax ? &vmi : nullptr, i >= tail_from);
    store_moments(m, v, vmax, i, mi, vi, vmi);
    if (master) {
      global_store(master + i, w);
    }
    global_store(param + i, from_float<T>(w));
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

template <typename ChunkOp>
LaunchStatus launch_step(const OptimTensor* tensors, int64_t n, const ChunkOp& op, const float* found_inf,
                         cudaStream_t stream) {
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
  LaunchStatus status = cuda::multi_tensor_apply<kStreams>(heads, n, op, stream);
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

}  // namespace

LaunchStatus launch_adam_step(const OptimTensor* tensors, int64_t n, const AdamParams& params,
                              const float* grad_scale, const float* found_inf, const float* lr, cudaStream_t stream) {
  return launch_step(tensors, n, AdamChunkOp{AdamOp{params}, DeviceScalars{grad_scale, found_inf, lr}}, found_inf, stream);
}

LaunchStatus launch_sgd_step(const OptimTensor* tensors, int64_t n, const SgdParams& params, const float* grad_scale,
                             const float* found_inf, const float* lr, cudaStream_t stream) {
  return launch_step(tensors, n, SgdChunkOp{SgdOp{params}, DeviceScalars{grad_scale, found_inf, lr}}, found_inf, stream);
}

}  // namespace ampkit::kernels
