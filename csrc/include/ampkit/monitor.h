// Gradient monitoring for C++ training loops: every `every` steps, one JSON line with the scaler's statistics and
// each parameter's gradient statistics (ampkit::grad_stats: one fused pass per device). `python -m ampkit.monitor
// LOG.jsonl LOGDIR` turns the file into a TensorBoard event file (the records ampkit.monitor.GradMonitor writes
// from Python).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "ampkit/export.h"
#include "ampkit/grad_scaler.h"

namespace ampkit {

// One line per logged step:
//   {"step": S, "scaler": {"scale": .., "steps": .., "skipped_steps": .., "overflows_at_min_scale": ..},
//    "grads": [{"name": "fc.weight", "max_abs": .., "norm": .., "non_finite": N, "zeros": N, "below": N,
//               "above": N, "first_exp": E, "counts": [count of exponent E, E + 1, ...]}, ...]}
// ("scaler" only when a scaler is given; parameters without an FP16/BF16/FP32 dense grad are left out; "below" /
// "above" count exponents outside [-133, 127]; the statistics are of the unscaled grads).
class AMPKIT_API GradStatsLog {
 public:
  // Appends to `path` (created if missing). Throws c10::ValueError if every < 1, c10::Error if the file cannot be
  // opened.
  explicit GradStatsLog(const std::string& path, int64_t every = 100);

  // Writes a line when step % every == 0 and returns true; otherwise does nothing and returns false. Call it after
  // backward; with `scaler` and grads_scaled (before scaler.unscale_ / step), the grads are unscaled by the
  // scaler's 1/scale for the statistics, unless a compressed all-reduce already did (grads_unscaled_outside()). Reads the device (one copy per device, and the scaler's stats).
  bool log(int64_t step, const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
           GradScaler* scaler = nullptr, bool grads_scaled = true);

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int64_t every_;
  std::ofstream out_;
};

}  // namespace ampkit
