// CPU loops of the fused optimizer steps: one at::parallel_for over every (tensor, chunk) work item, each a plain
// loop over the optim_functors.h functors that the compiler vectorises for the instruction set of the including
// file (amp_cpu_loops_*.cpp compiles this once per ISA, in the namespace AMPKIT_CPU_NS).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <vector>

#include "../../../kernels/optim_launch.h"
#include "amp_cpu_loops.hpp"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

using kernels::DType;
using kernels::OptimTensor;

// Runs `body(w, g, m, v, vmax)` on elements [begin, end) of t, in FP32, and stores the weight back.
template <typename T, typename Body>
void optim_span(const OptimTensor& t, int64_t begin, int64_t end, const Body& body) {
  T* param = static_cast<T*>(t.param);
  const T* grad = static_cast<const T*>(t.grad);
  float* master = t.master;
  float* m = t.exp_avg;
  float* v = t.exp_avg_sq;
  float* vmax = t.max_exp_avg_sq;
  for (int64_t i = begin; i < end; ++i) {
    float w = master != nullptr ? master[i] : static_cast<float>(param[i]);
    body(w, static_cast<float>(grad[i]), m != nullptr ? m + i : nullptr,
         v != nullptr ? v + i : nullptr, vmax != nullptr ? vmax + i : nullptr);
    if (master != nullptr) {
      master[i] = w;
    }
    param[i] = static_cast<T>(w);
  }
}

template <typename PerTensor>
void for_all_chunks(const OptimTensor* tensors, int64_t n, const PerTensor& per_tensor) {
  struct WorkItem {
    int64_t tensor;
    int64_t begin;
    int64_t end;
  };
  std::vector<WorkItem> items;
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < tensors[t].numel; b += kCpuChunk) {
      items.push_back({t, b, std::min(tensors[t].numel, b + kCpuChunk)});
    }
    total += tensors[t].numel;
  }
  const int64_t grain = total < kCpuParallelThreshold / 4 ? static_cast<int64_t>(items.size()) : 1;
  at::parallel_for(0, static_cast<int64_t>(items.size()), std::max<int64_t>(grain, 1), [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      per_tensor(items[k].tensor, items[k].begin, items[k].end);
    }
  });
}

template <typename Body>
void dispatch_span(const OptimTensor& t, int64_t begin, int64_t end, const Body& body) {
  switch (t.dtype) {
    case DType::kFloat16:
      optim_span<c10::Half>(t, begin, end, body);
      break;
    case DType::kBFloat16:
      optim_span<c10::BFloat16>(t, begin, end, body);
      break;
    default:
      optim_span<float>(t, begin, end, body);
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
  for_all_chunks(tensors, n, [&](int64_t t, int64_t b, int64_t e) {
    const kernels::AdamStepFactors& f = factors[t];
    dispatch_span(tensors[t], b, e, [&](float& w, float g, float* m, float* v, float* vmax) {
      op(w, grad_scale == 1.f ? g : g / grad_scale, *m, *v, vmax, f);
    });
  });
  for (int64_t t = 0; t < n; ++t) {
    *tensors[t].step += 1.f;
  }
}

void sgd_step(const OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale) {
  const kernels::SgdOp op{params};
  for_all_chunks(tensors, n, [&](int64_t t, int64_t b, int64_t e) {
    const bool first = tensors[t].step == nullptr || *tensors[t].step == 0.f;
    dispatch_span(tensors[t], b, e, [&](float& w, float g, float* buf, float*, float*) {
      op(w, grad_scale == 1.f ? g : g / grad_scale, buf, first);
    });
  });
  for (int64_t t = 0; t < n; ++t) {
    if (tensors[t].step != nullptr) {
      *tensors[t].step += 1.f;
    }
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
