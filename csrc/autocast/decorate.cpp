// ampkit::decorate: the O-level presets for LibTorch modules (see <ampkit/autocast.h>), with the FP32 masters of
// an ampkit optimizer taken before the cast, and a registry of the modules decorated at O2/O3.
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ampkit/autocast.h"
#include "ampkit/fp8.h"
#include "ampkit/optim.h"

namespace ampkit {
namespace {

bool is_norm(const torch::nn::Module& m) {
  return m.as<torch::nn::BatchNorm1d>() || m.as<torch::nn::BatchNorm2d>() || m.as<torch::nn::BatchNorm3d>() ||
         m.as<torch::nn::LayerNorm>() || m.as<torch::nn::GroupNorm>() || m.as<torch::nn::InstanceNorm1d>() ||
         m.as<torch::nn::InstanceNorm2d>() || m.as<torch::nn::InstanceNorm3d>();
}

const char* level_name(OptLevel level) {
  static const char* const names[] = {"O0", "O1", "O2", "O3"};
  return names[static_cast<int>(level)];
}

// NOTE [Decorated modules]
// ampkit.decorate marks a model decorated at O2/O3 with an attribute and refuses to decorate it again (that would
// take the optimizer's masters from rounded weights). A LibTorch module has no room for a mark, so the modules are
// kept here by address with a weak reference that tells when the module is gone: its owner's (a module owned by a
// shared_ptr: TORCH_MODULE holders, std::make_shared), or for a module held by value (`Net model;`, as LibTorch's
// examples write it) its first parameter's, which dies with it. An entry whose module is gone is dropped: a new
// module at a freed module's address is never taken for it.
struct Decorated {
  const torch::nn::Module* module;
  std::weak_ptr<torch::nn::Module> owner;                               // a module owned by a shared_ptr
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> first_param;  // else: its first parameter
  OptLevel level;

  bool gone() const { return owner.expired() && (!first_param.has_value() || first_param->expired()); }
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::vector<Decorated>& registry() {
  static std::vector<Decorated> r;
  return r;
}

// The first parameter of `module` (recursing), or an undefined tensor.
at::Tensor first_parameter(const torch::nn::Module& module) {
  const auto params = module.parameters(/*recurse=*/true);
  return params.empty() ? at::Tensor() : params.front();
}

// The level `module` was decorated at (O2/O3), if it was; drops the entries of modules that are gone.
std::optional<OptLevel> decorated_level(const torch::nn::Module& module) {
  const std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  r.erase(std::remove_if(r.begin(), r.end(), [](const Decorated& d) { return d.gone(); }), r.end());
  const at::Tensor first = first_parameter(module);
  for (const auto& d : r) {
    const bool same =
        d.module == &module && (!d.owner.expired() || (first.defined() && d.first_param.has_value() &&
                                                       d.first_param->lock().get() == first.unsafeGetTensorImpl()));
    if (same) {
      return d.level;
    }
  }
  return std::nullopt;
}

void mark_decorated(torch::nn::Module& module, OptLevel level) {
  Decorated entry{&module, module.weak_from_this(), std::nullopt, level};
  if (entry.owner.expired()) {
    const at::Tensor first = first_parameter(module);
    if (!first.defined()) {
      return;  // no parameter: nothing a second decorate could take a master from
    }
    entry.first_param.emplace(first.getIntrusivePtr());
  }
  const std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(std::move(entry));
}

// `module` and every module under it, with their qualified names ("" for `module`), without asking for a
// shared_ptr that owns `module` (named_modules(include_self) does): a module held by value is decorated too.
std::vector<std::pair<std::string, torch::nn::Module*>> modules_of(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::nn::Module*>> all{{"", &module}};
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    all.emplace_back(item.key(), item.value().get());
  }
  return all;
}

// `module` and every module under it.
std::vector<const torch::nn::Module*> subtree(const torch::nn::Module& module) {
  std::vector<const torch::nn::Module*> all{&module};
  for (const auto& sub : module.modules(/*include_self=*/false)) {
    all.push_back(sub.get());
  }
  return all;
}

// Gives parameter p an FP32 master copied from its current value in `optimizer`'s state (creating the state).
template <typename State>
void set_master(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto& slot = optimizer.state()[p.unsafeGetTensorImpl()];
  if (!slot) {
    slot = std::make_unique<State>();
  }
  static_cast<State&>(*slot).master_param(p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
}

using SetMaster = void (*)(torch::optim::Optimizer&, const at::Tensor&);

// A group's master_weights option (kAuto for an optimizer decorate refuses anyway).
optim::MasterWeights master_weights_of(const torch::optim::OptimizerOptions& options) {
  if (const auto* o = dynamic_cast<const optim::AdamOptions*>(&options)) {
    return o->master_weights();
  }
  if (const auto* o = dynamic_cast<const optim::AdamWOptions*>(&options)) {
    return o->master_weights();
  }
  if (const auto* o = dynamic_cast<const optim::SGDOptions*>(&options)) {
    return o->master_weights();
  }
  if (const auto* o = dynamic_cast<const optim::LAMBOptions*>(&options)) {
    return o->master_weights();
  }
  return optim::MasterWeights::kAuto;
}

// How `optimizer` keeps masters: its state type's set_master; throws for an optimizer that keeps none.
SetMaster master_setter(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<optim::Adam*>(&optimizer) != nullptr || dynamic_cast<optim::AdamW*>(&optimizer) != nullptr ||
      dynamic_cast<optim::LAMB*>(&optimizer) != nullptr) {
    return &set_master<optim::AdamParamState>;
  }
  TORCH_CHECK_TYPE(dynamic_cast<optim::SGD*>(&optimizer) != nullptr,
                   "ampkit::decorate: optimizer must be an "
                   "ampkit::optim optimizer (Adam, AdamW, SGD or LAMB) at O2/O3, which keep the FP32 masters, but got ",
                   c10::demangle(typeid(optimizer).name()));
  return &set_master<optim::SGDParamState>;
}

void decorate_impl(torch::nn::Module& module, torch::optim::Optimizer* optimizer, OptLevel level,
                   std::optional<c10::ScalarType> dtype_arg, bool keep_norm_fp32,
                   const std::vector<std::string>& excluded) {
  c10::ScalarType dtype = c10::kBFloat16;
  if (dtype_arg.has_value()) {
    dtype = *dtype_arg;
  } else {
    // The device's low-precision dtype (BF16 on the CPU, FP16 on CUDA); a warning when it is not faster there.
    const auto params = module.parameters();
    const PrecisionSupport support =
        precision_support(params.empty() ? c10::Device(c10::kCPU) : params.front().device());
    dtype = support.lowp_dtype;
    if ((level == OptLevel::kO2 || level == OptLevel::kO3) && !support.fast) {
      TORCH_WARN_ONCE("ampkit::decorate: ", support.reason);
    }
  }
  TORCH_CHECK_VALUE(dtype == c10::kHalf || dtype == c10::kBFloat16,
                    "ampkit::decorate: dtype must be Half or BFloat16, but got ", dtype);
  if (level == OptLevel::kO0 || level == OptLevel::kO1) {
    return;
  }
  // Everything is checked before the first cast or master: a decorate that throws changes nothing.
  const SetMaster set_master_of = optimizer != nullptr ? master_setter(*optimizer) : nullptr;
  // Parameters of groups that keep no FP32 master (master_weights stochastic or kahan): cast, no master.
  std::unordered_set<const c10::TensorImpl*> masterless;
  if (optimizer != nullptr) {
    for (const auto& group : optimizer->param_groups()) {
      const optim::MasterWeights mw = master_weights_of(group.options());
      if (mw == optim::MasterWeights::kStochastic || mw == optim::MasterWeights::kKahan) {
        for (const auto& p : group.params()) {
          masterless.insert(p.unsafeGetTensorImpl());
        }
      }
    }
  }
  const std::optional<OptLevel> before = decorated_level(module);
  TORCH_CHECK(!before.has_value(), "ampkit::decorate: module must not be decorated yet, but it was decorated at ",
              before.has_value() ? level_name(*before) : "",
              " already; decorating it again would take the "
              "optimizer's masters from rounded weights (decorate a module once, before loading checkpoints)");
  const auto named = modules_of(module);
  for (const auto& name : excluded) {
    TORCH_CHECK_VALUE(std::any_of(named.begin(), named.end(), [&](const auto& item) { return item.first == name; }),
                      "ampkit::decorate: excluded module '", name, "' is not in the model");
  }
  // Modules kept FP32, with everything under them.
  std::unordered_set<const torch::nn::Module*> kept;
  for (const auto& [name, m] : named) {
    const bool excluded_here = std::find(excluded.begin(), excluded.end(), name) != excluded.end();
    const bool norm_kept = level == OptLevel::kO2 && keep_norm_fp32 && is_norm(*m);
    if (excluded_here || norm_kept) {
      for (const torch::nn::Module* sub : subtree(*m)) {
        kept.insert(sub);
      }
    }
  }
  // A parameter shared between modules (a decoder tied to the embedding) has one dtype: when one owner stays
  // FP32, every owner does (with everything under it), until no kept module shares a parameter with a cast one.
  std::unordered_map<const c10::TensorImpl*, std::vector<const torch::nn::Module*>> owners;
  for (const auto& item : named) {
    for (const auto& p : item.second->named_parameters(/*recurse=*/false)) {
      owners[p.value().unsafeGetTensorImpl()].push_back(item.second);
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (const auto& [param, modules] : owners) {
      const bool any_kept =
          std::any_of(modules.begin(), modules.end(), [&](const torch::nn::Module* m) { return kept.count(m) != 0; });
      for (const torch::nn::Module* m : modules) {
        if (any_kept && kept.count(m) == 0) {
          for (const torch::nn::Module* sub : subtree(*m)) {
            kept.insert(sub);
          }
          changed = true;
        }
      }
    }
  }
  std::unordered_set<const c10::TensorImpl*> owned;  // the optimizer's parameters
  if (optimizer != nullptr) {
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        owned.insert(p.unsafeGetTensorImpl());
      }
    }
  }
  const torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;  // a parameter tied between modules is cast once
  int64_t rounded = 0;
  for (const auto& item : named) {
    if (kept.count(item.second) != 0) {
      continue;
    }
    for (auto& p : item.second->named_parameters(/*recurse=*/false)) {
      at::Tensor& param = p.value();
      if (!seen.insert(param.unsafeGetTensorImpl()).second || !param.is_floating_point()) {
        continue;
      }
      if (owned.count(param.unsafeGetTensorImpl()) != 0 && masterless.count(param.unsafeGetTensorImpl()) == 0) {
        if (param.scalar_type() == c10::kHalf || param.scalar_type() == c10::kBFloat16) {
          ++rounded;
        }
        set_master_of(*optimizer, param);  // from the weight before its cast (Apex O2)
      }
      param.set_data(param.to(dtype));
    }
    if (dynamic_cast<const fp8::Float8LinearImpl*>(item.second) != nullptr) {
      continue;  // its buffers are FP8 scaling state, kept FP32
    }
    for (auto& b : item.second->named_buffers(/*recurse=*/false)) {
      if (b.value().is_floating_point()) {
        b.value().set_data(b.value().to(dtype));
      }
    }
  }
  if (rounded > 0) {
    TORCH_WARN("ampkit::decorate: ", rounded,
               " parameter(s) were already FP16/BF16, so their FP32 masters are "
               "copies of rounded weights; decorate the FP32 model to keep the unrounded values");
  }
  mark_decorated(module, level);
}

}  // namespace

void decorate(torch::nn::Module& module, OptLevel level, std::optional<c10::ScalarType> dtype, bool keep_norm_fp32,
              const std::vector<std::string>& excluded) {
  decorate_impl(module, nullptr, level, dtype, keep_norm_fp32, excluded);
}

void decorate(torch::nn::Module& module, torch::optim::Optimizer& optimizer, OptLevel level,
              std::optional<c10::ScalarType> dtype, bool keep_norm_fp32, const std::vector<std::string>& excluded) {
  decorate_impl(module, &optimizer, level, dtype, keep_norm_fp32, excluded);
}

}  // namespace ampkit
