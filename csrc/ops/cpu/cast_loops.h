// CPU loops of the compressed all-reduce's cast passes (NOTE [Compressed all-reduce passes] in
// kernels/amp_functors.h): at::vec SIMD, one at::parallel_for over every (pair, chunk) work item. Compiled once per
// instruction set like unscale_loops.h.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../../../kernels/amp_functors.h"
#include "cpu_loops.h"
#include "vec_io.h"
#include "work_items.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

using kernels::DType;
using kernels::TensorRef;
constexpr int64_t kCastBlock = 2 * VecF::size();  // one Vectorized<Half> / <BFloat16>: two float vectors
static_assert(at::vec::Vectorized<c10::Half>::size() == kCastBlock, "a 2-byte vector widens to two float vectors");

// Rounds float vectors to T's precision (nearest even) and widens them again: float(T(x)).
template <typename T>
void round_through(VecF& lo, VecF& hi) {
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

// out[0, n) = the cast pass of s[0, n); returns whether a float(Out(s[i])) was non-finite (only when `check`).
template <typename TS, typename TO>
bool cast_span(const TS* s, TO* o, int64_t n, const kernels::CastOp& op, bool check) {
  bool bad = false;
  int64_t i = 0;
  for (; i + kCastBlock <= n; i += kCastBlock) {
    VecF lo;
    VecF hi;
    load2(s + i, lo, hi);
    round_through<TO>(lo, hi);
    if (check) {
      bad |= lo.has_inf_nan() || hi.has_inf_nan();
    }
    store2(o + i, op(lo), op(hi));
  }
  for (; i < n; ++i) {
    const float y = static_cast<float>(static_cast<TO>(static_cast<float>(s[i])));
    bad |= check && kernels::is_non_finite(y);
    o[i] = static_cast<TO>(op(y));
  }
  return bad;
}

template <typename TS>
bool cast_span_to(const TS* s, const TensorRef& out, int64_t begin, int64_t n, const kernels::CastOp& op, bool check) {
  switch (out.dtype) {
    case DType::kFloat16:
      return cast_span(s, static_cast<c10::Half*>(out.data) + begin, n, op, check);
    case DType::kBFloat16:
      return cast_span(s, static_cast<c10::BFloat16*>(out.data) + begin, n, op, check);
    default:
      return cast_span(s, static_cast<float*>(out.data) + begin, n, op, check);
  }
}

bool cast_ref(const TensorRef& src, const TensorRef& out, int64_t begin, int64_t end, const kernels::CastOp& op,
              bool check) {
  const int64_t n = end - begin;
  switch (src.dtype) {
    case DType::kFloat16:
      return cast_span_to(static_cast<const c10::Half*>(src.data) + begin, out, begin, n, op, check);
    case DType::kBFloat16:
      return cast_span_to(static_cast<const c10::BFloat16*>(src.data) + begin, out, begin, n, op, check);
    default:
      return cast_span_to(static_cast<const float*>(src.data) + begin, out, begin, n, op, check);
  }
}

}  // namespace

bool cast_pass(const TensorRef* src, const TensorRef* out, int64_t n, const kernels::CastOp& op, bool check) {
  return any_chunk(
      n, [&](int64_t t) { return src[t].numel; }, kCpuParallelThreshold,
      [&](const WorkItem& w) { return cast_ref(src[w.tensor], out[w.tensor], w.begin, w.end, op, check); });
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
