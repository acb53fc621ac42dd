// ampkit::AutocastGuard: torch.autocast for C++ programs, as an RAII scope over ATen's autocast state.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ampkit/export.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ampkit {

// How autocast runs an op: in the low-precision dtype, in FP32, or in the widest floating dtype of its inputs.
enum class AutocastPolicy { kLowerPrecision, kFp32, kPromote };

// Ops forced to FP32 or to the low-precision dtype inside one AutocastGuard scope, on its thread only. Names
// are "softmax" (aten), "aten::linear" or "myns::myop"; every overload of the name is affected. A name acts on
// the op autocast sees, which is not always the module's name: LibTorch's torch::nn::Linear (and
// torch::nn::functional::linear) runs aten::addmm for a 2-D input with a bias and aten::matmul otherwise, so
// "linear" does not reach it from C++ (it does from Python, whose nn.Linear calls aten::linear): list "addmm"
// and "matmul" (which also covers every other addmm/matmul of the scope). OpStatsGuard lists the ops a model
// runs under their names.
struct AutocastOverrides {
  std::vector<std::string> fp32_ops;
  std::vector<std::string> lowp_ops;
};

// Inside the guard's scope, ops on `device` run under autocast in `dtype` (when `enabled`), exactly as inside
// `with torch.autocast(device, dtype, enabled, cache_enabled)`: on entry it saves the enabled flag, the dtype and
// the cache flag, sets them and increments the nesting count; on exit it decrements the count, clears the cast
// cache when the outermost scope closes (forgetting that leaks every cast weight: pytorch/pytorch#46649) and
// restores what it saved. Autocast state is per thread; the cast cache is process-wide.
//
// Args:
//   device: kCPU or kCUDA (any device type ATen's autocast knows). kCUDA where no CUDA device exists warns once
//           and leaves autocast off in the scope, as torch.autocast does.
//   dtype: the low-precision type, kHalf or kBFloat16.
//   enabled: false runs the scope in full precision (a nested guard can switch autocast off).
//   cache_enabled: keep casts of leaf tensors (weights) for the scope; default: the current setting.
//   overrides: ops forced to FP32 / low precision in this scope, on this thread (inner scopes win); outside any
//              override an op behaves exactly as under torch.autocast.
class AMPKIT_API AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true,
                std::optional<bool> cache_enabled = std::nullopt, const AutocastOverrides& overrides = {});
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_;
  bool pushed_overrides_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

// The override scopes AutocastGuard pushes and pops, for bindings that manage autocast state themselves
// (ampkit.autocast in Python): push validates the names and installs the kernels before it changes anything.
AMPKIT_API void push_autocast_overrides(c10::DeviceType device, const AutocastOverrides& overrides);
AMPKIT_API void pop_autocast_overrides();

// Autocast behaviour for an op that has none (a custom op, defined in C++ or Python) on `device` (kCPU or kCUDA):
// under autocast its floating inputs are cast by `policy` before it runs, in C++ (no Python in the dispatch
// path). Registered once per process; later calls change the policy.
AMPKIT_API void register_autocast(const std::string& op, c10::DeviceType device, AutocastPolicy policy);

// Counts, per op and dtype, the ops run on this thread while the guard lives (Paddle's operator stats): the
// question "is my model really running in FP16?". Only outermost ops are counted (an op's internal calls are
// its own business), each under the dtype of its first floating output (else input, else "other"). The ops that
// autograd's backward nodes run on this thread are left out unless `include_backward`.
class AMPKIT_API OpStatsGuard {
 public:
  explicit OpStatsGuard(bool include_backward = false);
  ~OpStatsGuard();
  OpStatsGuard(const OpStatsGuard&) = delete;
  OpStatsGuard& operator=(const OpStatsGuard&) = delete;
  // (op name, dtype name) -> calls, so far.
  std::map<std::pair<std::string, std::string>, int64_t> counts() const;

 private:
  uint64_t handle_;
  void* stats_;
};

// Which low-precision dtypes `device` runs, and runs fast (the seeds' advice: check the hardware before choosing
// FP16 or BF16; without low-precision units there is no speed-up). CUDA: FP16 from sm_53, fast with Tensor Cores
// from sm_70, BF16 (fast) from sm_80. CPU: both run (through FP32); BF16 is fast with AVX512-BF16 or AMX-BF16,
// FP16 with AVX512-FP16 or AMX-FP16.
// The milliseconds of a small probe (NOTE [CPU precision probe]): conv2d and linear, each forward and backward.
struct ProbeTimes {
  double conv2d_ms = 0;
  double linear_ms = 0;
};
struct PrecisionSupport {
  bool fp16 = false;
  bool bf16 = false;
  bool fp16_fast = false;
  bool bf16_fast = false;
  c10::ScalarType lowp_dtype = c10::kBFloat16;  // the low-precision dtype for this device: BF16 CPU, FP16 CUDA
  bool fast = false;                            // lowp_dtype computes faster than FP32 here
  c10::ScalarType recommended = c10::kFloat;    // lowp_dtype when fast, else FP32
  std::string reason;                           // the above in words
  // CPU: the probe's times per dtype (measured once per process); all zero on CUDA.
  bool measured = false;
  ProbeTimes fp32_probe, bf16_probe, fp16_probe;
};
// The CPU: a dtype runs fast when the processor has its units (AVX512-BF16/AMX-BF16, AVX512-FP16/AMX-FP16) and
// no op of the probe runs 3 times or more slower in it than in the fastest dtype (measured once per process); CUDA: from
// the compute capability.
AMPKIT_API PrecisionSupport precision_support(const c10::Device& device);
// Why autocast in `dtype` on `device` is a poor choice where `support` (precision_support's answer) holds: FP16 on a
// CPU where an op of the probe runs 3 times or more slower in FP16 than in BF16 (torch's FP16 convolutions on the
// CPU have no fast kernel even with AVX512-FP16), naming the op and the factor. Empty when there is nothing to
// say. AutocastGuard and ampkit.autocast warn with it once per process.
AMPKIT_API std::string autocast_dtype_advice(c10::DeviceType device, c10::ScalarType dtype,
                                             const PrecisionSupport& support);

// The O-level presets of ampkit.decorate, for LibTorch modules.
enum class OptLevel { kO0, kO1, kO2, kO3 };

// Applies an O-level to `module` in place: O0/O1 leave it FP32 (O1 is AutocastGuard + GradScaler in the loop);
// O2 casts every parameter and floating buffer to `dtype` (but the FP32 scaling state of ampkit::fp8::Float8Linear)
// except those of normalisation layers (BatchNorm,
// LayerNorm, GroupNorm, InstanceNorm; when keep_norm_fp32) and of modules whose qualified name is in `excluded`,
// which stay FP32 and take low-precision inputs (ATen's norms accept mixed input/weight dtypes); O3 casts
// everything but `excluded`. A module sharing a parameter with a kept one (a decoder tied to an excluded embedding)
// is kept too, since a shared parameter has one dtype. No `dtype` picks BF16 for a module on the CPU (or without
// parameters) and FP16 on CUDA, as ampkit.decorate does. A module is decorated at O2/O3 once: a second call throws (decorate before
// loading checkpoints). Everything is checked first: a call that throws changes nothing. Without the optimizer,
// call its init_master_params() before, so that its FP32 masters are the FP32 weights; the overload below does it.
AMPKIT_API void decorate(torch::nn::Module& module, OptLevel level, std::optional<c10::ScalarType> dtype = std::nullopt,
                         bool keep_norm_fp32 = true, const std::vector<std::string>& excluded = {});
// The same with the model's optimizer (ampkit.decorate(model, optimizer, ...)): at O2/O3 it must be an
// ampkit::optim one (Adam, AdamW, SGD, LAMB; TypeError otherwise), and each of its parameters that is cast gets an
// FP32 master copied from its weight just before the cast (Apex O2), a tied parameter once; a parameter that was
// FP16/BF16 already gets a master of its rounded value, with a warning. Groups whose master_weights keeps no master
// (MasterWeights::stochastic(), kahan()) get none: their weights are just cast. Mutates the optimizer's state.
AMPKIT_API void decorate(torch::nn::Module& module, torch::optim::Optimizer& optimizer, OptLevel level,
                         std::optional<c10::ScalarType> dtype = std::nullopt, bool keep_norm_fp32 = true,
                         const std::vector<std::string>& excluded = {});

}  // namespace ampkit
