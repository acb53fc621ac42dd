// The element-wise formulas of ampkit's fused optimizer steps, one functor each, shared by the CPU loops and the
// CUDA kernels. They follow torch's fused kernels (aten/src/ATen/native/cuda/fused_adam_utils.cuh, FusedSgdKernel)
// in FP32 opmath, on the FP32 master value when there is one.
#pragma once

#include <cmath>

#include "common.h"

namespace ampkit::kernels {

// NOTE [BF16 weight + 16-bit remainder]
// An FP32 master held as the BF16 weight (its high half, rounded) plus an int16 remainder: exact FP32 for 2
// extra bytes per parameter instead of 4 (Transformer Engine's store_param_remainders). The weight is the high
// half rounded to nearest with ties away from zero (round-to-nearest-even everywhere but exact ties), so that
// remainder = low half as a signed int16 and master bits = (weight bits << 16) + remainder, exactly.
AMPKIT_HOST_DEVICE AMPKIT_INLINE float join_remainder(uint16_t weight_bits, int16_t remainder) {
  return bit_cast<float>((static_cast<uint32_t>(weight_bits) << 16) +
                         static_cast<uint32_t>(static_cast<int32_t>(remainder)));
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE void split_remainder(float master, uint16_t* weight_bits, int16_t* remainder) {
  const uint32_t bits = bit_cast<uint32_t>(master);
  const uint32_t low = bits & 0xffffu;
  *weight_bits = static_cast<uint16_t>((bits >> 16) + (low >> 15));
  *remainder = static_cast<int16_t>(static_cast<uint16_t>(low));
}

// Hyper-parameters of an Adam/AdamW step.
struct AdamParams {
  float lr;
  float beta1;
  float beta2;
  float weight_decay;
  float eps;
  bool amsgrad;
  bool maximize;
  bool decoupled_weight_decay;  // AdamW (true) or Adam with L2 (false)
};

// Per-tensor factors of one Adam step, from the step number the tensor reaches with it.
struct AdamStepFactors {
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)

  AMPKIT_HOST_DEVICE static AdamStepFactors at_step(const AdamParams& p, float step) {
    const float bc1 = 1.f - static_cast<float>(pow(static_cast<double>(p.beta1), static_cast<double>(step)));
    const float bc2 = 1.f - static_cast<float>(pow(static_cast<double>(p.beta2), static_cast<double>(step)));
    return {p.lr / bc1, sqrtf(bc2)};
  }
};

// Elementary operations of the functors on scalars; SIMD drivers pass their own policy with the same members.
struct ScalarMath {
  AMPKIT_HOST_DEVICE static float sqrt(float x) { return sqrtf(x); }
  AMPKIT_HOST_DEVICE static float max(float a, float b) { return a > b ? a : b; }
  AMPKIT_HOST_DEVICE static float neg(float x) { return -x; }
};

// One Adam/AdamW update in FP32: `w` is the weight (the master when there is one), `g` the unscaled grad,
// `m`/`v`/`vmax` the moments; updates w, m, v (and vmax with amsgrad) in place. `V` is float, or a SIMD vector
// of floats with the `Math` policy for it (constants are broadcast with V(c)).
struct AdamOp {
  AdamParams p;

  template <typename V, typename Math = ScalarMath>
  AMPKIT_HOST_DEVICE void apply(V& w, V g, V& m, V& v, V* vmax, const AdamStepFactors& f) const {
    if (p.maximize) {
      g = Math::neg(g);
    }
    if (p.weight_decay != 0.f) {
      if (p.decoupled_weight_decay) {
        w = w - V(p.lr * p.weight_decay) * w;
      } else {
        g = g + w * V(p.weight_decay);
      }
    }
    m = V(p.beta1) * m + V(1.f - p.beta1) * g;
    v = V(p.beta2) * v + V(1.f - p.beta2) * g * g;
    V second = v;
    if (p.amsgrad) {
      *vmax = Math::max(*vmax, v);
      second = *vmax;
    }
    const V denom = Math::sqrt(second) / V(f.bias_correction2_sqrt) + V(p.eps);
    w = w - V(f.step_size) * m / denom;
  }

  AMPKIT_HOST_DEVICE void operator()(float& w, float g, float& m, float& v, float* vmax,
                                     const AdamStepFactors& f) const {
    apply<float>(w, g, m, v, vmax, f);
  }
};

// Hyper-parameters of an SGD step.
struct SgdParams {
  float lr;
  float momentum;
  float dampening;
  float weight_decay;
  bool nesterov;
  bool maximize;
};

// One SGD update in FP32; `first` is whether this tensor takes its first momentum step (the buffer starts as
// the grad itself, as torch's). `V`/`Math` as for AdamOp.
struct SgdOp {
  SgdParams p;

  template <typename V, typename Math = ScalarMath>
  AMPKIT_HOST_DEVICE void apply(V& w, V g, V* buf, bool first) const {
    if (p.maximize) {
      g = Math::neg(g);
    }
    if (p.weight_decay != 0.f) {
      g = g + V(p.weight_decay) * w;
    }
    if (p.momentum != 0.f) {
      *buf = first ? g : V(p.momentum) * *buf + V(1.f - p.dampening) * g;
      g = p.nesterov ? g + V(p.momentum) * *buf : *buf;
    }
    w = w - V(p.lr) * g;
  }

  AMPKIT_HOST_DEVICE void operator()(float& w, float g, float* buf, bool first) const {
    apply<float>(w, g, buf, first);
  }
};

}  // namespace ampkit::kernels
