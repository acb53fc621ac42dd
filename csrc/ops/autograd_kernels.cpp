// Kernels of ampkit's ops for the Autograd dispatch key (NOTE [Autograd kernels]).
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "ampkit/ops.h"

namespace ampkit::detail {
namespace {

// NOTE [Autograd kernels]
// ampkit's ops have no derivatives. Without a kernel for the Autograd key, the dispatcher sends every call through
// torch's boxed autograd fallback, which turns each tensor of each list into an IValue and back before the
// backend kernel runs: about a microsecond per tensor for the optimizer steps' five to eight lists, most of a
// step over thousands of small tensors. These kernels run the op below autograd without boxing, with what the
// fallback does for these ops: results without a grad_fn, version counters as the backend leaves them.
template <auto Fn>
struct BelowAutograd;

template <typename R, typename... A, R (*Fn)(A...)>
struct BelowAutograd<Fn> {
  static R run(A... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return Fn(args...);
  }
};

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, Autograd, m) {
  using ampkit::detail::BelowAutograd;
  m.impl("unscale_and_check_", TORCH_FN(BelowAutograd<&ampkit::unscale_and_check_>::run));
  m.impl("check_finite_", TORCH_FN(BelowAutograd<&ampkit::check_finite_>::run));
  m.impl("cast_divide_", TORCH_FN(BelowAutograd<&ampkit::cast_divide_>::run));
  m.impl("cast_unscale_and_check_", TORCH_FN(BelowAutograd<&ampkit::cast_unscale_and_check_>::run));
  m.impl("grad_stats", TORCH_FN(BelowAutograd<&ampkit::grad_stats>::run));
  m.impl("update_scale_", TORCH_FN(BelowAutograd<&ampkit::update_scale_>::run));
  m.impl("update_scale_hysteresis_", TORCH_FN(BelowAutograd<&ampkit::update_scale_hysteresis_>::run));
  m.impl("adamw_step_", TORCH_FN(BelowAutograd<&ampkit::adamw_step_>::run));
  m.impl("sgd_step_", TORCH_FN(BelowAutograd<&ampkit::sgd_step_>::run));
  m.impl("lamb_step_", TORCH_FN(BelowAutograd<&ampkit::lamb_step_>::run));
  m.impl("grad_norm", TORCH_FN(BelowAutograd<&ampkit::grad_norm>::run));
}
