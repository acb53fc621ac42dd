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

}  // namespace
}  // namespace ampkit::detail::AMPKIT_CPU_NS
