// CPU loops of lamb_step_ and grad_norm (NOTE [LAMB passes] in kernels/optim_functors.h): work items of one
// kNormChunk chunk each, run by at::parallel_for; every sum of squares follows NOTE [Deterministic norm] (chunk
// lanes, lane sums in lane order, chunk sums in chunk order), so the results are those of the CUDA kernels bit for
// bit. Compiled once per instruction set like optim_loops.h.
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
#include "cpu_loops.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

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

template <typename Items, typename Fn>
void for_items(Items& items, const Fn& fn) {
  int64_t elements = 0;
  for (const auto& item : items) {
    elements += item.end - item.begin;
  }
  const int64_t grain = elements < kCpuParallelThreshold / 4 ? static_cast<int64_t>(items.size()) + 1 : 1;
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      fn(items[k]);
    }
  });
}

// Lane sums of one chunk in the CUDA kernel's order: element i of the chunk belongs to lane (i / 8) % 512.
template <int K>
struct Lanes {
  std::array<std::array<double, kernels::kNormLanes>, K> lane{};

  void add(int k, int64_t i, float x) {
    const double d = static_cast<double>(x);
    double& l = lane[k][(i / kernels::kNormPack) % kernels::kNormLanes];
    l = l + d * d;
  }
  double sum(int k) const {
    double s = 0.0;
    for (const double l : lane[k]) {
      s = s + l;
    }
    return s;
  }
};

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

template <typename T>
void store_weight(const kernels::OptimTensor& t, int64_t i, float w) {
  if (t.master != nullptr) {
    t.master[i] = w;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (t.remainder != nullptr) {
      kernels::split_remainder(w, &reinterpret_cast<uint16_t*>(t.param)[i], &t.remainder[i]);
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
  for_items(items, [&](NormItem<1>& item) {
    Lanes<1> lanes;
    lamb_dispatch_dtype(grads[item.tensor].dtype, [&](auto zero) {
      using T = decltype(zero);
      const T* g = static_cast<const T*>(grads[item.tensor].data) + item.begin;
      for (int64_t i = 0; i < item.end - item.begin; ++i) {
        lanes.add(0, i, static_cast<float>(g[i]));
      }
    });
    item.sum[0] = lanes.sum(0);
  });
  // Chunk sums in list order (NOTE [LAMB passes]).
  double total = 0.0;
  for (const auto& item : items) {
    total = total + item.sum[0];
  }
  return static_cast<float>(std::sqrt(total) / static_cast<double>(grad_scale));
}

void lamb_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::LambParams& params, float grad_scale,
               const float* norm) {
  const kernels::LambOp op{params};
  const bool trust = op.trust_ratio();
  const float divisor = kernels::lamb_grad_divisor(grad_scale, norm, params.max_grad_norm);
  std::vector<int64_t> numel(static_cast<size_t>(n));
  std::vector<kernels::LambStepFactors> factors(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    numel[t] = tensors[t].numel;
    factors[t] = kernels::LambStepFactors::at_step(params, *tensors[t].step + 1.f);
  }
  auto items = norm_items<2>(n, numel.data());
  // Pass 2: moments, and the lane sums of ||w||^2 and ||u||^2.
  for_items(items, [&](NormItem<2>& item) {
    const kernels::OptimTensor& t = tensors[item.tensor];
    const kernels::LambStepFactors& f = factors[item.tensor];
    Lanes<2> lanes;
    lamb_dispatch_dtype(t.dtype, [&](auto zero) {
      using T = decltype(zero);
      const T* grad = static_cast<const T*>(t.grad);
      for (int64_t i = item.begin; i < item.end; ++i) {
        const float w = load_weight<T>(t, i);
        float g = static_cast<float>(grad[i]);
        if (divisor != 1.f) {
          g = g / divisor;
        }
        const float u = op.moments(w, g, t.exp_avg[i], t.exp_avg_sq[i], f);
        if (trust) {
          lanes.add(0, i - item.begin, w);
          lanes.add(1, i - item.begin, u);
        }
      }
    });
    if (trust) {
      item.sum = {lanes.sum(0), lanes.sum(1)};
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
      for (int64_t i = item.begin; i < item.end; ++i) {
        const float w = load_weight<T>(t, i);
        const float u = op.direction(w, t.exp_avg[i], t.exp_avg_sq[i], f);
        store_weight<T>(t, i, kernels::ScalarMath::fma(factor, u, w));
      }
    });
  });
  for (int64_t t = 0; t < n; ++t) {
    *tensors[t].step += 1.f;
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
