// Lookup in a GradScaler state (ScalerState: ordered key/value entries), shared by the scaler's state sources.
#pragma once

#include <string>

#include "ampkit/grad_scaler.h"

namespace ampkit::detail {

// The entry named `key`, or nullptr.
inline const c10::IValue* find_entry(const ScalerState& state, const std::string& key) {
  for (const auto& [k, v] : state) {
    if (k == key) {
      return &v;
    }
  }
  return nullptr;
}

}  // namespace ampkit::detail
