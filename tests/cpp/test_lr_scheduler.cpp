// ampkit::optim::SkipAware: a LibTorch scheduler held on the steps a GradScaler skipped, against a scheduler stepped
// by hand only after the applied steps.
#include "support/catch_torch.h"

#include <ampkit/lr_scheduler.h>

#include <limits>
#include <set>
#include <string>

namespace {

double lr_of(const torch::optim::Optimizer& opt) { return opt.param_groups()[0].options().get_lr(); }

}  // namespace

TEST_CASE("SkipAware: the schedule advances only on applied steps", "[optim][scaler][cpu]") {
  torch::manual_seed(0);
  torch::nn::Linear model(6, 3);
  ampkit::optim::SGD opt(model->parameters(), ampkit::optim::SGDOptions(0.8));
  torch::optim::StepLR inner(opt, /*step_size=*/1, /*gamma=*/0.5);
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(128.0));
  ampkit::optim::SkipAware sched(inner, scaler);
  CHECK(sched.last_step_applied());  // before the first update()

  torch::nn::Linear ref_model(6, 3);
  ampkit::optim::SGD ref_opt(ref_model->parameters(), ampkit::optim::SGDOptions(0.8));
  torch::optim::StepLR ref(ref_opt, 1, 0.5);

  const std::set<int> poisoned = {1, 4};
  std::vector<double> lrs, ref_lrs;
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    scaler.scale(model(torch::randn({4, 6})).square().mean()).backward();
    if (poisoned.count(step) != 0) {
      model->weight.mutable_grad()[2][5] = std::numeric_limits<float>::quiet_NaN();
    }
    scaler.step(opt);
    scaler.update();
    sched.step();
    lrs.push_back(lr_of(opt));
    if (poisoned.count(step) == 0) {
      ref.step();
    }
    ref_lrs.push_back(lr_of(ref_opt));
  }
  CHECK(sched.skipped_steps() == 2);
  CHECK(scaler.stats().skipped_steps == 2);
  CHECK(lrs == ref_lrs);
  CHECK(lr_of(opt) == 0.8 * 0.5 * 0.5 * 0.5);  // four applied steps: LibTorch's StepLR decays from its second on
}

TEST_CASE("SkipAware: a disabled scaler steps every time", "[optim][scaler][cpu]") {
  torch::nn::Linear model(2, 2);
  ampkit::optim::SGD opt(model->parameters(), ampkit::optim::SGDOptions(1.0));
  torch::optim::StepLR inner(opt, 1, 0.5);
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().enabled(false));
  ampkit::optim::SkipAware sched(inner, scaler);
  for (int i = 0; i < 3; ++i) {
    scaler.update();
    sched.step();
  }
  CHECK(sched.skipped_steps() == 0);
  CHECK(lr_of(opt) == 0.25);  // three steps, two decays
}

TEST_CASE("GradScaler: each of two optimizers reports its own step, and SkipAware follows it", "[optim][scaler][cpu]") {
  torch::manual_seed(3);
  torch::nn::Linear disc(5, 1), gen(5, 1);
  ampkit::optim::AdamW opt_d(disc->parameters(), ampkit::optim::AdamWOptions(0.05));
  torch::optim::SGD opt_g(gen->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::StepLR inner_d(opt_d, 1, 0.5), inner_g(opt_g, 1, 0.5);
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(64.0).growth_interval(1000));
  ampkit::optim::SkipAware sched_d(inner_d, scaler, opt_d), sched_g(inner_g, scaler, opt_g);
  CHECK_FALSE(scaler.last_step_ran(opt_d).defined());  // before the first update()

  const std::vector<std::set<int>> poisons = {{}, {0}, {1}, {0, 1}, {}};
  std::vector<std::string> outcomes;  // per iteration: D ran, G ran, the iteration ran (1 or 0 each)
  std::vector<at::Tensor> held;       // flags kept across iterations keep their values
  for (const auto& poison : poisons) {
    const auto x = torch::randn({4, 5});
    torch::nn::Linear* models[] = {&disc, &gen};
    torch::optim::Optimizer* opts[] = {&opt_d, &opt_g};
    std::vector<at::Tensor> before;
    for (int k = 0; k < 2; ++k) {
      opts[k]->zero_grad();
      scaler.scale((*models[k])(x).square().mean()).backward();
      if (poison.count(k) != 0) {
        (*models[k])->bias.mutable_grad()[0] = std::numeric_limits<float>::infinity();
      }
      before.push_back((*models[k])->weight.detach().clone());
      scaler.step(*opts[k]);
    }
    scaler.update();
    for (int k = 0; k < 2; ++k) {
      CHECK(torch::equal(before[static_cast<size_t>(k)], (*models[k])->weight) == (poison.count(k) != 0));
    }
    held.push_back(scaler.last_step_ran(opt_d));
    std::string outcome;
    for (const at::Tensor& ran : {scaler.last_step_ran(opt_d), scaler.last_step_ran(opt_g), scaler.last_step_ran()}) {
      outcome += ran.item<bool>() ? '1' : '0';
    }
    outcomes.push_back(outcome);
    sched_d.step();
    sched_g.step();
  }
  CHECK(outcomes == std::vector<std::string>{"111", "010", "100", "000", "111"});
  std::vector<bool> kept;
  for (const auto& f : held) {
    kept.push_back(f.item<bool>());
  }
  CHECK(kept == std::vector<bool>{true, false, true, false, true});
  CHECK(sched_d.skipped_steps() == 2);
  CHECK(sched_g.skipped_steps() == 2);
  CHECK(lr_of(opt_g) == 0.05 * 0.5 * 0.5);  // three applied steps: LibTorch's StepLR decays from its second on

  // An iteration of one optimizer: its flag is the iteration's; the other took no part.
  opt_g.zero_grad();
  scaler.scale(gen(torch::randn({4, 5})).square().mean()).backward();
  scaler.step(opt_g);
  scaler.update();
  CHECK_FALSE(scaler.last_step_ran(opt_d).defined());
  CHECK(scaler.last_step_ran(opt_g).item<bool>() == scaler.last_step_ran().item<bool>());
}
