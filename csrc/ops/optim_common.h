// Checks and descriptor building shared by the CPU, CUDA and Meta kernels of adamw_step_ and sgd_step_.
// Everything is validated before the first write: a failed call changes nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "../../kernels/optim_launch.h"

namespace ampkit::detail {

// The tensor lists of one fused step. Optional lists are either empty or as long as params.
struct OptimLists {
  at::TensorList params;
  at::TensorList grads;
  at::TensorList master_params;  // optional
  at::TensorList param_remainders;  // optional, BF16 params only, exclusive with master_params
  at::TensorList exp_avgs;       // Adam: required; SGD: momentum buffers, required iff momentum != 0
  at::TensorList exp_avg_sqs;    // Adam: required; SGD: empty
  at::TensorList max_exp_avg_sqs;  // required iff amsgrad
  at::TensorList state_steps;    // Adam: required; SGD: optional (needed with momentum)
};

// Throws unless the lists, grad_scale and found_inf are consistent (see the op schemas in registration.cpp).
void check_optim_args(const char* op, const OptimLists& lists, bool need_exp_avgs, bool need_exp_avg_sqs,
                      bool need_max_exp_avg_sqs, bool need_steps, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor);

// Throws unless the hyper-parameters are in range (torch.optim's rules).
void check_adam_hparams(const char* op, double lr, double beta1, double beta2, double weight_decay, double eps);
void check_sgd_hparams(const char* op, double lr, double momentum, double dampening, double weight_decay,
                       bool nesterov);

// The functors' hyper-parameters from the ops' (checked) arguments.
kernels::AdamParams adam_params(double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                                bool maximize, bool decoupled_weight_decay);
kernels::SgdParams sgd_params(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                              bool maximize);

// One kernel descriptor per parameter.
std::vector<kernels::OptimTensor> optim_tensors(const OptimLists& lists);

}  // namespace ampkit::detail
