// ampkit::optim::Adam, AdamW and SGD (see <ampkit/optim.h>): LibTorch optimizers whose step() groups each param
// group's params by (device, has master) and runs one fused op per group.
#include "ampkit/optim.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <string>

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

// A bool option that archives from before it existed do not hold: left at its default when absent.
void read_optional_flag(torch::serialize::InputArchive& archive, const char* key, bool& value) {
  c10::IValue ivalue;
  if (archive.try_read(key, ivalue)) {
    TORCH_CHECK_VALUE(ivalue.isBool(), "ampkit::optim: option '", key, "' in the archive must be a bool, but it is a ",
                      ivalue.tagKind());
    value = ivalue.toBool();
  }
}

bool wants_master(const std::optional<bool>& option, const at::Tensor& p) {
  return option.value_or(p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16);
}

at::Tensor fp32_zeros_like(const at::Tensor& p) {
  return at::zeros_like(p, at::TensorOptions().dtype(at::kFloat), at::MemoryFormat::Preserve);
}

// The tensor lists of one fused call.
struct Bucket {
  std::vector<at::Tensor> params, grads, masters, first, second, third, steps;
};

// The parameter's state in `states`, created by `make()` when it has none.
template <typename State, typename Make>
State& state_for(ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& states,
                 const at::Tensor& p, const Make& make) {
  auto& slot = states[p.unsafeGetTensorImpl()];
  if (!slot) {
    slot = make();
  }
  return static_cast<State&>(*slot);
}

// Adds the param, its grad and its master (if any) to the bucket of its (device, has master).
Bucket& add_to_bucket(std::map<std::pair<std::string, bool>, Bucket>& buckets, const at::Tensor& p,
                      const at::Tensor& master) {
  Bucket& b = buckets[{p.device().str(), master.defined()}];
  b.params.push_back(p);
  b.grads.push_back(p.grad());
  if (master.defined()) {
    b.masters.push_back(master);
  }
  return b;
}

// Throws unless every param with a grad is one the fused kernels take (checked for all groups before a step
// writes or creates anything, so that a step is all or nothing).
void check_params(const char* optimizer, const torch::optim::OptimizerParamGroup& group) {
  for (const auto& p : group.params()) {
    if (!p.grad().defined()) {
      continue;
    }
    const auto dtype = p.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, "ampkit::optim::",
                     optimizer, ": parameters must be Half, BFloat16 or Float, but one is ", dtype);
    TORCH_CHECK(!p.grad().is_sparse(), "ampkit::optim::", optimizer, " does not support sparse gradients");
  }
}

at::Tensor fp32_copy(const at::Tensor& p) { return p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true); }

std::unique_ptr<AdamParamState> new_adam_state(const at::Tensor& p, bool with_master) {
  auto s = std::make_unique<AdamParamState>();
  s->step(at::zeros({}, p.options().dtype(at::kFloat)));
  s->exp_avg(fp32_zeros_like(p));
  s->exp_avg_sq(fp32_zeros_like(p));
  if (with_master) {
    s->master_param(fp32_copy(p));
  }
  return s;
}

std::unique_ptr<SGDParamState> new_sgd_state(const at::Tensor& p, bool with_master) {
  auto s = std::make_unique<SGDParamState>();
  s->step(at::zeros({}, p.options().dtype(at::kFloat)));
  if (with_master) {
    s->master_param(fp32_copy(p));
  }
  return s;
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

std::optional<at::Tensor> ScaledStep::grad_scale_for(const at::Device& device) const {
  if (!grad_scale_.defined()) {
    return std::nullopt;
  }
  return grad_scale_.device() == device ? grad_scale_ : grad_scale_.to(device, /*non_blocking=*/true);
}

std::optional<at::Tensor> ScaledStep::found_inf_for(const at::Device& device) const {
  if (!found_inf_.defined()) {
    return std::nullopt;
  }
  return found_inf_.device() == device ? found_inf_ : found_inf_.to(device, /*non_blocking=*/true);
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
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(write_unscaled_grads);
}

template <bool kDecoupled>
void AdamOptionsT<kDecoupled>::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, master_weights);
  read_optional_flag(archive, "write_unscaled_grads", write_unscaled_grads_);
}

void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

template <bool kDecoupled>
AdamT<kDecoupled>::AdamT(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<Options>(defaults)) {
  check_options(defaults);
  check_group_options<Options>(kDecoupled ? "AdamW" : "Adam", 0, param_groups);
  keep_group_options(param_groups_, 0, param_groups);
}

template <bool kDecoupled>
void AdamT<kDecoupled>::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  check_group_options<Options>(kDecoupled ? "AdamW" : "Adam", param_groups_.size(), {param_group});
  torch::optim::Optimizer::add_param_group(param_group);
  keep_group_options(param_groups_, param_groups_.size() - 1, {param_group});
}

template <bool kDecoupled>
void AdamT<kDecoupled>::check_options(const Options& o) {
  TORCH_CHECK_VALUE(o.lr() >= 0, "Invalid learning rate: ", o.lr());
  TORCH_CHECK_VALUE(o.eps() >= 0, "Invalid epsilon value: ", o.eps());
  const auto [b1, b2] = o.betas();
  TORCH_CHECK_VALUE(0 <= b1 && b1 < 1.0, "Invalid beta parameter at index 0: ", b1);
  TORCH_CHECK_VALUE(0 <= b2 && b2 < 1.0, "Invalid beta parameter at index 1: ", b2);
  TORCH_CHECK_VALUE(o.weight_decay() >= 0, "Invalid weight_decay value: ", o.weight_decay());
}

template <bool kDecoupled>
at::Tensor AdamT<kDecoupled>::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  const at::NoGradGuard no_grad;
  for (const auto& group : param_groups_) {  // every group is checked before the first one is written
    check_options(static_cast<const Options&>(group.options()));
    check_params(kDecoupled ? "AdamW" : "Adam", group);
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const Options&>(group.options());
    std::map<std::pair<std::string, bool>, Bucket> buckets;  // (device, has master)
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      auto& s = state_for<AdamParamState>(state_, p,
                                          [&] { return new_adam_state(p, wants_master(o.master_weights(), p)); });
      if (o.amsgrad() && !s.max_exp_avg_sq().defined()) {
        s.max_exp_avg_sq(fp32_zeros_like(p));
      }
      Bucket& b = add_to_bucket(buckets, p, s.master_param());
      b.first.push_back(s.exp_avg());
      b.second.push_back(s.exp_avg_sq());
      if (o.amsgrad()) {
        b.third.push_back(s.max_exp_avg_sq());
      }
      b.steps.push_back(s.step());
    }
    for (auto& [key, b] : buckets) {
      const at::Device device = b.params[0].device();
      adamw_step_(b.params, b.grads, b.masters, {}, b.first, b.second, b.third, b.steps, o.lr(), std::get<0>(o.betas()),
                  std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(), o.maximize(), kDecoupled,
                  grad_scale_for(device), found_inf_for(device), std::nullopt, o.write_unscaled_grads());
    }
  }
  return loss;
}

template <bool kDecoupled>
void AdamT<kDecoupled>::init_master_params() {
  const at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      state_for<AdamParamState>(state_, p, [&] { return new_adam_state(p, false); }).master_param(fp32_copy(p));
    }
  }
}

template <bool kDecoupled>
void AdamT<kDecoupled>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamParamState, Options>(archive, *this);
}

template <bool kDecoupled>
void AdamT<kDecoupled>::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<AdamParamState, Options>(archive, *this);
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
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(write_unscaled_grads);
}

void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG_OPTIONAL(bool, master_weights);
  read_optional_flag(archive, "write_unscaled_grads", write_unscaled_grads_);
}

void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<SGDOptions>(defaults)) {
  check_options(defaults);
  check_group_options<SGDOptions>("SGD", 0, param_groups);
  keep_group_options(param_groups_, 0, param_groups);
}

void SGD::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  check_group_options<SGDOptions>("SGD", param_groups_.size(), {param_group});
  torch::optim::Optimizer::add_param_group(param_group);
  keep_group_options(param_groups_, param_groups_.size() - 1, {param_group});
}

void SGD::check_options(const SGDOptions& o) {
  TORCH_CHECK_VALUE(o.lr() >= 0, "Invalid learning rate: ", o.lr());
  TORCH_CHECK_VALUE(o.momentum() >= 0, "Invalid momentum value: ", o.momentum());
  TORCH_CHECK_VALUE(o.weight_decay() >= 0, "Invalid weight_decay value: ", o.weight_decay());
  TORCH_CHECK_VALUE(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
                    "Nesterov momentum requires a momentum and zero dampening");
}

at::Tensor SGD::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  const at::NoGradGuard no_grad;
  for (const auto& group : param_groups_) {  // every group is checked before the first one is written
    check_options(static_cast<const SGDOptions&>(group.options()));
    check_params("SGD", group);
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const SGDOptions&>(group.options());
    const bool momentum = o.momentum() != 0;
    std::map<std::pair<std::string, bool>, Bucket> buckets;  // (device, has master)
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      auto& s = state_for<SGDParamState>(state_, p,
                                         [&] { return new_sgd_state(p, wants_master(o.master_weights(), p)); });
      if (momentum && !s.momentum_buffer().defined()) {
        s.momentum_buffer(fp32_zeros_like(p));
      }
      Bucket& b = add_to_bucket(buckets, p, s.master_param());
      if (momentum) {
        b.first.push_back(s.momentum_buffer());
        b.steps.push_back(s.step());
      }
    }
    for (auto& [key, b] : buckets) {
      const at::Device device = b.params[0].device();
      sgd_step_(b.params, b.grads, b.masters, {}, b.first, b.steps, o.lr(), o.momentum(), o.dampening(),
                o.weight_decay(), o.nesterov(), o.maximize(), grad_scale_for(device), found_inf_for(device),
                std::nullopt, o.write_unscaled_grads());
    }
  }
  return loss;
}

void SGD::init_master_params() {
  const at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      state_for<SGDParamState>(state_, p, [&] { return new_sgd_state(p, false); }).master_param(fp32_copy(p));
    }
  }
}

void SGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

void SGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

}  // namespace ampkit::optim
