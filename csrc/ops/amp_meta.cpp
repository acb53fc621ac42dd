// Meta kernels of the AMP ops: the same argument checks as the real kernels and no data access, so fake-tensor
// tracing (torch.compile, torch.library.opcheck) sees the errors a real call would raise.
#include <torch/library.h>

#include "checks.h"

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

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, Meta, m) {
  m.impl("unscale_and_check_", &ampkit::detail::unscale_and_check_meta);
  m.impl("check_finite_", &ampkit::detail::check_finite_meta);
  m.impl("update_scale_", &ampkit::detail::update_scale_meta);
}

// Sparse tensors reach the sparse dispatch keys before any kernel of ours could name the bad argument; these
// kernels run the checks, which reject every sparse argument with a message naming it.
namespace ampkit::detail {
namespace {

template <auto kCheck, typename... Args>
void reject_sparse(Args... args) {
  kCheck(args...);
  TORCH_INTERNAL_ASSERT(false, "ampkit: a sparse argument passed the layout checks");
}

}  // namespace
}  // namespace ampkit::detail

#define AMPKIT_REGISTER_SPARSE_REJECTS(m)                                                                          \
  m.impl("unscale_and_check_",                                                                                     \
         &ampkit::detail::reject_sparse<&ampkit::detail::check_unscale_and_check_args, at::TensorList,              \
                                        const at::Tensor&, const at::Tensor&>);                                     \
  m.impl("check_finite_",                                                                                          \
         &ampkit::detail::reject_sparse<&ampkit::detail::check_check_finite_args, at::TensorList, const at::Tensor&>); \
  m.impl("update_scale_", &ampkit::detail::reject_sparse<&ampkit::detail::check_update_scale_args, const at::Tensor&, \
                                                         const at::Tensor&, const at::Tensor&, double, double, int64_t>)

TORCH_LIBRARY_IMPL(ampkit, SparseCPU, m) { AMPKIT_REGISTER_SPARSE_REJECTS(m); }
TORCH_LIBRARY_IMPL(ampkit, SparseCUDA, m) { AMPKIT_REGISTER_SPARSE_REJECTS(m); }
