// GradScaler's calibrated first scale (options().calibrate(), Python init_scale="auto"): the first iteration's
// largest gradient, collected while the grads are checked, and the scale the first update() sets from it.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ampkit/grad_scaler.h"
#include "scaler_internal.h"

namespace ampkit {

// NOTE [Calibrated first scale]
// torch, Apex and DeepSpeed start from a blind 2^16 (Megatron 2^32) and spend their first steps backing off.
// With calibrate, the first iteration runs at scale 1, where FP16 grads overflow only if they would at any
// scale, and measures amax, the largest |gradient| of every optimizer it steps (one _foreach_norm(inf) per device
// and optimizer, in that iteration only; the grads are still scaled by 1, or already unscaled by a compressing
// all-reduce). Its update() then sets, on the device and without a sync,
//   scale = 2^floor(log2(65504 / (amax * 2^calibration_margin)))  clamped to [min_scale, max_scale],
// so the largest gradient of the next backward lands within a factor of two below FP16's max over the headroom.
// The iteration's own step is an ordinary step at scale 1 (applied unless its grads held Inf/NaN). Exceptions:
// an overflow in it backs off from 1 as any overflow does; an amax of 0 (every gradient zero or underflowed at 1)
// gives torch's 2^16; without max_scale the calibrated scale is at most 2^32. Zero-size grads are not measured.
// With a process group, amax is all-reduced (MAX) first, every rank taking part, so every rank sets the same
// scale; DTensor (FSDP2) grads need that group (the Python scaler refuses them without it), since each rank
// measures only its shards. Grads an op refuses (record_checks throws) are not counted.
// A state loaded before the first update() (steps == 0) keeps the calibration pending; any other ends it, as
// does update(new_scale).
void GradScaler::note_calibration_amax(const std::vector<at::Tensor>& grads, bool scaled) {
  const at::Device device = scale_.device();
  if (!calibration_amax_.defined()) {
    calibration_amax_ = at::zeros({}, scale_.options());
  }
  std::vector<at::Tensor> measured;
  for (const at::Tensor& g : grads) {
    if (g.numel() != 0) {  // no element to measure (and _foreach_norm's inf norm refuses empty tensors)
      measured.push_back(g);
    }
  }
  for (const auto& [d, list] : detail::by_device(measured)) {
    at::Tensor amax = at::stack(at::_foreach_norm(list, std::numeric_limits<double>::infinity())).to(at::kFloat).max();
    if (scaled) {
      amax = amax * inv_scale_on(d);
    }
    // fmax would drop a NaN: a NaN gradient must leave the calibration invalid, as the overflow it is.
    at::Tensor moved = amax.to(device, /*non_blocking=*/true).reshape({});
    calibration_amax_ = at::where(moved.isnan() | (moved > calibration_amax_), moved, calibration_amax_);
  }
}

void GradScaler::apply_calibration(const at::Tensor& found_inf) {
  calibrating_ = false;
  if (!calibration_amax_.defined() && !options_.process_group()) {
    return;  // no gradient seen: the update() stays an ordinary one
  }
  // A rank that saw no gradient still joins the all-reduce, with 0.
  at::Tensor amax = calibration_amax_.defined() ? calibration_amax_ : at::zeros({}, scale_.options());
  calibration_amax_ = at::Tensor();
  if (options_.process_group()) {
    std::vector<at::Tensor> tensors{amax};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    options_.process_group()->allreduce(tensors, opts)->wait();
  }
  const double lo = options_.min_scale().value_or(0.0);
  // Without max_scale the calibrated scale stops at 2^32 (Megatron's first scale): a near-zero amax must not set a
  // scale at which the loss itself overflows FP32.
  const double hi = options_.max_scale().value_or(std::exp2(32.0));
  constexpr double kFp16Max = 65504.0;
  const at::Tensor amax64 = amax.to(at::kDouble);
  at::Tensor calibrated =
      at::exp2(at::floor(at::log2(kFp16Max / (amax64 * std::exp2(options_.calibration_margin()))))).clamp(lo, hi);
  const at::Tensor clean = found_inf.reshape({}) == 0;
  const at::Tensor measured = clean & at::isfinite(amax) & (amax > 0);
  const at::Tensor none_seen = clean & (amax == 0);
  calibrated = at::where(none_seen, at::scalar_tensor(std::clamp(65536.0, lo, hi), calibrated.options()), calibrated);
  const at::Tensor set = measured | none_seen;
  scale_.copy_(at::where(set, calibrated.to(at::kFloat), scale_));
  growth_tracker_.masked_fill_(set, 0);
}

}  // namespace ampkit
