// Helpers of the emulated optimizer tests (test_emulated_optim.cpp, test_emulated_lamb.cpp): one parameter's
// tensors, the ops' lists of them, the emulated CUDA op (the CUDA host glue of csrc/ops/optim_cuda_launch.h run
// through the op kernel templates, so with the width and parameters the GPU gets), and the checks of NOTE
// [torch's scalar tail]: the CUDA op bit for bit against the CPU op on padded copies (every element through the
// vector formulas), and against the CPU op itself bit for bit but in each tensor's scalar tail.
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "catch_torch.h"
#include "csrc/ops/op_kernels.h"
#include "csrc/ops/optim_cuda_launch.h"
#include "emulated_helpers.h"
#include "test_helpers.h"

namespace ampkit::test::emulated {

// kKahan and kStochastic: BF16 weights without a master; `remainder` then holds the BF16 Kahan compensation or
// the 0-dim int64 stochastic rounding seed (NOTE [Weight companions] in csrc/ops/checks.cpp).
enum class Master { kNone, kFp32, kRemainder, kKahan, kStochastic };

// One parameter's tensors for a fused step, in the layout of the ops' lists.
struct ParamState {
  at::Tensor param, grad, master, remainder, exp_avg, exp_avg_sq, max_exp_avg_sq, step;

  // A copy whose tensors keep the originals' offsets from a 16-byte boundary.
  ParamState clone() const {
    auto c = [](const at::Tensor& t) { return copy_keeping_offset(t); };
    return {c(param), c(grad), c(master), c(remainder), c(exp_avg), c(exp_avg_sq), c(max_exp_avg_sq), c(step)};
  }
};

inline std::vector<ParamState> clones(const std::vector<ParamState>& ps) {
  std::vector<ParamState> out;
  for (const ParamState& p : ps) {
    out.push_back(p.clone());
  }
  return out;
}

inline std::vector<ParamState> make_params(const std::vector<int64_t>& sizes, at::ScalarType dtype, Master master,
                                           bool adam, bool amsgrad, bool momentum, int64_t offset) {
  std::vector<ParamState> out;
  for (const int64_t n : sizes) {
    ParamState s;
    const auto w32 = at::randn({n}, at::kFloat);
    s.param = at_offset(w32.to(dtype), offset);
    s.grad = at_offset(random_grad(n, dtype, 100.0), offset);
    if (master == Master::kFp32) {
      s.master = at_offset(w32, offset);
    } else if (master == Master::kRemainder) {
      s.remainder = at_offset(at::randint(-32768, 32767, {n}, at::kShort), offset);
    } else if (master == Master::kKahan) {
      // A compensation below half the weight's unit in the last place, as a step leaves it.
      s.remainder = at_offset((w32 * at::rand({n}, at::kFloat) * 0x1p-9).to(at::kBFloat16), offset);
    } else if (master == Master::kStochastic) {
      s.remainder = at::randint(0, std::numeric_limits<int64_t>::max(), {}, at::kLong);
    }
    if (adam || momentum) {
      s.exp_avg = at_offset(at::randn({n}, at::kFloat) * 0.1, offset);
    }
    if (adam) {
      s.exp_avg_sq = at_offset(at::rand({n}, at::kFloat) * 0.01, offset);
    }
    if (amsgrad) {
      s.max_exp_avg_sq = at_offset(at::rand({n}, at::kFloat) * 0.02, offset);
    }
    if (adam || momentum || master == Master::kStochastic) {
      s.step = scalar_f32(adam ? 3.f : 0.f);
    }
    out.push_back(s);
  }
  return out;
}

inline std::vector<at::Tensor> list_of(const std::vector<ParamState>& ps, at::Tensor ParamState::*field) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    if ((p.*field).defined()) {
      out.push_back(p.*field);
    }
  }
  return out;
}

inline std::vector<kern::OptimTensor> descriptors_of(const std::vector<ParamState>& ps) {
  std::vector<kern::OptimTensor> out;
  auto f = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  for (const auto& p : ps) {
    out.push_back({p.param.data_ptr(), p.grad.data_ptr(), f(p.master),
                   p.remainder.defined() ? p.remainder.data_ptr<int16_t>() : nullptr, f(p.exp_avg), f(p.exp_avg_sq),
                   f(p.max_exp_avg_sq), f(p.step), p.param.numel(), dtype_of(p.param.scalar_type())});
  }
  return out;
}

inline void require_same_state(const std::vector<ParamState>& a, const std::vector<ParamState>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("param " << i << ", numel " << a[i].param.numel());
    for (auto field : {&ParamState::param, &ParamState::grad, &ParamState::master, &ParamState::remainder,
                       &ParamState::exp_avg, &ParamState::exp_avg_sq, &ParamState::max_exp_avg_sq, &ParamState::step}) {
      if ((a[i].*field).defined()) {
        REQUIRE(bits_equal(a[i].*field, b[i].*field));
      }
    }
  }
}

// The device scalars of one step: grad scale, skip flag and device lr (each optional).
struct Scalars {
  float grad_scale;
  float found_inf;
  float lr;
  bool use_scale;
  bool use_found;
  bool use_lr;
  std::optional<at::Tensor> t(bool use, float v) const {
    return use ? std::optional<at::Tensor>(scalar_f32(v)) : std::nullopt;
  }
};

// ---- the emulated CUDA ops: the dispatcher's kernel templates (checks, descriptors) around the CUDA glue ----
// (File-local from here on: the templates test `Run != nullptr` at compile time, which GCC refuses for inline
// functions.)
namespace {

[[maybe_unused]] void adam_step_emulated(const detail::AdamStepArgs& a, const std::vector<kern::OptimTensor>& tensors) {
  if (!a.lists.params.empty()) {  // as optim_cuda.cpp
    REQUIRE(detail::launch_adam_step_args(a, tensors, nullptr).ok());
  }
}

[[maybe_unused]] void sgd_step_emulated(const detail::SgdStepArgs& a, const std::vector<kern::OptimTensor>& tensors) {
  if (!a.lists.params.empty()) {
    REQUIRE(detail::launch_sgd_step_args(a, tensors, nullptr).ok());
  }
}

[[maybe_unused]] void lamb_step_emulated(const detail::LambStepArgs& a, const std::vector<kern::OptimTensor>& tensors) {
  if (!a.lists.params.empty()) {
    REQUIRE(detail::launch_lamb_step_args(a, tensors, nullptr).ok());
  }
}

// ampkit::adamw_step_ / sgd_step_ on the CPU, or the emulated CUDA op of the same signature.
using AdamStepFn = decltype(&ampkit::adamw_step_);
using SgdStepFn = decltype(&ampkit::sgd_step_);
inline AdamStepFn adam_cpu() { return &ampkit::adamw_step_; }
inline AdamStepFn adam_cuda() { return &detail::adamw_step_kernel<adam_step_emulated>; }
inline SgdStepFn sgd_cpu() { return &ampkit::sgd_step_; }
inline SgdStepFn sgd_cuda() { return &detail::sgd_step_kernel<sgd_step_emulated>; }

// One Adam step of `fn` over `s` with hyper-parameters `hp` (its tail width and write_unscaled_grads unused: each
// op picks its own tail, and the grads are written back as the op's argument says).
inline void adam_on(AdamStepFn fn, const std::vector<ParamState>& s, const kern::AdamParams& hp, const Scalars& sc,
                    bool write_unscaled_grads = true) {
  fn(list_of(s, &ParamState::param), list_of(s, &ParamState::grad), list_of(s, &ParamState::master),
     list_of(s, &ParamState::remainder), list_of(s, &ParamState::exp_avg), list_of(s, &ParamState::exp_avg_sq),
     list_of(s, &ParamState::max_exp_avg_sq), list_of(s, &ParamState::step), hp.lr, hp.beta1, hp.beta2, hp.weight_decay,
     hp.eps, hp.amsgrad, hp.maximize, hp.decoupled_weight_decay, sc.t(sc.use_scale, sc.grad_scale),
     sc.t(sc.use_found, sc.found_inf), sc.t(sc.use_lr, sc.lr), write_unscaled_grads);
}

inline void sgd_on(SgdStepFn fn, const std::vector<ParamState>& s, const kern::SgdParams& hp, const Scalars& sc,
                   bool write_unscaled_grads = true) {
  fn(list_of(s, &ParamState::param), list_of(s, &ParamState::grad), list_of(s, &ParamState::master),
     list_of(s, &ParamState::remainder), list_of(s, &ParamState::exp_avg), list_of(s, &ParamState::step), hp.lr,
     hp.momentum, hp.dampening, hp.weight_decay, hp.nesterov, hp.maximize, sc.t(sc.use_scale, sc.grad_scale),
     sc.t(sc.use_found, sc.found_inf), sc.t(sc.use_lr, sc.lr), write_unscaled_grads);
}

// ---- NOTE [torch's scalar tail]: the references of the CUDA op ----

// The scalar tail of the CPU op in this process (8 with AVX2 and AVX-512).
inline int64_t cpu_tail_width() { return ampkit::build_info().cpu_optim_tail_width; }

// Copies of a parameter list padded with zeros to a multiple of the CPU's tail width (`full`: the CPU op runs on
// these, so no element of the original extent takes the scalar tail), and views of the original extent (`view`).
struct Padded {
  std::vector<ParamState> full;
  std::vector<ParamState> view;
};

inline Padded padded_copy(const std::vector<ParamState>& ps) {
  const int64_t w = cpu_tail_width();
  Padded out;
  for (const ParamState& p : ps) {
    const int64_t n = p.param.numel();
    const int64_t extra = (w - n % w) % w;
    auto pad = [&](const at::Tensor& t) {
      if (t.defined() && t.dim() == 0) {  // a stochastic rounding seed
        return t.clone();
      }
      return t.defined() ? at::cat({t.flatten(), at::zeros({extra}, t.options())}) : t;
    };
    auto view = [&](const at::Tensor& t) { return t.defined() && t.dim() != 0 ? t.narrow(0, 0, n) : t; };
    ParamState full{
        pad(p.param),   pad(p.grad),       pad(p.master),         pad(p.remainder),
        pad(p.exp_avg), pad(p.exp_avg_sq), pad(p.max_exp_avg_sq), p.step.defined() ? p.step.clone() : p.step};
    out.view.push_back({view(full.param), view(full.grad), view(full.master), view(full.remainder), view(full.exp_avg),
                        view(full.exp_avg_sq), view(full.max_exp_avg_sq), full.step});
    out.full.push_back(std::move(full));
  }
  return out;
}

// The FP32 weight of a parameter: its master, the BF16 weight joined with its remainder, or the weight widened
// (with a Kahan compensation or stochastic rounding: the BF16 weight, which the 16-bit check bounds).
inline at::Tensor fp32_weight(const ParamState& p) {
  if (p.master.defined()) {
    return p.master;
  }
  if (p.remainder.defined() && p.remainder.scalar_type() == at::kShort) {
    const at::Tensor high = p.param.view(at::kShort).to(at::kInt).bitwise_and(0xFFFF).__lshift__(16);
    return (high + p.remainder.to(at::kInt)).view(at::kFloat);
  }
  return p.param.to(at::kFloat);
}

// Bitwise checks of NOTE [torch's scalar tail] on each tensor's body, and its tolerance on each tensor's last
// numel % tail_width elements: FP32 values (weights, moments) within kTailRelTolerance of each other, 16-bit
// weights within one unit in their last place. Returns how many tail elements differed at all.
constexpr double kTailRelTolerance = 1e-6;

inline int64_t require_cpu_contract(const std::vector<ParamState>& cpu, const std::vector<ParamState>& cuda) {
  REQUIRE(cpu.size() == cuda.size());
  const int64_t w = cpu_tail_width();
  int64_t differing = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const int64_t n = cpu[i].param.numel();
    const int64_t body = n - n % w;
    INFO("param " << i << ", numel " << n << ", tail from " << body);
    for (auto field : {&ParamState::param, &ParamState::grad, &ParamState::master, &ParamState::remainder,
                       &ParamState::exp_avg, &ParamState::exp_avg_sq, &ParamState::max_exp_avg_sq}) {
      const at::Tensor& a = cpu[i].*field;
      if (!a.defined()) {
        continue;
      }
      const at::Tensor& b = cuda[i].*field;
      if (a.dim() == 0) {  // a stochastic rounding seed: only read
        REQUIRE(bits_equal(a, b));
        continue;
      }
      REQUIRE(bits_equal(a.narrow(0, 0, body), b.narrow(0, 0, body)));
      const at::Tensor ta = a.narrow(0, body, n - body);
      const at::Tensor tb = b.narrow(0, body, n - body);
      differing += ta.ne(tb).sum().item<int64_t>();
    }
    REQUIRE(bits_equal(cpu[i].grad, cuda[i].grad));  // the unscaled grads take no tail formula
    if (cpu[i].step.defined()) {
      REQUIRE(bits_equal(cpu[i].step, cuda[i].step));
    }
    auto close = [&](const at::Tensor& a, const at::Tensor& b, double rtol) {
      const at::Tensor x = a.narrow(0, body, n - body).to(at::kDouble);
      const at::Tensor y = b.narrow(0, body, n - body).to(at::kDouble);
      const at::Tensor bound = at::maximum(x.abs(), y.abs()) * rtol + 1e-30;
      INFO("cpu " << x << "\ncuda " << y);
      REQUIRE((x - y).abs().le(bound).all().item<bool>());
    };
    close(fp32_weight(cpu[i]), fp32_weight(cuda[i]), kTailRelTolerance);
    for (auto field : {&ParamState::exp_avg, &ParamState::exp_avg_sq, &ParamState::max_exp_avg_sq}) {
      if ((cpu[i].*field).defined()) {
        close(cpu[i].*field, cuda[i].*field, kTailRelTolerance);
      }
    }
    const at::ScalarType dtype = cpu[i].param.scalar_type();
    if (dtype != at::kFloat) {  // one rounding of nearly equal FP32 weights: at most one unit apart
      close(cpu[i].param, cuda[i].param, dtype == at::kHalf ? 0x1p-10 : 0x1p-7);
    }
  }
  return differing;
}

// One step sequence run three ways: the emulated CUDA op, the CPU op, and the CPU op on padded copies.
struct StepRuns {
  std::vector<ParamState> cuda;
  std::vector<ParamState> cpu;
  Padded reference;
  int64_t tail_differences = 0;

  explicit StepRuns(const std::vector<ParamState>& initial)
      : cuda(clones(initial)), cpu(clones(initial)), reference(padded_copy(initial)) {}

  void adam(const kern::AdamParams& hp, const Scalars& sc) {
    adam_on(adam_cuda(), cuda, hp, sc);
    adam_on(adam_cpu(), cpu, hp, sc);
    adam_on(adam_cpu(), reference.full, hp, sc);
    check();
  }
  void sgd(const kern::SgdParams& hp, const Scalars& sc) {
    sgd_on(sgd_cuda(), cuda, hp, sc);
    sgd_on(sgd_cpu(), cpu, hp, sc);
    sgd_on(sgd_cpu(), reference.full, hp, sc);
    check();
  }
  // The CUDA op equals the width-0 reference bit for bit, and the CPU op but in the tails.
  void check() {
    require_same_state(reference.view, cuda);
    tail_differences += require_cpu_contract(cpu, cuda);
  }
};

}  // namespace
}  // namespace ampkit::test::emulated
