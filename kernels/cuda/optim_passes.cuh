// The pieces the fused optimizer kernels share (optim_kernels.cu: Adam and SGD; lamb_kernels.cu: LAMB and the
// grad norm): the names of the optimizer streams, the device scalars every step reads, the chunk table of those
// streams and the kernel that bumps the step counts. Included by those two files only (file-local definitions).
#pragma once

#include <type_traits>
#include <vector>

#include "convert.cuh"
#include "launch.cuh"
#include "multi_tensor_apply.cuh"
#include "optim_launch.h"
#include "../blockwise8.h"
#include "../stochastic_rounding.h"

namespace ampkit::kernels {
namespace {

// The streams of the chunk table, one per field of OptimTensor (named as ATen's fused_adam_utils.cuh names its
// tensor lists).
constexpr int kParamIdx = 0;
constexpr int kGradIdx = 1;
constexpr int kMasterIdx = 2;
constexpr int kExpAvgIdx = 3;
constexpr int kExpAvgSqIdx = 4;
constexpr int kMaxExpAvgSqIdx = 5;
constexpr int kStepIdx = 6;
// The BF16 weight's companion (NOTE [Weight companions] in csrc/ops/checks.cpp): the int16 remainder, the BF16
// Kahan compensation or a pointer to the stochastic rounding seed, one kind per launch (WeightStore). One stream
// for the three keeps the chunk table at 8 streams (NOTE [Kernel parameter budget]).
constexpr int kRemainderIdx = 7;
constexpr int kStreams = 8;

// How the weights of one launch are kept when they are not the FP32 master or the parameter itself.
enum class WeightStore : uint8_t { kDirect, kRemainder, kKahan, kStochastic };

// The store of a launch's tensors (every tensor of an op call keeps its weight the same way).
inline WeightStore weight_store(const OptimTensor* tensors, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (tensors[i].remainder != nullptr) {
      return WeightStore::kRemainder;
    }
    if (tensors[i].kahan_comp != nullptr) {
      return WeightStore::kKahan;
    }
    if (tensors[i].sr_seed != nullptr) {
      return WeightStore::kStochastic;
    }
  }
  return WeightStore::kDirect;
}

// A moment stream's dtype code in the chunk table: kFloat32, kBFloat16, or kUInt8 for a packed 8-bit state.
inline DType state_dtype_code(StateType type) {
  return type == StateType::kBFloat16     ? DType::kBFloat16
         : type == StateType::kBlockwise8 ? DType::kUInt8
                                          : DType::kFloat32;
}

using cuda::from_opmath;
using cuda::global_load;
using cuda::global_store;
using cuda::to_opmath;

// How the elements of one chunk read their grads: divided by the scale (when `unscale`), stored back unscaled
// (when `write`); elements from index `tail_from` of the tensor on take the scalar-tail formulas (NOTE [torch's
// scalar tail]).
struct GradIn {
  float scale;
  bool unscale;
  bool write;
  int tail_width;
};

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

// NOTE [Step factors once per block]
// A tensor's per-step factors (the bias-correction powers of NOTE [Bias-correction powers]: tens of double-double
// products) are the same for every thread of a block, whose chunk belongs to one tensor: thread 0 computes them
// and hands them to the others through shared memory, instead of all 512 threads computing them. A chunk functor
// calls this once, before any of its threads may return.
template <typename Factors, typename Compute>
__device__ AMPKIT_INLINE Factors block_factors(const Compute& compute) {
  AMPKIT_SHARED(Factors, shared_factors, 1);
  if (threadIdx.x == 0) {
    shared_factors[0] = compute();
  }
  __syncthreads();
  return shared_factors[0];
}

// Calls f(T{}, G{}) with T the parameter's element type and G the grad's (a FP16/BF16 parameter's grad in its
// dtype or in FP32: NOTE [FP32 grads of low-precision params]).
template <typename Args, typename F>
__device__ AMPKIT_INLINE void with_param_and_grad_types(const Args& a, int t, const F& f) {
  const bool fp32_grad = a.dtype[kGradIdx][t] == DType::kFloat32;
  auto low_precision = [&](auto param_zero) {  // a 2-byte parameter: its grad in its type or in FP32
    using T = decltype(param_zero);
    if (fp32_grad) {
      f(T{}, float{});
    } else {
      f(T{}, T{});
    }
  };
  switch (a.dtype[kParamIdx][t]) {
    case DType::kFloat16:
      low_precision(__half{});
      break;
    case DType::kBFloat16:
      low_precision(__nv_bfloat16{});
      break;
    default:
      f(float{}, float{});
      break;
  }
}

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
    void* streams[kStreams];
    streams[kParamIdx] = t.param;
    streams[kGradIdx] = t.grad;
    streams[kMasterIdx] = t.master;
    streams[kExpAvgIdx] = t.exp_avg;
    streams[kExpAvgSqIdx] = t.exp_avg_sq;
    streams[kMaxExpAvgSqIdx] = t.max_exp_avg_sq;
    streams[kStepIdx] = t.step;
    streams[kRemainderIdx] = t.remainder != nullptr    ? static_cast<void*>(t.remainder)
                             : t.kahan_comp != nullptr ? static_cast<void*>(t.kahan_comp)
                                                       : const_cast<int64_t*>(t.sr_seed);
    for (int s = 0; s < kStreams; ++s) {
      const bool weight_typed = s == kParamIdx || (s == kGradIdx && !t.grad_fp32);
      lists[s * n + i] = TensorRef{streams[s], t.numel, weight_typed ? t.dtype : DType::kFloat32};
    }
    // The moments' storage (StateType) as their streams' dtype codes.
    lists[kExpAvgIdx * n + i].dtype = state_dtype_code(t.exp_avg_type);
    lists[kExpAvgSqIdx * n + i].dtype = state_dtype_code(t.exp_avg_sq_type);
  }
  const TensorRef* heads[kStreams];
  for (int s = 0; s < kStreams; ++s) {
    heads[s] = lists.data() + s * n;
  }
  return cuda::multi_tensor_apply<kStreams>(heads, n, op, stream);
}

// Every step count += 1 (unless *found_inf != 0), after the passes that read them; adds to `status`.
inline void launch_increment_steps(const OptimTensor* tensors, int64_t n, const float* found_inf, cudaStream_t stream,
                                   LaunchStatus& status) {
  StepList steps;
  steps.n = 0;
  auto flush = [&]() {
    status.error =
        cuda::launch_kernel(increment_steps_kernel, dim3((steps.n + 255) / 256), dim3(256), stream, steps, found_inf);
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
}

// The pass of `op`, then every step count += 1 (unless *found_inf != 0).
template <typename ChunkOp>
LaunchStatus launch_step(const OptimTensor* tensors, int64_t n, const ChunkOp& op, const float* found_inf,
                         cudaStream_t stream) {
  LaunchStatus status = launch_passes(tensors, n, op, stream);
  launch_increment_steps(tensors, n, found_inf, stream, status);
  return status;
}

// NOTE [Moment storage kernels]
// A tensor whose moments are not both FP32 (BF16 or 8-bit: NOTE [State-block chunk loop]) and one whose moments are
// FP32 run different loops; in one kernel, the state-block loop's registers (a lane's 8 moments of each kind in
// flight) would set the register allocation of the whole kernel, and ptxas spilled the Adam kernel for every
// tensor. So each step is two kernels, one per kind of moment storage (`Op<false>`: FP32 moments, `Op<true>`: the
// state-block loop), each launched over the tensors of its kind (in list order), then the step counts.
template <template <bool> class ChunkOp, typename... Members>
LaunchStatus launch_step_by_storage(const OptimTensor* tensors, int64_t n, const float* found_inf, cudaStream_t stream,
                                    const Members&... members) {
  std::vector<OptimTensor> fp32_moments;
  std::vector<OptimTensor> state_blocks;
  for (int64_t i = 0; i < n; ++i) {
    const bool blocks =
        tensors[i].exp_avg_type != StateType::kFloat32 || tensors[i].exp_avg_sq_type != StateType::kFloat32;
    (blocks ? state_blocks : fp32_moments).push_back(tensors[i]);
  }
  LaunchStatus status;
  if (!fp32_moments.empty()) {
    status = launch_passes(fp32_moments.data(), static_cast<int64_t>(fp32_moments.size()), ChunkOp<false>{members...},
                           stream);
  }
  if (status.ok() && !state_blocks.empty()) {
    const LaunchStatus more = launch_passes(state_blocks.data(), static_cast<int64_t>(state_blocks.size()),
                                            ChunkOp<true>{members...}, stream);
    status.error = more.error;
    status.launches += more.launches;
  }
  if (status.ok()) {
    launch_increment_steps(tensors, n, found_inf, stream, status);
  }
  return status;
}

}  // namespace
}  // namespace ampkit::kernels
