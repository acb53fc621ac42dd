// AutocastGuard: torch.autocast.__enter__ / __exit__, step for step, in C++ (see <ampkit/autocast.h>).
#include "ampkit/autocast.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace ampkit {
namespace {

// As torch.autocast: a CUDA scope where no CUDA device exists runs without autocast, and says so (silently it
// looks like a working FP16 scope whose ops all run in FP32 on the CPU).
// FP16 on a CPU where it runs 3 times or more slower than BF16 (precision_support measures it): said once, where
// the dtype is chosen.
bool enabled_on(c10::DeviceType device, c10::ScalarType dtype, bool enabled) {
  if (enabled && device == c10::DeviceType::CUDA && !at::globalContext().hasCUDA()) {
    TORCH_WARN_ONCE("ampkit::AutocastGuard: device CUDA was asked for, but CUDA is not available here, so autocast "
                    "is disabled for this scope; for the CPU use AutocastGuard(at::kCPU, at::kBFloat16)");
    return false;
  }
  if (enabled && device == c10::DeviceType::CPU && dtype == c10::kHalf) {
    static const std::string advice =
        autocast_dtype_advice(device, dtype, precision_support(c10::Device(c10::DeviceType::CPU)));
    if (!advice.empty()) {
      TORCH_WARN_ONCE("ampkit::AutocastGuard: ", advice);
    }
  }
  return enabled;
}

}  // namespace

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled,
                             std::optional<bool> cache_enabled, const AutocastOverrides& overrides)
    : device_(device),
      pushed_overrides_(false),
      prev_enabled_(at::autocast::is_autocast_enabled(device)),
      prev_dtype_(at::autocast::get_autocast_dtype(device)),
      prev_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {
  TORCH_CHECK_VALUE(dtype == c10::kHalf || dtype == c10::kBFloat16,
                    "ampkit::AutocastGuard: dtype must be Half or BFloat16, but got ", dtype);
  if (!overrides.fp32_ops.empty() || !overrides.lowp_ops.empty()) {
    push_autocast_overrides(device, overrides);  // validates (and installs) before any state changes
    pushed_overrides_ = true;
  }
  at::autocast::set_autocast_enabled(device, enabled_on(device, dtype, enabled));
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled.value_or(prev_cache_enabled_));
}

AutocastGuard::~AutocastGuard() {
  if (pushed_overrides_) {
    pop_autocast_overrides();
  }
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace ampkit
