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

// One step of dynamic loss scaling, exactly as torch._amp_update_scale_: back off on overflow, grow by
// `growth_factor` after `growth_interval` consecutive clean steps, never grow past the largest finite float.
// The products are formed in double and rounded once to float, as ATen's CPU and CUDA kernels do.
struct UpdateScaleOp {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;

  AMPKIT_HOST_DEVICE void operator()(float* scale, int32_t* growth_tracker, float found_inf) const {
    if (found_inf != 0.f) {
      *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
      *growth_tracker = 0;
      return;
    }
    const int64_t successful = static_cast<int64_t>(*growth_tracker) + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      if (!is_non_finite(grown)) {
        *scale = grown;
      }
      *growth_tracker = 0;
    } else {
      *growth_tracker = static_cast<int32_t>(successful);
    }
  }
};

}  // namespace ampkit::kernels
