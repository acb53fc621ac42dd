// The lean ways to store a BF16 weight without an FP32 master, shared by the CPU loops and the CUDA kernels: the
// counter-based Philox4x32-10 generator, FP32 -> BF16 stochastic rounding keyed by (seed, step, element), and
// the Kahan-compensated store of a BF16 weight.
#pragma once

#include "common.h"

namespace ampkit::kernels {

// NOTE [Counter-based stochastic rounding]
// master_weights="stochastic" rounds each updated weight to BF16 up or down with probabilities proportional to its
// distance from either neighbour, so that updates smaller than half a BF16 ulp still move the weight on average.
// The random bits come from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11),
// a counter-based generator: the bits of an element are a pure function of (key, counter), with key = the
// parameter's 64-bit seed (state "sr_seed", drawn from torch's default generator when the state is created) and
// counter = (element index / 4, the step the update reaches), one word of the output per element. Nothing but the
// seed and the step count is kept, so a run is reproducible, resumes bit-identically from a state_dict, a skipped
// step (found_inf) leaves the counter where it was, and the CPU loop, the emulated CUDA build and the GPU round
// each element with the same bits whatever their threads, chunks and vector widths. The step count is FP32: past
// 2^24 steps it stops counting (as the bias corrections' step does) and the counter repeats.
struct Philox4x32 {
  uint32_t v[4];
};

// Philox4x32's multipliers and key increments (Weyl constants).
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u;
constexpr uint32_t kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxWeyl1 = 0xBB67AE85u;

// One Philox round on counter (c0, c1, c2, c3) under key (k0, k1).
AMPKIT_HOST_DEVICE AMPKIT_INLINE void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0,
                                                   uint32_t k1) {
  const uint64_t p0 = static_cast<uint64_t>(kPhiloxMul0) * c0;
  const uint64_t p1 = static_cast<uint64_t>(kPhiloxMul1) * c2;
  const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
  const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
  c0 = n0;
  c1 = static_cast<uint32_t>(p1);
  c2 = n2;
  c3 = static_cast<uint32_t>(p0);
}

// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1): Random123's philox4x32 with 10 rounds (its
// known-answer vectors are in tests/cpp/test_functors.cpp).
AMPKIT_HOST_DEVICE AMPKIT_INLINE Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                          uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    philox_round(c0, c1, c2, c3, k0, k1);
  }
  return {{c0, c1, c2, c3}};
}

// The random words of elements 4 * group ... 4 * group + 3 of a parameter with key `seed` at step `step` (the step
// count the update reaches: 1 for the first): one Philox call per 4 elements, word k for element 4 * group + k,
// so that a kernel's pack of 4 aligned elements costs one call (NOTE [Optimizer chunk loop]).
AMPKIT_HOST_DEVICE AMPKIT_INLINE Philox4x32 rounding_words(uint64_t seed, uint32_t step, int64_t group) {
  const auto g = static_cast<uint64_t>(group);
  return philox4x32_10(static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), step, 0u, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// The random bits of element `index` (its word of rounding_words; bf16_bits_stochastic uses the low 16).
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint32_t rounding_bits(uint64_t seed, uint32_t step, int64_t index) {
  const Philox4x32 r = rounding_words(seed, step, index >> 2);
  const int64_t k = index & 3;
  return k == 0 ? r.v[0] : k == 1 ? r.v[1] : k == 2 ? r.v[2] : r.v[3];  // no indexing: registers, not local memory
}

// The BF16 bits of x rounded stochastically with the 16 random bits `r`: r added to the low half of x's bit
// pattern, then truncated (torchao's _fp32_to_bf16_sr), so x rounds away from zero with probability (low half) /
// 2^16. A finite x may round up to Inf only from beyond BF16's largest finite value; Inf stays Inf and NaN stays
// NaN (the canonical quiet NaN of c10::BFloat16's round to nearest).
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint16_t bf16_bits_stochastic(float x, uint32_t r) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0u;
  }
  return static_cast<uint16_t>((bits + (r & 0xffffu)) >> 16);
}

// The BF16 bits of x rounded to nearest, ties to even (c10::BFloat16's and CUDA's __float2bfloat16 rounding).
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint16_t bf16_bits_nearest(float x) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0u;
  }
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE float bf16_bits_to_float(uint16_t b) {
  return bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// NOTE [Kahan-compensated BF16 weight]
// master_weights="kahan" keeps the BF16 weight w and a BF16 compensation c (state "kahan_comp"): the part of the
// past updates that the weight's rounding lost (torch-optimi's Kahan summation). A step computes the updated
// value w_new in FP32 from w (the functors, unchanged), then
//   u = c + (w_new - w);  w' = bf16_nearest(w + u);  c' = bf16_nearest(u - (w' - w))
// every operation in FP32 (w' - w is exact: both are BF16 of nearby magnitude). No multiply is involved, so no
// contraction can make CPU and GPU differ. 4 bytes per parameter hold the weight to about 16 significant bits.
AMPKIT_HOST_DEVICE AMPKIT_INLINE void kahan_store(float w, float w_new, uint16_t* weight_bits, uint16_t* comp_bits) {
  const float u = bf16_bits_to_float(*comp_bits) + (w_new - w);
  const uint16_t next = bf16_bits_nearest(w + u);
  *weight_bits = next;
  *comp_bits = bf16_bits_nearest(u - (bf16_bits_to_float(next) - w));
}

}  // namespace ampkit::kernels
