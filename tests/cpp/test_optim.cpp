// ampkit::optim from C++: AdamW and SGD against LibTorch's on FP32, BF16 params following an FP32 run through
// their masters, the sync-free GradScaler path with skipped steps, torch::save / torch::load round trips, and what
// Adam, AdamW, SGD and LAMB take from their shared base (param groups, names in errors, constructors).
#include "support/catch_torch.h"

#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

#include "support/test_helpers.h"

using ampkit::test::bits_equal;

namespace {

std::vector<at::Tensor> make_params(at::ScalarType dtype, int seed = 0) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> ps;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{33, 17}, {17}, {5, 3, 2}, {0}, {1025}}) {
    ps.push_back(torch::randn(shape).to(dtype).requires_grad_());
  }
  return ps;
}

void set_grads(std::vector<at::Tensor>& ps, int step, at::ScalarType dtype) {
  torch::manual_seed(1000 + step);
  for (auto& p : ps) {
    p.mutable_grad() = torch::randn(p.sizes()).to(dtype);
  }
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().to(dtype, false, true).requires_grad_());
  }
  return out;
}

// Steps `opt` over ps and `loaded` over copy with the same BF16 grads for steps [first, end), then requires the
// parameters equal bit for bit: a loaded optimizer continues as the saved one does.
template <typename Optimizer>
void step_in_lockstep(Optimizer& opt, Optimizer& loaded, std::vector<at::Tensor>& ps, std::vector<at::Tensor>& copy,
                      int first, int end) {
  for (int step = first; step < end; ++step) {
    set_grads(ps, step, at::kBFloat16);
    set_grads(copy, step, at::kBFloat16);
    opt.step();
    loaded.step();
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    REQUIRE(bits_equal(ps[i].detach(), copy[i].detach()));
  }
}

}  // namespace

TEST_CASE("optim::AdamW and SGD: FP32 results follow LibTorch's optimizers", "[optim][cpu]") {
  auto ours = make_params(at::kFloat);
  auto theirs = clone_params(ours, at::kFloat);
  SECTION("AdamW with amsgrad") {
    ampkit::optim::AdamW a(ours, ampkit::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
    torch::optim::AdamW t(theirs, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
    for (int step = 0; step < 50; ++step) {
      set_grads(ours, step, at::kFloat);
      set_grads(theirs, step, at::kFloat);
      a.step();
      t.step();
    }
  }
  SECTION("SGD with momentum, dampening and weight decay") {
    ampkit::optim::SGD a(ours, ampkit::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.1).weight_decay(0.01));
    torch::optim::SGD t(theirs, torch::optim::SGDOptions(1e-2).momentum(0.9).dampening(0.1).weight_decay(0.01));
    for (int step = 0; step < 50; ++step) {
      set_grads(ours, step, at::kFloat);
      set_grads(theirs, step, at::kFloat);
      a.step();
      t.step();
    }
  }
  for (size_t i = 0; i < ours.size(); ++i) {
    REQUIRE(torch::allclose(ours[i], theirs[i], 2e-5, 2e-6));
  }
}

TEST_CASE("optim::AdamW: BF16 params keep FP32 masters that follow the FP32 run", "[optim][cpu]") {
  auto low = make_params(at::kBFloat16);
  auto full = clone_params(low, at::kFloat);
  ampkit::optim::AdamW a(low, ampkit::optim::AdamWOptions(1e-2));
  ampkit::optim::AdamW f(full, ampkit::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 30; ++step) {
    set_grads(low, step, at::kBFloat16);
    for (size_t i = 0; i < low.size(); ++i) {
      full[i].mutable_grad() = low[i].grad().to(at::kFloat);
    }
    a.step();
    f.step();
  }
  for (size_t i = 0; i < low.size(); ++i) {
    const auto& s = static_cast<ampkit::optim::AdamParamState&>(*a.state().at(low[i].unsafeGetTensorImpl()));
    REQUIRE(s.master_param().scalar_type() == at::kFloat);
    REQUIRE(torch::allclose(s.master_param(), full[i].detach(), 1e-6, 1e-7));
    REQUIRE(bits_equal(low[i].detach(), s.master_param().to(at::kBFloat16)));
  }
}

TEST_CASE("optim: FP32 grads of BF16/FP16 params step bit for bit as the FP32 run, LAMB's global clip included",
          "[optim][cpu]") {
  // NOTE [FP32 grads of low-precision params]: a LibTorch program that accumulates FP32 grads for its BF16 weights
  // (mutable_grad(), or torch's grad_dtype) gets the FP32 run's masters, moments and rounded weights.
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    auto low = make_params(dtype, 3);
    auto full = clone_params(low, at::kFloat);
    ampkit::optim::AdamW a(low, ampkit::optim::AdamWOptions(1e-2).weight_decay(0.1));
    ampkit::optim::AdamW f(full, ampkit::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto low_lamb = clone_params(low, dtype);
    auto full_lamb = clone_params(low, at::kFloat);
    ampkit::optim::LAMB l(low_lamb, ampkit::optim::LAMBOptions(1e-2).max_grad_norm(0.5));
    ampkit::optim::LAMB fl(full_lamb, ampkit::optim::LAMBOptions(1e-2).max_grad_norm(0.5));
    for (int step = 0; step < 3; ++step) {
      set_grads(full, step, at::kFloat);
      set_grads(full_lamb, step, at::kFloat);
      for (size_t i = 0; i < low.size(); ++i) {
        low[i].mutable_grad() = full[i].grad().clone();
        low_lamb[i].mutable_grad() = full_lamb[i].grad().clone();
      }
      a.step();
      f.step();
      l.step();
      fl.step();
    }
    for (size_t i = 0; i < low.size(); ++i) {
      INFO("dtype " << dtype << ", param " << i);
      const auto& s = static_cast<ampkit::optim::AdamParamState&>(*a.state().at(low[i].unsafeGetTensorImpl()));
      REQUIRE(low[i].grad().scalar_type() == at::kFloat);
      REQUIRE(bits_equal(s.master_param(), full[i].detach()));
      REQUIRE(bits_equal(low[i].detach(), full[i].detach().to(dtype)));
      REQUIRE(bits_equal(low_lamb[i].detach(), full_lamb[i].detach().to(dtype)));
    }
  }
}

TEST_CASE("optim + GradScaler: sync-free steps equal an unscaled run, overflow steps change nothing",
          "[optim][scaler][cpu]") {
  torch::manual_seed(0);
  torch::nn::Linear model(8, 4);
  torch::nn::Linear ref(8, 4);
  {
    const torch::NoGradGuard no_grad;
    ref->weight.copy_(model->weight);
    ref->bias.copy_(model->bias);
  }
  ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-2));
  ampkit::optim::AdamW ref_opt(ref->parameters(), ampkit::optim::AdamWOptions(1e-2));
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(256.0).growth_interval(3));
  for (int step = 0; step < 12; ++step) {
    const auto x = torch::randn({16, 8});
    opt.zero_grad();
    scaler.scale(model(x).square().mean()).backward();
    const bool overflow = step == 0 || step == 5;  // the very first step too
    if (overflow) {
      model->bias.mutable_grad()[1] = std::numeric_limits<float>::infinity();
    }
    const auto before = model->weight.detach().clone();
    scaler.step(opt);
    scaler.update();
    if (overflow) {
      REQUIRE(bits_equal(model->weight.detach(), before));
      REQUIRE_FALSE(scaler.last_step_ran().item<bool>());
      continue;
    }
    ref_opt.zero_grad();
    ref(x).square().mean().backward();
    ref_opt.step();
    REQUIRE(bits_equal(model->weight.detach(), ref->weight.detach()));
    REQUIRE(bits_equal(model->bias.detach(), ref->bias.detach()));
  }
  CHECK(scaler.stats().skipped_steps == 2);
}

TEST_CASE("optim: torch::save / torch::load round trip continues bit-identically", "[optim][cpu]") {
  auto ps = make_params(at::kBFloat16);
  ampkit::optim::AdamW opt(ps, ampkit::optim::AdamWOptions(1e-2).amsgrad(true));
  for (int step = 0; step < 3; ++step) {
    set_grads(ps, step, at::kBFloat16);
    opt.step();
  }
  const std::string path = "ampkit_test_adamw.pt";
  torch::save(opt, path);
  auto copy = clone_params(ps, at::kBFloat16);
  ampkit::optim::AdamW loaded(copy, ampkit::optim::AdamWOptions(1.0));
  torch::load(loaded, path);
  std::remove(path.c_str());
  CHECK(static_cast<const ampkit::optim::AdamWOptions&>(loaded.param_groups()[0].options()).lr() == 1e-2);
  step_in_lockstep(opt, loaded, ps, copy, 3, 6);
}

TEST_CASE("optim: bad options and mismatched grads raise", "[optim][cpu]") {
  auto ps = make_params(at::kFloat);
  REQUIRE_THROWS_WITH(ampkit::optim::AdamW(ps, ampkit::optim::AdamWOptions(-1.0)),
                      Catch::Contains("Invalid learning rate"));
  REQUIRE_THROWS_WITH(ampkit::optim::SGD(ps, ampkit::optim::SGDOptions(0.1).nesterov(true)),
                      Catch::Contains("Nesterov momentum requires"));
  ampkit::optim::AdamW opt(ps, ampkit::optim::AdamWOptions(1e-2));
  set_grads(ps, 0, at::kFloat);
  ps[2].mutable_grad() = ps[2].grad().to(at::kDouble);
  const auto before = ps[0].detach().clone();
  REQUIRE_THROWS_WITH(opt.step(), Catch::Contains("grads[2] must be Float"));
  CHECK(bits_equal(ps[0].detach(), before));
}

TEST_CASE("optim: a step that raises for one param group writes and creates nothing in the others", "[optim][cpu]") {
  auto a = torch::randn({8}).to(torch::kHalf).requires_grad_();
  auto b = torch::randn({8}).to(torch::kHalf).requires_grad_();
  ampkit::optim::AdamW opt({torch::optim::OptimizerParamGroup({a}), torch::optim::OptimizerParamGroup({b})},
                           ampkit::optim::AdamWOptions(1e-3));
  static_cast<ampkit::optim::AdamWOptions&>(opt.param_groups()[1].options()).lr(-1.0);
  a.mutable_grad() = torch::randn({8}).to(torch::kHalf);
  b.mutable_grad() = torch::randn({8}).to(torch::kHalf);
  const auto a0 = a.detach().clone();
  REQUIRE_THROWS_WITH(opt.step(), Catch::Contains("Invalid learning rate: -1"));
  CHECK(torch::equal(a.detach(), a0));
  CHECK(opt.state().empty());

  auto c = torch::randn({4}).requires_grad_();
  auto d = torch::randn({4}, torch::kDouble).requires_grad_();
  ampkit::optim::SGD sgd(
      {torch::optim::OptimizerParamGroup({c}),
       torch::optim::OptimizerParamGroup({d}, std::make_unique<ampkit::optim::SGDOptions>(
                                                  ampkit::optim::SGDOptions(0.1).momentum(0.9).master_weights(true)))},
      ampkit::optim::SGDOptions(0.1).momentum(0.9));
  c.mutable_grad() = torch::ones({4});
  d.mutable_grad() = torch::ones({4}, torch::kDouble);
  const auto c0 = c.detach().clone();
  REQUIRE_THROWS_WITH(
      sgd.step(), Catch::Contains("SGD: master_weights(true) needs FP16, BF16 or FP32 parameters, but got a Double"));
  CHECK(torch::equal(c.detach(), c0));
  CHECK(sgd.state().empty());
}

TEST_CASE("optim::AdamW and SGD: FP32 steps under a grad scale are bit-identical to ATen's fused CPU kernels, "
          "unscaled grads included",
          "[optim][cpu]") {
  auto ours = make_params(at::kFloat, 21);
  auto ref = clone_params(ours, at::kFloat);
  ampkit::optim::AdamW opt(ours, ampkit::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
  std::vector<at::Tensor> m, v, vmax, steps;
  for (const auto& p : ref) {
    m.push_back(torch::zeros_like(p));
    v.push_back(torch::zeros_like(p));
    vmax.push_back(torch::zeros_like(p));
    steps.push_back(torch::zeros({}));
  }
  const auto scale = torch::full({}, 512.f);
  const auto found = torch::zeros({});
  for (int step = 0; step < 3; ++step) {
    set_grads(ours, step, at::kFloat);
    std::vector<at::Tensor> ref_grads;
    for (size_t i = 0; i < ref.size(); ++i) {
      ours[i].mutable_grad().mul_(512.f);
      ref_grads.push_back(ours[i].grad().clone());
    }
    for (auto& s : steps) {
      s.add_(1);
    }
    at::_fused_adamw_(ref, ref_grads, m, v, vmax, steps, 1e-2, 0.9, 0.999, 0.1, 1e-8, true, false, scale, found);
    opt.set_amp_scaling(scale, found);
    opt.step();
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("step " << step << ", param " << i);
      REQUIRE(bits_equal(ours[i].detach(), ref[i].detach()));
      REQUIRE(bits_equal(ours[i].grad(), ref_grads[i]));  // the unscaled grad, as ATen's kernel leaves it
    }
  }
  // write_unscaled_grads(false): the same step, the grads left as the backward wrote them.
  auto left = make_params(at::kFloat, 22);
  ampkit::optim::SGD sgd(left, ampkit::optim::SGDOptions(0.1).momentum(0.9).write_unscaled_grads(false));
  set_grads(left, 0, at::kFloat);
  const auto before = left[0].grad().clone();
  sgd.set_amp_scaling(scale, found);
  sgd.step();
  CHECK(bits_equal(left[0].grad(), before));
}

TEST_CASE("WarmupDecayLR: linear warm-up, then linear, cosine or no decay, on every param group", "[optim][cpu]") {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a});
  groups.emplace_back(std::vector<at::Tensor>{b}, std::make_unique<ampkit::optim::AdamWOptions>(2e-3));
  ampkit::optim::AdamW opt(groups, ampkit::optim::AdamWOptions(1e-3));
  REQUIRE(opt.param_groups()[1].options().get_lr() == 2e-3);  // the group keeps its own options
  auto extra = torch::zeros({1}, torch::requires_grad());
  opt.add_param_group(torch::optim::OptimizerParamGroup({extra}, std::make_unique<ampkit::optim::AdamWOptions>(5e-3)));
  CHECK(opt.param_groups()[2].options().get_lr() == 5e-3);
  REQUIRE_THROWS_WITH(ampkit::optim::SGD(groups, ampkit::optim::SGDOptions(0.1)),
                      Catch::Contains("ampkit::optim::SGD: param group 1 carries the options of another optimizer"));
  opt.param_groups().pop_back();
  ampkit::optim::WarmupDecayLR linear(opt, 4, 12);
  REQUIRE(linear.base_lrs() == std::vector<double>{1e-3, 2e-3});
  std::vector<double> seen;
  for (int step = 0; step < 14; ++step) {
    seen.push_back(opt.param_groups()[0].options().get_lr());
    CHECK(opt.param_groups()[1].options().get_lr() == Approx(2 * seen.back()).margin(1e-15));
    a.mutable_grad() = torch::ones({2});
    b.mutable_grad() = torch::ones({2});
    opt.step();
    linear.step();
  }
  // 0, 1/4, 2/4, 3/4 of the base; 1 at step 4; then down by 1/8 per step to 0 at step 12, and 0 after.
  const std::vector<double> expected = {0, .25, .5, .75, 1, .875, .75, .625, .5, .375, .25, .125, 0, 0};
  for (size_t i = 0; i < expected.size(); ++i) {
    CHECK(seen[i] == Approx(1e-3 * expected[i]).margin(1e-15));
  }
  CHECK(torch::equal(a.detach(), torch::zeros({2})) == false);  // the optimizer stepped with these lrs

  auto c = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD sgd({c}, torch::optim::SGDOptions(0.1));
  ampkit::optim::WarmupDecayLR cosine(sgd, 2, 10, ampkit::optim::Decay::kCosine, 0.1);
  CHECK(cosine.factor(0) == 0.0);
  CHECK(cosine.factor(1) == 0.5);
  CHECK(cosine.factor(2) == 1.0);
  CHECK(cosine.factor(6) == Approx(0.1 + 0.9 * 0.5));  // halfway through the decay
  CHECK(cosine.factor(10) == Approx(0.1));
  CHECK(cosine.factor(50) == Approx(0.1));
  ampkit::optim::WarmupDecayLR constant(sgd, 0, 0, ampkit::optim::Decay::kConstant);
  CHECK(constant.factor(0) == 1.0);
  CHECK(constant.factor(1000) == 1.0);

  REQUIRE_THROWS_WITH(ampkit::optim::WarmupDecayLR(sgd, -1, 10), Catch::Contains("warmup_steps must be >= 0"));
  REQUIRE_THROWS_WITH(ampkit::optim::WarmupDecayLR(sgd, 10, 10), Catch::Contains("total_steps must be > warmup_steps"));
  REQUIRE_THROWS_WITH(ampkit::optim::WarmupDecayLR(sgd, 1, 10, ampkit::optim::Decay::kLinear, 1.5),
                      Catch::Contains("min_lr_ratio must be in [0, 1], but got 1.5"));
}

TEST_CASE("optim::LAMB: param groups with a global clip equal the fused op on the global norm", "[optim][cpu]") {
  auto ps = make_params(at::kHalf, 3);
  auto ref = clone_params(ps, at::kHalf);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{ps[0], ps[2]}, std::make_unique<ampkit::optim::LAMBOptions>(
                                                                 ampkit::optim::LAMBOptions(1e-2).max_grad_norm(0.5)));
  // A group takes the defaults' value of each option it leaves at its constructor's (NOTE [Group options]): this
  // one clips at the optimizer's 0.25.
  groups.emplace_back(std::vector<at::Tensor>{ps[1], ps[3], ps[4]},
                      std::make_unique<ampkit::optim::LAMBOptions>(ampkit::optim::LAMBOptions(1e-2).weight_decay(0)));
  ampkit::optim::LAMB opt(groups, ampkit::optim::LAMBOptions(1e-2).max_grad_norm(0.25));
  // The reference: the ops by hand, FP32 masters and moments per group, one norm over every grad.
  std::vector<at::Tensor> masters, m, v, steps;
  for (const auto& p : ref) {
    masters.push_back(p.detach().to(at::kFloat));
    m.push_back(torch::zeros(p.sizes()));
    v.push_back(torch::zeros(p.sizes()));
    steps.push_back(torch::zeros({}));
  }
  auto pick = [](const std::vector<at::Tensor>& all, std::vector<size_t> idx) {
    std::vector<at::Tensor> out;
    for (const size_t i : idx) {
      out.push_back(all[i]);
    }
    return out;
  };
  for (int step = 0; step < 3; ++step) {
    set_grads(ps, step, at::kHalf);
    set_grads(ref, step, at::kHalf);
    opt.step();
    std::vector<at::Tensor> grads;
    std::vector<at::Tensor> weights;
    for (const auto& p : ref) {
      grads.push_back(p.grad());
      weights.push_back(p.detach());
    }
    const at::Tensor norm = ampkit::grad_norm(grads);
    double expect = 0.0;
    for (const auto& g : grads) {
      expect += g.to(at::kDouble).square().sum().item<double>();
    }
    CHECK(std::abs(opt.last_grad_norm().item<double>() - std::sqrt(expect)) <= 1e-6 * std::sqrt(expect));
    struct Group {
      std::vector<size_t> idx;
      double weight_decay, max_grad_norm;
    };
    for (const auto& g : {Group{{0, 2}, 0.01, 0.5}, Group{{1, 3, 4}, 0.0, 0.25}}) {
      ampkit::lamb_step_(pick(weights, g.idx), pick(grads, g.idx), pick(masters, g.idx), {}, pick(m, g.idx),
                         pick(v, g.idx), pick(steps, g.idx), 1e-2, 0.9, 0.999, g.weight_decay, 1e-6, true, true, true,
                         false, g.max_grad_norm, norm);
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      REQUIRE(bits_equal(ps[i].detach(), ref[i].detach()));
    }
  }
  const auto* state = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, ps[0]);
  REQUIRE(state != nullptr);
  CHECK(bits_equal(state->master_param(), masters[0]));
  CHECK(bits_equal(state->exp_avg_sq(), v[0]));
}

TEST_CASE("optim::LAMB: no weight decay and no clip is Adam, save and load continue bit-identically", "[optim][cpu]") {
  auto ps = make_params(at::kFloat, 4);
  auto adam_ps = clone_params(ps, at::kFloat);
  ampkit::optim::LAMB lamb(ps, ampkit::optim::LAMBOptions(1e-2).weight_decay(0).max_grad_norm(0).eps(1e-8));
  torch::optim::AdamW adamw(adam_ps, torch::optim::AdamWOptions(1e-2).weight_decay(0));
  for (int step = 0; step < 4; ++step) {
    set_grads(ps, step, at::kFloat);
    set_grads(adam_ps, step, at::kFloat);
    lamb.step();
    adamw.step();
  }
  CHECK(!lamb.last_grad_norm().defined());
  for (size_t i = 0; i < ps.size(); ++i) {
    REQUIRE(torch::allclose(ps[i], adam_ps[i], 1e-5, 1e-6));
  }
  auto bf = make_params(at::kBFloat16, 5);
  ampkit::optim::LAMB opt(bf,
                          ampkit::optim::LAMBOptions(1e-2).master_weights(ampkit::optim::MasterWeights::remainder()));
  for (int step = 0; step < 2; ++step) {
    set_grads(bf, step, at::kBFloat16);
    opt.step();
  }
  const std::string path = "ampkit_test_lamb.pt";
  torch::save(opt, path);
  auto copy = clone_params(bf, at::kBFloat16);
  ampkit::optim::LAMB loaded(copy, ampkit::optim::LAMBOptions(1.0));
  torch::load(loaded, path);
  std::remove(path.c_str());
  const auto& options = static_cast<const ampkit::optim::LAMBOptions&>(loaded.param_groups()[0].options());
  CHECK(options.lr() == 1e-2);
  CHECK(options.master_weights() == ampkit::optim::MasterWeights::remainder());
  step_in_lockstep(opt, loaded, bf, copy, 2, 4);
}

TEST_CASE("optim::LAMB: bad options and parameters raise before anything is written", "[optim][cpu]") {
  auto ps = make_params(at::kFloat);
  REQUIRE_THROWS_WITH(ampkit::optim::LAMB(ps, ampkit::optim::LAMBOptions(1e-2).max_grad_norm(-1)),
                      Catch::Contains("Invalid max_grad_norm value: -1"));
  REQUIRE_THROWS_WITH(ampkit::optim::LAMB(ps, ampkit::optim::LAMBOptions(1e-2).betas({0.9, 1.0})),
                      Catch::Contains("Invalid beta parameter at index 1"));
  ps.push_back(torch::zeros({4}, at::kDouble).requires_grad_());
  ampkit::optim::LAMB opt(ps, ampkit::optim::LAMBOptions(1e-2));
  set_grads(ps, 0, at::kFloat);
  ps.back().mutable_grad() = torch::ones({4}, at::kDouble);
  const auto before = ps[0].detach().clone();
  REQUIRE_THROWS_WITH(opt.step(), Catch::Contains("LAMB needs FP16, BF16 or FP32 parameters"));
  CHECK(bits_equal(ps[0].detach(), before));
  CHECK(opt.state().empty());
}

namespace {

template <class Optimizer>
struct OptionsOf;
template <bool kDecoupled>
struct OptionsOf<ampkit::optim::AdamT<kDecoupled>> {
  using type = ampkit::optim::AdamOptionsT<kDecoupled>;
};
template <>
struct OptionsOf<ampkit::optim::SGD> {
  using type = ampkit::optim::SGDOptions;
};
template <>
struct OptionsOf<ampkit::optim::LAMB> {
  using type = ampkit::optim::LAMBOptions;
};

// The constructors each optimizer has: explicit, with default options except SGD's (SGDOptions has no default lr).
static_assert(std::is_constructible_v<ampkit::optim::Adam, std::vector<at::Tensor>>);
static_assert(std::is_constructible_v<ampkit::optim::AdamW, std::vector<at::Tensor>>);
static_assert(std::is_constructible_v<ampkit::optim::LAMB, std::vector<at::Tensor>>);
static_assert(!std::is_constructible_v<ampkit::optim::SGD, std::vector<at::Tensor>>);
static_assert(std::is_constructible_v<ampkit::optim::SGD, std::vector<at::Tensor>, ampkit::optim::SGDOptions>);
static_assert(!std::is_convertible_v<std::vector<at::Tensor>, ampkit::optim::Adam>);
static_assert(std::is_base_of_v<torch::optim::Optimizer, ampkit::optim::LAMB>);
static_assert(std::is_base_of_v<ampkit::AmpScalingOptimizer, ampkit::optim::SGD>);

}  // namespace

TEMPLATE_TEST_CASE("optim: Adam, AdamW, SGD and LAMB keep a group's options, refuse another's, and name themselves",
                   "[optim][cpu]", ampkit::optim::Adam, ampkit::optim::AdamW, ampkit::optim::SGD, ampkit::optim::LAMB) {
  using Options = typename OptionsOf<TestType>::type;
  const std::string name = TestType::kName;
  CHECK(std::string(TestType::config(Options(1e-3)).optimizer) == name);
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a});
  groups.emplace_back(std::vector<at::Tensor>{b}, std::make_unique<Options>(2e-3));
  TestType opt(groups, Options(1e-3));
  CHECK(opt.param_groups()[0].options().get_lr() == 1e-3);
  CHECK(opt.param_groups()[1].options().get_lr() == 2e-3);
  auto c = torch::zeros({1}, torch::requires_grad());
  opt.add_param_group(torch::optim::OptimizerParamGroup({c}, std::make_unique<Options>(5e-3)));
  CHECK(opt.param_groups()[2].options().get_lr() == 5e-3);
  CHECK(dynamic_cast<const Options*>(&opt.param_groups()[2].options()) != nullptr);

  auto d = torch::zeros({1}, torch::requires_grad());
  REQUIRE_THROWS_WITH(
      opt.add_param_group(torch::optim::OptimizerParamGroup({d}, std::make_unique<torch::optim::AdagradOptions>(0.1))),
      Catch::Contains("ampkit::optim::" + name + ": param group 3 carries the options of another optimizer"));
  CHECK(opt.param_groups().size() == 3);
  groups.emplace_back(std::vector<at::Tensor>{d}, std::make_unique<torch::optim::AdagradOptions>(0.1));
  REQUIRE_THROWS_WITH(TestType(groups, Options(1e-3)),
                      Catch::Contains("ampkit::optim::" + name + ": param group 2 carries the options of another"));

  torch::serialize::OutputArchive no_version;  // LibTorch's layout before 1.5
  no_version.write("learning_rate", c10::IValue(0.5));
  std::ostringstream out;
  no_version.save_to(out);
  std::istringstream in(out.str());
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  REQUIRE_THROWS_WITH(opt.load(archive), Catch::Contains("ampkit::optim::" + name +
                                                         "::load: the archive must hold "
                                                         "'pytorch_version' = \"1.5.0\"") &&
                                             Catch::Contains("but it has none"));
  CHECK(opt.param_groups()[2].options().get_lr() == 5e-3);
  CHECK(opt.state().empty());
}

TEST_CASE("optim: MasterWeights::stochastic() and kahan() keep BF16 weights without a master, resume from "
          "torch::save bit-identically, and refuse other dtypes",
          "[optim][cpu]") {
  using ampkit::optim::MasterWeights;
  for (const MasterWeights mw : {MasterWeights::stochastic(), MasterWeights::kahan()}) {
    INFO("master_weights " << mw.name());
    CHECK(MasterWeights::from_name(mw.name()) == mw);
    auto ps = make_params(at::kBFloat16);
    ampkit::optim::AdamW opt(ps, ampkit::optim::AdamWOptions(1e-2).master_weights(mw));
    opt.init_master_params();  // keeps no master in this mode (O2's flow)
    for (int step = 0; step < 3; ++step) {
      set_grads(ps, step, at::kBFloat16);
      opt.step();
    }
    for (const auto& p : ps) {
      const auto& s = static_cast<const ampkit::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      CHECK(!s.master_param().defined());
      CHECK(!s.param_remainder().defined());
      if (mw == MasterWeights::kahan()) {
        REQUIRE(s.kahan_comp().defined());
        CHECK(s.kahan_comp().scalar_type() == at::kBFloat16);
        CHECK(!s.sr_seed().defined());
      } else {
        REQUIRE(s.sr_seed().defined());
        CHECK(s.sr_seed().scalar_type() == at::kLong);
        CHECK(!s.kahan_comp().defined());
      }
    }
    const std::string path = std::string("ampkit_test_lean_") + mw.name() + ".pt";
    torch::save(opt, path);
    auto copy = clone_params(ps, at::kBFloat16);
    torch::manual_seed(99);  // the seeds come from the archive
    ampkit::optim::AdamW loaded(copy, ampkit::optim::AdamWOptions(1.0));
    torch::load(loaded, path);
    std::remove(path.c_str());
    CHECK(static_cast<const ampkit::optim::AdamWOptions&>(loaded.param_groups()[0].options()).master_weights() == mw);
    step_in_lockstep(opt, loaded, ps, copy, 3, 6);
    // An FP32 parameter: refused before anything is written, naming the optimizer, the option and the dtype.
    auto fp32 = make_params(at::kFloat);
    ampkit::optim::AdamW bad(fp32, ampkit::optim::AdamWOptions(1e-2).master_weights(mw));
    set_grads(fp32, 0, at::kFloat);
    const auto before = fp32[0].detach().clone();
    REQUIRE_THROWS_WITH(bad.step(), Catch::Contains(std::string("AdamW: master_weights(MasterWeights::") + mw.name() +
                                                    "()) needs BFloat16 parameters") &&
                                        Catch::Contains("Float"));
    CHECK(bits_equal(fp32[0].detach(), before));
    CHECK(bad.state().empty());
    // LAMB keeps the weight the same way.
    auto lamb_params = clone_params(ps, at::kBFloat16);
    ampkit::optim::LAMB lamb(lamb_params, ampkit::optim::LAMBOptions(1e-2).master_weights(mw));
    set_grads(lamb_params, 0, at::kBFloat16);
    lamb.step();
    const auto& ls =
        static_cast<const ampkit::optim::AdamParamState&>(*lamb.state().at(lamb_params[0].unsafeGetTensorImpl()));
    CHECK(!ls.master_param().defined());
    CHECK(ls.kahan_comp().defined() == (mw == MasterWeights::kahan()));
    CHECK(ls.sr_seed().defined() == (mw == MasterWeights::stochastic()));
    CHECK(!bits_equal(lamb_params[0].detach(), ps[0].detach()));
  }
}

TEST_CASE("optim: exp_avg_dtype / momentum_dtype keep BF16 and 8-bit moments, save and load them bit-identically",
          "[optim][cpu]") {
  // NOTE [8-bit block-wise states]: parameters of 4096 elements or more get packed 8-bit states, smaller ones FP32.
  std::vector<at::Tensor> ps = {at::randn({64, 80}).to(at::kBFloat16).requires_grad_(),
                                at::randn({100}).to(at::kBFloat16).requires_grad_()};
  auto grads = [&](std::vector<at::Tensor>& params, int step) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = at::randn(params[i].sizes(), at::TensorOptions().dtype(at::kFloat))
                                     .mul(1 + step + static_cast<int>(i))
                                     .to(at::kBFloat16);
    }
  };
  ampkit::optim::AdamW opt(ps, ampkit::optim::AdamWOptions(1e-2)
                                   .master_weights(ampkit::optim::MasterWeights::kahan())
                                   .exp_avg_dtype(at::kByte)
                                   .exp_avg_sq_dtype(at::kBFloat16));
  torch::manual_seed(1);
  for (int step = 0; step < 3; ++step) {
    grads(ps, step);
    opt.step();
  }
  const auto& big = static_cast<const ampkit::optim::AdamParamState&>(*opt.state().at(ps[0].unsafeGetTensorImpl()));
  const auto& small = static_cast<const ampkit::optim::AdamParamState&>(*opt.state().at(ps[1].unsafeGetTensorImpl()));
  CHECK(big.exp_avg().scalar_type() == at::kByte);
  CHECK(big.exp_avg().numel() == ampkit::blockwise8_state_bytes(64 * 80));
  CHECK(big.exp_avg_sq().scalar_type() == at::kBFloat16);
  CHECK(small.exp_avg().scalar_type() == at::kFloat);  // under kBlockwise8MinNumel
  CHECK(small.exp_avg_sq().scalar_type() == at::kBFloat16);
  const std::string path = "ampkit_test_lean_states.pt";
  torch::save(opt, path);
  std::vector<at::Tensor> copy;
  for (const auto& p : ps) {
    copy.push_back(p.detach().clone().requires_grad_());
  }
  ampkit::optim::AdamW loaded(copy, ampkit::optim::AdamWOptions(1.0));
  torch::load(loaded, path);
  std::remove(path.c_str());
  const auto& o = static_cast<const ampkit::optim::AdamWOptions&>(loaded.param_groups()[0].options());
  CHECK(o.exp_avg_dtype() == at::kByte);
  CHECK(o.exp_avg_sq_dtype() == at::kBFloat16);
  for (int step = 3; step < 6; ++step) {
    torch::manual_seed(step);
    grads(ps, step);
    torch::manual_seed(step);
    grads(copy, step);
    opt.step();
    loaded.step();
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    REQUIRE(bits_equal(ps[i].detach(), copy[i].detach()));
    const auto& a = static_cast<const ampkit::optim::AdamParamState&>(*opt.state().at(ps[i].unsafeGetTensorImpl()));
    const auto& b =
        static_cast<const ampkit::optim::AdamParamState&>(*loaded.state().at(copy[i].unsafeGetTensorImpl()));
    REQUIRE(bits_equal(a.exp_avg(), b.exp_avg()));
    REQUIRE(bits_equal(a.exp_avg_sq(), b.exp_avg_sq()));
  }
  // SGD's momentum buffer in 8 bits; a dtype outside Float, BFloat16 and Byte raises before anything is written.
  ampkit::optim::SGD sgd({ps[0]}, ampkit::optim::SGDOptions(1e-2).momentum(0.9).momentum_dtype(at::kByte));
  grads(ps, 0);
  sgd.step();
  CHECK(static_cast<const ampkit::optim::SGDParamState&>(*sgd.state().at(ps[0].unsafeGetTensorImpl()))
            .momentum_buffer()
            .scalar_type() == at::kByte);
  REQUIRE_THROWS_WITH(ampkit::optim::AdamW(copy, ampkit::optim::AdamWOptions(1e-2).exp_avg_dtype(at::kHalf)),
                      Catch::Contains("AdamW: exp_avg_dtype must be at::kFloat, at::kBFloat16 or at::kByte") &&
                          Catch::Contains("exp_avg_dtype(at::kHalf)"));
  // Set on a group after construction: refused by step() before anything is written.
  ampkit::optim::AdamW later(copy, ampkit::optim::AdamWOptions(1e-2));
  static_cast<ampkit::optim::AdamWOptions&>(later.param_groups()[0].options()).exp_avg_sq_dtype(at::kHalf);
  grads(copy, 0);
  const auto before = copy[0].detach().clone();
  REQUIRE_THROWS_WITH(later.step(), Catch::Contains("AdamW: exp_avg_sq_dtype must be"));
  CHECK(bits_equal(copy[0].detach(), before));
  CHECK(later.state().empty());
}
