// Argument checks of the FP8 ops (fp8_quantize, fp8_compute_scale, fp8_update_amax_history_and_scale_), shared by
// their CPU, CUDA and Meta kernels, fp8_quantize's result tensors, and the functors' parameters built from checked
// arguments.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "alias_check.h"
#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

void check_strided(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, " must be a defined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, " must be a strided tensor, but got layout ",
              t.layout());
}

bool fits_float(double v) { return std::isfinite(v) && std::isfinite(static_cast<float>(v)); }

void check_fp8_max(const char* op, const char* arg, double fp8_max) {
  TORCH_CHECK_VALUE(fits_float(fp8_max) && fp8_max > 0, "ampkit::", op, ": ", arg,
                    " must be a finite number > 0 that FP32 holds (448 for E4M3, 57344 for E5M2), but got ", fp8_max);
}

void check_margin(const char* op, double margin) {
  TORCH_CHECK_VALUE(std::isfinite(margin) && fits_float(std::exp2(margin)) && static_cast<float>(std::exp2(margin)) > 0,
                    "ampkit::", op, ": margin must be finite with 2^margin a normal FP32 number, but got ", margin);
}

}  // namespace

kernels::Fp8Format fp8_format(at::ScalarType dtype) {
  return dtype == at::ScalarType::Float8_e5m2 ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
}

kernels::Fp8QuantizeParams fp8_quantize_params(const Fp8QuantizeArgs& a, const at::Tensor& x, const at::Tensor& scale,
                                               const Fp8QuantizeResult& out) {
  const auto& q_t = std::get<2>(out);
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  return {x.const_data_ptr(),
          kernel_dtype(x.scalar_type()),
          x.numel() / cols,
          cols,
          scale.const_data_ptr<float>(),
          scale.numel() != 1,
          static_cast<uint8_t*>(std::get<0>(out).mutable_data_ptr()),
          q_t.has_value() ? static_cast<uint8_t*>(q_t->mutable_data_ptr()) : nullptr,
          std::get<1>(out).mutable_data_ptr<float>(),
          fp8_format(a.dtype)};
}

kernels::Fp8ScaleOp fp8_scale_op(double fp8_max, double margin, double epsilon, bool power_of_2) {
  return kernels::Fp8ScaleOp{static_cast<float>(fp8_max), static_cast<float>(std::exp2(margin)),
                             static_cast<float>(epsilon), power_of_2};
}

kernels::Fp8HistoryOp fp8_history_op(const Fp8UpdateArgs& a, size_t i) {
  const double fp8_max = a.fp8_maxes.size() == 1 ? a.fp8_maxes[0] : a.fp8_maxes[i];
  return kernels::Fp8HistoryOp{fp8_scale_op(fp8_max, a.margin, 0.0, false), a.amax_histories[i].size(0),
                               a.amax_compute_algo == "most_recent"};
}

Fp8QuantizeResult fp8_quantize_result(const Fp8QuantizeArgs& a) {
  const auto options = a.x.options().dtype(a.dtype);
  at::Tensor q = at::empty_symint(a.x.sym_sizes(), options);
  at::Tensor amax = at::zeros({}, a.x.options().dtype(at::kFloat));
  std::optional<at::Tensor> q_t;
  if (a.transpose) {
    q_t = at::empty_symint({a.x.sym_size(1), a.x.sym_size(0)}, options);
  }
  return {q, amax, q_t};
}

void check(const Fp8QuantizeArgs& a) {
  check_strided(a.op, "x", a.x);
  const auto xt = a.x.scalar_type();
  TORCH_CHECK_TYPE(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, "ampkit::", a.op,
                   ": x must be Float, BFloat16 or Half, but got ", xt);
  check_strided(a.op, "scale", a.scale);
  TORCH_CHECK_TYPE(a.scale.scalar_type() == at::kFloat, "ampkit::", a.op, ": scale must be a Float tensor, but got ",
                   a.scale.scalar_type());
  TORCH_CHECK(a.scale.device() == a.x.device(), "ampkit::", a.op, ": scale must be on the device of x (", a.x.device(),
              "), but is on ", a.scale.device());
  if (a.scale.sym_numel() != 1) {
    // Rowwise: one scale per row of x, x's shape with the last dimension 1.
    bool rowwise = a.x.dim() >= 1 && a.scale.dim() == a.x.dim() && a.scale.sym_size(-1) == 1;
    for (int64_t d = 0; rowwise && d + 1 < a.x.dim(); ++d) {
      rowwise = a.scale.sym_size(d) == a.x.sym_size(d);
    }
    TORCH_CHECK_VALUE(rowwise, "ampkit::", a.op, ": scale must have one element (tensorwise) or x's shape with the ",
                      "last dimension 1 (rowwise: ", a.x.sym_sizes(), " -> [..., 1]), but got shape ",
                      a.scale.sym_sizes());
  }
  TORCH_CHECK_VALUE(a.dtype == at::ScalarType::Float8_e4m3fn || a.dtype == at::ScalarType::Float8_e5m2,
                    "ampkit::", a.op, ": dtype must be torch.float8_e4m3fn or torch.float8_e5m2, but got ", a.dtype);
  TORCH_CHECK_VALUE(!a.transpose || a.x.dim() == 2, "ampkit::", a.op,
                    ": transpose=True needs a 2-D x, but x has shape ", a.x.sym_sizes());
}

void check(const Fp8ComputeScaleArgs& a) {
  check_strided(a.op, "amax", a.amax);
  TORCH_CHECK_TYPE(a.amax.scalar_type() == at::kFloat, "ampkit::", a.op, ": amax must be a Float tensor, but got ",
                   a.amax.scalar_type());
  check_fp8_max(a.op, "fp8_max", a.fp8_max);
  check_margin(a.op, a.margin);
  TORCH_CHECK_VALUE(fits_float(a.epsilon) && a.epsilon >= 0, "ampkit::", a.op,
                    ": epsilon must be a finite number >= 0 that FP32 holds, but got ", a.epsilon);
}

void check(const Fp8UpdateArgs& a) {
  const size_t n = a.amax_histories.size();
  TORCH_CHECK_VALUE(a.scales.size() == n, "ampkit::", a.op, ": scales must have one tensor per amax history (", n,
                    "), but has ", a.scales.size());
  TORCH_CHECK_VALUE(a.amax_compute_algo == "max" || a.amax_compute_algo == "most_recent", "ampkit::", a.op,
                    ": amax_compute_algo must be 'max' or 'most_recent', but got '", a.amax_compute_algo, "'");
  check_margin(a.op, a.margin);
  if (n == 0) {
    return;
  }
  TORCH_CHECK_VALUE(a.fp8_maxes.size() == n || a.fp8_maxes.size() == 1, "ampkit::", a.op,
                    ": fp8_maxes must have one value per amax history (", n, ") or one for all, but has ",
                    a.fp8_maxes.size());
  for (size_t i = 0; i < a.fp8_maxes.size(); ++i) {
    check_fp8_max(a.op, ("fp8_maxes[" + std::to_string(i) + "]").c_str(), a.fp8_maxes[i]);
  }
  const at::Tensor& first = a.amax_histories[0];
  TORCH_CHECK(first.defined() && first.dim() >= 1, "ampkit::", a.op,
              ": amax_histories[0] must be a defined tensor of at least one dimension (history rows first)");
  AliasCheck alias(a.op);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& h = a.amax_histories[i];
    const at::Tensor& s = a.scales[i];
    TORCH_CHECK(h.defined() && s.defined(), "ampkit::", a.op, ": amax_histories[", i, "] and scales[", i,
                "] must be defined");
    TORCH_CHECK(h.layout() == at::kStrided && s.layout() == at::kStrided, "ampkit::", a.op, ": amax_histories[", i,
                "] and scales[", i, "] must be strided tensors");
    TORCH_CHECK_TYPE(h.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat, "ampkit::", a.op,
                     ": amax_histories[", i, "] and scales[", i, "] must be Float tensors, but got ", h.scalar_type(),
                     " and ", s.scalar_type());
    TORCH_CHECK(h.device() == first.device() && s.device() == first.device(), "ampkit::", a.op, ": amax_histories[", i,
                "] and scales[", i, "] must be on ", first.device(), " like amax_histories[0], but are on ", h.device(),
                " and ", s.device());
    TORCH_CHECK(h.is_contiguous() && s.is_contiguous(), "ampkit::", a.op, ": amax_histories[", i, "] and scales[", i,
                "] must be contiguous (they are updated in place)");
    TORCH_CHECK_VALUE(h.dim() >= 1 && h.sym_size(0) == first.sym_size(0) && h.sym_size(0) >= 1, "ampkit::", a.op,
                      ": amax_histories[", i, "] must have ", first.sym_size(0),
                      " rows like amax_histories[0] (at least one), but has shape ", h.sym_sizes());
    TORCH_CHECK_VALUE(s.sym_numel() * h.sym_size(0) == h.sym_numel(), "ampkit::", a.op, ": scales[", i,
                      "] must have one element per column of amax_histories[", i, "] (", h.sym_numel() / h.sym_size(0),
                      "), but has ", s.sym_numel());
    alias.add("amax_histories", h, static_cast<int64_t>(i));
    alias.add("scales", s, static_cast<int64_t>(i));
  }
  alias.check();
}

}  // namespace ampkit::detail
