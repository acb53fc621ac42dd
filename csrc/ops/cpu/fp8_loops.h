// CPU loop of fp8_quantize (NOTE [Saturating FP8 cast] in kernels/fp8_functors.h): rows of x times their scale,
// cast to FP8 kWidth elements at a time by the functor's own integer and FP32 operations written on vectors, the
// amax as an unsigned maximum of fp8_abs_bits, and the transposed copy in 8 x 8 byte blocks. Compiled once per
// instruction set like unscale_loops.h; fp8_cpu.cpp runs it over row ranges on at::parallel_for.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../../kernels/fp8_functors.h"
#include "cpu_loops.h"
#include "vec_ext.h"
#include "vec_io.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

// Elements of a row converted to FP32 at a time (a 2-byte row is staged in L1 through at::vec's conversions).
constexpr int kFp8Span = 512;
static_assert(kFp8Span % (2 * VecF::size()) == 0 && kFp8Span % kWidth == 0);

// kernels::fp8_from_float<F> on kWidth lanes: the same operations in the same order, so the same bits (passed
// by reference: no function takes or returns a vector by value, an ABI that differs between the copies).
template <kernels::Fp8Format F>
[[gnu::always_inline]] inline void fp8_codes(const VW& bits, VW& code) {
  constexpr int kMantissa = F == kernels::Fp8Format::kE4M3 ? 3 : 2;
  constexpr int kBias = F == kernels::Fp8Format::kE4M3 ? 7 : 15;
  constexpr uint32_t kMaxCode = F == kernels::Fp8Format::kE4M3 ? 0x7Eu : 0x7Bu;
  constexpr float kMax = F == kernels::Fp8Format::kE4M3 ? kernels::kFp8E4M3Max : kernels::kFp8E5M2Max;
  constexpr int kDrop = 23 - kMantissa;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr float kSubnormalMagic = F == kernels::Fp8Format::kE4M3 ? 16384.f : 128.f;
  const VW sign = (bits >> 24) & 0x80u;
  const VW abs_bits = bits & 0x7fffffffu;
  const VW rounded = abs_bits + ((1u << (kDrop - 1)) - 1u) + ((abs_bits >> kDrop) & 1u);
  const VW normal = (rounded >> kDrop) - (static_cast<uint32_t>(127 - kBias) << kMantissa);
  const VF magic_sum = __builtin_bit_cast(VF, abs_bits) + kSubnormalMagic;
  const VW subnormal = __builtin_bit_cast(VW, magic_sum) - c10::bit_cast<uint32_t>(kSubnormalMagic);
  VW c = abs_bits < kMinNormalBits ? subnormal : normal;
  c = abs_bits > c10::bit_cast<uint32_t>(kMax) ? VW{} + kMaxCode : c;
  c = abs_bits > 0x7f800000u ? VW{} + 0x7Fu : c;
  code = sign | c;
}

// q[0, n) from x[0, n) (FP32) times s (kernels::fp8_quantize_value); amax_lanes takes the lanes' maximum of
// fp8_abs_bits(x).
template <kernels::Fp8Format F>
void fp8_span(const float* x, int64_t n, float s, uint8_t* q, VW& amax_lanes) {
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    VF v;
    std::memcpy(&v, x + i, sizeof(v));
    VW a = __builtin_bit_cast(VW, v) & 0x7fffffffu;
    a = a > 0x7f800000u ? VW{} + 0x7fc00000u : a;  // kernels::fp8_abs_bits
    amax_lanes = a > amax_lanes ? a : amax_lanes;
    // kernels::fp8_scaled: a NaN product takes x's sign.
    const VW scaled = __builtin_bit_cast(VW, v * s);
    const VW nan = (__builtin_bit_cast(VW, v) & 0x80000000u) | 0x7fc00000u;
    VW code;
    fp8_codes<F>((scaled & 0x7fffffffu) > 0x7f800000u ? nan : scaled, code);
    const VB bytes = __builtin_convertvector(code, VB);
    std::memcpy(q + i, &bytes, sizeof(bytes));
  }
  uint32_t amax = 0;
  for (; i < n; ++i) {
    const uint32_t b = kernels::fp8_abs_bits(x[i]);
    amax = b > amax ? b : amax;
    q[i] = kernels::fp8_from_float<F>(kernels::fp8_scaled(x[i], s));
  }
  amax_lanes[0] = std::max(amax_lanes[0], amax);
}

// The 8 x 8 bytes at src (row stride src_stride) transposed into dst (row stride dst_stride): each row a 64-bit
// word, three rounds of masked swaps (2 x 2 blocks of bytes, then of 16-bit pairs, then of 32-bit quads).
inline void transpose8x8(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride) {
  uint64_t w[8];
  for (int r = 0; r < 8; ++r) {
    std::memcpy(&w[r], src + r * src_stride, 8);
  }
  auto swap = [&](int a, int b, int shift, uint64_t mask) {  // w[a]'s high parts with w[b]'s low ones (little-endian)
    const uint64_t t = ((w[a] >> shift) ^ w[b]) & mask;
    w[b] ^= t;
    w[a] ^= t << shift;
  };
  for (int r = 0; r < 8; r += 2) {
    swap(r, r + 1, 8, 0x00ff00ff00ff00ffull);
  }
  for (int r : {0, 1, 4, 5}) {
    swap(r, r + 2, 16, 0x0000ffff0000ffffull);
  }
  for (int r = 0; r < 4; ++r) {
    swap(r, r + 4, 32, 0x00000000ffffffffull);
  }
  for (int r = 0; r < 8; ++r) {
    std::memcpy(dst + r * dst_stride, &w[r], 8);
  }
}

// Rows [begin, end) of q into q_t (cols x rows): 8 x 8 blocks, the edges byte by byte. Every block lies inside
// the range, so threads writing other ranges never store into the same bytes.
inline void transpose_rows(const kernels::Fp8QuantizeParams& p, int64_t begin, int64_t end) {
  const int64_t rows8 = begin + (end - begin) / 8 * 8;
  const int64_t cols8 = p.cols / 8 * 8;
  constexpr int64_t kTile = 64;  // columns per pass: the source rows stay in L1
  for (int64_t c0 = 0; c0 < cols8; c0 += kTile) {
    const int64_t c1 = std::min(c0 + kTile, cols8);
    for (int64_t r = begin; r < rows8; r += 8) {
      for (int64_t c = c0; c < c1; c += 8) {
        transpose8x8(p.q + r * p.cols + c, p.cols, p.q_t + c * p.rows + r, p.rows);
      }
    }
  }
  for (int64_t r = begin; r < end; ++r) {  // the last rows % 8 rows and the last cols % 8 columns
    const int64_t from = r < rows8 ? cols8 : 0;
    for (int64_t c = from; c < p.cols; ++c) {
      p.q_t[c * p.rows + r] = p.q[r * p.cols + c];
    }
  }
}

// Rows quantized before their transposed copy is written from them: about 64 KiB of q, a multiple of 8 rows (so
// that only a range's last pass has rows past the last 8 x 8 block), still in L2 when the transpose reads them.
inline int64_t fp8_rows_per_pass(int64_t cols) {
  return std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(cols, 1) / 8 * 8);
}

template <typename T, kernels::Fp8Format F>
uint32_t fp8_quantize_rows_of(const kernels::Fp8QuantizeParams& p, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(p.x);
  VW amax_lanes = {};
  alignas(64) float staged[std::is_same_v<T, float> ? 1 : kFp8Span];
  const int64_t pass = fp8_rows_per_pass(p.cols);
  for (int64_t r0 = begin; r0 < end; r0 += pass) {
    const int64_t r1 = std::min(end, r0 + pass);
    for (int64_t r = r0; r < r1; ++r) {
      const float s = p.scale[p.rowwise ? r : 0];
      for (int64_t c0 = 0; c0 < p.cols; c0 += kFp8Span) {
        const int64_t len = std::min<int64_t>(kFp8Span, p.cols - c0);
        const T* row = x + r * p.cols + c0;
        const float* xs;
        if constexpr (std::is_same_v<T, float>) {
          xs = row;
        } else {
          row_as_float(row, len, staged);
          xs = staged;
        }
        fp8_span<F>(xs, len, s, p.q + r * p.cols + c0, amax_lanes);
      }
    }
    if (p.q_t != nullptr) {
      transpose_rows(p, r0, r1);
    }
  }
  uint32_t amax = 0;
  for (int k = 0; k < kWidth; ++k) {
    amax = std::max(amax, amax_lanes[k]);
  }
  return amax;
}

}  // namespace

uint32_t fp8_quantize_rows(const kernels::Fp8QuantizeParams& p, int64_t begin, int64_t end) {
  const bool e4m3 = p.format == kernels::Fp8Format::kE4M3;
  switch (p.dtype) {
    case kernels::DType::kFloat16:
      return e4m3 ? fp8_quantize_rows_of<c10::Half, kernels::Fp8Format::kE4M3>(p, begin, end)
                  : fp8_quantize_rows_of<c10::Half, kernels::Fp8Format::kE5M2>(p, begin, end);
    case kernels::DType::kBFloat16:
      return e4m3 ? fp8_quantize_rows_of<c10::BFloat16, kernels::Fp8Format::kE4M3>(p, begin, end)
                  : fp8_quantize_rows_of<c10::BFloat16, kernels::Fp8Format::kE5M2>(p, begin, end);
    default:
      return e4m3 ? fp8_quantize_rows_of<float, kernels::Fp8Format::kE4M3>(p, begin, end)
                  : fp8_quantize_rows_of<float, kernels::Fp8Format::kE5M2>(p, begin, end);
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
