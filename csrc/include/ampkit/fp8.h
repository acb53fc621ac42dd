// FP8 training for LibTorch programs (docs/fp8.md): the scaling recipes and Float8Linear, a torch::nn linear layer
// whose three GEMMs run in FP8 on torch._scaled_mm through the ops of <ampkit/ops.h> (fp8_linear,
// fp8_linear_delayed, fp8_update_amax_history_and_scale_). ampkit.fp8 in Python is built on the same ops.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <cstdint>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

#include "ampkit/export.h"

namespace ampkit::fp8 {

// Current (dynamic) scaling: every operand's scale from its own amax in the same call. fp8_format "hybrid" (E4M3
// for input and weight, E5M2 for output gradients) or "e4m3" (E4M3 for all). amax_epsilon clamps the amax from
// below (1e-12, so an all-zero tensor never divides by zero); power_of_2 rounds each scale down to a power of two.
// granularity "tensorwise" (one scale per tensor) or "rowwise" (one per row of each GEMM operand, along the
// dimension the GEMM sums over; NOTE [FP8 linear]).
struct CurrentScaling {
  TORCH_ARG(std::string, granularity) = "tensorwise";
  TORCH_ARG(bool, power_of_2) = false;
  TORCH_ARG(double, amax_epsilon) = 1e-12;
  TORCH_ARG(std::string, fp8_format) = "hybrid";
};

// Delayed scaling (Transformer Engine's default): each operand is quantized with a scale computed from the amaxes
// of earlier iterations, kept in an amax history of amax_history_len rows; amax_compute_algo "max" (over the
// history) or "most_recent"; scale = (fp8_max / amax) / 2^margin.
struct DelayedScaling {
  TORCH_ARG(int64_t, amax_history_len) = 1024;
  TORCH_ARG(double, margin) = 0.0;
  TORCH_ARG(std::string, amax_compute_algo) = "max";
  TORCH_ARG(std::string, fp8_format) = "hybrid";
};

using Recipe = std::variant<CurrentScaling, DelayedScaling>;

// The largest finite values of the FP8 formats a recipe's fp8_format uses for (input, weight, grad_output):
// "hybrid" {448, 448, 57344}, "e4m3" {448, 448, 448}. Throws for another name.
AMPKIT_API std::array<double, 3> fp8_maxes(const std::string& fp8_format);

// Why a linear layer of these features cannot run in FP8 ("" when it can): torch._scaled_mm takes dimensions that
// are multiples of 16.
AMPKIT_API std::string unsupported_reason(int64_t in_features, int64_t out_features);

// Throws unless Float8Linear implements `recipe` (names the setting that is not supported).
AMPKIT_API void check_recipe(const Recipe& recipe);

// A linear layer y = x W^T + b computed in FP8 (NOTE [FP8 linear] in csrc/ops/fp8_linear.cpp); parameters as
// torch::nn::Linear's (same initialisation). With delayed scaling it holds, as buffers (saved with the module),
// amax_history_{input,weight,grad_output} ([amax_history_len] FP32) and scale_{input,weight,grad_output} ([1]
// FP32, starting at 1); in training mode, each forward first updates the scales from the histories
// (fp8_update_amax_history_and_scale_), so the scales of iteration i come from the amaxes of iterations before i.
class AMPKIT_API Float8LinearImpl : public torch::nn::Cloneable<Float8LinearImpl> {
 public:
  Float8LinearImpl(int64_t in_features, int64_t out_features)
      : Float8LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  explicit Float8LinearImpl(const torch::nn::LinearOptions& options, Recipe recipe = CurrentScaling());

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  // input: [..., in_features], FP32, BF16 or FP16; the output has input's dtype (autocast's under autocast).
  at::Tensor forward(const at::Tensor& input);
  // As torch::nn::Module's, but the scaling buffers stay FP32 (their precision decides the scales); they move to
  // the device as the rest.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  using torch::nn::Module::to;

  torch::nn::LinearOptions options;
  Recipe recipe;
  at::Tensor weight;
  at::Tensor bias;
  // Delayed scaling only (undefined otherwise).
  at::Tensor amax_history_input;
  at::Tensor amax_history_weight;
  at::Tensor amax_history_grad_output;
  at::Tensor scale_input;
  at::Tensor scale_weight;
  at::Tensor scale_grad_output;
};

TORCH_MODULE(Float8Linear);

// Row 0 of every amax history of `module`'s delayed-scaling Float8Linear layers (itself included): the amaxes this
// iteration recorded, as views, in module order (input, weight, grad_output per layer). Data-parallel ranks make
// their scales agree by reducing them (MAX) once per iteration, after backward:
//   scaler.reduce_with_found_inf(ampkit::fp8::current_amaxes(*model));  // in the scaler's found_inf all-reduce
//   ampkit::distributed::all_reduce_max(ampkit::fp8::current_amaxes(*model), process_group);  // without a scaler
AMPKIT_API std::vector<at::Tensor> current_amaxes(const torch::nn::Module& module);

}  // namespace ampkit::fp8
