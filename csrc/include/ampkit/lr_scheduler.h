// LibTorch learning-rate schedules: ampkit::optim::WarmupDecayLR (linear warm-up, then constant, linear or cosine
// decay, for any LibTorch optimizer; LibTorch ships only StepLR and ReduceLROnPlateau; the schedule of BERT-style
// pre-training: NVIDIA's LAMB recipe, Hugging Face's get_linear_schedule_with_warmup / ..._cosine_...), and
// ampkit::optim::SkipAware, which holds any scheduler on the steps a GradScaler skipped.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <vector>

#include "ampkit/export.h"

namespace ampkit {
class GradScaler;
}

namespace ampkit::optim {

enum class Decay { kConstant, kLinear, kCosine };

// Each param group's lr is its lr at construction (the base) times factor(step), where step counts the scheduler's
// step() calls: factor rises linearly from 0 (step 0) to 1 (step warmup_steps), then stays 1 (kConstant), falls
// linearly (kLinear) or along a half cosine (kCosine) to min_lr_ratio at total_steps and stays there. The
// constructor sets factor(0); call step() after each optimizer step, as Python's LambdaLR.
class AMPKIT_API WarmupDecayLR : public torch::optim::LRScheduler {
 public:
  WarmupDecayLR(torch::optim::Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps,
                Decay decay = Decay::kLinear, double min_lr_ratio = 0.0);

  // The multiplier of the base lrs at scheduler step `step` (>= 0).
  double factor(int64_t step) const;
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 private:
  std::vector<double> get_lrs() override;

  torch::optim::Optimizer& optimizer_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  Decay decay_;
  double min_lr_ratio_;
  std::vector<double> base_lrs_;
};

// Steps `scheduler` only when `scaler`'s last step was applied: a step skipped for Inf/NaN grads changes no weight,
// so a schedule counted in optimizer steps does not count it either (Python: ampkit.optim.lr_scheduler.SkipAware).
// Call step() once per optimizer step, after scaler.update(); each call reads the scaler's device flag once (a host
// read; none before the first update() or with a disabled scaler, when every call steps). The scheduler and the
// scaler must outlive it. With several optimizers on one scaler (a GAN), pass the scheduler's optimizer: the
// scheduler then follows that optimizer's step (GradScaler::last_step_ran(optimizer)), not the iteration's, and
// the optimizer must outlive it too.
class AMPKIT_API SkipAware {
 public:
  SkipAware(torch::optim::LRScheduler& scheduler, const GradScaler& scaler);
  SkipAware(torch::optim::LRScheduler& scheduler, const GradScaler& scaler, const torch::optim::Optimizer& optimizer);

  void step();
  // Whether the scaler's last step (of the optimizer, when one was given and took part in the last update()'s
  // iteration) was applied (true before the first update()): one host read.
  bool last_step_applied() const;
  // The step() calls that did not step the scheduler.
  int64_t skipped_steps() const { return skipped_steps_; }
  torch::optim::LRScheduler& scheduler() { return scheduler_; }

 private:
  torch::optim::LRScheduler& scheduler_;
  const GradScaler& scaler_;
  const torch::optim::Optimizer* optimizer_ = nullptr;
  int64_t skipped_steps_ = 0;
};

}  // namespace ampkit::optim
