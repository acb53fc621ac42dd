// The element-wise formulas of ampkit's fused optimizer steps, one functor each, shared by the CPU loops and the
// CUDA kernels. They follow torch's fused kernels (aten/src/ATen/native/cuda/fused_adam_utils.cuh, FusedSgdKernel)
// in FP32 opmath, on the FP32 master value when there is one.
#pragma once

#include <cmath>

#include "common.h"

namespace ampkit::kernels {

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

// One Adam/AdamW update of one element, in FP32: `w` is the weight (the master when there is one), `g` the
// unscaled grad, `m`/`v`/`vmax` the moments. Updates w, m, v (and vmax with amsgrad) in place.
struct AdamOp {
  AdamParams p;

  AMPKIT_HOST_DEVICE void operator()(float& w, float g, float& m, float& v, float* vmax,
                                     const AdamStepFactors& f) const {
    if (p.maximize) {
      g = -g;
    }
    if (p.weight_decay != 0.f) {
      if (p.decoupled_weight_decay) {
        w -= p.lr * p.weight_decay * w;
      } else {
        g += w * p.weight_decay;
      }
    }
    m = p.beta1 * m + (1.f - p.beta1) * g;
    v = p.beta2 * v + (1.f - p.beta2) * g * g;
    float second = v;
    if (p.amsgrad) {
      *vmax = *vmax > v ? *vmax : v;
      second = *vmax;
    }
    const float denom = sqrtf(second) / f.bias_correction2_sqrt + p.eps;
    w -= f.step_size * m / denom;
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

// One SGD update of one element in FP32; `first` is whether this tensor takes its first momentum step (the
// buffer starts as the grad itself, as torch's).
struct SgdOp {
  SgdParams p;

  AMPKIT_HOST_DEVICE void operator()(float& w, float g, float* buf, bool first) const {
    if (p.maximize) {
      g = -g;
    }
    if (p.weight_decay != 0.f) {
      g += p.weight_decay * w;
    }
    if (p.momentum != 0.f) {
      *buf = first ? g : p.momentum * *buf + (1.f - p.dampening) * g;
      g = p.nesterov ? g + p.momentum * *buf : *buf;
    }
    w -= p.lr * g;
  }
};

}  // namespace ampkit::kernels
