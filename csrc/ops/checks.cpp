// Argument checks of every ampkit op, shared by its CPU, CUDA and Meta kernels (see op_args.h), and the
// functors' parameters built from checked arguments.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../kernels/blockwise8.h"
#include "alias_check.h"
#include "descriptors.h"
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

// NOTE [Metadata prefetch]
// A pass over thousands of small tensors waits on memory more than it computes: each tensor's TensorImpl and
// storage are allocations of their own, reached through pointers (list -> TensorImpl -> storage), so the hardware
// cannot fetch them ahead, and after a forward and backward pass (anything that streams through the caches) each
// one misses. The passes of a step over its tensors (the binding's scan, the core's plan, the fused step's checks,
// the list checks of the scaler's unscale and inf check) therefore prefetch what they will read a few tensors on:
// the objects kMetadataAhead positions ahead, and those reached through them (a storage, a grad) kMetadataAhead / 2
// ahead, whose pointers were prefetched by then. Measured on 2,000 FP32 AdamW parameters of ~1,000 elements, 2
// threads, each step after a 96 MiB write, the passes' prefetches toggled in one process: these checks 0.85 ->
// 0.52 ms, the whole step 3.4 -> 3.0 ms; bench/many_small.py's figures against the build before are in
// docs/performance.md.
constexpr size_t kMetadataAhead = 8;

// At position i of a pass over `list`: prefetches the TensorImpl of list[i + kMetadataAhead] and the storage of
// list[i + kMetadataAhead / 2] (read from its TensorImpl: prefetched kMetadataAhead / 2 positions earlier), where
// they exist and are defined.
void prefetch_metadata(at::TensorList list, size_t i) {
  const size_t ahead = i + kMetadataAhead;
  const size_t half = i + kMetadataAhead / 2;
  if (ahead < list.size() && list[ahead].defined()) {
    const auto* impl = reinterpret_cast<const char*>(list[ahead].unsafeGetTensorImpl());
    for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) {
      __builtin_prefetch(impl + offset);
    }
    __builtin_prefetch(impl + sizeof(c10::TensorImpl) - 1);
  }
  if (half < list.size() && list[half].defined()) {
    const c10::Storage& storage = list[half].unsafeGetTensorImpl()->unsafe_storage();
    if (storage) {
      const auto* impl = reinterpret_cast<const char*>(storage.unsafeGetStorageImpl());
      __builtin_prefetch(impl);
      __builtin_prefetch(impl + sizeof(c10::StorageImpl) - 1);
    }
  }
}

void check_float_list(const char* op, const char* arg, at::TensorList list, const at::Device& device, bool mutated) {
  for (size_t i = 0; i < list.size(); ++i) {
    prefetch_metadata(list, i);
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

// Bytes past a 4-byte boundary at which a Byte tensor without data (Meta, fake) starts: its storage offset's, every
// allocator aligning a storage's base; 0 where the offset is symbolic or the tensor empty.
int64_t storage_misalignment(const at::Tensor& t) {
  const auto numel = t.sym_numel().maybe_as_int();
  const auto offset = t.sym_storage_offset().maybe_as_int();
  return numel.has_value() && *numel > 0 && offset.has_value() ? *offset % 4 : 0;
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
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampkit::", op, ": ", name, "[", i, "] must be ", dtype, ", but got ",
                   t.scalar_type());
  // Symbolic-size aware (fake tensors under torch.compile carry SymInts).
  TORCH_CHECK(t.sym_sizes() == param.sym_sizes() && t.sym_strides() == param.sym_strides(), "ampkit::", op, ": ", name,
              "[", i, "] must have the shape and strides of params[", i, "] (", param.sym_sizes(), ", ",
              param.sym_strides(), "), but has ", t.sym_sizes(), ", ", t.sym_strides());
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

// A list entry of the FP16/BF16/FP32-only ops (cast passes, grad_stats): defined, strided, of one of those dtypes,
// on `device` (the first entry's when not set yet; `like` names what set it).
void check_narrow_float_entry(const char* op, const char* arg, size_t i, const at::Tensor& t,
                              std::optional<at::Device>& device, const char* like) {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, "[", i,
              "] must be a strided (dense) tensor, but got layout ", t.layout());
  const auto dtype = t.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, "ampkit::", op, ": ", arg, "[",
                   i, "] must be Half, BFloat16 or Float, but got ", dtype);
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
    TORCH_CHECK_VALUE(std::isfinite(a.divisor) && a.divisor > 0 && std::isfinite(divisor) && divisor > 0,
                      "ampkit::", a.op, ": divisor must be a finite number > 0 that FP32 holds, but got ", a.divisor);
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

// What a fused step's lists hold: `exp_avg_name` names exp_avgs (Adam, LAMB) or momentum_buffers (SGD).
struct StepLists {
  const char* exp_avg_name = "exp_avgs";
  bool need_exp_avgs = false;
  bool need_exp_avg_sqs = false;
  bool need_max_exp_avg_sqs = false;
  bool need_steps = false;
  bool grads_read_only = false;  // LAMB: the grads are only read
  bool lean_weights = false;     // param_remainders may hold Kahan compensations or stochastic rounding seeds
  bool lean_states = false;      // moments may be BF16 or 8-bit block-wise (Adam, SGD)
};

// The lists of each fused step op (the op's side of NOTE [State lists of the fused ops] in ampkit/optim_core.h).
StepLists adamw_step_lists(bool amsgrad) {
  StepLists s;
  s.need_exp_avgs = s.need_exp_avg_sqs = s.need_steps = true;
  s.need_max_exp_avg_sqs = amsgrad;
  s.lean_weights = s.lean_states = true;
  return s;
}

StepLists sgd_step_lists(bool momentum) {
  StepLists s;
  s.exp_avg_name = "momentum_buffers";
  s.need_exp_avgs = s.need_steps = momentum;
  s.lean_weights = s.lean_states = true;
  return s;
}

StepLists lamb_step_lists() {
  StepLists s;
  s.need_exp_avgs = s.need_exp_avg_sqs = s.need_steps = true;
  s.grads_read_only = true;
  s.lean_weights = true;
  return s;
}

// NOTE [Weight companions]
// param_remainders carries what a BF16 weight kept without an FP32 master needs besides itself, one kind for the
// whole call, told apart by dtype: int16 remainders in the parameter's layout (master_weights="remainder"), BF16
// Kahan compensations in the parameter's layout ("kahan"), or one-element int64 stochastic rounding seeds on the
// parameter's device ("stochastic"; the step counts are then required: they are the generator's counter).
enum class Companion { kNone, kRemainder, kKahan, kSeed };

Companion companion_kind(const char* op, const OptimLists& l, bool lean) {
  if (l.param_remainders.empty()) {
    return Companion::kNone;
  }
  const at::Tensor& c = l.param_remainders[0];
  TORCH_CHECK(c.defined(), "ampkit::", op, ": param_remainders[0] is undefined");
  const at::ScalarType dtype = c.scalar_type();
  if (lean && dtype == at::kBFloat16) {
    return Companion::kKahan;
  }
  if (lean && dtype == at::kLong) {
    return Companion::kSeed;
  }
  TORCH_CHECK_TYPE(
      dtype == at::kShort, "ampkit::", op, ": param_remainders[0] must be ",
      lean ? "Short (remainders), BFloat16 (Kahan compensations) or Long (stochastic rounding seeds)" : "Short",
      ", but got ", dtype);
  return Companion::kRemainder;
}

// NOTE [Checks in parts]
// A real CPU step over many parameters (512 or more, with two or more intra-op threads, not already inside a
// parallel region) checks them in parts, one per intra-op thread: threads that otherwise wait while the host reads
// metadata (NOTE [One pass per parameter]). Each part checks its run of parameters, records their ranges in an
// AliasCheck of its own and writes their descriptors; the parts' ranges are then appended in order, exactly as
// one pass records them. A part gives up, and one pass then runs on the calling thread from the start, where
//   - a check fails: that pass throws the error of the first failing parameter, as it always has;
//   - a storage would materialize when its mutable data pointer is taken (copy-on-write, which torch forbids
//     inside at::parallel_for and which two parts could do at once to two views of one storage; from torch 2.12
//     any lazy materializer);
//   - a tensor dispatches to Python (a subclass may answer device(), sizes() and the rest in Python, which a
//     worker thread must not run while the calling thread holds the GIL).
// The parts only read: nothing has changed when they give up. CUDA steps keep the one pass (their host side has
// not been measured with parts).
std::atomic<int64_t> parts_ran{0};
std::atomic<int64_t> parts_gave_up{0};

template <typename CheckParam>
bool check_in_parts(const char* op, size_t n, AliasCheck& alias, std::vector<kernels::OptimTensor>* tensors,
                    const CheckParam& check_param) {
  constexpr size_t kPerPart = 256;  // parameters: below that, a part costs about what it saves
  const int threads = at::get_num_threads();
  if (n < 2 * kPerPart || threads < 2 || at::in_parallel_region()) {
    return false;
  }
  const size_t parts = std::min(static_cast<size_t>(threads), n / kPerPart);
  std::vector<AliasCheck> ranges(parts, AliasCheck(op));
  tensors->resize(n);
  std::atomic<bool> failed{false};
  at::parallel_for(0, static_cast<int64_t>(parts), 1, [&](int64_t begin, int64_t end) {
    for (auto k = static_cast<size_t>(begin); k < static_cast<size_t>(end); ++k) {
      const size_t first = n * k / parts;
      const size_t last = n * (k + 1) / parts;
      try {
        ranges[k].make_part();
        ranges[k].reserve((last - first) * 8);
        for (size_t i = first; i < last && !failed.load(std::memory_order_relaxed); ++i) {
          check_param(i, ranges[k], tensors->data() + i);
        }
      } catch (...) {
        failed.store(true, std::memory_order_relaxed);
      }
    }
  });
  if (failed.load()) {
    tensors->clear();
    parts_gave_up.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  alias.reserve(n * 8);
  for (const AliasCheck& part : ranges) {
    alias.append(part);
  }
  parts_ran.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// NOTE [One pass per parameter]
// A step over thousands of small tensors is bound by reading their metadata: every tensor's TensorImpl and storage
// live in memory of their own, so each pass over the lists misses in the caches about once per tensor. A step's
// lists are therefore checked, their byte ranges recorded for the alias check and, in a real run (`tensors` given),
// their kernel descriptors built in one pass per parameter, which reads each tensor's metadata and storage once.
// The descriptors take each tensor's mutable data pointer in that pass, so a copy-on-write storage is materialized
// there, and the alias check compares the memory the kernel will write.
//
// Everything a fused step writes or reads, the device scalars included, must be distinct (NOTE [Aliasing]): the
// grads are read while the rest is written, and stored back when unscaled. A step that only reads its grads
// (LAMB) lets them, and its device scalars (`grad_norm` among them), share memory with each other, never with what
// it writes.
void check_step_and_build_descriptors(const char* op, const OptimLists& l, const StepLists& spec, const StepScalars& s,
                                      const std::optional<at::Tensor>& grad_norm,
                                      std::vector<kernels::OptimTensor>* tensors) {
  const size_t n = l.params.size();
  check_list_length(op, "grads", l.grads, n, true);
  check_list_length(op, "master_params", l.master_params, n, false);
  check_list_length(op, "param_remainders", l.param_remainders, n, false);
  TORCH_CHECK_VALUE(l.master_params.empty() || l.param_remainders.empty(), "ampkit::", op,
                    ": give master_params or param_remainders, not both");
  check_list_length(op, spec.exp_avg_name, l.exp_avgs, spec.need_exp_avgs ? n : 0, true);
  check_list_length(op, "exp_avg_sqs", l.exp_avg_sqs, spec.need_exp_avg_sqs ? n : 0, true);
  check_list_length(op, "max_exp_avg_sqs", l.max_exp_avg_sqs, spec.need_max_exp_avg_sqs ? n : 0, true);
  const Companion companion = companion_kind(op, l, spec.lean_weights);
  check_list_length(op, "state_steps", l.state_steps, n, spec.need_steps || companion == Companion::kSeed);
  AliasCheck alias(op);
  const bool data = tensors != nullptr;
  if (n > 0) {
    const at::Device device = l.params[0].device();
    // The checks of params[i] and its companions, their ranges recorded in `alias` and, in a real run, their
    // descriptor written to *out.
    const at::TensorList all_lists[] = {l.params,   l.grads,       l.master_params,   l.param_remainders,
                                        l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.state_steps};
    auto check_param = [&](size_t i, AliasCheck& ranges, kernels::OptimTensor* out) {
      for (at::TensorList list : all_lists) {  // NOTE [Metadata prefetch]
        prefetch_metadata(list, i);
      }
      if (ranges.is_part()) {  // no Python on a worker thread (NOTE [Checks in parts])
        for (at::TensorList list : all_lists) {
          if (!list.empty() && list[i].defined() && list[i].unsafeGetTensorImpl()->is_python_dispatch()) {
            throw AliasCheck::GiveUp{};
          }
        }
      }
      const at::Tensor& p = l.params[i];
      TORCH_CHECK(p.defined(), "ampkit::", op, ": params[", i, "] is undefined");
      TORCH_CHECK(p.layout() == at::kStrided, "ampkit::", op, ": params[", i,
                  "] must be a strided (dense) tensor, but got layout ", p.layout());
      TORCH_CHECK(p.device() == device, "ampkit::", op, ": params[", i, "] must be on ", device,
                  " like params[0], but is on ", p.device());
      const auto dtype = p.scalar_type();
      TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, "ampkit::", op, ": params[",
                       i, "] must be Half, BFloat16 or Float, but got ", dtype);
      TORCH_CHECK(p.sym_numel() == 0 || p.is_non_overlapping_and_dense(), "ampkit::", op, ": params[", i,
                  "] must be dense (non-overlapping, no gaps)");
      const auto index = static_cast<int64_t>(i);
      // Checked, then recorded: (its data pointer in a real run).
      auto entry = [&](const char* name, const at::Tensor& t, at::ScalarType type, bool read_only = false) {
        check_companion(op, name, i, t, p, type);
        return ranges.add_defined(name, t, index, read_only, data);
      };
      void* param = ranges.add_defined("params", p, index, false, data);
      // The grad in the parameter's dtype, or a FP16/BF16 parameter's in FP32 (NOTE [FP32 grads of low-precision
      // params]).
      const at::Tensor& g = l.grads[i];
      const bool grad_fp32 = dtype != at::kFloat && g.defined() && g.scalar_type() == at::kFloat;
      TORCH_CHECK_TYPE(!g.defined() || g.scalar_type() == dtype || grad_fp32, "ampkit::", op, ": grads[", i,
                       "] must be ", dtype, (dtype == at::kFloat ? "" : " or Float"), " like params[", i, "], but got ",
                       g.scalar_type());
      void* grad = entry("grads", g, grad_fp32 ? at::kFloat : dtype, spec.grads_read_only);
      void* master = nullptr;
      void* remainder = nullptr;
      void* comp = nullptr;
      void* seed = nullptr;
      void* m = nullptr;
      void* v = nullptr;
      void* vmax = nullptr;
      void* step = nullptr;
      if (!l.master_params.empty()) {
        master = entry("master_params", l.master_params[i], at::kFloat);
      }
      if (!l.param_remainders.empty()) {
        TORCH_CHECK_TYPE(dtype == at::kBFloat16, "ampkit::", op, ": params[", i,
                         "] must be BFloat16 when param_remainders are given, but got ", dtype);
        const at::Tensor& c = l.param_remainders[i];
        if (companion == Companion::kRemainder) {
          remainder = entry("param_remainders", c, at::kShort);
        } else if (companion == Companion::kKahan) {
          comp = entry("param_remainders", c, at::kBFloat16);
        } else {
          TORCH_CHECK(c.defined(), "ampkit::", op, ": param_remainders[", i, "] is undefined");
          TORCH_CHECK_TYPE(c.scalar_type() == at::kLong, "ampkit::", op, ": param_remainders[", i,
                           "] must be Long like param_remainders[0] (stochastic rounding seeds), but got ",
                           c.scalar_type());
          TORCH_CHECK(c.layout() == at::kStrided && c.numel() == 1, "ampkit::", op, ": param_remainders[", i,
                      "] must be a one-element strided tensor (a stochastic rounding seed), but has shape ", c.sizes());
          TORCH_CHECK(c.device() == device, "ampkit::", op, ": param_remainders[", i, "] must be on ", device,
                      " like params[", i, "], but is on ", c.device());
          seed = ranges.add_defined("param_remainders", c, index, true, data);
        }
      }
      // A moment (momentum buffer) in FP32, or with lean states (Adam, SGD) BF16 in the parameter's layout or one
      // packed 8-bit block-wise state (NOTE [8-bit block-wise states] in kernels/blockwise8.h).
      auto state = [&](const char* name, const at::Tensor& t, kernels::StateType* type) {
        const at::ScalarType st = t.defined() ? t.scalar_type() : at::kFloat;
        if (!spec.lean_states || st == at::kFloat || st == at::kBFloat16) {
          if (spec.lean_states && st == at::kBFloat16) {
            *type = kernels::StateType::kBFloat16;
            return entry(name, t, at::kBFloat16);
          }
          return entry(name, t, at::kFloat);
        }
        TORCH_CHECK_TYPE(st == at::kByte, "ampkit::", op, ": ", name, "[", i,
                         "] must be Float, BFloat16 or Byte (an 8-bit block-wise state), but got ", st);
        // Symbolic-size aware (fake tensors under torch.compile carry SymInts): blockwise8_bytes, on SymInts.
        const c10::SymInt bytes =
            (p.sym_numel() + (kernels::kQuantBlock - 1)) / kernels::kQuantBlock * (kernels::kQuantBlock + 4);
        TORCH_CHECK(t.layout() == at::kStrided && t.device() == device, "ampkit::", op, ": ", name, "[", i,
                    "] must be a strided tensor on ", device, " like params[", i, "]");
        TORCH_CHECK_VALUE(t.dim() == 1 && t.sym_numel() == bytes && t.is_contiguous(), "ampkit::", op, ": ", name, "[",
                          i, "] (an 8-bit block-wise state of params[", i, "], ", p.sym_numel(),
                          " elements) must be a contiguous 1-D Byte tensor of ", bytes, " bytes, but has shape ",
                          t.sym_sizes(), t.is_contiguous() ? "" : " (not contiguous)");
        *type = kernels::StateType::kBlockwise8;
        void* ptr = ranges.add_defined(name, t, index, false, data);
        // The kernels read the absmaxes (a multiple of 4 bytes past the start) as floats: a state at an odd byte
        // offset (a view such as buf[1:]) faults on a GPU ("misaligned address"). Refused on every device, so that
        // a state steps, or is refused, alike on each; on Meta, where there is no data, by its storage offset.
        const int64_t misalignment = !data            ? storage_misalignment(t)
                                     : t.numel() == 0 ? 0
                                                      : static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr) % 4);
        TORCH_CHECK_VALUE(misalignment == 0, "ampkit::", op, ": ", name, "[", i,
                          "] (an 8-bit block-wise state) must have a 4-byte aligned data pointer (its FP32 absmaxes "
                          "are read as floats), but its data pointer mod 4 is ",
                          misalignment, " (a view at a byte offset? clone() it)");
        return ptr;
      };
      kernels::StateType m_type = kernels::StateType::kFloat32;
      kernels::StateType v_type = kernels::StateType::kFloat32;
      if (spec.need_exp_avgs) {
        m = state(spec.exp_avg_name, l.exp_avgs[i], &m_type);
      }
      if (spec.need_exp_avg_sqs) {
        v = state("exp_avg_sqs", l.exp_avg_sqs[i], &v_type);
      }
      if (spec.need_max_exp_avg_sqs) {
        vmax = entry("max_exp_avg_sqs", l.max_exp_avg_sqs[i], at::kFloat);
      }
      if (!l.state_steps.empty()) {
        const at::Tensor& t = l.state_steps[i];
        TORCH_CHECK(t.defined() && t.sym_numel() == 1 && t.scalar_type() == at::kFloat && t.device() == device,
                    "ampkit::", op, ": state_steps[", i, "] must be a one-element Float tensor on ", device);
        step = ranges.add_defined("state_steps", t, index, false, data);
      }
      if (out != nullptr) {
        *out = kernels::OptimTensor{param,
                                    grad,
                                    static_cast<float*>(master),
                                    static_cast<int16_t*>(remainder),
                                    static_cast<float*>(m),
                                    static_cast<float*>(v),
                                    static_cast<float*>(vmax),
                                    static_cast<float*>(step),
                                    p.numel(),
                                    kernel_dtype(dtype),
                                    static_cast<uint16_t*>(comp),
                                    static_cast<const int64_t*>(seed),
                                    m_type,
                                    v_type,
                                    grad_fp32};
      }
    };
    if (!data || device.type() != at::kCPU || !check_in_parts(op, n, alias, tensors, check_param)) {
      alias.reserve(n * 8);
      if (data) {
        tensors->resize(n);
      }
      for (size_t i = 0; i < n; ++i) {
        check_param(i, alias, data ? tensors->data() + i : nullptr);
      }
    }
    const std::optional<at::Device> on(device);
    if (s.grad_scale.has_value()) {
      check_scalar_tensor(op, "grad_scale", *s.grad_scale, at::kFloat, on);
    }
    if (s.found_inf.has_value()) {
      check_scalar_tensor(op, "found_inf", *s.found_inf, at::kFloat, on);
    }
    if (s.lr_tensor.has_value()) {
      // On the parameters' device (read by the kernels), or on the CPU (read on the host when the op runs, as
      // torch's fused CUDA optimizers read a CPU lr: no host-to-device copy).
      const bool host = s.lr_tensor->defined() && s.lr_tensor->is_cpu();
      check_scalar_tensor(op, "lr_tensor", *s.lr_tensor, at::kFloat, host ? std::nullopt : on);
    }
  }
  if (grad_norm.has_value()) {
    check_scalar_tensor(op, "grad_norm", *grad_norm, at::kFloat,
                        n == 0 ? std::nullopt : std::optional<at::Device>(l.params[0].device()));
  }
  const bool ro = spec.grads_read_only;
  alias.add("grad_scale", s.grad_scale, ro);
  alias.add("found_inf", s.found_inf, ro);
  alias.add("lr_tensor", s.lr_tensor, ro);
  alias.add("grad_norm", grad_norm, ro);
  alias.check();
}

}  // namespace

CheckPartsCount checks_in_parts_count() { return {parts_ran.load(), parts_gave_up.load()}; }

void check_and_build_descriptors(const AdamStepArgs& a, std::vector<kernels::OptimTensor>* tensors) {
  const kernels::AdamParams& h = a.hparams;
  check_adam_hparams(a.op, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps);
  check_step_and_build_descriptors(a.op, a.lists, adamw_step_lists(h.amsgrad), a.scalars, std::nullopt, tensors);
}

void check_and_build_descriptors(const SgdStepArgs& a, std::vector<kernels::OptimTensor>* tensors) {
  const kernels::SgdParams& h = a.hparams;
  check_sgd_hparams(a.op, h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov);
  check_step_and_build_descriptors(a.op, a.lists, sgd_step_lists(h.momentum != 0.0), a.scalars, std::nullopt, tensors);
}

void check_and_build_descriptors(const LambStepArgs& a, std::vector<kernels::OptimTensor>* tensors) {
  const kernels::LambParams& h = a.hparams;
  check_adam_hparams(a.op, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps);
  TORCH_CHECK_VALUE(h.max_grad_norm >= 0.0 && std::isfinite(h.max_grad_norm), "ampkit::", a.op,
                    ": max_grad_norm must be a finite number >= 0 (0: no clipping), but got ", h.max_grad_norm);
  check_step_and_build_descriptors(a.op, a.lists, lamb_step_lists(), a.scalars, a.grad_norm, tensors);
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
  kernels::AdamParams p = a.hparams;
  p.lr = lr;
  p.tail_width = tail_width;
  return p;
}

kernels::LambParams lamb_params(const LambStepArgs& a, double lr) {
  kernels::LambParams p = a.hparams;
  p.lr = lr;
  return p;
}

kernels::SgdParams sgd_params(const SgdStepArgs& a, double lr, int tail_width) {
  kernels::SgdParams p = a.hparams;
  p.lr = lr;
  p.tail_width = tail_width;
  return p;
}

}  // namespace ampkit::detail
