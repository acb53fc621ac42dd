// The arguments of each ampkit op as one plain struct (flash-attention's params-struct pattern): built once from
// the dispatcher's call by the kernel templates in op_kernels.h, validated by one check function per op (shared
// by the CPU, CUDA and Meta kernels), then handed to the backend's run function. Everything is checked before
// the first write, so a failed call changes nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <vector>

#include "../../kernels/amp_functors.h"
#include "../../kernels/fp8_functors.h"
#include "../../kernels/optim_functors.h"

namespace ampkit::detail {

// unscale_and_check_ (inv_scale defined) and check_finite_ (inv_scale undefined: read only).
struct UnscaleArgs {
  const char* op;
  at::TensorList grads;
  at::Tensor found_inf;
  at::Tensor inv_scale;
};

// cast_divide_ (inv_scale undefined: out = Out(src) / divisor) and cast_unscale_and_check_ (NOTE [Compressed
// all-reduce passes] in kernels/amp_functors.h).
struct CastArgs {
  const char* op;
  at::TensorList src;
  at::TensorList out;
  double divisor;
  at::Tensor found_inf;
  at::Tensor inv_scale;
};

// grad_stats (NOTE [Gradient statistics] in kernels/amp_functors.h).
struct GradStatsArgs {
  const char* op;
  at::TensorList grads;
  std::optional<at::Tensor> inv_scale;
};

// update_scale_ (hysteresis_tracker and stats undefined) and update_scale_hysteresis_.
struct UpdateScaleArgs {
  const char* op;
  at::Tensor scale;
  at::Tensor growth_tracker;
  at::Tensor hysteresis_tracker;
  at::Tensor stats;
  at::Tensor found_inf;
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int64_t hysteresis = 1;
  double min_scale = 0.0;
  double max_scale = 3.40282347e+38;
  bool dynamic = true;
};

// The tensor lists of one fused optimizer step. Optional lists are either empty or as long as params.
struct OptimLists {
  at::TensorList params;
  at::TensorList grads;
  at::TensorList master_params;     // optional
  at::TensorList param_remainders;  // optional, BF16 params only, exclusive with master_params
  at::TensorList exp_avgs;          // Adam: required; SGD: momentum buffers, required iff momentum != 0
  at::TensorList exp_avg_sqs;       // Adam: required; SGD: empty
  at::TensorList max_exp_avg_sqs;   // required iff amsgrad
  at::TensorList state_steps;       // Adam: required; SGD: optional (needed with momentum)
};

// The device scalars every fused step may read: the grad scale, the skip flag and a device learning rate.
struct StepScalars {
  std::optional<at::Tensor> grad_scale;
  std::optional<at::Tensor> found_inf;
  std::optional<at::Tensor> lr_tensor;
};

// The fused steps' hyper-parameters are the kernels' own parameter structs (kernels/optim_functors.h), written
// once: the op's lr is replaced by scalars.lr_tensor when one is given, and tail_width is the backend's (NOTE
// [torch's scalar tail]), both set by adam_params / sgd_params / lamb_params below.
struct AdamStepArgs {
  const char* op;
  OptimLists lists;
  kernels::AdamParams hparams;  // write_unscaled_grads: with grad_scale, the unscaled grads are stored in grads
  StepScalars scalars;
};

struct SgdStepArgs {
  const char* op;
  OptimLists lists;
  kernels::SgdParams hparams;
  StepScalars scalars;
};

// lamb_step_ (NOTE [LAMB passes] in kernels/optim_functors.h): lists.max_exp_avg_sqs is empty.
struct LambStepArgs {
  const char* op;
  OptimLists lists;
  kernels::LambParams hparams;
  std::optional<at::Tensor> grad_norm;
  StepScalars scalars;
};

// grad_norm: the global L2 norm of a list of grads, divided by grad_scale when given.
struct GradNormArgs {
  const char* op;
  at::TensorList grads;
  std::optional<at::Tensor> grad_scale;
};

// fp8_quantize: q = saturate(x * scale) in `dtype` (NOTE [Saturating FP8 cast]), amax = max |x|, and the
// transposed copy of a 2-D x when `transpose`.
struct Fp8QuantizeArgs {
  const char* op;
  at::Tensor x;
  at::Tensor scale;
  at::ScalarType dtype;
  bool transpose;
};

// fp8_compute_scale (NOTE [FP8 scale]): one scale per element of amax.
struct Fp8ComputeScaleArgs {
  const char* op;
  at::Tensor amax;
  double fp8_max;
  double margin;
  double epsilon;
  bool power_of_2;
};

// fp8_update_amax_history_and_scale_ (NOTE [Delayed scaling update]): fp8_maxes has one value per history, or one
// for all of them.
struct Fp8UpdateArgs {
  const char* op;
  at::TensorList amax_histories;
  at::TensorList scales;
  std::string_view amax_compute_algo;
  c10::ArrayRef<double> fp8_maxes;
  double margin;
};

// Throw (naming the op, the argument and the list index) unless the arguments are consistent.
void check(const UnscaleArgs& a);
void check(const UpdateScaleArgs& a);
void check(const CastArgs& a);
void check(const GradStatsArgs& a);
void check(const GradNormArgs& a);
void check(const Fp8QuantizeArgs& a);
void check(const Fp8ComputeScaleArgs& a);
void check(const Fp8UpdateArgs& a);
// The same for the fused steps, which also fill `tensors`, when given (the Meta kernels check only), with one
// kernel descriptor per parameter (zero-size params included: their step counts advance), built in the same
// pass as the checks (NOTE [One pass per parameter]).
// How many fused steps' checks ran in parts and how many gave up to one pass (NOTE [Checks in parts] in
// checks.cpp) since the process started; for tests.
struct CheckPartsCount {
  int64_t ran;
  int64_t gave_up;
};
CheckPartsCount checks_in_parts_count();
void check_and_build_descriptors(const AdamStepArgs& a, std::vector<kernels::OptimTensor>* tensors = nullptr);
void check_and_build_descriptors(const SgdStepArgs& a, std::vector<kernels::OptimTensor>* tensors = nullptr);
void check_and_build_descriptors(const LambStepArgs& a, std::vector<kernels::OptimTensor>* tensors = nullptr);

// The functors' parameters of checked arguments, with `lr` for the op's lr (the CPU reads lr_tensor on the host)
// and the backend's `tail_width` (NOTE [torch's scalar tail]).
kernels::UpdateScaleOp update_scale_op(const UpdateScaleArgs& a);
kernels::AdamParams adam_params(const AdamStepArgs& a, double lr, int tail_width);
kernels::SgdParams sgd_params(const SgdStepArgs& a, double lr, int tail_width);
kernels::LambParams lamb_params(const LambStepArgs& a, double lr);
kernels::Fp8Format fp8_format(at::ScalarType dtype);
kernels::Fp8ScaleOp fp8_scale_op(double fp8_max, double margin, double epsilon, bool power_of_2);
// The update's functor for history i (fp8_maxes[i], or fp8_maxes[0] for all).
kernels::Fp8HistoryOp fp8_history_op(const Fp8UpdateArgs& a, size_t i);

}  // namespace ampkit::detail
