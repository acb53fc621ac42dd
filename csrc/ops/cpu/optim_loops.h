// CPU loops of the fused optimizer steps: one at::parallel_for over every (tensor, chunk) work item; each item runs
// the optim_functors.h functors on at::vec::Vectorized<float> (two vectors per iteration, so that a vector of
// FP16/BF16 converts to exactly two of FP32), then the scalar functor on the tail. Compiled once per instruction
// set by loops_<isa>.cpp, in the namespace AMPKIT_CPU_NS.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <vector>

#include "../../../kernels/optim_functors.h"
#include "cpu_loops.h"
#include "work_items.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

using kernels::DType;
using kernels::OptimTensor;
using VecF = at::vec::Vectorized<float>;

struct VecMath {
  static VecF sqrt(const VecF& x) { return x.sqrt(); }
  static VecF max(const VecF& a, const VecF& b) { return at::vec::maximum(a, b); }
  static VecF neg(const VecF& x) { return x.neg(); }
};

// Two float vectors from 2 * VecF::size() elements of T, and back (rounding once to nearest-even).
template <typename T>
void load2(const T* p, VecF& lo, VecF& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = VecF::loadu(p);
    hi = VecF::loadu(p + VecF::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

template <typename T>
void store2(T* p, const VecF& lo, const VecF& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p);
    hi.store(p + VecF::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p);
  }
}

// Runs `vec_body(w, g, m, v, vmax)` on pairs of float vectors over elements [begin, end) of t, then
// `scalar_body` on the tail, and stores the weight (and the master) back.
template <typename T, typename VecBody, typename ScalarBody>
void optim_span(const OptimTensor& t, int64_t begin, int64_t end, float grad_scale, const VecBody& vec_body,
                const ScalarBody& scalar_body) {
  static_assert(at::vec::Vectorized<T>::size() == 2 * VecF::size() || std::is_same_v<T, float>);
  constexpr int64_t kStep = 2 * VecF::size();
  T* param = static_cast<T*>(t.param);
  const T* grad = static_cast<const T*>(t.grad);
  float* master = t.master;
  float* m = t.exp_avg;
  float* v = t.exp_avg_sq;
  float* vmax = t.max_exp_avg_sq;
  const VecF scale(grad_scale);
  const bool unscale = grad_scale != 1.f;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (t.remainder != nullptr) {
      // BF16 weight + int16 remainder (NOTE [BF16 weight + 16-bit remainder]): scalar, bit-level.
      auto* bits = reinterpret_cast<uint16_t*>(param);
      for (int64_t i = begin; i < end; ++i) {
        float w1 = kernels::join_remainder(bits[i], t.remainder[i]);
        const float g1 = static_cast<float>(grad[i]);
        scalar_body(w1, unscale ? g1 / grad_scale : g1, m != nullptr ? m + i : nullptr,
                    v != nullptr ? v + i : nullptr, vmax != nullptr ? vmax + i : nullptr);
        kernels::split_remainder(w1, &bits[i], &t.remainder[i]);
      }
      return;
    }
  }
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    VecF w[2], g[2], mv[2], vv[2], vm[2];
    if (master != nullptr) {
      load2(master + i, w[0], w[1]);
    } else {
      load2(param + i, w[0], w[1]);
    }
    load2(grad + i, g[0], g[1]);
    if (m != nullptr) {
      load2(m + i, mv[0], mv[1]);
    }
    if (v != nullptr) {
      load2(v + i, vv[0], vv[1]);
    }
    if (vmax != nullptr) {
      load2(vmax + i, vm[0], vm[1]);
    }
    for (int h = 0; h < 2; ++h) {
      vec_body(w[h], unscale ? g[h] / scale : g[h], mv[h], vv[h], vmax != nullptr ? &vm[h] : nullptr);
    }
    if (m != nullptr) {
      store2(m + i, mv[0], mv[1]);
    }
    if (v != nullptr) {
      store2(v + i, vv[0], vv[1]);
    }
    if (vmax != nullptr) {
      store2(vmax + i, vm[0], vm[1]);
    }
    if (master != nullptr) {
      store2(master + i, w[0], w[1]);
    }
    store2(param + i, w[0], w[1]);
  }
  for (; i < end; ++i) {
    float w1 = master != nullptr ? master[i] : static_cast<float>(param[i]);
    const float g1 = static_cast<float>(grad[i]);
    scalar_body(w1, unscale ? g1 / grad_scale : g1, m != nullptr ? m + i : nullptr, v != nullptr ? v + i : nullptr,
                vmax != nullptr ? vmax + i : nullptr);
    if (master != nullptr) {
      master[i] = w1;
    }
    param[i] = static_cast<T>(w1);
  }
}

template <typename VecBody, typename ScalarBody>
void dispatch_span(const OptimTensor& t, int64_t begin, int64_t end, float grad_scale, const VecBody& vec_body,
                   const ScalarBody& scalar_body) {
  switch (t.dtype) {
    case DType::kFloat16:
      optim_span<c10::Half>(t, begin, end, grad_scale, vec_body, scalar_body);
      break;
    case DType::kBFloat16:
      optim_span<c10::BFloat16>(t, begin, end, grad_scale, vec_body, scalar_body);
      break;
    default:
      optim_span<float>(t, begin, end, grad_scale, vec_body, scalar_body);
      break;
  }
}

}  // namespace

void adam_step(const OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale) {
  const kernels::AdamOp op{params};
  std::vector<kernels::AdamStepFactors> factors(n);
  for (int64_t t = 0; t < n; ++t) {
    factors[t] = kernels::AdamStepFactors::at_step(params, *tensors[t].step + 1.f);
  }
  // Grads are divided by the scale, as torch's fused kernels do.
  // Optimizer steps do ~20 flops per element: worth threads from a quarter of the unscale's threshold.
  for_all_chunks(n, [&](int64_t t) { return tensors[t].numel; }, kCpuParallelThreshold / 4,
                 [&](size_t, const WorkItem& w) {
    const kernels::AdamStepFactors& f = factors[w.tensor];
    dispatch_span(
        tensors[w.tensor], w.begin, w.end, grad_scale,
        [&](VecF& w, VecF g, VecF& m, VecF& v, VecF* vmax) { op.apply<VecF, VecMath>(w, g, m, v, vmax, f); },
        [&](float& w, float g, float* m, float* v, float* vmax) { op(w, g, *m, *v, vmax, f); });
  });
  for (int64_t t = 0; t < n; ++t) {
    *tensors[t].step += 1.f;
  }
}

void sgd_step(const OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale) {
  const kernels::SgdOp op{params};
  for_all_chunks(n, [&](int64_t t) { return tensors[t].numel; }, kCpuParallelThreshold / 4,
                 [&](size_t, const WorkItem& w) {
    const bool first = tensors[w.tensor].step == nullptr || *tensors[w.tensor].step == 0.f;
    dispatch_span(
        tensors[w.tensor], w.begin, w.end, grad_scale,
        [&](VecF& w, VecF g, VecF& buf, VecF&, VecF*) { op.apply<VecF, VecMath>(w, g, &buf, first); },
        [&](float& w, float g, float* buf, float*, float*) { op(w, g, buf, first); });
  });
  for (int64_t t = 0; t < n; ++t) {
    if (tensors[t].step != nullptr) {
      *tensors[t].step += 1.f;
    }
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
