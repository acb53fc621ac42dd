// ampkit::GradScaler (see <ampkit/grad_scaler.h>): torch.amp.GradScaler's state machine and messages over
// ampkit's ops, with persistent device buffers so that a step allocates nothing after the first.
#include "ampkit/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "ampkit/ops.h"
#include "ampkit/optim.h"

namespace ampkit {
namespace {

constexpr const char* kFix =
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration.";

// The state_dict keys: torch.amp.GradScaler's first, then ampkit's.
const std::vector<std::string>& state_keys() {
  static const std::vector<std::string> keys = {
      "scale",         "growth_factor",      "backoff_factor", "growth_interval",    "_growth_tracker",
      "hysteresis",    "_hysteresis_tracker", "min_scale",      "max_scale",          "steps",
      "skipped_steps", "last_overflow_step", "_overflows_at_min_scale"};
  return keys;
}

std::vector<at::Tensor> params_of(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      params.push_back(p);
    }
  }
  return params;
}

int64_t key_of(const torch::optim::Optimizer& optimizer) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&optimizer));
}

void check_options(const GradScalerOptions& o) {
  if (!o.enabled()) {
    return;
  }
  // torch.amp.GradScaler raises AssertionError for these two.
  if (!(o.growth_factor() > 1.0)) {
    throw ScalerAssertionError("The growth factor must be > 1.0.");
  }
  if (!(o.backoff_factor() < 1.0)) {
    throw ScalerAssertionError("The backoff factor must be < 1.0.");
  }
  TORCH_CHECK_VALUE(std::isfinite(o.growth_factor()), "ampkit::GradScaler: growth_factor must be finite, but got ",
                    o.growth_factor());
  TORCH_CHECK_VALUE(o.backoff_factor() > 0.0, "ampkit::GradScaler: backoff_factor must be > 0, but got ",
                    o.backoff_factor());
  TORCH_CHECK_VALUE(std::isfinite(o.init_scale()) && o.init_scale() > 0.0,
                    "ampkit::GradScaler: init_scale must be a finite number > 0, but got ", o.init_scale());
  TORCH_CHECK_VALUE(o.growth_interval() >= 1 && o.growth_interval() <= std::numeric_limits<int32_t>::max(),
                    "ampkit::GradScaler: growth_interval must be in [1, 2^31 - 1], but got ", o.growth_interval());
  TORCH_CHECK_VALUE(o.hysteresis() >= 1 && o.hysteresis() <= std::numeric_limits<int32_t>::max(),
                    "ampkit::GradScaler: hysteresis must be in [1, 2^31 - 1], but got ", o.hysteresis());
  const double lo = o.min_scale().value_or(0.0);
  const double hi = o.max_scale().value_or(std::numeric_limits<double>::infinity());
  TORCH_CHECK_VALUE(lo >= 0.0 && std::isfinite(lo), "ampkit::GradScaler: min_scale must be a finite number >= 0, but got ",
                    lo);
  TORCH_CHECK_VALUE(hi >= lo && !std::isnan(hi), "ampkit::GradScaler: max_scale must be >= min_scale (", lo,
                    "), but got ", hi);
  if (o.scaling()) {
    TORCH_CHECK_VALUE(o.init_scale() >= lo && o.init_scale() <= hi, "ampkit::GradScaler: init_scale (",
                      o.init_scale(), ") must lie in [min_scale, max_scale] = [", lo, ", ", hi, "]");
  }
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

const c10::IValue* find_entry(const ScalerState& state, const std::string& key) {
  for (const auto& [k, v] : state) {
    if (k == key) {
      return &v;
    }
  }
  return nullptr;
}

std::string device_key(int64_t key, const at::Device& device, const char* role) {
  std::ostringstream os;
  os << key << '/' << device << '/' << role;
  return os.str();
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)),
      enabled_(options_.enabled()),
      init_scale_(options_.scaling() ? options_.init_scale() : 1.0),
      growth_factor_(options_.growth_factor()),
      backoff_factor_(options_.backoff_factor()),
      growth_interval_(options_.growth_interval()),
      init_hysteresis_tracker_(options_.hysteresis()) {
  check_options(options_);
}

// ---- device state ---------------------------------------------------------------------------------------------

void GradScaler::lazy_init(const at::Device& device) {
  const auto on = at::TensorOptions().device(device);
  scale_ = at::full({}, init_scale_, on.dtype(at::kFloat));
  growth_tracker_ = at::full({}, init_growth_tracker_, on.dtype(at::kInt));
  hysteresis_tracker_ = at::full({}, init_hysteresis_tracker_, on.dtype(at::kInt));
  stats_ = at::tensor(init_stats_, at::TensorOptions().dtype(at::kLong)).to(device);
  step_ran_ = at::ones({}, on.dtype(at::kBool));
  scale64_ = at::empty({}, on.dtype(at::kDouble));
}

const at::Tensor& GradScaler::check_scale_exists(const char* funcname) const {
  if (!scale_.defined()) {
    throw ScalerAssertionError(std::string("Attempted ") + funcname + " but _scale is None.  " + kFix);
  }
  return scale_;
}

at::Tensor& GradScaler::found_inf_buffer(int64_t key, const at::Device& device, const char* role) {
  at::Tensor& buf = found_inf_buffers_[device_key(key, device, role)];
  if (!buf.defined()) {
    buf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  return buf;
}

const at::Tensor& GradScaler::inv_scale_on(const at::Device& device) {
  // The FP64 reciprocal rounded once to FP32, as torch: scale.double().reciprocal().float().
  at::Tensor& inv = inv_scale_[device.str()];
  if (!inv.defined()) {
    inv = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  scale64_.copy_(scale_);
  scale64_.reciprocal_();
  inv.copy_(scale64_, /*non_blocking=*/true);
  return inv;
}

// ---- the training loop ------------------------------------------------------------------------------------------

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) {
    return outputs;
  }
  if (!scale_.defined()) {
    lazy_init(outputs.device());
  }
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& t : outputs) {
    scaled.push_back(scale(t));
  }
  return scaled;
}

void GradScaler::record_checks(int64_t key, const std::vector<at::Tensor>& params, bool unscale, bool allow_fp16) {
  // Validate before anything is written.
  std::vector<at::Tensor> grads;
  std::vector<size_t> indices;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "ampkit::GradScaler: params[", i, "] is undefined");
    const at::Tensor& g = p.grad();
    if (!g.defined()) {
      continue;
    }
    TORCH_CHECK_VALUE(allow_fp16 || g.scalar_type() != at::kHalf, "Attempting to unscale FP16 gradients.");
    grads.push_back(g);
    indices.push_back(i);
  }
  at::NoGradGuard no_grad;
  for (size_t j = 0; j < grads.size(); ++j) {
    if (grads[j].is_sparse()) {
      at::Tensor& g = const_cast<at::Tensor&>(params[indices[j]]).mutable_grad();
      if (g.scalar_type() == at::kHalf) {
        g = g.coalesce();  // as torch: duplicate FP16 entries could overflow when summed later
      }
      grads[j] = g._values();
    }
  }
  // One call per device (ampkit's ops take mixed dtypes), in order of first appearance.
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> per_device;
  for (const auto& g : grads) {
    auto it = std::find_if(per_device.begin(), per_device.end(), [&](const auto& e) { return e.first == g.device(); });
    if (it == per_device.end()) {
      per_device.emplace_back(g.device(), std::vector<at::Tensor>{});
      it = std::prev(per_device.end());
    }
    it->second.push_back(g);
  }
  PerOptimizer& state = per_optimizer_[key];
  state.found_inf.clear();
  state.report.clear();
  for (auto& [device, list] : per_device) {
    at::Tensor& found = found_inf_buffer(key, device, "found_inf");
    found.zero_();
    if (unscale) {
      unscale_and_check_(list, found, inv_scale_on(device));
    } else {
      check_finite_(list, found);
    }
    state.found_inf.emplace_back(device, found);
  }
  if (options_.overflow_report()) {
    for (size_t j = 0; j < grads.size(); ++j) {
      at::Tensor flag = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(grads[j].device()));
      check_finite_({grads[j]}, flag);
      state.report.push_back({key, indices[j], params[indices[j]], flag});
    }
  }
  if (options_.process_group() && !state.found_inf.empty()) {
    // Every rank must take the same decision: all-reduce (MAX) this optimizer's combined flag.
    at::Tensor combined = combined_found_inf(key);
    std::vector<at::Tensor> tensors{combined};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    options_.process_group()->allreduce(tensors, opts)->wait();
    state.found_inf = {{combined.device(), combined}};
  }
}

at::Tensor GradScaler::combined_found_inf(int64_t key) {
  const auto& list = per_optimizer_[key].found_inf;
  const at::Device device = scale_.device();
  if (list.size() == 1 && list[0].first == device) {
    return list[0].second;
  }
  at::Tensor& sum = found_inf_buffer(key, device, "combined");
  sum.zero_();
  for (const auto& [d, t] : list) {
    sum.add_(t.to(device, /*non_blocking=*/true));
  }
  return sum;
}

void GradScaler::unscale_params_(int64_t key, const std::vector<at::Tensor>& params) {
  if (!enabled_) {
    return;
  }
  check_scale_exists("unscale_");
  const Stage s = stage(key);
  TORCH_CHECK(s != Stage::kUnscaled, "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(s != Stage::kStepped, "unscale_() is being called after step().");
  record_checks(key, params, /*unscale=*/true, /*allow_fp16=*/false);
  per_optimizer_[key].stage = Stage::kUnscaled;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) { unscale_params_(key_of(optimizer), params_of(optimizer)); }

void GradScaler::begin_step(int64_t key) const {
  check_scale_exists("step");
  TORCH_CHECK(stage(key) != Stage::kStepped, "step() has already been called since the last update().");
}

bool GradScaler::prepare_step(int64_t key, const std::vector<at::Tensor>& params) {
  if (stage(key) == Stage::kReady) {
    unscale_params_(key, params);
  }
  const auto& found = per_optimizer_[key].found_inf;
  if (found.empty()) {
    throw ScalerAssertionError("No inf checks were recorded for this optimizer.");
  }
  double total = 0.0;
  for (const auto& [device, t] : found) {
    total += t.item<double>();  // the generic path's one host read, as torch's
  }
  if (total != 0.0) {
    host_saw_overflow_ = true;
  }
  return total == 0.0;
}

std::pair<at::Tensor, at::Tensor> GradScaler::prepare_fused_step(int64_t key, const std::vector<at::Tensor>& params) {
  const at::Tensor& scale = check_scale_exists("_check_inf_per_device");
  const bool still_scaled = stage(key) == Stage::kReady;
  if (still_scaled) {
    record_checks(key, params, /*unscale=*/false, /*allow_fp16=*/true);
  }
  const auto& found = per_optimizer_[key].found_inf;
  at::Tensor found_inf = found.empty() ? found_inf_buffer(key, scale.device(), "combined").zero_()
                                       : combined_found_inf(key);
  return {still_scaled ? scale : at::Tensor(), found_inf};
}

void GradScaler::mark_stepped(int64_t key) { per_optimizer_[key].stage = Stage::kStepped; }

GradScaler::Stage GradScaler::stage(int64_t key) const {
  const auto it = per_optimizer_.find(key);
  return it == per_optimizer_.end() ? Stage::kReady : it->second.stage;
}

std::vector<at::Tensor> GradScaler::found_inf_per_device(int64_t key) const {
  std::vector<at::Tensor> out;
  const auto it = per_optimizer_.find(key);
  if (it != per_optimizer_.end()) {
    for (const auto& [d, t] : it->second.found_inf) {
      out.push_back(t);
    }
  }
  return out;
}

at::Tensor GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    return optimizer.step();
  }
  const int64_t key = key_of(optimizer);
  begin_step(key);
  at::Tensor result;
  if (auto* fused = dynamic_cast<optim::AmpScalingOptimizer*>(&optimizer)) {
    // Sync-free: the optimizer unscales inline and skips on the device.
    auto [grad_scale, found_inf] = prepare_fused_step(key, params_of(optimizer));
    fused->set_amp_scaling(grad_scale, found_inf);
    try {
      result = optimizer.step();
    } catch (...) {
      fused->set_amp_scaling({}, {});
      throw;
    }
    fused->set_amp_scaling({}, {});
  } else if (prepare_step(key, params_of(optimizer))) {
    result = optimizer.step();
  }
  mark_stepped(key);
  return result;
}

void GradScaler::update() {
  if (!enabled_) {
    return;
  }
  const at::Tensor& scale = check_scale_exists("update");
  std::vector<at::Tensor> found;
  for (const auto& [key, state] : per_optimizer_) {
    for (const auto& [device, t] : state.found_inf) {
      found.push_back(t);
    }
  }
  if (found.empty()) {
    throw ScalerAssertionError("No inf checks were recorded prior to update.");
  }
  at::Tensor combined;
  if (found.size() == 1 && found[0].device() == scale.device()) {
    combined = found[0];
  } else {
    combined = found_inf_buffer(0, scale.device(), "update");
    combined.zero_();
    for (const auto& t : found) {
      combined.add_(t.to(scale.device(), /*non_blocking=*/true));
    }
  }
  update_scale_hysteresis_(scale_, growth_tracker_, hysteresis_tracker_, stats_, combined, growth_factor_,
                           backoff_factor_, growth_interval_, options_.hysteresis(), options_.min_scale().value_or(0.0),
                           options_.max_scale().value_or(std::numeric_limits<double>::infinity()),
                           options_.scaling());
  at::eq_out(step_ran_, combined, 0);
  if (options_.overflow_report()) {
    last_report_.clear();
    for (const auto& [key, state] : per_optimizer_) {
      last_report_.insert(last_report_.end(), state.report.begin(), state.report.end());
    }
  }
  if (host_saw_overflow_ && options_.min_scale().has_value()) {
    // The generic path already read found_inf on the host; on its (rare) overflow steps, one more read.
    warn_at_min_scale(stats_[3].item<int64_t>());
  }
  host_saw_overflow_ = false;
  forget_unused_buffers();
  per_optimizer_.clear();
}

void GradScaler::forget_unused_buffers() {
  // Buffers are reused step after step; those of optimizers that took no part in this iteration (replaced or
  // destroyed ones) are released, so that recreating optimizers does not accumulate them.
  for (auto it = found_inf_buffers_.begin(); it != found_inf_buffers_.end();) {
    const int64_t key = std::stoll(it->first.substr(0, it->first.find('/')));
    if (key != 0 && per_optimizer_.count(key) == 0) {
      it = found_inf_buffers_.erase(it);
    } else {
      ++it;
    }
  }
}

void GradScaler::update(double new_scale) {
  if (!enabled_) {
    return;
  }
  check_scale_exists("update");
  scale_.fill_(new_scale);
  per_optimizer_.clear();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!enabled_) {
    return;
  }
  const at::Tensor& scale = check_scale_exists("update");
  const char* reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with "
      "requires_grad=False.";
  if (!new_scale.defined() || new_scale.device().type() != scale.device().type() || new_scale.numel() != 1 ||
      new_scale.requires_grad()) {
    throw ScalerAssertionError(reason);
  }
  scale_.copy_(new_scale);
  per_optimizer_.clear();
}

// ---- state ------------------------------------------------------------------------------------------------------

double GradScaler::get_scale() const {
  if (!enabled_) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

at::Tensor GradScaler::get_scale_async() const { return scale_; }

at::Tensor GradScaler::last_step_ran() const { return step_ran_; }

void GradScaler::set_growth_factor(double v) { growth_factor_ = v; }
void GradScaler::set_backoff_factor(double v) { backoff_factor_ = v; }
void GradScaler::set_growth_interval(int64_t v) { growth_interval_ = v; }

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
    const at::Tensor host = at::cat({stats_, growth_tracker_.reshape({1}).to(at::kLong),
                                       hysteresis_tracker_.reshape({1}).to(at::kLong)})
                                .to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    const int64_t* v = host.const_data_ptr<int64_t>();
    s.steps = v[0];
    s.skipped_steps = v[1];
    s.last_overflow_step = v[2];
    s.overflows_at_min_scale = v[3];
    s.growth_tracker = v[4];
    s.hysteresis_tracker = v[5];
  } else {
    s.steps = init_stats_[0];
    s.skipped_steps = init_stats_[1];
    s.last_overflow_step = init_stats_[2];
    s.overflows_at_min_scale = init_stats_[3];
    s.growth_tracker = init_growth_tracker_;
    s.hysteresis_tracker = init_hysteresis_tracker_;
  }
  if (options_.min_scale().has_value()) {
    warn_at_min_scale(s.overflows_at_min_scale);
  }
  return s;
}

void GradScaler::warn_at_min_scale(int64_t overflows_at_min) const {
  if (overflows_at_min <= 0) {
    return;
  }
  const std::string msg = "ampkit.GradScaler: gradients kept overflowing with the loss scale at min_scale (" +
                          std::to_string(*options_.min_scale()) + "), " + std::to_string(overflows_at_min) +
                          " time(s); the scale will not go lower. The model may be diverging, or min_scale is too "
                          "high for it.";
  TORCH_CHECK(!options_.raise_at_min_scale(), msg);
  if (!warned_at_min_) {
    warned_at_min_ = true;
    TORCH_WARN(msg);
  }
}

void GradScaler::set_parameter_names(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters) {
  for (const auto& [name, p] : named_parameters) {
    param_names_[p.unsafeGetTensorImpl()] = name;
  }
}

std::vector<std::string> GradScaler::overflow_report() const {
  TORCH_CHECK(options_.overflow_report(),
              "ampkit.GradScaler.overflow_report: construct the scaler with overflow_report=True to record it");
  std::vector<std::string> names;
  for (const auto& e : last_report_) {
    if (e.flag.item<float>() == 0.f) {
      continue;
    }
    const auto it = param_names_.find(e.param.unsafeGetTensorImpl());
    if (it != param_names_.end()) {
      names.push_back(it->second);
    } else {
      std::ostringstream os;
      os << "param " << e.index << " of optimizer " << e.key << " (" << e.param.sizes() << " "
         << e.param.scalar_type() << ")";
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
  return d;
}

void GradScaler::load_state_dict(const ScalerState& state) {
  if (!enabled_) {
    return;
  }
  TORCH_CHECK(state.size() != 0,
              "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  for (const char* required : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TORCH_CHECK_VALUE((find_entry(state, required) != nullptr), "GradScaler.load_state_dict: the state dict has no '", required,
                      "' entry (keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)");
  }
  // Validate everything first: a failed load leaves the scaler as it was.
  const double scale = number_of(*find_entry(state, "scale"), "scale");
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "GradScaler.load_state_dict: 'scale' must be a finite number > 0, but got ",
                    scale);
  const double growth = number_of(*find_entry(state, "growth_factor"), "growth_factor");
  TORCH_CHECK_VALUE(std::isfinite(growth) && growth > 0, "GradScaler.load_state_dict: 'growth_factor' must be a finite number > 0, but got ",
                    growth);
  const double backoff = number_of(*find_entry(state, "backoff_factor"), "backoff_factor");
  TORCH_CHECK_VALUE(std::isfinite(backoff) && backoff > 0, "GradScaler.load_state_dict: 'backoff_factor' must be a finite number > 0, but got ",
                    backoff);
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
  if (scale_.defined()) {
    scale_.fill_(scale);
    growth_tracker_.fill_(tracker);
    hysteresis_tracker_.fill_(hysteresis_tracker);
    stats_.copy_(at::tensor(stats, at::TensorOptions().dtype(at::kLong)));
  }
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
