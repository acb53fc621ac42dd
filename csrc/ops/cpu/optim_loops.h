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
      for (int64_t i = b0; i < b1; ++i) {
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
      float absmax = 0.f;
      for (int64_t i = 0; i < b1 - b0; ++i) {
        absmax = kernels::absmax_fold(absmax, in[i]);
      }
      const float scale = kernels::blockwise8_scale(absmax);
      std::memcpy(codes + kernels::blockwise8_blocks(numel) * kernels::kQuantBlock + 4 * blk, &scale, 4);
      for (int64_t i = b0; i < b1; ++i) {
        codes[i] = kernels::blockwise8_code(in[i - b0], scale, map);
      }
    }
  }
};

// The step of elements [begin, end) of a tensor whose exp_avg (momentum buffer) or exp_avg_sq is not FP32: a
// quantization block of 256 elements at a time (work items start at multiples of kCpuChunk, a multiple of it),
// the states loaded into FP32, `scalar_body` run on each element and the weight stored as its mode keeps it,
// then the states stored back (NOTE [8-bit block-wise states]). Scalar.
template <typename T, typename ScalarBody>
void state_block_span(const OptimTensor& t, int64_t begin, int64_t end, int64_t tail_from, float grad_scale,
                      bool write_grads, const ScalarBody& scalar_body_arg) {
  static_assert(kCpuChunk % kernels::kQuantBlock == 0, "a work item holds whole quantization blocks");
  const ScalarBody scalar_body = scalar_body_arg;  // NOTE [Loop-invariant options]
  T* param = static_cast<T*>(t.param);
  T* grad = static_cast<T*>(t.grad);
  auto* bits = reinterpret_cast<uint16_t*>(param);
  const bool bf16 = std::is_same_v<T, c10::BFloat16>;
  const bool stochastic = bf16 && t.sr_seed != nullptr;
  const uint64_t seed = stochastic ? static_cast<uint64_t>(*t.sr_seed) : 0;
  const uint32_t sr_step = stochastic ? static_cast<uint32_t>(*t.step + 1.f) : 0;
  const StateBlockIO m_io{t.exp_avg_type, t.exp_avg, t.numel, kernels::blockwise8_map(true)};
  const StateBlockIO v_io{t.exp_avg_sq_type, t.exp_avg_sq, t.numel, kernels::blockwise8_map(false)};
  const bool unscale = grad_scale != 1.f;
  write_grads = write_grads && unscale;
  float mb[kernels::kQuantBlock];
  float vb[kernels::kQuantBlock];
  kernels::Philox4x32 words{};
  for (int64_t b0 = begin; b0 < end;) {
    const int64_t blk = b0 / kernels::kQuantBlock;
    const int64_t b1 = std::min(end, (blk + 1) * kernels::kQuantBlock);
    if (m_io.data != nullptr) {
      m_io.load(blk, b0, b1, mb);
    }
    if (v_io.data != nullptr) {
      v_io.load(blk, b0, b1, vb);
    }
    for (int64_t i = b0; i < b1; ++i) {
      float w0;
      if (t.master != nullptr) {
        w0 = t.master[i];
      } else if (bf16 && t.remainder != nullptr) {
        w0 = kernels::join_remainder(bits[i], t.remainder[i]);
      } else {
        w0 = static_cast<float>(param[i]);
      }
      float g = static_cast<float>(grad[i]);
      if (unscale) {
        g = g / grad_scale;
        if (write_grads) {
          grad[i] = static_cast<T>(g);
        }
      }
      float w1 = w0;
      scalar_body(w1, g, m_io.data != nullptr ? &mb[i - b0] : nullptr, v_io.data != nullptr ? &vb[i - b0] : nullptr,
                  t.max_exp_avg_sq != nullptr ? t.max_exp_avg_sq + i : nullptr, i >= tail_from);
      if (t.master != nullptr) {
        t.master[i] = w1;
        param[i] = static_cast<T>(w1);
      } else if (bf16 && t.remainder != nullptr) {
        kernels::split_remainder(w1, &bits[i], &t.remainder[i]);
      } else if (bf16 && t.kahan_comp != nullptr) {
        kernels::kahan_store(w0, w1, &bits[i], &t.kahan_comp[i]);
      } else if (stochastic) {
        if (i == b0 || (i & 3) == 0) {
          words = kernels::rounding_words(seed, sr_step, i >> 2);
        }
        bits[i] = kernels::bf16_bits_stochastic(w1, words.v[i & 3]);
      } else {
        param[i] = static_cast<T>(w1);
      }
    }
    if (m_io.data != nullptr) {
      m_io.store(blk, b0, b1, mb);
    }
    if (v_io.data != nullptr) {
      v_io.store(blk, b0, b1, vb);
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
template <typename T, bool kMaster, bool kM, bool kV, bool kVmax, typename VecBody, typename ScalarBody>
void optim_span(const OptimTensor& t, int64_t begin, int64_t end, int64_t tail_from, float grad_scale, bool write_grads,
                const VecBody& vec_body_arg, const ScalarBody& scalar_body_arg) {
  // Local copies of the bodies (NOTE [Loop-invariant options]).
  const VecBody vec_body = vec_body_arg;
  const ScalarBody scalar_body = scalar_body_arg;
  static_assert(at::vec::Vectorized<T>::size() == 2 * VecF::size() || std::is_same_v<T, float>);
  // Float vectors per iteration: two for FP16/BF16 parameters (one vector of theirs widens to two), one for FP32
  // (every stream then loads one vector, as torch's loop does, and a tensor's vector part ends one vector later).
  constexpr int kVecs = std::is_same_v<T, float> ? 1 : 2;
  constexpr int64_t kStep = kVecs * VecF::size();
  T* param = static_cast<T*>(t.param);
  T* grad = static_cast<T*>(t.grad);
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
        grad[i] = static_cast<T>(g);
      }
    }
    return g;
  };
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (t.remainder != nullptr) {
      // BF16 weight + int16 remainder (NOTE [BF16 weight + 16-bit remainder]): scalar, bit-level.
      auto* bits = reinterpret_cast<uint16_t*>(param);
      for (int64_t i = begin; i < end; ++i) {
        float w1 = kernels::join_remainder(bits[i], t.remainder[i]);
        const float g1 = scalar_grad(i);
        scalar_body(w1, g1, m != nullptr ? m + i : nullptr, v != nullptr ? v + i : nullptr,
                    vmax != nullptr ? vmax + i : nullptr, i >= tail_from);
        kernels::split_remainder(w1, &bits[i], &t.remainder[i]);
      }
      return;
    }
    if (t.kahan_comp != nullptr || t.sr_seed != nullptr) {
      // BF16 weight without a master (kernels/stochastic_rounding.h): the FP32 update of the BF16 value, stored
      // with Kahan compensation or stochastic rounding; scalar, bit-level, keyed by element index.
      auto* bits = reinterpret_cast<uint16_t*>(param);
      const uint64_t seed = t.sr_seed != nullptr ? static_cast<uint64_t>(*t.sr_seed) : 0;
      const uint32_t step = t.sr_seed != nullptr ? static_cast<uint32_t>(*t.step + 1.f) : 0;
      kernels::Philox4x32 words{};
      for (int64_t i = begin; i < end; ++i) {
        if (t.sr_seed != nullptr && (i == begin || (i & 3) == 0)) {
          words = kernels::rounding_words(seed, step, i >> 2);  // one call per group of 4 elements
        }
        const float w0 = kernels::bf16_bits_to_float(bits[i]);
        float w1 = w0;
        const float g1 = scalar_grad(i);
        scalar_body(w1, g1, m != nullptr ? m + i : nullptr, v != nullptr ? v + i : nullptr,
                    vmax != nullptr ? vmax + i : nullptr, i >= tail_from);
        if (t.kahan_comp != nullptr) {
          kernels::kahan_store(w0, w1, &bits[i], &t.kahan_comp[i]);
        } else {
          bits[i] = kernels::bf16_bits_stochastic(w1, words.v[i & 3]);
        }
      }
      return;
    }
  }
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

template <typename T, Streams kStreams, typename VecBody, typename ScalarBody>
void span_with_streams(const OptimTensor& t, int64_t begin, int64_t end, int64_t tail_from, float grad_scale,
                       bool write_grads, const VecBody& vec_body, const ScalarBody& scalar_body) {
  constexpr bool kAdam = kStreams == Streams::kAdam;
  // Adam: the master and max_exp_avg_sq vary; SGD: the master and the momentum buffer (exp_avg).
  const bool second = kAdam ? t.max_exp_avg_sq != nullptr : t.exp_avg != nullptr;
  with_flag(t.master != nullptr, [&](auto master) {
    with_flag(second, [&](auto other) {
      constexpr bool kOther = decltype(other)::value;
      optim_span<T, decltype(master)::value, kAdam || kOther, kAdam, kAdam && kOther>(
          t, begin, end, tail_from, grad_scale, write_grads, vec_body, scalar_body);
    });
  });
}

template <Streams kStreams, typename VecBody, typename ScalarBody>
void dispatch_span(const OptimTensor& t, int64_t begin, int64_t end, int tail_width, float grad_scale, bool write_grads,
                   const VecBody& vec_body, const ScalarBody& scalar_body) {
  const int64_t tail_from = kernels::tail_start(t.numel, tail_width);
  if (t.exp_avg_type != kernels::StateType::kFloat32 || t.exp_avg_sq_type != kernels::StateType::kFloat32) {
    switch (t.dtype) {  // BF16 or 8-bit moments
      case DType::kFloat16:
        state_block_span<c10::Half>(t, begin, end, tail_from, grad_scale, write_grads, scalar_body);
        break;
      case DType::kBFloat16:
        state_block_span<c10::BFloat16>(t, begin, end, tail_from, grad_scale, write_grads, scalar_body);
        break;
      default:
        state_block_span<float>(t, begin, end, tail_from, grad_scale, write_grads, scalar_body);
        break;
    }
    return;
  }
  switch (t.dtype) {
    case DType::kFloat16:
      span_with_streams<c10::Half, kStreams>(t, begin, end, tail_from, grad_scale, write_grads, vec_body, scalar_body);
      break;
    case DType::kBFloat16:
      span_with_streams<c10::BFloat16, kStreams>(t, begin, end, tail_from, grad_scale, write_grads, vec_body,
                                                 scalar_body);
      break;
    default:
      span_with_streams<float, kStreams>(t, begin, end, tail_from, grad_scale, write_grads, vec_body, scalar_body);
      break;
  }
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
