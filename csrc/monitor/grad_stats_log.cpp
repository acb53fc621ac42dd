// ampkit::GradStatsLog: grad_stats rows and the scaler's statistics as JSON lines (see ampkit/monitor.h).
#include "ampkit/monitor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <iomanip>
#include <map>
#include <optional>
#include <sstream>
#include <vector>

#include "ampkit/ops.h"

namespace ampkit {
namespace {

void write_json_string(std::ostream& os, const std::string& s) {
  os << '"';
  for (const char c : s) {
    switch (c) {
      case '"':
        os << "\\\"";
        break;
      case '\\':
        os << "\\\\";
        break;
      case '\n':
        os << "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          os << "\\u" << std::hex << std::setw(4) << std::setfill('0') << static_cast<int>(c) << std::dec;
        } else {
          os << c;
        }
    }
  }
  os << '"';
}

void write_row(std::ostream& os, const std::string& name, const double* row) {
  const int first_bin = kGradStatsHistFirst + 1;
  const int last_bin = kGradStatsColumns - 2;  // exponent 127
  int lo = first_bin;
  int hi = last_bin;
  while (lo <= hi && row[lo] == 0.0) {
    ++lo;
  }
  while (hi >= lo && row[hi] == 0.0) {
    --hi;
  }
  os << "{\"name\": ";
  write_json_string(os, name);
  os << ", \"max_abs\": " << row[0] << ", \"norm\": " << row[1] << ", \"non_finite\": " << static_cast<int64_t>(row[2])
     << ", \"zeros\": " << static_cast<int64_t>(row[3])
     << ", \"below\": " << static_cast<int64_t>(row[kGradStatsHistFirst])
     << ", \"above\": " << static_cast<int64_t>(row[kGradStatsColumns - 1])
     << ", \"first_exp\": " << (lo <= hi ? kGradStatsHistMinExp + (lo - first_bin) : kGradStatsHistMinExp)
     << ", \"counts\": [";
  for (int k = lo; k <= hi; ++k) {
    os << (k == lo ? "" : ", ") << static_cast<int64_t>(row[k]);
  }
  os << "]}";
}

}  // namespace

GradStatsLog::GradStatsLog(const std::string& path, int64_t every) : path_(path), every_(every) {
  TORCH_CHECK_VALUE(every >= 1, "ampkit::GradStatsLog: every must be >= 1, but got ", every);
  out_.open(path, std::ios::app);
  TORCH_CHECK(out_.good(), "ampkit::GradStatsLog: cannot open '", path, "' for appending");
}

bool GradStatsLog::log(int64_t step, const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                       GradScaler* scaler, bool grads_scaled) {
  if (step % every_ != 0) {
    return false;
  }
  const at::NoGradGuard no_grad;
  // Grads by device, in parameter order within each device.
  std::map<std::string, std::pair<std::vector<std::string>, std::vector<at::Tensor>>> by_device;
  std::vector<std::string> device_order;
  for (const auto& item : named_parameters) {
    const at::Tensor& g = item.value().grad();
    if (!g.defined() || g.layout() != at::kStrided ||
        (g.scalar_type() != at::kHalf && g.scalar_type() != at::kBFloat16 && g.scalar_type() != at::kFloat)) {
      continue;
    }
    const std::string key = g.device().str();
    if (by_device.find(key) == by_device.end()) {
      device_order.push_back(key);
    }
    by_device[key].first.push_back(item.key());
    by_device[key].second.push_back(g);
  }
  // Not when a compressed all-reduce (ampkit::distributed) already unscaled the grads this iteration.
  const bool unscale = scaler != nullptr && grads_scaled && scaler->is_enabled() &&
                       scaler->get_scale_async().defined() && !scaler->grads_unscaled_outside();
  std::ostringstream line;
  line << std::setprecision(17) << "{\"step\": " << step;
  if (scaler != nullptr) {
    const GradScalerStats s = scaler->stats();
    line << ", \"scaler\": {\"scale\": " << s.scale << ", \"steps\": " << s.steps
         << ", \"skipped_steps\": " << s.skipped_steps << ", \"overflows_at_min_scale\": " << s.overflows_at_min_scale
         << "}";
  }
  line << ", \"grads\": [";
  bool first = true;
  for (const std::string& key : device_order) {
    const auto& [names, grads] = by_device[key];
    std::optional<at::Tensor> inv;
    if (unscale) {
      inv = scaler->unscale_factor(grads.front().device());
    }
    const at::Tensor rows = grad_stats(grads, inv).cpu().contiguous();
    const double* data = rows.const_data_ptr<double>();
    for (size_t i = 0; i < names.size(); ++i) {
      line << (first ? "" : ", ");
      write_row(line, names[i], data + i * kGradStatsColumns);
      first = false;
    }
  }
  line << "]}\n";
  out_ << line.str();
  out_.flush();
  TORCH_CHECK(out_.good(), "ampkit::GradStatsLog: writing to '", path_, "' failed");
  return true;
}

}  // namespace ampkit
