// CPU loop of grad_stats (NOTE [Gradient statistics] in kernels/amp_functors.h): one at::parallel_for over
// (tensor, chunk) work items of kNormChunk elements, each summing squares lane by lane in the order of the CUDA
// kernel (NOTE [Deterministic norm]), so that CPU and CUDA norms agree bit for bit. Compiled once per instruction
// set like unscale_loops.h.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <cmath>
#include <vector>

#include "../../../kernels/amp_functors.h"
#include "cpu_loops.h"
#include "vec_ext.h"
#include "vec_io.h"
#include "work_items.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

struct StatsItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
  double sum = 0.0;
  uint64_t non_finite = 0;
  uint64_t zeros = 0;
  float max_abs = 0.f;
  std::array<uint64_t, kernels::kGradHistBins> hist{};
};

// Histogram slots past the kGradHistBins bins: the zeros and the Inf/NaN elements.
constexpr int kZeroSlot = kernels::kGradHistBins;
constexpr int kNonFiniteSlot = kernels::kGradHistBins + 1;
constexpr int kHistSlots = kernels::kGradHistBins + 2;

// How the histogram's exponent is found. kPow2: inv_scale is 2^k with a normal k, so floor(log2(|x| * inv_scale))
// is floor(log2 |x|) + k, read from x's float exponent (a subnormal |x| scaled by 2^64 first, exactly). kExact: any
// other inv_scale: the exponent of the exact double product, as grad_hist_bin reads it.
enum class BinPath { kPow2, kExact };

template <BinPath kPath>
void hist_bins(const VF& ax, const VD& ax_d, int pow2_exp, double inv, VI& bin) {
  VI e;
  if constexpr (kPath == BinPath::kPow2) {
    const VI exp_field = __builtin_bit_cast(VI, ax) >> 23;
    const VI sub_field = __builtin_bit_cast(VI, ax * 0x1p64f) >> 23;  // exact: a subnormal becomes normal
    e = (exp_field == 0 ? sub_field - 64 : exp_field) - 127 + pow2_exp;
  } else {
    e = __builtin_convertvector((__builtin_bit_cast(VU, ax_d * inv) >> 52) & 0x7ff, VI) - 1023;
  }
  bin = e - (kernels::kGradHistMinExp - 1);
  bin = bin < 0 ? 0 : bin;
  bin = bin > kernels::kGradHistBins - 1 ? kernels::kGradHistBins - 1 : bin;
}

// NOTE [Histogram by bit counts]
// A scalar increment per element (load the bin, add, store) held the CPU loop to 13-19% of copy bandwidth. The
// vector loop counts instead: each live element (finite, non-zero) becomes a one-hot 32-bit word, whose bit
// b < kWindowBins stands for bin base + b of a window of kWindowBins consecutive bins (bits kWindowBins and up are
// never read: the AVX-512 blocks leave in them what falls just over the window). The loops count the finite
// elements (the AVX-512 blocks the Inf/NaN, where a group of four rows has one); Inf/NaN are the others, and zeros
// the finite elements neither the window nor the count of outside elements below took. The words of kWidth
// elements form a vector, and vectors of equal weight are added bitwise in carry-save form
// (Harley-Seal): level i holds, for every bit position of every vector lane, the i-th binary digit of that counter,
// so one carry-save adder (an XOR of three and a majority of three) adds kWidth * 32 counters at once. A chunk's
// counts are read out of the levels once, at its end (or when the window moves).
// Gradients span few binades (a normal distribution's elements 2^-25 under its maximum are about one in 10^7), so
// the window sits 25 bins under the largest bin of the chunk's first row and 4 over it. A live element outside the
// window (a subnormal |x| included, under kPow2) is counted one by one after its block of kRowsPerBlock rows. A
// block with more than kMoveWindowAfter of them, most of its live elements, moves the window under their largest
// bin, at most kWindowMoves times a chunk; where more than kMoveWindowAfter elements, and more than 1/kSlotsOnlyOver
// of a block's live ones, stay outside, the data is wider than a window (exponents spread over the whole range, two
// clusters 2^40 apart) and the chunk's later rows count one element at a time (stats_row_slots, the scalar histogram
// in kOutsideCopies copies): such data steps 1.1-1.4x slower than the scalar loop alone did, gradients about 2x
// faster (a block with few live elements, as in an embedding's gradient, never switches).
// Counts do not depend on the order in which they are added, so the histogram is exactly the scalar one;
// tests/python/test_cpu_isa_copies.py compares every copy of the loop (AMPKIT_CPU_ISA) bit for bit.
constexpr int kWindowBins = 30;
constexpr int kWindowBelowTop = kWindowBins - 5;
constexpr int kMoveWindowAfter = 64;
constexpr int kWindowMoves = 2;  // per chunk: data wider than a window stops moving it (NOTE [Histogram by bit counts])
constexpr int kOutsideCopies = 4;
constexpr int kSlotsOnlyOver = 32;
constexpr int kRowsPerBlock = 4;
// Enough levels for a chunk's vectors: a count below 2^(kLevels - 1) per lane and bit.
constexpr int kLevels = 16;
static_assert(kernels::kNormChunk / kWidth < (int64_t{1} << (kLevels - 1)));

// The running statistics of one chunk: its lanes (NOTE [Deterministic norm]), its window's carry-save levels and the
// pending vector of each level, its histogram slots, and the running maximum.
struct ChunkStats {
  alignas(64) double lanes[kernels::kNormLanes] = {};
  VW level[kLevels] = {};
  VW pending[kLevels] = {};
  bool has_pending[kLevels] = {};
  uint32_t hist[kHistSlots] = {};
  // The counts of count_outside and stats_row_slots, in kOutsideCopies copies that consecutive elements increment
  // in turn (one copy would make every increment wait for the store before it).
  uint32_t outside_hist[kOutsideCopies][kHistSlots] = {};
  alignas(64) int32_t slots[kernels::kNormLanes];  // stats_row_slots' slots of one row
  bool slots_only = false;                         // wide data: every later row by stats_row_slots
  int moves_left = kWindowMoves;
  int base = 0;
  int lowest_base = 0;  // the window's range (window_place)
  int highest_base = 0;
  float max_abs = 0.f;
  VF vmax = {};  // the AVX-512 blocks' running maximum, lane by lane (joins max_abs at the chunk's end)
  // Of the rows counted through the window (not stats_row_slots'): their elements, the finite ones, those the
  // window counted and those count_outside counted. Zeros and Inf/NaN follow from these (NOTE [Histogram by bit
  // counts]).
  uint32_t window_elements = 0;
  uint32_t finite = 0;
  uint32_t window_counted = 0;
  uint32_t outside_counted = 0;
};

// a + b + s, bit by bit: s keeps the sum's low bit, carry gets its high bit (twice the weight).
[[gnu::always_inline]] inline void carry_save(VW& s, const VW& a, const VW& b, VW& carry) {
  const VW u = s ^ a;
  carry = (s & a) | (u & b);
  s = u ^ b;
}

// A vector of one-hot words of weight 2^first joins the levels: it waits as its level's pending vector, or it and
// the pending one are added into the level, whose carry goes up one level.
void count_vector(ChunkStats& cs, const VW& words, int first) {
  VW v = words;
  for (int i = first; i < kLevels; ++i) {
    if (!cs.has_pending[i]) {
      cs.pending[i] = v;
      cs.has_pending[i] = true;
      return;
    }
    VW carry;
    carry_save(cs.level[i], cs.pending[i], v, carry);
    cs.has_pending[i] = false;
    v = carry;
  }
}

// The levels' counts into the histogram slots (at the window's bins), and the levels emptied. Bit b of every lane of
// level i (and of its pending vector) counts 2^i: summed lane by lane in one vector per bit, then across lanes.
void read_window(ChunkStats& cs) {
  VW sums[kWindowBins] = {};
  for (int i = 0; i < kLevels; ++i) {
    const VW level = cs.level[i];
    const VW pending = cs.has_pending[i] ? cs.pending[i] : VW{};
    for (int b = 0; b < kWindowBins; ++b) {
      sums[b] += (((level >> b) & 1) + ((pending >> b) & 1)) << i;
    }
    cs.level[i] = VW{};
    cs.has_pending[i] = false;
  }
  uint32_t bits[kWindowBins];
  for (int b = 0; b < kWindowBins; ++b) {
    uint32_t total = 0;
    for (int k = 0; k < kWidth; ++k) {
      total += sums[b][k];
    }
    bits[b] = total;
  }
  for (int b = 0; b < kWindowBins; ++b) {
    cs.hist[cs.base + b] += bits[b];
    cs.window_counted += bits[b];
  }
}

int window_base(const ChunkStats& cs, int top_bin) {
  return std::clamp(top_bin - kWindowBelowTop, cs.lowest_base, cs.highest_base);
}

// Where a live element falls relative to the window: `rel`, its bin minus the window's base, and `in_window`, set
// where its bin is in the window (only ever for a live element). The window lies inside the histogram's bins, so a
// bin in it needs no clamping. kPow2 reads the bin from |x|'s exponent field plus a constant, and the window's range
// (window_range) keeps the fields 0 (zeros, subnormals: a live subnormal counts as outside) and 255 (Inf/NaN) out of
// it; kExact reads the exponent field of the double product |x| * inv_scale (never subnormal; a non-live element,
// +0 there, falls far under any window).
template <BinPath kPath>
[[gnu::always_inline]] inline void window_place(const VI& mag, const VD& ax_d, int pow2_exp, double inv, int base,
                                                VI& rel, VI& in_window) {
  constexpr int kFirst = kernels::kGradHistMinExp - 1;  // bin = exponent - kFirst, before clamping
  if constexpr (kPath == BinPath::kPow2) {
    rel = (mag >> 23) + (pow2_exp - 127 - kFirst - base);
  } else {
    rel = __builtin_convertvector((__builtin_bit_cast(VU, ax_d * inv) >> 52) & 0x7ff, VI) + (-1023 - kFirst - base);
  }
  in_window = __builtin_bit_cast(VW, rel) < kWindowBins;
}

// The bases a window may take: inside the histogram and, for kPow2, where the exponent fields 0 and 255 (at
// rel = field + pow2_exp - 127 - kFirst - base) fall outside it.
template <BinPath kPath>
void window_range(int pow2_exp, ChunkStats& cs) {
  cs.lowest_base = 0;
  cs.highest_base = kernels::kGradHistBins - kWindowBins;
  if constexpr (kPath == BinPath::kPow2) {
    const int field0 = pow2_exp - 127 - (kernels::kGradHistMinExp - 1);  // the bin at exponent field 0
    cs.lowest_base = std::max(cs.lowest_base, field0 + 1);
    cs.highest_base = std::min(cs.highest_base, field0 + 255 - kWindowBins);
  }
}

// An element's magnitude bits, whether it is finite and live (non-zero and finite), |x| (+0 where it is not live)
// in FP32 and FP64; |x| joins the running maximum.
[[gnu::always_inline]] inline void element_bits(const VF& x, VF& vmax, VI& mag, VI& finite, VI& live, VF& ax,
                                                VD& ax_d) {
  mag = __builtin_bit_cast(VI, x) & 0x7fffffff;
  finite = mag < 0x7f800000;
  live = finite & (mag != 0);
  ax = __builtin_bit_cast(VF, mag & live);
  vmax = ax > vmax ? ax : vmax;
  ax_d = __builtin_convertvector(ax, VD);
}

// The vector of g[j, j + kWidth): past `len` (a row's last, partial vector) +0.0, which is not live.
[[gnu::always_inline]] inline void load_row_vector(const float* g, int j, int len, VF& x) {
  if (j + kWidth <= len) {
    std::memcpy(&x, g + j, sizeof(x));
  } else {
    float tail[kWidth] = {};
    std::copy(g + j, g + len, tail);
    std::memcpy(&x, tail, sizeof(x));
  }
}

// What an element contributes: its square to its lane, |x| to the maximum, its one-hot word (0 past the row's
// end, `valid`, and where it is not live or its bin is outside the window), its lane set in `outside` where it is
// live and its bin outside the window, and -1 to its lane of `finite_lanes` where it is finite.
template <BinPath kPath>
[[gnu::always_inline]] inline void stats_vector(const VF& x, const VI& valid, int pow2_exp, double inv, int base,
                                                VD& lane, VF& vmax, VW& word, VI& outside, VI& finite_lanes) {
  VI mag, finite, live;
  VF ax;
  VD ax_d;
  element_bits(x, vmax, mag, finite, live, ax, ax_d);
  lane += ax_d * ax_d;
  VI rel, in_window;
  window_place<kPath>(mag, ax_d, pow2_exp, inv, base, rel, in_window);
  word = __builtin_bit_cast(VW, valid & in_window & (VI{} + 1) << (rel & 31));
  outside |= valid & live & ~in_window;
  finite_lanes += valid & finite;
}

// kRows consecutive rows of a chunk (each kNormLanes elements but the last, `len` of them), row element j adding its
// square to lane j, so that every lane sums its elements in element order (NOTE [Deterministic norm]). A lane's
// vector is loaded once for all kRows rows. No branch: a zero or an Inf/NaN adds +0.0 to its lane (which leaves a
// lane of finite squares unchanged bit for bit) and nothing to the one-hot words.
template <BinPath kPath, int kRows>
void stats_rows(const float* g, int len, int pow2_exp, double inv, ChunkStats& cs, VI& outside_out,
                const float* next = nullptr) {
  static_assert(kernels::kNormLanes % kWidth == 0);
  static_assert(kRows == 1 || kRows == kRowsPerBlock);
  VF vmax = {};  // locals: in cs, every store of the loop could alias them
  VW ones = cs.level[0];
  VW twos = cs.level[1];
  VI outside = outside_out;
  VI finite_lanes = {};
  VI all = VI{} - 1;
  const int last = kRows == 1 ? len : kernels::kNormLanes;
  for (int j = 0; j < last; j += kWidth) {
    if (next != nullptr) {  // the next block's rows, one cache line each (four streams defeat the prefetchers)
      for (int r = 0; r < kRows; ++r) {
        __builtin_prefetch(next + r * kernels::kNormLanes + j);
      }
    }
    VD lane;
    std::memcpy(&lane, cs.lanes + j, sizeof(VD));
    VW words[kRows];
    for (int r = 0; r < kRows; ++r) {
      VF x;
      VI valid = all;
      if (kRows == 1 && j + kWidth > len) {  // the row's last, partial vector: zeros past its end, not counted
        load_row_vector(g, j, len, x);
        for (int k = len - j; k < kWidth; ++k) {
          valid[k] = 0;
        }
      } else {
        std::memcpy(&x, g + r * kernels::kNormLanes + j, sizeof(x));
      }
      stats_vector<kPath>(x, valid, pow2_exp, inv, cs.base, lane, vmax, words[r], outside, finite_lanes);
    }
    std::memcpy(cs.lanes + j, &lane, sizeof(VD));
    if constexpr (kRows == kRowsPerBlock) {
      VW twos_a, twos_b, fours;
      carry_save(ones, words[0], words[1], twos_a);
      carry_save(ones, words[2], words[3], twos_b);
      carry_save(twos, twos_a, twos_b, fours);
      count_vector(cs, fours, 2);
    } else {
      count_vector(cs, words[0], 0);
    }
  }
  outside_out = outside;
  cs.window_elements += kRows == 1 ? len : kRows * kernels::kNormLanes;
  for (int k = 0; k < kWidth; ++k) {
    cs.finite += static_cast<uint32_t>(-finite_lanes[k]);  // (a true comparison is -1)
  }
  if constexpr (kRows == kRowsPerBlock) {
    cs.level[0] = ones;
    cs.level[1] = twos;
  } else {
    (void)ones;
    (void)twos;
  }
  for (int k = 0; k < kWidth; ++k) {
    cs.max_abs = std::max(cs.max_abs, vmax[k]);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The FP32 bits of 16 elements of T, widened exactly in a register.
[[gnu::always_inline]] inline __m512i float_bits(const float* x) { return _mm512_loadu_si512(x); }
[[gnu::always_inline]] inline __m512i float_bits(const c10::BFloat16* x) {
  return bf16_words_as_float_bits(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 0);
}
[[gnu::always_inline]] inline __m512i float_bits(const c10::Half* x) {
  return _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
}

// The halves of 16 elements as FP64 (`bits` their FP32 bits), where `keep` (bit k: element k) is set, 0.0
// elsewhere. FP32 elements are converted from memory again: a load costs less than extracting the high half.
template <typename T>
[[gnu::always_inline]] inline void as_doubles(const T* x, __m512i bits, __mmask16 keep, __m512d& lo, __m512d& hi) {
  __m256 x_lo;
  __m256 x_hi;
  if constexpr (std::is_same_v<T, float>) {
    x_lo = _mm256_loadu_ps(x);
    x_hi = _mm256_loadu_ps(x + 8);
  } else {
    x_lo = _mm512_castps512_ps256(_mm512_castsi512_ps(bits));
    x_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castsi512_pd(bits), 1));
  }
  lo = _mm512_maskz_cvtps_pd(static_cast<__mmask8>(keep), x_lo);
  hi = _mm512_maskz_cvtps_pd(static_cast<__mmask8>(_kshiftri_mask16(keep, 8)), x_hi);
}

// stats_rows<kPow2, kRowsPerBlock> in AVX-512 intrinsics, the same counts with fewer instructions and without mask
// registers (on this loop they, not the vector units, set the pace). Four rows (16 lanes each) at a time: their
// squares join the FP64 lanes unmasked and their largest magnitude is taken as an integer; only where that is an
// Inf/NaN are the four rows' squares added again from the lanes as they were, under a `finite` mask (0.0 elsewhere:
// +0.0 to the lane, as there), their Inf/NaN counted and their largest finite magnitude taken. The one-hot word
// takes every element's bit by an unmasked shift: a zero's or a subnormal's exponent field 0 and an Inf/NaN's 255
// fall under the window or 30 and more over it (window_range), and a shift of 32 or more is 0, so no bit under
// kWindowBins is set but a live element's in the window. Whether any live element is outside follows from the
// block's largest finite and smallest non-zero magnitudes (bins grow with magnitudes). FP16/BF16 elements are
// widened in registers (no staged copy); three-input logic for the carry-save adders. Returns whether any live
// element is outside the window.
template <typename T>
bool stats_block_pow2(const T* g, int pow2_exp, ChunkStats& cs, const T* next) {
  constexpr int kFirst = kernels::kGradHistMinExp - 1;
  const int to_rel_scalar = pow2_exp - 127 - kFirst - cs.base;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i to_rel = _mm512_set1_epi32(to_rel_scalar);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i vmax = _mm512_setzero_si512();  // the largest finite magnitude, lane by lane
  __m512i vmin = _mm512_set1_epi32(-1);   // the smallest magnitude - 1 (unsigned: a zero's is the largest)
  uint32_t non_finite = 0;
  __m512i ones = __builtin_bit_cast(__m512i, cs.level[0]);
  __m512i twos = __builtin_bit_cast(__m512i, cs.level[1]);
  auto carry_save = [](__m512i& sum, const __m512i a, const __m512i b) {
    const __m512i carry = _mm512_ternarylogic_epi32(sum, a, b, 0xe8);  // majority
    sum = _mm512_ternarylogic_epi32(sum, a, b, 0x96);                  // a ^ b ^ sum
    return carry;
  };
  for (int j = 0; j < kernels::kNormLanes; j += 16) {
    if (next != nullptr && (sizeof(T) == 4 || j % 32 == 0)) {  // a cache line of each row once
      for (int r = 0; r < kRowsPerBlock; ++r) {
        __builtin_prefetch(next + r * kernels::kNormLanes + j);
      }
    }
    const __m512d lane_lo_before = _mm512_load_pd(cs.lanes + j);
    const __m512d lane_hi_before = _mm512_load_pd(cs.lanes + j + 8);
    __m512d lane_lo = lane_lo_before;
    __m512d lane_hi = lane_hi_before;
    __m512i words[kRowsPerBlock];
    __m512i largest = _mm512_setzero_si512();
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const T* x = g + r * kernels::kNormLanes + j;
      const __m512i bits = float_bits(x);
      const __m512i mag = _mm512_and_si512(bits, abs_mask);
      largest = _mm512_max_epu32(largest, mag);
      vmin = _mm512_min_epu32(vmin, _mm512_sub_epi32(mag, one));
      __m512d lo;
      __m512d hi;
      as_doubles(x, bits, 0xffff, lo, hi);
      lane_lo = _mm512_add_pd(lane_lo, _mm512_mul_pd(lo, lo));
      lane_hi = _mm512_add_pd(lane_hi, _mm512_mul_pd(hi, hi));
      words[r] = _mm512_sllv_epi32(one, _mm512_add_epi32(_mm512_srli_epi32(mag, 23), to_rel));
    }
    if (_mm512_cmpge_epu32_mask(largest, inf) != 0) [[unlikely]] {
      // An Inf/NaN among these rows: their squares again, the finite ones only, from the lanes as they were.
      lane_lo = lane_lo_before;
      lane_hi = lane_hi_before;
      largest = _mm512_setzero_si512();
      for (int r = 0; r < kRowsPerBlock; ++r) {
        const T* x = g + r * kernels::kNormLanes + j;
        const __m512i bits = float_bits(x);
        const __m512i mag = _mm512_and_si512(bits, abs_mask);
        const __mmask16 finite = _mm512_cmplt_epu32_mask(mag, inf);
        largest = _mm512_mask_max_epu32(largest, finite, largest, mag);
        __m512d lo;
        __m512d hi;
        as_doubles(x, bits, finite, lo, hi);
        lane_lo = _mm512_add_pd(lane_lo, _mm512_mul_pd(lo, lo));
        lane_hi = _mm512_add_pd(lane_hi, _mm512_mul_pd(hi, hi));
        non_finite += static_cast<uint32_t>(__builtin_popcount(_cvtmask16_u32(_knot_mask16(finite))));
      }
    }
    vmax = _mm512_max_epu32(vmax, largest);
    _mm512_store_pd(cs.lanes + j, lane_lo);
    _mm512_store_pd(cs.lanes + j + 8, lane_hi);
    const __m512i twos_a = carry_save(ones, words[0], words[1]);
    const __m512i twos_b = carry_save(ones, words[2], words[3]);
    const __m512i fours = carry_save(twos, twos_a, twos_b);
    count_vector(cs, __builtin_bit_cast(VW, fours), 2);
  }
  cs.level[0] = __builtin_bit_cast(VW, ones);
  cs.level[1] = __builtin_bit_cast(VW, twos);
  cs.window_elements += kRowsPerBlock * kernels::kNormLanes;
  cs.finite += kRowsPerBlock * kernels::kNormLanes - non_finite;
  cs.vmax = __builtin_bit_cast(VF, _mm512_max_epu32(__builtin_bit_cast(__m512i, cs.vmax), vmax));
  // The largest finite magnitude and the smallest non-zero one (an Inf/NaN's is never the smallest where a live
  // element is); a bin is the exponent field plus to_rel_scalar.
  const uint32_t largest = _mm512_reduce_max_epu32(vmax);
  const uint32_t smallest = _mm512_reduce_min_epu32(vmin) + 1u;  // 0: every element zero
  const bool live_over = largest != 0 && static_cast<int>(largest >> 23) + to_rel_scalar >= kWindowBins;
  const bool live_under =
      smallest != 0 && smallest < 0x7f800000u && static_cast<int>(smallest >> 23) + to_rel_scalar < 0;
  return live_over || live_under;
}
#endif

// One row of a chunk (len <= kNormLanes elements), its histogram counted one element at a time: for data wider than
// the window (NOTE [Histogram by bit counts]). Its lanes and maximum as stats_rows<kPath, 1>.
template <BinPath kPath>
void stats_row_slots(const float* g, int len, int pow2_exp, double inv, ChunkStats& cs) {
  VF vmax = {};  // a local: in cs, every store of the loop could alias it
  for (int j = 0; j < len; j += kWidth) {
    VF x;
    load_row_vector(g, j, len, x);  // (past len: +0.0 to the lanes; those slots are not counted)
    VI mag, finite, live;
    VF ax;
    VD ax_d;
    element_bits(x, vmax, mag, finite, live, ax, ax_d);
    VD lane;
    std::memcpy(&lane, cs.lanes + j, sizeof(VD));
    lane += ax_d * ax_d;
    std::memcpy(cs.lanes + j, &lane, sizeof(VD));
    VI bin;
    hist_bins<kPath>(ax, ax_d, pow2_exp, inv, bin);
    const VI slot = live ? bin : (finite ? VI{} + kZeroSlot : VI{} + kNonFiniteSlot);
    std::memcpy(cs.slots + j, &slot, sizeof(slot));
  }
  for (int k = 0; k < kWidth; ++k) {
    cs.max_abs = std::max(cs.max_abs, vmax[k]);
  }
  int j = 0;
  for (; j + kOutsideCopies <= len; j += kOutsideCopies) {
    for (int c = 0; c < kOutsideCopies; ++c) {
      ++cs.outside_hist[c][cs.slots[j + c]];
    }
  }
  for (; j < len; ++j) {
    ++cs.outside_hist[0][cs.slots[j]];
  }
}

// The live elements of g[0, len) outside the window, counted one by one (the set lanes of each vector's mask);
// returns how many there were, and sets `live_count` to the live elements of the span and `top_bin` to the largest
// bin among the ones outside (-1 if none).
template <BinPath kPath>
int count_outside(const float* g, int len, int pow2_exp, double inv, ChunkStats& cs, int& live_count, int& top_bin) {
  VI outside_count = {};
  VI live_lanes = {};
  VI top = VI{} - 1;
  for (int j = 0; j < len; j += kWidth) {
    VF unused_max = {};  // (the block's maximum is already taken)
    VI mag, finite, live;
    VF ax;
    VD ax_d;
    VF x;
    load_row_vector(g, j, len, x);
    element_bits(x, unused_max, mag, finite, live, ax, ax_d);
    VI bin, rel, in_window;
    hist_bins<kPath>(ax, ax_d, pow2_exp, inv, bin);
    window_place<kPath>(mag, ax_d, pow2_exp, inv, cs.base, rel, in_window);
    const VI outside = live & ~in_window;
    top = (outside & (bin > top)) != 0 ? bin : top;
    outside_count -= outside;
    live_lanes -= live;
    uint32_t lanes = 0;
#if defined(CPU_CAPABILITY_AVX512)
    lanes = _cvtmask16_u32(_mm512_movepi32_mask(__builtin_bit_cast(__m512i, outside)));
#else
    for (int k = 0; k < kWidth; ++k) {
      lanes |= static_cast<uint32_t>(outside[k] & 1) << k;
    }
#endif
    for (int c = 0; lanes != 0; lanes &= lanes - 1, c = (c + 1) % kOutsideCopies) {
      ++cs.outside_hist[c][bin[__builtin_ctz(lanes)]];
    }
  }
  int count = 0;
  live_count = 0;
  top_bin = -1;
  for (int k = 0; k < kWidth; ++k) {
    count += outside_count[k];
    live_count += live_lanes[k];
    top_bin = std::max<int>(top_bin, top[k]);
  }
  return count;
}

// The largest bin of a chunk's first elements (0 if none is live), which places its first window.
int first_top_bin(const float* g, int len, float inv_scale) {
  float top = 0.f;
  for (int j = 0; j < len; ++j) {
    const float a = std::fabs(g[j]);
    top = a > top && a < std::numeric_limits<float>::infinity() ? a : top;
  }
  return top > 0.f ? kernels::grad_hist_bin(top, inv_scale) : 0;
}

template <BinPath kPath, typename T>
void stats_span(const T* g, int64_t n, float inv_scale, StatsItem& item) {
  ChunkStats cs;
  const double inv = static_cast<double>(inv_scale);
  const int pow2_exp = static_cast<int>(c10::bit_cast<uint32_t>(inv_scale) >> 23) - 127;
  window_range<kPath>(pow2_exp, cs);
  constexpr int kBlock = kRowsPerBlock * kernels::kNormLanes;
  for (int64_t row = 0; row < n; row += kBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kBlock, n - row));
    // The block as FP32 for the loops that read FP32: FP16/BF16 staged in L1 when one of them runs (the AVX-512
    // block widens its elements in registers).
    alignas(64) float staged[std::is_same_v<T, float> ? 1 : kBlock];
    const float* xs = nullptr;
    auto as_float = [&]() {
      if constexpr (std::is_same_v<T, float>) {
        xs = g + row;
      } else if (xs == nullptr) {
        row_as_float(g + row, len, staged);
        xs = staged;
      }
      return xs;
    };
    if (row == 0) {
      cs.base = window_base(cs, first_top_bin(as_float(), std::min(len, kernels::kNormLanes), inv_scale));
    }
    VI outside = {};
    bool block_outside = false;  // the AVX-512 block's answer
    if (cs.slots_only) {
      for (int r = 0; r < len; r += kernels::kNormLanes) {
        stats_row_slots<kPath>(as_float() + r, std::min(kernels::kNormLanes, len - r), pow2_exp, inv, cs);
      }
    } else if (len == kBlock) {
      // The next block, prefetched (by the portable loop only where it reads FP32: staged spans are read in order).
      const T* next = n - row >= 2 * kBlock ? g + row + kBlock : nullptr;
      const float* next_f32 = std::is_same_v<T, float> ? reinterpret_cast<const float*>(next) : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (kPath == BinPath::kPow2) {
        block_outside = stats_block_pow2(g + row, pow2_exp, cs, next);
      } else {
        stats_rows<kPath, kRowsPerBlock>(as_float(), len, pow2_exp, inv, cs, outside, next_f32);
      }
#else
      stats_rows<kPath, kRowsPerBlock>(as_float(), len, pow2_exp, inv, cs, outside, next_f32);
#endif
    } else {
      for (int r = 0; r < len; r += kernels::kNormLanes) {
        stats_rows<kPath, 1>(as_float() + r, std::min(kernels::kNormLanes, len - r), pow2_exp, inv, cs, outside);
      }
    }
    bool any_outside = block_outside;
    for (int k = 0; k < kWidth; ++k) {
      any_outside |= outside[k] != 0;
    }
    if (any_outside) {
      int live_count = 0;
      int top_bin = -1;
      const int outside_count = count_outside<kPath>(as_float(), len, pow2_exp, inv, cs, live_count, top_bin);
      cs.outside_counted += outside_count;
      // Many outside, most of the block's: the window moves under their largest bin (a bounded number of times per
      // chunk). More than kMoveWindowAfter outside, and more than 1/kSlotsOnlyOver of the live elements, where it
      // cannot or will not move: the data is wider than a window, and the chunk's later rows count one element at
      // a time.
      const int target = window_base(cs, top_bin);
      if (outside_count > kMoveWindowAfter && 2 * outside_count > live_count && cs.moves_left > 0 &&
          target != cs.base) {
        read_window(cs);
        cs.base = target;
        --cs.moves_left;
      } else if (outside_count > kMoveWindowAfter && kSlotsOnlyOver * outside_count > live_count) {
        cs.slots_only = true;
      }
    }
  }
  read_window(cs);
  cs.hist[kZeroSlot] += cs.finite - cs.window_counted - cs.outside_counted;
  cs.hist[kNonFiniteSlot] += cs.window_elements - cs.finite;
  for (int k = 0; k < kWidth; ++k) {
    cs.max_abs = std::max(cs.max_abs, cs.vmax[k]);
  }
  double chunk_sum = 0.0;
  for (const double lane : cs.lanes) {
    chunk_sum += lane;
  }
  item.sum = chunk_sum;
  item.max_abs = cs.max_abs;
  for (int c = 0; c < kOutsideCopies; ++c) {
    for (int k = 0; k < kHistSlots; ++k) {
      cs.hist[k] += cs.outside_hist[c][k];
    }
  }
  for (int k = 0; k < kernels::kGradHistBins; ++k) {
    item.hist[k] += cs.hist[k];
  }
  item.zeros += cs.hist[kZeroSlot];
  item.non_finite += cs.hist[kNonFiniteSlot];
}

template <typename T>
void stats_span(const T* g, int64_t n, float inv_scale, StatsItem& item) {
  const uint32_t bits = c10::bit_cast<uint32_t>(inv_scale);
  const bool pow2 = (bits & 0x7fffff) == 0 && (bits >> 23) != 0 && (bits >> 23) < 0xff;  // positive, normal
  if (pow2) {
    stats_span<BinPath::kPow2>(g, n, inv_scale, item);
  } else {
    stats_span<BinPath::kExact>(g, n, inv_scale, item);
  }
}

}  // namespace

void grad_stats(const kernels::TensorRef* grads, int64_t n, float inv_scale, double* out) {
  std::vector<StatsItem> items;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < grads[t].numel; b += kernels::kNormChunk) {
      StatsItem item;
      item.tensor = t;
      item.begin = b;
      item.end = std::min(grads[t].numel, b + kernels::kNormChunk);
      items.push_back(item);
    }
  }
  for_item_ranges(items, 0, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      StatsItem& item = items[k];
      const kernels::TensorRef& ref = grads[item.tensor];
      const int64_t len = item.end - item.begin;
      switch (ref.dtype) {
        case kernels::DType::kFloat16:
          stats_span(static_cast<const c10::Half*>(ref.data) + item.begin, len, inv_scale, item);
          break;
        case kernels::DType::kBFloat16:
          stats_span(static_cast<const c10::BFloat16*>(ref.data) + item.begin, len, inv_scale, item);
          break;
        default:
          stats_span(static_cast<const float*>(ref.data) + item.begin, len, inv_scale, item);
          break;
      }
    }
  });
  // Rows in item order: chunk sums in chunk order, as the CUDA kernel's last pass adds them.
  std::vector<double> totals(static_cast<size_t>(n), 0.0);
  std::vector<float> maxima(static_cast<size_t>(n), 0.f);
  for (int64_t t = 0; t < n; ++t) {
    double* row = out + t * kernels::kGradStatsColumns;
    std::fill(row, row + kernels::kGradStatsColumns, 0.0);
  }
  for (const StatsItem& item : items) {
    double* row = out + item.tensor * kernels::kGradStatsColumns;
    totals[item.tensor] += item.sum;
    maxima[item.tensor] = std::max(maxima[item.tensor], item.max_abs);
    row[kernels::kStatNonFinite] += static_cast<double>(item.non_finite);
    row[kernels::kStatZeros] += static_cast<double>(item.zeros);
    for (int k = 0; k < kernels::kGradHistBins; ++k) {
      row[4 + k] += static_cast<double>(item.hist[k]);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    double* row = out + t * kernels::kGradStatsColumns;
    row[kernels::kStatMaxAbs] = static_cast<double>(maxima[t]) * static_cast<double>(inv_scale);
    row[kernels::kStatNorm] = std::sqrt(totals[t]) * static_cast<double>(inv_scale);
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
