// The options of ampkit's optimizers, declared once (NOTE [Optimizer option table]). Included by <ampkit/optim.h>;
// the Python binding expands the same rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ampkit::optim {

// NOTE [Optimizer option table]
// Every option of an algorithm is one row of its list below, and every other spelling of it is derived from the
// rows: the member of the LibTorch *Options (AMPKIT_OPTION, with its default), its archive writing and reading
// (csrc/optim/optim.cpp), the optimizer's config() (its core::GroupConfig), the Python binding's reading of a
// param group, and the table ampkit._C exports, from which ampkit.optim takes its group defaults, flags and state
// dtype keys (tests/python/test_optim_options.py compares ampkit.optim's signatures with it). A new option is a
// row, plus its op argument and functor.
//   ROW(type, name, default, archive, python, field)
//     archive (OptionArchive): kRequired, LibTorch's own option, which every archive carries; kOptional,
//              ampkit's, taken from the optimizer's defaults where an archive lacks it (one LibTorch wrote).
//     python (OptionPython): how ampkit.optim spells it: kGroup, a param-group key (kLr: the learning rate,
//              which also takes a tensor); kAttribute, a constructor keyword kept on the optimizer; kNone: none
//              (lr_tensor: Python's lr takes a tensor).
//     field: what it sets in a core::GroupConfig `c`: c.field = value.
//   PY_ROW(type, name, default, field): a param-group option of ampkit.optim that LibTorch spells otherwise (Adam's
//     decoupled_weight_decay: LibTorch's AdamW is a type of its own).
// Defaults: the parenthesised expression, in the scope of the options type (Adam's lists see kDecoupled). SGD's lr
// default is Python's; LibTorch's SGDOptions takes lr in its constructor, as LibTorch's does.
enum class OptionArchive : int8_t { kRequired, kOptional };
enum class OptionPython : int8_t { kGroup, kLr, kAttribute, kNone };

#define AMPKIT_ADAM_OPTIONS(ROW, PY_ROW)                                                        \
  ROW(double, lr, (1e-3), kRequired, kLr, lr)                                                   \
  ROW(betas_t, betas, (std::make_tuple(0.9, 0.999)), kRequired, kGroup, betas())                \
  ROW(double, eps, (1e-8), kRequired, kGroup, eps)                                              \
  ROW(double, weight_decay, (kDecoupled ? 1e-2 : 0.0), kRequired, kGroup, weight_decay)         \
  ROW(bool, amsgrad, (false), kRequired, kGroup, amsgrad)                                       \
  PY_ROW(bool, decoupled_weight_decay, (kDecoupled), decoupled_weight_decay)                    \
  ROW(bool, maximize, (false), kOptional, kGroup, maximize)                                     \
  ROW(MasterWeights, master_weights, (MasterWeights::kAuto), kOptional, kGroup, master_weights) \
  ROW(at::ScalarType, exp_avg_dtype, (at::kFloat), kOptional, kGroup, exp_avg_dtype)            \
  ROW(at::ScalarType, exp_avg_sq_dtype, (at::kFloat), kOptional, kGroup, exp_avg_sq_dtype)      \
  ROW(bool, write_unscaled_grads, (true), kOptional, kAttribute, write_unscaled_grads)          \
  ROW(at::Tensor, lr_tensor, (at::Tensor()), kOptional, kNone, lr_tensor)

#define AMPKIT_SGD_OPTIONS(ROW, PY_ROW)                                                         \
  ROW(double, lr, (1e-3), kRequired, kLr, lr)                                                   \
  ROW(double, momentum, (0.0), kRequired, kGroup, momentum)                                     \
  ROW(double, dampening, (0.0), kRequired, kGroup, dampening)                                   \
  ROW(double, weight_decay, (0.0), kRequired, kGroup, weight_decay)                             \
  ROW(bool, nesterov, (false), kRequired, kGroup, nesterov)                                     \
  ROW(bool, maximize, (false), kOptional, kGroup, maximize)                                     \
  ROW(MasterWeights, master_weights, (MasterWeights::kAuto), kOptional, kGroup, master_weights) \
  ROW(at::ScalarType, momentum_dtype, (at::kFloat), kOptional, kGroup, exp_avg_dtype)           \
  ROW(bool, write_unscaled_grads, (true), kOptional, kAttribute, write_unscaled_grads)          \
  ROW(at::Tensor, lr_tensor, (at::Tensor()), kOptional, kNone, lr_tensor)

// LAMB only reads the grads: write_unscaled_grads has no row and stays false in its config.
#define AMPKIT_LAMB_OPTIONS(ROW, PY_ROW)                                                        \
  ROW(double, lr, (1e-3), kRequired, kLr, lr)                                                   \
  ROW(betas_t, betas, (std::make_tuple(0.9, 0.999)), kRequired, kGroup, betas())                \
  ROW(double, eps, (1e-6), kRequired, kGroup, eps)                                              \
  ROW(double, weight_decay, (0.01), kRequired, kGroup, weight_decay)                            \
  ROW(bool, bias_correction, (true), kRequired, kGroup, bias_correction)                        \
  ROW(bool, adam_w_mode, (true), kRequired, kGroup, decoupled_weight_decay)                     \
  ROW(bool, grad_averaging, (true), kRequired, kGroup, grad_averaging)                          \
  ROW(double, max_grad_norm, (1.0), kRequired, kGroup, max_grad_norm)                           \
  ROW(bool, use_nvlamb, (false), kRequired, kGroup, use_nvlamb)                                 \
  ROW(MasterWeights, master_weights, (MasterWeights::kAuto), kOptional, kGroup, master_weights) \
  ROW(at::Tensor, lr_tensor, (at::Tensor()), kOptional, kNone, lr_tensor)

// Expands to nothing (a list's PY_ROWs where only LibTorch's options are wanted, and the like).
#define AMPKIT_OPTION_SKIP(...)

}  // namespace ampkit::optim
