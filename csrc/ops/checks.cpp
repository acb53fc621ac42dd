// Argument checks of every ampkit op, shared by its CPU, CUDA and Meta kernels (see op_args.h), and the
// functors' parameters built from checked arguments.
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "op_args.h"

namespace ampkit::detail {
namespace {

// `device`, when given, is the device of the argument named `ref` (the op's reference argument).
void check_scalar_tensor(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype,
                         const std::optional<at::Device>& device, const char* ref = "params[0]") {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, " must be a defined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, " must be a strided tensor, but got layout ",
              t.layout());
  TORCH_CHECK(t.numel() == 1, "ampkit::", op, ": ", arg, " must have exactly one element, but got ", t.numel(),
              " elements (shape ", t.sizes(), ")");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampkit::", op, ": ", arg, " must be a ", dtype, " tensor, but got ",
                   t.scalar_type());
  if (device.has_value()) {
    TORCH_CHECK(t.device() == *device, "ampkit::", op, ": ", arg, " must be on the device of ", ref, " (", *device,
                "), but is on ", t.device());
  }
}

void check_float_list(const char* op, const char* arg, at::TensorList list, const at::Device& device, bool mutated) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, "[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, "[", i,
                "] must be a strided (dense) tensor, but got layout ", t.layout());
    const auto dtype = t.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                     "ampkit::", op, ": ", arg, "[", i, "] must be Half, BFloat16, Float or Double, but got ", dtype);
    TORCH_CHECK(t.device() == device, "ampkit::", op, ": ", arg, "[", i, "] must be on ", device,
                " like found_inf and the other tensors, but is on ", t.device());
    if (mutated && t.device().type() != at::kMeta) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "ampkit::", op, ": ", arg, "[", i,
                  "] is written in place and must not have overlapping elements (an expanded view?)");
    }
  }
}

void check_list_length(const char* op, const char* name, at::TensorList list, size_t expected, bool required) {
  TORCH_CHECK_VALUE(list.size() == expected || (!required && list.empty()), "ampkit::", op, ": ", name, " must have ",
                    expected, " tensors (one per param)", required ? "" : " or none", ", but has ", list.size());
}

// `t` must be a companion of params[i]: same shape and strides, on the same device, of `dtype`.
void check_companion(const char* op, const char* name, size_t i, const at::Tensor& t, const at::Tensor& param,
                     at::ScalarType dtype) {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", name, "[", i,
              "] must be a strided (dense) tensor, but got layout ", t.layout());
  TORCH_CHECK(t.device() == param.device(), "ampkit::", op, ": ", name, "[", i, "] must be on ", param.device(),
              " like params[", i, "], but is on ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampkit::", op, ": ", name, "[", i, "] must be ", dtype,
                   ", but got ", t.scalar_type());
  // Symbolic-size aware (fake tensors under torch.compile carry SymInts).
  TORCH_CHECK(t.sym_sizes() == param.sym_sizes() && t.sym_strides() == param.sym_strides(), "ampkit::", op, ": ",
              name, "[", i, "] must have the shape and strides of params[", i, "] (", param.sym_sizes(), ", ",
              param.sym_strides(), "), but has ", t.sym_sizes(), ", ", t.sym_strides());
}

void check_optim_args(const char* op, const OptimLists& l, bool need_exp_avgs, bool need_exp_avg_sqs,
                      bool need_max_exp_avg_sqs, bool need_steps, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor) {
  const size_t n = l.params.size();
  check_list_length(op, "grads", l.grads, n, true);
  check_list_length(op, "master_params", l.master_params, n, false);
  check_list_length(op, "param_remainders", l.param_remainders, n, false);
  TORCH_CHECK_VALUE(l.master_params.empty() || l.param_remainders.empty(), "ampkit::", op,
                    ": give master_params or param_remainders, not both");
  check_list_length(op, need_exp_avg_sqs ? "exp_avgs" : "momentum_buffers", l.exp_avgs, need_exp_avgs ? n : 0, true);
  check_list_length(op, "exp_avg_sqs", l.exp_avg_sqs, need_exp_avg_sqs ? n : 0, true);
  check_list_length(op, "max_exp_avg_sqs", l.max_exp_avg_sqs, need_max_exp_avg_sqs ? n : 0, true);
  check_list_length(op, "state_steps", l.state_steps, n, need_steps);
  if (n == 0) {
    return;
  }
  const at::Device device = l.params[0].device();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = l.params[i];
    TORCH_CHECK(p.defined(), "ampkit::", op, ": params[", i, "] is undefined");
    TORCH_CHECK(p.layout() == at::kStrided, "ampkit::", op, ": params[", i,
                "] must be a strided (dense) tensor, but got layout ", p.layout());
    TORCH_CHECK(p.device() == device, "ampkit::", op, ": params[", i, "] must be on ", device,
                " like params[0], but is on ", p.device());
    const auto dtype = p.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, "ampkit::", op,
                     ": params[", i, "] must be Half, BFloat16 or Float, but got ", dtype);
    TORCH_CHECK(p.sym_numel() == 0 || p.is_non_overlapping_and_dense(), "ampkit::", op, ": params[", i,
                "] must be dense (non-overlapping, no gaps)");
    check_companion(op, "grads", i, l.grads[i], p, dtype);
    if (!l.master_params.empty()) {
      check_companion(op, "master_params", i, l.master_params[i], p, at::kFloat);
    }
    if (!l.param_remainders.empty()) {
      TORCH_CHECK_TYPE(dtype == at::kBFloat16, "ampkit::", op, ": params[", i,
                       "] must be BFloat16 when param_remainders are given, but got ", dtype);
      check_companion(op, "param_remainders", i, l.param_remainders[i], p, at::kShort);
    }
    if (need_exp_avgs) {
      check_companion(op, need_exp_avg_sqs ? "exp_avgs" : "momentum_buffers", i, l.exp_avgs[i], p, at::kFloat);
    }
    if (need_exp_avg_sqs) {
      check_companion(op, "exp_avg_sqs", i, l.exp_avg_sqs[i], p, at::kFloat);
    }
    if (need_max_exp_avg_sqs) {
      check_companion(op, "max_exp_avg_sqs", i, l.max_exp_avg_sqs[i], p, at::kFloat);
    }
    if (!l.state_steps.empty()) {
      const at::Tensor& s = l.state_steps[i];
      TORCH_CHECK(s.defined() && s.sym_numel() == 1 && s.scalar_type() == at::kFloat && s.device() == device, "ampkit::",
                  op, ": state_steps[", i, "] must be a one-element Float tensor on ", device);
    }
  }
  if (grad_scale.has_value()) {
    check_scalar_tensor(op, "grad_scale", *grad_scale, at::kFloat, device);
  }
  if (found_inf.has_value()) {
    check_scalar_tensor(op, "found_inf", *found_inf, at::kFloat, device);
  }
  if (lr_tensor.has_value()) {
    check_scalar_tensor(op, "lr_tensor", *lr_tensor, at::kFloat, device);
  }
}

void check_adam_hparams(const char* op, double lr, double beta1, double beta2, double weight_decay, double eps) {
  TORCH_CHECK_VALUE(lr >= 0.0, "ampkit::", op, ": lr must be >= 0, but got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "ampkit::", op, ": beta1 must be in [0, 1), but got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "ampkit::", op, ": beta2 must be in [0, 1), but got ", beta2);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "ampkit::", op, ": weight_decay must be >= 0, but got ", weight_decay);
  TORCH_CHECK_VALUE(eps >= 0.0, "ampkit::", op, ": eps must be >= 0, but got ", eps);
}

void check_sgd_hparams(const char* op, double lr, double momentum, double dampening, double weight_decay,
                       bool nesterov) {
  TORCH_CHECK_VALUE(lr >= 0.0, "ampkit::", op, ": lr must be >= 0, but got ", lr);
  TORCH_CHECK_VALUE(momentum >= 0.0, "ampkit::", op, ": momentum must be >= 0, but got ", momentum);
  TORCH_CHECK_VALUE(std::isfinite(dampening), "ampkit::", op, ": dampening must be a finite number, but got ",
                    dampening);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "ampkit::", op, ": weight_decay must be >= 0, but got ", weight_decay);
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0.0 && dampening == 0.0), "ampkit::", op,
                    ": nesterov momentum requires a momentum > 0 and zero dampening");
}

void check_scale_factors(const char* op, double growth_factor, double backoff_factor, int64_t growth_interval) {
  TORCH_CHECK_VALUE(std::isfinite(growth_factor) && growth_factor > 0, "ampkit::", op,
                    ": growth_factor must be a finite number > 0, but got ", growth_factor);
  TORCH_CHECK_VALUE(std::isfinite(backoff_factor) && backoff_factor > 0, "ampkit::", op,
                    ": backoff_factor must be a finite number > 0, but got ", backoff_factor);
  TORCH_CHECK_VALUE(growth_interval >= 1 && growth_interval <= std::numeric_limits<int32_t>::max(), "ampkit::", op,
                    ": growth_interval must be in [1, 2^31 - 1], but got ", growth_interval);
}

// NOTE [Aliasing]
// The tensors an op writes (and the device scalars it reads while writing) must not share memory: two views of
// one buffer in a list would be updated twice, a master aliasing a moment would corrupt the weight, found_inf
// aliasing inv_scale would change the scale mid-launch. Byte ranges are sorted to find candidate pairs in
// O(n log n); a candidate is confirmed with ATen's overlap test, as ATen's own in-place ops do: full or partial
// overlap is refused, while views it cannot decide (interleaved strided views of one buffer, such as the even and
// odd columns of a matrix, which share no element) are accepted.
class AliasCheck {
 public:
  explicit AliasCheck(const char* op) : op_(op) {}

  void add(const char* arg, const at::Tensor& t, int64_t index = -1, bool read_only = false) {
    if (!t.defined()) {
      return;
    }
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->device_type() == c10::DeviceType::Meta || impl->numel() == 0 || !impl->has_storage()) {
      return;
    }
    int64_t extent = 1;  // elements from the first to one past the last (a contiguous tensor: its numel)
    if (impl->is_contiguous()) {
      extent = impl->numel();
    } else {
      all_contiguous_ = false;
      const auto sizes = impl->sizes();
      const auto strides = impl->strides();
      for (size_t d = 0; d < sizes.size(); ++d) {
        extent += (sizes[d] - 1) * strides[d];
      }
    }
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    ranges_.push_back({begin, begin + static_cast<uintptr_t>(extent * static_cast<int64_t>(impl->itemsize())),
                       static_cast<uint32_t>(entries_.size())});
    entries_.push_back({arg, index, &t, read_only});
  }

  // `read_only`: the list is only read, so its tensors may share memory with each other (never with the others).
  void add(const char* arg, at::TensorList list, bool read_only = false) {
    // Room for the list, growing geometrically (an exact reserve per list would copy every earlier record).
    if (ranges_.capacity() < ranges_.size() + list.size()) {
      ranges_.reserve(std::max(ranges_.size() + list.size(), 2 * ranges_.capacity()));
      entries_.reserve(ranges_.capacity());
    }
    for (size_t i = 0; i < list.size(); ++i) {
      add(arg, list[i], static_cast<int64_t>(i), read_only);
    }
  }

  void add(const char* arg, const std::optional<at::Tensor>& t, bool read_only = false) {
    if (t.has_value()) {
      add(arg, *t, -1, read_only);
    }
  }

  // Throws, naming both arguments, if any two added tensors share an element. Ranges are sorted by start (small
  // records); a range that starts at or after the end of every earlier one overlaps none of them, so only the
  // others are compared with the ranges still open.
  void check() {
    // NOTE [Alias check memo]
    // An optimizer's lists are the same tensors step after step (and, with grads kept between steps or reused
    // by the allocator, the same memory). The verdict depends only on the ranges and which of them are read-only
    // when every tensor is contiguous (two contiguous tensors share an element iff their ranges overlap), so the
    // last call that passed on this thread is kept: the same ranges in the same order pass again without the sort.
    // Compared in place; the key is built (before the sort reorders the ranges) only when it differs.
    thread_local std::vector<uintptr_t> passed;
    thread_local const char* passed_op = nullptr;
    std::vector<uintptr_t> key;
    if (all_contiguous_) {
      bool same = passed_op == op_ && passed.size() == ranges_.size() * 3;
      for (size_t i = 0; same && i < ranges_.size(); ++i) {
        const Range& r = ranges_[i];
        same = passed[3 * i] == r.begin && passed[3 * i + 1] == r.end &&
               passed[3 * i + 2] == (entries_[r.entry].read_only ? 1u : 0u);
      }
      if (same) {
        return;
      }
      key.reserve(ranges_.size() * 3);
      for (const Range& r : ranges_) {
        key.push_back(r.begin);
        key.push_back(r.end);
        key.push_back(entries_[r.entry].read_only ? 1 : 0);
      }
    }
    std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
    std::vector<const Range*> open;
    uintptr_t max_end = 0;
    for (const Range& r : ranges_) {
      if (r.begin >= max_end) {
        open.clear();
      } else {
        open.erase(std::remove_if(open.begin(), open.end(), [&](const Range* o) { return o->end <= r.begin; }),
                   open.end());
        const Entry& e = entries_[r.entry];
        for (const Range* o : open) {
          const Entry& oe = entries_[o->entry];
          if (oe.read_only && e.read_only) {
            continue;
          }
          const at::MemOverlapStatus status = at::get_overlap_status(*oe.t, *e.t);
          if (status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial) {
            TORCH_CHECK(false, "ampkit::", op_, ": ", name(oe), " and ", name(e),
                        " share memory, but every tensor the op writes (and each device scalar it reads) must be "
                        "distinct: the same tensor twice in a list, or two overlapping views of one buffer?");
          }
        }
      }
      open.push_back(&r);
      max_end = std::max(max_end, r.end);
    }
    if (all_contiguous_) {
      passed = std::move(key);
      passed_op = op_;
    }
  }

 private:
  struct Range {
    uintptr_t begin;
    uintptr_t end;
    uint32_t entry;
  };
  struct Entry {
    const char* arg;
    int64_t index;
    const at::Tensor* t;
    bool read_only;
  };

  static std::string name(const Entry& e) {
    return e.index < 0 ? std::string(e.arg) : std::string(e.arg) + "[" + std::to_string(e.index) + "]";
  }

  const char* op_;
  std::vector<Range> ranges_;
  std::vector<Entry> entries_;
  bool all_contiguous_ = true;
};

// A list entry of the FP16/BF16/FP32-only ops (cast passes, grad_stats): defined, strided, of one of those dtypes,
// on `device` (the first entry's when not set yet; `like` names what set it).
void check_narrow_float_entry(const char* op, const char* arg, size_t i, const at::Tensor& t,
                              std::optional<at::Device>& device, const char* like) {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, "[", i,
              "] must be a strided (dense) tensor, but got layout ", t.layout());
  const auto dtype = t.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, "ampkit::", op, ": ", arg,
                   "[", i, "] must be Half, BFloat16 or Float, but got ", dtype);
  if (!device.has_value()) {
    device = t.device();
  }
  TORCH_CHECK(t.device() == *device, "ampkit::", op, ": ", arg, "[", i, "] must be on ", *device, " like ", like,
              ", but is on ", t.device());
}

}  // namespace

void check(const UnscaleArgs& a) {
  check_scalar_tensor(a.op, "found_inf", a.found_inf, at::kFloat, std::nullopt);
  const bool unscale = a.inv_scale.defined();
  if (unscale) {
    check_scalar_tensor(a.op, "inv_scale", a.inv_scale, at::kFloat, a.found_inf.device(), "found_inf");
  }
  check_float_list(a.op, unscale ? "grads" : "tensors", a.grads, a.found_inf.device(), /*mutated=*/unscale);
  AliasCheck alias(a.op);
  alias.add("found_inf", a.found_inf);
  alias.add("inv_scale", a.inv_scale);
  if (unscale) {
    alias.add("grads", a.grads);
  }
  alias.check();
}

void check(const GradStatsArgs& a) {
  std::optional<at::Device> device;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    check_narrow_float_entry(a.op, "grads", i, a.grads[i], device, "grads[0]");
  }
  if (a.inv_scale.has_value()) {
    check_scalar_tensor(a.op, "inv_scale", *a.inv_scale, at::kFloat, device, "grads[0]");
  }
}

void check(const CastArgs& a) {
  const size_t n = a.src.size();
  TORCH_CHECK_VALUE(a.out.size() == n, "ampkit::", a.op, ": out must have ", n, " tensors (one per src), but has ",
                    a.out.size());
  const bool unscale = a.inv_scale.defined();
  std::optional<at::Device> device;
  if (unscale) {
    check_scalar_tensor(a.op, "found_inf", a.found_inf, at::kFloat, std::nullopt);
    check_scalar_tensor(a.op, "inv_scale", a.inv_scale, at::kFloat, a.found_inf.device(), "found_inf");
    device = a.found_inf.device();
  } else {
    // The kernels divide in FP32: the divisor must be a finite FP32 number > 0 once rounded.
    const auto divisor = static_cast<float>(a.divisor);
    TORCH_CHECK_VALUE(std::isfinite(a.divisor) && a.divisor > 0 && std::isfinite(divisor) && divisor > 0, "ampkit::",
                      a.op, ": divisor must be a finite number > 0 that FP32 holds, but got ", a.divisor);
  }
  for (size_t i = 0; i < n; ++i) {
    const char* like = unscale ? "found_inf" : "src[0]";
    check_narrow_float_entry(a.op, "src", i, a.src[i], device, like);
    check_narrow_float_entry(a.op, "out", i, a.out[i], device, like);
    TORCH_CHECK(a.src[i].sym_sizes() == a.out[i].sym_sizes(), "ampkit::", a.op, ": out[", i,
                "] must have the shape of src[", i, "] (", a.src[i].sym_sizes(), "), but has ", a.out[i].sym_sizes());
    if (!a.out[i].device().is_meta()) {
      TORCH_CHECK(at::has_internal_overlap(a.out[i]) != at::MemOverlap::Yes, "ampkit::", a.op, ": out[", i,
                  "] is written and must not have overlapping elements (an expanded view?)");
    }
  }
  AliasCheck alias(a.op);
  alias.add("out", a.out);
  alias.add("src", a.src, /*read_only=*/true);
  if (unscale) {
    alias.add("found_inf", a.found_inf);
    alias.add("inv_scale", a.inv_scale, -1, /*read_only=*/true);
  }
  alias.check();
}

namespace {

void check_update_scale_values(const UpdateScaleArgs& a) {
  check_scalar_tensor(a.op, "scale", a.scale, at::kFloat, std::nullopt);
  check_scalar_tensor(a.op, "growth_tracker", a.growth_tracker, at::kInt, a.scale.device(), "scale");
  check_scalar_tensor(a.op, "found_inf", a.found_inf, at::kFloat, a.scale.device(), "scale");
  check_scale_factors(a.op, a.growth_factor, a.backoff_factor, a.growth_interval);
  if (!a.hysteresis_tracker.defined() && !a.stats.defined()) {
    return;  // update_scale_
  }
  check_scalar_tensor(a.op, "hysteresis_tracker", a.hysteresis_tracker, at::kInt, a.scale.device(), "scale");
  const at::Tensor& stats = a.stats;
  TORCH_CHECK(stats.defined() && stats.layout() == at::kStrided && stats.dim() == 1 &&
                  stats.numel() == kernels::kNumStats && stats.is_contiguous(),
              "ampkit::", a.op, ": stats must be a contiguous 1-D tensor of ", static_cast<int>(kernels::kNumStats),
              " elements, but got ", stats.defined() ? stats.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kLong, "ampkit::", a.op, ": stats must be a Long tensor, but got ",
                   stats.scalar_type());
  TORCH_CHECK(stats.device() == a.scale.device(), "ampkit::", a.op, ": stats must be on ", a.scale.device(),
              " like the other arguments, but is on ", stats.device());
  TORCH_CHECK_VALUE(a.hysteresis >= 1 && a.hysteresis <= std::numeric_limits<int32_t>::max(), "ampkit::", a.op,
                    ": hysteresis must be in [1, 2^31 - 1], but got ", a.hysteresis);
  TORCH_CHECK_VALUE(a.min_scale >= 0 && a.max_scale >= a.min_scale && !std::isnan(a.max_scale), "ampkit::", a.op,
                    ": min_scale and max_scale must satisfy 0 <= min_scale <= max_scale, but got min_scale=",
                    a.min_scale, ", max_scale=", a.max_scale);
}

}  // namespace

void check(const UpdateScaleArgs& a) {
  check_update_scale_values(a);
  AliasCheck alias(a.op);
  alias.add("scale", a.scale);
  alias.add("growth_tracker", a.growth_tracker);
  alias.add("hysteresis_tracker", a.hysteresis_tracker);
  alias.add("stats", a.stats);
  alias.add("found_inf", a.found_inf);
  alias.check();
}


namespace {

// Everything a fused step writes or reads, the device scalars included, must be distinct (NOTE [Aliasing]): the
// grads are read while the rest is written, and stored back when unscaled. A step that only reads its grads
// (`grads_read_only`: LAMB) lets them, and its device scalars (`grad_norm` among them), share memory with each
// other, never with what it writes.
void check_step_aliasing(const char* op, const OptimLists& l, const StepScalars& s, const char* exp_avg_name,
                         bool grads_read_only = false, const std::optional<at::Tensor>& grad_norm = std::nullopt) {
  AliasCheck alias(op);
  alias.add("params", l.params);
  alias.add("grads", l.grads, grads_read_only);
  alias.add("master_params", l.master_params);
  alias.add("param_remainders", l.param_remainders);
  alias.add(exp_avg_name, l.exp_avgs);
  alias.add("exp_avg_sqs", l.exp_avg_sqs);
  alias.add("max_exp_avg_sqs", l.max_exp_avg_sqs);
  alias.add("state_steps", l.state_steps);
  alias.add("grad_scale", s.grad_scale, grads_read_only);
  alias.add("found_inf", s.found_inf, grads_read_only);
  alias.add("lr_tensor", s.lr_tensor, grads_read_only);
  alias.add("grad_norm", grad_norm, grads_read_only);
  alias.check();
}

}  // namespace

void check(const AdamStepArgs& a) {
  check_adam_hparams(a.op, a.lr, a.beta1, a.beta2, a.weight_decay, a.eps);
  check_optim_args(a.op, a.lists, true, true, a.amsgrad, true, a.scalars.grad_scale, a.scalars.found_inf,
                   a.scalars.lr_tensor);
  check_step_aliasing(a.op, a.lists, a.scalars, "exp_avgs");
}

void check(const SgdStepArgs& a) {
  check_sgd_hparams(a.op, a.lr, a.momentum, a.dampening, a.weight_decay, a.nesterov);
  const bool momentum = a.momentum != 0.0;
  check_optim_args(a.op, a.lists, momentum, false, false, momentum, a.scalars.grad_scale, a.scalars.found_inf,
                   a.scalars.lr_tensor);
  check_step_aliasing(a.op, a.lists, a.scalars, "momentum_buffers");
}

void check(const LambStepArgs& a) {
  check_adam_hparams(a.op, a.lr, a.beta1, a.beta2, a.weight_decay, a.eps);
  TORCH_CHECK_VALUE(a.max_grad_norm >= 0.0 && std::isfinite(a.max_grad_norm), "ampkit::", a.op,
                    ": max_grad_norm must be a finite number >= 0 (0: no clipping), but got ", a.max_grad_norm);
  check_optim_args(a.op, a.lists, true, true, false, true, a.scalars.grad_scale, a.scalars.found_inf,
                   a.scalars.lr_tensor);
  TORCH_CHECK_VALUE(a.lists.max_exp_avg_sqs.empty(), "ampkit::", a.op, ": LAMB keeps no max_exp_avg_sqs");
  if (a.grad_norm.has_value()) {
    check_scalar_tensor(a.op, "grad_norm", *a.grad_norm, at::kFloat,
                        a.lists.params.empty() ? std::nullopt : std::optional<at::Device>(a.lists.params[0].device()));
  }
  // The grads are only read (the moments pass and the apply pass both need them whole).
  check_step_aliasing(a.op, a.lists, a.scalars, "exp_avgs", /*grads_read_only=*/true, a.grad_norm);
}

void check(const GradNormArgs& a) {
  std::optional<at::Device> device;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    check_narrow_float_entry(a.op, "grads", i, a.grads[i], device, "grads[0]");
  }
  if (a.grad_scale.has_value()) {
    check_scalar_tensor(a.op, "grad_scale", *a.grad_scale, at::kFloat, device, "grads[0]");
  }
}

kernels::UpdateScaleOp update_scale_op(const UpdateScaleArgs& a) {
  return {a.growth_factor,
          a.backoff_factor,
          a.growth_interval,
          static_cast<int32_t>(a.hysteresis),
          static_cast<float>(a.min_scale),
          static_cast<float>(a.max_scale),
          a.dynamic};
}

kernels::AdamParams adam_params(const AdamStepArgs& a, double lr, int tail_width) {
  return {lr,         a.beta1,    a.beta2,    a.weight_decay, a.eps, a.amsgrad,
          a.maximize, a.decoupled_weight_decay, tail_width,   a.write_unscaled_grads};
}

kernels::LambParams lamb_params(const LambStepArgs& a, double lr) {
  return {lr,         a.beta1,          a.beta2,          a.weight_decay, a.eps, a.bias_correction,
          a.adam_w_mode, a.grad_averaging, a.use_nvlamb, a.max_grad_norm};
}

kernels::SgdParams sgd_params(const SgdStepArgs& a, double lr, int tail_width) {
  return {lr, a.momentum, a.dampening, a.weight_decay, a.nesterov, a.maximize, tail_width, a.write_unscaled_grads};
}

}  // namespace ampkit::detail
