// The one TORCH_LIBRARY block of ampkit: every op schema, declared once. Each backend registers its kernels next
// to their implementation (<op>_cpu.cpp, <op>_cuda.cpp, meta_kernels.cpp).
#include <torch/library.h>

TORCH_LIBRARY(ampkit, m) {
  // Mutating ops return () so that functionalization (torch.compile) can rewrite them.
  m.def("unscale_and_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()",
        {at::Tag::pt2_compliant_tag});
  m.def("check_finite_(Tensor[] tensors, Tensor(a!) found_inf) -> ()", {at::Tag::pt2_compliant_tag});
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval) -> ()",
      {at::Tag::pt2_compliant_tag});
  // The GradScaler's update: update_scale_ plus hysteresis, [min_scale, max_scale] bounds, a fixed-scale mode
  // and int64 step statistics [steps, skipped, last overflow step, overflows at min_scale], all on the device.
  m.def(
      "update_scale_hysteresis_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor(d!) stats, Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale, bool dynamic) -> ()",
      {at::Tag::pt2_compliant_tag});
}
