// Helpers shared by the scaler's sources: a lookup in a GradScaler state (ScalerState: ordered key/value entries),
// and tensors grouped by device.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

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

using DeviceLists = std::vector<std::pair<at::Device, std::vector<at::Tensor>>>;

// `tensors` grouped by device, the devices in order of first appearance (one op call per device).
inline DeviceLists by_device(const std::vector<at::Tensor>& tensors) {
  DeviceLists lists;
  for (const at::Tensor& t : tensors) {
    auto it = std::find_if(lists.begin(), lists.end(), [&](const auto& e) { return e.first == t.device(); });
    if (it == lists.end()) {
      lists.emplace_back(t.device(), std::vector<at::Tensor>{});
      it = std::prev(lists.end());
    }
    it->second.push_back(t);
  }
  return lists;
}

}  // namespace ampkit::detail
