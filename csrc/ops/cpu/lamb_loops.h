// CPU loops of lamb_step_ and grad_norm (NOTE [LAMB passes] in kernels/optim_functors.h): work items of one
// kNormChunk chunk each, run by at::parallel_for; the formulas run on at::vec::Vectorized<float> (VecMath: the
// same roundings as the scalar functors), and every sum of squares follows NOTE [Deterministic norm] (chunk lanes,
// lane sums in lane order, a tensor's chunk sums in chunk order, the global norm's in finish lanes), so the results
// are those of the CUDA kernels bit for bit.
// Compiled once per instruction set like optim_loops.h (which it includes for VecMath).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "../../../kernels/amp_functors.h"
#include "../../../kernels/optim_functors.h"
#include "../../../kernels/stochastic_rounding.h"
#include "cpu_loops.h"
#include "optim_loops.h"
#include "vec_io.h"
#include "work_items.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

constexpr int64_t kStep = 2 * VecF::size();  // one load2 / store2

// One chunk of kNormChunk elements of one tensor, and its sums of squares (K of them).
template <int K>
struct NormItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
  std::array<double, K> sum{};
};

template <int K>
std::vector<NormItem<K>> norm_items(int64_t n, const int64_t* numel) {
  std::vector<NormItem<K>> items;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < numel[t]; b += kernels::kNormChunk) {
      items.push_back({t, b, std::min(numel[t], b + kernels::kNormChunk), {}});
    }
  }
  return items;
}

// Lists under a quarter of kCpuParallelThreshold elements run on the calling thread.
constexpr int64_t kNormSerialBelow = kCpuParallelThreshold / 4;

template <typename Items, typename Fn>
void for_items(Items& items, const Fn& fn) {
  for_item_ranges(items, kNormSerialBelow, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      fn(items[k]);
    }
  });
}

// NOTE [Lane sums side by side]
// A chunk's sum adds its kNormLanes lane sums in lane order (NOTE [Deterministic norm]): 512 dependent FP64 adds,
// about 2,000 cycles whatever the chunk's size, which for a tensor of a thousand elements cost more than its
// squares. The order within one sum is fixed, but sums are independent of each other: lane_sums runs up to
// kMaxChains of them in one loop, each still in lane order, so that their adds overlap (LAMB's two norms of an item;
// grad_norm's chunks kMaxChains at a time). Lanes no element reached hold +0.0 and are left out: a sum of squares is
// +0.0 or more (or NaN), and s + 0.0 == s for every such s.
constexpr int kMaxChains = 8;
alignas(64) constexpr double kZeroLanes[kernels::kNormLanes] = {};

// out[c] = lanes[c][0] + ... + lanes[c][used - 1], added in that order from 0.0, for c < count (count <=
// kMaxChains; every lane from `used` on is 0.0).
inline void lane_sums(const double* const* lanes, int count, int64_t used, double* out) {
  const double* p[kMaxChains];
  for (int c = 0; c < kMaxChains; ++c) {
    p[c] = c < count ? lanes[c] : kZeroLanes;
  }
  double s[kMaxChains] = {};
  for (int64_t l = 0; l < used; ++l) {
    for (int c = 0; c < kMaxChains; ++c) {
      s[c] = s[c] + p[c][l];
    }
  }
  for (int c = 0; c < count; ++c) {
    out[c] = s[c];
  }
}

// Lane sums of one chunk (NOTE [Deterministic norm]): element i of the chunk adds its square to lane i % 512. The
// chunk is walked in rows of kNormLanes elements; a row adds one square to each lane, lane by lane independent,
// so the adds vectorize without changing any sum's order.
template <int K>
struct Lanes {
  alignas(64) double lane[K][kernels::kNormLanes] = {};

  int64_t used = 0;  // lanes [used, kNormLanes) are still 0.0

  // Adds x[l]^2 to lane l for l < m (x: one row of the chunk, from a multiple of kNormLanes).
  void add_row(int k, const float* x, int64_t m) {
    used = std::max(used, m);
    double* lk = lane[k];
#pragma omp simd
    for (int64_t l = 0; l < m; ++l) {
      const double d = static_cast<double>(x[l]);
      lk[l] = lk[l] + d * d;
    }
  }
  // The K sums side by side (NOTE [Lane sums side by side]).
  std::array<double, K> sums() const {
    static_assert(K <= kMaxChains);
    const double* lanes[K];
    for (int k = 0; k < K; ++k) {
      lanes[k] = lane[k];
    }
    std::array<double, K> out{};
    lane_sums(lanes, K, used, out.data());
    return out;
  }
};

static_assert(kernels::kNormLanes % 64 == 0, "a row holds whole vector steps of every instruction set");

template <typename T>
float load_weight(const kernels::OptimTensor& t, int64_t i) {
  if (t.master != nullptr) {
    return t.master[i];
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (t.remainder != nullptr) {
      return kernels::join_remainder(reinterpret_cast<const uint16_t*>(t.param)[i], t.remainder[i]);
    }
  }
  return static_cast<float>(static_cast<const T*>(t.param)[i]);
}

// Stores the updated weight w of element i (w0: the weight load_weight read) as the tensor keeps it: the master
// and the rounded weight, the BF16 weight and its remainder or Kahan compensation, or the weight rounded
// stochastically with the words of step `step` (NOTE [Counter-based stochastic rounding]).
template <typename T>
void store_weight(const kernels::OptimTensor& t, int64_t i, float w0, float w, uint32_t step) {
  if (t.master != nullptr) {
    t.master[i] = w;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    auto* bits = &reinterpret_cast<uint16_t*>(t.param)[i];
    if (t.remainder != nullptr) {
      kernels::split_remainder(w, bits, &t.remainder[i]);
      return;
    }
    if (t.kahan_comp != nullptr) {
      kernels::kahan_store(w0, w, bits, &t.kahan_comp[i]);
      return;
    }
    if (t.sr_seed != nullptr) {
      *bits = kernels::bf16_bits_stochastic(w, kernels::rounding_bits(static_cast<uint64_t>(*t.sr_seed), step, i));
      return;
    }
  }
  static_cast<T*>(t.param)[i] = static_cast<T>(w);  // with a master too: the rounded weight
}

template <typename Fn>
void lamb_dispatch_dtype(kernels::DType dtype, const Fn& fn) {
  switch (dtype) {
    case kernels::DType::kFloat16:
      fn(c10::Half{});
      break;
    case kernels::DType::kBFloat16:
      fn(c10::BFloat16{});
      break;
    default:
      fn(float{});
      break;
  }
}

}  // namespace

float grad_norm(const kernels::TensorRef* grads, int64_t n, float grad_scale) {
  std::vector<int64_t> numel(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    numel[t] = grads[t].numel;
  }
  auto items = norm_items<1>(n, numel.data());
  // Chunks kMaxChains at a time: their lanes first, then their sums side by side (NOTE [Lane sums side by side]).
  for_item_ranges(items, kNormSerialBelow, [&](int64_t b, int64_t e) {
    std::vector<Lanes<1>> group(static_cast<size_t>(std::min<int64_t>(kMaxChains, e - b)));
    alignas(64) float row[kernels::kNormLanes];
    for (int64_t k0 = b; k0 < e; k0 += kMaxChains) {
      const int count = static_cast<int>(std::min<int64_t>(kMaxChains, e - k0));
      const double* lanes[kMaxChains];
      int64_t used = 0;
      for (int c = 0; c < count; ++c) {
        const NormItem<1>& item = items[k0 + c];
        Lanes<1>& chunk = group[c];
        std::fill(chunk.lane[0], chunk.lane[0] + kernels::kNormLanes, 0.0);
        chunk.used = 0;
        lamb_dispatch_dtype(grads[item.tensor].dtype, [&](auto zero) {
          using T = decltype(zero);
          const T* g = static_cast<const T*>(grads[item.tensor].data) + item.begin;
          const int64_t n = item.end - item.begin;
          for (int64_t r = 0; r < n; r += kernels::kNormLanes) {
            const int64_t m = std::min<int64_t>(kernels::kNormLanes, n - r);
            row_as_float(g + r, m, row);
            chunk.add_row(0, row, m);
          }
        });
        lanes[c] = chunk.lane[0];
        used = std::max(used, chunk.used);
      }
      double sums[kMaxChains];
      lane_sums(lanes, count, used, sums);
      for (int c = 0; c < count; ++c) {
        items[k0 + c].sum[0] = sums[c];
      }
    }
  });
  // Chunk sums in the finish-lane order of NOTE [Deterministic norm].
  std::array<double, kernels::kNormFinishLanes> finish{};
  for (size_t r = 0; r < items.size(); ++r) {
    finish[r % kernels::kNormFinishLanes] = finish[r % kernels::kNormFinishLanes] + items[r].sum[0];
  }
  double total = 0.0;
  for (const double s : finish) {
    total = total + s;
  }
  return static_cast<float>(std::sqrt(total) / static_cast<double>(grad_scale));
}

void lamb_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::LambParams& params, float grad_scale,
               const float* norm) {
  const kernels::LambOp op{params};
  const bool trust = op.trust_ratio();
  const float divisor = kernels::lamb_grad_divisor(grad_scale, norm, params.max_grad_norm);
  std::vector<int64_t> numel(static_cast<size_t>(n));
  const auto factors = step_factors<kernels::LambStepFactors>(
      tensors, n, [&](float step) { return kernels::LambStepFactors::at_step(params, step); });
  for (int64_t t = 0; t < n; ++t) {
    numel[t] = tensors[t].numel;
  }
  auto items = norm_items<2>(n, numel.data());
  // Pass 2: moments, and the lane sums of ||w||^2 and ||u||^2, row by row.
  for_items(items, [&](NormItem<2>& item) {
    const kernels::OptimTensor& t = tensors[item.tensor];
    const kernels::LambStepFactors& f = factors[item.tensor];
    Lanes<2> lanes;
    alignas(64) float w_row[kernels::kNormLanes];
    alignas(64) float u_row[kernels::kNormLanes];
    with_param_and_grad_types(t, [&](auto param_zero, auto grad_zero) {
      using T = decltype(param_zero);
      const auto* grad = static_cast<const decltype(grad_zero)*>(t.grad);  // NOTE [FP32 grads of low-precision params]
      const bool vector = t.remainder == nullptr;
      const VecF div(divisor);
      for (int64_t r = item.begin; r < item.end; r += kernels::kNormLanes) {
        const int64_t m = std::min<int64_t>(kernels::kNormLanes, item.end - r);
        int64_t l = 0;
        for (; vector && l + kStep <= m; l += kStep) {
          const int64_t i = r + l;
          VecF w[2], g[2], mv[2], vv[2];
          if (t.master != nullptr) {
            load2(t.master + i, w[0], w[1]);
          } else {
            load2(static_cast<const T*>(t.param) + i, w[0], w[1]);
          }
          load2(grad + i, g[0], g[1]);
          load2(t.exp_avg + i, mv[0], mv[1]);
          load2(t.exp_avg_sq + i, vv[0], vv[1]);
          for (int h = 0; h < 2; ++h) {
            if (divisor != 1.f) {
              g[h] = g[h] / div;
            }
            const VecF u = op.moments<VecF, VecMath>(w[h], g[h], mv[h], vv[h], f);
            w[h].store(w_row + l + h * VecF::size());
            u.store(u_row + l + h * VecF::size());
          }
          store2(t.exp_avg + i, mv[0], mv[1]);
          store2(t.exp_avg_sq + i, vv[0], vv[1]);
        }
        for (; l < m; ++l) {
          const int64_t i = r + l;
          const float w = load_weight<T>(t, i);
          float g = static_cast<float>(grad[i]);
          if (divisor != 1.f) {
            g = g / divisor;
          }
          w_row[l] = w;
          u_row[l] = op.moments(w, g, t.exp_avg[i], t.exp_avg_sq[i], f);
        }
        if (trust) {
          lanes.add_row(0, w_row, m);
          lanes.add_row(1, u_row, m);
        }
      }
    });
    if (trust) {
      item.sum = lanes.sums();
    }
  });
  // Per tensor: sums in chunk order, the update factor.
  std::vector<double> w_sq(static_cast<size_t>(n), 0.0);
  std::vector<double> u_sq(static_cast<size_t>(n), 0.0);
  for (const auto& item : items) {
    w_sq[item.tensor] = w_sq[item.tensor] + item.sum[0];
    u_sq[item.tensor] = u_sq[item.tensor] + item.sum[1];
  }
  std::vector<float> update(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    update[t] = kernels::lamb_update_factor(params.lr, w_sq[t], u_sq[t], trust);
  }
  // Pass 3: the update from the stored moments.
  for_items(items, [&](NormItem<2>& item) {
    const kernels::OptimTensor& t = tensors[item.tensor];
    const kernels::LambStepFactors& f = factors[item.tensor];
    const float factor = update[item.tensor];
    lamb_dispatch_dtype(t.dtype, [&](auto zero) {
      using T = decltype(zero);
      T* param = static_cast<T*>(t.param);
      int64_t i = item.begin;
      const bool vector = t.remainder == nullptr && t.kahan_comp == nullptr && t.sr_seed == nullptr;
      for (; vector && i + kStep <= item.end; i += kStep) {
        VecF w[2], mv[2], vv[2];
        if (t.master != nullptr) {
          load2(t.master + i, w[0], w[1]);
        } else {
          load2(param + i, w[0], w[1]);
        }
        load2(t.exp_avg + i, mv[0], mv[1]);
        load2(t.exp_avg_sq + i, vv[0], vv[1]);
        for (int h = 0; h < 2; ++h) {
          w[h] = VecMath::fma(VecF(factor), op.direction<VecF, VecMath>(w[h], mv[h], vv[h], f), w[h]);
        }
        if (t.master != nullptr) {
          store2(t.master + i, w[0], w[1]);
        }
        store2(param + i, w[0], w[1]);
      }
      const auto step = static_cast<uint32_t>(*t.step + 1.f);
      for (; i < item.end; ++i) {
        const float w = load_weight<T>(t, i);
        const float u = op.direction(w, t.exp_avg[i], t.exp_avg_sq[i], f);
        store_weight<T>(t, i, w, kernels::ScalarMath::fma(factor, u, w), step);
      }
    });
  });
  for (int64_t t = 0; t < n; ++t) {
    *tensors[t].step += 1.f;
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
