// CPU loops of the fused optimizer steps: one at::parallel_for over every (tensor, chunk) work item; each item runs
// the optim_functors.h functors on at::vec::Vectorized<float> (two vectors per iteration, so that a vector of
// FP16/BF16 converts to exactly two of FP32), then the scalar functor on the tail. Compiled once per instruction
// set by loops_<isa>.cpp, in the namespace AMPKIT_CPU_NS.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../../kernels/blockwise8.h"
#include "../../../kernels/optim_functors.h"
#include "../../../kernels/stochastic_rounding.h"
#include "cpu_loops.h"
#include "vec_io.h"
#include "work_items.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

using kernels::DType;
using kernels::OptimTensor;

struct VecMath {
  static VecF sqrt(const VecF& x) { return x.sqrt(); }
  static VecF max(const VecF& a, const VecF& b) { return at::vec::maximum(a, b); }
  static VecF neg(const VecF& x) { return x.neg(); }
  // a * b + c rounded once, as the scalar functors' fmaf.
  static VecF fma(const VecF& a, const VecF& b, const VecF& c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    return at::vec::fmadd(a, b, c);  // one vfmadd instruction
#else
    // The generic Vectorized fmadd is a * b + c rounded twice: one std::fma per lane instead.
    __at_align__ float av[VecF::size()];
    __at_align__ float bv[VecF::size()];
    __at_align__ float cv[VecF::size()];
    a.store(av);
    b.store(bv);
    c.store(cv);
    for (int i = 0; i < VecF::size(); ++i) {
      av[i] = std::fma(av[i], bv[i], cv[i]);
    }
    return VecF::loadu(av);
#endif
  }
};

// codes[i] = blockwise8_code(in[i], scale, map) for i < n: the same operations (a division, eight compares against
// map entries, the rounding compare), 16 or 8 elements at a time. AVX-512: the map in search order (NOTE
// [Quantizer search tree]) held in 16 registers, each level's thresholds picked by permutes (vpermps/vpermt2ps)
// instead of gathers, and the two values of the final rounding carried along, 32 elements at a time (a map other
// than blockwise8_map's two, and the last n % 32 elements, take the scalar code); AVX2: gathers.
inline void blockwise8_codes(const float* in, int64_t n, float scale, const float* map, uint8_t* codes) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 half = _mm512_set1_ps(0.5f);
  if (const float* tree = kernels::blockwise8_tree_of(map); tree != nullptr) {
    __m512 t[16];
    for (int k = 0; k < 16; ++k) {
      t[k] = _mm512_loadu_ps(tree + 16 * k);
    }
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i bit5 = _mm512_set1_epi32(32);
    const __m512i bit6 = _mm512_set1_epi32(64);
    const __m512 map_last = _mm512_set1_ps(map[kernels::kQuantBlock - 1]);
    // Two vectors of 16 at a time: the search is a chain of dependent permutes and compares, so two independent
    // chains side by side keep the permute and compare units busy.
    struct Lanes {
      __m512 x;
      __m512 down;  // map[code]
      __m512 up;    // map[code + 1]
      __m512i node;
    };
    auto level = [&](Lanes& v, const __m512 threshold) {
      const __mmask16 ge = _mm512_cmp_ps_mask(v.x, threshold, _CMP_GE_OQ);
      v.down = _mm512_mask_mov_ps(v.down, ge, threshold);
      v.up = _mm512_mask_mov_ps(threshold, ge, v.up);
      v.node = _mm512_mask_add_epi32(_mm512_add_epi32(v.node, v.node), ge, _mm512_add_epi32(v.node, v.node), one);
    };
    auto levels_64_127 = [&](const __m512i node) {
      const __mmask16 hi = _mm512_test_epi32_mask(node, bit5);
      return _mm512_mask_mov_ps(_mm512_permutex2var_ps(t[4], node, t[5]), hi, _mm512_permutex2var_ps(t[6], node, t[7]));
    };
    auto levels_128_255 = [&](const __m512i node) {
      const __mmask16 hi5 = _mm512_test_epi32_mask(node, bit5);
      const __mmask16 hi6 = _mm512_test_epi32_mask(node, bit6);
      const __m512 lo =
          _mm512_mask_mov_ps(_mm512_permutex2var_ps(t[8], node, t[9]), hi5, _mm512_permutex2var_ps(t[10], node, t[11]));
      const __m512 hi = _mm512_mask_mov_ps(_mm512_permutex2var_ps(t[12], node, t[13]), hi5,
                                           _mm512_permutex2var_ps(t[14], node, t[15]));
      return _mm512_mask_mov_ps(lo, hi6, hi);
    };
    auto finish = [&](const Lanes& v, uint8_t* out) {
      __m512i code = _mm512_sub_epi32(v.node, _mm512_set1_epi32(kernels::kQuantBlock));
      const __m512i code_up = _mm512_min_epi32(_mm512_add_epi32(code, one), _mm512_set1_epi32(255));
      const __mmask16 round_up =
          _mm512_cmp_ps_mask(_mm512_sub_ps(v.x, v.down), _mm512_mul_ps(_mm512_sub_ps(v.up, v.down), half), _CMP_GE_OQ);
      code = _mm512_mask_mov_epi32(code, round_up, code_up);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(code));
    };
    const __m512 tree0 = _mm512_set1_ps(tree[0]);
    for (; i + 32 <= n; i += 32) {
      Lanes a{_mm512_div_ps(_mm512_loadu_ps(in + i), s), tree0, map_last, one};
      Lanes b{_mm512_div_ps(_mm512_loadu_ps(in + i + 16), s), tree0, map_last, one};
      for (int l = 0; l < 4; ++l) {  // nodes 1-15: t[0] (vpermps reads the low 4 bits of the node)
        level(a, _mm512_permutexvar_ps(a.node, t[0]));
        level(b, _mm512_permutexvar_ps(b.node, t[0]));
      }
      level(a, _mm512_permutexvar_ps(a.node, t[1]));  // nodes 16-31
      level(b, _mm512_permutexvar_ps(b.node, t[1]));
      level(a, _mm512_permutex2var_ps(t[2], a.node, t[3]));  // nodes 32-63 (the low 5 bits)
      level(b, _mm512_permutex2var_ps(t[2], b.node, t[3]));
      level(a, levels_64_127(a.node));  // bit 5 picks the pair
      level(b, levels_64_127(b.node));
      level(a, levels_128_255(a.node));  // bits 5 and 6 pick the pair
      level(b, levels_128_255(b.node));
      finish(a, codes + i);
      finish(b, codes + i + 16);
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 half = _mm256_set1_ps(0.5f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(in + i), s);
    __m256i code = _mm256_setzero_si256();
    for (int step = 128; step > 0; step /= 2) {
      const __m256i probe = _mm256_add_epi32(code, _mm256_set1_epi32(step));
      const __m256 ge = _mm256_cmp_ps(x, _mm256_i32gather_ps(map, probe, 4), _CMP_GE_OQ);
      code = _mm256_blendv_epi8(code, probe, _mm256_castps_si256(ge));
    }
    const __m256i up = _mm256_min_epi32(_mm256_add_epi32(code, _mm256_set1_epi32(1)), _mm256_set1_epi32(255));
    const __m256 down_value = _mm256_i32gather_ps(map, code, 4);
    const __m256 up_value = _mm256_i32gather_ps(map, up, 4);
    const __m256 round_up = _mm256_cmp_ps(_mm256_sub_ps(x, down_value),
                                          _mm256_mul_ps(_mm256_sub_ps(up_value, down_value), half), _CMP_GE_OQ);
    code = _mm256_blendv_epi8(code, up, _mm256_castps_si256(round_up));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), code);
    for (int k = 0; k < 8; ++k) {
      codes[i + k] = static_cast<uint8_t>(lanes[k]);
    }
  }
#endif
  for (; i < n; ++i) {
    codes[i] = kernels::blockwise8_code(in[i], scale, map);
  }
}

// One state stream of a tensor whose states are not all FP32 (kernels::StateType), read and written a
// quantization block at a time.
struct StateBlockIO {
  kernels::StateType type;
  void* data;        // nullptr: the tensor has no such stream
  int64_t numel;     // of the parameter
  const float* map;  // 8-bit: its dynamic map (signed or unsigned)

  // Elements [b0, b1) of block `blk` into out[0, b1 - b0), as FP32.
  void load(int64_t blk, int64_t b0, int64_t b1, float* out) const {
    if (type == kernels::StateType::kFloat32) {
      std::copy(static_cast<const float*>(data) + b0, static_cast<const float*>(data) + b1, out);
    } else if (type == kernels::StateType::kBFloat16) {
      const auto* bits = static_cast<const uint16_t*>(data);
      for (int64_t i = b0; i < b1; ++i) {
        out[i - b0] = kernels::bf16_bits_to_float(bits[i]);
      }
    } else {
      const auto* codes = static_cast<const uint8_t*>(data);
      float scale;
      std::memcpy(&scale, codes + kernels::blockwise8_blocks(numel) * kernels::kQuantBlock + 4 * blk, 4);
      int64_t i = b0;
#if defined(CPU_CAPABILITY_AVX512)
      // map[code] by permutes from the map held in 16 registers (vpermt2ps picks within a pair of registers, bits
      // 5-7 of the code pick the pair), not by gathers, which are several times slower per element on CPUs with
      // the gather data-sampling mitigation.
      __m512 mv[16];
      for (int k = 0; k < 16; ++k) {
        mv[k] = _mm512_loadu_ps(map + 16 * k);
      }
      const __m512 s = _mm512_set1_ps(scale);
      const __m512i bit5 = _mm512_set1_epi32(32);
      const __m512i bit6 = _mm512_set1_epi32(64);
      const __m512i bit7 = _mm512_set1_epi32(128);
      for (; i + 16 <= b1; i += 16) {
        const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
        const __mmask16 h5 = _mm512_test_epi32_mask(code, bit5);
        const __mmask16 h6 = _mm512_test_epi32_mask(code, bit6);
        const __mmask16 h7 = _mm512_test_epi32_mask(code, bit7);
        __m512 pair[4];
        for (int q = 0; q < 4; ++q) {  // pairs 2q and 2q + 1, picked by bit 5
          pair[q] = _mm512_mask_mov_ps(_mm512_permutex2var_ps(mv[4 * q], code, mv[4 * q + 1]), h5,
                                       _mm512_permutex2var_ps(mv[4 * q + 2], code, mv[4 * q + 3]));
        }
        const __m512 lo = _mm512_mask_mov_ps(pair[0], h6, pair[1]);
        const __m512 hi = _mm512_mask_mov_ps(pair[2], h6, pair[3]);
        _mm512_storeu_ps(out + (i - b0), _mm512_mul_ps(_mm512_mask_mov_ps(lo, h7, hi), s));
      }
#elif defined(CPU_CAPABILITY_AVX2)
      for (; i + 8 <= b1; i += 8) {
        const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
        _mm256_storeu_ps(out + (i - b0), _mm256_mul_ps(_mm256_i32gather_ps(map, code, 4), _mm256_set1_ps(scale)));
      }
#endif
      for (; i < b1; ++i) {
        out[i - b0] = map[codes[i]] * scale;
      }
    }
  }

  // in[0, b1 - b0) back as elements [b0, b1) of block `blk`: FP32 as is, BF16 rounded to nearest even, 8-bit
  // quantized with the block's new absmax.
  void store(int64_t blk, int64_t b0, int64_t b1, const float* in) const {
    if (type == kernels::StateType::kFloat32) {
      std::copy(in, in + (b1 - b0), static_cast<float*>(data) + b0);
    } else if (type == kernels::StateType::kBFloat16) {
      auto* bits = static_cast<uint16_t*>(data);
      for (int64_t i = b0; i < b1; ++i) {
        bits[i] = kernels::bf16_bits_nearest(in[i - b0]);
      }
    } else {
      auto* codes = static_cast<uint8_t*>(data);
      // The largest |x| by vectors (at::vec::maximum propagates NaN); a NaN block is folded again one element at
      // a time, so that the stored NaN is the one absmax_fold (and the CUDA kernel) keeps.
      const int64_t len = b1 - b0;
      VecF vmax_abs(0.f);
      int64_t i = 0;
      for (; i + VecF::size() <= len; i += VecF::size()) {
        vmax_abs = at::vec::maximum(vmax_abs, VecF::loadu(in + i).abs());
      }
      __at_align__ float lanes[VecF::size()];
      vmax_abs.store(lanes);
      float absmax = 0.f;
      for (const float lane : lanes) {
        absmax = kernels::absmax_fold(absmax, lane);
      }
      for (; i < len; ++i) {
        absmax = kernels::absmax_fold(absmax, in[i]);
      }
      if (absmax != absmax) {
        absmax = 0.f;
        for (int64_t k = 0; k < len; ++k) {
          absmax = kernels::absmax_fold(absmax, in[k]);
        }
      }
      const float scale = kernels::blockwise8_scale(absmax);
      std::memcpy(codes + kernels::blockwise8_blocks(numel) * kernels::kQuantBlock + 4 * blk, &scale, 4);
      blockwise8_codes(in, b1 - b0, scale, map, codes + b0);
    }
  }
};

// n elements of T as FP32 and back (rounding once to nearest even), vectorized.
template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// The rounding words of `groups` (<= 64) consecutive groups of 4 elements from group `first`: rounding_words'
// operations (NOTE [Counter-based stochastic rounding]) on the groups side by side, round by round, in a loop the
// compiler vectorizes. out[4 * g + k]: word k of group first + g.
inline void rounding_words_of_block(uint64_t seed, uint32_t step, int64_t first, int groups, uint32_t* out) {
  uint32_t c0[64];
  uint32_t c1[64];
  uint32_t c2[64];
  uint32_t c3[64];
  for (int g = 0; g < groups; ++g) {
    const auto counter = static_cast<uint64_t>(first + g);
    c0[g] = static_cast<uint32_t>(counter);
    c1[g] = static_cast<uint32_t>(counter >> 32);
    c2[g] = step;
    c3[g] = 0u;
  }
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kernels::kPhiloxWeyl0;
      k1 += kernels::kPhiloxWeyl1;
    }
    for (int g = 0; g < groups; ++g) {
      kernels::philox_round(c0[g], c1[g], c2[g], c3[g], k0, k1);
    }
  }
  for (int g = 0; g < groups; ++g) {
    out[4 * g] = c0[g];
    out[4 * g + 1] = c1[g];
    out[4 * g + 2] = c2[g];
    out[4 * g + 3] = c3[g];
  }
}

// NOTE [Weight-block loop]
// The CPU step of a tensor whose weight is kept bit by bit (a BF16 remainder, a Kahan compensation, stochastic
// rounding) or whose exp_avg (momentum buffer) or exp_avg_sq is not FP32 (BF16, 8-bit block-wise): a block of 256
// elements at a time (a quantization block: work items start at multiples of kCpuChunk, a multiple of it). The
// block's weights, grads and moments are widened into FP32 buffers (in L1), the optimizer's vector body runs on them
// (the scalar body with the tail formula from `tail_from` on, NOTE [torch's scalar tail]), then the weights are
// stored as their mode keeps them and the moments as their dtype does. Every element takes the formulas and the
// rounding the CUDA kernels take (NOTE [State-block chunk loop], NOTE [Optimizer chunk loop]): the bits agree.
template <typename T, typename G, typename VecBody, typename ScalarBody>
void weight_block_span(const OptimTensor& t, int64_t begin, int64_t end, int64_t tail_from, float grad_scale,
                       bool write_grads, const VecBody& vec_body_arg, const ScalarBody& scalar_body_arg) {
  constexpr int64_t kBlock = kernels::kQuantBlock;
  constexpr int64_t kWidth = VecF::size();
  static_assert(kCpuChunk % kBlock == 0 && kBlock % kWidth == 0, "work items hold whole blocks of whole vectors");
  const VecBody vec_body = vec_body_arg;  // NOTE [Loop-invariant options]
  const ScalarBody scalar_body = scalar_body_arg;
  T* param = static_cast<T*>(t.param);
  G* grad = static_cast<G*>(t.grad);
  auto* bits = reinterpret_cast<uint16_t*>(param);
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  const bool stochastic = kBf16 && t.sr_seed != nullptr;
  const uint64_t seed = stochastic ? static_cast<uint64_t>(*t.sr_seed) : 0;
  const uint32_t sr_step = stochastic ? static_cast<uint32_t>(*t.step + 1.f) : 0;
  const StateBlockIO m_io{t.exp_avg_type, t.exp_avg, t.numel, kernels::blockwise8_map(true)};
  const StateBlockIO v_io{t.exp_avg_sq_type, t.exp_avg_sq, t.numel, kernels::blockwise8_map(false)};
  float* const vmax = t.max_exp_avg_sq;
  const bool unscale = grad_scale != 1.f;
  write_grads = write_grads && unscale;
  __at_align__ float wb[kBlock];
  __at_align__ float w0b[kBlock];
  __at_align__ float gb[kBlock];
  __at_align__ float mb[kBlock];
  __at_align__ float vb[kBlock];
  __at_align__ float vmb[kBlock];
  // The vector body reads every stream: those the tensor lacks read zeros (their results are not stored).
  for (float* absent :
       {m_io.data == nullptr ? mb : nullptr, v_io.data == nullptr ? vb : nullptr, vmax == nullptr ? vmb : nullptr}) {
    if (absent != nullptr) {
      std::fill(absent, absent + kBlock, 0.f);
    }
  }
  for (int64_t b0 = begin; b0 < end;) {
    const int64_t blk = b0 / kBlock;
    const int64_t b1 = std::min(end, (blk + 1) * kBlock);
    const int64_t len = b1 - b0;
    if (t.master != nullptr) {
      std::copy(t.master + b0, t.master + b1, wb);
    } else if (kBf16 && t.remainder != nullptr) {
      for (int64_t i = 0; i < len; ++i) {
        wb[i] = kernels::join_remainder(bits[b0 + i], t.remainder[b0 + i]);
      }
    } else {
      to_float(param + b0, wb, len);
    }
    std::copy(wb, wb + len, w0b);
    to_float(grad + b0, gb, len);
    if (unscale) {
      for (int64_t i = 0; i < len; ++i) {
        gb[i] = gb[i] / grad_scale;
      }
      if (write_grads) {
        from_float(gb, grad + b0, len);
      }
    }
    if (m_io.data != nullptr) {
      m_io.load(blk, b0, b1, mb);
    }
    if (v_io.data != nullptr) {
      v_io.load(blk, b0, b1, vb);
    }
    if (vmax != nullptr) {
      std::copy(vmax + b0, vmax + b1, vmb);
    }
    // The optimizer's formulas: vectors up to the tail, the scalar body on the rest.
    const int64_t vec_len = std::clamp<int64_t>(tail_from - b0, 0, len) / kWidth * kWidth;
    int64_t i = 0;
    for (; i < vec_len; i += kWidth) {
      VecF w = VecF::loadu(wb + i);
      VecF m = VecF::loadu(mb + i);
      VecF v = VecF::loadu(vb + i);
      VecF vm = VecF::loadu(vmb + i);
      vec_body(w, VecF::loadu(gb + i), m, v, vmax != nullptr ? &vm : nullptr);
      w.store(wb + i);
      m.store(mb + i);
      v.store(vb + i);
      if (vmax != nullptr) {
        vm.store(vmb + i);
      }
    }
    for (; i < len; ++i) {
      scalar_body(wb[i], gb[i], m_io.data != nullptr ? &mb[i] : nullptr, v_io.data != nullptr ? &vb[i] : nullptr,
                  vmax != nullptr ? &vmb[i] : nullptr, b0 + i >= tail_from);
    }
    // The weights as their mode keeps them.
    if (t.master != nullptr) {
      std::copy(wb, wb + len, t.master + b0);
      from_float(wb, param + b0, len);
    } else if (kBf16 && t.remainder != nullptr) {
      for (int64_t k = 0; k < len; ++k) {
        kernels::split_remainder(wb[k], &bits[b0 + k], &t.remainder[b0 + k]);
      }
    } else if (kBf16 && t.kahan_comp != nullptr) {
      for (int64_t k = 0; k < len; ++k) {
        kernels::kahan_store(w0b[k], wb[k], &bits[b0 + k], &t.kahan_comp[b0 + k]);
      }
    } else if (stochastic) {
      // Blocks start at multiples of 4: word k of the block is element b0 + k's.
      __at_align__ uint32_t words[kBlock];
      rounding_words_of_block(seed, sr_step, b0 / 4, static_cast<int>((len + 3) / 4), words);
      for (int64_t k = 0; k < len; ++k) {
        bits[b0 + k] = kernels::bf16_bits_stochastic(wb[k], words[k]);
      }
    } else {
      from_float(wb, param + b0, len);
    }
    if (m_io.data != nullptr) {
      m_io.store(blk, b0, b1, mb);
    }
    if (v_io.data != nullptr) {
      v_io.store(blk, b0, b1, vb);
    }
    if (vmax != nullptr) {
      std::copy(vmb, vmb + len, vmax + b0);
    }
    b0 = b1;
  }
}

// Runs `vec_body(w, g, m, v, vmax)` on pairs of float vectors over elements [begin, end) of t, then
// `scalar_body(w, g, m, v, vmax, tail)` on what is left, and stores the weight (and the master) back. Elements
// from `tail_from` on (NOTE [torch's scalar tail]) always take the scalar body with tail = true. With
// `write_grads`, the unscaled grads are stored back into t.grad.
// kMaster, kM, kV, kVmax: which of the master, exp_avg (momentum buffer), exp_avg_sq and max_exp_avg_sq streams
// the tensor has, as template arguments so that the vector loop tests none of them (dispatch_span picks them).
template <typename T, typename G, bool kMaster, bool kM, bool kV, bool kVmax, typename VecBody, typename ScalarBody>
void optim_span(const OptimTensor& t, int64_t begin, int64_t end, int64_t tail_from, float grad_scale, bool write_grads,
                const VecBody& vec_body_arg, const ScalarBody& scalar_body_arg) {
  // Local copies of the bodies (NOTE [Loop-invariant options]).
  const VecBody vec_body = vec_body_arg;
  const ScalarBody scalar_body = scalar_body_arg;
  static_assert(at::vec::Vectorized<T>::size() == 2 * VecF::size() || std::is_same_v<T, float>);
  // Float vectors per iteration: two for FP16/BF16 parameters (one vector of theirs widens to two), one for FP32
  // (every stream then loads one vector, as torch's loop does, and a tensor's vector part ends one vector later).
  // An FP32 grad of a 2-byte parameter loads as two vectors of FP32.
  constexpr int kVecs = std::is_same_v<T, float> ? 1 : 2;
  constexpr int64_t kStep = kVecs * VecF::size();
  T* param = static_cast<T*>(t.param);
  G* grad = static_cast<G*>(t.grad);  // T, or FP32 (NOTE [FP32 grads of low-precision params])
  float* const master = kMaster ? t.master : nullptr;
  float* const m = kM ? t.exp_avg : nullptr;
  float* const v = kV ? t.exp_avg_sq : nullptr;
  float* const vmax = kVmax ? t.max_exp_avg_sq : nullptr;
  const VecF scale(grad_scale);
  const bool unscale = grad_scale != 1.f;
  write_grads = write_grads && unscale;
  // The grad of element i, unscaled (and stored back when asked).
  auto scalar_grad = [&](int64_t i) {
    float g = static_cast<float>(grad[i]);
    if (unscale) {
      g = g / grad_scale;
      if (write_grads) {
        grad[i] = static_cast<G>(g);
      }
    }
    return g;
  };
  const int64_t vec_end = std::min(end, tail_from);
  int64_t i = begin;
  for (; i + kStep <= vec_end; i += kStep) {
    VecF w[kVecs], g[kVecs], mv[kVecs], vv[kVecs], vm[kVecs];
    if constexpr (kMaster) {
      loadn<kVecs>(master + i, w);
    } else {
      loadn<kVecs>(param + i, w);
    }
    loadn<kVecs>(grad + i, g);
    if (unscale) {
      for (int h = 0; h < kVecs; ++h) {
        g[h] = g[h] / scale;
      }
      if (write_grads) {
        storen<kVecs>(grad + i, g);
      }
    }
    if constexpr (kM) {
      loadn<kVecs>(m + i, mv);
    }
    if constexpr (kV) {
      loadn<kVecs>(v + i, vv);
    }
    if constexpr (kVmax) {
      loadn<kVecs>(vmax + i, vm);
    }
    for (int h = 0; h < kVecs; ++h) {
      vec_body(w[h], g[h], mv[h], vv[h], vmax != nullptr ? &vm[h] : nullptr);
    }
    if constexpr (kM) {
      storen<kVecs>(m + i, mv);
    }
    if constexpr (kV) {
      storen<kVecs>(v + i, vv);
    }
    if constexpr (kVmax) {
      storen<kVecs>(vmax + i, vm);
    }
    if constexpr (kMaster) {
      storen<kVecs>(master + i, w);
    }
    storen<kVecs>(param + i, w);
  }
  for (; i < end; ++i) {
    float w1 = master != nullptr ? master[i] : static_cast<float>(param[i]);
    const float g1 = scalar_grad(i);
    scalar_body(w1, g1, m != nullptr ? m + i : nullptr, v != nullptr ? v + i : nullptr,
                vmax != nullptr ? vmax + i : nullptr, i >= tail_from);
    if constexpr (kMaster) {
      master[i] = w1;
    }
    param[i] = static_cast<T>(w1);
  }
}

// The per-tensor factors of a step, make(step) for the step number each tensor reaches; a tensor at the step of the
// tensor before it shares its factors (the tensors of a step mostly do: the pow calls once per run of them).
template <typename Factors, typename Make>
std::vector<Factors> step_factors(const OptimTensor* tensors, int64_t n, const Make& make) {
  std::vector<Factors> factors(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const float step = *tensors[t].step + 1.f;
    factors[t] = t > 0 && *tensors[t - 1].step + 1.f == step ? factors[t - 1] : make(step);
  }
  return factors;
}

// NOTE [FP32 grads of low-precision params] (kernels/common.h).
// Calls f(T{}, G{}) with T the parameter's element type and G the grad's: (Half, Half), (Half, float),
// (BFloat16, BFloat16), (BFloat16, float) or (float, float).
template <typename F>
void with_param_and_grad_types(const OptimTensor& t, const F& f) {
  auto low_precision = [&](auto param_zero) {  // a 2-byte parameter: its grad in its type or in FP32
    using T = decltype(param_zero);
    if (t.grad_fp32) {
      f(T{}, float{});
    } else {
      f(T{}, T{});
    }
  };
  switch (t.dtype) {
    case DType::kFloat16:
      low_precision(c10::Half{});
      break;
    case DType::kBFloat16:
      low_precision(c10::BFloat16{});
      break;
    default:
      f(float{}, float{});
      break;
  }
}

// Streams an algorithm's tensors may have: Adam (exp_avg and exp_avg_sq always; a master and max_exp_avg_sq
// optional) or SGD (a master and a momentum buffer optional).
enum class Streams { kAdam, kSgd };

// Calls f(std::true_type{}) or f(std::false_type{}): a run-time flag as a template argument.
template <typename F>
void with_flag(bool flag, const F& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename T, typename G, Streams kStreams, typename VecBody, typename ScalarBody>
void span_with_streams(const OptimTensor& t, int64_t begin, int64_t end, int64_t tail_from, float grad_scale,
                       bool write_grads, const VecBody& vec_body, const ScalarBody& scalar_body) {
  constexpr bool kAdam = kStreams == Streams::kAdam;
  // Adam: the master and max_exp_avg_sq vary; SGD: the master and the momentum buffer (exp_avg).
  const bool second = kAdam ? t.max_exp_avg_sq != nullptr : t.exp_avg != nullptr;
  with_flag(t.master != nullptr, [&](auto master) {
    with_flag(second, [&](auto other) {
      constexpr bool kOther = decltype(other)::value;
      optim_span<T, G, decltype(master)::value, kAdam || kOther, kAdam, kAdam && kOther>(
          t, begin, end, tail_from, grad_scale, write_grads, vec_body, scalar_body);
    });
  });
}

template <Streams kStreams, typename VecBody, typename ScalarBody>
void dispatch_span(const OptimTensor& t, int64_t begin, int64_t end, int tail_width, float grad_scale, bool write_grads,
                   const VecBody& vec_body, const ScalarBody& scalar_body) {
  const int64_t tail_from = kernels::tail_start(t.numel, tail_width);
  // NOTE [Weight-block loop]: a weight kept bit by bit, or moments in BF16 or 8 bits.
  const bool blocks = t.remainder != nullptr || t.kahan_comp != nullptr || t.sr_seed != nullptr ||
                      t.exp_avg_type != kernels::StateType::kFloat32 ||
                      t.exp_avg_sq_type != kernels::StateType::kFloat32;
  with_param_and_grad_types(t, [&](auto param_zero, auto grad_zero) {
    using T = decltype(param_zero);
    using G = decltype(grad_zero);
    if (blocks) {
      weight_block_span<T, G>(t, begin, end, tail_from, grad_scale, write_grads, vec_body, scalar_body);
    } else {
      span_with_streams<T, G, kStreams>(t, begin, end, tail_from, grad_scale, write_grads, vec_body, scalar_body);
    }
  });
}

}  // namespace

void adam_step(const OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale) {
  const kernels::AdamOp op{params};
  const auto factors = step_factors<kernels::AdamStepFactors>(
      tensors, n, [&](float step) { return kernels::AdamStepFactors::at_step(params, params.lr, step); });
  // Grads are divided by the scale, as torch's fused kernels do.
  // Optimizer steps do ~20 flops per element: worth threads from a quarter of the unscale's threshold.
  for_all_chunks(
      n, [&](int64_t t) { return tensors[t].numel; }, kCpuParallelThreshold / 4,
      [&](size_t, const WorkItem& w) {
        // Local copies (NOTE [Loop-invariant options]).
        const kernels::AdamOp local = op;
        const kernels::AdamStepFactors f = factors[w.tensor];
        dispatch_span<Streams::kAdam>(
            tensors[w.tensor], w.begin, w.end, params.tail_width, grad_scale, params.write_unscaled_grads,
            [local, f](VecF& w, VecF g, VecF& m, VecF& v, VecF* vmax) {
              local.apply<VecF, VecMath>(w, g, m, v, vmax, f);
            },
            [local, f](float& w, float g, float* m, float* v, float* vmax, bool tail) {
              local(w, g, *m, *v, vmax, f, tail);
            });
      });
  for (int64_t t = 0; t < n; ++t) {
    *tensors[t].step += 1.f;
  }
}

void sgd_step(const OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale) {
  const kernels::SgdOp op{params};
  for_all_chunks(
      n, [&](int64_t t) { return tensors[t].numel; }, kCpuParallelThreshold / 4,
      [&](size_t, const WorkItem& w) {
        // NOTE [Loop-invariant options]
        // The loops store vectors through the intrinsics' unaligned store types, which are declared may_alias: the
        // compiler must assume that each store may change anything it reads through memory (the op's options, the
        // step factors, a lambda's captured references) and reloads and re-tests every option on every iteration.
        // The bodies therefore capture local copies by value, and optim_span runs its own copies of the bodies, whose
        // addresses never escape: the options stay in registers and their tests leave the loop.
        const kernels::SgdOp local = op;
        const bool first = tensors[w.tensor].step == nullptr || *tensors[w.tensor].step == 0.f;
        dispatch_span<Streams::kSgd>(
            tensors[w.tensor], w.begin, w.end, params.tail_width, grad_scale, params.write_unscaled_grads,
            [local, first](VecF& w, VecF g, VecF& buf, VecF&, VecF*) { local.apply<VecF, VecMath>(w, g, &buf, first); },
            [local, first](float& w, float g, float* buf, float*, float*, bool tail) {
              local(w, g, buf, first, tail);
            });
      });
  for (int64_t t = 0; t < n; ++t) {
    if (tensors[t].step != nullptr) {
      *tensors[t].step += 1.f;
    }
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
