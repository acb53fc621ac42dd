// Sparse tensors reach the sparse dispatch keys before any kernel of ours could name the bad argument. One boxed
// kernel serves every ampkit op there: it finds the first sparse argument from the op's schema and names it.
#include <torch/library.h>

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

void register_rejects(torch::Library& m) {
  for (const char* name : {"unscale_and_check_", "check_finite_", "update_scale_", "update_scale_hysteresis_",
                           "adamw_step_", "sgd_step_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&reject_sparse>());
  }
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, SparseCPU, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, SparseCUDA, m) { ampkit::detail::register_rejects(m); }
