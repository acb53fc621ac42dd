// ampkit::optim::SkipAware: a LibTorch scheduler held on the steps a GradScaler skipped, against a scheduler stepped
// by hand only after the applied steps.
#include "catch_torch.h"

#include <ampkit/lr_scheduler.h>

#include <limits>
#include <set>

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
