// The formulas of FP8 training, one functor or function each, shared by the CPU loops and the CUDA kernels: the
// saturating FP32 -> FP8 conversion (E4M3FN, E5M2), the amax accumulation, the scale from an amax (Transformer
// Engine's semantics) and the delayed-scaling update of one amax history column.
#pragma once

#include "common.h"

namespace ampkit::kernels {

// The two FP8 formats of the OCP 8-bit floating point specification that FP8 training uses.
enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1 };

// Largest finite values: E4M3FN 448 (S.1111.110), E5M2 57344 (S.11110.11).
constexpr float kFp8E4M3Max = 448.f;
constexpr float kFp8E5M2Max = 57344.f;
constexpr float kFloatMax = 3.40282347e+38f;

// NOTE [Saturating FP8 cast]
// v -> FP8 with one rounding to nearest-even; a value beyond the format's largest finite one, and +-Inf, become
// +-max (the saturation of the hardware's cvt.rn.satfinite and Transformer Engine's casts; torch's eager CPU cast
// sends E5M2 overflows to Inf instead); NaN stays NaN (0x7F with v's sign). The conversion is done here in integer
// arithmetic and one correctly rounded FP32 addition, so the CPU loops and the CUDA kernels (any architecture, and
// the emulated build) produce the same bits. Callers compute v = fp8_scaled(x, scale) first (x * scale in FP32, a
// NaN product signed by x); the amax they report comes from x itself (fp8_abs_bits), so a non-finite input is
// visible in the amax even though the cast saturates it.
// Written without branches (selects only), so that a CPU loop vectorizes and a warp never diverges:
//   normal FP8 values: round the FP32 bits to nearest-even at the FP8 mantissa's last bit, rebias the exponent;
//   FP8 subnormals (|v| below the smallest normal): |v| + 2^(24 - bias - mantissa bits), whose FP32 ulp is the
//     FP8 subnormal unit, so the FP32 addition rounds to nearest-even there and the low bits are the code (an FP32
//     subnormal |v| rounds to 0 with or without flush-to-zero);
//   then saturation and NaN, as above. Checked equal, on all 2^32 inputs of both formats, to the same conversion
//   written with branches (field by field: exponent, mantissa, the rounding bits).
template <Fp8Format F>
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint8_t fp8_from_float(float v) {
  constexpr int kMantissa = F == Fp8Format::kE4M3 ? 3 : 2;
  constexpr int kBias = F == Fp8Format::kE4M3 ? 7 : 15;
  constexpr uint32_t kMaxCode = F == Fp8Format::kE4M3 ? 0x7Eu : 0x7Bu;
  constexpr float kMax = F == Fp8Format::kE4M3 ? kFp8E4M3Max : kFp8E5M2Max;
  constexpr int kDrop = 23 - kMantissa;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr float kSubnormalMagic = F == Fp8Format::kE4M3 ? 16384.f : 128.f;  // 2^(24 - kBias - kMantissa)
  const uint32_t bits = bit_cast<uint32_t>(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7fffffffu;
  const uint32_t rounded = abs_bits + ((1u << (kDrop - 1)) - 1u) + ((abs_bits >> kDrop) & 1u);
  const uint32_t normal = (rounded >> kDrop) - (static_cast<uint32_t>(127 - kBias) << kMantissa);
  const uint32_t subnormal =
      bit_cast<uint32_t>(bit_cast<float>(abs_bits) + kSubnormalMagic) - bit_cast<uint32_t>(kSubnormalMagic);
  uint32_t code = abs_bits < kMinNormalBits ? subnormal : normal;
  code = abs_bits > bit_cast<uint32_t>(kMax) ? kMaxCode : code;  // finite overflow and Inf saturate
  code = abs_bits > 0x7f800000u ? 0x7Fu : code;                  // NaN
  return static_cast<uint8_t>(sign | code);
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE uint8_t fp8_from_float(float v, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? fp8_from_float<Fp8Format::kE4M3>(v) : fp8_from_float<Fp8Format::kE5M2>(v);
}

// The FP32 value of an FP8 code, exact (every E4M3FN and E5M2 value is an FP32 value): E4M3FN has no Inf, its
// S.1111.111 is NaN; E5M2's top exponent holds +-Inf and NaN, as IEEE's. NaN comes back quiet, with the code's sign.
template <Fp8Format F>
AMPKIT_HOST_DEVICE AMPKIT_INLINE float fp8_to_float(uint8_t code) {
  constexpr int kMantissa = F == Fp8Format::kE4M3 ? 3 : 2;
  constexpr int kBias = F == Fp8Format::kE4M3 ? 7 : 15;
  constexpr uint32_t kTopExponent = F == Fp8Format::kE4M3 ? 15u : 31u;
  // The subnormal unit 2^(1 - kBias - kMantissa): 2^-9 (E4M3FN), 2^-16 (E5M2).
  constexpr float kSubnormalUnit = F == Fp8Format::kE4M3 ? 1.f / 512.f : 1.f / 65536.f;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code & 0x7fu) >> kMantissa;
  const uint32_t mantissa = code & ((1u << kMantissa) - 1u);
  if (exponent == kTopExponent && (F == Fp8Format::kE5M2 || mantissa == (1u << kMantissa) - 1u)) {
    return bit_cast<float>(sign | (F == Fp8Format::kE5M2 && mantissa == 0 ? 0x7f800000u : 0x7fc00000u));
  }
  if (exponent == 0) {
    return bit_cast<float>(sign | bit_cast<uint32_t>(static_cast<float>(mantissa) * kSubnormalUnit));
  }
  const uint32_t biased = static_cast<uint32_t>(static_cast<int>(exponent) - kBias + 127);
  return bit_cast<float>(sign | (biased << 23) | (mantissa << (23 - kMantissa)));
}

// x * scale for fp8_quantize, one FP32 rounding; a NaN product becomes the quiet NaN with x's sign. (Which NaN a
// product of two NaNs returns, or 0 * Inf's sign, is the hardware's choice: x86 returns the first operand, which
// the compiler may swap, and its default NaN is negative; CUDA returns one canonical NaN. FP8 keeps only the sign.)
AMPKIT_HOST_DEVICE AMPKIT_INLINE float fp8_scaled(float x, float scale) {
  const uint32_t v = bit_cast<uint32_t>(x * scale);
  const uint32_t nan = (bit_cast<uint32_t>(x) & 0x80000000u) | 0x7fc00000u;
  return bit_cast<float>((v & 0x7fffffffu) > 0x7f800000u ? nan : v);
}

// One element of fp8_quantize: fp8_scaled, then the saturating cast.
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint8_t fp8_quantize_value(float x, float scale, Fp8Format format) {
  return fp8_from_float(fp8_scaled(x, scale), format);
}

// |x| as FP32 bits for an amax taken as an unsigned maximum: every NaN becomes the canonical 0x7fc00000, above
// +Inf's 0x7f800000, so a maximum over these bits is NaN if any element is NaN, and otherwise max |x| (the order of
// the elements never matters: CPU threads and CUDA blocks agree bit for bit).
AMPKIT_HOST_DEVICE AMPKIT_INLINE uint32_t fp8_abs_bits(float x) {
  const uint32_t a = bit_cast<uint32_t>(x) & 0x7fffffffu;
  return a > 0x7f800000u ? 0x7fc00000u : a;
}

// NOTE [FP8 scale]
// The scale that maps an amax onto the format's range (Transformer Engine's compute_scale_from_amax and its
// delayed-scaling default):
//   a = max(amax, epsilon)                 (a NaN amax stays NaN)
//   a == 0, Inf or NaN  -> fallback         (1 for current scaling, the previous scale for delayed scaling)
//   scale = (fp8_max / a) / margin_divisor  (margin_divisor = 2^margin, formed by the caller in double)
//   scale Inf           -> FLT_MAX
//   power_of_2          -> scale rounded down to a power of two (exponent bits kept, mantissa cleared), unless
//                          that would give 0 (a subnormal scale is kept as it is)
// Every step is one FP32 operation, correctly rounded on the CPU and on CUDA (no fast-math, no contraction).
struct Fp8ScaleOp {
  float fp8_max;
  float margin_divisor = 1.f;
  float epsilon = 0.f;
  bool power_of_2 = false;

  AMPKIT_HOST_DEVICE float operator()(float amax, float fallback) const {
    float a = amax < epsilon ? epsilon : amax;
    if (a == 0.f || is_non_finite(a)) {
      return fallback;
    }
    float scale = (fp8_max / a) / margin_divisor;
    if (is_non_finite(scale)) {
      scale = kFloatMax;
    }
    if (power_of_2) {
      const uint32_t rounded = bit_cast<uint32_t>(scale) & 0xff800000u;
      if ((rounded & 0x7f800000u) != 0) {
        scale = bit_cast<float>(rounded);
      }
    }
    return scale;
  }
};

// NOTE [Delayed scaling update]
// One column of an amax history (rows x columns, row-major FP32; row 0 collects the current iteration's amax) and
// its scale, as Transformer Engine's delayed scaling updates them at the end of an iteration:
//   amax  = row 0 (most_recent) or the maximum over every row (max; NaN if any row is NaN, fp8_abs_bits)
//   scale = Fp8ScaleOp(amax, fallback = the previous scale)  (a 0, Inf or NaN amax keeps the scale)
//   then the column rolls by -1 (row r takes row r + 1, the last row takes row 0) and row 0 is zeroed,
// so the scale used in iteration i comes from the amaxes recorded before iteration i.
struct Fp8HistoryOp {
  Fp8ScaleOp scale_op;
  int64_t rows;
  bool most_recent;

  // The amax of the column starting at `history` (stride: the number of columns).
  AMPKIT_HOST_DEVICE float amax(const float* history, int64_t stride) const {
    if (most_recent) {
      return history[0];
    }
    uint32_t m = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t b = fp8_abs_bits(history[r * stride]);
      m = b > m ? b : m;
    }
    return bit_cast<float>(m);
  }

  // Updates one column and its scale in place.
  AMPKIT_HOST_DEVICE void operator()(float* history, int64_t stride, float* scale) const {
    *scale = scale_op(amax(history, stride), *scale);
    const float first = history[0];
    for (int64_t r = 0; r + 1 < rows; ++r) {
      history[r * stride] = history[(r + 1) * stride];
    }
    history[(rows - 1) * stride] = first;
    history[0] = 0.f;
  }
};

// The arguments of one fp8_quantize pass: x (dense, rows x cols, FP32, BF16 or FP16) times its scale (one FP32
// value, or one per row when rowwise) cast to `format` into q (rows x cols) and, when q_t is not null, into q_t
// (cols x rows, the transpose); *amax (zeroed by the caller) receives max |x| (fp8_abs_bits: NaN if any is NaN).
struct Fp8QuantizeParams {
  const void* x;
  DType dtype;
  int64_t rows;
  int64_t cols;
  const float* scale;
  bool rowwise;
  uint8_t* q;
  uint8_t* q_t;
  float* amax;
  Fp8Format format;
};

}  // namespace ampkit::kernels
