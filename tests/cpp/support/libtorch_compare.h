// Runs a LibTorch optimizer and an ampkit one side by side on the same seeded grads (test_optim_libtorch.cpp,
// test_optim_groups.cpp).
#pragma once

#include <vector>

#include "catch_torch.h"

namespace ampkit::test {

// Seeded random grads for step `step`, in each parameter's dtype (never all zero).
inline void set_step_grads(std::vector<at::Tensor>& ps, int step) {
  torch::manual_seed(2000 + step);
  for (auto& p : ps) {
    p.mutable_grad() = torch::randn(p.sizes()).to(p.scalar_type());
  }
}

// Runs `theirs` (a LibTorch optimizer) and `ours` over the same grads from the same weights for steps [first,
// last), and checks the weights agree to FP32 rounding: ampkit's fused kernel and LibTorch's ATen ops round in
// different places, while a lost option or a wrong formula moves the weights far more.
template <typename Theirs, typename Ours>
void steps_agree(Theirs& theirs, std::vector<at::Tensor>& tp, Ours& ours, std::vector<at::Tensor>& op, int first,
                 int last) {
  for (int step = first; step < last; ++step) {
    set_step_grads(tp, step);
    set_step_grads(op, step);
    theirs.step();
    ours.step();
  }
  for (size_t i = 0; i < tp.size(); ++i) {
    INFO("param " << i);
    REQUIRE(torch::allclose(op[i].detach(), tp[i].detach(), 1e-5, 1e-6));
  }
}

}  // namespace ampkit::test
