// ampkit::optim's param groups and options as LibTorch's own: a group carrying options takes the optimizer's
// defaults for every option it does not set (NOTE [Group options] in csrc/optim/optim.cpp), as torch::optim's
// optimizers do since torch 2.13 (checked side by side where the torch built against has that rule; ampkit also
// keeps an option set to its constructor's value, as Python does), and options and param states compare with
// operator== as LibTorch's do.
#include "support/catch_torch.h"

#include <torch/version.h>

#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "support/libtorch_compare.h"

namespace {

using torch::optim::OptimizerParamGroup;

// LibTorch's optimizers fill a group's unset options from the defaults since torch 2.13 (2.11 keeps the group's
// options as given).
constexpr bool kTorchMergesGroups = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13);

template <typename Options>
std::unique_ptr<torch::optim::OptimizerOptions> own(const Options& o) {
  return std::make_unique<Options>(o);
}

template <typename Options>
const Options& options_of(torch::optim::Optimizer& opt, size_t group) {
  return static_cast<const Options&>(opt.param_groups().at(group).options());
}

std::vector<at::Tensor> fresh_params(int seed, int n) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> ps;
  for (int i = 0; i < n; ++i) {
    ps.push_back(torch::randn({7 + i, 3}).requires_grad_());
  }
  return ps;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().clone().requires_grad_());
  }
  return out;
}

}  // namespace

TEST_CASE("optim groups: options a group leaves unset come from the optimizer's defaults", "[optim][cpu]") {
  auto ps = fresh_params(1, 3);
  SECTION("Adam: a weight_decay group under lr 0.002") {
    ampkit::optim::Adam opt({OptimizerParamGroup({ps[0]}, own(ampkit::optim::AdamOptions().weight_decay(.11))),
                             OptimizerParamGroup({ps[1]})},
                            ampkit::optim::AdamOptions()
                                .lr(.002)
                                .amsgrad(true)
                                .master_weights(false)
                                .exp_avg_dtype(at::kBFloat16)
                                .write_unscaled_grads(false));
    const auto& g0 = options_of<ampkit::optim::AdamOptions>(opt, 0);
    CHECK(g0.lr() == .002);
    CHECK(g0.weight_decay() == .11);
    CHECK(g0.amsgrad());
    CHECK(g0.master_weights() == ampkit::optim::MasterWeights(false));
    CHECK(g0.exp_avg_dtype() == at::kBFloat16);
    CHECK(g0.exp_avg_sq_dtype() == at::kFloat);
    CHECK_FALSE(g0.write_unscaled_grads());
    CHECK(options_of<ampkit::optim::AdamOptions>(opt, 1) ==
          static_cast<const ampkit::optim::AdamOptions&>(opt.defaults()));
    // add_param_group takes the same rule, and a group's own values win.
    opt.add_param_group(OptimizerParamGroup(
        {ps[2]},
        own(ampkit::optim::AdamOptions(.005).betas({.8, .9}).master_weights(ampkit::optim::MasterWeights::kahan()))));
    const auto& g2 = options_of<ampkit::optim::AdamOptions>(opt, 2);
    CHECK(g2.lr() == .005);
    CHECK(g2.betas() == std::make_tuple(.8, .9));
    CHECK(g2.master_weights() == ampkit::optim::MasterWeights::kahan());
    CHECK(g2.amsgrad());
    CHECK(g2.weight_decay() == 0.0);
  }
  SECTION("SGD: an SGDOptions(0.01) group under momentum 0.9") {
    ampkit::optim::SGD opt({OptimizerParamGroup({ps[0]}, own(ampkit::optim::SGDOptions(0.01))),
                            OptimizerParamGroup({ps[1]}, own(ampkit::optim::SGDOptions(0.02).momentum(0.5)))},
                           ampkit::optim::SGDOptions(0.001).momentum(0.9).nesterov(true).momentum_dtype(at::kBFloat16));
    const auto& g0 = options_of<ampkit::optim::SGDOptions>(opt, 0);
    CHECK(g0.lr() == 0.01);
    CHECK(g0.momentum() == 0.9);
    CHECK(g0.nesterov());
    CHECK(g0.momentum_dtype() == at::kBFloat16);
    const auto& g1 = options_of<ampkit::optim::SGDOptions>(opt, 1);
    CHECK(g1.lr() == 0.02);
    CHECK(g1.momentum() == 0.5);
  }
  SECTION("LAMB: the defaults' max_grad_norm and lr_tensor reach a group that sets neither") {
    const auto lr = torch::full({1}, 0.25);
    ampkit::optim::LAMB opt({OptimizerParamGroup({ps[0]}, own(ampkit::optim::LAMBOptions().weight_decay(0.0)))},
                            ampkit::optim::LAMBOptions().max_grad_norm(0.0).use_nvlamb(true).lr_tensor(lr));
    const auto& g0 = options_of<ampkit::optim::LAMBOptions>(opt, 0);
    CHECK(g0.max_grad_norm() == 0.0);
    CHECK(g0.use_nvlamb());
    CHECK(g0.weight_decay() == 0.0);
    REQUIRE(g0.lr_tensor().defined());
    CHECK(g0.lr_tensor().item<double>() == 0.25);
    const auto own_lr = torch::full({1}, 0.5);
    opt.add_param_group(OptimizerParamGroup({ps[1]}, own(ampkit::optim::LAMBOptions().lr_tensor(own_lr))));
    CHECK(options_of<ampkit::optim::LAMBOptions>(opt, 1).lr_tensor().item<double>() == 0.5);
  }
}

TEST_CASE("optim groups: an option a group sets is its own, even at its constructor's value", "[optim][cpu]") {
  auto ps = fresh_params(4, 3);
  using AO = ampkit::optim::AdamOptions;
  // LibTorch (2.13) takes these for unset, since they equal the constructor's; ampkit records the setter.
  ampkit::optim::Adam opt(
      {OptimizerParamGroup({ps[0]}, own(AO().weight_decay(0.0))),
       OptimizerParamGroup({ps[1]},
                           own(AO(1e-3).exp_avg_dtype(at::kFloat).master_weights(ampkit::optim::MasterWeights::kAuto))),
       OptimizerParamGroup({ps[2]}, own(AO().amsgrad(false)))},
      AO(2e-3)
          .weight_decay(1e-4)
          .exp_avg_dtype(at::kByte)
          .master_weights(ampkit::optim::MasterWeights::stochastic())
          .amsgrad(true));
  CHECK(options_of<AO>(opt, 0).weight_decay() == 0.0);
  CHECK(options_of<AO>(opt, 0).lr() == 2e-3);  // not set: the default
  CHECK(options_of<AO>(opt, 1).lr() == 1e-3);
  CHECK(options_of<AO>(opt, 1).exp_avg_dtype() == at::kFloat);
  CHECK(options_of<AO>(opt, 1).master_weights() == ampkit::optim::MasterWeights::kAuto);
  CHECK(options_of<AO>(opt, 1).weight_decay() == 1e-4);
  CHECK_FALSE(options_of<AO>(opt, 2).amsgrad());
  CHECK(options_of<AO>(opt, 2).exp_avg_dtype() == at::kByte);
}

TEST_CASE("optim groups: lr and lr_tensor are one option", "[optim][cpu]") {
  auto ps = fresh_params(5, 3);
  using AWO = ampkit::optim::AdamWOptions;
  const auto shared = torch::full({1}, 1e-3);
  ampkit::optim::AdamW opt({OptimizerParamGroup({ps[0]}, own(AWO(1e-5))),  // its lr, not the defaults' tensor
                            OptimizerParamGroup({ps[1]}, own(AWO().weight_decay(0.0))),
                            OptimizerParamGroup({ps[2]}, own(AWO().lr_tensor(torch::full({1}, 5e-4))))},
                           AWO().lr_tensor(shared));
  CHECK(options_of<AWO>(opt, 0).lr() == 1e-5);
  CHECK_FALSE(options_of<AWO>(opt, 0).lr_tensor().defined());
  CHECK(options_of<AWO>(opt, 1).lr_tensor().is_same(shared));  // inherited: the defaults' tensor, as in torch.optim
  CHECK(options_of<AWO>(opt, 2).lr_tensor().item<float>() == 5e-4f);
  // The group with lr 1e-5 steps by it (AdamW's first step moves each weight by about lr).
  const auto before = ps[0].detach().clone();
  ampkit::test::set_step_grads(ps, 0);
  opt.step();
  CHECK((ps[0].detach() - before).abs().max().item<double>() < 2e-5);
}

namespace {

// The options LibTorch's and ampkit's Adam/AdamW share, compared.
template <typename Theirs, typename Ours>
void same_adam_options(const Theirs& t, const Ours& o) {
  CHECK(t.lr() == o.lr());
  CHECK(t.betas() == o.betas());
  CHECK(t.eps() == o.eps());
  CHECK(t.weight_decay() == o.weight_decay());
  CHECK(t.amsgrad() == o.amsgrad());
}

template <typename Theirs, typename Ours>
void same_sgd_options(const Theirs& t, const Ours& o) {
  CHECK(t.lr() == o.lr());
  CHECK(t.momentum() == o.momentum());
  CHECK(t.dampening() == o.dampening());
  CHECK(t.weight_decay() == o.weight_decay());
  CHECK(t.nesterov() == o.nesterov());
}

// Every group of theirs (LibTorch's, options TO) and ours (ampkit's, AO) with the same options (`same`), then
// four steps of both giving the same parameters.
template <typename TO, typename AO, typename Theirs, typename Ours, typename Same>
void groups_and_steps_agree(Theirs& theirs, std::vector<at::Tensor>& tp, Ours& ours, std::vector<at::Tensor>& op,
                            const Same& same) {
  REQUIRE(theirs.param_groups().size() == ours.param_groups().size());
  for (size_t g = 0; g < theirs.param_groups().size(); ++g) {
    INFO("group " << g);
    same(options_of<TO>(theirs, g), options_of<AO>(ours, g));
  }
  ampkit::test::steps_agree(theirs, tp, ours, op, 0, 4);
}

}  // namespace

TEST_CASE("optim groups: the groups of torch::optim's Adam, AdamW and SGD and ampkit's get the same options",
          "[optim][cpu]") {
  if (!kTorchMergesGroups) {
    WARN("torch " TORCH_VERSION " keeps a group's options as given: no side-by-side comparison");
    return;
  }
  auto tp = fresh_params(2, 4);
  auto op = copies(tp);
  SECTION("Adam") {
    using TO = torch::optim::AdamOptions;
    using AO = ampkit::optim::AdamOptions;
    torch::optim::Adam theirs({OptimizerParamGroup({tp[0]}, own(TO().weight_decay(.11))),
                               OptimizerParamGroup({tp[1]}, own(TO().betas({.8, .95}))),
                               OptimizerParamGroup({tp[2]}, own(TO(.02).amsgrad(true))), OptimizerParamGroup({tp[3]})},
                              TO().lr(.002).eps(1e-6).weight_decay(0.01));
    ampkit::optim::Adam ours({OptimizerParamGroup({op[0]}, own(AO().weight_decay(.11))),
                              OptimizerParamGroup({op[1]}, own(AO().betas({.8, .95}))),
                              OptimizerParamGroup({op[2]}, own(AO(.02).amsgrad(true))), OptimizerParamGroup({op[3]})},
                             AO().lr(.002).eps(1e-6).weight_decay(0.01));
    groups_and_steps_agree<TO, AO>(theirs, tp, ours, op, [](const auto& t, const auto& o) { same_adam_options(t, o); });
  }
  SECTION("AdamW") {
    using TO = torch::optim::AdamWOptions;
    using AO = ampkit::optim::AdamWOptions;
    torch::optim::AdamW theirs(
        {OptimizerParamGroup({tp[0], tp[1]}, own(TO().weight_decay(.3))), OptimizerParamGroup({tp[2], tp[3]})},
        TO(.003).amsgrad(true));
    ampkit::optim::AdamW ours(
        {OptimizerParamGroup({op[0], op[1]}, own(AO().weight_decay(.3))), OptimizerParamGroup({op[2], op[3]})},
        AO(.003).amsgrad(true));
    groups_and_steps_agree<TO, AO>(theirs, tp, ours, op, [](const auto& t, const auto& o) { same_adam_options(t, o); });
  }
  SECTION("SGD") {
    using TO = torch::optim::SGDOptions;
    using AO = ampkit::optim::SGDOptions;
    torch::optim::SGD theirs(
        {OptimizerParamGroup({tp[0]}, own(TO(0.01))), OptimizerParamGroup({tp[1]}, own(TO(0.02).dampening(0.1))),
         OptimizerParamGroup({tp[2], tp[3]}, own(TO(0.001).weight_decay(0.05)))},
        TO(0.001).momentum(0.9));
    ampkit::optim::SGD ours(
        {OptimizerParamGroup({op[0]}, own(AO(0.01))), OptimizerParamGroup({op[1]}, own(AO(0.02).dampening(0.1))),
         OptimizerParamGroup({op[2], op[3]}, own(AO(0.001).weight_decay(0.05)))},
        AO(0.001).momentum(0.9));
    groups_and_steps_agree<TO, AO>(theirs, tp, ours, op, [](const auto& t, const auto& o) { same_sgd_options(t, o); });
  }
}

TEST_CASE("optim options and param states: operator== as LibTorch's", "[optim][cpu]") {
  SECTION("options: every option counts") {
    using AO = ampkit::optim::AdamWOptions;
    const AO base = AO(2e-3).betas({.8, .9}).amsgrad(true);
    CHECK(base == AO(2e-3).betas({.8, .9}).amsgrad(true));
    CHECK_FALSE(base == AO(2e-3).betas({.8, .9}));
    CHECK_FALSE(base == AO(2e-3).betas({.8, .9}).amsgrad(true).eps(1e-7));
    CHECK_FALSE(base == AO(base).master_weights(ampkit::optim::MasterWeights::remainder()));
    CHECK_FALSE(base == AO(base).exp_avg_sq_dtype(at::kByte));
    CHECK_FALSE(base == AO(base).write_unscaled_grads(false));
    CHECK_FALSE(base == AO(base).lr_tensor(torch::full({1}, 2e-3)));
    CHECK(AO(base).lr_tensor(torch::full({1}, 2e-3)) == AO(base).lr_tensor(torch::full({1}, 2e-3)));
    CHECK_FALSE(AO(base).lr_tensor(torch::full({1}, 2e-3)) == AO(base).lr_tensor(torch::full({1}, 3e-3)));
    using SO = ampkit::optim::SGDOptions;
    CHECK(SO(0.1).momentum(0.9) == SO(0.1).momentum(0.9));
    CHECK_FALSE(SO(0.1).momentum(0.9) == SO(0.1).momentum(0.9).nesterov(true));
    CHECK_FALSE(SO(0.1) == SO(0.1).momentum_dtype(at::kBFloat16));
    using LO = ampkit::optim::LAMBOptions;
    CHECK(LO() == LO());
    CHECK_FALSE(LO() == LO().use_nvlamb(true));
    CHECK_FALSE(LO() == LO().max_grad_norm(0.5));
  }
  SECTION("param states after steps: equal to a copy, unequal after any entry changes") {
    auto ps = fresh_params(3, 2);
    ampkit::optim::Adam opt(ps, ampkit::optim::AdamOptions().amsgrad(true));
    ampkit::test::set_step_grads(ps, 0);
    opt.step();
    const auto& state = *ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, ps[0]);
    ampkit::optim::AdamParamState c = state;
    c.exp_avg(state.exp_avg().clone()).step(state.step().clone());
    CHECK(state == c);
    c.exp_avg().view(-1)[6] += 1e-6;
    CHECK_FALSE(state == c);
    c.exp_avg(state.exp_avg());
    CHECK(state == c);
    c.max_exp_avg_sq(at::Tensor());
    CHECK_FALSE(state == c);
    CHECK_FALSE(state == *ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, ps[1]));
    ampkit::optim::SGD sgd(ps, ampkit::optim::SGDOptions(0.1).momentum(0.9));
    ampkit::test::set_step_grads(ps, 1);
    sgd.step();
    const auto& s = *ampkit::optim::state_of<ampkit::optim::SGDParamState>(sgd, ps[1]);
    ampkit::optim::SGDParamState same = s;
    CHECK(s == same);
    same.momentum_buffer(s.momentum_buffer() * 2);
    CHECK_FALSE(s == same);
  }
}

namespace {

// A value other than the row's default for every option type (NOTE [Optimizer option table]).
void change(double& v) { v += 0.0625; }
void change(bool& v) { v = !v; }
void change(std::tuple<double, double>& v) { v = std::make_tuple(std::get<0>(v) / 2, std::get<1>(v) / 4); }
void change(ampkit::optim::MasterWeights& v) {
  v = v == ampkit::optim::MasterWeights::remainder() ? ampkit::optim::MasterWeights(true)
                                                     : ampkit::optim::MasterWeights::remainder();
}
void change(at::ScalarType& v) { v = v == at::kBFloat16 ? at::kByte : at::kBFloat16; }
void change(at::Tensor& v) { v = torch::full({1}, 0.25); }

// Every row of Options changed, saved and loaded into default options: each comes back (required rows marked set,
// as their setters mark them), and a group's config holds the changed values.
template <typename Options>
void check_rows_round_trip(Options defaults) {
  Options changed = defaults;
  std::vector<std::string> names;
  Options::for_each_option([&](const char* name, auto value, auto, ampkit::optim::OptionArchive) {
    names.emplace_back(name);
    change(changed.*value);
  });
  REQUIRE(names.size() >= 10);
  torch::serialize::OutputArchive out;
  changed.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream read_back(bytes.str());
  in.load_from(read_back);
  Options loaded = defaults;
  loaded.serialize(in);
  Options::for_each_option([&](const char* name, auto value, auto set, ampkit::optim::OptionArchive archive) {
    INFO(Options::kOptionsName << "::" << name);
    CHECK(ampkit::optim::detail::same_value(loaded.*value, changed.*value));
    CHECK_FALSE(ampkit::optim::detail::same_value(loaded.*value, defaults.*value));
    CHECK((loaded.*set) == (archive == ampkit::optim::OptionArchive::kRequired));
  });
}

}  // namespace

TEST_CASE("option table: every option of every optimizer is archived, read back and configured", "[optim]") {
  using ampkit::optim::MasterWeights;
  check_rows_round_trip(ampkit::optim::AdamOptions());
  check_rows_round_trip(ampkit::optim::AdamWOptions());
  check_rows_round_trip(ampkit::optim::SGDOptions(1e-3));
  check_rows_round_trip(ampkit::optim::LAMBOptions());
  // Fields under another name than the option's, and the type's own value (AdamW's decoupled weight decay).
  const auto sgd = ampkit::optim::SGD::config(ampkit::optim::SGDOptions(0.5).momentum_dtype(at::kBFloat16));
  CHECK(sgd.exp_avg_dtype == at::kBFloat16);
  CHECK(sgd.lr == 0.5);
  const auto lamb = ampkit::optim::LAMB::config(ampkit::optim::LAMBOptions().adam_w_mode(false).betas({0.5, 0.25}));
  CHECK_FALSE(lamb.decoupled_weight_decay);
  CHECK((lamb.beta1 == 0.5 && lamb.beta2 == 0.25));
  CHECK_FALSE(lamb.write_unscaled_grads);
  CHECK(ampkit::optim::AdamW::config(ampkit::optim::AdamWOptions()).decoupled_weight_decay);
  CHECK_FALSE(ampkit::optim::Adam::config(ampkit::optim::AdamOptions()).decoupled_weight_decay);
  CHECK(ampkit::optim::AdamW::config(ampkit::optim::AdamWOptions()).weight_decay == 1e-2);
  CHECK(
      ampkit::optim::Adam::config(ampkit::optim::AdamOptions().master_weights(MasterWeights::kahan())).master_weights ==
      MasterWeights::kahan());
}
