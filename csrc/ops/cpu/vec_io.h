// Loads and stores between FP16/BF16/FP32 elements and pairs of at::vec::Vectorized<float> (one vector of a 2-byte
// type widens to exactly two of FP32), shared by the CPU loops of loops_<isa>.cpp inside AMPKIT_CPU_NS.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <tuple>
#include <type_traits>

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

using VecF = at::vec::Vectorized<float>;

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

// N float vectors from N * VecF::size() elements of T, and back: N == 2 as load2/store2, N == 1 for float only.
template <int N, typename T>
void loadn(const T* p, VecF* v) {
  if constexpr (N == 1) {
    static_assert(std::is_same_v<T, float>);
    v[0] = VecF::loadu(p);
  } else {
    load2(p, v[0], v[1]);
  }
}

template <int N, typename T>
void storen(T* p, const VecF* v) {
  if constexpr (N == 1) {
    static_assert(std::is_same_v<T, float>);
    v[0].store(p);
  } else {
    store2(p, v[0], v[1]);
  }
}

// An FP16, BF16 or FP32 span as FP32 in xs[0, len): 2 * VecF::size() elements at a time by load2 (F16C where the
// loop's instruction set has it), then a scalar tail.
template <typename T>
void row_as_float(const T* g, int64_t len, float* xs) {
  constexpr int64_t kStep = 2 * VecF::size();
  int64_t j = 0;
  for (; j + kStep <= len; j += kStep) {
    VecF lo, hi;
    load2(g + j, lo, hi);
    lo.store(xs + j);
    hi.store(xs + j + VecF::size());
  }
  for (; j < len; ++j) {
    xs[j] = static_cast<float>(g[j]);
  }
}

}  // namespace
}  // namespace ampkit::detail::AMPKIT_CPU_NS
