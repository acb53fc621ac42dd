// GradScaler's spike-aware skipping (options().spike_skip()): the iteration's loss and gradient norm, judged on the
// device against their recent history, and the step skipped as an overflowed one is.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "ampkit/grad_scaler.h"
#include "ampkit/ops.h"
#include "capture.h"
#include "scaler_internal.h"

namespace ampkit {

// NOTE [Spike-aware skipping]
// Large-model runs skip steps whose loss or gradient norm is far above recent history (OLMo-core's
// SkipStepOptimizer, levanter's SkipStepConfig). Here it is one more reason for the skip the scaler already makes:
//   - The signals: the loss handed to scale() (before scaling; summed over the scale() calls that precede the
//     iteration's first step), and, with grad_norm, the L2 norm of the unscaled gradients of the optimizer whose
//     step decides first (ampkit::grad_norm). On the fused path (an optimizer that unscales inline) that norm's
//     pass replaces the read-only inf check (an Inf/NaN makes the norm non-finite): no extra read of the grads.
//     After unscale_ (or on the generic path) the grads are read once more for it.
//   - The decision, taken once per iteration at its first step (prepare_step / prepare_fused_step), on the
//     device: a signal spikes when its value is finite and above mean + sigmas * σ of the finite values of its
//     window (σ the sample standard deviation; at least two finite values), and only once its window holds
//     `warmup` values (a count the host keeps: no sync; hence no CUDA graph capture of the deciding step, which
//     would replay one count and one window slot for ever: refused). Non-finite values are the overflow check's
//     business, never a spike. Each rank sees its own loss: in a multi-process run the decision must be
//     all-reduced (MAX) over the scaler's process group, so that every rank skips together (the Python scaler
//     refuses spike_skip without one when torch.distributed runs several processes).
//   - The skip: the decision joins found_inf for every optimizer of the iteration, so ampkit's optimizers skip on
//     the device (moments, weights, masters and step counts untouched) and torch.optim ones through the scaler's
//     host read; update() backs off only for overflows (a spike is not a scaling problem), counts steps skipped for
//     a spike alone in spike_skipped_steps (not in skipped_steps), and last_step_ran() reports the skip.
//   - update() then pushes the values the decision was taken on (a spike's included, as OLMo-core does: a lasting
//     shift stops being a spike once the window has seen it) into each signal's ring of `window` values; values
//     seen after the decision (a second loss of a GAN iteration) are not pushed, and every update() variant ends
//     the iteration's decision. An iteration abandoned after scale() (an out-of-memory backward caught by the
//     loop, say) leaves its loss to be summed with the next iteration's. The rings, counts and the spike count are
//     in state_dict(), so a resumed run decides as the uninterrupted one.
namespace {

constexpr const char* kSignalNames[2] = {"loss", "grad_norm"};

// Whether work on `device` is being captured into a CUDA graph.
bool capturing(const at::Device& device) {
#if defined(AMPKIT_WITH_CUDA)
  if (device.is_cuda()) {
    return detail::cuda_capture_id(c10::impl::getDeviceGuardImpl(device.type())->getStream(device)) != 0;
  }
#endif
  (void)device;
  return false;
}

// Whether `latest` (FP32 0-dim) spikes against `history` (FP32 [window], NaN: empty): bool 0-dim, on the device.
at::Tensor is_spike(const at::Tensor& history, const at::Tensor& latest, double sigmas) {
  const at::Tensor finite = history.isfinite();
  const at::Tensor count = finite.sum().to(at::kFloat);
  const at::Tensor zeros = at::zeros_like(history);
  const at::Tensor mean = at::where(finite, history, zeros).sum() / count.clamp_min(1.0);
  const at::Tensor var = at::where(finite, (history - mean).square(), zeros).sum() / (count - 1.0).clamp_min(1.0);
  const at::Tensor threshold = mean + sigmas * var.sqrt();
  return (count >= 2.0) & latest.isfinite() & (latest > threshold);
}

}  // namespace

void GradScaler::init_spike_state(const at::Device& device, bool keep_iteration) {
  if (!options_.spike_skip()) {
    return;
  }
  const int64_t window = options_.spike_skip()->window();
  const auto on = at::TensorOptions().device(device).dtype(at::kFloat);
  for (SpikeSignal& s : spike_signals_) {
    at::Tensor history = at::full({window}, std::nan(""), at::TensorOptions().dtype(at::kFloat));
    // The loaded values, oldest first, in the ring slots they were pushed to.
    const int64_t n = static_cast<int64_t>(s.init_history.size());
    for (int64_t i = 0; i < n; ++i) {
      history.select(0, (s.count - n + i) % window).fill_(s.init_history[i]);
    }
    s.history = history.to(device);
    s.filled = n;
    if (!keep_iteration) {
      s.value = at::Tensor();
    }
  }
  if (!keep_iteration) {
    spike_flag_ = at::Tensor();
  }
  spike_skipped_ = at::full({}, init_spike_skipped_, on.dtype(at::kLong));
}

void GradScaler::note_spike_loss(const at::Tensor& outputs) {
  if (!options_.spike_skip() || !options_.spike_skip()->loss() || spike_flag_.defined()) {
    return;
  }
  at::NoGradGuard no_grad;
  const at::Tensor v = outputs.detach().to(at::kFloat).sum().to(scale_.device(), /*non_blocking=*/true);
  at::Tensor& value = spike_signals_[0].value;
  value = value.defined() ? value + v : v;
}

bool GradScaler::spike_norm_in_check(const std::vector<at::Tensor>& grads) const {
  if (!options_.spike_skip() || !options_.spike_skip()->grad_norm() || spike_flag_.defined()) {
    return false;
  }
  return std::all_of(grads.begin(), grads.end(), [](const at::Tensor& g) {
    return g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kFloat;
  });
}

at::Tensor GradScaler::spike_flag(const std::vector<at::Tensor>& grads, bool scaled) {
  if (!options_.spike_skip()) {
    return {};
  }
  if (spike_flag_.defined()) {
    return spike_flag_;
  }
  const SpikeSkipOptions& o = *options_.spike_skip();
  at::NoGradGuard no_grad;
  const at::Device device = scale_.device();
  TORCH_CHECK(!capturing(device),
              "GradScaler: spike_skip cannot be captured in a CUDA graph: its warm-up count "
              "and window position are kept on the host, and a replay would repeat them (NOTE [Spike-aware "
              "skipping]); capture without spike_skip");
  if (o.grad_norm() && !spike_signals_[1].value.defined()) {  // else the check computed it
    // Per device, then the root of the summed squares on the scale's device.
    std::vector<at::Tensor> measured;
    for (const at::Tensor& g : grads) {
      if (!g.defined() || g.numel() == 0) {
        continue;
      }
      const at::Tensor values = g.is_sparse() ? g.coalesce()._values() : g;
      // grad_norm reads FP16, BF16 and FP32
      measured.push_back(values.scalar_type() == at::kDouble ? values.to(at::kFloat) : values);
    }
    at::Tensor sum_sq = at::zeros({}, scale_.options());
    for (const auto& [d, list] : detail::by_device(measured)) {
      const at::Tensor norm = grad_norm(list, scaled ? std::optional<at::Tensor>(scale_.to(d)) : std::nullopt);
      sum_sq = sum_sq + norm.reshape({}).to(device, /*non_blocking=*/true).square();
    }
    spike_signals_[1].value = sum_sq.sqrt();
  }
  const int64_t warmup = o.warmup().value_or(std::min<int64_t>(64, o.window()));
  at::Tensor flag = at::zeros({}, scale_.options().dtype(at::kBool));
  for (int i = 0; i < 2; ++i) {
    const SpikeSignal& s = spike_signals_[i];
    const bool on = i == 0 ? o.loss() : o.grad_norm();
    if (on && s.value.defined() && s.filled >= warmup) {
      flag = flag | is_spike(s.history, s.value, o.sigmas());
    }
  }
  spike_flag_ = flag.to(at::kFloat);
  if (options_.process_group()) {
    std::vector<at::Tensor> tensors{spike_flag_};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    options_.process_group()->allreduce(tensors, opts)->wait();
  }
  return spike_flag_;
}

void GradScaler::end_spike_iteration(const at::Tensor& overflow) {
  if (!options_.spike_skip()) {
    return;
  }
  if (spike_flag_.defined()) {
    // A step that also overflowed is counted in skipped_steps (overflow undefined: update(new_scale), unchecked).
    const at::Tensor spiked = overflow.defined() ? (spike_flag_ > 0) & (overflow.reshape({}) == 0) : spike_flag_ > 0;
    spike_skipped_.add_(spiked.to(at::kLong));
    const int64_t window = options_.spike_skip()->window();
    for (SpikeSignal& s : spike_signals_) {
      if (s.value.defined()) {
        // A non-finite value is kept as NaN: it counts towards the warm-up, not towards the statistics.
        s.history.select(0, s.count % window).copy_(at::where(s.value.isfinite(), s.value, std::nan("")));
        ++s.count;
        s.filled = std::min(s.filled + 1, window);
      }
    }
  }
  for (SpikeSignal& s : spike_signals_) {
    s.value = at::Tensor();
  }
  spike_flag_ = at::Tensor();
}

void GradScaler::spike_state(ScalerState& state) const {
  if (!options_.spike_skip()) {
    return;
  }
  const int64_t window = options_.spike_skip()->window();
  state.emplace_back("spike_skipped_steps",
                     spike_skipped_.defined() ? spike_skipped_.item<int64_t>() : init_spike_skipped_);
  for (int i = 0; i < 2; ++i) {
    const SpikeSignal& s = spike_signals_[i];
    std::vector<double> history;
    if (s.history.defined()) {
      const at::Tensor host = s.history.to(at::kCPU, at::kDouble);
      const double* h = host.const_data_ptr<double>();
      const int64_t n = std::min(s.count, window);
      for (int64_t k = s.count - n; k < s.count; ++k) {
        history.push_back(h[k % window]);
      }
    } else {
      history = s.init_history;
    }
    state.emplace_back(std::string("_spike_") + kSignalNames[i] + "_history", c10::IValue(history));
    state.emplace_back(std::string("_spike_") + kSignalNames[i] + "_count", s.count);
  }
}

GradScaler::SpikeLoad GradScaler::check_spike_state(const ScalerState& state) const {
  SpikeLoad load;
  if (!options_.spike_skip()) {
    return load;  // a state's spike entries are ignored by a scaler without spike skipping
  }
  const int64_t window = options_.spike_skip()->window();
  if (const c10::IValue* v = detail::find_entry(state, "spike_skipped_steps")) {
    TORCH_CHECK_VALUE(v->isInt() && v->toInt() >= 0,
                      "GradScaler.load_state_dict: 'spike_skipped_steps' must be "
                      "an int >= 0, but got ",
                      v->isInt() ? std::to_string(v->toInt()) : v->tagKind());
    load.skipped = v->toInt();
  }
  for (int i = 0; i < 2; ++i) {
    const std::string history_key = std::string("_spike_") + kSignalNames[i] + "_history";
    const std::string count_key = std::string("_spike_") + kSignalNames[i] + "_count";
    const c10::IValue* h = detail::find_entry(state, history_key);
    const c10::IValue* c = detail::find_entry(state, count_key);
    TORCH_CHECK_VALUE((h == nullptr) == (c == nullptr), "GradScaler.load_state_dict: '", history_key, "' and '",
                      count_key, "' come together, but the state has only '", h ? history_key : count_key, "'");
    if (h == nullptr) {
      continue;
    }
    TORCH_CHECK_VALUE(h->isDoubleList(), "GradScaler.load_state_dict: '", history_key,
                      "' must be a list of floats, but got ", h->tagKind());
    TORCH_CHECK_VALUE(c->isInt(), "GradScaler.load_state_dict: '", count_key, "' must be an int, but got ",
                      c->tagKind());
    std::vector<double> history = h->toDoubleVector();
    const int64_t count = c->toInt();
    TORCH_CHECK_VALUE(count >= static_cast<int64_t>(history.size()), "GradScaler.load_state_dict: '", count_key, "' (",
                      count, ") must be at least the length of '", history_key, "' (", history.size(), ")");
    if (static_cast<int64_t>(history.size()) > window) {  // a longer window saved: keep its newest values
      history.erase(history.begin(), history.end() - window);
    }
    load.history[i] = std::move(history);
    load.count[i] = count;
  }
  return load;
}

void GradScaler::apply_spike_state(const SpikeLoad& load) {
  if (!options_.spike_skip()) {
    return;
  }
  init_spike_skipped_ = load.skipped;
  for (int i = 0; i < 2; ++i) {
    spike_signals_[i].init_history = load.history[i];
    spike_signals_[i].count = load.count[i];
  }
  if (scale_.defined()) {
    init_spike_state(scale_.device(), /*keep_iteration=*/true);
  }
}

}  // namespace ampkit
