// ampkit::GradScaler: dynamic loss scaling for LibTorch training loops, with torch.amp.GradScaler's semantics
// (READY/UNSCALED/STEPPED stages, error messages, FP64 reciprocal, state_dict keys), plus hysteresis, scale
// bounds, a fixed-scale BF16 mode, step statistics kept on the device, an opt-in overflow report and a c10d
// process group over which found_inf is all-reduced. ampkit.GradScaler (Python) is this same class.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <stdexcept>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ampkit/export.h"

namespace ampkit {

// The interface GradScaler::step() calls on an optimizer that unscales and skips on the device itself (torch's
// scaler duck-types the same thing as `_step_supports_amp_scaling`): before the optimizer's step() the scaler
// hands it grad_scale (divide grads by it; undefined: already unscaled) and found_inf (nonzero: write nothing),
// and clears both after it. ampkit's optimizers implement it; the scaler needs nothing else from them.
class AMPKIT_API AmpScalingOptimizer {
 public:
  virtual ~AmpScalingOptimizer() = default;
  virtual void set_amp_scaling(at::Tensor grad_scale, at::Tensor found_inf) = 0;
};

// Options of spike-aware skipping (NOTE [Spike-aware skipping] in csrc/scaler/scaler_spike.cpp): a step whose loss
// or gradient norm is far above its recent history is skipped as an overflowed one is, on the device, without
// backing off the scale. Defaults as OLMo-core's SkipStepOptimizer. GradScalerOptions().spike_skip(
// SpikeSkipOptions().sigmas(6)); Python: GradScaler(spike_skip=True) or spike_skip={"sigmas": 6, ...}.
struct AMPKIT_API SpikeSkipOptions {
  // Values kept per signal (>= 2): a step's value is judged against the mean and sample σ of the last `window`.
  TORCH_ARG(int64_t, window) = 128;
  // A value above mean + sigmas * σ is a spike (finite, > 0).
  TORCH_ARG(double, sigmas) = 6.0;
  // No step is skipped before the window holds this many values of a signal (in [2, window]; none: 64, or the
  // window when it is shorter).
  TORCH_ARG(std::optional<int64_t>, warmup) = std::nullopt;
  // The signals: the loss handed to scale() (summed over the scale() calls before the iteration's first step),
  // and the L2 norm of the unscaled gradients of the optimizer whose step decides first (with ampkit's optimizers
  // computed by the inf check's pass; after unscale_ or with torch::optim ones, one extra read of the grads).
  TORCH_ARG(bool, loss) = true;
  TORCH_ARG(bool, grad_norm) = false;
};

// Options of GradScaler; LibTorch TORCH_ARG style: GradScalerOptions().init_scale(1024).hysteresis(2).
struct AMPKIT_API GradScalerOptions {
  // Initial scale factor.
  TORCH_ARG(double, init_scale) = 65536.0;
  // Multiplier after growth_interval consecutive clean steps (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  // Multiplier on overflow (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  // Consecutive clean steps before the scale grows (>= 1).
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // false: scale() returns its input, step() just steps, the other methods do nothing.
  TORCH_ARG(bool, enabled) = true;
  // The scale backs off at the hysteresis-th overflow since the last growth (1: every overflow, as torch).
  TORCH_ARG(int64_t, hysteresis) = 1;
  // Bounds of the dynamic scale; none by default (torch's behaviour).
  TORCH_ARG(std::optional<double>, min_scale) = std::nullopt;
  TORCH_ARG(std::optional<double>, max_scale) = std::nullopt;
  // When overflows continue at min_scale: warn once (false) or raise (true), from update(); on a GPU an update()
  // learns of the count without a sync, so possibly one update() late (NOTE [Watching min_scale]).
  TORCH_ARG(bool, raise_at_min_scale) = false;
  // false: the scale is fixed at 1 (BF16 runs); grads are still checked and non-finite steps skipped. Recorded
  // in state_dict() ("scaling").
  TORCH_ARG(bool, scaling) = true;
  // false: a static loss scale (Apex's loss_scale=128, Paddle's use_dynamic_loss_scaling=False): the scale stays
  // at init_scale; non-finite steps are still skipped and counted. Recorded in state_dict() ("dynamic").
  TORCH_ARG(bool, dynamic) = true;
  // true: a calibrated first scale (NOTE [Calibrated first scale]). The first iteration runs at scale 1 whatever
  // init_scale says, and its update() sets the scale to 2^floor(log2(65504 / (amax * 2^calibration_margin))),
  // amax the largest |gradient| of the optimizers checked in it, clamped to [min_scale, max_scale] (at most 2^32
  // without max_scale); no sync.
  // Python: GradScaler(init_scale="auto"). Needs scaling and dynamic.
  TORCH_ARG(bool, calibrate) = false;
  // Headroom of the calibrated scale in powers of two (finite, >= 0): the largest gradient lands at or below
  // 65504 / 2^calibration_margin.
  TORCH_ARG(double, calibration_margin) = 2.0;
  // Spike-aware skipping; none by default.
  TORCH_ARG(std::optional<SpikeSkipOptions>, spike_skip) = std::nullopt;
  // Record, per step, which parameters held Inf/NaN gradients (see GradScaler::overflow_report).
  TORCH_ARG(bool, overflow_report) = false;
  // found_inf is all-reduced (MAX) over this group before the skip decision, so all ranks skip together.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group) = {};
};

// Raised where torch.amp.GradScaler raises AssertionError (the scaler used before scale(), an update without
// any inf check recorded); Python sees an AssertionError with torch's wording (python_message()).
class AMPKIT_API ScalerAssertionError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
  ScalerAssertionError(const std::string& message, std::string python_message)
      : std::logic_error(message), python_message_(std::move(python_message)) {}
  // The message for Python callers: torch.amp.GradScaler's own text where it differs from what().
  const char* python_message() const noexcept { return python_message_.empty() ? what() : python_message_.c_str(); }

 private:
  std::string python_message_;
};

// A scaler's state as ordered (key, value) entries; values are double, int64 or None (see state_dict()).
using ScalerState = std::vector<std::pair<std::string, c10::IValue>>;

// What GradScaler::stats() reports. Reading it synchronises with the device.
struct GradScalerStats {
  int64_t steps = 0;               // update() calls that consumed inf checks, skipped steps included
  int64_t skipped_steps = 0;       // of those, steps whose grads held Inf/NaN
  int64_t last_overflow_step = 0;  // number (1-based) of the last skipped step; 0: none yet
  int64_t overflows_at_min_scale = 0;
  int64_t spike_skipped_steps = 0;  // steps skipped for a spike alone (not counted in skipped_steps)
  double scale = 1.0;
  int64_t growth_tracker = 0;
  int64_t hysteresis_tracker = 0;
};

class AMPKIT_API GradScaler {
 public:
  enum class Stage { kReady, kUnscaled, kStepped };

  explicit GradScaler(GradScalerOptions options = {});

  // ---- the training loop ----------------------------------------------------------------------------------
  // outputs * scale (the scale tensor is created on the first call, on the outputs' device).
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);
  // For a caller that multiplies by the scale itself (a compiled step): the scale as a new 0-dim tensor on like's
  // device (the state is created there on the first call, as scale() creates it), and the loss that spike_skip
  // watches, which scale() notes on its own (NOTE [Spike-aware skipping]).
  at::Tensor scale_factor(const at::Tensor& like);
  void observe_loss(const at::Tensor& loss);
  // Divides the optimizer's grads by the scale in place and records Inf/NaN, once per step and optimizer.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Unscales (unless unscale_ ran), then runs optimizer.step() unless a grad held Inf/NaN (reads found_inf on
  // the host, as torch does). Returns what optimizer.step() returned (undefined when the step was skipped).
  at::Tensor step(torch::optim::Optimizer& optimizer);
  // Backs off or grows the scale on the device from this step's inf checks; update(new_scale) sets it.
  void update();
  void update(double new_scale);
  void update(const at::Tensor& new_scale);
  // Paddle's scaler.minimize(optimizer, scaled_loss): step(optimizer) then update(), after the backward of the
  // scaled loss (with gradient accumulation, once per optimizer step). Returns what step() returned.
  at::Tensor minimize(torch::optim::Optimizer& optimizer);

  // ---- state ----------------------------------------------------------------------------------------------
  double get_scale() const;            // synchronises; init_scale before the first scale(), 1.0 when disabled
  at::Tensor get_scale_async() const;  // the device tensor (undefined before the first scale())
  // A 0-dim bool device tensor: whether the last update()'s step ran (false: it was skipped). No sync. A flag
  // keeps its value as long as it is held: update() writes into one of a few reused flags that nobody else holds
  // (NOTE [Step-ran flags]), so it allocates nothing unless the caller keeps more flags than it has.
  at::Tensor last_step_ran() const;
  // Per optimizer, for several optimizers with one scaler (a GAN): whether `optimizer`'s step in the last
  // update()'s iteration ran (false: its grads held Inf/NaN and it skipped, whatever the others did); undefined when
  // it took no part in that iteration. With one optimizer it is last_step_ran()'s flag. No sync; flags are kept
  // and reused as last_step_ran()'s are.
  at::Tensor last_step_ran(const torch::optim::Optimizer& optimizer) const;
  at::Tensor last_step_ran(int64_t key) const;  // the optimizer-agnostic core's key
  double get_growth_factor() const { return growth_factor_; }
  void set_growth_factor(double v);
  double get_backoff_factor() const { return backoff_factor_; }
  void set_backoff_factor(double v);
  int64_t get_growth_interval() const { return growth_interval_; }
  void set_growth_interval(int64_t v);
  int64_t get_growth_tracker() const;
  // torch.amp.GradScaler's internals with torch's meaning (frameworks call them): the scale and growth tracker the
  // device state starts from (the options, then the last load_state_dict), the growth tracker's int32 device
  // tensor (undefined before the first scale()), and the device state created on `device` before the first
  // scale() (a no-op when it exists there; an error naming both devices when it exists on another).
  double init_scale() const { return init_scale_; }
  int64_t init_growth_tracker() const { return init_growth_tracker_; }
  at::Tensor get_growth_tracker_async() const { return growth_tracker_; }
  void lazy_init_state(const at::Device& device);
  bool is_enabled() const { return enabled_; }
  const GradScalerOptions& options() const { return options_; }
  GradScalerStats stats() const;
  // For the last update()'s step: the parameters whose grads held Inf/NaN, by name where one was registered
  // with set_parameter_names (else "param <i> of optimizer <key> (<shape> <dtype>)"). Needs
  // options().overflow_report(); synchronises.
  std::vector<std::string> overflow_report() const;
  void set_parameter_names(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters);

  // torch.amp.GradScaler's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker) with
  // double/int values, plus ampkit's (hysteresis, _hysteresis_tracker, min_scale, max_scale, steps,
  // skipped_steps, last_overflow_step, _overflows_at_min_scale, and the bools scaling and dynamic; with spike_skip:
  // spike_skipped_steps and, per signal, _spike_<loss|grad_norm>_history (its window, oldest first) and
  // _spike_<loss|grad_norm>_count). Empty when disabled.
  ScalerState state_dict() const;
  // Loads torch's or ampkit's state; validates everything first: on error nothing changes. A state whose scaling
  // or dynamic differs from this scaler's options is refused (states without them, torch's, load as they are).
  void load_state_dict(const ScalerState& state);
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  // ---- optimizer-agnostic core: any optimizer, identified by a key (ampkit.GradScaler drives Python ones) --
  // unscale_ for the optimizer `key` whose parameters are `params` (their .grad are unscaled).
  void unscale_params_(int64_t key, const std::vector<at::Tensor>& params);
  // The same with the grads given: grads[i] is params[i]'s gradient (undefined: none). A compiled training step
  // passes the grads its graph computed, which it assigns to .grad only after the graph has run.
  void unscale_params_(int64_t key, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);
  // Checks that a step may start (scale exists, not stepped since update()).
  void begin_step(int64_t key) const;
  // Generic step: unscales if needed, then returns whether the optimizer should step (host read of found_inf).
  bool prepare_step(int64_t key, const std::vector<at::Tensor>& params);
  // Fused step (optimizers taking grad_scale/found_inf): checks the grads read-only if they are still scaled
  // and returns (grad_scale: the scale tensor, or undefined when unscale_ already ran; found_inf). No sync.
  std::pair<at::Tensor, at::Tensor> prepare_fused_step(int64_t key, const std::vector<at::Tensor>& params);
  std::pair<at::Tensor, at::Tensor> prepare_fused_step(int64_t key, const std::vector<at::Tensor>& params,
                                                       const std::vector<at::Tensor>& grads);
  void mark_stepped(int64_t key);
  // NOTE [Grads unscaled outside the scaler]
  // A gradient all-reduce that decompresses, unscales (by unscale_factor) and checks the grads in one pass
  // (ampkit.distributed's DDP unscale hooks, ampkit::distributed::GradientAllReduce) records its Inf/NaN flag here (one
  // FP32 element, nonzero: a grad held Inf/NaN). Each call keeps its own copy of the flag, taken on the current
  // stream; the first unscale_/step sums them on its own stream after waiting for each (NOTE [Scaler streams]),
  // so buckets may record from different streams and threads (torch runs each DDP bucket's callback on a stream
  // of its pool) and no flag is lost. The flag may be reused as soon as this returns. For the rest of the iteration
  // unscale_/step take that flag for every optimizer instead of unscaling or checking again, and fused
  // optimizers get no grad_scale; update() clears it. Every parameter of the stepped optimizers must have gone
  // through that all-reduce. After an all-reduce the flag is the same on every rank of its group, so those ranks
  // skip together; with options().process_group() the flag is also all-reduced (MAX) over that group once, at the
  // first unscale_/step.
  void record_unscaled_grads(const at::Tensor& found_inf);
  // NOTE [Tensors reduced with found_inf]
  // Adds `tensors` (FP32, on the scale's device) to this iteration's all-reduce (MAX) of found_inf over
  // options().process_group(), so that one collective carries the flag and them: every rank then holds the
  // maximum of each (FP8 amaxes: ampkit::fp8::current_amaxes, so every rank scales its FP8 tensors alike). They
  // are read when that collective runs, the next unscale_ or step of this iteration (so they may be written until
  // then); if none comes before update(), update() reduces them alone; a disabled scaler (or one before its first
  // scale()) reduces them at once. Every rank passes tensors of the same sizes in the same order. Needs
  // options().process_group(). Mutates `tensors` (at that all-reduce).
  void reduce_with_found_inf(const std::vector<at::Tensor>& tensors);
  // 1 / scale on `device` (the FP64 reciprocal rounded once to FP32, as unscale_ multiplies by), a one-element
  // tensor; needs the scale (after the first scale()). Computed once per scale, on the stream of the first call
  // after it changed; a call from another stream makes that stream wait for it. Valid until the scale changes
  // (update(), load_state_dict()): work reading it must be ordered before update(), as recording the flag it
  // computed (record_unscaled_grads) orders it. Safe to call from several threads.
  at::Tensor unscale_factor(const at::Device& device);
  // Whether record_unscaled_grads was called in this iteration.
  bool grads_unscaled_outside() const { return recorded_count_ > 0; }
  // Whether inf checks or steps were recorded since the last update() (an iteration is in progress).
  bool in_iteration() const { return !per_optimizer_.empty(); }
  Stage stage(int64_t key) const;
  // Per-device found_inf tensors recorded for `key` this step (empty if none).
  std::vector<at::Tensor> found_inf_per_device(int64_t key) const;

  // State without a scaler: read/write a checkpoint file (the format of torch::save(scaler, path)).
  static ScalerState read_state(const std::string& path);
  static void write_state(const ScalerState& state, const std::string& path);

 private:
  // One parameter checked for the overflow report: its own found_inf flag.
  struct ReportEntry {
    int64_t key;
    size_t index;
    at::Tensor param;
    at::Tensor flag;
  };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    std::vector<std::pair<at::Device, at::Tensor>> found_inf;  // this step's, per device
    std::vector<ReportEntry> report;
  };

  // What a reused device buffer holds (see NOTE [Scaler buffers] in scaler_buffers.cpp).
  enum class BufferRole : uint8_t { kFoundInf, kCombined, kUpdate, kReportFlag, kExternal, kSpikeStep };
  struct BufferKey {
    int64_t optimizer;  // the optimizer's key; 0: the scaler's own
    at::DeviceType device_type;
    at::DeviceIndex device_index;
    int64_t stream;  // the stream it is used on (0 on the CPU)
    BufferRole role;
    int64_t index;  // kReportFlag: the parameter's index
    bool operator<(const BufferKey& o) const;
  };
  struct Buffer {
    at::Tensor tensor;
    int64_t last_used;  // the iteration (update() count) that last used it
  };
  // A point in one stream's work that work on other streams can be ordered after (NOTE [Scaler streams]).
  struct StreamMark {
    std::optional<c10::Event> event;  // none on the CPU, and before the first record
    c10::Stream stream = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
    uint64_t capture = 0;  // the CUDA graph capture it was recorded in (0: none)
  };
  // 1 / scale on one device.
  struct InvScale {
    at::Device device = at::kCPU;
    at::Tensor inv;      // FP32, 0-dim
    bool valid = false;  // computed from the current scale
    StreamMark ready;    // after its computation
  };
  // One record_unscaled_grads call's copy of its flag; reused iteration after iteration.
  struct RecordedFlag {
    at::Tensor flag;  // FP32, 0-dim, on the scale's device
    StreamMark written;
  };
  // The overflows-at-min_scale count on its way to the host (NOTE [Watching min_scale]).
  struct MinScaleWatch {
    at::Tensor host;  // int64[1], pinned off the CPU
    StreamMark copied;
    bool pending = false;  // a copy is in flight
    bool stale = false;    // ...of a count that load_state_dict() replaced
    int64_t known = 0;     // the last count that reached the host
  };

  const at::Tensor& check_scale_exists(const char* funcname) const;
  void lazy_init(const at::Device& device);
  void record_checks(int64_t key, const std::vector<at::Tensor>& params, std::vector<at::Tensor> grads, bool unscale,
                     bool allow_fp16);
  at::Tensor combined_found_inf(int64_t key);
  // All-reduces (MAX) `flag` over options().process_group() with the tensors of reduce_with_found_inf.
  void all_reduce_found_inf(const at::Tensor& flag);
  // A zeroed-on-creation FP32 scalar on `device`, reused across iterations on the current stream.
  at::Tensor& buffer(int64_t optimizer, const at::Device& device, BufferRole role, int64_t index = 0);
  const at::Tensor& inv_scale_on(const at::Device& device);
  // The recorded flags' sum on the current stream (NOTE [Scaler streams]); once per iteration.
  at::Tensor consume_recorded_flags();
  // Step-ran flags that keep their values while held (NOTE [Step-ran flags]).
  struct FlagPool {
    std::vector<at::Tensor> flags;  // bool, 0-dim each
    size_t last = 0;                // the one written last
  };
  // The flag of `pool` the next update() writes: one nobody else holds.
  at::Tensor& next_step_ran_flag(FlagPool& pool) const;
  // Around every write of scale_ on the current stream: it waits for the inverse's computation to have read the
  // old scale; after it, the inverses are recomputed on their next use.
  void before_scale_write();
  void scale_written();
  void watch_min_scale();
  void apply_state(const ScalerState& state);
  void warn_at_min_scale(int64_t overflows_at_min, bool may_raise) const;
  // NOTE [Calibrated first scale]: the largest |gradient| of `grads` (multiplied by the scale when `scaled`) joins
  // the iteration's amax; apply_calibration() sets the scale from it in the first update().
  void note_calibration_amax(const std::vector<at::Tensor>& grads, bool scaled);
  void apply_calibration(const at::Tensor& found_inf);
  void check_new_scale_allowed() const;
  // NOTE [Spike-aware skipping]: the loss joins the iteration's value (scale()); the iteration's decision, taken
  // at its first step from `grads` (scaled: still multiplied by the scale), FP32 0-dim, 1 for a spike (undefined
  // without spike_skip); update() counts it and pushes the values it was taken on.
  void note_spike_loss(const at::Tensor& outputs);
  at::Tensor spike_flag(const std::vector<at::Tensor>& grads, bool scaled);
  // Whether a read-only check of these grads should be the gradient-norm pass (the decision still to take).
  bool spike_norm_in_check(const std::vector<at::Tensor>& grads) const;
  void end_spike_iteration(const at::Tensor& overflow);
  void spike_state(ScalerState& state) const;
  struct SpikeLoad {  // a state's spike entries, checked
    int64_t skipped = 0;
    std::vector<double> history[2];
    int64_t count[2] = {0, 0};
  };
  SpikeLoad check_spike_state(const ScalerState& state) const;
  void apply_spike_state(const SpikeLoad& load);
  // Creates the windows and the count on `device` from the loaded or initial values; keep_iteration: the decision
  // and values of the iteration in progress stay (a load_state_dict in mid-iteration).
  void init_spike_state(const at::Device& device, bool keep_iteration = false);
  // Ends an iteration: releases the buffers it did not use (optimizers that left, streams no longer used).
  void end_iteration();

  GradScalerOptions options_;
  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  int64_t init_growth_tracker_ = 0;
  int64_t init_hysteresis_tracker_;
  std::vector<int64_t> init_stats_ = std::vector<int64_t>(4, 0);

  // Device state, created lazily by the first scale() on the outputs' device.
  at::Tensor scale_;               // FP32, 0-dim
  at::Tensor growth_tracker_;      // int32, 0-dim
  at::Tensor hysteresis_tracker_;  // int32, 0-dim
  at::Tensor stats_;               // int64[4]
  FlagPool step_ran_;              // the iteration's (NOTE [Step-ran flags])
  // Per optimizer, written when several optimizers took part in the last update()'s iteration.
  std::unordered_map<int64_t, FlagPool> step_ran_per_optimizer_;
  std::vector<int64_t> last_stepped_;  // the keys of the optimizers in the last update()'s iteration
  bool calibrating_ = false;           // options().calibrate() and the first update() has not run
  at::Tensor calibration_amax_;        // FP32, 0-dim on the scale's device: the first iteration's largest |gradient|
  at::Tensor scale64_;                 // FP64, 0-dim: for the FP64 reciprocal
  StreamMark scale_mark_;              // after the last write of scale_
  std::deque<InvScale> inv_scales_;    // per device, kept (stable references)

  std::unordered_map<int64_t, PerOptimizer> per_optimizer_;
  std::deque<RecordedFlag> recorded_;  // record_unscaled_grads' copies, the first recorded_count_ this iteration's
  size_t recorded_count_ = 0;
  StreamMark recorded_read_;                       // after the last sum of the recorded flags
  at::Tensor external_found_inf_;                  // that sum, this iteration (undefined: not taken yet)
  bool external_reduced_ = false;                  // that flag was all-reduced over the process group
  std::vector<at::Tensor> reduce_with_found_inf_;  // NOTE [Tensors reduced with found_inf]
  // record_unscaled_grads and unscale_factor may be called from several threads (DDP's callbacks).
  std::unique_ptr<std::mutex> hook_mutex_ = std::make_unique<std::mutex>();
  MinScaleWatch min_watch_;
  std::map<BufferKey, Buffer> buffers_;  // reused step after step
  int64_t iteration_ = 0;
  struct NamedParam {
    c10::weak_intrusive_ptr<c10::TensorImpl> param;  // the name is valid only while this is alive
    std::string name;
  };
  std::unordered_map<const void*, NamedParam> param_names_;
  std::vector<ReportEntry> last_report_;  // the overflow-report flags of the last update()'s step
  mutable bool warned_at_min_ = false;
  struct SpikeSignal {
    at::Tensor history;                // FP32 [window] on the scale's device, a ring; NaN: empty or a non-finite value
    int64_t count = 0;                 // values pushed so far (the next goes to count % window)
    int64_t filled = 0;                // slots of the window that hold a pushed value (the warm-up counts these)
    at::Tensor value;                  // this iteration's, FP32 0-dim (undefined: none seen yet)
    std::vector<double> init_history;  // loaded before the device state existed, oldest first
  };
  SpikeSignal spike_signals_[2];  // the loss, the gradient norm
  at::Tensor spike_flag_;         // this iteration's decision (undefined: not taken yet)
  at::Tensor spike_skipped_;      // int64 0-dim
  int64_t init_spike_skipped_ = 0;
};

// torch::save(scaler, path) / torch::load(scaler, path).
AMPKIT_API torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                                       const GradScaler& scaler);
AMPKIT_API torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler);

}  // namespace ampkit
