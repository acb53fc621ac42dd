// Typed C++ entry points of ampkit's Torch ops. Each call goes through the dispatcher (torch.ops.ampkit.*), so
// it picks the CPU, CUDA or Meta kernel from its arguments exactly as a call from Python does.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Export.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ampkit/export.h"

namespace ampkit {

// Multiplies every gradient by inv_scale in place (no multiply when inv_scale is exactly 1) and sets found_inf
// to 1.0 if any gradient element is Inf or NaN; found_inf is never cleared (the caller zeroes it). Same
// semantics as torch._amp_foreach_non_finite_check_and_unscale_, plus BF16 and mixed dtypes on CUDA.
//
// Args:
//   grads:     FP16, BF16, FP32 or FP64 tensors on one device, any strides; mutated.
//   found_inf: one-element FP32 tensor on the grads' device; mutated (set to 1.0 or left as is).
//   inv_scale: one-element FP32 tensor on the grads' device.
AMPKIT_API void unscale_and_check_(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale);

// Sets found_inf to 1.0 if any element of `tensors` is Inf or NaN; reads the tensors only.
AMPKIT_API void check_finite_(at::TensorList tensors, const at::Tensor& found_inf);

// The two passes around a gradient all-reduce in a narrow dtype, one pass over memory each (the casts of
// out.copy_(src) and the arithmetic fused):
//
// cast_divide_: out[i] = Out(float(Out(src[i])) / divisor), i.e. src.to(out.dtype).div_(divisor) as torch's
// fp16/bf16 compression hooks compute it (bit for bit on the CPU; on CUDA torch multiplies by 1/divisor, which is
// the same for powers of two).
//
// cast_unscale_and_check_: out[i] = Out(float(Out(src[i])) * inv_scale), setting found_inf to 1.0 if any
// float(Out(src[i])) is Inf or NaN: out.copy_(src) followed by unscale_and_check_({out}), bit for bit.
//
// Args:
//   src:       FP16, BF16 or FP32 tensors on one device; read only.
//   out:       one tensor per src, of its shape, FP16, BF16 or FP32 (any mix), on the same device; written. No out
//              may share memory with another out, a src or the scalars.
//   divisor:   a finite number > 0.
//   found_inf: one-element FP32 tensor on the tensors' device; mutated (set to 1.0 or left as is).
//   inv_scale: one-element FP32 tensor on the tensors' device.
AMPKIT_API void cast_divide_(at::TensorList src, at::TensorList out, double divisor);
AMPKIT_API void cast_unscale_and_check_(at::TensorList src, at::TensorList out, const at::Tensor& found_inf,
                                        const at::Tensor& inv_scale);

// Statistics of gradients, one pass over them, no host sync: an FP64 tensor of one row per gradient, on their
// device, of kGradStatsColumns (267) columns about the unscaled values x * inv_scale (inv_scale omitted: 1):
//   0: max |x * inv_scale| over finite x (0 if none)    1: L2 norm over finite x
//   2: number of Inf/NaN elements                        3: number of zeros
//   4..266: counts of the non-zero finite elements by e = floor(log2 |x * inv_scale|): column 4 for e < -133,
//           column 5 + e + 133 for e in [-133, 127], column 266 for e > 127 (BF16's whole range, FP32's but its
//           subnormals, FP16's inside it: FP16's smallest subnormal 2^-24 counts in column 114, its largest finite 65504 in 153).
// The norm's summation order is fixed (the same bits on the CPU and CUDA, run after run); the other columns do not
// depend on order.
//
// Args:
//   grads:     FP16, BF16 or FP32 tensors on one device, any strides (zero-size ones get a row of zeros).
//   inv_scale: optional one-element FP32 tensor on that device, the scaler's 1/scale.
AMPKIT_API at::Tensor grad_stats(at::TensorList grads, const std::optional<at::Tensor>& inv_scale = std::nullopt);
// The column layout above.
constexpr int kGradStatsColumns = 267;
constexpr int kGradStatsHistFirst = 4;      // column of the "below 2^-133" bin
constexpr int kGradStatsHistMinExp = -133;  // exponent of column kGradStatsHistFirst + 1

// grad_stats' rows by name: views of `rows` ([n, kGradStatsColumns] FP64), no copy and no sync. amax (max |x| over
// finite x), l2_norm (over finite x), nonfinite (Inf/NaN count) and zeros ([n] each), exp_hist ([n, 263]: column 0
// counts exponents below kGradStatsHistMinExp, column 1 + e - kGradStatsHistMinExp exponent e up to 127, the last
// one exponents above 127).
struct GradStats {
  at::Tensor amax, l2_norm, nonfinite, zeros, exp_hist;
};
AMPKIT_API GradStats grad_stats_by_name(const at::Tensor& rows);

// One step of dynamic loss scaling on the device, identical to torch._amp_update_scale_: if found_inf is
// nonzero, scale *= backoff_factor and growth_tracker = 0; otherwise growth_tracker += 1 and, when it reaches
// growth_interval, scale *= growth_factor (unless that overflows FP32) and growth_tracker = 0.
//
// Args:
//   scale:          one-element FP32 tensor; mutated.
//   growth_tracker: one-element int32 tensor on the same device; mutated.
//   found_inf:      one-element FP32 tensor on the same device.
AMPKIT_API void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                              double growth_factor, double backoff_factor, int64_t growth_interval);

// update_scale_ with hysteresis, bounds, a fixed-scale mode and step statistics (kernels::HysteresisScaleOp):
// on overflow the scale backs off only at the `hysteresis`-th overflow since the last growth (and every one
// after it), never below min_scale; growth never passes max_scale. With dynamic == false the scale stays fixed.
//
// Args:
//   scale, growth_tracker, hysteresis_tracker: one-element FP32 / int32 / int32 tensors on one device; mutated.
//   stats: int64 tensor of kScaleStats elements [steps, skipped steps, last overflow step (0: none), overflows met
//          at min_scale] (slots kScaleStatSteps ... kScaleStatOverflowsAtMin) on that device; mutated.
//   found_inf: one-element FP32 tensor on that device (nonzero: this step overflowed).
constexpr int kScaleStatSteps = 0;
constexpr int kScaleStatSkipped = 1;
constexpr int kScaleStatLastOverflow = 2;
constexpr int kScaleStatOverflowsAtMin = 3;
constexpr int kScaleStats = 4;
AMPKIT_API void update_scale_hysteresis_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                         const at::Tensor& hysteresis_tracker, const at::Tensor& stats,
                                         const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                                         int64_t growth_interval, int64_t hysteresis, double min_scale,
                                         double max_scale, bool dynamic);

// One fused Adam/AdamW step over tensor lists (see the schema in csrc/ops/registration.cpp): grads (the params'
// dtype) divided by grad_scale in registers, FP32 masters (empty list: none) and FP32 moments updated, params
// written once, step counts += 1; nothing is written when found_inf is nonzero. For BF16 params,
// param_remainders (int16) may replace master_params: the exact FP32 master for 2 bytes per param (NOTE [BF16
// weight + 16-bit remainder] in kernels/optim_functors.h); or, with no master at all, BF16 Kahan compensations
// or one-element int64 stochastic rounding seeds (then state_steps are required): NOTE [Weight companions] in
// csrc/ops/checks.cpp, kernels/stochastic_rounding.h. Optional lists are empty or one
// tensor per param (max_exp_avg_sqs: iff amsgrad). lr_tensor (one FP32 element on the params' device) replaces
// lr when given: read on the device, so an LR schedule can live in a captured CUDA graph. With grad_scale and
// write_unscaled_grads (the default, as torch's fused optimizers), the unscaled grads are stored back into grads;
// false leaves them scaled and saves that write. On the CPU, FP32 steps are bit-identical to torch's fused CPU
// kernels (NOTE [torch's scalar tail] in kernels/optim_functors.h).
AMPKIT_API void adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                            at::TensorList param_remainders, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                            at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1,
                            double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                            bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale = std::nullopt,
                            const std::optional<at::Tensor>& found_inf = std::nullopt,
                            const std::optional<at::Tensor>& lr_tensor = std::nullopt,
                            bool write_unscaled_grads = true);

// One fused SGD step (momentum buffers and step counts needed iff momentum != 0, or with stochastic rounding
// seeds); same companions and skipping rule.
AMPKIT_API void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                          at::TensorList param_remainders, at::TensorList momentum_buffers, at::TensorList state_steps,
                          double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                          bool maximize, const std::optional<at::Tensor>& grad_scale = std::nullopt,
                          const std::optional<at::Tensor>& found_inf = std::nullopt,
                          const std::optional<at::Tensor>& lr_tensor = std::nullopt, bool write_unscaled_grads = true);

// One fused LAMB step (You et al. 2020, with the semantics of Apex's FusedLAMB): Adam moments (grad_averaging:
// m = beta1 m + (1 - beta1) g, else beta1 m + g; bias_correction), the update u = m^ / (sqrt(v^) + eps) plus
// weight_decay * w in adam_w_mode (else L2 weight decay added to the grad), then per tensor
// w -= lr * ratio * u with the trust ratio ||w|| / ||u|| (1 when either is 0; applied where weight_decay != 0, or
// everywhere with use_nvlamb). Grads are only read: divided by grad_scale and, when grad_norm (a one-element FP32
// tensor: the global norm of the unscaled grads, from grad_norm()) exceeds max_grad_norm > 0, by
// grad_norm / max_grad_norm. master_params / param_remainders, found_inf (skip everything, step counts included)
// and lr_tensor as adamw_step_. Norms are deterministic: CPU and CUDA give the same bits.
AMPKIT_API void lamb_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                           at::TensorList param_remainders, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                           at::TensorList state_steps, double lr, double beta1, double beta2, double weight_decay,
                           double eps, bool bias_correction = true, bool adam_w_mode = true, bool grad_averaging = true,
                           bool use_nvlamb = false, double max_grad_norm = 0.0,
                           const std::optional<at::Tensor>& grad_norm = std::nullopt,
                           const std::optional<at::Tensor>& grad_scale = std::nullopt,
                           const std::optional<at::Tensor>& found_inf = std::nullopt,
                           const std::optional<at::Tensor>& lr_tensor = std::nullopt);

// The L2 norm of all `grads` together (FP16/BF16/FP32, one device), divided by grad_scale (a one-element FP32
// tensor) when given: a 0-dim FP32 tensor on their device, no host sync. Squares are summed in double in one
// fixed order (NOTE [Deterministic norm] in kernels/amp_functors.h), so CPU and CUDA results are bit-identical.
// An empty list gives 0 (on the CPU, or on grad_scale's device).
AMPKIT_API at::Tensor grad_norm(at::TensorList grads, const std::optional<at::Tensor>& grad_scale = std::nullopt);

// New entries of a fused optimizer state for `param` (FP16, BF16 or FP32), one per name of `entries`, in that
// order: "step" (a 0-dim FP32 tensor holding `step`, on param's device), "exp_avg", "exp_avg_sq",
// "max_exp_avg_sq", "momentum_buffer" (zeros in param's layout: FP32, or the moments and momentum buffer in
// exp_avg_dtype / exp_avg_sq_dtype: BF16, or Byte for an 8-bit block-wise state, see below), "master_param" (an FP32 copy of param),
// "param_remainder" (int16 zeros in param's layout), "kahan_comp" (BF16 zeros, BF16 param only), "sr_seed" (a
// 0-dim int64 on param's device, drawn from torch's default CPU generator). Reads param only. (Not through the dispatcher: one kernel
// for every backend, registered as the op ampkit::make_optim_state.)
// The L2 norm of all `grads` together, on any number of devices, divided by grad_scale (when given): grad_norm()
// per device, combined in FP64 on the first grad's device; 0-dim FP32, no host sync. Undefined grads are skipped;
// none at all gives 0 on the CPU. (Not through the dispatcher, as make_optim_state.)
AMPKIT_API at::Tensor global_grad_norm(at::TensorList grads,
                                       const std::optional<at::Tensor>& grad_scale = std::nullopt);

AMPKIT_API std::vector<at::Tensor> make_optim_state(const at::Tensor& param, const std::vector<std::string>& entries,
                                                    double step = 0.0,
                                                    std::optional<at::ScalarType> exp_avg_dtype = std::nullopt,
                                                    std::optional<at::ScalarType> exp_avg_sq_dtype = std::nullopt);

// 8-bit block-wise optimizer states (NOTE [8-bit block-wise states] in kernels/blockwise8.h): parameters of
// kBlockwise8MinNumel elements or more get them where a group asks for torch.uint8 states (smaller ones keep FP32,
// as bitsandbytes and torchao do); the packed state of a tensor of `numel` elements has
// blockwise8_state_bytes(numel) bytes (the codes of its 256-element blocks, then their FP32 absmaxes).
constexpr int64_t kBlockwise8MinNumel = 4096;
AMPKIT_API int64_t blockwise8_state_bytes(int64_t numel);
// `values` (any floating dtype and shape) quantized into a packed 8-bit state: `is_signed` picks the dynamic map
// (true: a first moment or momentum buffer; false: a second moment, values >= 0). The bytes the fused steps store.
AMPKIT_API at::Tensor blockwise8_quantize(const at::Tensor& values, bool is_signed);
// The FP32 values of a packed 8-bit state, in the shape and layout of `like` (its numel must match the state's).
AMPKIT_API at::Tensor blockwise8_dequantize(const at::Tensor& state, bool is_signed, const at::Tensor& like);

// FP8 (docs/fp8.md). quantize: q = saturate(x * scale) cast to `dtype` (torch.float8_e4m3fn or float8_e5m2) with
// one rounding to nearest-even, values beyond the format's largest finite one and +-Inf saturating to +-max, NaN
// staying NaN; amax = max |x| of the unscaled x (a 0-dim FP32 tensor, NaN if any element is NaN); q_t, when
// `transpose` (2-D x only), the contiguous transpose of q, written in the same pass. x: FP32, BF16 or FP16, any
// strides; scale: one FP32 element (tensorwise) or x's shape with the last dimension 1 (rowwise), on x's device,
// read on the device. Reads x and scale only.
AMPKIT_API std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> fp8_quantize(const at::Tensor& x,
                                                                                      const at::Tensor& scale,
                                                                                      at::ScalarType dtype,
                                                                                      bool transpose = false);

// The FP8 formats' largest finite values, defined once: fp8_max(Float8_e4m3fn) 448, fp8_max(Float8_e5m2) 57344
// (another dtype: ValueError). fp8_dtypes(fp8_format): the dtypes of (input, weight, grad_output) under a recipe's
// fp8_format: "e4m3" all E4M3, "hybrid" E5M2 for grad_output (another format: ValueError).
AMPKIT_API double fp8_max(at::ScalarType dtype);
AMPKIT_API std::array<at::ScalarType, 3> fp8_dtypes(c10::string_view fp8_format);

// The scale for each element of `amax` (FP32, any shape; the result is a new contiguous FP32 tensor of its shape):
// a = max(amax, epsilon); a of 0, Inf or NaN gives 1; else (fp8_max / a) / 2^margin, an overflow giving FLT_MAX,
// rounded down to a power of two when power_of_2 (NOTE [FP8 scale] in kernels/fp8_functors.h). The default epsilon
// 1e-12 (torchao's) keeps an all-zero tensor from a zero amax: it gets the scale fp8_max / 1e-12.
AMPKIT_API at::Tensor fp8_compute_scale(const at::Tensor& amax, double fp8_max, double margin = 0.0,
                                        double epsilon = 1e-12, bool power_of_2 = false);

// What quantizing x with `scale` (as fp8_quantize takes it) to `dtype` loses, counted: an int64 tensor [saturated
// (|x * scale| beyond the format's largest finite value by more than half an ulp, so clamped; +-Inf included), flushed (x nonzero and |x * scale| at most
// half the smallest subnormal: it rounds to zero), NaN]. A diagnostic (ampkit.fp8's quantization report); reads x.
AMPKIT_API at::Tensor fp8_quantization_stats(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype);

// Delayed scaling's end-of-iteration update of every FP8 tensor in one call, on the device, no host sync: for each
// history (FP32, contiguous, rows first, the same number of rows for all; row 0 holds the current amaxes) and its
// scale (FP32, contiguous, one element per history column), amax = the maximum over the rows ("max") or row 0
// ("most_recent"); scale = (fp8_max / amax) / 2^margin, kept as it was when amax is 0, Inf or NaN, FLT_MAX on
// overflow; then the history rolls by -1 along the rows and row 0 is zeroed (NOTE [Delayed scaling update]).
// fp8_maxes: one per history, or one for all. Mutates amax_histories and scales.
AMPKIT_API void fp8_update_amax_history_and_scale_(at::TensorList amax_histories, at::TensorList scales,
                                                   c10::string_view amax_compute_algo, c10::ArrayRef<double> fp8_maxes,
                                                   double margin = 0.0);

// y = q(input) q(weight)^T (+ bias) on torch._scaled_mm, differentiable: dX = q(dY) q(weight), dW = q(input)^T q(dY),
// each operand quantized by fp8_quantize (NOTE [FP8 linear] in csrc/ops/fp8_linear.cpp): granularity "tensorwise"
// (one scale per operand) or "rowwise" (one scale per row of each GEMM's operands, along the dimension the GEMM
// sums over: each operand is quantized once per GEMM it enters). fp8_format
// "hybrid": E4M3 for input and weight, E5M2 for dY; "e4m3": E4M3 for all three. fp8_linear: current scaling, each
// operand's scale from its own amax (fp8_compute_scale with amax_epsilon and power_of_2). The output dtype is
// out_dtype, else autocast's when autocast is on for input's device, else input's.
AMPKIT_API at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias, c10::string_view fp8_format = "hybrid",
                                 double amax_epsilon = 1e-12, bool power_of_2 = false,
                                 std::optional<at::ScalarType> out_dtype = std::nullopt,
                                 c10::string_view granularity = "tensorwise");

// fp8_linear with delayed scaling: amax_histories and scales hold three tensors each, for input, weight and
// grad_output (a history of one column, [rows] or [rows, 1], FP32; a one-element FP32 scale). Each operand is
// quantized with its scale as it is (fp8_update_amax_history_and_scale_ updates them between iterations), and its
// amax goes into row 0 of its history (the maximum with what row 0 holds; grad_output's in the backward).
// Mutates amax_histories.
AMPKIT_API at::Tensor fp8_linear_delayed(const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, at::TensorList amax_histories,
                                         at::TensorList scales, c10::string_view fp8_format = "hybrid",
                                         std::optional<at::ScalarType> out_dtype = std::nullopt);

// What this build of ampkit contains: whether its CUDA kernels were compiled, for which architectures, and
// which instruction set the CPU loops use on this machine.
struct BuildInfo {
  bool cuda_compiled;
  const char* cuda_archs;
  const char* cpu_isa;
  const char* torch_version;
  // Elements of each tensor's scalar tail in the CPU optimizer steps: the width of the scalar tail of the kernels
  // torch runs in this process, 8 for AVX2 and AVX-512 (NOTE [torch's scalar tail] in kernels/optim_functors.h).
  int cpu_optim_tail_width;
};
AMPKIT_API BuildInfo build_info();

// Whether this build's CUDA kernels run on a GPU of compute capability major.minor: SASS compiled for the same
// major and a minor no higher, or PTX (for the last architecture of the list) of a capability no higher. Always
// false in a CPU-only build.
AMPKIT_API bool cuda_arch_supported(int major, int minor);

}  // namespace ampkit
