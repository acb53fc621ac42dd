// The ops made of other ops, one kernel for every backend (CompositeExplicitAutograd: CPU, CUDA and Meta alike),
// which ampkit's optimizers call in an eager step and their compiled step (NOTE [Compiled steps] in
// python/ampkit/_compile.py) traces, so that both compute the same tensors: make_optim_state, the entries of a
// fused optimizer state (created where ampkit::optim::core's plan says), and global_grad_norm, the norm of grads
// over several devices (LAMB's clipping).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "../../kernels/blockwise8.h"
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

std::vector<at::Tensor> make_optim_state(const at::Tensor& param, const std::vector<std::string>& entries, double step,
                                         std::optional<at::ScalarType> exp_avg_dtype,
                                         std::optional<at::ScalarType> exp_avg_sq_dtype) {
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
  for (const auto& [arg, dtype] : {std::pair("exp_avg_dtype", exp_avg_dtype), {"exp_avg_sq_dtype", exp_avg_sq_dtype}}) {
    TORCH_CHECK_TYPE(!dtype || *dtype == at::kFloat || *dtype == at::kBFloat16 || *dtype == at::kByte,
                     "ampkit::make_optim_state: ", arg, " must be None, Float, BFloat16 or Byte, but got ", *dtype);
  }
  std::vector<at::Tensor> out;
  out.reserve(entries.size());
  const auto fp32 = param.options().dtype(at::kFloat);
  // A moment in `dtype`: FP32 or BF16 zeros in param's layout, or a packed 8-bit state of zeros for params of
  // kBlockwise8MinNumel elements or more (FP32 below; NOTE [8-bit block-wise states] in kernels/blockwise8.h).
  const auto moment = [&](std::optional<at::ScalarType> dtype) {
    const at::ScalarType d = dtype.value_or(at::kFloat);
    if (d == at::kByte && param.sym_numel() >= kBlockwise8MinNumel) {  // SymInts: traced with fake tensors too
      const c10::SymInt bytes =
          (param.sym_numel() + (kernels::kQuantBlock - 1)) / kernels::kQuantBlock * (kernels::kQuantBlock + 4);
      return at::zeros_symint({bytes}, param.options().dtype(at::kByte));
    }
    return at::zeros_like(param, d == at::kBFloat16 ? param.options().dtype(at::kBFloat16) : fp32,
                          at::MemoryFormat::Preserve);
  };
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
    } else if (name == "exp_avg" || name == "momentum_buffer") {
      out.push_back(moment(exp_avg_dtype));
    } else if (name == "exp_avg_sq") {
      out.push_back(moment(exp_avg_sq_dtype));
    } else {  // max_exp_avg_sq
      out.push_back(at::zeros_like(param, fp32, at::MemoryFormat::Preserve));
    }
  }
  return out;
}

int64_t blockwise8_state_bytes(int64_t numel) {
  TORCH_CHECK_VALUE(numel >= 0, "ampkit::blockwise8_state_bytes: numel must be >= 0, but got ", numel);
  return kernels::blockwise8_bytes(numel);
}

at::Tensor blockwise8_quantize(const at::Tensor& values, bool is_signed) {
  TORCH_CHECK_TYPE(values.is_floating_point(),
                   "ampkit::blockwise8_quantize: values must be a floating tensor, but got ", values.scalar_type());
  // On the host with the kernels' own quantizer (a state conversion, not a step), so the bytes are the steps'.
  // In memory order (a state's element i is its parameter's i-th element in memory, whatever the layout).
  at::Tensor x = values.detach().to(at::kCPU, at::kFloat);
  if (!x.is_non_overlapping_and_dense()) {
    x = x.contiguous();
  }
  const int64_t n = x.numel();
  at::Tensor out = at::zeros({kernels::blockwise8_bytes(n)}, at::TensorOptions().dtype(at::kByte));
  const float* in = x.data_ptr<float>();
  uint8_t* codes = out.data_ptr<uint8_t>();
  const float* map = kernels::blockwise8_map(is_signed);
  const int64_t blocks = kernels::blockwise8_blocks(n);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t b0 = b * kernels::kQuantBlock;
    const int64_t b1 = std::min(n, b0 + kernels::kQuantBlock);
    float absmax = 0.f;
    for (int64_t i = b0; i < b1; ++i) {
      absmax = kernels::absmax_fold(absmax, in[i]);
    }
    const float scale = kernels::blockwise8_scale(absmax);
    std::memcpy(codes + blocks * kernels::kQuantBlock + 4 * b, &scale, 4);
    for (int64_t i = b0; i < b1; ++i) {
      codes[i] = kernels::blockwise8_code(in[i], scale, map);
    }
  }
  return out.to(values.device());
}

at::Tensor blockwise8_dequantize(const at::Tensor& state, bool is_signed, const at::Tensor& like) {
  const int64_t n = like.numel();
  TORCH_CHECK_VALUE(
      state.scalar_type() == at::kByte && state.dim() == 1 && state.numel() == kernels::blockwise8_bytes(n),
      "ampkit::blockwise8_dequantize: state must be a 1-D Byte tensor of ", kernels::blockwise8_bytes(n),
      " bytes (an 8-bit state of ", n, " elements), but got ", state.scalar_type(), " of shape ", state.sizes());
  const at::Tensor s = state.detach().to(at::kCPU).contiguous();
  at::Tensor out = at::empty_like(like, like.options().dtype(at::kFloat).device(at::kCPU), at::MemoryFormat::Preserve);
  if (!out.is_non_overlapping_and_dense()) {
    out = at::empty(like.sizes(), out.options());
  }
  const uint8_t* codes = s.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const float* map = kernels::blockwise8_map(is_signed);
  const int64_t blocks = kernels::blockwise8_blocks(n);
  for (int64_t i = 0; i < n; ++i) {
    float scale;
    std::memcpy(&scale, codes + blocks * kernels::kQuantBlock + 4 * (i / kernels::kQuantBlock), 4);
    o[i] = map[codes[i]] * scale;
  }
  return out.to(like.device());
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
