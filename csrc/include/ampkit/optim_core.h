// The decisions of ampkit's optimizers, in one place: ampkit::optim::{Adam,AdamW,SGD} (LibTorch) and
// ampkit.optim.{Adam,AdamW,SGD} (Python) both call these. A param group's options become a core::GroupConfig,
// each parameter's state a core::ParamState (torch.optim's entry names); core::step() checks them, creates the
// state a step needs, groups the parameters into fused calls by (device, master mode), stages grads whose layout
// differs from the parameter's, and runs torch.optim's own single-tensor formulas for what the fused kernels do
// not take (FP64 and complex parameters, sparse grads, parameters with gaps in memory). Those decisions are one
// core::StepPlan, which ampkit.optim's compiled step follows too.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ampkit/export.h"

namespace ampkit::optim {

// The master_weights option: auto (an FP32 master for FP16/BF16 parameters, decided when a parameter's state is
// created), on, off, remainder (BF16 parameters: the exact FP32 master held as the BF16 weight plus an int16
// remainder, 2 bytes per parameter; NOTE [BF16 weight + 16-bit remainder] in kernels/optim_functors.h), and two
// without a master for BF16 parameters of Adam, AdamW and SGD (kernels/stochastic_rounding.h): stochastic (FP32
// math, the result rounded stochastically to the BF16 weight, keyed by a per-parameter seed; NOTE [Counter-based
// stochastic rounding]) and kahan (the BF16 weight plus a BF16 compensation, 2 bytes per parameter; NOTE
// [Kahan-compensated BF16 weight]).
// Converts from bool and std::nullopt, so options(...).master_weights(true) reads as before.
class MasterWeights {
 public:
  enum Mode : int8_t { kAuto, kOn, kOff, kRemainder, kStochastic, kKahan };
  constexpr MasterWeights() = default;
  constexpr MasterWeights(Mode mode) : mode_(mode) {}           // NOLINT(google-explicit-constructor)
  constexpr MasterWeights(bool on) : mode_(on ? kOn : kOff) {}  // NOLINT(google-explicit-constructor)
  constexpr MasterWeights(std::nullopt_t) {}                    // NOLINT(google-explicit-constructor)
  constexpr MasterWeights(std::optional<bool> on) : mode_(on ? (*on ? kOn : kOff) : kAuto) {}  // NOLINT
  static constexpr MasterWeights remainder() { return MasterWeights(kRemainder); }
  static constexpr MasterWeights stochastic() { return MasterWeights(kStochastic); }
  static constexpr MasterWeights kahan() { return MasterWeights(kKahan); }
  constexpr Mode mode() const { return mode_; }
  constexpr bool operator==(MasterWeights other) const { return mode_ == other.mode_; }
  constexpr bool operator!=(MasterWeights other) const { return mode_ != other.mode_; }
  // "auto", "on", "off", "remainder", "stochastic", "kahan"
  AMPKIT_API const char* name() const;
  AMPKIT_API static MasterWeights from_name(const std::string& name);

 private:
  Mode mode_ = kAuto;
};

namespace core {

enum class Algorithm : int8_t { kAdam, kSGD, kLamb };
// How a parameter's FP32 value is kept: none (the parameter itself), an FP32 master, BF16 + int16 remainder, or
// no FP32 value at all: a BF16 weight written with stochastic rounding or with a Kahan compensation.
enum class MasterMode : int8_t { kNone, kMaster, kRemainder, kStochastic, kKahan };

// One param group's options, with torch.optim's names and defaults.
struct GroupConfig {
  const char* optimizer = "Adam";  // names the optimizer in errors: "Adam", "AdamW", "SGD", "LAMB"
  Algorithm algorithm = Algorithm::kAdam;
  double lr = 1e-3;
  // Defined: a one-element tensor learning rate that replaces lr. On the parameters' device (FP32) it is read by
  // the kernels on the device (a schedule inside a captured CUDA graph); on the CPU with parameters elsewhere
  // it is read on the host, which costs no sync.
  at::Tensor lr_tensor;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool amsgrad = false, decoupled_weight_decay = false;
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false;
  bool maximize = false;
  // LAMB (decoupled_weight_decay is its adam_w_mode). max_grad_norm > 0 with grad_norm defined (the global norm
  // of the unscaled grads of every group, ampkit::global_grad_norm()) clips the grads to that norm.
  bool bias_correction = true, grad_averaging = true, use_nvlamb = false;
  double max_grad_norm = 0.0;
  at::Tensor grad_norm;
  MasterWeights master_weights;
  // The dtypes of the moments (Adam, AdamW; SGD: exp_avg_dtype is the momentum buffer's): Float, BFloat16, or Byte
  // for 8-bit block-wise states (parameters of kBlockwise8MinNumel elements or more; FP32 below). NOTE [8-bit
  // block-wise states] in kernels/blockwise8.h. max_exp_avg_sq stays FP32.
  at::ScalarType exp_avg_dtype = at::kFloat, exp_avg_sq_dtype = at::kFloat;
  bool write_unscaled_grads = true;
  bool python_spelling = false;  // errors spell options as Python's keywords (master_weights=True)

  // (beta1, beta2) as one assignable pair: the field of the betas rows (NOTE [Optimizer option table]).
  std::tuple<double&, double&> betas() { return {beta1, beta2}; }
};

// One parameter's state; an undefined tensor is an absent entry. Fused parameters keep FP32 states (step: one
// FP32 element on the parameter's device); the others keep torch.optim's own format (the parameter's dtype, step
// on the CPU, SGD without a step).
struct AMPKIT_API ParamState {
  at::Tensor step, exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer, master_param, param_remainder;
  // master_weights "kahan": the BF16 compensation in the parameter's layout; "stochastic": the 64-bit seed of the
  // rounding's generator (a 0-dim int64 tensor on the parameter's device).
  at::Tensor kahan_comp, sr_seed;
  bool empty() const;
  // The named entry (torch.optim's names), nullptr for an unknown name.
  at::Tensor* entry(const std::string& name);
  static const std::vector<std::string>& names();
  // (name, member) of every entry, in names() order.
  using Field = at::Tensor ParamState::*;
  // An entry's bit in a mask of entries (fields() order).
  enum Bit : uint32_t {
    kStep = 1,
    kExpAvg = 2,
    kExpAvgSq = 4,
    kMaxExpAvgSq = 8,
    kMomentumBuffer = 16,
    kMasterParam = 32,
    kParamRemainder = 64,
    kKahanComp = 128,
    kSrSeed = 256,
  };
  static const std::vector<std::pair<const char*, Field>>& fields();
};

// torch.optim's range checks and messages (ValueError from Python) for a group's options.
AMPKIT_API void check_config(const GroupConfig& config);

// Whether the fused kernels take this parameter and grad (FP16/BF16/FP32, dense in memory, dense grad); the
// others take torch.optim's single-tensor path.
AMPKIT_API bool takes_fused(const at::Tensor& param, const at::Tensor& grad);

// The master mode of a parameter under the group's master_weights; throws (ValueError) where the option cannot
// apply (master weights for an FP64 or complex parameter, remainder for a non-BF16 one). A parameter on the
// single-tensor path keeps no master: master_weights unset means none there, set raises in check_group.
AMPKIT_API MasterMode master_mode(const GroupConfig& config, const at::Tensor& param);

// Checks the options and every parameter that has a grad, writing nothing: callers check every group before the
// first step() so that a step is all or nothing.
AMPKIT_API void check_group(const GroupConfig& config, at::TensorList params);

// What a step does with each parameter of a group that has a grad, decided before anything is written: core::step
// follows it, and so does ampkit.optim's compiled step, which asks for it at trace time (NOTE [Compiled steps] in
// python/ampkit/_compile.py): both paths make the same decisions by construction.
struct StepPlan {
  struct Param {
    size_t index;  // in the group's params
    MasterMode mode;
    bool fused;                          // else torch.optim's single-tensor formulas
    bool staged = false;                 // fused, with a grad in another layout: the kernels read a staging copy
    uint32_t missing = 0;                // the state entries to create (bit k: ParamState::fields()[k])
    double first_step = 0.0;             // the value of a created step (1 after an SGD buffer from torch.optim)
    bool remainder_from_master = false;  // the remainder is derived from a loaded master (rewrites the weight)
    // The grad plan_step checked (in the grads it was given, or params[index]'s own): valid while those are.
    const at::Tensor* grad = nullptr;
  };
  // One fused call: the parameters (indices into `params`) on one device in one master mode, and the state
  // entries the call reads (a mask of ParamState bits).
  struct Bucket {
    at::Device device;
    MasterMode mode;
    uint32_t reads;
    std::vector<size_t> params;
  };
  std::vector<Param> params;    // the parameters with a grad, in order
  std::vector<Bucket> buckets;  // in order of first appearance
  // The names of the entries of a `missing` mask, in ParamState::fields() order.
  AMPKIT_API static std::vector<std::string> entry_names(uint32_t entries);
};

// NOTE [State lists of the fused ops]
// Each state entry a fused step reads travels in one list argument of its algorithm's op (adamw_step_, sgd_step_,
// lamb_step_): master_param in master_params; param_remainder, kahan_comp and sr_seed in param_remainders (NOTE
// [Weight companions] in csrc/ops/checks.cpp); exp_avg in exp_avgs (SGD's momentum_buffer in momentum_buffers),
// exp_avg_sq in exp_avg_sqs, max_exp_avg_sq in max_exp_avg_sqs, step in state_steps. This table is that layout,
// written once: the eager step's fused call (optim_core.cpp) and ampkit.optim's compiled step (through
// OptimizerCore.state_lists()) both fill the op's lists from it. An op's lists that no entry of a bucket fills are
// passed empty.
enum class OpList : int8_t { kMasters, kRemainders, kFirst, kSecond, kThird, kSteps };
struct EntryList {
  ParamState::Bit entry;
  ParamState::Field field;
  OpList list;
};
// The table of an algorithm, in ParamState::fields() order; and the name of each of its op's lists (nullptr: the
// op has no such list).
AMPKIT_API const std::vector<EntryList>& entry_lists(Algorithm algorithm);
AMPKIT_API const char* op_list_name(Algorithm algorithm, OpList list);

// Checks the group (as check_group) and plans its step; states[i] is params[i]'s state (nullptr: none yet), and
// grads[i] its grad (undefined: none), or params[i].grad() where `grads` is empty. Writes nothing.
AMPKIT_API StepPlan plan_step(const GroupConfig& config, at::TensorList params,
                              const std::vector<const ParamState*>& states, at::TensorList grads = {});

// Whether a step in this group may assign over a state entry that is already there (with false, a step only fills
// entries a state lacks): true where master_weights is "remainder", whose remainder made from a loaded FP32 master
// replaces the master. What lets a binding borrow the entries it passes (NOTE [Borrowed states]).
AMPKIT_API bool may_replace_entries(const GroupConfig& config);

// One step of a param group: params without a grad are skipped; states[i] (not null) is params[i]'s state,
// completed here (an SGD parameter without momentum or master keeps an empty state). grad_scale/found_inf come
// from a GradScaler: the fused kernels unscale in registers and skip on the device; the single-tensor path reads
// found_inf on the host (a sync, on that path only) and unscales the grads in place (whatever
// write_unscaled_grads says: its formulas read the grads).
AMPKIT_API void step(const GroupConfig& config, at::TensorList params, const std::vector<ParamState*>& states,
                     const std::optional<at::Tensor>& grad_scale = std::nullopt,
                     const std::optional<at::Tensor>& found_inf = std::nullopt);

// NOTE [The policy across groups]
// An optimizer's step is all or nothing over its param groups, and LAMB's clipping needs one norm over every
// group's grads: step_groups() plans (checks) every group before the first one is written, then, where any group
// clips (max_grad_norm > 0), takes the global norm of the unscaled grads once and gives it to every group, then
// steps the groups in order, each along its plan. The LibTorch optimizers and ampkit.optim (through
// OptimizerCore.step_groups) both step through it. A group the caller steps itself (ampkit.optim: the local shards
// of DTensor parameters, differentiable=True) comes with `check` and `step`, which the core calls in that group's
// turns: check before any group is written, step(grad_norm) in order.
struct GroupStep {
  GroupConfig config;
  at::TensorList params;                                  // held by the caller for the call
  std::vector<ParamState*> states;                        // states[i]: params[i]'s (not null), completed by the step
  std::function<void()> check;                            // set: the caller's group (params, states unused)
  std::function<void(const at::Tensor& grad_norm)> step;  // its step; grad_norm undefined where none is taken
};
// The global norm of the clipping groups' grads (undefined: none clips): `global_norm` where given (ampkit.optim's,
// over DTensor shards too), else ampkit::global_grad_norm over every core-stepped group's grads. Returns it.
AMPKIT_API at::Tensor step_groups(std::vector<GroupStep>& groups,
                                  const std::optional<at::Tensor>& grad_scale = std::nullopt,
                                  const std::optional<at::Tensor>& found_inf = std::nullopt,
                                  const std::function<at::Tensor()>& global_norm = {});

// Gives the parameter an FP32 master copied from its current value (O2: call while the weights are FP32).
AMPKIT_API void init_master(const at::Tensor& param, ParamState& state);
// Whether the optimizers' init_master_params() gives this group's parameters masters: not where master_weights
// keeps none ("stochastic", "kahan": a master there would be 4 bytes per parameter that no step reads).
AMPKIT_API bool takes_master(const GroupConfig& config);

// The int16 remainder that, with the BF16 weight as it is, holds the FP32 master. The weight keeps its bits when
// it is the master rounded to nearest-even (ties rounded down keep 32767, a master 1 ulp closer to the weight);
// a weight that is not the master's rounding at all is re-derived from the master (ties away from zero).
AMPKIT_API at::Tensor remainder_of(const at::Tensor& param, const at::Tensor& master);
// The exact FP32 master held by a BF16 weight and its int16 remainder.
AMPKIT_API at::Tensor master_from_remainder(const at::Tensor& param, const at::Tensor& remainder);

// Checks a loaded state (entries as (name, tensor)): shapes, dtypes, and Adam's step and moments all present or
// all absent; for a fused parameter or one on the single-tensor path (torch.optim's format: complex moments for
// a complex parameter). `where` names it in errors ("state[3]"). Throws ValueError.
AMPKIT_API void check_loaded_state(const GroupConfig& config, const std::string& where, const at::Tensor& param,
                                   const std::vector<std::pair<std::string, at::Tensor>>& entries);
// A loaded entry as the fused kernels keep it: on the parameter's device, FP32 (int16 for param_remainder, BF16
// for kahan_comp, int64 for sr_seed), in the parameter's layout. Parameters the kernels do not take keep torch.optim's format (the caller's cast).
AMPKIT_API at::Tensor loaded_entry(const std::string& name, const at::Tensor& value, const at::Tensor& param);
// The same in the group's state dtypes: a moment or momentum buffer is converted to exp_avg_dtype /
// exp_avg_sq_dtype (an 8-bit state dequantized or quantized, a BF16 one rounded to nearest even; one already in
// the group's dtype is kept bit for bit), so a torch.optim checkpoint loads into lean states and back.
AMPKIT_API at::Tensor loaded_entry(const GroupConfig& config, const std::string& name, const at::Tensor& value,
                                   const at::Tensor& param);
// The dtype a fused parameter's moment `name` ("exp_avg", "exp_avg_sq", "momentum_buffer") is kept in under the
// group's options: Byte only for parameters of kBlockwise8MinNumel elements or more.
AMPKIT_API at::ScalarType state_dtype(const GroupConfig& config, const std::string& name, const at::Tensor& param);

}  // namespace core
}  // namespace ampkit::optim
