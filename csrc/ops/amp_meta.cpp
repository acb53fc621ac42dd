// Meta kernels of the AMP ops: the same argument checks as the real kernels and no data access, so fake-tensor
// tracing (torch.compile, torch.library.opcheck) sees the errors a real call would raise.
#include <torch/library.h>

#include "checks.h"
#include "optim_common.h"
#include "optim_ops.h"

namespace ampkit::detail {
namespace {

void unscale_and_check_meta(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_and_check_args(grads, found_inf, inv_scale);
}

void check_finite_meta(at::TensorList tensors, const at::Tensor& found_inf) {
  check_check_finite_args(tensors, found_inf);
}

void update_scale_meta(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
  check_update_scale_args(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
}

void update_scale_hysteresis_meta(AMPKIT_UPDATE_SCALE_HYSTERESIS_ARGS) {
  AMPKIT_CHECK_UPDATE_SCALE_HYSTERESIS();
}

void adamw_step_meta(AMPKIT_ADAMW_STEP_ARGS) { AMPKIT_CHECK_ADAMW_STEP("adamw_step_"); }

void sgd_step_meta(AMPKIT_SGD_STEP_ARGS) { AMPKIT_CHECK_SGD_STEP("sgd_step_"); }

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, Meta, m) {
  m.impl("adamw_step_", &ampkit::detail::adamw_step_meta);
  m.impl("sgd_step_", &ampkit::detail::sgd_step_meta);
  m.impl("update_scale_hysteresis_", &ampkit::detail::update_scale_hysteresis_meta);
  m.impl("unscale_and_check_", &ampkit::detail::unscale_and_check_meta);
  m.impl("check_finite_", &ampkit::detail::check_finite_meta);
  m.impl("update_scale_", &ampkit::detail::update_scale_meta);
}

// Sparse tensors reach the sparse dispatch keys before any kernel of ours could name the bad argument. One boxed
// kernel serves every op there: it finds the first sparse argument from the op's schema and names it.
namespace ampkit::detail {
namespace {

void reject_sparse(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor() && v.toTensor().is_sparse()) {
      TORCH_CHECK(false, op.schema().name(), ": ", args[i].name(), " must be a strided (dense) tensor, but got layout ",
                  v.toTensor().layout());
    }
    if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        const at::Tensor t = list[j];
        TORCH_CHECK(!t.is_sparse(), op.schema().name(), ": ", args[i].name(), "[", j,
                    "] must be a strided (dense) tensor, but got layout ", t.layout());
      }
    }
  }
  TORCH_INTERNAL_ASSERT(false, op.schema().name(), ": reached a sparse kernel without a sparse argument");
}

}  // namespace
}  // namespace ampkit::detail

#define AMPKIT_REGISTER_SPARSE_REJECTS(m)                                                                   \
  for (const char* name : {"unscale_and_check_", "check_finite_", "update_scale_", "update_scale_hysteresis_", "adamw_step_",   \
                           "sgd_step_"}) { \
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&ampkit::detail::reject_sparse>());              \
  }

TORCH_LIBRARY_IMPL(ampkit, SparseCPU, m) { AMPKIT_REGISTER_SPARSE_REJECTS(m) }
TORCH_LIBRARY_IMPL(ampkit, SparseCUDA, m) { AMPKIT_REGISTER_SPARSE_REJECTS(m) }
