// The ops made of other ops, one kernel for every backend (CompositeExplicitAutograd: CPU, CUDA and Meta alike),
// which ampkit's optimizers call in an eager step and their compiled step (NOTE [Compiled steps] in
// python/ampkit/_compile.py) traces, so that both compute the same tensors: make_optim_state, the entries of a
// fused optimizer state (created where ampkit::optim::core's plan says), and global_grad_norm, the norm of grads
// over several devices (LAMB's clipping).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "ampkit/ops.h"

namespace ampkit {
namespace {

std::optional<at::Tensor> on_device(const std::optional<at::Tensor>& t, const at::Device& device) {
  if (!t) {
    return std::nullopt;
  }
  return t->device() == device ? *t : t->to(device, /*non_blocking=*/true);
}

}  // namespace

std::vector<at::Tensor> make_optim_state(const at::Tensor& param, const std::vector<std::string>& entries,
                                         double step) {
  static const char* const kNames[] = {
      "step",         "exp_avg",         "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
      "master_param", "param_remainder", "kahan_comp", "sr_seed"};
  for (size_t i = 0; i < entries.size(); ++i) {
    const bool known =
        std::any_of(std::begin(kNames), std::end(kNames), [&](const char* name) { return entries[i] == name; });
    TORCH_CHECK_VALUE(known, "ampkit::make_optim_state: entries[", i, "] must be one of step, exp_avg, exp_avg_sq, ",
                      "max_exp_avg_sq, momentum_buffer, master_param, param_remainder, kahan_comp, sr_seed, but got '",
                      entries[i], "'");
    TORCH_CHECK_VALUE(std::count(entries.begin(), entries.end(), entries[i]) == 1,
                      "ampkit::make_optim_state: ", "entries[", i, "] ('", entries[i], "') is named twice");
  }
  TORCH_CHECK_TYPE(
      param.scalar_type() == at::kHalf || param.scalar_type() == at::kBFloat16 || param.scalar_type() == at::kFloat,
      "ampkit::make_optim_state: param must be FP16, BF16 or FP32, but got ", param.scalar_type());
  std::vector<at::Tensor> out;
  out.reserve(entries.size());
  const auto fp32 = param.options().dtype(at::kFloat);
  for (const std::string& name : entries) {
    if (name == "step") {
      out.push_back(at::full({}, step, fp32));
    } else if (name == "master_param") {
      out.push_back(param.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    } else if (name == "param_remainder") {
      out.push_back(at::zeros_like(param, param.options().dtype(at::kShort), at::MemoryFormat::Preserve));
    } else if (name == "kahan_comp") {
      TORCH_CHECK_TYPE(param.scalar_type() == at::kBFloat16,
                       "ampkit::make_optim_state: kahan_comp needs a BFloat16 param, but got ", param.scalar_type());
      out.push_back(at::zeros_like(param, param.options(), at::MemoryFormat::Preserve));
    } else if (name == "sr_seed") {
      // Drawn from torch's default CPU generator: torch.manual_seed makes a run's rounding reproducible.
      const at::Tensor seed =
          at::randint(0, std::numeric_limits<int64_t>::max(), {}, at::TensorOptions().dtype(at::kLong));
      out.push_back(seed.to(param.device()));
    } else {  // the moments and the momentum buffer
      out.push_back(at::zeros_like(param, fp32, at::MemoryFormat::Preserve));
    }
  }
  return out;
}

at::Tensor global_grad_norm(at::TensorList grads, const std::optional<at::Tensor>& grad_scale) {
  std::vector<std::pair<at::Device, std::vector<at::Tensor>>> by_device;
  for (const auto& g : grads) {
    if (!g.defined()) {
      continue;
    }
    auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& d) { return d.first == g.device(); });
    if (it == by_device.end()) {
      by_device.emplace_back(g.device(), std::vector<at::Tensor>{});
      it = std::prev(by_device.end());
    }
    it->second.push_back(g);
  }
  if (by_device.empty()) {
    return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
  }
  if (by_device.size() == 1) {
    return grad_norm(by_device[0].second, on_device(grad_scale, by_device[0].first));
  }
  std::vector<at::Tensor> norms;
  for (const auto& [device, list] : by_device) {
    norms.push_back(grad_norm(list, on_device(grad_scale, device)).to(by_device[0].first, at::kDouble));
  }
  return at::stack(norms).square().sum().sqrt().to(at::kFloat);
}

}  // namespace ampkit

TORCH_LIBRARY_IMPL(ampkit, CompositeExplicitAutograd, m) {
  m.impl("make_optim_state", &ampkit::make_optim_state);
  m.impl("global_grad_norm", &ampkit::global_grad_norm);
}
