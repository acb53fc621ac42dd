// A parameter's optimizer state: ParamState's entries by name, the O2 master, the BF16 weight + int16 remainder
// conversions, and the checks and conversions of a loaded state (<ampkit/optim_core.h>).
#include <ATen/ATen.h>

#include <string>

#include "ampkit/ops.h"
#include "ampkit/optim_core.h"

namespace ampkit::optim::core {
namespace {

bool moment(const std::string& name) { return name == "exp_avg" || name == "exp_avg_sq" || name == "momentum_buffer"; }

// A saved packed 8-bit state of a moment of p (NOTE [8-bit block-wise states] in kernels/blockwise8.h).
bool packed_state(const std::string& name, const at::Tensor& value, const at::Tensor& p) {
  return moment(name) && value.scalar_type() == at::kByte && value.dim() == 1 &&
         value.numel() == ampkit::blockwise8_state_bytes(p.numel());
}

bool fp32_entry(const std::string& name) {
  return name != "param_remainder" && name != "kahan_comp" && name != "sr_seed";
}

// The dtype of an entry that is not FP32.
at::ScalarType exact_dtype(const std::string& name) {
  return name == "param_remainder" ? at::kShort : name == "kahan_comp" ? at::kBFloat16 : at::kLong;
}

// value as an entry of p's state: a copy in `dtype` on p's device, in p's layout where it has p's shape.
at::Tensor in_layout(const at::Tensor& value, const at::Tensor& p, at::ScalarType dtype) {
  if (value.dim() != 0 && value.sizes() == p.sizes() && value.strides() != p.strides()) {
    // e.g. a channels_last state for a contiguous parameter: the kernels take the parameter's layout.
    return at::empty_like(p, p.options().dtype(dtype)).copy_(value);
  }
  return value.to(p.device(), dtype, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

bool ParamState::empty() const {
  return !(step.defined() || exp_avg.defined() || exp_avg_sq.defined() || max_exp_avg_sq.defined() ||
           momentum_buffer.defined() || master_param.defined() || param_remainder.defined() || kahan_comp.defined() ||
           sr_seed.defined());
}

const std::vector<std::pair<const char*, ParamState::Field>>& ParamState::fields() {
  static const std::vector<std::pair<const char*, Field>> f{{"step", &ParamState::step},
                                                            {"exp_avg", &ParamState::exp_avg},
                                                            {"exp_avg_sq", &ParamState::exp_avg_sq},
                                                            {"max_exp_avg_sq", &ParamState::max_exp_avg_sq},
                                                            {"momentum_buffer", &ParamState::momentum_buffer},
                                                            {"master_param", &ParamState::master_param},
                                                            {"param_remainder", &ParamState::param_remainder},
                                                            {"kahan_comp", &ParamState::kahan_comp},
                                                            {"sr_seed", &ParamState::sr_seed}};
  return f;
}

at::Tensor* ParamState::entry(const std::string& name) {
  for (const auto& [n, field] : fields()) {
    if (name == n) {
      return &(this->*field);
    }
  }
  return nullptr;
}

const std::vector<std::string>& ParamState::names() {
  static const std::vector<std::string> n = [] {
    std::vector<std::string> out;
    for (const auto& f : fields()) {
      out.emplace_back(f.first);
    }
    return out;
  }();
  return n;
}

void init_master(const at::Tensor& param, ParamState& state) {
  state.master_param = make_optim_state(param, {"master_param"})[0];
}

bool takes_master(const GroupConfig& config) {
  return config.master_weights != MasterWeights::kStochastic && config.master_weights != MasterWeights::kKahan;
}

at::Tensor remainder_of(const at::Tensor& param, const at::Tensor& master) {
  TORCH_CHECK_VALUE(
      param.scalar_type() == at::kBFloat16 && master.scalar_type() == at::kFloat && param.sizes() == master.sizes(),
      "ampkit::optim::core::remainder_of: expected a BFloat16 parameter and an FP32 master of its "
      "shape, but got ",
      param.scalar_type(), " ", param.sizes(), " and ", master.scalar_type(), " ", master.sizes());
  const at::Tensor weight16 = param.detach();
  const at::Tensor bits = master.contiguous().view(at::kInt).to(at::kLong).bitwise_and(0xFFFFFFFFLL);
  const at::Tensor high = weight16.contiguous().view(at::kShort).to(at::kLong).bitwise_and(0xFFFF).__lshift__(16);
  at::Tensor rem = bits - high;
  const at::Tensor foreign = rem.lt(-32768).logical_or(rem.gt(32768));
  const at::Tensor split_weight = (bits.__rshift__(16) + bits.bitwise_and(0xFFFF).__rshift__(15)).bitwise_and(0xFFFF);
  const at::Tensor split_rem = bits.bitwise_and(0xFFFF);
  const at::Tensor weight = at::where(foreign, split_weight, high.__rshift__(16));
  rem = at::where(foreign, split_rem, rem.clamp_max(32767));
  weight16.view(at::kShort).copy_(weight.to(at::kShort).view(param.sizes()));  // the same bits unless foreign
  return at::empty_like(param, at::TensorOptions().dtype(at::kShort), at::MemoryFormat::Preserve)
      .copy_(rem.to(at::kShort).view(param.sizes()));
}

at::Tensor master_from_remainder(const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK_VALUE(param.scalar_type() == at::kBFloat16 && remainder.scalar_type() == at::kShort &&
                        param.sizes() == remainder.sizes(),
                    "ampkit::optim::core::master_from_remainder: expected a BFloat16 parameter and an int16 "
                    "remainder of its shape, but got ",
                    param.scalar_type(), " ", param.sizes(), " and ", remainder.scalar_type(), " ", remainder.sizes());
  const at::Tensor bits =
      param.detach().contiguous().view(at::kShort).to(at::kInt).__lshift__(16) + remainder.contiguous().to(at::kInt);
  return bits.view(at::kFloat).view(param.sizes());
}

void check_loaded_state(const GroupConfig& c, const std::string& where, const at::Tensor& p,
                        const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  const std::string prefix = std::string(c.optimizer) + ".load_state_dict: " + where;
  bool has[3] = {false, false, false};  // step, exp_avg, exp_avg_sq
  for (const auto& [name, value] : entries) {
    if (name == "step" || name == "sr_seed") {
      TORCH_CHECK_VALUE(value.numel() == 1, prefix, "['", name, "'] must have one element, but has ", value.numel());
    } else if (moment(name) && value.scalar_type() == at::kByte) {
      TORCH_CHECK_VALUE(packed_state(name, value, p), prefix, "['", name, "'] (an 8-bit block-wise state) must be ",
                        "a 1-D Byte tensor of ", ampkit::blockwise8_state_bytes(p.numel()),
                        " bytes for a parameter of ", p.numel(), " elements, but has shape ", value.sizes());
    } else if (ParamState().entry(name) != nullptr) {
      TORCH_CHECK_VALUE(value.sizes() == p.sizes(), prefix, "['", name, "'] must have the parameter's shape ",
                        p.sizes(), ", but has ", value.sizes());
    }
    if (ParamState().entry(name) != nullptr && !(moment(name) && value.scalar_type() == at::kByte)) {
      if (fp32_entry(name)) {
        TORCH_CHECK_VALUE(value.is_floating_point() || (value.is_complex() && p.is_complex()), prefix, "['", name,
                          "'] must be a floating tensor, but is ", value.scalar_type());
      } else {
        TORCH_CHECK_VALUE(value.scalar_type() == exact_dtype(name), prefix, "['", name, "'] must be ",
                          exact_dtype(name), ", but is ", value.scalar_type());
      }
    }
    has[0] |= name == "step";
    has[1] |= name == "exp_avg";
    has[2] |= name == "exp_avg_sq";
  }
  if (c.algorithm != Algorithm::kSGD && (has[0] || has[1] || has[2])) {
    TORCH_CHECK_VALUE(has[0] && has[1] && has[2], prefix, " has", has[0] ? " step" : "", has[1] ? " exp_avg" : "",
                      has[2] ? " exp_avg_sq" : "", " but not", has[0] ? "" : " step", has[1] ? "" : " exp_avg",
                      has[2] ? "" : " exp_avg_sq", ": a partial state would silently restart from zeros");
  }
}

at::ScalarType state_dtype(const GroupConfig& c, const std::string& name, const at::Tensor& p) {
  const at::ScalarType d = name == "exp_avg_sq" ? c.exp_avg_sq_dtype : c.exp_avg_dtype;
  return d == at::kByte && p.numel() < ampkit::kBlockwise8MinNumel ? at::kFloat : d;
}

at::Tensor loaded_entry(const GroupConfig& c, const std::string& name, const at::Tensor& value, const at::Tensor& p) {
  if (!moment(name)) {
    return loaded_entry(name, value, p);
  }
  const bool is_signed = name != "exp_avg_sq";
  const at::ScalarType want = state_dtype(c, name, p);
  if (packed_state(name, value, p)) {
    if (want == at::kByte) {
      return value.to(p.device(), at::kByte, /*non_blocking=*/false, /*copy=*/true);  // bit for bit
    }
    return in_layout(ampkit::blockwise8_dequantize(value, is_signed, p), p, want);
  }
  if (want == at::kByte) {
    return ampkit::blockwise8_quantize(in_layout(value, p, at::kFloat), is_signed).to(p.device());
  }
  return in_layout(value, p, want);  // a BF16 value into BF16: the same bits
}

at::Tensor loaded_entry(const std::string& name, const at::Tensor& value, const at::Tensor& p) {
  return in_layout(value, p, fp32_entry(name) ? at::kFloat : value.scalar_type());
}

}  // namespace ampkit::optim::core
