// ampkit::optim::Adam, AdamW and SGD (see <ampkit/optim.h>): LibTorch optimizers whose step() groups each param
// group's params by (device, has master) and runs one fused op per group.
#include "ampkit/optim.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "ampkit/ops.h"

namespace ampkit::optim {
namespace {

// Throws unless every group that carries options carries this optimizer's (groups[i] becomes group first + i).
template <typename Options>
void check_group_options(const char* optimizer, size_t first,
                         const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    TORCH_CHECK_VALUE(!groups[i].has_options() || dynamic_cast<const Options*>(&groups[i].options()) != nullptr,
                      "ampkit::optim::", optimizer, ": param group ", first + i, " carries the options of another "
                      "optimizer; give it this optimizer's options (or none, for the defaults)");
  }
}

// LibTorch's Optimizer constructor and add_param_group give the param groups of an optimizer it does not know the
// defaults, dropping the options a group carries: put each group's own options back (groups[i] became group
// first + i).
void keep_group_options(std::vector<torch::optim::OptimizerParamGroup>& added, size_t first,
                        const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].has_options()) {
      added.at(first + i).set_options(groups[i].options().clone());
    }
  }
}

// The constructor's and add_param_group's part shared by every optimizer here: groups carrying another
// optimizer's options are refused, and each group's own options are kept.
template <typename Options>
void adopt_groups(const char* optimizer, std::vector<torch::optim::OptimizerParamGroup>& own,
                  const std::vector<torch::optim::OptimizerParamGroup>& given) {
  check_group_options<Options>(optimizer, 0, given);
  keep_group_options(own, 0, given);
}

template <typename Options>
void add_group(const char* optimizer, torch::optim::Optimizer& self,
               const torch::optim::OptimizerParamGroup& param_group) {
  check_group_options<Options>(optimizer, self.param_groups().size(), {param_group});
  self.torch::optim::Optimizer::add_param_group(param_group);
  keep_group_options(self.param_groups(), self.param_groups().size() - 1, {param_group});
}

// A bool option that archives from before it existed do not hold: left at its default when absent.
void read_optional_flag(torch::serialize::InputArchive& archive, const char* key, bool& value) {
  c10::IValue ivalue;
  if (archive.try_read(key, ivalue)) {
    TORCH_CHECK_VALUE(ivalue.isBool(), "ampkit::optim: option '", key, "' in the archive must be a bool, but it is a ",
                      ivalue.tagKind());
    value = ivalue.toBool();
  }
}

// Writes a master_weights option: a bool or none (as archives before remainder mode), or "remainder".
void write_master_weights(torch::serialize::OutputArchive& archive, MasterWeights mw) {
  switch (mw.mode()) {
    case MasterWeights::kRemainder:
      archive.write("master_weights", c10::IValue(std::string(mw.name())));
      break;
    case MasterWeights::kAuto:
      archive.write("master_weights", c10::IValue());
      break;
    default:
      archive.write("master_weights", c10::IValue(mw == MasterWeights::kOn));
  }
}

void read_master_weights(torch::serialize::InputArchive& archive, MasterWeights& mw) {
  c10::IValue ivalue;
  if (!archive.try_read("master_weights", ivalue)) {
    return;
  }
  if (ivalue.isNone()) {
    mw = MasterWeights::kAuto;
  } else if (ivalue.isBool()) {
    mw = MasterWeights(ivalue.toBool());
  } else {
    TORCH_CHECK_VALUE(ivalue.isString(), "ampkit::optim: option 'master_weights' in the archive must be a bool, none "
                      "or a string, but it is a ", ivalue.tagKind());
    mw = MasterWeights::from_name(ivalue.toStringRef());
  }
}

void write_lr_tensor(torch::serialize::OutputArchive& archive, const at::Tensor& lr_tensor) {
  if (lr_tensor.defined()) {
    archive.write("lr_tensor", lr_tensor);
  }
}

void read_lr_tensor(torch::serialize::InputArchive& archive, at::Tensor& lr_tensor) {
  c10::IValue ivalue;
  if (archive.try_read("lr_tensor", ivalue)) {
    TORCH_CHECK_VALUE(ivalue.isTensor(), "ampkit::optim: option 'lr_tensor' in the archive must be a tensor, but it is a ",
                      ivalue.tagKind());
    lr_tensor = ivalue.toTensor();
  }
}

// The entries of a LibTorch param state, as the core names them (and back).
core::ParamState to_core(const AdamParamState& s) {
  core::ParamState c;
  c.step = s.step();
  c.exp_avg = s.exp_avg();
  c.exp_avg_sq = s.exp_avg_sq();
  c.max_exp_avg_sq = s.max_exp_avg_sq();
  c.master_param = s.master_param();
  c.param_remainder = s.param_remainder();
  return c;
}

void from_core(const core::ParamState& c, AdamParamState& s) {
  s.step(c.step).exp_avg(c.exp_avg).exp_avg_sq(c.exp_avg_sq).max_exp_avg_sq(c.max_exp_avg_sq);
  s.master_param(c.master_param).param_remainder(c.param_remainder);
}

core::ParamState to_core(const SGDParamState& s) {
  core::ParamState c;
  c.step = s.step();
  c.momentum_buffer = s.momentum_buffer();
  c.master_param = s.master_param();
  c.param_remainder = s.param_remainder();
  return c;
}

void from_core(const core::ParamState& c, SGDParamState& s) {
  s.step(c.step).momentum_buffer(c.momentum_buffer).master_param(c.master_param).param_remainder(c.param_remainder);
}

using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

// One step of every group through the core: every group is checked before the first one is written; states are
// created for the params the core gives state to (an SGD param without momentum or master gets none).
template <typename State, typename Options, typename ConfigOf>
void core_step(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& states, const ConfigOf& config_of,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               at::Tensor* lamb_grad_norm = nullptr) {
  std::vector<core::GroupConfig> configs;
  for (const auto& group : groups) {
    configs.push_back(config_of(static_cast<const Options&>(group.options())));
    core::check_group(configs.back(), group.params());
  }
  if (lamb_grad_norm != nullptr) {
    // LAMB's clipping: one global norm over every group's grads (NOTE [LAMB passes]).
    const bool clip = std::any_of(configs.begin(), configs.end(), [](const auto& c) { return c.max_grad_norm > 0; });
    if (clip) {
      std::vector<at::Tensor> grads;
      for (const auto& group : groups) {
        for (const auto& p : group.params()) {
          if (p.grad().defined()) {
            grads.push_back(p.grad());
          }
        }
      }
      *lamb_grad_norm = core::global_grad_norm(grads, grad_scale);
      for (auto& c : configs) {
        c.grad_norm = *lamb_grad_norm;
      }
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    std::vector<core::ParamState> cores(params.size());
    std::vector<core::ParamState*> ptrs(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto it = states.find(params[i].unsafeGetTensorImpl());
      if (it != states.end()) {
        cores[i] = to_core(static_cast<const State&>(*it->second));
      }
      ptrs[i] = &cores[i];
    }
    core::step(configs[g], params, ptrs, grad_scale, found_inf);
    for (size_t i = 0; i < params.size(); ++i) {
      if (cores[i].empty()) {
        continue;
      }
      auto& slot = states[params[i].unsafeGetTensorImpl()];
      if (!slot) {
        slot = std::make_unique<State>();
      }
      from_core(cores[i], static_cast<State&>(*slot));
    }
  }
}

// Loads an archive of save() into the optimizer, all or nothing: the options and states are checked by the core,
// states of fused params kept FP32 (torch::optim::serialize restores them as saved); on any error the optimizer's
// options and states are put back.
template <typename State, typename Options, typename ConfigOf>
void checked_load(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                  const ConfigOf& config_of) {
  auto& groups = optimizer.param_groups();
  auto& states = optimizer.state();
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved_options;
  for (const auto& group : groups) {
    saved_options.push_back(group.options().clone());
  }
  StateMap saved_states;
  for (const auto& [key, value] : states) {
    saved_states[key] = value->clone();
  }
  try {
    torch::optim::serialize<State, Options>(archive, optimizer);
    size_t index = 0;
    for (const auto& group : groups) {
      const core::GroupConfig config = config_of(static_cast<const Options&>(group.options()));
      core::check_config(config);
      for (const auto& p : group.params()) {
        const auto it = states.find(p.unsafeGetTensorImpl());
        const std::string where = "state[" + std::to_string(index++) + "]";
        if (it == states.end() || !core::takes_fused(p, p)) {
          continue;  // torch.optim's state format (the single-tensor path)
        }
        core::ParamState c = to_core(static_cast<const State&>(*it->second));
        std::vector<std::pair<std::string, at::Tensor>> entries;
        for (const auto& name : core::ParamState::names()) {
          if (c.entry(name)->defined()) {
            entries.emplace_back(name, *c.entry(name));
          }
        }
        core::check_loaded_state(config, where, p, entries);
        for (auto& [name, value] : entries) {
          *c.entry(name) = core::loaded_entry(name, value, p);
        }
        from_core(c, static_cast<State&>(*it->second));
      }
    }
  } catch (...) {
    for (size_t i = 0; i < groups.size() && i < saved_options.size(); ++i) {
      groups[i].set_options(std::move(saved_options[i]));
    }
    states = std::move(saved_states);
    throw;
  }
}

// Gives every parameter an FP32 master copied from its current value (init_master_params).
template <typename State>
void init_masters(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& states) {
  const at::NoGradGuard no_grad;
  for (auto& group : groups) {
    for (const auto& p : group.params()) {
      auto& slot = states[p.unsafeGetTensorImpl()];
      if (!slot) {
        slot = std::make_unique<State>();
      }
      core::ParamState c = to_core(static_cast<const State&>(*slot));
      core::init_master(p, c);
      from_core(c, static_cast<State&>(*slot));
    }
  }
}

// The loss closure of torch::optim::Optimizer::step, run with grad enabled (as LibTorch's optimizers do).
at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) {
    return {};
  }
  const at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace

std::optional<at::Tensor> ScaledStep::grad_scale() const {
  return grad_scale_.defined() ? std::optional<at::Tensor>(grad_scale_) : std::nullopt;
}

std::optional<at::Tensor> ScaledStep::found_inf() const {
  return found_inf_.defined() ? std::optional<at::Tensor>(found_inf_) : std::nullopt;
}

// ---- Adam / AdamW -------------------------------------------------------------------------------------------------

template <bool kDecoupled>
void AdamOptionsT<kDecoupled>::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  write_master_weights(archive, master_weights());
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(write_unscaled_grads);
  write_lr_tensor(archive, lr_tensor());
}

template <bool kDecoupled>
void AdamOptionsT<kDecoupled>::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  read_master_weights(archive, master_weights_);
  read_optional_flag(archive, "write_unscaled_grads", write_unscaled_grads_);
  read_lr_tensor(archive, lr_tensor_);
}

void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(param_remainder);
}

void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, param_remainder);
}

template <bool kDecoupled>
core::GroupConfig AdamT<kDecoupled>::config(const Options& o) {
  core::GroupConfig c;
  c.optimizer = kDecoupled ? "AdamW" : "Adam";
  c.algorithm = core::Algorithm::kAdam;
  c.lr = o.lr();
  c.lr_tensor = o.lr_tensor();
  std::tie(c.beta1, c.beta2) = o.betas();
  c.eps = o.eps();
  c.weight_decay = o.weight_decay();
  c.amsgrad = o.amsgrad();
  c.decoupled_weight_decay = kDecoupled;
  c.maximize = o.maximize();
  c.master_weights = o.master_weights();
  c.write_unscaled_grads = o.write_unscaled_grads();
  return c;
}

template <bool kDecoupled>
AdamT<kDecoupled>::AdamT(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<Options>(defaults)) {
  core::check_config(config(defaults));
  adopt_groups<Options>(kDecoupled ? "AdamW" : "Adam", param_groups_, param_groups);
}

template <bool kDecoupled>
void AdamT<kDecoupled>::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  add_group<Options>(kDecoupled ? "AdamW" : "Adam", *this, param_group);
}

template <bool kDecoupled>
at::Tensor AdamT<kDecoupled>::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  const at::NoGradGuard no_grad;
  core_step<AdamParamState, Options>(param_groups_, state_, &AdamT::config, grad_scale(), found_inf());
  return loss;
}

template <bool kDecoupled>
void AdamT<kDecoupled>::init_master_params() {
  init_masters<AdamParamState>(param_groups_, state_);
}

template <bool kDecoupled>
void AdamT<kDecoupled>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamParamState, Options>(archive, *this);
}

template <bool kDecoupled>
void AdamT<kDecoupled>::load(torch::serialize::InputArchive& archive) {
  checked_load<AdamParamState, Options>(*this, archive, &AdamT::config);
}

template struct AdamOptionsT<false>;
template struct AdamOptionsT<true>;
template class AdamT<false>;
template class AdamT<true>;

// ---- SGD ------------------------------------------------------------------------------------------------------

void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  write_master_weights(archive, master_weights());
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(write_unscaled_grads);
  write_lr_tensor(archive, lr_tensor());
}

void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  read_master_weights(archive, master_weights_);
  read_optional_flag(archive, "write_unscaled_grads", write_unscaled_grads_);
  read_lr_tensor(archive, lr_tensor_);
}

void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(param_remainder);
}

void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, param_remainder);
}

core::GroupConfig SGD::config(const SGDOptions& o) {
  core::GroupConfig c;
  c.optimizer = "SGD";
  c.algorithm = core::Algorithm::kSGD;
  c.lr = o.lr();
  c.lr_tensor = o.lr_tensor();
  c.momentum = o.momentum();
  c.dampening = o.dampening();
  c.weight_decay = o.weight_decay();
  c.nesterov = o.nesterov();
  c.maximize = o.maximize();
  c.master_weights = o.master_weights();
  c.write_unscaled_grads = o.write_unscaled_grads();
  return c;
}

SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<SGDOptions>(defaults)) {
  core::check_config(config(defaults));
  adopt_groups<SGDOptions>("SGD", param_groups_, param_groups);
}

void SGD::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  add_group<SGDOptions>("SGD", *this, param_group);
}

at::Tensor SGD::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  const at::NoGradGuard no_grad;
  core_step<SGDParamState, SGDOptions>(param_groups_, state_, &SGD::config, grad_scale(), found_inf());
  return loss;
}

void SGD::init_master_params() { init_masters<SGDParamState>(param_groups_, state_); }

void SGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

void SGD::load(torch::serialize::InputArchive& archive) {
  checked_load<SGDParamState, SGDOptions>(*this, archive, &SGD::config);
}

// ---- LAMB -----------------------------------------------------------------------------------------------------

void LAMBOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adam_w_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_averaging);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_grad_norm);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_nvlamb);
  write_master_weights(archive, master_weights());
  write_lr_tensor(archive, lr_tensor());
}

void LAMBOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adam_w_mode);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, grad_averaging);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_grad_norm);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_nvlamb);
  read_master_weights(archive, master_weights_);
  read_lr_tensor(archive, lr_tensor_);
}

core::GroupConfig LAMB::config(const LAMBOptions& o) {
  core::GroupConfig c;
  c.optimizer = "LAMB";
  c.algorithm = core::Algorithm::kLamb;
  c.lr = o.lr();
  c.lr_tensor = o.lr_tensor();
  std::tie(c.beta1, c.beta2) = o.betas();
  c.eps = o.eps();
  c.weight_decay = o.weight_decay();
  c.decoupled_weight_decay = o.adam_w_mode();
  c.bias_correction = o.bias_correction();
  c.grad_averaging = o.grad_averaging();
  c.max_grad_norm = o.max_grad_norm();
  c.use_nvlamb = o.use_nvlamb();
  c.master_weights = o.master_weights();
  c.write_unscaled_grads = false;  // LAMB only reads the grads
  return c;
}

LAMB::LAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LAMBOptions defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<LAMBOptions>(defaults)) {
  core::check_config(config(defaults));
  adopt_groups<LAMBOptions>("LAMB", param_groups_, param_groups);
}

void LAMB::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  add_group<LAMBOptions>("LAMB", *this, param_group);
}

at::Tensor LAMB::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  const at::NoGradGuard no_grad;
  core_step<AdamParamState, LAMBOptions>(param_groups_, state_, &LAMB::config, grad_scale(), found_inf(),
                                         &last_grad_norm_);
  return loss;
}

void LAMB::init_master_params() { init_masters<AdamParamState>(param_groups_, state_); }

void LAMB::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamParamState, LAMBOptions>(archive, *this);
}

void LAMB::load(torch::serialize::InputArchive& archive) {
  checked_load<AdamParamState, LAMBOptions>(*this, archive, &LAMB::config);
}

}  // namespace ampkit::optim
