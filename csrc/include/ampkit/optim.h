// ampkit::optim::Adam, AdamW, SGD and LAMB: torch::optim::Optimizer subclasses on ampkit's fused kernels. What they
// share (construction, param groups, the step of every group, checked loads, masters) is written once in their base
// FusedOptimizer; each adds its options, their conversion to core::GroupConfig and its state type. Options mirror
// LibTorch's (AdamWOptions(lr).betas(...).weight_decay(...)) plus master_weights (MasterWeights: unset keeps an FP32
// master for FP16/BF16 parameters, true/false forces it, MasterWeights::remainder() keeps BF16 parameters' masters
// as int16 remainders; MasterWeights::stochastic() and kahan() keep BF16 weights without a master, Adam, AdamW and
// SGD only: stochastic rounding keyed by a per-parameter seed, or a BF16 Kahan compensation), lr_tensor (a one-element tensor learning rate read on the device) and write_unscaled_grads
// (not LAMB's, which only reads the grads). Their decisions (state creation, checks, master modes, fallbacks) are
// ampkit::optim::core's, shared with ampkit.optim in Python: FP16/BF16/FP32 parameters take the fused kernels with
// FP32 states; FP64 and complex parameters, sparse SGD grads and parameters with gaps in memory take torch.optim's
// single-tensor formulas on torch's state format (LAMB takes FP16/BF16/FP32 dense parameters only).
// ampkit::GradScaler drives them without a host sync: it hands them grad_scale/found_inf and the skip happens on
// the device.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <optional>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

#include "ampkit/export.h"
#include "ampkit/grad_scaler.h"
#include "ampkit/optim_core.h"
#include "ampkit/optim_options.h"

namespace ampkit::optim {

// TORCH_ARG, recording that the setter ran: an option a param group sets is the group's, every other the optimizer's
// default (NOTE [Group options] in csrc/optim/optim.cpp). Writing through the non-const getter records nothing.
#define AMPKIT_OPTION(T, name)                                          \
 public:                                                                \
  inline auto name(const T& new_##name)->decltype(*this) { /* NOLINT */ \
    this->name##_ = new_##name;                                         \
    this->name##_set_ = true;                                           \
    return *this;                                                       \
  }                                                                     \
  inline auto name(T&& new_##name)->decltype(*this) { /* NOLINT */      \
    this->name##_ = std::move(new_##name);                              \
    this->name##_set_ = true;                                           \
    return *this;                                                       \
  }                                                                     \
  inline const T& name() const noexcept { /* NOLINT */                  \
    return this->name##_;                                               \
  }                                                                     \
  inline T& name() noexcept { /* NOLINT */                              \
    return this->name##_;                                               \
  }                                                                     \
  inline bool name##_is_set() const noexcept { /* NOLINT */             \
    return this->name##_set_;                                           \
  }                                                                     \
                                                                        \
 private:                                                               \
  bool name##_set_ = false;                                             \
  T name##_ /* NOLINT */

// The members and visitor of an options type from its row list (NOTE [Optimizer option table]): each ROW an
// AMPKIT_OPTION with its default; for_each_option(visit) calls visit(name, value member, set flag member,
// OptionArchive) once per row, in row order: the list that archives, param groups' merge with the defaults (NOTE
// [Group options]), operator== and config() read. kOptionsName names the type in archive errors.
#define AMPKIT_OPTION_MEMBER(T, name, default_, archive, python, field) AMPKIT_OPTION(T, name) = default_;
#define AMPKIT_OPTION_VISIT(T, name, default_, archive, python, field) \
  visit(#name, &Self::name##_, &Self::name##_set_, OptionArchive::archive);
#define AMPKIT_OPTIONS_BODY(SELF, NAME, LIST)                              \
  LIST(AMPKIT_OPTION_MEMBER, AMPKIT_OPTION_SKIP)                           \
                                                                           \
 public:                                                                   \
  using Self = SELF;                                                       \
  static constexpr const char* kOptionsName = NAME;                        \
  double get_lr() const override { return lr(); }                          \
  void set_lr(const double lr) override { this->lr(lr); }                  \
  void serialize(torch::serialize::OutputArchive& archive) const override; \
  void serialize(torch::serialize::InputArchive& archive) override;        \
  template <class Visit>                                                   \
  static void for_each_option(Visit&& visit) {                             \
    LIST(AMPKIT_OPTION_VISIT, AMPKIT_OPTION_SKIP)                          \
  }

using AmpScalingOptimizer = ::ampkit::AmpScalingOptimizer;

// The scaler's grad_scale and found_inf held for the next step() of an ampkit optimizer (AmpScalingOptimizer).
class AMPKIT_API ScaledStep : public AmpScalingOptimizer {
 public:
  void set_amp_scaling(at::Tensor grad_scale, at::Tensor found_inf) override {
    grad_scale_ = std::move(grad_scale);
    found_inf_ = std::move(found_inf);
  }

 protected:
  std::optional<at::Tensor> grad_scale() const;
  std::optional<at::Tensor> found_inf() const;

 private:
  at::Tensor grad_scale_;
  at::Tensor found_inf_;
};

// The base of the optimizers below (CRTP): everything they share, written once. Derived supplies
//   static constexpr const char* kName;                      // "Adam": the name its errors use
//   static core::GroupConfig config(const Options& options);  // the core's view of a group's options
// and may hide stepped (LAMB keeps the global grad norm) or override save (SGD's). State is the per-parameter state
// it keeps. Instantiated in libampkit for Adam, AdamW, SGD and LAMB only.
template <class Derived, class Options, class State>
class AMPKIT_API FusedOptimizer : public torch::optim::Optimizer, public ScaledStep {
 public:
  // Adds a param group: the options it sets, the defaults for the others (NOTE [Group options]); a group carrying
  // another optimizer's options is refused, as in the constructor.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);
  // Checks every param group (options, parameter dtypes) before anything is written or created: a step that
  // raises leaves every parameter and state as it was. Then one core::step per group, with the scaler's
  // grad_scale/found_inf when GradScaler::step drives it.
  at::Tensor step(LossClosure closure = nullptr) override;
  // torch::optim::serialize's layout, with steps as int64 so that LibTorch's optimizers read it too (ignoring
  // masters and ampkit's options): NOTE [LibTorch archives] in csrc/optim/libtorch_archive.h.
  void save(torch::serialize::OutputArchive& archive) const override;
  // Loads an archive of save() or, for Adam, AdamW and SGD, of LibTorch's optimizer of that name (LibTorch's
  // options and int steps; the options it lacks from this optimizer's defaults; no masters: taken from the
  // weights); checks the options and every state (shapes, dtypes, Adam's step and moments all present or all
  // absent) and keeps states FP32: an archive that fails leaves the optimizer as it was.
  void load(torch::serialize::InputArchive& archive) override;
  // Creates every parameter's state now, with an FP32 master copied from its current value. Call it while the
  // model is still FP32, then cast the model to FP16/BF16 (O2): the masters keep the unrounded weights.
  void init_master_params();

 protected:
  // Checks the defaults (core::check_config) and gives each group the options it sets and the defaults for the
  // others (NOTE [Group options]); a group carrying another optimizer's options is refused.
  FusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults);

  // Called by step() after every group stepped, with the global grad norm they were clipped with (undefined: none;
  // NOTE [The policy across groups] in ampkit/optim_core.h): nothing here.
  void stepped(const at::Tensor&) {}
};

template <bool kDecoupled>
struct AMPKIT_API AdamOptionsT : public torch::optim::OptimizerCloneableOptions<AdamOptionsT<kDecoupled>> {
  using betas_t = std::tuple<double, double>;
  AdamOptionsT() = default;
  AdamOptionsT(double lr) : lr_set_(true), lr_(lr) {}  // NOLINT(google-explicit-constructor): as LibTorch's
  // The options of AMPKIT_ADAM_OPTIONS (optim_options.h). exp_avg_dtype / exp_avg_sq_dtype, the moments' dtypes:
  // at::kFloat, at::kBFloat16, or at::kByte for 8-bit block-wise states (parameters of kBlockwise8MinNumel
  // elements or more; FP32 below; NOTE [8-bit block-wise states] in kernels/blockwise8.h). write_unscaled_grads:
  // a step the GradScaler unscales stores the unscaled grads back (as torch's fused optimizers); false leaves them
  // scaled and saves that write. lr_tensor, defined: a one-element tensor learning rate that replaces lr
  // (torch.optim's tensor lr): on the parameters' device the kernels read it there (an LR schedule inside a
  // captured CUDA graph). Saved with the options.
  AMPKIT_OPTIONS_BODY(AdamOptionsT, kDecoupled ? "AdamWOptions" : "AdamOptions", AMPKIT_ADAM_OPTIONS)
};
using AdamOptions = AdamOptionsT<false>;
using AdamWOptions = AdamOptionsT<true>;

struct AMPKIT_API AdamParamState : public torch::optim::OptimizerCloneableParamState<AdamParamState> {
  // FP32, one element, on the parameter's device (the CPU for a single-tensor param); archived as an int64, as
  // LibTorch's AdamParamState, and read back from an int64 or a tensor.
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);
  TORCH_ARG(at::Tensor, master_param);
  TORCH_ARG(at::Tensor, param_remainder);  // int16, MasterWeights::remainder()
  TORCH_ARG(at::Tensor, kahan_comp);       // BF16, MasterWeights::kahan()
  TORCH_ARG(at::Tensor, sr_seed);          // 0-dim int64, MasterWeights::stochastic()

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
  // Calls visit(name, member pointer) once per entry (operator==).
  template <class Visit>
  static void for_each_entry(Visit&& visit) {
    visit("step", &AdamParamState::step_);
    visit("exp_avg", &AdamParamState::exp_avg_);
    visit("exp_avg_sq", &AdamParamState::exp_avg_sq_);
    visit("max_exp_avg_sq", &AdamParamState::max_exp_avg_sq_);
    visit("master_param", &AdamParamState::master_param_);
    visit("param_remainder", &AdamParamState::param_remainder_);
    visit("kahan_comp", &AdamParamState::kahan_comp_);
    visit("sr_seed", &AdamParamState::sr_seed_);
  }
};

template <bool kDecoupled>
class AMPKIT_API AdamT : public FusedOptimizer<AdamT<kDecoupled>, AdamOptionsT<kDecoupled>, AdamParamState> {
 public:
  using Options = AdamOptionsT<kDecoupled>;
  static constexpr const char* kName = kDecoupled ? "AdamW" : "Adam";

  explicit AdamT(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults = {})
      : FusedOptimizer<AdamT, Options, AdamParamState>(param_groups, std::move(defaults)) {}
  explicit AdamT(std::vector<at::Tensor> params, Options defaults = {})
      : AdamT({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  // The core's view of a group's options.
  static core::GroupConfig config(const Options& o);
};
using Adam = AdamT<false>;
using AdamW = AdamT<true>;

struct AMPKIT_API SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr) : lr_set_(true), lr_(lr) {}  // NOLINT(google-explicit-constructor): as LibTorch's
  // The options of AMPKIT_SGD_OPTIONS (optim_options.h); momentum_dtype is the momentum buffer's dtype, as
  // AdamOptionsT's exp_avg_dtype.
  AMPKIT_OPTIONS_BODY(SGDOptions, "SGDOptions", AMPKIT_SGD_OPTIONS)
};

struct AMPKIT_API SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, momentum_buffer);
  TORCH_ARG(at::Tensor, master_param);
  TORCH_ARG(at::Tensor, param_remainder);
  TORCH_ARG(at::Tensor, kahan_comp);  // as AdamParamState's
  TORCH_ARG(at::Tensor, sr_seed);

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
  // As AdamParamState's.
  template <class Visit>
  static void for_each_entry(Visit&& visit) {
    visit("step", &SGDParamState::step_);
    visit("momentum_buffer", &SGDParamState::momentum_buffer_);
    visit("master_param", &SGDParamState::master_param_);
    visit("param_remainder", &SGDParamState::param_remainder_);
    visit("kahan_comp", &SGDParamState::kahan_comp_);
    visit("sr_seed", &SGDParamState::sr_seed_);
  }
};

class AMPKIT_API SGD : public FusedOptimizer<SGD, SGDOptions, SGDParamState> {
 public:
  static constexpr const char* kName = "SGD";

  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
      : FusedOptimizer(param_groups, std::move(defaults)) {}
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults)
      : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  // FusedOptimizer::save's, without the states that equal none (step 0: a skipped first step), since LibTorch
  // takes any momentum buffer as filled.
  void save(torch::serialize::OutputArchive& archive) const override;

  static core::GroupConfig config(const SGDOptions& o);  // as AdamT's
};

// LAMB (You et al. 2020) with the semantics and defaults of Apex's FusedLAMB (NVIDIA's BERT recipe): Adam moments,
// the update u = m^ / (sqrt(v^) + eps) (+ weight_decay * w with adam_w_mode, else L2 decay on the grad), and per
// tensor w -= lr * ||w|| / ||u|| * u (trust ratio 1 when either norm is 0, and for groups without weight decay
// unless use_nvlamb). With max_grad_norm > 0 the grads are first scaled down so that the global norm over every
// group's grads is at most max_grad_norm (computed on the device each step). FP16/BF16/FP32 parameters only, dense
// in memory; masters, remainders, lr_tensor and the GradScaler's skip on the device as AdamW. States are
// AdamParamState (step, exp_avg, exp_avg_sq, master_param / param_remainder).
struct AMPKIT_API LAMBOptions : public torch::optim::OptimizerCloneableOptions<LAMBOptions> {
  using betas_t = std::tuple<double, double>;
  LAMBOptions() = default;
  LAMBOptions(double lr) : lr_set_(true), lr_(lr) {}  // NOLINT(google-explicit-constructor)
  // The options of AMPKIT_LAMB_OPTIONS (optim_options.h); max_grad_norm 0: no clipping.
  AMPKIT_OPTIONS_BODY(LAMBOptions, "LAMBOptions", AMPKIT_LAMB_OPTIONS)
};

class AMPKIT_API LAMB : public FusedOptimizer<LAMB, LAMBOptions, AdamParamState> {
 public:
  static constexpr const char* kName = "LAMB";

  explicit LAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LAMBOptions defaults = {})
      : FusedOptimizer(param_groups, std::move(defaults)) {}
  explicit LAMB(std::vector<at::Tensor> params, LAMBOptions defaults = {})
      : LAMB({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  // The global norm of the unscaled grads that the last step() clipped with (undefined before a clipping step):
  // a 0-dim FP32 device tensor, read it without syncing each step.
  const at::Tensor& last_grad_norm() const { return last_grad_norm_; }

  static core::GroupConfig config(const LAMBOptions& o);  // as AdamT's

 private:
  friend class FusedOptimizer<LAMB, LAMBOptions, AdamParamState>;

  // The clipping of step(): with max_grad_norm > 0 in any group, the core takes one global norm over every group's
  // grads (NOTE [The policy across groups], NOTE [LAMB passes]); kept in last_grad_norm_.
  void stepped(const at::Tensor& grad_norm);

  at::Tensor last_grad_norm_;
};

namespace detail {
// Equal values; tensors: both undefined, or both defined with the same dtype, shape, device and elements.
AMPKIT_API bool same_value(const at::Tensor& a, const at::Tensor& b);
template <class T>
bool same_value(const T& a, const T& b) {
  return a == b;
}
template <class T>
bool same_options(const T& a, const T& b) {
  bool same = true;
  T::for_each_option(
      [&](const char*, auto member, auto, OptionArchive) { same = same && same_value(a.*member, b.*member); });
  return same;
}
template <class T>
bool same_entries(const T& a, const T& b) {
  bool same = true;
  T::for_each_entry([&](const char*, auto member) { same = same && same_value(a.*member, b.*member); });
  return same;
}
}  // namespace detail

// Every option equal (lr_tensor: both undefined, or equal values), as LibTorch's operator== on its options.
template <bool kDecoupled>
bool operator==(const AdamOptionsT<kDecoupled>& a, const AdamOptionsT<kDecoupled>& b) {
  return detail::same_options(a, b);
}
inline bool operator==(const SGDOptions& a, const SGDOptions& b) { return detail::same_options(a, b); }
inline bool operator==(const LAMBOptions& a, const LAMBOptions& b) { return detail::same_options(a, b); }
// Every entry equal (an absent entry equals only an absent one), as LibTorch's operator== on its param states.
inline bool operator==(const AdamParamState& a, const AdamParamState& b) { return detail::same_entries(a, b); }
inline bool operator==(const SGDParamState& a, const SGDParamState& b) { return detail::same_entries(a, b); }

// The state of parameter `p` in `optimizer` (nullptr before its first step), typed: instead of
// static_cast<AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())),
//   if (const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, p)) { s->exp_avg(); ... }
// Throws (naming both types) when the optimizer keeps another kind of state for p.
template <typename State>
State* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& states = optimizer.state();
  const auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end()) {
    return nullptr;
  }
  auto* state = dynamic_cast<State*>(it->second.get());
  TORCH_CHECK(state != nullptr, "ampkit::optim::state_of: the optimizer keeps a ", typeid(*it->second).name(),
              " for this parameter, not the ", typeid(State).name(), " asked for");
  return state;
}

extern template struct AdamOptionsT<false>;
extern template struct AdamOptionsT<true>;
extern template class FusedOptimizer<AdamT<false>, AdamOptionsT<false>, AdamParamState>;
extern template class FusedOptimizer<AdamT<true>, AdamOptionsT<true>, AdamParamState>;
extern template class FusedOptimizer<SGD, SGDOptions, SGDParamState>;
extern template class FusedOptimizer<LAMB, LAMBOptions, AdamParamState>;
extern template class AdamT<false>;
extern template class AdamT<true>;

}  // namespace ampkit::optim
