// The element-wise formulas of ampkit's fused optimizer steps, one functor each, shared by the CPU loops and the
// CUDA kernels: torch's fused CPU kernels' formulas (NOTE [torch's scalar tail]) in FP32 opmath, on the FP32
// master value when there is one.
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

// Hyper-parameters of an Adam/AdamW step, as the caller gives them (double, like torch.optim's).
struct AdamParams {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
  bool amsgrad;
  bool maximize;
  bool decoupled_weight_decay;  // AdamW (true) or Adam with L2 (false)
  // NOTE [torch's scalar tail]: the last numel % tail_width elements of each tensor take the formulas of torch's
  // scalar tail loop (0: every element takes the vector formulas).
  int tail_width = 0;
  // With a grad scale: write the unscaled grad back into the grad tensor (torch's fused optimizers do).
  bool write_unscaled_grads = false;
};

// NOTE [torch's scalar tail]
// ampkit's optimizer formulas are torch's fused CPU kernels' (aten/src/ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp)
// as they run: FP32 opmath, constants rounded once from double, and each multiply-add fused where torch's compiled
// kernel fuses it (its explicit fmadd and the compiler's contraction), so that FP32 steps are bit-identical to
// torch.optim's fused=True. Torch's kernel runs vectors of Vectorized<float>::size() elements and then a scalar
// loop on the last numel % size elements, and the two loops contract one multiply-add differently (the second
// moment of Adam, the momentum buffer of SGD; from a tensor's second step on, as both start from zero or the
// grad). Under AVX-512 the compiler made vector code of 8 floats of that scalar loop, which rounds as the vector
// body: there only the last numel % 8 elements take the scalar formulas (tail_width 8, as AVX2's;
// torch_cpu_float_vector_width in csrc/ops/cpu/cpu_loops.cpp). Every ampkit loop, CPU or CUDA, takes the
// formula by element index (tail = index >= numel - numel % tail_width), never by its own SIMD width. The ops
// pass different widths, and the contract is:
//   - the CPU ops take torch's tail (tail_width = torch_cpu_float_vector_width()): bit-identical to torch's fused
//     CPU optimizers (tests/python/test_optim_bitwise_torch.py);
//   - the CUDA ops take none (tail_width 0, kCudaOptimTailWidth in csrc/ops/optim_cuda_launch.h), as torch's CUDA
//     fused kernels have no scalar loop: bit-identical to the CPU op on a tensor padded to a multiple of its tail
//     width (no element of the original extent in the tail), which is how tests/cpp/test_emulated_optim.cpp and
//     tests/cpp/test_ops_cuda.cpp check them;
//   - CUDA against CPU op on the same tensors: bit for bit but in the last numel % tail_width elements (at most 7)
//     of each tensor, where the moments and FP32 weights differ by a few FP32 roundings per step (the tests hold
//     them to a relative 1e-6 over their few steps) and a 16-bit weight by at most one unit in its last place.
AMPKIT_HOST_DEVICE AMPKIT_INLINE int64_t tail_start(int64_t numel, int tail_width) {
  return tail_width > 0 ? numel - numel % tail_width : numel;
}

// NOTE [Bias-correction powers]
// beta^step is computed by step_power, the same operations on every device, never by the platform's pow: CUDA's
// pow(double) is within 2 ulp and glibc's within 0.52 ulp, and the two round differently wherever beta^step lies
// near a midpoint. step_power squares in double-double arithmetic (each product error-free through an explicit
// fma, each sum renormalised by an exact two-sum: nothing the compiler may contract or reassociate) and rounds once
// at the end: correctly rounded but for a relative error of about 2^-98, and the same bits on the CPU, in the
// emulated build and on the GPU, so CPU and CUDA steps agree bit for bit. torch's fused CPU kernels call glibc's
// pow: in double, the two differ by 1 ulp for about 1 in 2000 (beta, step) pairs (where glibc's pow is not
// correctly rounded); the FP32 factors the functors use (-lr / (1 - beta^step), sqrt(1 - beta^step), 1 -
// beta^step) came out identical on all 3.2e7 pairs of a sweep (betas 0.1 ... 0.999999 and 2000 random ones, steps
// 1 ... 1e6, eight learning rates; tests/cpp/test_functors.cpp keeps a part of it), so the CPU steps stay
// bit-identical to torch's. Step counts that are not whole numbers (a hand-edited state) take the platform's pow.
// (a_hi + a_lo) * (b_hi + b_lo) as a renormalised pair: the exact product of the high parts (its error by an
// fma) plus the cross terms.
AMPKIT_HOST_DEVICE AMPKIT_INLINE void dd_mul(double a_hi, double a_lo, double b_hi, double b_lo, double* hi,
                                             double* lo) {
  const double p = a_hi * b_hi;
  const double e = fma(a_lo, b_hi, fma(a_hi, b_lo, fma(a_hi, b_hi, -p)));
  *hi = p + e;
  *lo = e - (*hi - p);
}

AMPKIT_HOST_DEVICE AMPKIT_INLINE double step_power(double beta, double step) {
  if (!(step >= 0.0 && step <= 9007199254740992.0 && floor(step) == step)) {
    return pow(beta, step);
  }
  auto n = static_cast<uint64_t>(step);
  // (hi, lo): an unevaluated sum, |lo| <= ulp(hi) / 2.
  double r_hi = 1.0;
  double r_lo = 0.0;
  double b_hi = beta;
  double b_lo = 0.0;
  while (n != 0) {
    if ((n & 1u) != 0) {
      dd_mul(r_hi, r_lo, b_hi, b_lo, &r_hi, &r_lo);
    }
    n >>= 1;
    if (n != 0) {
      dd_mul(b_hi, b_lo, b_hi, b_lo, &b_hi, &b_lo);
    }
  }
  return r_hi;  // = hi + lo rounded once (the pair is renormalised)
}

// Per-tensor factors of one Adam step, from the step number the tensor reaches with it and the step's lr
// (in double, then rounded once, as torch's kernel does; NOTE [Bias-correction powers]).
struct AdamStepFactors {
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float decay;                  // AdamW: 1 - lr * weight_decay

  AMPKIT_HOST_DEVICE static AdamStepFactors at_step(const AdamParams& p, double lr, float step) {
    const double bc1 = 1.0 - step_power(p.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - step_power(p.beta2, static_cast<double>(step));
    return {static_cast<float>(-(lr / bc1)), static_cast<float>(sqrt(bc2)),
            static_cast<float>(1.0 - lr * p.weight_decay)};
  }
};

// Elementary operations of the functors on scalars; SIMD drivers pass their own policy with the same members.
struct ScalarMath {
  AMPKIT_HOST_DEVICE static float sqrt(float x) { return sqrtf(x); }
  AMPKIT_HOST_DEVICE static float max(float a, float b) { return a > b ? a : b; }
  AMPKIT_HOST_DEVICE static float neg(float x) { return -x; }
  // a * b + c rounded once.
  AMPKIT_HOST_DEVICE static float fma(float a, float b, float c) { return fmaf(a, b, c); }
};

// One Adam/AdamW update in FP32: `w` is the weight (the master when there is one), `g` the unscaled grad,
// `m`/`v`/`vmax` the moments; updates w, m, v (and vmax with amsgrad) in place. `V` is float, or a SIMD vector
// of floats with the `Math` policy for it (constants are broadcast with V(c)); `tail` picks the scalar-tail
// formula (NOTE [torch's scalar tail]).
struct AdamOp {
  AdamParams p;
  // The constants of the update, rounded once from double.
  float lerp_weight;  // 1 - beta1: exp_avg.lerp_(grad, 1 - beta1)
  float beta2;
  float grad_sq_coeff;  // 1 - beta2
  float weight_decay;
  float eps;
  bool lerp_from_exp_avg;  // |lerp_weight| < 0.5: lerp from exp_avg, else from grad (torch's lerp)
  // The options as flags decided once (a test of a bool, not a compare of doubles, in the loops).
  bool maximize;
  bool decay;
  bool decoupled;
  bool amsgrad;

  AMPKIT_HOST_DEVICE explicit AdamOp(const AdamParams& params)
      : p(params),
        lerp_weight(static_cast<float>(1.0 - params.beta1)),
        beta2(static_cast<float>(params.beta2)),
        grad_sq_coeff(static_cast<float>(1.0 - params.beta2)),
        weight_decay(static_cast<float>(params.weight_decay)),
        eps(static_cast<float>(params.eps)),
        lerp_from_exp_avg(fabsf(lerp_weight) < 0.5f),
        maximize(params.maximize),
        decay(params.weight_decay != 0.0),
        decoupled(params.decoupled_weight_decay),
        amsgrad(params.amsgrad) {}

  template <typename V, typename Math = ScalarMath>
  AMPKIT_HOST_DEVICE void apply(V& w, V g, V& m, V& v, V* vmax, const AdamStepFactors& f, bool tail = false) const {
    if (maximize) {
      g = Math::neg(g);
    }
    if (decay) {
      if (decoupled) {
        w = w * V(f.decay);
      } else {
        g = Math::fma(w, V(weight_decay), g);
      }
    }
    const V diff = g - m;
    m = lerp_from_exp_avg ? Math::fma(V(lerp_weight), diff, m) : Math::fma(V(lerp_weight - 1.f), diff, g);
    v = tail ? Math::fma(v, V(beta2), V(grad_sq_coeff) * g * g) : Math::fma(V(grad_sq_coeff) * g, g, v * V(beta2));
    V second = v;
    if (amsgrad) {
      *vmax = Math::max(*vmax, v);
      second = *vmax;
    }
    const V denom = Math::sqrt(second) / V(f.bias_correction2_sqrt) + V(eps);
    w = w + V(f.neg_step_size) * m / denom;
  }

  AMPKIT_HOST_DEVICE void operator()(float& w, float g, float& m, float& v, float* vmax, const AdamStepFactors& f,
                                     bool tail = false) const {
    apply<float>(w, g, m, v, vmax, f, tail);
  }
};

// Hyper-parameters of an SGD step, as the caller gives them.
struct SgdParams {
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
  int tail_width = 0;                 // NOTE [torch's scalar tail]
  bool write_unscaled_grads = false;  // as AdamParams
};

// One SGD update in FP32; `first` is whether this tensor takes its first momentum step (the buffer starts as
// the grad itself, as torch's). `V`/`Math`/`tail` as for AdamOp.
struct SgdOp {
  SgdParams p;
  float weight_decay;
  float momentum;
  float grad_coeff;  // 1 - dampening
  float neg_lr;
  // The options as flags decided once (a test of a bool, not a compare of doubles, in the loops).
  bool maximize;
  bool decay;
  bool use_momentum;
  bool nesterov;

  AMPKIT_HOST_DEVICE explicit SgdOp(const SgdParams& params)
      : p(params),
        weight_decay(static_cast<float>(params.weight_decay)),
        momentum(static_cast<float>(params.momentum)),
        grad_coeff(static_cast<float>(1.0 - params.dampening)),
        neg_lr(static_cast<float>(-params.lr)),
        maximize(params.maximize),
        decay(params.weight_decay != 0.0),
        use_momentum(params.momentum != 0.0),
        nesterov(params.nesterov) {}

  template <typename V, typename Math = ScalarMath>
  AMPKIT_HOST_DEVICE void apply(V& w, V g, V* buf, bool first, bool tail = false) const {
    if (maximize) {
      g = Math::neg(g);
    }
    if (decay) {
      g = Math::fma(w, V(weight_decay), g);
    }
    if (use_momentum) {
      if (first) {
        *buf = g;
      } else {
        *buf = tail ? Math::fma(*buf, V(momentum), g * V(grad_coeff)) : Math::fma(V(grad_coeff), g, *buf * V(momentum));
      }
      g = nesterov ? Math::fma(*buf, V(momentum), g) : *buf;
    }
    w = Math::fma(g, V(neg_lr), w);
  }

  AMPKIT_HOST_DEVICE void operator()(float& w, float g, float* buf, bool first, bool tail = false) const {
    apply<float>(w, g, buf, first, tail);
  }
};

// Hyper-parameters of a LAMB step (You et al. 2020; the semantics of Apex's FusedLAMB, NVIDIA's BERT recipe), as
// the caller gives them.
struct LambParams {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
  bool bias_correction;
  bool adam_w_mode;      // decoupled weight decay added to the update (true) or L2 added to the grad (false)
  bool grad_averaging;   // m = beta1 * m + (1 - beta1) * g (true) or beta1 * m + g (false)
  bool use_nvlamb;       // the trust ratio for every tensor, not only those with weight decay
  double max_grad_norm;  // > 0 with a grad norm given: the grads are scaled down to that global norm
};

// NOTE [LAMB passes]
// A LAMB step needs per-tensor norms of the weight and of the update before any weight may change, so it is
// three passes (Apex's two stages, without its scratch copy of the update):
//   1. (grad_norm op, when clipping) the global norm of the unscaled grads: sum of squares per chunk lane.
//   2. moments: g = raw grad / (grad_scale * clip), m and v updated and stored, u = m^ / (sqrt(v^) + eps)
//      (+ wd * w in adam_w_mode) computed, ||w||^2 and ||u||^2 summed per chunk lane; the weight is not written.
//   3. apply: u recomputed from the stored m and v (the same FP32 formula, so the same bits), the trust ratio
//      r = ||w|| / ||u|| (1 when either is 0, or without weight decay unless use_nvlamb), w += -lr * r * u.
// Norms are sums of squares in double in the order of NOTE [Deterministic norm] (amp_functors.h): chunk lanes,
// lane sums in lane order, a tensor's chunk sums in chunk order, the global norm's in finish lanes; the CPU loops
// follow it, so CPU and CUDA agree bit for bit.
// Traffic per parameter with an FP16 weight and FP32 master: pass 2 reads g, w, m, v and writes m, v (22 bytes);
// pass 3 reads w, m, v and writes w and the FP16 weight (18 bytes): 40 bytes, 42 with clipping (AdamW: 28).

// The divisor of the raw grads: the loss scale times the clipping factor ||g|| / max_grad_norm when the global
// norm of the unscaled grads exceeds max_grad_norm (in double, rounded once).
AMPKIT_HOST_DEVICE AMPKIT_INLINE float lamb_grad_divisor(float grad_scale, const float* grad_norm,
                                                         double max_grad_norm) {
  double clip = 1.0;
  if (grad_norm != nullptr && max_grad_norm > 0.0) {
    const double norm = static_cast<double>(*grad_norm);
    if (norm > max_grad_norm) {
      clip = norm / max_grad_norm;
    }
  }
  return static_cast<float>(static_cast<double>(grad_scale) * clip);
}

// The bias corrections of a tensor's step (1 without bias correction), in double rounded once (NOTE
// [Bias-correction powers]).
struct LambStepFactors {
  float bias_correction1;
  float bias_correction2;

  AMPKIT_HOST_DEVICE static LambStepFactors at_step(const LambParams& p, float step) {
    if (!p.bias_correction) {
      return {1.f, 1.f};
    }
    return {static_cast<float>(1.0 - step_power(p.beta1, static_cast<double>(step))),
            static_cast<float>(1.0 - step_power(p.beta2, static_cast<double>(step)))};
  }
};

// The per-element formulas of LAMB's moments and update pass (NOTE [LAMB passes]) in FP32, every multiply-add
// written out (no contraction: the CPU and CUDA builds round alike).
struct LambOp {
  LambParams p;
  float beta1;
  float grad_coeff;  // 1 - beta1 with grad averaging, else 1
  float beta2;
  float grad_sq_coeff;  // 1 - beta2
  float weight_decay;
  float eps;

  AMPKIT_HOST_DEVICE explicit LambOp(const LambParams& params)
      : p(params),
        beta1(static_cast<float>(params.beta1)),
        grad_coeff(params.grad_averaging ? static_cast<float>(1.0 - params.beta1) : 1.f),
        beta2(static_cast<float>(params.beta2)),
        grad_sq_coeff(static_cast<float>(1.0 - params.beta2)),
        weight_decay(static_cast<float>(params.weight_decay)),
        eps(static_cast<float>(params.eps)) {}

  // Whether the update is scaled by the trust ratio ||w|| / ||u||.
  AMPKIT_HOST_DEVICE bool trust_ratio() const { return p.weight_decay != 0.0 || p.use_nvlamb; }

  // The update direction u of weight w from the (new) moments m and v.
  template <typename V = float, typename Math = ScalarMath>
  AMPKIT_HOST_DEVICE V direction(V w, V m, V v, const LambStepFactors& f) const {
    const V denom = Math::sqrt(v / V(f.bias_correction2)) + V(eps);
    V u = (m / V(f.bias_correction1)) / denom;
    if (p.adam_w_mode && p.weight_decay != 0.0) {
      u = Math::fma(V(weight_decay), w, u);
    }
    return u;
  }

  // Updates the moments with the unscaled, clipped grad g and returns the update direction.
  template <typename V = float, typename Math = ScalarMath>
  AMPKIT_HOST_DEVICE V moments(V w, V g, V& m, V& v, const LambStepFactors& f) const {
    if (!p.adam_w_mode && p.weight_decay != 0.0) {
      g = Math::fma(V(weight_decay), w, g);
    }
    m = Math::fma(V(beta1), m, V(grad_coeff) * g);
    v = Math::fma(V(beta2), v, V(grad_sq_coeff) * g * g);
    return direction<V, Math>(w, m, v, f);
  }
};

// The factor of a tensor's update, -lr * trust ratio, from its sums of squares ||w||^2 and ||u||^2 (double,
// rounded once).
AMPKIT_HOST_DEVICE AMPKIT_INLINE float lamb_update_factor(double lr, double w_sq, double u_sq, bool trust_ratio) {
  double ratio = 1.0;
  if (trust_ratio && w_sq != 0.0 && u_sq != 0.0) {
    ratio = sqrt(w_sq) / sqrt(u_sq);
  }
  return static_cast<float>(-(lr * ratio));
}

}  // namespace ampkit::kernels
