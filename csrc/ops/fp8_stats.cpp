// fp8_quantization_stats: how many elements a quantization to FP8 saturates, flushes to zero or finds NaN, the
// counts behind ampkit.fp8's quantization report. Made of ATen ops, one kernel for every backend
// (CompositeExplicitAutograd: CPU, CUDA and Meta); a diagnostic, run only when a report is asked for.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ampkit/ops.h"

namespace ampkit {

at::Tensor fp8_quantization_stats(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype) {
  constexpr const char* kOp = "ampkit::fp8_quantization_stats";
  TORCH_CHECK_TYPE(dtype == at::ScalarType::Float8_e4m3fn || dtype == at::ScalarType::Float8_e5m2, kOp,
                   ": dtype must be torch.float8_e4m3fn or torch.float8_e5m2, but got ", dtype);
  TORCH_CHECK(x.defined() && x.layout() == at::kStrided, kOp, ": x must be a strided tensor");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                   kOp, ": x must be Float, BFloat16 or Half, but got ", x.scalar_type());
  TORCH_CHECK_TYPE(scale.defined() && scale.scalar_type() == at::kFloat, kOp, ": scale must be a Float tensor");
  TORCH_CHECK(scale.device() == x.device(), kOp, ": scale must be on x's device (", x.device(), "), but is on ",
              scale.device());
  const bool tensorwise = scale.sym_numel() == 1;
  bool rowwise = x.dim() >= 1 && scale.dim() == x.dim() && scale.sym_size(-1) == 1;
  for (int64_t d = 0; rowwise && d + 1 < x.dim(); ++d) {
    rowwise = scale.sym_size(d) == x.sym_size(d);
  }
  TORCH_CHECK_VALUE(tensorwise || rowwise, kOp,
                    ": scale must have one element or x's shape with the last dimension 1, ", "but got ",
                    scale.sym_sizes(), " for x of shape ", x.sym_sizes());
  const bool e4m3 = dtype == at::ScalarType::Float8_e4m3fn;
  // The largest finite value plus half an ulp (448 + 16, 57344 + 4096): beyond it the value is clamped; up to it
  // (ties to even) it rounds to the largest value as any rounding would.
  const double clamp = e4m3 ? 464.0 : 61440.0;
  // Half the smallest subnormal (2^-9, 2^-16): at most this, a nonzero value rounds to zero (ties to even).
  const double flush = e4m3 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17);
  const at::Tensor v = x.to(at::kFloat) * (tensorwise ? scale.reshape({}) : scale);  // the quantizing product
  const at::Tensor a = v.abs();
  const at::Tensor saturated = (a > clamp).sum();
  const at::Tensor flushed = ((a <= flush) & (x != 0)).sum();
  const at::Tensor nan = v.isnan().sum();
  return at::stack({saturated, flushed, nan});
}

}  // namespace ampkit

TORCH_LIBRARY_IMPL(ampkit, CompositeExplicitAutograd, m) {
  m.impl("fp8_quantization_stats", &ampkit::fp8_quantization_stats);
}
