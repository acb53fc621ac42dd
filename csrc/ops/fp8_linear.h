// The Autograd kernels of fp8_linear and fp8_linear_delayed (fp8_linear.cpp; NOTE [FP8 linear]): unlike the other
// ops' kernels on that key, they record a C++ autograd function. autograd_kernels.cpp registers them. And the
// FP8 widening that the layer's CPU GEMMs run on.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace ampkit::detail {

at::Tensor fp8_linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               c10::string_view fp8_format, double amax_epsilon, bool power_of_2,
                               std::optional<at::ScalarType> out_dtype, c10::string_view granularity);

at::Tensor fp8_linear_delayed_autograd(const at::Tensor& input, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, at::TensorList amax_histories,
                                       at::TensorList scales, c10::string_view fp8_format,
                                       std::optional<at::ScalarType> out_dtype);

// The FP32 values of a CPU FP8 tensor (E4M3FN or E5M2), exact, contiguous (fp8_cpu.cpp).
at::Tensor fp8_to_float_cpu(const at::Tensor& q);

}  // namespace ampkit::detail
