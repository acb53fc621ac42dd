// What the files of ampkit::optim::core share and do not export: a parameter of a step as the step reads it, and
// torch.optim's single-tensor formulas (single_tensor.cpp) for the parameters the fused kernels do not take.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "ampkit/optim_core.h"

namespace ampkit::optim::core::detail {

// A parameter of a step: the tensors outlive the step (the caller's list, the parameter's grad or its staging copy).
struct Entry {
  const at::Tensor* param;
  const at::Tensor* grad;
  ParamState* state;
};

// torch.optim's single-tensor Adam or SGD step (capturable=False, differentiable=False) over `entries`, on
// torch.optim's state format. found_inf is read on the host (a sync, on this path only); grad_scale unscales the
// grads in place first.
void single_tensor_step(const GroupConfig& c, const std::vector<Entry>& entries,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

}  // namespace ampkit::optim::core::detail
