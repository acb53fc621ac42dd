// GradScaler's state (see <ampkit/grad_scaler.h>): the scale and trackers read back, stats(), the overflow
// report, state_dict() / load_state_dict() (torch.amp.GradScaler's keys first, then ampkit's) and checkpoints.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "ampkit/grad_scaler.h"
#include "scaler_internal.h"

namespace ampkit {
namespace {

// The state_dict keys: torch.amp.GradScaler's first, then ampkit's.
const std::vector<std::string>& state_keys() {
  static const std::vector<std::string> keys = {"scale",
                                                "growth_factor",
                                                "backoff_factor",
                                                "growth_interval",
                                                "_growth_tracker",
                                                "hysteresis",
                                                "_hysteresis_tracker",
                                                "min_scale",
                                                "max_scale",
                                                "steps",
                                                "skipped_steps",
                                                "last_overflow_step",
                                                "_overflows_at_min_scale",
                                                "scaling",
                                                "dynamic",
                                                "spike_skipped_steps",
                                                "_spike_loss_history",
                                                "_spike_loss_count",
                                                "_spike_grad_norm_history",
                                                "_spike_grad_norm_count"};
  return keys;
}

// Typed readers of state_dict values: the message names the key and what was expected.
double number_of(const c10::IValue& v, const std::string& key) {
  TORCH_CHECK_VALUE(v.isDouble() || v.isInt(), "GradScaler.load_state_dict: '", key, "' must be a number, but got ",
                    v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

int64_t int_of(const c10::IValue& v, const std::string& key) {
  TORCH_CHECK_VALUE(v.isInt(), "GradScaler.load_state_dict: '", key, "' must be an int, but got ", v.tagKind());
  return v.toInt();
}

std::optional<double> optional_number_of(const c10::IValue& v, const std::string& key) {
  if (v.isNone()) {
    return std::nullopt;
  }
  return number_of(v, key);
}

using detail::find_entry;

}  // namespace

// ---- state ------------------------------------------------------------------------------------------------------

double GradScaler::get_scale() const {
  if (!enabled_) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

at::Tensor GradScaler::get_scale_async() const { return scale_; }

namespace {

// A tensor of its own over the flag's storage (NOTE [Step-ran flags]): whoever holds it, or a view of it, holds
// the storage. No device memory.
at::Tensor hand_out(const at::Tensor& flag) {
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(flag.storage()), flag.key_set(), flag.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(flag.sizes(), flag.strides(), flag.storage_offset());
  return out;
}

}  // namespace

at::Tensor GradScaler::last_step_ran() const {
  return step_ran_.flags.empty() ? at::Tensor() : hand_out(step_ran_.flags[step_ran_.last]);
}

at::Tensor GradScaler::last_step_ran(int64_t key) const {
  if (std::find(last_stepped_.begin(), last_stepped_.end(), key) == last_stepped_.end()) {
    return {};
  }
  if (last_stepped_.size() == 1) {
    return last_step_ran();
  }
  const FlagPool& pool = step_ran_per_optimizer_.at(key);
  return hand_out(pool.flags[pool.last]);
}

// The setters validate as the constructor does (a bad value changes nothing).
void GradScaler::set_growth_factor(double v) {
  TORCH_CHECK_VALUE(std::isfinite(v) && v > 1.0,
                    "GradScaler.set_growth_factor: the growth factor must be a finite "
                    "number > 1.0, but got ",
                    v);
  growth_factor_ = v;
}

void GradScaler::set_backoff_factor(double v) {
  TORCH_CHECK_VALUE(v > 0.0 && v < 1.0, "GradScaler.set_backoff_factor: the backoff factor must be in (0, 1), but got ",
                    v);
  backoff_factor_ = v;
}

void GradScaler::set_growth_interval(int64_t v) {
  TORCH_CHECK_VALUE(v >= 1 && v <= std::numeric_limits<int32_t>::max(),
                    "GradScaler.set_growth_interval: "
                    "growth_interval must be in [1, 2^31 - 1], but got ",
                    v);
  growth_interval_ = v;
}

int64_t GradScaler::get_growth_tracker() const {
  if (!enabled_) {
    return 0;
  }
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

GradScalerStats GradScaler::stats() const {
  GradScalerStats s;
  s.scale = get_scale();
  if (!enabled_) {
    return s;
  }
  if (stats_.defined()) {
    // One host copy of [stats..., growth_tracker, hysteresis_tracker]: a single sync, and one buffer to read
    // from (a host copy is always a new tensor, on the CPU as on a GPU, so this path is the same everywhere).
    std::vector<at::Tensor> parts{stats_, growth_tracker_.reshape({1}).to(at::kLong),
                                  hysteresis_tracker_.reshape({1}).to(at::kLong)};
    if (spike_skipped_.defined()) {
      parts.push_back(spike_skipped_.reshape({1}));
    }
    const at::Tensor host = at::cat(parts).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    const int64_t* v = host.const_data_ptr<int64_t>();
    s.steps = v[0];
    s.skipped_steps = v[1];
    s.last_overflow_step = v[2];
    s.overflows_at_min_scale = v[3];
    s.growth_tracker = v[4];
    s.hysteresis_tracker = v[5];
    s.spike_skipped_steps = spike_skipped_.defined() ? v[6] : init_spike_skipped_;
  } else {
    s.steps = init_stats_[0];
    s.skipped_steps = init_stats_[1];
    s.last_overflow_step = init_stats_[2];
    s.overflows_at_min_scale = init_stats_[3];
    s.growth_tracker = init_growth_tracker_;
    s.hysteresis_tracker = init_hysteresis_tracker_;
    s.spike_skipped_steps = init_spike_skipped_;
  }
  if (options_.min_scale().has_value()) {
    warn_at_min_scale(s.overflows_at_min_scale, /*may_raise=*/false);  // reading state never raises
  }
  return s;
}

void GradScaler::warn_at_min_scale(int64_t overflows_at_min, bool may_raise) const {
  if (overflows_at_min <= 0) {
    return;
  }
  const std::string msg = "GradScaler: gradients kept overflowing with the loss scale at min_scale (" +
                          std::to_string(*options_.min_scale()) + "), " + std::to_string(overflows_at_min) +
                          " time(s); the scale will not go lower. The model may be diverging, or min_scale is too "
                          "high for it.";
  TORCH_CHECK(!(may_raise && options_.raise_at_min_scale()), msg);
  if (!warned_at_min_) {
    warned_at_min_ = true;
    TORCH_WARN(msg);
  }
}

void GradScaler::set_parameter_names(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters) {
  // Names of parameters that no longer exist are dropped; the others are held by weak reference, so that a
  // parameter allocated later at a freed one's address is never given its name.
  for (auto it = param_names_.begin(); it != param_names_.end();) {
    it = it->second.param.expired() ? param_names_.erase(it) : std::next(it);
  }
  for (const auto& [name, p] : named_parameters) {
    param_names_.insert_or_assign(p.unsafeGetTensorImpl(),
                                  NamedParam{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), name});
  }
}

std::vector<std::string> GradScaler::overflow_report() const {
  TORCH_CHECK(options_.overflow_report(),
              "GradScaler overflow_report(): construct the scaler with the overflow report on to record it "
              "(overflow_report=True in Python, GradScalerOptions().overflow_report(true) in C++)");
  std::vector<std::string> names;
  for (const auto& e : last_report_) {
    if (e.flag.item<float>() == 0.f) {
      continue;
    }
    const auto it = param_names_.find(e.param.unsafeGetTensorImpl());
    if (it != param_names_.end() && it->second.param.lock().get() == e.param.unsafeGetTensorImpl()) {
      names.push_back(it->second.name);
    } else {
      std::ostringstream os;
      os << "param " << e.index << " of optimizer " << e.key << " (" << e.param.sizes() << " " << e.param.scalar_type()
         << ")";
      names.push_back(os.str());
    }
  }
  return names;
}

ScalerState GradScaler::state_dict() const {
  ScalerState d;
  if (!enabled_) {
    return d;
  }
  const GradScalerStats s = stats();
  d.emplace_back("scale", s.scale);
  d.emplace_back("growth_factor", growth_factor_);
  d.emplace_back("backoff_factor", backoff_factor_);
  d.emplace_back("growth_interval", growth_interval_);
  d.emplace_back("_growth_tracker", s.growth_tracker);
  d.emplace_back("hysteresis", options_.hysteresis());
  d.emplace_back("_hysteresis_tracker", s.hysteresis_tracker);
  d.emplace_back("min_scale", options_.min_scale().has_value() ? c10::IValue(*options_.min_scale()) : c10::IValue());
  d.emplace_back("max_scale", options_.max_scale().has_value() ? c10::IValue(*options_.max_scale()) : c10::IValue());
  d.emplace_back("steps", s.steps);
  d.emplace_back("skipped_steps", s.skipped_steps);
  d.emplace_back("last_overflow_step", s.last_overflow_step);
  d.emplace_back("_overflows_at_min_scale", s.overflows_at_min_scale);
  d.emplace_back("scaling", options_.scaling());
  d.emplace_back("dynamic", options_.dynamic());
  spike_state(d);
  return d;
}

void GradScaler::load_state_dict(const ScalerState& state) {
  if (!enabled_) {
    return;
  }
  TORCH_CHECK(state.size() != 0,
              "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  for (const char* required : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TORCH_CHECK_VALUE((find_entry(state, required) != nullptr), "GradScaler.load_state_dict: the state dict has no '",
                      required,
                      "' entry (keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)");
  }
  // Validate everything first: a failed load leaves the scaler as it was.
  if (const c10::IValue* scaling = find_entry(state, "scaling")) {  // absent: torch's state, or ampkit's before it
    TORCH_CHECK_VALUE(scaling->isBool(), "GradScaler.load_state_dict: 'scaling' must be a bool, but got ",
                      scaling->tagKind());
    const bool saved = scaling->toBool();
    TORCH_CHECK_VALUE(saved == options_.scaling(),
                      "GradScaler.load_state_dict: 'scaling' must equal this scaler's "
                      "(scaling=",
                      options_.scaling() ? "True" : "False", "), but the state has scaling=",
                      saved ? "True: it scales the loss" : "False: its scale is fixed at 1 (a BF16 run)",
                      "; build the scaler with scaling=", saved ? "True" : "False", " (GradScalerOptions().scaling(",
                      saved ? "true" : "false", ") in C++) to continue it");
  }
  const double scale = number_of(*find_entry(state, "scale"), "scale");
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0 && scale <= std::numeric_limits<float>::max(),
                    "GradScaler.load_state_dict: 'scale' must be a finite number > 0 that a float32 holds, but got ",
                    scale);
  TORCH_CHECK_VALUE(options_.scaling() || scale == 1.0,
                    "GradScaler.load_state_dict: this scaler was built with "
                    "scaling=False (its scale is fixed at 1), but the state has 'scale' ",
                    scale);
  const double growth = number_of(*find_entry(state, "growth_factor"), "growth_factor");
  TORCH_CHECK_VALUE(std::isfinite(growth) && growth > 1.0,
                    "GradScaler.load_state_dict: 'growth_factor' must be a finite number > 1, but got ", growth);
  const double backoff = number_of(*find_entry(state, "backoff_factor"), "backoff_factor");
  TORCH_CHECK_VALUE(backoff > 0.0 && backoff < 1.0,
                    "GradScaler.load_state_dict: 'backoff_factor' must be in (0, 1), but got ", backoff);
  const int64_t interval = int_of(*find_entry(state, "growth_interval"), "growth_interval");
  TORCH_CHECK_VALUE(interval >= 1 && interval <= std::numeric_limits<int32_t>::max(),
                    "GradScaler.load_state_dict: 'growth_interval' must be in [1, 2^31 - 1], but got ", interval);
  const int64_t tracker = int_of(*find_entry(state, "_growth_tracker"), "_growth_tracker");
  TORCH_CHECK_VALUE(tracker >= 0 && tracker < interval,
                    "GradScaler.load_state_dict: '_growth_tracker' must be in [0, growth_interval), but got ", tracker);
  int64_t hysteresis = options_.hysteresis();
  if ((find_entry(state, "hysteresis") != nullptr)) {
    hysteresis = int_of(*find_entry(state, "hysteresis"), "hysteresis");
    TORCH_CHECK_VALUE(hysteresis >= 1 && hysteresis <= std::numeric_limits<int32_t>::max(),
                      "GradScaler.load_state_dict: 'hysteresis' must be in [1, 2^31 - 1], but got ", hysteresis);
  }
  int64_t hysteresis_tracker = hysteresis;
  if ((find_entry(state, "_hysteresis_tracker") != nullptr)) {
    hysteresis_tracker = int_of(*find_entry(state, "_hysteresis_tracker"), "_hysteresis_tracker");
    TORCH_CHECK_VALUE(hysteresis_tracker >= 0 && hysteresis_tracker <= hysteresis,
                      "GradScaler.load_state_dict: '_hysteresis_tracker' must be in [0, hysteresis], but got ",
                      hysteresis_tracker);
  }
  std::optional<double> min_scale = options_.min_scale();
  std::optional<double> max_scale = options_.max_scale();
  if ((find_entry(state, "min_scale") != nullptr)) {
    min_scale = optional_number_of(*find_entry(state, "min_scale"), "min_scale");
  }
  if ((find_entry(state, "max_scale") != nullptr)) {
    max_scale = optional_number_of(*find_entry(state, "max_scale"), "max_scale");
  }
  const double lo = min_scale.value_or(0.0);
  const double hi = max_scale.value_or(std::numeric_limits<double>::infinity());
  TORCH_CHECK_VALUE(lo >= 0 && std::isfinite(lo) && hi >= lo && !std::isnan(hi),
                    "GradScaler.load_state_dict: 'min_scale' and 'max_scale' must satisfy 0 <= min_scale <= "
                    "max_scale, but got ",
                    lo, " and ", hi);
  TORCH_CHECK_VALUE(!options_.scaling() || (scale >= lo && scale <= hi), "GradScaler.load_state_dict: 'scale' (", scale,
                    ") must lie in [min_scale, max_scale] = [", lo, ", ", hi, "]");
  std::vector<int64_t> stats(4, 0);
  const char* stat_keys[] = {"steps", "skipped_steps", "last_overflow_step", "_overflows_at_min_scale"};
  for (int i = 0; i < 4; ++i) {
    if ((find_entry(state, stat_keys[i]) != nullptr)) {
      stats[i] = int_of(*find_entry(state, stat_keys[i]), stat_keys[i]);
      TORCH_CHECK_VALUE(stats[i] >= 0, "GradScaler.load_state_dict: '", stat_keys[i], "' must be >= 0, but got ",
                        stats[i]);
    }
  }
  TORCH_CHECK_VALUE(stats[1] <= stats[0] && stats[2] <= stats[0],
                    "GradScaler.load_state_dict: 'skipped_steps' and 'last_overflow_step' cannot exceed 'steps'");
  if (const c10::IValue* dynamic = find_entry(state, "dynamic")) {
    TORCH_CHECK_VALUE(dynamic->isBool(), "GradScaler.load_state_dict: 'dynamic' must be a bool, but got ",
                      dynamic->tagKind());
    TORCH_CHECK_VALUE(dynamic->toBool() == options_.dynamic(), "GradScaler.load_state_dict: the state is of a ",
                      dynamic->toBool() ? "dynamic" : "static", "-scale scaler, but this scaler is ",
                      options_.dynamic() ? "dynamic" : "static", " (the dynamic option)");
  }
  const SpikeLoad spike = check_spike_state(state);
  TORCH_CHECK_VALUE(spike.skipped <= stats[0], "GradScaler.load_state_dict: 'spike_skipped_steps' (", spike.skipped,
                    ") cannot exceed 'steps' (", stats[0], ")");

  // Apply.
  init_scale_ = scale;
  growth_factor_ = growth;
  backoff_factor_ = backoff;
  growth_interval_ = interval;
  init_growth_tracker_ = tracker;
  options_.hysteresis(hysteresis);
  options_.min_scale(min_scale);
  options_.max_scale(max_scale);
  init_hysteresis_tracker_ = hysteresis_tracker;
  init_stats_ = stats;
  // A checkpoint taken before the first update() keeps the calibration pending (NOTE [Calibrated first scale]).
  calibrating_ = options_.calibrate() && stats[0] == 0 && find_entry(state, "steps") != nullptr;
  if (scale_.defined()) {
    before_scale_write();
    scale_.fill_(scale);
    scale_written();
    growth_tracker_.fill_(tracker);
    hysteresis_tracker_.fill_(hysteresis_tracker);
    stats_.copy_(at::tensor(stats, at::TensorOptions().dtype(at::kLong)));
  }
  // A copy of the old count still in flight is not the count any more (NOTE [Watching min_scale]).
  min_watch_.stale = min_watch_.pending;
  min_watch_.known = stats[3];
  apply_spike_state(spike);
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  const auto state = state_dict();
  for (const auto& key : state_keys()) {
    if ((find_entry(state, key) != nullptr)) {
      archive.write(key, *find_entry(state, key));
    }
  }
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  ScalerState state;
  for (const auto& key : state_keys()) {
    c10::IValue v;
    if (archive.try_read(key, v)) {
      state.emplace_back(key, v);
    }
  }
  load_state_dict(state);
}

ScalerState GradScaler::read_state(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  ScalerState state;
  for (const auto& key : state_keys()) {
    c10::IValue v;
    if (archive.try_read(key, v)) {
      state.emplace_back(key, v);
    }
  }
  return state;
}

void GradScaler::write_state(const ScalerState& state, const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& key : state_keys()) {
    if ((find_entry(state, key) != nullptr)) {
      archive.write(key, *find_entry(state, key));
    }
  }
  archive.save_to(path);
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace ampkit
