// ampkit::AutocastGuard: torch.autocast for C++ programs, as an RAII scope over ATen's autocast state.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

#include "ampkit/export.h"

namespace ampkit {

// Inside the guard's scope, ops on `device` run under autocast in `dtype` (when `enabled`), exactly as inside
// `with torch.autocast(device, dtype, enabled, cache_enabled)`: on entry it saves the enabled flag, the dtype and
// the cache flag, sets them and increments the nesting count; on exit it decrements the count, clears the cast
// cache when the outermost scope closes (forgetting that leaks every cast weight: pytorch/pytorch#46649) and
// restores what it saved. Autocast state is per thread; the cast cache is process-wide.
//
// Args:
//   device: kCPU or kCUDA (any device type ATen's autocast knows).
//   dtype: the low-precision type, kHalf or kBFloat16.
//   enabled: false runs the scope in full precision (a nested guard can switch autocast off).
//   cache_enabled: keep casts of leaf tensors (weights) for the scope; default: the current setting.
class AMPKIT_API AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true,
                std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

}  // namespace ampkit
