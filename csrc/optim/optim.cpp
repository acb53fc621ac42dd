// ampkit::optim::Adam, AdamW, SGD and LAMB (see <ampkit/optim.h>): LibTorch optimizers over ampkit::optim::core,
// which checks, plans and runs each group's step. FusedOptimizer, their base, is defined here once (construction,
// the step of every group, checked loads, masters) and instantiated for the four; below it, each optimizer's
// options, states and config(). Their archives' reading and writing is libtorch_archive.cpp's.
#include "ampkit/optim.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "ampkit/ops.h"
#include "libtorch_archive.h"

namespace ampkit::optim {
namespace {

using namespace archive;  // NOLINT(google-build-using-namespace): the archive helpers of this file's classes

// Throws unless every group that carries options carries this optimizer's (groups[i] becomes group first + i).
template <typename Options>
void check_group_options(const char* optimizer, size_t first,
                         const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    TORCH_CHECK_VALUE(!groups[i].has_options() || dynamic_cast<const Options*>(&groups[i].options()) != nullptr,
                      "ampkit::optim::", optimizer, ": param group ", first + i,
                      " carries the options of another "
                      "optimizer; give it this optimizer's options (or none, for the defaults)");
  }
}

// NOTE [Group options]
// A param group carrying options takes the options it sets (a setter or the lr constructor ran) and the optimizer's
// defaults for every other: torch.optim's rule in Python, and LibTorch's since torch 2.13 (its add_param_group
// merges a group's options with the defaults; torch 2.11 keeps a group's options as given). So
// Adam(groups{AdamOptions().weight_decay(.11)}, AdamOptions().lr(2e-3)) gives that group lr 2e-3, and an
// SGDOptions(0.01) group under SGDOptions(1e-3).momentum(0.9) gets momentum 0.9. LibTorch tells a set option by
// comparing it with the constructor's value, so there a group that sets weight_decay(0) (or, here, FP32 moments
// under 8-bit defaults) gets the default; ampkit records the setter instead (AMPKIT_OPTION), so the group keeps
// what it set, as in Python. lr and lr_tensor are one option, the learning rate: a group setting either takes
// neither from the defaults. An lr_tensor taken from the defaults is the defaults' tensor itself, shared, as
// torch.optim shares a tensor lr between groups that inherit it.
template <typename Options>
void merge_group_options(std::vector<torch::optim::OptimizerParamGroup>& added, size_t first,
                         const std::vector<torch::optim::OptimizerParamGroup>& groups, const Options& defaults) {
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!groups[i].has_options()) {
      continue;
    }
    const auto& own = static_cast<const Options&>(groups[i].options());
    auto merged = std::make_unique<Options>(defaults);
    Options::for_each_option([&](const char*, auto value, auto set, OptionArchive) {
      if (own.*set) {
        (*merged).*value = own.*value;
        (*merged).*set = true;
      }
    });
    if (own.lr_is_set() || own.lr_tensor_is_set()) {  // the learning rate is the group's: both of its spellings
      merged->lr(own.lr());
      merged->lr_tensor(own.lr_tensor());
    }
    added.at(first + i).set_options(std::move(merged));
  }
}

// The options a LibTorch archive lacks (ampkit's: OptionArchive::kOptional), from this optimizer's defaults.
template <typename Options>
void take_defaults_libtorch_lacks(Options& o, const Options& d) {
  Options::for_each_option([&](const char*, auto value, auto, OptionArchive archive) {
    if (archive == OptionArchive::kOptional) {
      o.*value = d.*value;
    }
  });
}

// An option into an archive, as torch::optim::serialize writes LibTorch's (ampkit's own types by their writers).
template <typename T>
void write_option(torch::serialize::OutputArchive& archive, const char* name, const T& value) {
  archive.write(name, c10::IValue(value));
}
void write_option(torch::serialize::OutputArchive& archive, const char*, MasterWeights value) {
  write_master_weights(archive, value);
}
void write_option(torch::serialize::OutputArchive& archive, const char* name, at::ScalarType value) {
  write_state_dtype(archive, name, value);
}
void write_option(torch::serialize::OutputArchive& archive, const char*, const at::Tensor& value) {
  write_lr_tensor(archive, value);
}

// A required option (LibTorch's: an archive without it is refused, naming `options`), or an optional one (ampkit's:
// left as it is where the archive lacks it).
void read_required_option(torch::serialize::InputArchive& archive, const char* options, const char* name,
                          double& value) {
  value = read_double(archive, options, name);
}
void read_required_option(torch::serialize::InputArchive& archive, const char* options, const char* name, bool& value) {
  value = read_bool(archive, options, name);
}
void read_required_option(torch::serialize::InputArchive& archive, const char* options, const char*,
                          std::tuple<double, double>& value) {
  value = read_betas(archive, options);
}
void read_optional_option(torch::serialize::InputArchive& archive, const char* name, bool& value) {
  read_optional_flag(archive, name, value);
}
void read_optional_option(torch::serialize::InputArchive& archive, const char*, MasterWeights& value) {
  read_master_weights(archive, value);
}
void read_optional_option(torch::serialize::InputArchive& archive, const char* name, at::ScalarType& value) {
  read_state_dtype(archive, name, value);
}
void read_optional_option(torch::serialize::InputArchive& archive, const char*, at::Tensor& value) {
  read_lr_tensor(archive, value);
}

// Every option into the archive, in row order (NOTE [Optimizer option table]).
template <typename Options>
void write_options(torch::serialize::OutputArchive& archive, const Options& o) {
  Options::for_each_option(
      [&](const char* name, auto value, auto, OptionArchive) { write_option(archive, name, o.*value); });
}

// Every option from the archive: LibTorch's (NOTE [LibTorch archives]), marked set as their setters mark them, then
// ampkit's.
template <typename Options>
void read_options(torch::serialize::InputArchive& archive, Options& o) {
  Options::for_each_option([&](const char* name, auto value, auto set, OptionArchive kind) {
    using T = std::decay_t<decltype(o.*value)>;
    if (kind == OptionArchive::kRequired) {
      if constexpr (std::is_same_v<T, double> || std::is_same_v<T, bool> ||
                    std::is_same_v<T, std::tuple<double, double>>) {
        read_required_option(archive, Options::kOptionsName, name, o.*value);
        o.*set = true;
      } else {
        TORCH_INTERNAL_ASSERT(false, "option ", name, " cannot be a required one");
      }
    } else {
      if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::tuple<double, double>>) {
        TORCH_INTERNAL_ASSERT(false, "option ", name, " cannot be an optional one");
      } else {
        read_optional_option(archive, name, o.*value);
      }
    }
  });
}

// The entries of a LibTorch param state (for_each_entry) paired with the core's entries of the same name, found once.
template <typename State>
const std::vector<std::pair<at::Tensor State::*, core::ParamState::Field>>& entry_map() {
  static const auto map = [] {
    std::vector<std::pair<at::Tensor State::*, core::ParamState::Field>> m;
    State::for_each_entry([&](const char* name, at::Tensor State::*member) {
      for (const auto& [core_name, field] : core::ParamState::fields()) {
        if (std::strcmp(core_name, name) == 0) {
          m.emplace_back(member, field);
        }
      }
    });
    return m;
  }();
  return map;
}

// A LibTorch param state's entries as the core names them (and back).
template <typename State>
core::ParamState to_core(const State& s) {
  core::ParamState c;
  for (const auto& [member, field] : entry_map<State>()) {
    c.*field = s.*member;
  }
  return c;
}

template <typename State>
void from_core(const core::ParamState& c, State& s) {
  for (const auto& [member, field] : entry_map<State>()) {
    s.*member = c.*field;
  }
}

// A param state's entries into an archive and back, as torch::optim::serialize's TORCH_ARG macros do (absent
// entries are not written; entries an archive lacks are left as they are), with the step as an int64, as LibTorch's
// (NOTE [LibTorch archives]).
template <typename State>
void write_entries(torch::serialize::OutputArchive& archive, const State& s) {
  State::for_each_entry([&](const char* name, at::Tensor State::*member) {
    if (std::strcmp(name, "step") == 0) {
      write_step(archive, s.*member);
    } else if ((s.*member).defined()) {
      archive.write(name, c10::IValue(s.*member));
    }
  });
}

template <typename State>
void read_entries(torch::serialize::InputArchive& archive, const char* state_name, State& s) {
  State::for_each_entry([&](const char* name, at::Tensor State::*member) {
    if (std::strcmp(name, "step") == 0) {
      s.*member = read_step(archive, state_name);
      return;
    }
    c10::IValue value;
    if (archive.try_read(name, value)) {
      s.*member = value.toTensor();
    }
  });
}

using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

// The loss closure of torch::optim::Optimizer::step, run with grad enabled (as LibTorch's optimizers do).
at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) {
    return {};
  }
  const at::AutoGradMode enable_grad(true);
  return closure();
}

}  // namespace

bool detail::same_value(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) {
    return a.defined() == b.defined();
  }
  return a.scalar_type() == b.scalar_type() && a.device() == b.device() && a.sizes().equals(b.sizes()) &&
         at::equal(a, b);
}

std::optional<at::Tensor> ScaledStep::grad_scale() const {
  return grad_scale_.defined() ? std::optional<at::Tensor>(grad_scale_) : std::nullopt;
}

std::optional<at::Tensor> ScaledStep::found_inf() const {
  return found_inf_.defined() ? std::optional<at::Tensor>(found_inf_) : std::nullopt;
}

// ---- FusedOptimizer ---------------------------------------------------------------------------------------------

template <class Derived, class Options, class State>
FusedOptimizer<Derived, Options, State>::FusedOptimizer(
    const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<Options>(defaults)) {
  core::check_config(Derived::config(defaults));
  check_group_options<Options>(Derived::kName, 0, param_groups);
  merge_group_options(param_groups_, 0, param_groups, static_cast<const Options&>(*defaults_));
}

template <class Derived, class Options, class State>
void FusedOptimizer<Derived, Options, State>::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  check_group_options<Options>(Derived::kName, param_groups_.size(), {param_group});
  torch::optim::Optimizer::add_param_group(param_group);
  merge_group_options(param_groups_, param_groups_.size() - 1, {param_group}, static_cast<const Options&>(*defaults_));
}

// One step of every group through the core's policy (NOTE [The policy across groups]): every group is checked
// before the first one is written; states are created for the params the core gives state to (an SGD param without
// momentum or master gets none).
template <class Derived, class Options, class State>
at::Tensor FusedOptimizer<Derived, Options, State>::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  const at::NoGradGuard no_grad;
  std::vector<std::vector<core::ParamState>> cores(param_groups_.size());
  std::vector<core::GroupStep> groups(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    groups[g].config = Derived::config(static_cast<const Options&>(param_groups_[g].options()));
    groups[g].params = params;
    cores[g].resize(params.size());
    groups[g].states.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto it = state_.find(params[i].unsafeGetTensorImpl());
      if (it != state_.end()) {
        cores[g][i] = to_core(static_cast<const State&>(*it->second));
      }
      groups[g].states[i] = &cores[g][i];
    }
  }
  const at::Tensor norm = core::step_groups(groups, grad_scale(), found_inf());
  static_cast<Derived&>(*this).stepped(norm);
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (cores[g][i].empty()) {
        continue;
      }
      auto& slot = state_[params[i].unsafeGetTensorImpl()];
      if (!slot) {
        slot = std::make_unique<State>();
      }
      from_core(cores[g][i], static_cast<State&>(*slot));
    }
  }
  return loss;
}

template <class Derived, class Options, class State>
void FusedOptimizer<Derived, Options, State>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<State, Options>(archive, *this);
}

// All or nothing: the options and states are checked by the core, states of fused params kept FP32
// (torch::optim::serialize restores them as saved); on any error the optimizer's options and states are put back.
template <class Derived, class Options, class State>
void FusedOptimizer<Derived, Options, State>::load(torch::serialize::InputArchive& archive) {
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> saved_options;
  for (const auto& group : param_groups_) {
    saved_options.push_back(group.options().clone());
  }
  StateMap saved_states;
  for (const auto& [key, value] : state_) {
    saved_states[key] = value->clone();
  }
  try {
    c10::IValue version;
    const bool has_version = archive.try_read("pytorch_version", version);
    TORCH_CHECK_VALUE(has_version && version.isString() && version.toStringRef() == "1.5.0",
                      "ampkit::optim::", Derived::kName,
                      "::load: the archive must hold 'pytorch_version' = \"1.5.0\" (torch::optim::serialize's "
                      "format, which LibTorch 1.5 and later and ampkit write), but ",
                      has_version ? "it holds " + version.tagKind() + " " + c10::str(version) : "it has none");
    torch::optim::serialize<State, Options>(archive, *this);
    const std::vector<bool> libtorch = groups_written_by_libtorch(archive);
    for (size_t i = 0; i < param_groups_.size() && i < libtorch.size(); ++i) {
      if (libtorch[i]) {
        take_defaults_libtorch_lacks(static_cast<Options&>(param_groups_[i].options()),
                                     static_cast<const Options&>(defaults()));
      }
    }
    size_t index = 0;
    for (const auto& group : param_groups_) {
      const core::GroupConfig config = Derived::config(static_cast<const Options&>(group.options()));
      core::check_config(config);
      for (const auto& p : group.params()) {
        const auto it = state_.find(p.unsafeGetTensorImpl());
        const std::string where = "state[" + std::to_string(index++) + "]";
        if (it == state_.end() || !core::takes_fused(p, p)) {
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
          *c.entry(name) = core::loaded_entry(config, name, value, p);
        }
        from_core(c, static_cast<State&>(*it->second));
      }
    }
  } catch (...) {
    for (size_t i = 0; i < param_groups_.size() && i < saved_options.size(); ++i) {
      param_groups_[i].set_options(std::move(saved_options[i]));
    }
    state_ = std::move(saved_states);
    throw;
  }
}

template <class Derived, class Options, class State>
void FusedOptimizer<Derived, Options, State>::init_master_params() {
  const at::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    if (!core::takes_master(Derived::config(static_cast<const Options&>(group.options())))) {
      continue;
    }
    for (const auto& p : group.params()) {
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        slot = std::make_unique<State>();
      }
      core::ParamState c = to_core(static_cast<const State&>(*slot));
      core::init_master(p, c);
      from_core(c, static_cast<State&>(*slot));
    }
  }
}

// ---- Adam / AdamW -------------------------------------------------------------------------------------------------

template <bool kDecoupled>
void AdamOptionsT<kDecoupled>::serialize(torch::serialize::OutputArchive& archive) const {
  write_options(archive, *this);
}

template <bool kDecoupled>
void AdamOptionsT<kDecoupled>::serialize(torch::serialize::InputArchive& archive) {
  read_options(archive, *this);
}

void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const { write_entries(archive, *this); }

void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  read_entries(archive, "AdamParamState", *this);
}

// The config of a group's options: each row's field (NOTE [Optimizer option table]); a PY_ROW's value is its
// default (the type's: AdamW's decoupled weight decay).
#define AMPKIT_CONFIG_FIELD(T, name, default_, archive, python, field) c.field = o.name();
#define AMPKIT_CONFIG_PY_FIELD(T, name, default_, field) c.field = default_;

template <bool kDecoupled>
core::GroupConfig AdamT<kDecoupled>::config(const Options& o) {
  core::GroupConfig c;
  c.optimizer = kName;
  c.algorithm = core::Algorithm::kAdam;
  AMPKIT_ADAM_OPTIONS(AMPKIT_CONFIG_FIELD, AMPKIT_CONFIG_PY_FIELD)
  return c;
}

template struct AdamOptionsT<false>;
template struct AdamOptionsT<true>;
template class FusedOptimizer<AdamT<false>, AdamOptionsT<false>, AdamParamState>;
template class FusedOptimizer<AdamT<true>, AdamOptionsT<true>, AdamParamState>;
template class AdamT<false>;
template class AdamT<true>;

// ---- SGD ------------------------------------------------------------------------------------------------------

void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const { write_options(archive, *this); }

void SGDOptions::serialize(torch::serialize::InputArchive& archive) { read_options(archive, *this); }

void SGDParamState::serialize(torch::serialize::OutputArchive& archive) const { write_entries(archive, *this); }

void SGDParamState::serialize(torch::serialize::InputArchive& archive) {
  read_entries(archive, "SGDParamState", *this);
}

core::GroupConfig SGD::config(const SGDOptions& o) {
  core::GroupConfig c;
  c.optimizer = kName;
  c.algorithm = core::Algorithm::kSGD;
  AMPKIT_SGD_OPTIONS(AMPKIT_CONFIG_FIELD, AMPKIT_CONFIG_PY_FIELD)
  return c;
}

void SGD::save(torch::serialize::OutputArchive& archive) const {
  // torch::optim::serialize's layout, without the states that equal no state: a momentum buffer that no step has
  // filled (step 0: the first step was skipped on an overflow) and no master. LibTorch takes any buffer it finds as
  // filled; with none it starts the buffer from the grad, as ampkit does at step 0 (NOTE [LibTorch archives]).
  StateMap kept;
  for (const auto& [key, value] : state_) {
    const auto& s = static_cast<const SGDParamState&>(*value);
    const bool unfilled = s.step().defined() && s.step().item<double>() == 0.0 && !s.master_param().defined() &&
                          !s.param_remainder().defined() && !s.kahan_comp().defined() && !s.sr_seed().defined();
    if (!unfilled) {
      kept[key] = value->clone();
    }
  }
  archive.write("pytorch_version", c10::IValue("1.5.0"));
  torch::serialize::OutputArchive state_archive(archive.compilation_unit());
  torch::optim::detail::serialize<SGDParamState>(state_archive, kept);
  archive.write("state", state_archive);
  torch::serialize::OutputArchive groups_archive(archive.compilation_unit());
  torch::optim::detail::serialize<SGDOptions>(groups_archive, param_groups_);
  archive.write("param_groups", groups_archive);
}

template class FusedOptimizer<SGD, SGDOptions, SGDParamState>;

// ---- LAMB -----------------------------------------------------------------------------------------------------

void LAMBOptions::serialize(torch::serialize::OutputArchive& archive) const { write_options(archive, *this); }

void LAMBOptions::serialize(torch::serialize::InputArchive& archive) { read_options(archive, *this); }

core::GroupConfig LAMB::config(const LAMBOptions& o) {
  core::GroupConfig c;
  c.optimizer = kName;
  c.algorithm = core::Algorithm::kLamb;
  AMPKIT_LAMB_OPTIONS(AMPKIT_CONFIG_FIELD, AMPKIT_CONFIG_PY_FIELD)
  c.write_unscaled_grads = false;  // LAMB only reads the grads
  return c;
}

void LAMB::stepped(const at::Tensor& grad_norm) {
  if (grad_norm.defined()) {
    last_grad_norm_ = grad_norm;
  }
}

template class FusedOptimizer<LAMB, LAMBOptions, AdamParamState>;

}  // namespace ampkit::optim
