// ampkit::distributed::GradientAllReduce: data-parallel gradient averaging for LibTorch programs (which have no
// DDP) over any c10d::ProcessGroup (NCCL, Gloo, ...), with optional FP16/BF16 compression that the GradScaler
// sees, as ampkit.distributed's DDP unscale hooks do in Python.
//
//   ampkit::distributed::GradientAllReduce sync(model->parameters(), process_group,
//       ampkit::distributed::GradientAllReduceOptions().compression(ampkit::distributed::Compression::kFP16),
//       &scaler);
//   scaler.scale(loss).backward();   // buckets are all-reduced as their grads become ready
//   sync.synchronize();              // waits, decompresses, unscales and checks; the scaler records the flag
//   scaler.step(optimizer);
//   scaler.update();
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ampkit/export.h"
#include "ampkit/grad_scaler.h"

namespace ampkit::distributed {

// The dtype gradients travel in: as they are, FP16 or BF16 (half the bytes of FP32).
enum class Compression : int8_t { kNone, kFP16, kBF16 };

struct AMPKIT_API GradientAllReduceOptions {
  TORCH_ARG(Compression, compression) = Compression::kNone;
  // Bytes of gradients (in their own dtype) per all-reduce, as DDP's bucket_cap_mb (25 MB).
  TORCH_ARG(int64_t, bucket_bytes) = 26214400;  // 25 MiB
  // Launch a bucket's all-reduce as soon as all its grads are accumulated (autograd hooks on the parameters'
  // gradient accumulators), overlapping communication with the rest of backward; false: all at synchronize().
  TORCH_ARG(bool, overlap) = true;
};

// NOTE [Gradient all-reduce]
// Parameters are put into buckets in reverse order (the order backward produces their grads), one dtype and
// device per bucket. A bucket is compressed once (each grad cast into a flat buffer of the wire dtype, which is
// then divided by the world size: the passes and bits of the DDP unscale hooks), all-reduced (SUM) asynchronously, and at
// synchronize() copied back into the grads; with a scaler they are then unscaled and checked in one multi-tensor
// pass (unscale_and_check_ with the scaler's unscale_factor) and the flag handed to
// GradScaler::record_unscaled_grads (NOTE [Grads unscaled outside the scaler]), so that unscale_/step neither
// unscale nor check again and every rank skips together. A parameter
// without a grad on this rank contributes zeros and receives the average. Buckets are launched strictly in order
// (a complete bucket waits for the ones before it), so every rank pairs the same buffers whatever order its
// grads arrive in. Each backward is one round: a second backward before synchronize() throws, and one after it
// in the same scaler iteration would add scaled grads to unscaled ones; for gradient accumulation,
// set_require_sync(false) for the micro-batches before the last.
class AMPKIT_API GradientAllReduce {
 public:
  // `params` must be leaves with requires_grad, the same list in the same order on every rank. `scaler` (may be
  // null) must outlive this object; the process group is kept alive by it.
  GradientAllReduce(std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                    GradientAllReduceOptions options = {}, GradScaler* scaler = nullptr);
  ~GradientAllReduce();
  GradientAllReduce(const GradientAllReduce&) = delete;
  GradientAllReduce& operator=(const GradientAllReduce&) = delete;

  // Launches the buckets not launched yet, waits for every all-reduce of this round and writes the averaged
  // (unscaled, with a scaler) grads. Call it after backward and before the optimizer step.
  void synchronize();
  // false: the next backwards accumulate locally (no all-reduce) until it is set back to true.
  void set_require_sync(bool require_sync) {
    const std::lock_guard<std::mutex> lock(mutex_);
    require_sync_ = require_sync;
  }
  bool require_sync() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return require_sync_;
  }

  // Parameter indices (into the constructor's list) of each bucket, in launch order.
  std::vector<std::vector<int64_t>> bucket_indices() const;
  // Bytes sent by this rank's all-reduces so far (the buffers' sizes; what the backend moves per byte depends on
  // its algorithm), and the number of all-reduces.
  int64_t bytes_reduced() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return bytes_reduced_;
  }
  int64_t allreduces() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return allreduces_;
  }

  struct Bucket;

 private:
  void grad_ready(size_t bucket, size_t slot);
  void launch(Bucket& bucket);

  std::vector<at::Tensor> params_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  GradientAllReduceOptions options_;
  GradScaler* scaler_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  size_t next_bucket_ = 0;    // the next bucket to launch this round (buckets go out in order on every rank)
  mutable std::mutex mutex_;  // autograd threads call grad_ready
  std::vector<std::function<void()>> remove_hooks_;  // each keeps its gradient accumulator alive
  bool require_sync_ = true;
  int64_t bytes_reduced_ = 0;
  int64_t allreduces_ = 0;
};

// NOTE [Store process group]
// A process group whose one collective, all-reduce (SUM or MAX of floating tensors, on any device), goes through
// a c10d::Store: each rank writes its tensor under a key of the round and reads the others', reducing in FP32
// (FP64 for FP64) in rank order, so every rank gets the same bits. It is ampkit's own backend, for CPU programs
// built against the PyPI wheel, whose headers cannot construct torch's Gloo process group: slow (all data passes
// through the store; keys are deleted after each round where the store can), meant for tests, examples and small
// CPU runs. Real training passes torch's NCCL or Gloo process group (built where their headers are available, or
// handed over from Python). Other collectives raise. Groups sharing one store need distinct names (the same on
// every rank of a group).
AMPKIT_API c10::intrusive_ptr<c10d::ProcessGroup> store_process_group(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                                      int size, const std::string& name = "default");

// The elementwise maximum over `process_group`'s ranks of each of `tensors` (floating, one dtype, on one device, any
// shapes and strides), in one all-reduce: the tensors are packed into one flat buffer (a single contiguous tensor is
// reduced as it is), reduced and copied back. Every rank passes tensors of the same sizes in the same order. Waits
// for the collective; mutates `tensors`. An empty list does nothing.
AMPKIT_API void all_reduce_max(const std::vector<at::Tensor>& tensors,
                               const c10::intrusive_ptr<c10d::ProcessGroup>& process_group);

}  // namespace ampkit::distributed
