// Meta kernels of every ampkit op: the same argument checks as the real kernels and no data access, so
// fake-tensor tracing (torch.compile, torch.library.opcheck) sees the errors a real call would raise.
#include <torch/library.h>

#include "op_kernels.h"

TORCH_LIBRARY_IMPL(ampkit, Meta, m) {
  using namespace ampkit::detail;
  m.impl("unscale_and_check_", &unscale_and_check_kernel<nullptr>);
  m.impl("check_finite_", &check_finite_kernel<nullptr>);
  m.impl("cast_divide_", &cast_divide_kernel<nullptr>);
  m.impl("cast_unscale_and_check_", &cast_unscale_and_check_kernel<nullptr>);
  m.impl("grad_stats", &grad_stats_kernel<grad_stats_result>);
  m.impl("update_scale_", &update_scale_kernel<nullptr>);
  m.impl("update_scale_hysteresis_", &update_scale_hysteresis_kernel<nullptr>);
  m.impl("adamw_step_", &adamw_step_kernel<nullptr>);
  m.impl("sgd_step_", &sgd_step_kernel<nullptr>);
  m.impl("lamb_step_", &lamb_step_kernel<nullptr>);
  m.impl("grad_norm", &grad_norm_kernel<grad_norm_result>);
  m.impl("fp8_quantize", &fp8_quantize_kernel<nullptr>);
  m.impl("fp8_compute_scale", &fp8_compute_scale_kernel<nullptr>);
  m.impl("fp8_update_amax_history_and_scale_", &fp8_update_amax_history_and_scale_kernel<nullptr>);
}
