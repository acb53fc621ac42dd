// Sparse (COO, CSR...), quantized and nested tensors reach their own dispatch keys before any kernel of ours could
// name the bad argument. One boxed kernel serves every ampkit op on those keys: it finds the first such argument
// from the op's schema and names it.
#include <torch/library.h>

#include <sstream>
#include <string>

namespace ampkit::detail {
namespace {

// What is wrong with `t` for an ampkit op, or "" when it is a plain strided tensor.
std::string what_is_wrong(const at::Tensor& t) {
  if (!t.defined()) {
    return "";
  }
  std::ostringstream os;
  if (t.is_nested()) {
    os << "a nested tensor";
  } else if (t.is_quantized()) {
    os << "a quantized tensor (" << t.scalar_type() << ")";
  } else if (t.layout() != at::kStrided) {
    os << "layout " << t.layout();
  }
  return os.str();
}

void reject_layouts(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      const std::string wrong = what_is_wrong(v.toTensor());
      TORCH_CHECK(wrong.empty(), op.schema().name(), ": ", args[i].name(),
                  " must be a strided (dense) tensor, but got ", wrong);
    }
    if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        const std::string wrong = what_is_wrong(list[j]);
        TORCH_CHECK(wrong.empty(), op.schema().name(), ": ", args[i].name(), "[", j,
                    "] must be a strided (dense) tensor, but got ", wrong);
      }
    }
  }
  TORCH_INTERNAL_ASSERT(false, op.schema().name(), ": reached a non-strided kernel without a non-strided argument");
}

void register_rejects(torch::Library& m) {
  for (const char* name :
       {"unscale_and_check_", "check_finite_", "cast_divide_", "cast_unscale_and_check_", "grad_stats", "update_scale_",
        "update_scale_hysteresis_", "adamw_step_", "sgd_step_", "lamb_step_", "grad_norm", "fp8_quantize",
        "fp8_compute_scale", "fp8_update_amax_history_and_scale_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&reject_layouts>());
  }
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, SparseCPU, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, SparseCUDA, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, SparseCsrCPU, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, SparseCsrCUDA, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, QuantizedCPU, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, QuantizedCUDA, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, NestedTensorCPU, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, NestedTensorCUDA, m) { ampkit::detail::register_rejects(m); }
TORCH_LIBRARY_IMPL(ampkit, AutogradNestedTensor, m) { ampkit::detail::register_rejects(m); }
