// The device buffers GradScaler reuses step after step (found_inf flags, their combinations, the overflow
// report's per-parameter flags, the step-ran flags, inv_scale), so that a training step allocates nothing after
// the first and can be captured in a CUDA graph; the order between the streams that use them; the min_scale watch.
//
// NOTE [Scaler buffers]
// A buffer is keyed by (optimizer, device, stream, role, index). Keying by the current stream keeps reuse
// stream-ordered: a buffer is only ever rewritten on the stream that last used it, so a step run on another
// stream (a side stream, a graph-capture stream) gets its own buffers instead of racing with kernels still
// reading the old ones. Buffers that an iteration did not use (optimizers that were replaced or destroyed, streams
// no longer used) are released when it ends, so recreating optimizers or streams does not accumulate them.
//
// NOTE [Scaler streams]
// Two things are shared between streams that nothing else orders: the inverse scale and the flags recorded by
// record_unscaled_grads. torch runs each DDP bucket's future callback (ampkit.distributed's hooks) on a stream
// of its own pool, so the buckets of one iteration unscale and record on different streams, and the scaler's
// unscale_/step/update run on yet another. Both are therefore ordered by events (a StreamMark), never by luck:
// * the inverse scale of a device is computed once per scale, by the first request after the scale was written
//   (which first waits for that write), and every request from another stream waits for that computation; the
//   next write of the scale waits for it too. Work reading the inverse must be ordered before the next update(),
//   which recording the flag it computed does (the flag is read by the update).
// * each record_unscaled_grads call copies its flag into a slot of its own, on its stream, and marks it; the
//   first unscale_/step of the iteration sums the slots on its stream after waiting for each mark, and marks the
//   sum; a slot is rewritten in a later iteration only after that mark. No flag is read-modify-written by two
//   streams, so none is lost.
// Under CUDA graph capture, CUDA allows no dependency on work outside the capture: marks recorded outside the
// capture in progress are not waited for (the graph is ordered by its replay), and an inverse computed in another
// capture (or outside one) is computed again. Host-side, a mutex serialises the calls that DDP's callbacks make.
#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "capture.h"

#include <tuple>

#include "ampkit/grad_scaler.h"
#include "ampkit/ops.h"

namespace ampkit {
namespace {

c10::Stream current_stream(const at::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

int64_t current_stream_id(const at::Device& device) {
  if (device.is_cpu() || !c10::impl::hasDeviceGuardImpl(device.type())) {
    return 0;
  }
  return current_stream(device).id();
}

// Whether work is ordered by streams here (not the CPU, whose ops run in program order on the host).
bool has_streams(const at::Device& device) { return !device.is_cpu() && c10::impl::hasDeviceGuardImpl(device.type()); }

// The id of the CUDA graph capture `stream` is in (0: none).
uint64_t capture_of(const c10::Stream& stream) {
#if defined(AMPKIT_WITH_CUDA)
  if (stream.device_type() == c10::DeviceType::CUDA) {
    return detail::cuda_capture_id(stream);
  }
#endif
  (void)stream;
  return 0;
}

uint64_t capture_on(const at::Device& device) { return has_streams(device) ? capture_of(current_stream(device)) : 0; }

// The marks (GradScaler::StreamMark; templates, as the type is private): record after the work enqueued so far on
// the device's current stream; make that stream wait for a mark; whether a mark's work has completed.
template <typename Mark>
void record(Mark& mark, const at::Device& device) {
  if (!has_streams(device)) {
    return;
  }
  const c10::Stream stream = current_stream(device);
  if (!mark.event.has_value()) {
    mark.event.emplace(device.type());
  }
  mark.event->record(stream);
  mark.stream = stream;
  mark.capture = capture_of(stream);
}

template <typename Mark>
void wait(const Mark& mark, const at::Device& device) {
  if (!has_streams(device) || !mark.event.has_value()) {
    return;
  }
  const c10::Stream stream = current_stream(device);
  if (stream == mark.stream || capture_of(stream) != mark.capture) {
    return;  // in stream order already, or across a capture's boundary (NOTE [Scaler streams])
  }
  mark.event->block(stream);
}

template <typename Mark>
bool completed(const Mark& mark) {
  return !mark.event.has_value() || mark.event->query();
}

}  // namespace

bool GradScaler::BufferKey::operator<(const BufferKey& o) const {
  return std::tie(optimizer, device_type, device_index, stream, role, index) <
         std::tie(o.optimizer, o.device_type, o.device_index, o.stream, o.role, o.index);
}

at::Tensor& GradScaler::buffer(int64_t optimizer, const at::Device& device, BufferRole role, int64_t index) {
  const BufferKey key{optimizer, device.type(), device.index(), current_stream_id(device), role, index};
  Buffer& b = buffers_[key];
  if (!b.tensor.defined()) {
    b.tensor = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  b.last_used = iteration_;
  return b.tensor;
}

// ---- the inverse scale (NOTE [Scaler streams]) ---------------------------------------------------------------

void GradScaler::before_scale_write() {
  const std::lock_guard<std::mutex> lock(*hook_mutex_);
  for (const InvScale& e : inv_scales_) {
    if (e.device == scale_.device()) {
      wait(e.ready, scale_.device());  // its computation has read scale_ (and written scale64_)
    }
  }
}

void GradScaler::scale_written() {
  const std::lock_guard<std::mutex> lock(*hook_mutex_);
  record(scale_mark_, scale_.device());
  for (InvScale& e : inv_scales_) {
    e.valid = false;
  }
}

const at::Tensor& GradScaler::inv_scale_on(const at::Device& requested) {
  // "cuda" means the current CUDA device: one entry per device.
  const at::Device device = requested.has_index() || !has_streams(requested)
                                ? requested
                                : c10::impl::VirtualGuardImpl(requested.type()).getDevice();
  const std::lock_guard<std::mutex> lock(*hook_mutex_);
  auto entry = [&](const at::Device& d) -> InvScale& {
    for (InvScale& e : inv_scales_) {
      if (e.device == d) {
        return e;
      }
    }
    inv_scales_.push_back(InvScale{d, at::empty({}, at::TensorOptions().dtype(at::kFloat).device(d)), false, {}});
    return inv_scales_.back();
  };
  // Computed in this capture context (an inverse computed inside a capture exists only in its graph).
  auto fresh = [](const InvScale& e) { return e.valid && e.ready.capture == capture_on(e.device); };
  const at::Device home = scale_.device();
  InvScale& main = entry(home);
  if (!fresh(main)) {
    wait(scale_mark_, home);
    // The FP64 reciprocal rounded once to FP32, as torch: scale.double().reciprocal().float().
    scale64_.copy_(scale_);
    scale64_.reciprocal_();
    main.inv.copy_(scale64_);
    record(main.ready, home);
    main.valid = true;
  } else {
    wait(main.ready, home);
  }
  if (device == home) {
    return main.inv;
  }
  InvScale& here = entry(device);
  if (!fresh(here)) {
    wait(main.ready, device);
    here.inv.copy_(main.inv, /*non_blocking=*/true);
    record(here.ready, device);
    here.valid = true;
  } else {
    wait(here.ready, device);
  }
  return here.inv;
}

// ---- flags recorded outside the scaler (NOTE [Grads unscaled outside the scaler], NOTE [Scaler streams]) -----

void GradScaler::record_unscaled_grads(const at::Tensor& found_inf) {
  if (!enabled_) {
    return;
  }
  const at::Tensor& scale = check_scale_exists("record_unscaled_grads");
  TORCH_CHECK_VALUE(found_inf.defined() && found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat,
                    "GradScaler.record_unscaled_grads: found_inf must be a one-element float32 tensor, but got ",
                    found_inf.defined() ? found_inf.toString() : std::string("an undefined tensor"),
                    found_inf.defined() ? " of " + std::to_string(found_inf.numel()) + " elements" : "");
  const std::lock_guard<std::mutex> lock(*hook_mutex_);
  for (const auto& [key, state] : per_optimizer_) {
    TORCH_CHECK(state.stage == Stage::kReady,
                "GradScaler.record_unscaled_grads: an optimizer was already unscaled "
                "or stepped in this iteration; all-reduce (and record) the grads before unscale_() and step()");
  }
  TORCH_CHECK(!external_reduced_ && !external_found_inf_.defined(),
              "GradScaler.record_unscaled_grads: the "
              "recorded flags were already summed in this iteration; record every bucket before unscale_() and step()");
  const at::Device device = scale.device();
  if (recorded_count_ == recorded_.size()) {
    recorded_.push_back(RecordedFlag{at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device)), {}});
  } else {
    wait(recorded_read_, device);  // the last sum has read this slot
  }
  RecordedFlag& slot = recorded_[recorded_count_];
  slot.flag.copy_(found_inf.reshape({}), /*non_blocking=*/true);
  record(slot.written, device);
  ++recorded_count_;
}

at::Tensor GradScaler::consume_recorded_flags() {
  const std::lock_guard<std::mutex> lock(*hook_mutex_);
  const at::Device device = scale_.device();
  at::Tensor& sum = buffer(0, device, BufferRole::kExternal);
  sum.zero_();
  for (size_t i = 0; i < recorded_count_; ++i) {
    wait(recorded_[i].written, device);
    sum.add_(recorded_[i].flag);
  }
  record(recorded_read_, device);
  return sum;
}

// ---- step-ran flags ------------------------------------------------------------------------------------------

// NOTE [Step-ran flags]
// last_step_ran() hands out the flag the last update() wrote, as a tensor of its own over the flag's storage. A
// caller may keep it (a list of flags collected step after step, read later without a sync), so update() never
// writes into a flag whose storage anyone else holds (counting references to the storage: a Python wrapper of
// the scaler's own tensor would hold a reference of its own for as long as the scaler holds one): it takes
// the first flag of a small pool (kStepRanFlags, made by the first update()), from the last one written on, whose
// tensor and storage only the scaler references, and adds one when every flag is held. A loop that holds at most
// three flags at a time never allocates, one that holds k at most k + 1 flags in all; flags released again beyond
// kKeptFree are freed. Under CUDA graph capture the replays rewrite the captured flag. last_step_ran(optimizer)
// works the same on a pool per optimizer, written only in iterations where several optimizers took part (a GAN:
// one logical_not per optimizer); in an iteration of one optimizer its flag is the iteration's, and pools of
// optimizers that took no part in the last iteration are dropped.
at::Tensor& GradScaler::next_step_ran_flag(FlagPool& pool) const {
  constexpr size_t kStepRanFlags = 4;
  constexpr size_t kKeptFree = kStepRanFlags;
  auto& flags = pool.flags;
  while (flags.size() < kStepRanFlags) {  // the first update() (trimming keeps kKeptFree)
    flags.push_back(at::empty({}, scale_.options().dtype(at::kBool)));
  }
  auto held = [](const at::Tensor& t) { return t.use_count() > 1 || t.storage().use_count() > 1; };
  size_t free_seen = 0;
  for (size_t i = 0; i < flags.size();) {
    if (!held(flags[i]) && ++free_seen > kKeptFree) {
      flags.erase(flags.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  const size_t n = flags.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (pool.last + k) % n;
    if (!held(flags[i])) {
      pool.last = i;
      return flags[i];
    }
  }
  flags.push_back(at::empty({}, scale_.options().dtype(at::kBool)));
  pool.last = n;
  return flags.back();
}

// ---- the min_scale watch -------------------------------------------------------------------------------------

// NOTE [Watching min_scale]
// Overflows met at min_scale are counted on the device (stats_). update() tells the host without a sync: it
// copies the count into pinned host memory (non-blocking, one copy in flight at a time) and acts on the newest
// count whose copy has completed, polled before and after enqueueing its own. On the CPU the copy completes at
// once, so the update() of the overflow warns or raises. On a GPU that is the update() of the overflow or the
// next one while the device runs at most one update() behind the host; further behind, the first update() that
// finds the copy completed (the count only grows, so no overflow is missed). stats() and state_dict() read the
// device and warn at once. Under CUDA graph capture the host is not told (the count still counts on the device).
void GradScaler::watch_min_scale() {
  if (!options_.min_scale().has_value() || (!options_.raise_at_min_scale() && warned_at_min_)) {
    return;
  }
  const at::Device device = stats_.device();
  if (capture_on(device) != 0) {
    return;
  }
  MinScaleWatch& w = min_watch_;
  auto poll = [&] {
    if (w.pending && completed(w.copied)) {
      w.pending = false;
      if (!w.stale) {
        w.known = w.host.const_data_ptr<int64_t>()[0];
      }
      w.stale = false;
    }
  };
  poll();
  if (!w.pending) {
    if (!w.host.defined()) {
      w.host = at::empty({1}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
    }
    w.host.copy_(stats_.narrow(0, ampkit::kScaleStatOverflowsAtMin, 1), /*non_blocking=*/true);
    record(w.copied, device);
    w.pending = true;
  }
  poll();
  warn_at_min_scale(w.known, /*may_raise=*/true);
}

void GradScaler::end_iteration() {
  for (auto it = buffers_.begin(); it != buffers_.end();) {
    it = it->second.last_used == iteration_ ? std::next(it) : buffers_.erase(it);
  }
  ++iteration_;
  per_optimizer_.clear();
  recorded_count_ = 0;
  external_found_inf_ = at::Tensor();
  external_reduced_ = false;
  reduce_with_found_inf_.clear();
  calibration_amax_ = at::Tensor();
}

}  // namespace ampkit
