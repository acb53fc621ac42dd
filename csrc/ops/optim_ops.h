// Signatures of the fused optimizer ops' kernels (one per backend: optim_cpu.cpp, optim_cuda.cpp, amp_meta.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#define AMPKIT_ADAMW_STEP_ARGS                                                                                       \
  at::TensorList params, at::TensorList grads, at::TensorList master_params, at::TensorList param_remainders,       \
      at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,           \
      double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,                    \
      bool decoupled_weight_decay, const std::optional<at::Tensor>&grad_scale,                                      \
      const std::optional<at::Tensor>&found_inf, const std::optional<at::Tensor>&lr_tensor

#define AMPKIT_SGD_STEP_ARGS                                                                                         \
  at::TensorList params, at::TensorList grads, at::TensorList master_params, at::TensorList param_remainders,       \
      at::TensorList momentum_buffers, at::TensorList state_steps, double lr, double momentum, double dampening, double weight_decay, bool nesterov, \
      bool maximize, const std::optional<at::Tensor>&grad_scale, const std::optional<at::Tensor>&found_inf,      \
      const std::optional<at::Tensor>&lr_tensor

// Validates every argument of the op (shared by all backends) and returns the lists.
#define AMPKIT_CHECK_ADAMW_STEP(op)                                                                                 \
  const ::ampkit::detail::OptimLists lists{params,   grads,       master_params,   param_remainders,               \
                                           exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps};                                                            \
  ::ampkit::detail::check_adam_hparams(op, lr, beta1, beta2, weight_decay, eps);                                    \
  ::ampkit::detail::check_optim_args(op, lists, true, true, amsgrad, true, grad_scale, found_inf, lr_tensor)

#define AMPKIT_CHECK_SGD_STEP(op)                                                                                   \
  const ::ampkit::detail::OptimLists lists{params, grads, master_params, param_remainders, momentum_buffers, {}, {}, \
                                           state_steps};                                                            \
  ::ampkit::detail::check_sgd_hparams(op, lr, momentum, dampening, weight_decay, nesterov);                        \
  ::ampkit::detail::check_optim_args(op, lists, momentum != 0.0, false, false, momentum != 0.0, grad_scale,         \
                                     found_inf, lr_tensor)
