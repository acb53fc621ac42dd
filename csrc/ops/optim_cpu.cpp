// CPU kernels of adamw_step_, sgd_step_, lamb_step_ and grad_norm: the device-side skip (found_inf), then the shared loops.
#include <torch/library.h>

#include "cpu/cpu_loops.h"
#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

bool skipped(const StepScalars& s) { return s.found_inf.has_value() && *s.found_inf->const_data_ptr<float>() != 0.f; }

float grad_scale_of(const StepScalars& s) {
  return s.grad_scale.has_value() ? *s.grad_scale->const_data_ptr<float>() : 1.f;
}

double lr_of(const StepScalars& s, double lr) {
  return s.lr_tensor.has_value() ? *s.lr_tensor->const_data_ptr<float>() : lr;
}

// Both fused steps: the device-side skip, then the CPU loop `run` with the step's lr.
template <typename Args, typename MakeParams, typename Run>
void step_cpu(const Args& a, const std::vector<kernels::OptimTensor>& tensors, MakeParams make_params, Run run) {
  if (skipped(a.scalars)) {
    return;
  }
  // The CPU steps follow torch's CPU kernels up to their scalar tail (NOTE [torch's scalar tail]).
  run(tensors.data(), static_cast<int64_t>(tensors.size()),
      make_params(a, lr_of(a.scalars, a.hparams.lr), torch_cpu_float_vector_width()), grad_scale_of(a.scalars));
}

void adam_step_cpu(const AdamStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cpu(a, tensors, adam_params, cpu_loops().adam_step);
}

void sgd_step_cpu(const SgdStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  step_cpu(a, tensors, sgd_params, cpu_loops().sgd_step);
}

void lamb_step_cpu(const LambStepArgs& a, const std::vector<kernels::OptimTensor>& tensors) {
  if (skipped(a.scalars)) {
    return;
  }
  cpu_loops().lamb_step(tensors.data(), static_cast<int64_t>(tensors.size()),
                        lamb_params(a, lr_of(a.scalars, a.hparams.lr)), grad_scale_of(a.scalars),
                        float_ptr(a.grad_norm));
}

at::Tensor grad_norm_cpu(const GradNormArgs& a) {
  at::Tensor out = grad_norm_result(a);
  const DenseList grads(a.grads);  // read only
  const float scale = a.grad_scale.has_value() ? *a.grad_scale->const_data_ptr<float>() : 1.f;
  *out.mutable_data_ptr<float>() = cpu_loops().grad_norm(grads.data(), grads.size(), scale);
  return out;
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  using namespace ampkit::detail;
  m.impl("adamw_step_", &adamw_step_kernel<adam_step_cpu>);
  m.impl("sgd_step_", &sgd_step_kernel<sgd_step_cpu>);
  m.impl("lamb_step_", &lamb_step_kernel<lamb_step_cpu>);
  m.impl("grad_norm", &grad_norm_kernel<grad_norm_cpu>);
}
