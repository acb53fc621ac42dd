// ampkit::decorate: the O-level presets for LibTorch modules (see <ampkit/autocast.h>).
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <unordered_set>

#include "ampkit/autocast.h"

namespace ampkit {
namespace {

bool is_norm(const torch::nn::Module& m) {
  return m.as<torch::nn::BatchNorm1d>() || m.as<torch::nn::BatchNorm2d>() || m.as<torch::nn::BatchNorm3d>() ||
         m.as<torch::nn::LayerNorm>() || m.as<torch::nn::GroupNorm>() || m.as<torch::nn::InstanceNorm1d>() ||
         m.as<torch::nn::InstanceNorm2d>() || m.as<torch::nn::InstanceNorm3d>();
}

}  // namespace

void decorate(torch::nn::Module& module, OptLevel level, std::optional<c10::ScalarType> dtype_arg,
              bool keep_norm_fp32, const std::vector<std::string>& excluded) {
  c10::ScalarType dtype = c10::kBFloat16;
  if (dtype_arg.has_value()) {
    dtype = *dtype_arg;
  } else {
    // The device's low-precision dtype (BF16 on the CPU, FP16 on CUDA); a warning when it is not faster there.
    const auto params = module.parameters();
    const PrecisionSupport support = precision_support(params.empty() ? c10::Device(c10::kCPU) : params.front().device());
    dtype = support.lowp_dtype;
    if ((level == OptLevel::kO2 || level == OptLevel::kO3) && !support.fast) {
      TORCH_WARN_ONCE("ampkit::decorate: ", support.reason);
    }
  }
  TORCH_CHECK_VALUE(dtype == c10::kHalf || dtype == c10::kBFloat16,
                    "ampkit::decorate: dtype must be Half or BFloat16, but got ", dtype);
  if (level == OptLevel::kO0 || level == OptLevel::kO1) {
    return;
  }
  const auto named = module.named_modules("", /*include_self=*/true);
  for (const auto& name : excluded) {
    TORCH_CHECK_VALUE(named.contains(name), "ampkit::decorate: excluded module '", name, "' is not in the model");
  }
  // Modules kept FP32, with everything under them.
  std::unordered_set<const torch::nn::Module*> kept;
  for (const auto& item : named) {
    const bool excluded_here = std::find(excluded.begin(), excluded.end(), item.key()) != excluded.end();
    const bool norm_kept = level == OptLevel::kO2 && keep_norm_fp32 && is_norm(*item.value());
    if (excluded_here || norm_kept) {
      for (const auto& sub : item.value()->modules(/*include_self=*/true)) {
        kept.insert(sub.get());
      }
    }
  }
  const torch::NoGradGuard no_grad;
  for (const auto& item : named) {
    if (kept.count(item.value().get()) != 0) {
      continue;
    }
    for (auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (p.value().is_floating_point()) {
        p.value().set_data(p.value().to(dtype));
      }
    }
    for (auto& b : item.value()->named_buffers(/*recurse=*/false)) {
      if (b.value().is_floating_point()) {
        b.value().set_data(b.value().to(dtype));
      }
    }
  }
}

}  // namespace ampkit
