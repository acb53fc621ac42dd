// ampkit::distributed::GradientAllReduce (see <ampkit/distributed.h>, NOTE [Gradient all-reduce]).
#include "ampkit/distributed.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <mutex>
#include <optional>
#include <utility>

#include "ampkit/ops.h"

namespace ampkit::distributed {

struct GradientAllReduce::Bucket {
  std::vector<int64_t> indices;  // into params_
  std::vector<int64_t> offsets;  // of each parameter in the flat buffer, in elements
  int64_t numel = 0;
  at::Device device = at::kCPU;
  at::ScalarType grad_dtype = at::kFloat;
  at::Tensor buffer;     // flat, in the wire dtype, reused round after round
  at::Tensor found_inf;  // this bucket's Inf/NaN flag (one FP32 element), reused round after round
  size_t pending = 0;
  std::vector<bool> ready;
  c10::intrusive_ptr<c10d::Work> work;
  bool launched = false;
};

namespace {

// The dtype of p's grads: its own, or the one its grad_dtype names (torch >= 2.10: FP32 grads of BF16 weights,
// NOTE [FP32 grads of low-precision params]), decided from the parameters so that every rank buckets alike.
at::ScalarType grad_dtype_of(const at::Tensor& p) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  if (const std::optional<at::ScalarType> d = p.grad_dtype(); d.has_value()) {
    return *d;
  }
#endif
  return p.scalar_type();
}

at::ScalarType wire_dtype(Compression c, at::ScalarType grad_dtype) {
  switch (c) {
    case Compression::kFP16:
      return at::kHalf;
    case Compression::kBF16:
      return at::kBFloat16;
    default:
      return grad_dtype;
  }
}

}  // namespace

GradientAllReduce::GradientAllReduce(std::vector<at::Tensor> params,
                                     c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                                     GradientAllReduceOptions options, GradScaler* scaler)
    : params_(std::move(params)), process_group_(std::move(process_group)), options_(options), scaler_(scaler) {
  const char* where = "ampkit::distributed::GradientAllReduce";
  TORCH_CHECK_VALUE(process_group_, where, ": process_group must not be null");
  TORCH_CHECK_VALUE(options_.bucket_bytes() > 0, where, ": bucket_bytes must be positive, but got ",
                    options_.bucket_bytes());
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK_VALUE(p.defined() && p.is_leaf() && p.requires_grad(), where, ": params[", i,
                      "] must be a leaf tensor that requires grad");
    TORCH_CHECK_TYPE(p.is_floating_point(), where, ": params[", i, "] must be floating point, but is ",
                     p.scalar_type());
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(!params_[j].is_same(p), where, ": params[", j, "] and params[", i, "] are the same tensor");
    }
  }
  // Buckets in reverse parameter order, one dtype and device each, up to bucket_bytes.
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    const at::Tensor& p = params_[i];
    const at::ScalarType grad_dtype = grad_dtype_of(p);
    Bucket* b = buckets_.empty() ? nullptr : buckets_.back().get();
    if (b == nullptr || b->device != p.device() || b->grad_dtype != grad_dtype ||
        (b->numel + p.numel()) * static_cast<int64_t>(c10::elementSize(grad_dtype)) > options_.bucket_bytes()) {
      buckets_.push_back(std::make_unique<Bucket>());
      b = buckets_.back().get();
      b->device = p.device();
      b->grad_dtype = grad_dtype;
    }
    b->indices.push_back(i);
    b->offsets.push_back(b->numel);
    b->numel += p.numel();
  }
  for (size_t k = 0; k < buckets_.size(); ++k) {
    Bucket& b = *buckets_[k];
    b.pending = b.indices.size();
    b.ready.assign(b.indices.size(), false);
    b.buffer = at::empty({b.numel},
                         at::TensorOptions().device(b.device).dtype(wire_dtype(options_.compression(), b.grad_dtype)));
    if (!options_.overlap()) {
      continue;
    }
    for (size_t slot = 0; slot < b.indices.size(); ++slot) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params_[b.indices[slot]]);
      const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, k, slot](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            grad_ready(k, slot);
            return outputs;
          }));
      remove_hooks_.push_back([accumulator, key]() { accumulator->del_post_hook(key); });
    }
  }
}

GradientAllReduce::~GradientAllReduce() {
  for (auto& remove : remove_hooks_) {
    remove();
  }
}

void GradientAllReduce::grad_ready(size_t bucket, size_t slot) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!require_sync_) {
    return;
  }
  Bucket& b = *buckets_[bucket];
  TORCH_CHECK(!b.launched && !b.ready[slot],
              "ampkit::distributed::GradientAllReduce: a second backward reached "
              "parameter ",
              b.indices[slot],
              " before synchronize(); with gradient accumulation, "
              "set_require_sync(false) for the backwards before the last one");
  b.ready[slot] = true;
  --b.pending;
  // Buckets go out strictly in order (every rank pairs the same buffers), each as soon as it and all before it
  // are complete.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_]->pending == 0) {
    launch(*buckets_[next_bucket_++]);
  }
}

namespace {

// Whether ampkit's cast passes take these dtypes (FP16, BF16, FP32); others go through copy_ and ATen.
bool cast_pass_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

}  // namespace

void GradientAllReduce::launch(Bucket& b) {
  const at::NoGradGuard no_grad;
  const auto size = static_cast<double>(process_group_->getSize());
  const bool fused = cast_pass_dtype(b.grad_dtype) && cast_pass_dtype(b.buffer.scalar_type());
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> parts;
  for (size_t slot = 0; slot < b.indices.size(); ++slot) {
    const at::Tensor& p = params_[b.indices[slot]];
    at::Tensor part = b.buffer.narrow(0, b.offsets[slot], p.numel()).view(p.sizes());
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) {
      part.zero_();  // no grad on this rank: it contributes zeros
    } else if (fused) {
      grads.push_back(grad);
      parts.push_back(std::move(part));
    } else {
      part.copy_(grad);
    }
  }
  if (fused) {
    // Cast into the flat buffer, then divide in the wire dtype (the bits of torch's and ampkit's DDP hooks), in
    // one pass; the zeroed parts stay zero.
    cast_divide_(grads, parts, size);
  } else {
    b.buffer.div_(size);
  }
  std::vector<at::Tensor> tensors{b.buffer};
  b.work = process_group_->allreduce(tensors);
  b.launched = true;
  bytes_reduced_ += b.buffer.nbytes();
  allreduces_ += 1;
}

void GradientAllReduce::synchronize() {
  if (!require_sync()) {
    return;
  }
  const at::NoGradGuard no_grad;
  const std::lock_guard<std::mutex> lock(mutex_);
  for (; next_bucket_ < buckets_.size(); ++next_bucket_) {  // the rest, in order
    launch(*buckets_[next_bucket_]);
  }
  next_bucket_ = 0;
  const bool unscale = scaler_ != nullptr && scaler_->is_enabled() && scaler_->get_scale_async().defined();
  for (auto& bucket : buckets_) {
    Bucket& b = *bucket;
    b.work->wait();
    std::vector<at::Tensor> grads;
    std::vector<at::Tensor> parts;
    for (size_t slot = 0; slot < b.indices.size(); ++slot) {
      at::Tensor& p = params_[b.indices[slot]];
      parts.push_back(b.buffer.narrow(0, b.offsets[slot], p.numel()).view(p.sizes()));
      if (!p.grad().defined()) {
        p.mutable_grad() = at::empty_like(p, p.options().dtype(b.grad_dtype), at::MemoryFormat::Preserve);
      }
      grads.push_back(p.mutable_grad());
    }
    const bool fused = cast_pass_dtype(b.grad_dtype) && cast_pass_dtype(b.buffer.scalar_type());
    if (unscale) {
      // The scaler's unscale and check, done here once for the bucket's grads; the scaler copies the flag into a
      // slot of its own (NOTE [Scaler streams]), so the bucket's tensor is free again at once.
      if (!b.found_inf.defined()) {
        b.found_inf = at::empty({1}, at::TensorOptions().device(b.device).dtype(at::kFloat));
      }
      b.found_inf.zero_();
      const at::Tensor factor = scaler_->unscale_factor(b.device);
      if (fused) {
        cast_unscale_and_check_(parts, grads, b.found_inf, factor);  // decompress + unscale + check: one pass
      } else {
        for (size_t i = 0; i < grads.size(); ++i) {
          grads[i].copy_(parts[i]);
        }
        unscale_and_check_(grads, b.found_inf, factor);
      }
      scaler_->record_unscaled_grads(b.found_inf);
    } else {
      for (size_t i = 0; i < grads.size(); ++i) {
        grads[i].copy_(parts[i]);  // decompress
      }
    }
    b.work.reset();
    b.launched = false;
    b.pending = b.indices.size();
    b.ready.assign(b.indices.size(), false);
  }
}

std::vector<std::vector<int64_t>> GradientAllReduce::bucket_indices() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) {
    out.push_back(b->indices);
  }
  return out;
}

}  // namespace ampkit::distributed
