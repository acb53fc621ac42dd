// ampkit::optim::Adam, AdamW and SGD: torch::optim::Optimizer subclasses on ampkit's fused kernels. Options
// mirror LibTorch's (AdamWOptions(lr).betas(...).weight_decay(...)) plus master_weights: unset (default) keeps
// an FP32 master for FP16/BF16 parameters, true/false forces it. All state is FP32. ampkit::GradScaler drives
// them without a host sync: it hands them grad_scale/found_inf and the skip happens on the device.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <optional>
#include <tuple>
#include <typeinfo>
#include <vector>

#include "ampkit/export.h"
#include "ampkit/grad_scaler.h"

namespace ampkit::optim {

using AmpScalingOptimizer = ::ampkit::AmpScalingOptimizer;

// The scaler's grad_scale and found_inf held for the next step() of an ampkit optimizer (AmpScalingOptimizer),
// each moved to the device a parameter bucket lives on.
class AMPKIT_API ScaledStep : public AmpScalingOptimizer {
 public:
  void set_amp_scaling(at::Tensor grad_scale, at::Tensor found_inf) override {
    grad_scale_ = std::move(grad_scale);
    found_inf_ = std::move(found_inf);
  }

 protected:
  std::optional<at::Tensor> grad_scale_for(const at::Device& device) const;
  std::optional<at::Tensor> found_inf_for(const at::Device& device) const;

 private:
  at::Tensor grad_scale_;
  at::Tensor found_inf_;
};

template <bool kDecoupled>
struct AMPKIT_API AdamOptionsT : public torch::optim::OptimizerCloneableOptions<AdamOptionsT<kDecoupled>> {
  using betas_t = std::tuple<double, double>;
  AdamOptionsT(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = kDecoupled ? 1e-2 : 0.0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  // A step the GradScaler unscales stores the unscaled grads back (as torch's fused optimizers); false leaves
  // them scaled and saves that write.
  TORCH_ARG(bool, write_unscaled_grads) = true;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};
using AdamOptions = AdamOptionsT<false>;
using AdamWOptions = AdamOptionsT<true>;

struct AMPKIT_API AdamParamState : public torch::optim::OptimizerCloneableParamState<AdamParamState> {
  TORCH_ARG(at::Tensor, step);  // FP32, one element, on the parameter's device
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

template <bool kDecoupled>
class AMPKIT_API AdamT : public torch::optim::Optimizer, public ScaledStep {
 public:
  using Options = AdamOptionsT<kDecoupled>;
  explicit AdamT(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults = {});
  explicit AdamT(std::vector<at::Tensor> params, Options defaults = {})
      : AdamT({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  // Adds a param group with its own options (torch::optim::Optimizer::add_param_group gives a group of a custom
  // optimizer the defaults instead of the options it carries).
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);
  // Checks every param group (options, parameter dtypes) before anything is written or created: a step that
  // raises leaves every parameter and state as it was.
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  // Creates every parameter's state now, with an FP32 master copied from its current value. Call it while the
  // model is still FP32, then cast the model to FP16/BF16 (O2): the masters keep the unrounded weights.
  void init_master_params();

 private:
  static void check_options(const Options& o);
};
using Adam = AdamT<false>;
using AdamW = AdamT<true>;

struct AMPKIT_API SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  TORCH_ARG(bool, write_unscaled_grads) = true;  // as AdamOptionsT's

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

struct AMPKIT_API SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, momentum_buffer);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

class AMPKIT_API SGD : public torch::optim::Optimizer, public ScaledStep {
 public:
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults);
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults)
      : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);  // as AdamT's
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  // As AdamT::init_master_params.
  void init_master_params();

 private:
  static void check_options(const SGDOptions& o);
};

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
extern template class AdamT<false>;
extern template class AdamT<true>;

}  // namespace ampkit::optim
