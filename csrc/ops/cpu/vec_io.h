// Loads and stores between FP16/BF16/FP32 elements and pairs of at::vec::Vectorized<float> (one vector of a 2-byte
// type widens to exactly two of FP32), shared by the CPU loops of loops_<isa>.cpp inside AMPKIT_CPU_NS.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

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

#if defined(CPU_CAPABILITY_AVX512)
// The FP32 bits of the BF16 words [first, first + 16) of `words` (first: 0 or 16): each word to the high half of its
// 32-bit lane, zeros in the low halves, by one word permutation (where zero extension and a shift take two).
inline __m512i bf16_words_as_float_bits(__m512i words, int first) {
  const __m512i to_high_halves = _mm512_add_epi16(_mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                                                   7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0),
                                                  _mm512_set1_epi16(static_cast<int16_t>(first)));
  return _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high_halves, words);
}
#endif

// An FP16, BF16 or FP32 span as FP32 in xs[0, len): 2 * VecF::size() elements at a time by load2 (F16C where the
// loop's instruction set has it; BF16 on AVX-512 by word permutations), then a scalar tail.
template <typename T>
void row_as_float(const T* g, int64_t len, float* xs) {
  constexpr int64_t kStep = 2 * VecF::size();
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; j + 32 <= len; j += 32) {
      const __m512i x = _mm512_loadu_si512(g + j);
      _mm512_storeu_si512(xs + j, bf16_words_as_float_bits(x, 0));
      _mm512_storeu_si512(xs + j + 16, bf16_words_as_float_bits(x, 16));
    }
  }
#endif
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
