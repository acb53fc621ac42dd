// ampkit::GradScaler (see <ampkit/grad_scaler.h>), the training loop: scale, unscale_, step and update, i.e.
// torch.amp.GradScaler's state machine and messages over ampkit's ops, plus the c10d all-reduce of found_inf.
// The reused device buffers live in scaler_buffers.cpp, the state (stats, state_dict, checkpoints) in
// scaler_state.cpp.
#include "ampkit/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "ampkit/distributed.h"
#include "ampkit/ops.h"
#include "scaler_internal.h"

namespace ampkit {
namespace {

// torch.amp.GradScaler's wording, for Python callers.
constexpr const char* kPyFix =
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration.";

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
  TORCH_CHECK_VALUE(lo >= 0.0 && std::isfinite(lo),
                    "ampkit::GradScaler: min_scale must be a finite number >= 0, but got ", lo);
  TORCH_CHECK_VALUE(hi >= lo && !std::isnan(hi), "ampkit::GradScaler: max_scale must be >= min_scale (", lo,
                    "), but got ", hi);
  if (o.calibrate()) {
    TORCH_CHECK_VALUE(o.scaling() && o.dynamic(),
                      "ampkit::GradScaler: calibrate sets a first scale, so it needs a "
                      "dynamic loss scale, but this scaler has ",
                      o.scaling() ? "a static one (dynamic=False)" : "none (scaling=False: the scale is fixed at 1)");
    TORCH_CHECK_VALUE(std::isfinite(o.calibration_margin()) && o.calibration_margin() >= 0.0,
                      "ampkit::GradScaler: calibration_margin must be a finite number >= 0, but got ",
                      o.calibration_margin());
    TORCH_CHECK_VALUE(lo <= 1.0 && hi >= 1.0,
                      "ampkit::GradScaler: calibrate runs its first iteration at scale 1, "
                      "which must lie in [min_scale, max_scale] = [",
                      lo, ", ", hi, "]");
  } else if (o.scaling()) {
    TORCH_CHECK_VALUE(o.init_scale() >= lo && o.init_scale() <= hi, "ampkit::GradScaler: init_scale (", o.init_scale(),
                      ") must lie in [min_scale, max_scale] = [", lo, ", ", hi, "]");
  }
  if (const auto& spike = o.spike_skip()) {
    TORCH_CHECK_VALUE(spike->window() >= 2 && spike->window() <= (int64_t{1} << 24),
                      "ampkit::GradScaler: "
                      "spike_skip window must be in [2, 2^24], but got ",
                      spike->window());
    TORCH_CHECK_VALUE(!spike->warmup() || (*spike->warmup() >= 2 && *spike->warmup() <= spike->window()),
                      "ampkit::GradScaler: spike_skip warmup must be in [2, window] = [2, ", spike->window(),
                      "], but got ", spike->warmup().value_or(0));
    TORCH_CHECK_VALUE(std::isfinite(spike->sigmas()) && spike->sigmas() > 0.0,
                      "ampkit::GradScaler: spike_skip "
                      "sigmas must be a finite number > 0, but got ",
                      spike->sigmas());
    TORCH_CHECK_VALUE(spike->loss() || spike->grad_norm(), "ampkit::GradScaler: spike_skip needs a signal: loss, "
                                                           "grad_norm or both, but both are off");
  }
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined(), "ampkit::GradScaler: params[", i, "] is undefined");
    grads.push_back(params[i].grad());
  }
  return grads;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)),
      enabled_(options_.enabled()),
      init_scale_(options_.scaling() && !options_.calibrate() ? options_.init_scale() : 1.0),
      growth_factor_(options_.growth_factor()),
      backoff_factor_(options_.backoff_factor()),
      growth_interval_(options_.growth_interval()),
      init_hysteresis_tracker_(options_.hysteresis()) {
  check_options(options_);
  calibrating_ = enabled_ && options_.calibrate();
}

// ---- device state ---------------------------------------------------------------------------------------------

void GradScaler::lazy_init(const at::Device& device) {
  const auto on = at::TensorOptions().device(device);
  scale_ = at::full({}, init_scale_, on.dtype(at::kFloat));
  growth_tracker_ = at::full({}, init_growth_tracker_, on.dtype(at::kInt));
  hysteresis_tracker_ = at::full({}, init_hysteresis_tracker_, on.dtype(at::kInt));
  stats_ = at::tensor(init_stats_, at::TensorOptions().dtype(at::kLong)).to(device);
  step_ran_ = FlagPool{{at::ones({}, on.dtype(at::kBool))}, 0};  // NOTE [Step-ran flags]: true before an update()
  step_ran_per_optimizer_.clear();
  last_stepped_.clear();
  scale64_ = at::empty({}, on.dtype(at::kDouble));
  init_spike_state(device);
  scale_written();
}

void GradScaler::lazy_init_state(const at::Device& device) {
  if (!enabled_) {
    return;
  }
  if (scale_.defined()) {
    TORCH_CHECK_VALUE(scale_.device() == device,
                      "GradScaler._lazy_init_scale_growth_tracker: the scaler's state is "
                      "already on ",
                      scale_.device(), ", but got device ", device);
    return;
  }
  lazy_init(device);
}

const at::Tensor& GradScaler::check_scale_exists(const char* funcname) const {
  if (!scale_.defined()) {
    throw ScalerAssertionError(std::string("GradScaler::") + funcname + ": the scaler has no scale yet: call " +
                                   "scaler.scale(loss) in this iteration before " + funcname + "()",
                               std::string("Attempted ") + funcname + " but _scale is None.  " + kPyFix);
  }
  return scale_;
}

// ---- the training loop ------------------------------------------------------------------------------------------

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) {
    return outputs;
  }
  if (!scale_.defined()) {
    lazy_init(outputs.device());
  }
  note_spike_loss(outputs);
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

at::Tensor GradScaler::scale_factor(const at::Tensor& like) {
  TORCH_CHECK(enabled_, "GradScaler scale_factor: the scaler is disabled");
  if (!scale_.defined()) {
    lazy_init(like.device());
  }
  return scale_.to(like.device(), /*non_blocking=*/true, /*copy=*/true);
}

void GradScaler::observe_loss(const at::Tensor& loss) {
  if (enabled_ && scale_.defined()) {
    note_spike_loss(loss);
  }
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& t : outputs) {
    scaled.push_back(scale(t));
  }
  return scaled;
}

void GradScaler::record_checks(int64_t key, const std::vector<at::Tensor>& params, std::vector<at::Tensor> all_grads,
                               bool unscale, bool allow_fp16) {
  // Validate before anything is written.
  TORCH_CHECK_VALUE(all_grads.size() == params.size(), "ampkit::GradScaler: ", params.size(), " params but ",
                    all_grads.size(), " grads");
  std::vector<at::Tensor> grads;
  std::vector<size_t> indices;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "ampkit::GradScaler: params[", i, "] is undefined");
    const at::Tensor& g = all_grads[i];
    if (!g.defined()) {
      continue;
    }
    TORCH_CHECK_VALUE(g.sizes() == p.sizes(), "ampkit::GradScaler: grads[", i, "] has shape ", g.sizes(),
                      " but its parameter has shape ", p.sizes());
    TORCH_CHECK_VALUE(allow_fp16 || g.scalar_type() != at::kHalf, "Attempting to unscale FP16 gradients.");
    grads.push_back(g);
    indices.push_back(i);
  }
  at::NoGradGuard no_grad;
  for (size_t j = 0; j < grads.size(); ++j) {
    if (grads[j].is_sparse()) {
      at::Tensor g = grads[j];
      if (g.scalar_type() == at::kHalf) {
        g = g.coalesce();  // as torch: duplicate FP16 entries could overflow when summed later
        at::Tensor& held = const_cast<at::Tensor&>(params[indices[j]]).mutable_grad();
        if (held.is_same(grads[j])) {
          held = g;  // torch leaves the coalesced grad in .grad
        }
      }
      grads[j] = g._values();
    }
  }
  // One call per device (ampkit's ops take mixed dtypes), in order of first appearance.
  detail::DeviceLists per_device = detail::by_device(grads);
  // The optimizer's entry is made only once the ops have passed their checks: an op that refuses its grads (an
  // overlapping grad, say) leaves the scaler outside an iteration, as it was.
  std::vector<std::pair<at::Device, at::Tensor>> found_inf;
  const at::Tensor amax_before = calibration_amax_;  // restored if an op refuses the grads
  at::Tensor norm_sq;                                // spike_skip's gradient norm, when the check computes it
  const bool norm_in_check = !unscale && spike_norm_in_check(grads);
  try {
    for (auto& [device, list] : per_device) {
      at::Tensor& found = buffer(key, device, BufferRole::kFoundInf);
      found.zero_();
      if (calibrating_) {
        note_calibration_amax(list, /*scaled=*/true);
      }
      if (unscale) {
        unscale_and_check_(list, found, inv_scale_on(device));
      } else if (norm_in_check) {
        // NOTE [Spike-aware skipping]: the norm's pass is the inf check (an Inf/NaN makes the norm non-finite).
        const at::Tensor norm = grad_norm(list, scale_.to(device)).reshape({});
        found.copy_(norm.isfinite().logical_not());
        const at::Tensor sq = norm.to(scale_.device(), /*non_blocking=*/true).square();
        norm_sq = norm_sq.defined() ? norm_sq + sq : sq;
      } else {
        check_finite_(list, found);
      }
      found_inf.emplace_back(device, found);
    }
    if (norm_sq.defined()) {
      spike_signals_[1].value = norm_sq.sqrt();
    }
  } catch (...) {
    calibration_amax_ = amax_before;
    throw;
  }
  PerOptimizer& state = per_optimizer_[key];
  state.found_inf = std::move(found_inf);
  state.report.clear();
  if (options_.overflow_report()) {
    for (size_t j = 0; j < grads.size(); ++j) {
      // A flag per parameter, reused across iterations: the report allocates nothing after the first step.
      at::Tensor flag = buffer(key, grads[j].device(), BufferRole::kReportFlag, static_cast<int64_t>(indices[j]));
      flag.zero_();
      check_finite_({grads[j]}, flag);
      state.report.push_back({key, indices[j], params[indices[j]], flag});
    }
  }
  if (options_.process_group() && !state.found_inf.empty()) {
    // Every rank must take the same decision: all-reduce (MAX) this optimizer's combined flag.
    at::Tensor combined = combined_found_inf(key);
    all_reduce_found_inf(combined);
    state.found_inf = {{combined.device(), combined}};
  }
}

at::Tensor GradScaler::combined_found_inf(int64_t key) {
  const auto& list = per_optimizer_[key].found_inf;
  const at::Device device = scale_.device();
  if (list.size() == 1 && list[0].first == device) {
    return list[0].second;
  }
  at::Tensor& sum = buffer(key, device, BufferRole::kCombined);
  sum.zero_();
  for (const auto& [d, t] : list) {
    sum.add_(t.to(device, /*non_blocking=*/true));
  }
  return sum;
}

void GradScaler::unscale_params_(int64_t key, const std::vector<at::Tensor>& params) {
  if (enabled_) {
    unscale_params_(key, params, grads_of(params));
  }
}

void GradScaler::unscale_params_(int64_t key, const std::vector<at::Tensor>& params,
                                 const std::vector<at::Tensor>& grads) {
  if (!enabled_) {
    return;
  }
  check_scale_exists("unscale_");
  const Stage s = stage(key);
  TORCH_CHECK(s != Stage::kUnscaled, "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(s != Stage::kStepped, "unscale_() is being called after step().");
  if (recorded_count_ > 0) {  // NOTE [Grads unscaled outside the scaler]
    if (!external_found_inf_.defined()) {
      external_found_inf_ = consume_recorded_flags();  // once per iteration, on this stream
    }
    if (options_.process_group() && !external_reduced_) {
      // The recorded flag agrees across the all-reduce's group; the scaler's group may be larger (pipeline or
      // tensor parallel around data parallel): every rank of it must take the same decision.
      all_reduce_found_inf(external_found_inf_);
      external_reduced_ = true;
    }
    if (calibrating_) {  // the all-reduce unscaled them
      std::vector<at::Tensor> unscaled;
      for (const at::Tensor& g : grads) {
        if (g.defined()) {
          unscaled.push_back(g.is_sparse() ? g._values() : g);
        }
      }
      note_calibration_amax(unscaled, /*scaled=*/false);
    }
    PerOptimizer& state = per_optimizer_[key];
    state.found_inf = {{external_found_inf_.device(), external_found_inf_}};
    state.report.clear();
  } else {
    record_checks(key, params, grads, /*unscale=*/true, /*allow_fp16=*/false);
  }
  per_optimizer_[key].stage = Stage::kUnscaled;
}

at::Tensor GradScaler::unscale_factor(const at::Device& device) {
  check_scale_exists("unscale_factor");
  return inv_scale_on(device).reshape({1});
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  unscale_params_(key_of(optimizer), params_of(optimizer));
}

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
    total += t.item<double>();  // the generic path's host read, as torch's
  }
  const at::Tensor spike = spike_flag(grads_of(params), /*scaled=*/false);  // NOTE [Spike-aware skipping]
  if (total == 0.0 && spike.defined()) {
    total = spike.item<double>();
  }
  return total == 0.0;
}

std::pair<at::Tensor, at::Tensor> GradScaler::prepare_fused_step(int64_t key, const std::vector<at::Tensor>& params) {
  check_scale_exists("_check_inf_per_device");
  return prepare_fused_step(key, params, stage(key) == Stage::kReady ? grads_of(params) : std::vector<at::Tensor>());
}

std::pair<at::Tensor, at::Tensor> GradScaler::prepare_fused_step(int64_t key, const std::vector<at::Tensor>& params,
                                                                 const std::vector<at::Tensor>& grads) {
  const at::Tensor& scale = check_scale_exists("_check_inf_per_device");
  bool still_scaled = stage(key) == Stage::kReady;
  if (still_scaled && recorded_count_ > 0) {  // NOTE [Grads unscaled outside the scaler]
    unscale_params_(key, params, grads);
    still_scaled = false;
  } else if (still_scaled) {
    record_checks(key, params, grads, /*unscale=*/false, /*allow_fp16=*/true);
  }
  const auto& found = per_optimizer_[key].found_inf;
  at::Tensor found_inf =
      found.empty() ? buffer(key, scale.device(), BufferRole::kCombined).zero_() : combined_found_inf(key);
  // NOTE [Spike-aware skipping]: a spike skips the step as an overflow does.
  const at::Tensor spike = spike_flag(grads.empty() ? grads_of(params) : grads, still_scaled);
  if (spike.defined()) {
    found_inf = at::add_out(buffer(key, scale.device(), BufferRole::kSpikeStep), found_inf, spike);
  }
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
  if (auto* fused = dynamic_cast<AmpScalingOptimizer*>(&optimizer)) {
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

at::Tensor GradScaler::last_step_ran(const torch::optim::Optimizer& optimizer) const {
  return last_step_ran(key_of(optimizer));
}

at::Tensor GradScaler::minimize(torch::optim::Optimizer& optimizer) {
  at::Tensor result = step(optimizer);
  update();
  return result;
}

void GradScaler::update() {
  if (!enabled_) {
    return;
  }
  const at::Tensor& scale = check_scale_exists("update");
  if (!reduce_with_found_inf_.empty()) {  // no found_inf all-reduce carried them
    const std::vector<at::Tensor> pending = std::move(reduce_with_found_inf_);
    reduce_with_found_inf_.clear();
    distributed::all_reduce_max(pending, options_.process_group());
  }
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
    combined = buffer(0, scale.device(), BufferRole::kUpdate);
    combined.zero_();
    for (const auto& t : found) {
      combined.add_(t.to(scale.device(), /*non_blocking=*/true));
    }
  }
  before_scale_write();
  update_scale_hysteresis_(scale_, growth_tracker_, hysteresis_tracker_, stats_, combined, growth_factor_,
                           backoff_factor_, growth_interval_, options_.hysteresis(), options_.min_scale().value_or(0.0),
                           options_.max_scale().value_or(std::numeric_limits<double>::infinity()),
                           options_.scaling() && options_.dynamic());
  if (calibrating_) {
    apply_calibration(combined);
  }
  scale_written();
  // A spike skipped the steps too, without backing off (NOTE [Spike-aware skipping]).
  const at::Tensor skipped = spike_flag_.defined() ? combined + spike_flag_ : combined;
  // Into a flag nobody holds (NOTE [Step-ran flags]): flags collected step after step keep their own values.
  at::logical_not_out(next_step_ran_flag(step_ran_), skipped);
  // Per optimizer: its own flag when several took part; with one, last_step_ran(key) is the iteration's flag.
  // Only optimizers that stepped (one only unscaled, for clipping or logging, reports nothing). Pools are dropped
  // only in iterations of several optimizers, so a loop alternating one and two (a WGAN) reuses its flags.
  last_stepped_.clear();
  for (const auto& [key, state] : per_optimizer_) {
    if (state.stage == Stage::kStepped) {
      last_stepped_.push_back(key);
    }
  }
  if (last_stepped_.size() > 1) {
    for (auto it = step_ran_per_optimizer_.begin(); it != step_ran_per_optimizer_.end();) {
      const bool kept = std::find(last_stepped_.begin(), last_stepped_.end(), it->first) != last_stepped_.end();
      it = kept ? std::next(it) : step_ran_per_optimizer_.erase(it);
    }
  }
  if (last_stepped_.size() > 1) {
    for (const int64_t key : last_stepped_) {
      const at::Tensor own = combined_found_inf(key);
      at::logical_not_out(next_step_ran_flag(step_ran_per_optimizer_[key]),
                          spike_flag_.defined() ? own + spike_flag_ : own);
    }
  }
  if (options_.overflow_report()) {
    last_report_.clear();
    for (const auto& [key, state] : per_optimizer_) {
      last_report_.insert(last_report_.end(), state.report.begin(), state.report.end());
    }
  }
  end_spike_iteration(combined);
  // The iteration is closed before anything may raise: a raise at min_scale leaves the scaler usable and savable.
  end_iteration();
  // Overflows at min_scale reach the host without a sync (NOTE [Watching min_scale]), on the generic and the
  // fused path alike, until the warning has been given (every update() with raise_at_min_scale).
  watch_min_scale();
}

void GradScaler::check_new_scale_allowed() const {
  TORCH_CHECK(options_.scaling(),
              "GradScaler update(new_scale): this scaler was built without loss scaling "
              "(scaling=False in Python, GradScalerOptions().scaling(false) in C++), so its scale is fixed at 1 (a "
              "BF16 run); build it with scaling on to set a scale");
  TORCH_CHECK(options_.dynamic(),
              "GradScaler update(new_scale): this scaler has a static loss scale (dynamic=False "
              "in Python, GradScalerOptions().dynamic(false) in C++), fixed at ",
              init_scale_, "; build a dynamic one to change the scale");
}

void GradScaler::update(double new_scale) {
  if (!enabled_) {
    return;
  }
  check_scale_exists("update");
  check_new_scale_allowed();
  TORCH_CHECK_VALUE(std::isfinite(new_scale) && new_scale > 0.0,
                    "GradScaler update(new_scale): new_scale must be a finite number > 0, but got ", new_scale);
  before_scale_write();
  scale_.fill_(new_scale);
  scale_written();
  calibrating_ = false;  // the caller chose the scale (NOTE [Calibrated first scale])
  end_spike_iteration(at::Tensor());
  end_iteration();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!enabled_) {
    return;
  }
  const at::Tensor& scale = check_scale_exists("update");
  const char* py_reason = "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with "
                          "requires_grad=False.";
  if (!new_scale.defined() || new_scale.device().type() != scale.device().type() || new_scale.numel() != 1 ||
      new_scale.requires_grad()) {
    std::ostringstream got;
    if (new_scale.defined()) {
      got << new_scale.numel() << " element(s) on " << new_scale.device()
          << (new_scale.requires_grad() ? ", requires_grad" : "");
    } else {
      got << "an undefined tensor";
    }
    throw ScalerAssertionError("GradScaler::update: new_scale must be a one-element tensor on the scaler's device "
                               "type (" +
                                   c10::DeviceTypeName(scale.device().type(), true) +
                                   ") without requires_grad, but got " + got.str(),
                               py_reason);
  }
  check_new_scale_allowed();
  // A manual override, off the hot path: its value is read (one sync) and checked as update(double) checks it.
  const double value = new_scale.item<double>();
  TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0,
                    "GradScaler update(new_scale): new_scale must be a finite number > 0, but got ", value);
  before_scale_write();
  scale_.copy_(new_scale);
  scale_written();
  calibrating_ = false;
  end_spike_iteration(at::Tensor());
  end_iteration();
}

}  // namespace ampkit
