// The one TORCH_LIBRARY block of ampkit: every op schema, declared once. Each backend registers its kernels next
// to their implementation (amp_cpu.cpp / optim_cpu.cpp, amp_cuda.cpp / optim_cuda.cpp, meta_kernels.cpp,
// sparse_reject.cpp); the kernels' C++ signatures come from op_kernels.h.
#include <torch/library.h>

TORCH_LIBRARY(ampkit, m) {
  // Mutating ops return () so that functionalization (torch.compile) can rewrite them.
  m.def("unscale_and_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()",
        {at::Tag::pt2_compliant_tag});
  m.def("check_finite_(Tensor[] tensors, Tensor(a!) found_inf) -> ()", {at::Tag::pt2_compliant_tag});
  // The compressed all-reduce's two passes, one each over memory: out = Out(src) / divisor (cast then divide, as
  // torch's compression hooks), and out = Out(src) * inv_scale with the Inf/NaN check of unscale_and_check_.
  m.def("cast_divide_(Tensor[] src, Tensor(a!)[] out, float divisor) -> ()", {at::Tag::pt2_compliant_tag});
  m.def("cast_unscale_and_check_(Tensor[] src, Tensor(a!)[] out, Tensor(b!) found_inf, Tensor inv_scale) -> ()",
        {at::Tag::pt2_compliant_tag});
  // Per tensor one row of FP64 statistics of the unscaled gradients (NOTE [Gradient statistics]).
  m.def("grad_stats(Tensor[] grads, Tensor? inv_scale=None) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval) -> ()",
        {at::Tag::pt2_compliant_tag});
  // The GradScaler's update: update_scale_ plus hysteresis, [min_scale, max_scale] bounds, a fixed-scale mode
  // and int64 step statistics [steps, skipped, last overflow step, overflows at min_scale], all on the device.
  m.def("update_scale_hysteresis_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
        "Tensor(d!) stats, Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
        "int hysteresis, float min_scale, float max_scale, bool dynamic) -> ()",
        {at::Tag::pt2_compliant_tag});
  // Fused optimizer steps over tensor lists: grads (same dtype as params) divided by grad_scale in registers
  // (and stored back unscaled unless write_unscaled_grads=False),
  // FP32 masters or, for BF16 params, int16 remainders (optional: empty lists) and FP32 states updated, params written once; nothing is written when
  // found_inf is nonzero. Optional lists are empty or one tensor per param. lr_tensor (one FP32 element on the
  // params' device), when given, is read on the device instead of lr (schedules inside a captured graph); on the
  // CPU with params elsewhere, it is read on the host when the op runs (no host-to-device copy). For adamw_step_
  // and sgd_step_, param_remainders may instead hold BF16 Kahan compensations or one-element int64 stochastic
  // rounding seeds (NOTE [Weight companions] in checks.cpp; kernels/stochastic_rounding.h), and each moment or
  // momentum buffer may be BF16 (the parameter's layout) or a packed 8-bit block-wise state (NOTE [8-bit
  // block-wise states] in kernels/blockwise8.h), told apart by dtype.
  m.def(
      "adamw_step_(Tensor(a!)[] params, Tensor(h!)[] grads, Tensor(b!)[] master_params, Tensor(g!)[] param_remainders, "
      "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] state_steps, *, float lr, float beta1, "
      "float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, bool decoupled_weight_decay, "
      "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? lr_tensor=None, bool write_unscaled_grads=True) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(b!)[] master_params, Tensor(e!)[] param_remainders, "
      "Tensor(c!)[] momentum_buffers, Tensor(d!)[] state_steps, *, float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
      "bool maximize, Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? lr_tensor=None, "
      "bool write_unscaled_grads=True) -> ()",
      {at::Tag::pt2_compliant_tag});
  // LAMB (NOTE [LAMB passes]): Adam moments, then per tensor w -= lr * ||w|| / ||u|| * u; grads (only read)
  // divided by grad_scale and, when grad_norm (the global norm of the unscaled grads, see grad_norm) exceeds
  // max_grad_norm > 0, by grad_norm / max_grad_norm. Masters, remainders, skip and lr_tensor as adamw_step_.
  m.def("lamb_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, Tensor(c!)[] param_remainders, "
        "Tensor(d!)[] exp_avgs, Tensor(e!)[] exp_avg_sqs, Tensor(f!)[] state_steps, *, float lr, float beta1, "
        "float beta2, float weight_decay, float eps, bool bias_correction=True, bool adam_w_mode=True, "
        "bool grad_averaging=True, bool use_nvlamb=False, float max_grad_norm=0.0, Tensor? grad_norm=None, "
        "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? lr_tensor=None) -> ()",
        {at::Tag::pt2_compliant_tag});
  // The L2 norm of all grads together divided by grad_scale, as a 0-dim FP32 tensor on their device; summed in
  // one fixed order (NOTE [Deterministic norm]), so CPU and CUDA give the same bits.
  m.def("grad_norm(Tensor[] grads, Tensor? grad_scale=None) -> Tensor", {at::Tag::pt2_compliant_tag});
  // New entries of a fused optimizer's state for `param`, in the order named: "step" (a 0-dim FP32 tensor holding
  // `step`), "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer" (FP32 zeros in param's layout; the
  // moments and the momentum buffer in exp_avg_dtype / exp_avg_sq_dtype: BF16, or Byte for a packed 8-bit state),
  // "master_param" (an FP32 copy of param), "param_remainder" (int16 zeros), "kahan_comp" (BF16 zeros), "sr_seed"
  // (a 0-dim int64 drawn from torch's default generator). Which entries a state lacks is the
  // optimizer core's decision (ampkit::optim::core::plan_step).
  m.def("make_optim_state(Tensor param, str[] entries, float step=0.0, ScalarType? exp_avg_dtype=None, "
        "ScalarType? exp_avg_sq_dtype=None) -> Tensor[]",
        {at::Tag::pt2_compliant_tag});
  // grad_norm over grads on several devices: each device's norm, combined in FP64 on the first grad's device.
  m.def("global_grad_norm(Tensor[] grads, Tensor? grad_scale=None) -> Tensor", {at::Tag::pt2_compliant_tag});
  // FP8 (docs/fp8.md; the formulas in kernels/fp8_functors.h). quantize: q = saturate(x * scale) in dtype, the
  // amax of x, and for 2-D x the transposed copy, in one pass; scale: tensorwise (one element) or rowwise.
  m.def("fp8_quantize(Tensor x, Tensor scale, ScalarType dtype, bool transpose=False) -> (Tensor q, Tensor amax, "
        "Tensor? q_t)",
        {at::Tag::pt2_compliant_tag});
  m.def("fp8_compute_scale(Tensor amax, float fp8_max, float margin=0.0, float epsilon=1e-12, bool power_of_2=False) "
        "-> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("fp8_update_amax_history_and_scale_(Tensor(a!)[] amax_histories, Tensor(b!)[] scales, str amax_compute_algo, "
        "float[] fp8_maxes, float margin=0.0) -> ()",
        {at::Tag::pt2_compliant_tag});
  // The FP8 linear layer (NOTE [FP8 linear] in fp8_linear.cpp), differentiable through its C++ Autograd kernel:
  // current scaling (pure), and delayed scaling with the (input, weight, grad_output) histories and scales, which
  // records the amaxes into row 0 of the histories (grad_output's in the backward).
  m.def("fp8_linear(Tensor input, Tensor weight, Tensor? bias, str fp8_format='hybrid', float amax_epsilon=1e-12, "
        "bool power_of_2=False, ScalarType? out_dtype=None, str granularity='tensorwise') -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // Counts of a quantization (x * scale to dtype): [saturated (|x * scale| beyond the format's max by more than half
  // an ulp: clamped; +-Inf included),
  // flushed to zero (x nonzero, |x * scale| at most half the smallest subnormal), NaN], int64.
  m.def("fp8_quantization_stats(Tensor x, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("fp8_linear_delayed(Tensor input, Tensor weight, Tensor? bias, Tensor(a!)[] amax_histories, Tensor[] scales, "
        "str fp8_format='hybrid', ScalarType? out_dtype=None) -> Tensor");
}
