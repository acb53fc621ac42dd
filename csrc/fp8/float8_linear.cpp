// ampkit::fp8::Float8Linear and the recipe helpers of <ampkit/fp8.h>: a torch::nn module over the FP8 ops.
#include <torch/nn/init.h>
#include <torch/types.h>

#include <cmath>

#include "ampkit/fp8.h"
#include "ampkit/ops.h"

namespace ampkit::fp8 {

std::array<double, 3> fp8_maxes(const std::string& fp8_format) {
  TORCH_CHECK_VALUE(fp8_format == "hybrid" || fp8_format == "e4m3",
                    "ampkit::fp8: fp8_format must be 'hybrid' or 'e4m3', but got '", fp8_format, "'");
  const auto dtypes = ampkit::fp8_dtypes(fp8_format);
  return {ampkit::fp8_max(dtypes[0]), ampkit::fp8_max(dtypes[1]), ampkit::fp8_max(dtypes[2])};
}

std::string unsupported_reason(int64_t in_features, int64_t out_features) {
  if (in_features % 16 != 0 || out_features % 16 != 0 || in_features <= 0 || out_features <= 0) {
    return "torch._scaled_mm needs in_features and out_features to be positive multiples of 16, but got " +
           std::to_string(in_features) + " and " + std::to_string(out_features);
  }
  return "";
}

void check_recipe(const Recipe& recipe) {
  if (const auto* current = std::get_if<CurrentScaling>(&recipe)) {
    TORCH_CHECK_VALUE(current->granularity() == "tensorwise" || current->granularity() == "rowwise",
                      "ampkit::fp8: CurrentScaling granularity must be 'tensorwise' or 'rowwise', but got '",
                      current->granularity(), "'");
    TORCH_CHECK_VALUE(std::isfinite(current->amax_epsilon()) && current->amax_epsilon() >= 0,
                      "ampkit::fp8: amax_epsilon must be a finite number >= 0, but got ", current->amax_epsilon());
    fp8_maxes(current->fp8_format());
  } else {
    const auto& delayed = std::get<DelayedScaling>(recipe);
    TORCH_CHECK_VALUE(delayed.amax_history_len() >= 1, "ampkit::fp8: amax_history_len must be >= 1, but got ",
                      delayed.amax_history_len());
    TORCH_CHECK_VALUE(delayed.amax_compute_algo() == "max" || delayed.amax_compute_algo() == "most_recent",
                      "ampkit::fp8: amax_compute_algo must be 'max' or 'most_recent', but got '",
                      delayed.amax_compute_algo(), "'");
    TORCH_CHECK_VALUE(std::isfinite(delayed.margin()), "ampkit::fp8: margin must be finite, but got ",
                      delayed.margin());
    fp8_maxes(delayed.fp8_format());
  }
}

Float8LinearImpl::Float8LinearImpl(const torch::nn::LinearOptions& options_, Recipe recipe_)
    : options(options_), recipe(std::move(recipe_)) {
  check_recipe(recipe);
  const std::string reason = unsupported_reason(options.in_features(), options.out_features());
  TORCH_CHECK_VALUE(reason.empty(), "ampkit::fp8::Float8Linear: ", reason);
  reset();
}

void Float8LinearImpl::reset() {
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias()) {
    bias = register_parameter("bias", torch::empty(options.out_features()));
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  if (const auto* delayed = std::get_if<DelayedScaling>(&recipe)) {
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
    const int64_t rows = delayed->amax_history_len();
    amax_history_input = register_buffer("amax_history_input", torch::zeros({rows}, f32));
    amax_history_weight = register_buffer("amax_history_weight", torch::zeros({rows}, f32));
    amax_history_grad_output = register_buffer("amax_history_grad_output", torch::zeros({rows}, f32));
    scale_input = register_buffer("scale_input", torch::ones({1}, f32));
    scale_weight = register_buffer("scale_weight", torch::ones({1}, f32));
    scale_grad_output = register_buffer("scale_grad_output", torch::ones({1}, f32));
  }
  reset_parameters();
}

// torch::nn::Linear's initialisation.
void Float8LinearImpl::reset_parameters() {
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    const auto [fan_in, fan_out] = torch::nn::init::_calculate_fan_in_and_fan_out(weight);
    (void)fan_out;
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

void Float8LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "ampkit::fp8::Float8Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
         << ", recipe=" << (std::holds_alternative<DelayedScaling>(recipe) ? "delayed" : "current") << ")";
}

at::Tensor Float8LinearImpl::forward(const at::Tensor& input) {
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (const auto* current = std::get_if<CurrentScaling>(&recipe)) {
    return ampkit::fp8_linear(input, weight, b, current->fp8_format(), current->amax_epsilon(), current->power_of_2(),
                              std::nullopt, current->granularity());
  }
  const auto& delayed = std::get<DelayedScaling>(recipe);
  const std::vector<at::Tensor> histories{amax_history_input, amax_history_weight, amax_history_grad_output};
  const std::vector<at::Tensor> scales{scale_input, scale_weight, scale_grad_output};
  if (is_training()) {
    const auto maxes = fp8_maxes(delayed.fp8_format());
    ampkit::fp8_update_amax_history_and_scale_(histories, scales, delayed.amax_compute_algo(), maxes, delayed.margin());
  }
  return ampkit::fp8_linear_delayed(input, weight, b, histories, scales, delayed.fp8_format());
}

namespace {

// After a cast of `layer`: its scaling buffers back to FP32 (from their values before it), on their new device.
void restore_fp32_buffers(Float8LinearImpl& layer, const std::vector<at::Tensor>& before) {
  size_t i = 0;
  for (auto& b : layer.named_buffers(/*recurse=*/false)) {
    if (b.value().scalar_type() != at::kFloat) {
      b.value().set_data(before[i].to(b.value().device()));
    }
    ++i;
  }
}

std::vector<at::Tensor> buffer_copies(const Float8LinearImpl& layer) {
  std::vector<at::Tensor> out;
  for (const auto& b : layer.named_buffers(/*recurse=*/false)) {
    out.push_back(b.value().clone());
  }
  return out;
}

}  // namespace

void Float8LinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  const auto before = buffer_copies(*this);
  torch::nn::Module::to(device, dtype, non_blocking);
  restore_fp32_buffers(*this, before);
}

void Float8LinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  const auto before = buffer_copies(*this);
  torch::nn::Module::to(dtype, non_blocking);
  restore_fp32_buffers(*this, before);
}

std::vector<at::Tensor> current_amaxes(const torch::nn::Module& module) {
  std::vector<at::Tensor> rows;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    const auto* layer = dynamic_cast<const Float8LinearImpl*>(m.get());
    if (layer != nullptr && std::holds_alternative<DelayedScaling>(layer->recipe)) {
      for (const at::Tensor* h :
           {&layer->amax_history_input, &layer->amax_history_weight, &layer->amax_history_grad_output}) {
        rows.push_back(h->view({-1}).narrow(0, 0, 1));
      }
    }
  }
  return rows;
}

}  // namespace ampkit::fp8
