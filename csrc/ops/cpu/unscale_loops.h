// CPU loops of gradient unscaling and the Inf/NaN check: at::vec SIMD over one at::parallel_for that spans
// every (tensor, chunk) work item of the list. This header is compiled once per instruction set (see
// loops_<isa>.cpp), each copy in its own namespace named by AMPKIT_CPU_NS; cpu_loops.cpp picks one.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "../../../kernels/amp_functors.h"
#include "cpu_loops.h"
#include "work_items.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

using kernels::DType;
using kernels::TensorRef;

// Checks, and unscales when `write`, elements [0, n) of p. Returns whether an element read was Inf or NaN.
template <typename T>
bool unscale_span(T* p, int64_t n, float inv_scale, bool write) {
  using Vec = at::vec::Vectorized<T>;
  using opmath = kernels::opmath_t<T>;
  const kernels::UnscaleOp<opmath> op(inv_scale);
  write = write && !op.identity;
  bool bad = false;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(p + i);
    if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
      auto [lo, hi] = at::vec::convert_to_float<T>(v);
      bad |= lo.has_inf_nan() || hi.has_inf_nan();
      if (write) {
        at::vec::convert_from_float<T>(op(lo), op(hi)).store(p + i);
      }
    } else {
      bad |= v.has_inf_nan();
      if (write) {
        op(v).store(p + i);
      }
    }
  }
  for (; i < n; ++i) {
    const opmath x = static_cast<opmath>(p[i]);
    bad |= kernels::is_non_finite(x);
    if (write) {
      p[i] = static_cast<T>(op(x));
    }
  }
  return bad;
}

bool unscale_ref(const TensorRef& t, int64_t begin, int64_t end, float inv_scale, bool write) {
  switch (t.dtype) {
    case DType::kFloat16:
      return unscale_span(static_cast<c10::Half*>(t.data) + begin, end - begin, inv_scale, write);
    case DType::kBFloat16:
      return unscale_span(static_cast<c10::BFloat16*>(t.data) + begin, end - begin, inv_scale, write);
    case DType::kFloat32:
      return unscale_span(static_cast<float*>(t.data) + begin, end - begin, inv_scale, write);
    case DType::kFloat64:
      return unscale_span(static_cast<double*>(t.data) + begin, end - begin, inv_scale, write);
    case DType::kUInt8:  // an optimizer state's code, never a grad
      break;
  }
  return false;
}

}  // namespace

bool unscale_and_check(const TensorRef* tensors, int64_t n, float inv_scale, bool write) {
  return any_chunk(
      n, [&](int64_t t) { return tensors[t].numel; }, kCpuParallelThreshold,
      [&](const WorkItem& w) { return unscale_ref(tensors[w.tensor], w.begin, w.end, inv_scale, write); });
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
