// The device buffers GradScaler reuses step after step (found_inf flags, their combinations, the overflow
// report's per-parameter flags, inv_scale), so that a training step allocates nothing after the first and can be
// captured in a CUDA graph.
//
// NOTE [Scaler buffers]
// A buffer is keyed by (optimizer, device, stream, role, index). Keying by the current stream keeps reuse
// stream-ordered: a buffer is only ever rewritten on the stream that last used it, so a step run on another
// stream (a side stream, a graph-capture stream) gets its own buffers instead of racing with kernels still
// reading the old ones. Buffers that an iteration did not use (optimizers that were replaced or destroyed, streams
// no longer used) are released when it ends, so recreating optimizers or streams does not accumulate them.
#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <tuple>

#include "ampkit/grad_scaler.h"

namespace ampkit {
namespace {

int64_t current_stream_id(const at::Device& device) {
  if (device.is_cpu() || !c10::impl::hasDeviceGuardImpl(device.type())) {
    return 0;
  }
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device).id();
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

const at::Tensor& GradScaler::inv_scale_on(const at::Device& device) {
  // The FP64 reciprocal rounded once to FP32, as torch: scale.double().reciprocal().float().
  at::Tensor& inv = buffer(0, device, BufferRole::kInvScale);
  scale64_.copy_(scale_);
  scale64_.reciprocal_();
  inv.copy_(scale64_, /*non_blocking=*/true);
  return inv;
}

void GradScaler::end_iteration() {
  for (auto it = buffers_.begin(); it != buffers_.end();) {
    it = it->second.last_used == iteration_ ? std::next(it) : buffers_.erase(it);
  }
  ++iteration_;
  per_optimizer_.clear();
  external_found_inf_ = at::Tensor();
  external_reduced_ = false;
}

}  // namespace ampkit
