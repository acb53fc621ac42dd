// Checks and descriptors of the fused optimizer ops (see optim_common.h).
#include "optim_common.h"

#include <c10/util/Exception.h>

#include "checks.h"

namespace ampkit::detail {
namespace {

void check_list_length(const char* op, const char* name, at::TensorList list, size_t expected, bool required) {
  TORCH_CHECK_VALUE(list.size() == expected || (!required && list.empty()), "ampkit::", op, ": ", name, " must have ",
                    expected, " tensors (one per param)", required ? "" : " or none", ", but has ", list.size());
}

// `t` must be a companion of params[i]: same shape and strides, on the same device, of `dtype`.
void check_companion(const char* op, const char* name, size_t i, const at::Tensor& t, const at::Tensor& param,
                     at::ScalarType dtype) {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", name, "[", i,
              "] must be a strided (dense) tensor, but got layout ", t.layout());
  TORCH_CHECK(t.device() == param.device(), "ampkit::", op, ": ", name, "[", i, "] must be on ", param.device(),
              " like params[", i, "], but is on ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampkit::", op, ": ", name, "[", i, "] must be ", dtype,
                   ", but got ", t.scalar_type());
  // Symbolic-size aware (fake tensors under torch.compile carry SymInts).
  TORCH_CHECK(t.sym_sizes() == param.sym_sizes() && t.sym_strides() == param.sym_strides(), "ampkit::", op, ": ",
              name, "[", i, "] must have the shape and strides of params[", i, "] (", param.sym_sizes(), ", ",
              param.sym_strides(), "), but has ", t.sym_sizes(), ", ", t.sym_strides());
}

}  // namespace

void check_optim_args(const char* op, const OptimLists& l, bool need_exp_avgs, bool need_exp_avg_sqs,
                      bool need_max_exp_avg_sqs, bool need_steps, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& lr_tensor) {
  const size_t n = l.params.size();
  check_list_length(op, "grads", l.grads, n, true);
  check_list_length(op, "master_params", l.master_params, n, false);
  check_list_length(op, "param_remainders", l.param_remainders, n, false);
  TORCH_CHECK_VALUE(l.master_params.empty() || l.param_remainders.empty(), "ampkit::", op,
                    ": give master_params or param_remainders, not both");
  check_list_length(op, need_exp_avg_sqs ? "exp_avgs" : "momentum_buffers", l.exp_avgs, need_exp_avgs ? n : 0, true);
  check_list_length(op, "exp_avg_sqs", l.exp_avg_sqs, need_exp_avg_sqs ? n : 0, true);
  check_list_length(op, "max_exp_avg_sqs", l.max_exp_avg_sqs, need_max_exp_avg_sqs ? n : 0, true);
  check_list_length(op, "state_steps", l.state_steps, n, need_steps);
  if (n == 0) {
    return;
  }
  const at::Device device = l.params[0].device();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = l.params[i];
    TORCH_CHECK(p.defined(), "ampkit::", op, ": params[", i, "] is undefined");
    TORCH_CHECK(p.layout() == at::kStrided, "ampkit::", op, ": params[", i,
                "] must be a strided (dense) tensor, but got layout ", p.layout());
    TORCH_CHECK(p.device() == device, "ampkit::", op, ": params[", i, "] must be on ", device,
                " like params[0], but is on ", p.device());
    const auto dtype = p.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, "ampkit::", op,
                     ": params[", i, "] must be Half, BFloat16 or Float, but got ", dtype);
    TORCH_CHECK(p.sym_numel() == 0 || p.is_non_overlapping_and_dense(), "ampkit::", op, ": params[", i,
                "] must be dense (non-overlapping, no gaps)");
    check_companion(op, "grads", i, l.grads[i], p, dtype);
    if (!l.master_params.empty()) {
      check_companion(op, "master_params", i, l.master_params[i], p, at::kFloat);
    }
    if (!l.param_remainders.empty()) {
      TORCH_CHECK_TYPE(dtype == at::kBFloat16, "ampkit::", op, ": params[", i,
                       "] must be BFloat16 when param_remainders are given, but got ", dtype);
      check_companion(op, "param_remainders", i, l.param_remainders[i], p, at::kShort);
    }
    if (need_exp_avgs) {
      check_companion(op, need_exp_avg_sqs ? "exp_avgs" : "momentum_buffers", i, l.exp_avgs[i], p, at::kFloat);
    }
    if (need_exp_avg_sqs) {
      check_companion(op, "exp_avg_sqs", i, l.exp_avg_sqs[i], p, at::kFloat);
    }
    if (need_max_exp_avg_sqs) {
      check_companion(op, "max_exp_avg_sqs", i, l.max_exp_avg_sqs[i], p, at::kFloat);
    }
    if (!l.state_steps.empty()) {
      const at::Tensor& s = l.state_steps[i];
      TORCH_CHECK(s.defined() && s.sym_numel() == 1 && s.scalar_type() == at::kFloat && s.device() == device, "ampkit::",
                  op, ": state_steps[", i, "] must be a one-element Float tensor on ", device);
    }
  }
  if (grad_scale.has_value()) {
    check_scalar_tensor(op, "grad_scale", *grad_scale, at::kFloat, device);
  }
  if (found_inf.has_value()) {
    check_scalar_tensor(op, "found_inf", *found_inf, at::kFloat, device);
  }
  if (lr_tensor.has_value()) {
    check_scalar_tensor(op, "lr_tensor", *lr_tensor, at::kFloat, device);
  }
}

void check_adam_hparams(const char* op, double lr, double beta1, double beta2, double weight_decay, double eps) {
  TORCH_CHECK_VALUE(lr >= 0.0, "ampkit::", op, ": lr must be >= 0, but got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "ampkit::", op, ": beta1 must be in [0, 1), but got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "ampkit::", op, ": beta2 must be in [0, 1), but got ", beta2);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "ampkit::", op, ": weight_decay must be >= 0, but got ", weight_decay);
  TORCH_CHECK_VALUE(eps >= 0.0, "ampkit::", op, ": eps must be >= 0, but got ", eps);
}

void check_sgd_hparams(const char* op, double lr, double momentum, double dampening, double weight_decay,
                       bool nesterov) {
  TORCH_CHECK_VALUE(lr >= 0.0, "ampkit::", op, ": lr must be >= 0, but got ", lr);
  TORCH_CHECK_VALUE(momentum >= 0.0, "ampkit::", op, ": momentum must be >= 0, but got ", momentum);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "ampkit::", op, ": weight_decay must be >= 0, but got ", weight_decay);
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0.0 && dampening == 0.0), "ampkit::", op,
                    ": nesterov momentum requires a momentum > 0 and zero dampening");
}

kernels::AdamParams adam_params(double lr, double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                                bool maximize, bool decoupled_weight_decay) {
  return {static_cast<float>(lr),           static_cast<float>(beta1), static_cast<float>(beta2),
          static_cast<float>(weight_decay), static_cast<float>(eps),   amsgrad,
          maximize,                         decoupled_weight_decay};
}

kernels::SgdParams sgd_params(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                              bool maximize) {
  return {static_cast<float>(lr),           static_cast<float>(momentum), static_cast<float>(dampening),
          static_cast<float>(weight_decay), nesterov,                     maximize};
}

std::vector<kernels::OptimTensor> optim_tensors(const OptimLists& l) {
  std::vector<kernels::OptimTensor> out;
  out.reserve(l.params.size());
  auto ptr = [](at::TensorList list, size_t i) -> float* {
    return list.empty() ? nullptr : list[i].mutable_data_ptr<float>();
  };
  for (size_t i = 0; i < l.params.size(); ++i) {
    // Zero-size params stay in the list: they have no elements to update, but their step counts advance.
    int16_t* remainder = l.param_remainders.empty() ? nullptr : l.param_remainders[i].mutable_data_ptr<int16_t>();
    out.push_back({l.params[i].data_ptr(), l.grads[i].const_data_ptr(), ptr(l.master_params, i), remainder,
                   ptr(l.exp_avgs, i),
                   ptr(l.exp_avg_sqs, i), ptr(l.max_exp_avg_sqs, i), ptr(l.state_steps, i), l.params[i].numel(),
                   kernel_dtype(l.params[i].scalar_type())});
  }
  return out;
}

}  // namespace ampkit::detail
