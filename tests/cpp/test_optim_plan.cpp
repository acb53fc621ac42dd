// ampkit::optim::core's step plan (the decisions the eager step follows and a compiled step asks for), the rule
// that lets a binding borrow state entries (may_replace_entries), BorrowedStates, and make_optim_state, the one
// place fused state entries are created.
#include "support/catch_torch.h"

#include <string>
#include <vector>

#include "csrc/optim/borrowed_tensors.h"
#include "support/test_helpers.h"

namespace core = ampkit::optim::core;
using ampkit::optim::MasterWeights;

namespace {

core::GroupConfig config(core::Algorithm algorithm, MasterWeights mw = MasterWeights()) {
  core::GroupConfig c;
  c.algorithm = algorithm;
  c.optimizer = algorithm == core::Algorithm::kSGD ? "SGD" : algorithm == core::Algorithm::kLamb ? "LAMB" : "Adam";
  c.lr = 1e-2;
  c.master_weights = mw;
  if (algorithm == core::Algorithm::kSGD) {
    c.momentum = 0.9;
  }
  return c;
}

at::Tensor with_grad(at::Tensor p) {
  p.mutable_grad() = at::randn_like(p);
  return p;
}

}  // namespace

TEST_CASE("optim core: plan_step names each parameter's path, state entries and fused calls", "[optim][cpu]") {
  torch::manual_seed(3);
  core::GroupConfig c = config(core::Algorithm::kAdam);
  c.amsgrad = true;
  const at::Tensor bf16 = with_grad(at::randn({4, 3}).to(at::kBFloat16));
  const at::Tensor fp32 = with_grad(at::randn({5}));
  const at::Tensor fp64 = with_grad(at::randn({2}, at::kDouble));
  const at::Tensor frozen = at::randn({3});  // no grad: not planned
  // channels_last with a contiguous grad: fused, through a staging copy
  at::Tensor conv = at::randn({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  conv.mutable_grad() = at::randn({2, 3, 4, 5});
  const std::vector<at::Tensor> params{bf16, fp32, fp64, frozen, conv};
  core::ParamState loaded;  // an O2 state: only the master
  loaded.master_param = bf16.to(at::kFloat);
  const std::vector<const core::ParamState*> states{&loaded, nullptr, nullptr, nullptr, nullptr};

  const core::StepPlan plan = core::plan_step(c, params, states);
  REQUIRE(plan.params.size() == 4);
  CHECK(plan.params[0].index == 0);
  CHECK(plan.params[0].mode == core::MasterMode::kMaster);
  CHECK(core::StepPlan::entry_names(plan.params[0].missing) ==
        std::vector<std::string>{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"});
  CHECK(plan.params[1].mode == core::MasterMode::kNone);
  CHECK(core::StepPlan::entry_names(plan.params[1].missing).size() == 4);
  CHECK_FALSE(plan.params[2].fused);  // FP64: torch.optim's single-tensor path
  CHECK(plan.params[3].index == 4);
  CHECK(plan.params[3].fused);
  CHECK(plan.params[3].staged);
  REQUIRE(plan.buckets.size() == 2);  // (cpu, master) and (cpu, none), in order of first appearance
  CHECK(plan.buckets[0].mode == core::MasterMode::kMaster);
  CHECK(plan.buckets[0].params == std::vector<size_t>{0});
  CHECK(plan.buckets[1].params == std::vector<size_t>{1, 3});
  CHECK(core::StepPlan::entry_names(plan.buckets[0].reads) ==
        std::vector<std::string>{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"});

  SECTION("explicit grads replace the parameters' own (a trace's layouts)") {
    const std::vector<at::Tensor> grads{at::Tensor(), fp32.grad(), at::Tensor(), at::Tensor(),
                                        at::empty_like(conv)};  // a channels_last grad: no staging
    const core::StepPlan traced = core::plan_step(c, params, states, grads);
    REQUIRE(traced.params.size() == 2);
    CHECK(traced.params[0].index == 1);
    CHECK_FALSE(traced.params[1].staged);
  }
  SECTION("SGD: a momentum buffer loaded from torch.optim starts at step 1; without momentum nothing is created") {
    core::ParamState sgd_state;
    sgd_state.momentum_buffer = at::zeros({5});
    const core::StepPlan sgd = core::plan_step(config(core::Algorithm::kSGD), {fp32}, {&sgd_state});
    CHECK(core::StepPlan::entry_names(sgd.params[0].missing) == std::vector<std::string>{"step"});
    CHECK(sgd.params[0].first_step == 1.0);
    core::GroupConfig plain = config(core::Algorithm::kSGD);
    plain.momentum = 0;
    const core::StepPlan none = core::plan_step(plain, {fp32}, {nullptr});
    CHECK(none.params[0].missing == 0);
    CHECK(none.buckets[0].reads == 0);
  }
  SECTION("remainder mode derives the remainder from a loaded master") {
    const core::StepPlan rem =
        core::plan_step(config(core::Algorithm::kAdam, MasterWeights::remainder()), {bf16}, {&loaded});
    CHECK(rem.params[0].remainder_from_master);
    CHECK((rem.params[0].missing & core::ParamState::kParamRemainder) == 0);
  }
  SECTION("a bad group is refused by the plan, as by the step") {
    core::GroupConfig bad = c;
    bad.lr = -1;
    CHECK_THROWS_WITH(core::plan_step(bad, params, states), Catch::Contains("Invalid learning rate: -1.0"));
    CHECK_THROWS_WITH(core::plan_step(c, params, {nullptr}), Catch::Contains("5 parameters but 1 states"));
  }
  SECTION("each planned parameter carries the grad its checks read") {
    CHECK(plan.params[0].grad == &bf16.grad());
    CHECK(plan.params[3].grad == &conv.grad());
    const std::vector<at::Tensor> grads{at::Tensor(), fp32.grad(), at::Tensor(), at::Tensor(), at::empty_like(conv)};
    const core::StepPlan traced = core::plan_step(c, params, states, grads);
    CHECK(traced.params[0].grad == &grads[1]);
    CHECK(traced.params[1].grad == &grads[4]);
  }
  SECTION("a check error of any parameter comes before a partial single-tensor state of an earlier one") {
    core::GroupConfig plain = config(core::Algorithm::kAdam);
    core::ParamState partial;  // torch.optim's format without exp_avg_sq
    partial.step = at::zeros({});
    partial.exp_avg = at::zeros({2}, at::kDouble);
    at::Tensor wrong = at::randn({3});
    wrong.mutable_grad() = at::randn({4});  // not the parameter's shape
    CHECK_THROWS_WITH(core::plan_step(plain, {fp64, wrong}, {&partial, nullptr}),
                      Catch::Contains("a parameter of shape [3] has a grad of shape [4]"));
    CHECK_THROWS_WITH(core::plan_step(plain, {fp64, fp32}, {&partial, nullptr}),
                      Catch::Contains("the state of params[0] has only some of step, exp_avg and exp_avg_sq"));
  }
}

TEST_CASE("optim core: a step assigns over an existing entry only where may_replace_entries says so", "[optim][cpu]") {
  torch::manual_seed(4);
  for (const auto algorithm : {core::Algorithm::kAdam, core::Algorithm::kSGD, core::Algorithm::kLamb}) {
    for (const MasterWeights mw :
         {MasterWeights(), MasterWeights(true), MasterWeights(false), MasterWeights::remainder()}) {
      const core::GroupConfig c = config(algorithm, mw);
      const at::Tensor p = with_grad(at::randn({6}).to(at::kBFloat16));
      // Partial states as loaded from torch.optim or after init_master: the master alone, or moments alone.
      core::ParamState s;
      s.master_param = p.to(at::kFloat);
      if (algorithm == core::Algorithm::kSGD) {
        s.momentum_buffer = at::zeros({6});
      }
      std::vector<const c10::TensorImpl*> before;
      for (const auto& [name, field] : core::ParamState::fields()) {
        before.push_back((s.*field).defined() ? (s.*field).unsafeGetTensorImpl() : nullptr);
      }
      core::step(c, {p}, {&s});
      bool replaced = false;
      size_t k = 0;
      for (const auto& [name, field] : core::ParamState::fields()) {
        const at::Tensor& now = s.*field;
        replaced |= before[k] != nullptr && (!now.defined() || now.unsafeGetTensorImpl() != before[k]);
        ++k;
      }
      INFO("algorithm " << static_cast<int>(algorithm) << ", master_weights " << mw.name());
      CHECK(replaced == core::may_replace_entries(c));  // remainder mode: the master became the remainder
    }
  }
}

TEST_CASE("optim core: BorrowedStates borrows without a reference and steps like referenced states", "[optim][cpu]") {
  torch::manual_seed(5);
  const core::GroupConfig c = config(core::Algorithm::kAdam);
  const at::Tensor p1 = with_grad(at::randn({7}).to(at::kBFloat16));
  const at::Tensor p2 = p1.detach().clone();
  p2.mutable_grad() = p1.grad().clone();
  const at::Tensor master = p1.to(at::kFloat);
  const at::Tensor exp_avg = at::rand({7});
  const auto uses = master.use_count();
  core::ParamState referenced;
  referenced.master_param = master.clone();
  referenced.exp_avg = exp_avg.clone();
  {
    core::BorrowedStates states(1, !core::may_replace_entries(c));
    states.set(0, 5, master, /*borrowable=*/true);    // master_param
    states.set(0, 1, exp_avg, /*borrowable=*/false);  // exp_avg: referenced
    CHECK(states.borrowed(0, 5));
    CHECK_FALSE(states.borrowed(0, 1));
    CHECK(master.use_count() == uses);  // no reference taken
    CHECK(states.before(0, 0) == nullptr);
    core::step(c, {p1}, states.pointers());
    CHECK(states[0].exp_avg_sq.defined());  // created: an entry the state lacked
    CHECK(states.before(0, 2) == nullptr);
    core::step(c, {p2}, {&referenced});
    CHECK(ampkit::test::bits_equal(p1, p2));
    CHECK(ampkit::test::bits_equal(master, referenced.master_param));  // updated in place through the borrow
    CHECK(ampkit::test::bits_equal(states[0].exp_avg, referenced.exp_avg));
    CHECK(ampkit::test::bits_equal(states[0].exp_avg_sq, referenced.exp_avg_sq));
  }
  CHECK(master.use_count() == uses);  // given back unreferenced
}

TEST_CASE("optim core: plan_step's look-ahead (metadata prefetch) changes no error, warning or plan", "[optim][cpu]") {
  torch::manual_seed(11);
  const core::GroupConfig c = config(core::Algorithm::kAdam);
  std::vector<at::Tensor> params;
  for (int i = 0; i < 16; ++i) {
    params.push_back(with_grad(at::randn({3 + i % 3})));
  }
  const std::vector<const core::ParamState*> none(params.size(), nullptr);
  SECTION("an undefined parameter and a non-leaf one without a grad, within reach of the look-ahead") {
    // Read ahead from params[1] on; planned in their turn: a bad grad at params[7], which the look-ahead passes
    // params[9] on the way to, is still the error raised; then what the undefined parameter gives on its own (an
    // error or none), as a plan of it alone gives it.
    params[5] = torch::randn({3}, torch::requires_grad()).mul(2);  // non-leaf, no grad: Tensor::grad() warns
    params[9] = at::Tensor();
    params[7].mutable_grad() = at::randn({7});
    CHECK_THROWS_WITH(core::plan_step(c, params, none), Catch::Contains("a parameter of shape [4] has a grad of "
                                                                        "shape [7]"));
    params[7].mutable_grad() = at::randn_like(params[7]);
    const auto outcome = [&](const std::vector<at::Tensor>& list) {
      try {
        return "planned " +
               std::to_string(
                   core::plan_step(c, list, std::vector<const core::ParamState*>(list.size(), nullptr)).params.size());
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
    };
    const std::string undefined_alone = outcome({params[9]});
    const std::string all = outcome(params);
    INFO(undefined_alone << " / " << all);
    CHECK((undefined_alone.rfind("planned", 0) == 0 ? all == "planned 14" : all == undefined_alone));
    struct Warnings : c10::WarningHandler {
      int count = 0;
      c10::WarningUtils::WarningHandlerGuard guard{this};
      void process(const c10::Warning&) override { ++count; }
    };
    params[9] = with_grad(at::randn({3}));
    const std::vector<at::Tensor> alone{params[5]};
    int expected = 0;
    {
      Warnings w;
      CHECK(core::plan_step(c, alone, {nullptr}).params.empty());
      expected = w.count;
      CHECK(expected == 1);
    }
    Warnings w;
    const core::StepPlan plan = core::plan_step(c, params, none);
    INFO("expected " << expected << " got " << w.count);
    CHECK(w.count == expected);  // the look-ahead read params[5]'s grad without Tensor::grad()'s warning
    REQUIRE(plan.params.size() == 15);
    CHECK(plan.params[4].index == 4);
    CHECK(plan.params[5].index == 6);  // params[5] has no grad: not planned
  }
  SECTION("grads given as a list: an undefined grad ahead is skipped in its turn, as without the look-ahead") {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) {
      grads.push_back(p.grad());
    }
    grads[7] = at::Tensor();
    const core::StepPlan plan = core::plan_step(c, params, none, grads);
    REQUIRE(plan.params.size() == 15);
    CHECK(plan.params[7].index == 8);
  }
}
