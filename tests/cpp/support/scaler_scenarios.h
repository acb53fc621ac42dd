// The GradScaler scenarios the CPU and the CUDA scaler tests both run (tests/cpp/test_grad_scaler.cpp,
// tests/cpp/test_ops_cuda.cpp), written once with the device as a parameter.
#pragma once

#include <torch/torch.h>

#include <limits>

#include "ampkit/grad_scaler.h"
#include "catch_torch.h"

namespace ampkit::test {

// The scaler of the hysteresis scenario: init_scale 512, growth_interval 3, hysteresis 2.
inline ampkit::GradScalerOptions hysteresis_scenario_options() {
  return ampkit::GradScalerOptions().init_scale(512.0).growth_interval(3).hysteresis(2);
}

// Five steps of an SGD over ones(4) on `device` with an Inf in the grad at step 2. By the update rule
// (UpdateScaleOp) the overflow takes one of the two hysteresis steps and keeps the scale; steps 3-5 are three clean
// steps, so step 5 grows the scale to 1024 and refills the hysteresis tracker: checked here.
inline void run_hysteresis_scenario(ampkit::GradScaler& scaler, const at::Device& device) {
  auto p = torch::ones({4}, torch::TensorOptions().device(device).requires_grad(true));
  torch::optim::SGD opt({p}, 0.01);
  for (int i = 0; i < 5; ++i) {
    opt.zero_grad();
    scaler.scale(p.sum()).backward();
    if (i == 1) {
      p.mutable_grad()[0] = std::numeric_limits<float>::infinity();
    }
    scaler.step(opt);
    scaler.update();
  }
  const ampkit::GradScalerStats s = scaler.stats();
  CHECK(s.steps == 5);
  CHECK(s.skipped_steps == 1);
  CHECK(s.last_overflow_step == 2);
  CHECK(s.hysteresis_tracker == 2);
  CHECK(scaler.get_scale() == 1024.0);
}

}  // namespace ampkit::test
