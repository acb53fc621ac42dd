// ampkit::optim::WarmupDecayLR and SkipAware (see <ampkit/lr_scheduler.h>).
#include "ampkit/lr_scheduler.h"

#include "ampkit/grad_scaler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace ampkit::optim {

WarmupDecayLR::WarmupDecayLR(torch::optim::Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps, Decay decay,
                             double min_lr_ratio)
    : torch::optim::LRScheduler(optimizer),
      optimizer_(optimizer),
      warmup_steps_(warmup_steps),
      total_steps_(total_steps),
      decay_(decay),
      min_lr_ratio_(min_lr_ratio) {
  TORCH_CHECK_VALUE(warmup_steps >= 0, "ampkit::optim::WarmupDecayLR: warmup_steps must be >= 0, but got ",
                    warmup_steps);
  TORCH_CHECK_VALUE(decay == Decay::kConstant || total_steps > warmup_steps,
                    "ampkit::optim::WarmupDecayLR: total_steps must be > warmup_steps (", warmup_steps,
                    ") for a decaying schedule, but got ", total_steps);
  TORCH_CHECK_VALUE(min_lr_ratio >= 0.0 && min_lr_ratio <= 1.0,
                    "ampkit::optim::WarmupDecayLR: min_lr_ratio must be in [0, 1], but got ", min_lr_ratio);
  TORCH_CHECK_VALUE(!optimizer.param_groups().empty(),
                    "ampkit::optim::WarmupDecayLR: the optimizer has no param group");
  for (const auto& group : optimizer.param_groups()) {
    base_lrs_.push_back(group.options().get_lr());
  }
  const double f = factor(0);
  for (size_t i = 0; i < base_lrs_.size(); ++i) {
    optimizer_.param_groups()[i].options().set_lr(base_lrs_[i] * f);
  }
}

double WarmupDecayLR::factor(int64_t step) const {
  TORCH_CHECK_VALUE(step >= 0, "ampkit::optim::WarmupDecayLR::factor: step must be >= 0, but got ", step);
  if (step < warmup_steps_) {
    return static_cast<double>(step) / static_cast<double>(warmup_steps_);
  }
  if (decay_ == Decay::kConstant) {
    return 1.0;
  }
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps_) / static_cast<double>(total_steps_ - warmup_steps_));
  const double shape = decay_ == Decay::kLinear ? 1.0 - progress : 0.5 * (1.0 + std::cos(M_PI * progress));
  return min_lr_ratio_ + (1.0 - min_lr_ratio_) * shape;
}

std::vector<double> WarmupDecayLR::get_lrs() {
  // LRScheduler::step() calls this before counting the step: the lrs of the step that comes next.
  const double f = factor(static_cast<int64_t>(step_count_) + 1);
  std::vector<double> lrs;
  lrs.reserve(base_lrs_.size());
  for (const double base : base_lrs_) {
    lrs.push_back(base * f);
  }
  return lrs;
}

SkipAware::SkipAware(torch::optim::LRScheduler& scheduler, const GradScaler& scaler)
    : scheduler_(scheduler), scaler_(scaler) {}

SkipAware::SkipAware(torch::optim::LRScheduler& scheduler, const GradScaler& scaler,
                     const torch::optim::Optimizer& optimizer)
    : scheduler_(scheduler), scaler_(scaler), optimizer_(&optimizer) {}

bool SkipAware::last_step_applied() const {
  at::Tensor ran = optimizer_ != nullptr ? scaler_.last_step_ran(*optimizer_) : at::Tensor();
  if (!ran.defined()) {
    ran = scaler_.last_step_ran();
  }
  return !ran.defined() || ran.item<bool>();
}

void SkipAware::step() {
  if (last_step_applied()) {
    scheduler_.step();
  } else {
    ++skipped_steps_;
  }
}

}  // namespace ampkit::optim
