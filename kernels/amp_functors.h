// The element-wise formulas of gradient unscaling and loss-scale update, one functor each. The CPU loops and
// the CUDA kernels both call these, so the CPU tests exercise the arithmetic the GPU runs.
#pragma once

#include "common.h"

namespace ampkit::kernels {

// Compute type of an element type: FP32 for FP16/BF16/FP32, FP64 for FP64.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// grad * inv_scale in opmath, skipped entirely when inv_scale is exactly 1 (so a 1.0 scale is a pure check).
// `V` may be a scalar opmath type or a SIMD vector of it that supports `*` and broadcast construction.
//
// Args:
//   inv_scale: the reciprocal of the loss scale, as stored on the device (FP32); for FP64 grads it is
//              widened to double before the multiply, as ATen does.
template <typename opmath>
struct UnscaleOp {
  opmath inv_scale;
  bool identity;

  AMPKIT_HOST_DEVICE explicit UnscaleOp(float inv) : inv_scale(static_cast<opmath>(inv)), identity(inv == 1.f) {}

  template <typename V>
  AMPKIT_HOST_DEVICE V operator()(const V& v) const {
    return identity ? v : v * V(inv_scale);
  }
};

// NOTE [Compressed all-reduce passes]
// The two element-wise passes around a gradient all-reduce in a narrow dtype, each one pass over memory:
//   cast_divide_:            out = Out(float(Out(src)) / divisor)  (torch's hooks: src.to(Out).div_(world_size))
//   cast_unscale_and_check_: y = float(Out(src)); flag y non-finite; out = Out(y * inv_scale)
//                            (out.copy_(src), then unscale_and_check_(out): the same bits)
// `Out(x)` rounds to the output's dtype (nearest even); the arithmetic is FP32. `V` may be float or a SIMD vector
// of floats that supports `*`, `/` and broadcast construction.
struct CastOp {
  float factor;
  bool divide;
  bool identity;  // factor == 1: the value passes unchanged

  // x / 2^k and x * 2^-k are the same real number, so they round alike: a power-of-two divisor (a world size of
  // 2, 4, 8, ...) becomes a multiply, several times cheaper than a division on every CPU and GPU.
  AMPKIT_HOST_DEVICE static CastOp divide_by(float divisor) {
    const uint32_t bits = bit_cast<uint32_t>(divisor);
    const uint32_t exponent = (bits >> 23) & 0xffu;
    if ((bits & 0x807fffffu) == 0 && exponent >= 1 && exponent <= 253) {  // +2^k with 2^-k a normal float
      const float inverse = bit_cast<float>((254u - exponent) << 23);
      return CastOp{inverse, false, divisor == 1.f};
    }
    return CastOp{divisor, true, divisor == 1.f};
  }
  AMPKIT_HOST_DEVICE static CastOp multiply_by(float inv_scale) { return CastOp{inv_scale, false, inv_scale == 1.f}; }

  template <typename V>
  AMPKIT_HOST_DEVICE V operator()(const V& v) const {
    return identity ? v : (divide ? v / V(factor) : v * V(factor));
  }
};

// NOTE [Gradient statistics]
// grad_stats gives, per tensor, one row of kGradStatsColumns FP64 values about the unscaled gradient x * inv_scale:
//   [kStatMaxAbs] max |x * inv_scale| over finite x (0 if none), [kStatNorm] the L2 norm over finite x,
//   [kStatNonFinite] the number of Inf/NaN elements, [kStatZeros] the number of zeros, then kGradHistBins counts of
//   the non-zero finite elements by e = floor(log2 |x * inv_scale|): bin 0 for e < kGradHistMinExp, bin
//   1 + e - kGradHistMinExp for kGradHistMinExp <= e <= kGradHistMaxExp, the last bin for e > kGradHistMaxExp.
//   The range is BF16's whole one, smallest subnormal 2^-133 to largest finite 2^127.99 (FP32's normals, whose
//   subnormals reach 2^-149, count below it), which holds FP16's (2^-24 to 2^15.99). |x| * inv_scale is formed in double, where it is exact.
// Counts, the maximum and the histogram do not depend on the order of the elements; the L2 norm does, so its order
// is fixed (NOTE [Deterministic norm]).
constexpr int kStatMaxAbs = 0;
constexpr int kStatNorm = 1;
constexpr int kStatNonFinite = 2;
constexpr int kStatZeros = 3;
constexpr int kGradHistMinExp = -133;
constexpr int kGradHistMaxExp = 127;
constexpr int kGradHistBins = kGradHistMaxExp - kGradHistMinExp + 3;
constexpr int kGradStatsColumns = 4 + kGradHistBins;

// The histogram bin of |x| * inv_scale for a non-zero finite float x, from the exponent bits of the exact double
// product (never subnormal: |x| >= 2^-149 and inv_scale >= 2^-149).
AMPKIT_HOST_DEVICE AMPKIT_INLINE int grad_hist_bin(float x, float inv_scale) {
  const double d = static_cast<double>(x < 0.f ? -x : x) * static_cast<double>(inv_scale);
  const int e = static_cast<int>((bit_cast<uint64_t>(d) >> 52) & 0x7ff) - 1023;
  return e < kGradHistMinExp ? 0 : (e > kGradHistMaxExp ? kGradHistBins - 1 : 1 + e - kGradHistMinExp);
}

// NOTE [Deterministic norm]
// A sum of squares has one order on every device, that of the CUDA kernels: the tensor is cut into chunks of
// kNormChunk elements; element i of a chunk belongs to lane i % kNormLanes (one CUDA thread, a grid-stride loop);
// a lane sums (in double, from 0.0) the squares of its elements in element order; a chunk's sum adds its lanes'
// sums in lane order (from 0.0), and the tensor's sum its chunks' sums in chunk order. The CPU loops follow the
// same order (a row of kNormLanes consecutive elements adds one square to each lane: vector adds, no reduction
// inside a row), so CPU and CUDA norms agree bit for bit.
// A list's norm (grad_norm) adds the chunk sums of all its tensors, numbered r = 0, 1, ... in list order, in
// kNormFinishLanes finish lanes: finish lane k adds (from 0.0) the chunk sums r = k, k + kNormFinishLanes, ... in
// that order, and the norm adds the finish lanes in lane order (from 0.0). One block of kNormFinishLanes threads
// reads the chunk sums coalesced, instead of one thread adding them all. Up to kNormFinishLanes chunk sums, each
// finish lane holds one of them (0.0 + s == s) or 0.0, so the total is the chunk sums added in chunk order.
constexpr int64_t kNormChunk = 65536;
constexpr int kNormLanes = 512;
constexpr int kNormFinishLanes = 256;

// Slots of the int64 statistics vector that UpdateScaleOp maintains on the device.
enum ScaleStat : int {
  kStatSteps = 0,
  kStatSkipped = 1,
  kStatLastOverflow = 2,
  kStatOverflowsAtMin = 3,
  kNumStats = 4
};

// One step of dynamic loss scaling. With the defaults (hysteresis 1, no bounds, dynamic) it is exactly
// torch._amp_update_scale_: back off on overflow, grow by `growth_factor` after `growth_interval` consecutive
// clean steps, never grow past the largest finite float; the products are formed in double and rounded once to
// float, as ATen's CPU and CUDA kernels do.
//
// The GradScaler adds hysteresis and bounds (Megatron-LM / DeepSpeed semantics) and statistics: on overflow the
// growth count restarts and the hysteresis count drops by one; the scale backs off only when that count reaches
// zero (the `hysteresis`-th overflow since the last growth, and every one after it), never below `min_scale`.
// A growth never passes `max_scale` and refills the hysteresis count. `dynamic == false` keeps the scale fixed
// (check and skip, never rescale).
//
// Args of operator():
//   hysteresis_tracker: the overflows left before a back-off; null: every overflow backs off (hysteresis 1).
//   stats: kNumStats slots [steps, skipped steps, number of the last overflow step (0: none), overflows met at
//          min_scale]; null: none kept.
struct UpdateScaleOp {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int32_t hysteresis = 1;
  float min_scale = 0.f;
  float max_scale = 3.40282347e+38f;  // FP32 max: a finite product never exceeds it
  bool dynamic = true;

  AMPKIT_HOST_DEVICE void operator()(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker, int64_t* stats,
                                     float found_inf) const {
    int32_t no_tracker = hysteresis;
    int32_t* left = hysteresis_tracker != nullptr ? hysteresis_tracker : &no_tracker;
    if (stats != nullptr) {
      stats[kStatSteps] += 1;
    }
    if (found_inf != 0.f) {
      if (stats != nullptr) {
        stats[kStatSkipped] += 1;
        stats[kStatLastOverflow] = stats[kStatSteps];
      }
      *growth_tracker = 0;
      if (!dynamic) {
        return;
      }
      if (stats != nullptr && *scale <= min_scale) {
        stats[kStatOverflowsAtMin] += 1;
      }
      if (*left > 0) {
        *left -= 1;
      }
      if (*left == 0) {
        const float backed_off = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
        *scale = backed_off < min_scale ? min_scale : backed_off;
      }
      return;
    }
    if (!dynamic) {
      return;
    }
    const int64_t successful = static_cast<int64_t>(*growth_tracker) + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      if (!is_non_finite(grown)) {
        *scale = grown > max_scale ? max_scale : grown;
      }
      *growth_tracker = 0;
      *left = hysteresis;
    } else {
      *growth_tracker = static_cast<int32_t>(successful);
    }
  }

  // torch._amp_update_scale_'s form: no hysteresis tracker, no statistics.
  AMPKIT_HOST_DEVICE void operator()(float* scale, int32_t* growth_tracker, float found_inf) const {
    (*this)(scale, growth_tracker, nullptr, nullptr, found_inf);
  }
};

}  // namespace ampkit::kernels
