// Kernels of ampkit's ops for the Autograd dispatch key (NOTE [Autograd kernels]).
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "ampkit/ops.h"
#include "fp8_linear.h"

namespace ampkit::detail {
namespace {

// NOTE [Autograd kernels]
// ampkit's ops have no derivatives, except fp8_linear and fp8_linear_delayed, whose kernels here apply a C++ autograd
// function (NOTE [FP8 linear] in fp8_linear.cpp). Without a kernel for the Autograd key, the dispatcher sends every call through
// torch's boxed autograd fallback, which turns each tensor of each list into an IValue and back before the
// backend kernel runs: about a microsecond per tensor for the optimizer steps' five to eight lists, most of a
// step over thousands of small tensors. These kernels run the op below autograd without boxing, redispatching with
// the key set the dispatcher computed for the call (computing it reads every tensor of every list); results carry
// no grad_fn. After the op they bump the version counter of every tensor it writes (the arguments the schema marks
// `(a!)`), as torch's in-place ops and fused optimizers do, so that autograd refuses a backward through tensors an
// optimizer step changed after they were saved. The optimizer steps' grads are the exception: the step writes them
// only when it stores unscaled grads back (a grad_scale given and write_unscaled_grads), so only then do they get
// a new version; torch's optimizers leave the grads' versions alone too, and a bump on a grad that autograd saved
// would make a later backward through it raise.
void bump(const at::Tensor& t) {
  if (t.defined()) {
    t.unsafeGetTensorImpl()->bump_version();  // torch::autograd::impl::bump_version's body, inlined
  }
}
void bump(at::TensorList list) {
  for (const auto& t : list) {
    bump(t);
  }
}
void bump(const std::optional<at::Tensor>& t) {
  if (t.has_value()) {
    bump(*t);
  }
}
template <typename T>
void bump(const T&) {}  // scalars

// Which arguments the schema of `name` marks as written, and for the optimizer steps that store unscaled grads
// back, the positions of `grads`, `grad_scale` and `write_unscaled_grads` (else -1).
struct WrittenArguments {
  std::vector<bool> written;
  int grads = -1;
  int grad_scale = -1;
  int write_back = -1;
};

WrittenArguments written_arguments(const char* name) {
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").schema();
  WrittenArguments w;
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    w.written.push_back(args[i].alias_info() != nullptr && args[i].alias_info()->isWrite());
    const int at = static_cast<int>(i);
    if (args[i].name() == "grads") {
      w.grads = at;
    } else if (args[i].name() == "grad_scale") {
      w.grad_scale = at;
    } else if (args[i].name() == "write_unscaled_grads") {
      w.write_back = at;
    }
  }
  if (w.write_back < 0) {
    w.grads = -1;  // grads written whenever the schema says so (unscale_and_check_) or never (lamb_step_)
  }
  return w;
}

template <size_t I, typename T>
void note_grads_write(const WrittenArguments& w, const T& arg, bool& scaled, bool& write_back) {
  if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
    if (static_cast<int>(I) == w.grad_scale) {
      scaled = arg.has_value();
    }
  } else if constexpr (std::is_same_v<T, bool>) {
    if (static_cast<int>(I) == w.write_back) {
      write_back = arg;
    }
  }
}

template <auto Fn, const char* Name>
struct BelowAutograd;

template <typename R, typename... A, R (*Fn)(A...), const char* Name>
struct BelowAutograd<Fn, Name> {
  static R run(c10::DispatchKeySet keys, A... args) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").typed<R(A...)>();
    const c10::DispatchKeySet below = keys & c10::after_ADInplaceOrView_keyset;
    if constexpr (std::is_void_v<R>) {
      {
        at::AutoDispatchBelowADInplaceOrView guard;
        op.redispatch(below, args...);
      }
      bump_written(std::index_sequence_for<A...>{}, args...);
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.redispatch(below, args...);
    }
  }

 private:
  template <size_t... I>
  static void bump_written(std::index_sequence<I...>, const A&... args) {
    static const WrittenArguments w = written_arguments(Name);
    bool grads_written = true;
    if (w.grads >= 0) {
      bool scaled = false;
      bool write_back = true;
      (note_grads_write<I>(w, args, scaled, write_back), ...);
      grads_written = scaled && write_back;
    }
    (void)std::initializer_list<int>{
        (w.written.at(I) && (static_cast<int>(I) != w.grads || grads_written) ? (bump(args), 0) : 0)...};
  }
};

#define AMPKIT_OP_NAME(op) constexpr char k_##op[] = "ampkit::" #op;
AMPKIT_OP_NAME(unscale_and_check_)
AMPKIT_OP_NAME(check_finite_)
AMPKIT_OP_NAME(cast_divide_)
AMPKIT_OP_NAME(cast_unscale_and_check_)
AMPKIT_OP_NAME(grad_stats)
AMPKIT_OP_NAME(update_scale_)
AMPKIT_OP_NAME(update_scale_hysteresis_)
AMPKIT_OP_NAME(adamw_step_)
AMPKIT_OP_NAME(sgd_step_)
AMPKIT_OP_NAME(lamb_step_)
AMPKIT_OP_NAME(grad_norm)
AMPKIT_OP_NAME(global_grad_norm)
AMPKIT_OP_NAME(make_optim_state)
AMPKIT_OP_NAME(fp8_quantize)
AMPKIT_OP_NAME(fp8_compute_scale)
AMPKIT_OP_NAME(fp8_update_amax_history_and_scale_)
AMPKIT_OP_NAME(fp8_quantization_stats)
#undef AMPKIT_OP_NAME

}  // namespace
}  // namespace ampkit::detail

#define AMPKIT_BELOW_AUTOGRAD(op) m.impl(#op, TORCH_FN((BelowAutograd<&ampkit::op, k_##op>::run)))

TORCH_LIBRARY_IMPL(ampkit, Autograd, m) {
  using namespace ampkit::detail;
  AMPKIT_BELOW_AUTOGRAD(unscale_and_check_);
  AMPKIT_BELOW_AUTOGRAD(check_finite_);
  AMPKIT_BELOW_AUTOGRAD(cast_divide_);
  AMPKIT_BELOW_AUTOGRAD(cast_unscale_and_check_);
  AMPKIT_BELOW_AUTOGRAD(grad_stats);
  AMPKIT_BELOW_AUTOGRAD(update_scale_);
  AMPKIT_BELOW_AUTOGRAD(update_scale_hysteresis_);
  AMPKIT_BELOW_AUTOGRAD(adamw_step_);
  AMPKIT_BELOW_AUTOGRAD(sgd_step_);
  AMPKIT_BELOW_AUTOGRAD(lamb_step_);
  AMPKIT_BELOW_AUTOGRAD(grad_norm);
  AMPKIT_BELOW_AUTOGRAD(global_grad_norm);
  AMPKIT_BELOW_AUTOGRAD(make_optim_state);
  AMPKIT_BELOW_AUTOGRAD(fp8_quantize);
  AMPKIT_BELOW_AUTOGRAD(fp8_compute_scale);
  AMPKIT_BELOW_AUTOGRAD(fp8_update_amax_history_and_scale_);
  AMPKIT_BELOW_AUTOGRAD(fp8_quantization_stats);
  // The differentiable ops: a C++ autograd function each (NOTE [FP8 linear] in fp8_linear.cpp).
  m.impl("fp8_linear", TORCH_FN(fp8_linear_autograd));
  m.impl("fp8_linear_delayed", TORCH_FN(fp8_linear_delayed_autograd));
}
