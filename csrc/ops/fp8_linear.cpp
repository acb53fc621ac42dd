// fp8_linear and fp8_linear_delayed: the FP8 linear layer's three GEMMs on torch._scaled_mm, each operand
// quantized by fp8_quantize. The Autograd kernels (registered in autograd_kernels.cpp) apply a C++ autograd
// function, so Python and LibTorch share it; the CPU and CUDA kernels (below autograd: inference, no_grad) run its
// forward; the Meta kernel gives the shape.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "ampkit/ops.h"
#include "fp8_linear.h"

namespace ampkit::detail {
namespace {

// NOTE [FP8 linear]
// y = q(x) q(W)^T + b, dX = q(dY) q(W), dW = q(x)^T q(dY), dB = sum(dY) (in FP32, from the unquantized dY). The
// GEMMs take the dequantizing scales 1/scale (tensorwise); _scaled_mm wants its second operand column-major, which
// the quantize's transposed copies give without another pass: the forward saves q(x)^T and q(W)^T (FP8, a quarter
// of an FP32 copy) for the backward, not x and W. With delayed scaling every operand is quantized with the scale
// its module holds, and its amax goes into row 0 of its history (the maximum with what row 0 already holds, so
// several calls in one iteration record their maximum); grad_output's amax is recorded by the backward.
// Rowwise (current scaling): every operand has one scale per row along the dimension its GEMM sums over, so each
// operand is quantized once per GEMM (x along features for y and along tokens for dW, W along in_features for y
// and along out_features for dX, dY along out_features for dX and along tokens for dW; torchao's rowwise recipe);
// the forward saves q(x^T) and q(W^T) with their scales. torch._scaled_mm takes the scales as [M, 1] and [1, N].
struct Fp8LinearConfig {
  const char* op;
  at::ScalarType forward_dtype;   // input and weight
  at::ScalarType backward_dtype;  // grad_output
  double epsilon;
  bool power_of_2;
  at::ScalarType out_dtype;
  std::vector<at::Tensor> histories;  // delayed scaling: input, weight, grad_output; empty: current scaling
  std::vector<at::Tensor> scales;
  bool rowwise = false;
  bool delayed() const { return !histories.empty(); }
};

bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

Fp8LinearConfig make_config(const char* op, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::TensorList histories, at::TensorList scales,
                            c10::string_view fp8_format, double epsilon, bool power_of_2,
                            std::optional<at::ScalarType> out_dtype, c10::string_view granularity = "tensorwise") {
  TORCH_CHECK(input.defined() && input.layout() == at::kStrided, "ampkit::", op, ": input must be a strided tensor");
  TORCH_CHECK(weight.defined() && weight.layout() == at::kStrided, "ampkit::", op, ": weight must be a strided tensor");
  TORCH_CHECK_TYPE(is_float(input.scalar_type()), "ampkit::", op, ": input must be Float, BFloat16 or Half, but got ",
                   input.scalar_type());
  TORCH_CHECK_TYPE(is_float(weight.scalar_type()), "ampkit::", op, ": weight must be Float, BFloat16 or Half, but got ",
                   weight.scalar_type());
  TORCH_CHECK_VALUE(input.dim() >= 1 && weight.dim() == 2 && input.sym_size(-1) == weight.sym_size(1), "ampkit::", op,
                    ": input must have weight.size(1) (", weight.dim() == 2 ? weight.sym_size(1) : c10::SymInt(-1),
                    ") features in its last dimension and weight must be 2-D, but got input ", input.sym_sizes(),
                    " and weight ", weight.sym_sizes());
  TORCH_CHECK(weight.device() == input.device(), "ampkit::", op, ": weight must be on input's device (", input.device(),
              "), but is on ", weight.device());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "ampkit::", op,
                      ": bias must have shape [", weight.sym_size(0), "], but got ", bias->sym_sizes());
    TORCH_CHECK(bias->device() == input.device(), "ampkit::", op, ": bias must be on input's device");
    TORCH_CHECK_TYPE(is_float(bias->scalar_type()), "ampkit::", op, ": bias must be Float, BFloat16 or Half");
  }
  const std::string_view format(fp8_format.data(), fp8_format.size());
  TORCH_CHECK_VALUE(format == "hybrid" || format == "e4m3", "ampkit::", op,
                    ": fp8_format must be 'hybrid' or 'e4m3', but got '", format, "'");
  TORCH_CHECK_VALUE(std::isfinite(epsilon) && epsilon >= 0, "ampkit::", op,
                    ": amax_epsilon must be a finite number >= 0, but got ", epsilon);
  const std::string_view gran(granularity.data(), granularity.size());
  TORCH_CHECK_VALUE(gran == "tensorwise" || gran == "rowwise", "ampkit::", op,
                    ": granularity must be 'tensorwise' or 'rowwise', but got '", gran, "'");
  if (out_dtype.has_value()) {
    TORCH_CHECK_TYPE(is_float(*out_dtype), "ampkit::", op, ": out_dtype must be Float, BFloat16 or Half, but got ",
                     *out_dtype);
  }
  Fp8LinearConfig c{op,
                    ampkit::fp8_dtypes(fp8_format)[0],
                    ampkit::fp8_dtypes(fp8_format)[2],
                    epsilon,
                    power_of_2,
                    input.scalar_type(),
                    {},
                    {},
                    gran == "rowwise"};
  const auto device_type = input.device().type();
  if (out_dtype.has_value()) {
    c.out_dtype = *out_dtype;
  } else if ((device_type == at::kCPU || device_type == at::kCUDA) && at::autocast::is_autocast_enabled(device_type)) {
    c.out_dtype = at::autocast::get_autocast_dtype(device_type);
  }
  if (op == std::string_view("fp8_linear_delayed")) {
    static const char* const kRoles[] = {"input", "weight", "grad_output"};
    TORCH_CHECK_VALUE(histories.size() == 3 && scales.size() == 3, "ampkit::", op,
                      ": amax_histories and scales must have 3 tensors each (input, weight, grad_output), but have ",
                      histories.size(), " and ", scales.size());
    for (size_t i = 0; i < 3; ++i) {
      const at::Tensor& h = histories[i];
      const at::Tensor& s = scales[i];
      TORCH_CHECK(h.defined() && s.defined() && h.device() == input.device() && s.device() == input.device(),
                  "ampkit::", op, ": amax_histories[", i, "] and scales[", i, "] (", kRoles[i],
                  ") must be defined and on input's device (", input.device(), ")");
      TORCH_CHECK_TYPE(h.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat, "ampkit::", op,
                       ": amax_histories[", i, "] and scales[", i, "] must be Float tensors");
      TORCH_CHECK_VALUE(h.dim() >= 1 && h.sym_size(0) >= 1 && h.sym_numel() == h.sym_size(0) && s.sym_numel() == 1,
                        "ampkit::", op, ": amax_histories[", i,
                        "] must have one column ([rows] or [rows, 1]) and scales[", i, "] one element, but got shapes ",
                        h.sym_sizes(), " and ", s.sym_sizes());
      c.histories.push_back(h);
      c.scales.push_back(s);
    }
  }
  return c;
}

// The configs of the two ops, each from its own arguments (every kernel and the autograd function of an op reads
// its arguments through these).
Fp8LinearConfig current_config(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               c10::string_view fp8_format, double amax_epsilon, bool power_of_2,
                               std::optional<at::ScalarType> out_dtype, c10::string_view granularity) {
  return make_config("fp8_linear", input, weight, bias, {}, {}, fp8_format, amax_epsilon, power_of_2, out_dtype,
                     granularity);
}

Fp8LinearConfig delayed_config(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               at::TensorList amax_histories, at::TensorList scales, c10::string_view fp8_format,
                               std::optional<at::ScalarType> out_dtype) {
  return make_config("fp8_linear_delayed", input, weight, bias, amax_histories, scales, fp8_format, 0.0, false,
                     out_dtype);
}

struct Quantized {
  at::Tensor q;
  at::Tensor q_t;          // tensorwise: q's transpose; rowwise: x^T quantized along its own rows
  at::Tensor inv_scale;    // the dequantizing scale _scaled_mm takes: [] or, rowwise, [rows, 1]
  at::Tensor inv_scale_t;  // q_t's
};

// max |x| (per row: [rows, 1]) as FP32, exact in x's dtype, NaN propagating (a zero amax's sign may differ between
// the two ways; the scale of a zero amax is the fallback either way). In one read-only pass without abs(x)'s
// temporary: max(max x, -min x). (linalg_vector_norm(x, inf) gives the same value, 10-20 times slower on the CPU.)
// The CPU takes the temporary for rows and for a strided x: there torch's aminmax was 4-8 times slower than abs
// and amax (BF16, 64 to 1024 rows, torch 2.13), while over a whole contiguous tensor it is the faster.
at::Tensor abs_max(const at::Tensor& x, bool rows) {
  if (x.device().is_cpu() && (rows || !x.is_contiguous())) {
    const at::Tensor a = at::abs(x);
    return (rows ? at::amax(a, {1}, /*keepdim=*/true) : at::amax(a)).to(at::kFloat);
  }
  const auto [lo, hi] = rows ? at::aminmax(x, 1, /*keepdim=*/true) : at::aminmax(x);
  return at::maximum(hi, at::neg(lo)).to(at::kFloat);
}

// Rowwise current scaling of a 2-D operand: one scale per row, from that row's amax.
Quantized quantize_rows(const at::Tensor& x, at::ScalarType dtype, const Fp8LinearConfig& c) {
  const at::Tensor amax = x.sym_size(1) == 0 ? at::zeros_symint({x.sym_size(0), 1}, x.options().dtype(at::kFloat))
                                             : abs_max(x, /*rows=*/true);
  const at::Tensor scale = ampkit::fp8_compute_scale(amax, ampkit::fp8_max(dtype), 0.0, c.epsilon, c.power_of_2);
  auto [q, unused_amax, unused_t] = ampkit::fp8_quantize(x, scale, dtype, false);
  return {q, at::Tensor(), at::reciprocal(scale), at::Tensor()};
}

// Quantizes a 2-D operand: current scaling takes its scale from its own amax, delayed scaling the scale of its
// role (0 input, 1 weight, 2 grad_output) and records the amax in that role's history.
Quantized quantize_operand(const at::Tensor& x, at::ScalarType dtype, const Fp8LinearConfig& c, size_t role,
                           bool transpose) {
  if (c.rowwise) {
    Quantized r = quantize_rows(x, dtype, c);
    if (transpose) {
      const Quantized t = quantize_rows(x.t(), dtype, c);
      r.q_t = t.q;
      r.inv_scale_t = t.inv_scale;
    }
    return r;
  }
  at::Tensor scale;
  if (c.delayed()) {
    scale = c.scales[role].reshape({});
  } else {
    const at::Tensor amax =
        x.sym_numel() == 0 ? at::zeros({}, x.options().dtype(at::kFloat)) : abs_max(x, /*rows=*/false);
    scale = ampkit::fp8_compute_scale(amax, ampkit::fp8_max(dtype), 0.0, c.epsilon, c.power_of_2);
  }
  auto [q, amax, q_t] = ampkit::fp8_quantize(x, scale, dtype, transpose);
  if (c.delayed() && x.device().type() != at::kMeta) {
    at::Tensor row0 = c.histories[role].view({-1}).narrow(0, 0, 1);
    row0.copy_(at::maximum(row0, amax.reshape({1})));
  }
  const at::Tensor inv = at::reciprocal(scale);
  return {q, q_t.has_value() ? *q_t : at::Tensor(), inv, inv};
}

// An FP8 tensor with `rows` zero rows and `cols` zero columns added (byte 0 is +0 in both formats).
at::Tensor pad_fp8(const at::Tensor& t, const c10::SymInt& rows, const c10::SymInt& cols) {
  const std::vector<c10::SymInt> pad{0, cols, 0, rows};
  return at::constant_pad_nd_symint(t.view(at::kByte), pad, 0).view(t.scalar_type());
}

// a [M, K] row-major times b [K, N] column-major, dequantized by inv_a ([] or [M, 1]) and inv_b ([] or, rowwise,
// [N, 1], passed as [1, N]). The GPU's _scaled_mm takes M and K that are multiples of 16 (N, the layer's features,
// is checked by unsupported_reason): other token counts are padded with zero rows and columns, which change no
// sum, and the result is cut back. The same on every device, so that the CPU tests run this path. NOTE [FP8 GEMM on
// the CPU] below.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inv_a, const at::Tensor& inv_b,
                     at::ScalarType out_dtype, bool rowwise) {
  const c10::SymInt m = a.sym_size(0);
  if (m == 0 || a.sym_size(1) == 0 || b.sym_size(1) == 0) {
    return at::zeros_symint({m, b.sym_size(1)}, a.options().dtype(out_dtype));
  }
  const c10::SymInt pad_m = (16 - m % 16) % 16;
  const c10::SymInt pad_k = (16 - a.sym_size(1) % 16) % 16;
  if (pad_m != 0 || pad_k != 0) {
    const at::Tensor a16 = pad_fp8(a, pad_m, pad_k);
    const at::Tensor b16 = pad_fp8(b.t(), 0, pad_k).t();
    const at::Tensor inv_a16 =
        rowwise ? at::constant_pad_nd_symint(inv_a, std::vector<c10::SymInt>{0, 0, 0, pad_m}, 1.0) : inv_a;
    return scaled_mm(a16, b16, inv_a16, inv_b, out_dtype, rowwise).narrow_symint(0, 0, m);
  }
  if (a.device().type() == at::kCPU) {
    // NOTE [FP8 GEMM on the CPU]: the operands widened to FP32 (exact) and one FP32 GEMM, i.e. the exact products an
    // FP8 tensor core makes, summed in FP32; then scaled once by the product of the dequantizing scales (by row and
    // column, rowwise), as the GPU's GEMM scales its accumulator; one rounding to out_dtype. torch's CPU
    // _scaled_mm scales the operands before its FP32 GEMM (the same bits with power-of-two scales) or, on CPUs with
    // AMX-INT8, runs oneDNN's FP8 GEMM, which is far slower than an FP32 GEMM there.
    // A tensor with Python behind it (a fake tensor while torch.compile traces, a subclass) widens through ATen's
    // cast, which gives the same values; plain tensors through ampkit's table, many times faster.
    const auto widen = [](const at::Tensor& t) {
      return t.key_set().has(c10::DispatchKey::Python) ? t.to(at::kFloat) : fp8_to_float_cpu(t);
    };
    const at::Tensor y = at::mm(widen(a), widen(b.t()).t());
    const at::Tensor scaled = rowwise ? y * inv_a * inv_b.view({1, -1}) : y * (inv_a * inv_b);
    return scaled.to(out_dtype);
  }
  if (!rowwise) {
    return at::_scaled_mm(a, b, inv_a, inv_b, std::nullopt, std::nullopt, out_dtype, /*use_fast_accum=*/false);
  }
  const at::Tensor inv_b_row = inv_b.view({1, -1});
  if (a.device().type() == at::kCUDA) {
    // The GPU's rowwise GEMM writes BF16 only.
    const at::Tensor y =
        at::_scaled_mm(a, b, inv_a, inv_b_row, std::nullopt, std::nullopt, at::kBFloat16, /*use_fast_accum=*/false);
    return out_dtype == at::kBFloat16 ? y : y.to(out_dtype);
  }
  // Elsewhere (the Meta device): the unscaled product in FP32, then scaled by row and column.
  const at::Tensor one = at::ones({}, inv_a.options());
  const at::Tensor y = at::_scaled_mm(a, b, one, one, std::nullopt, std::nullopt, at::kFloat, /*use_fast_accum=*/false);
  return (y * inv_a * inv_b_row).to(out_dtype);
}

// What the forward keeps for the backward.
struct Saved {
  at::Tensor q_x_t;
  at::Tensor q_w_t;
  at::Tensor inv_x_t;
  at::Tensor inv_w_t;
};

at::Tensor forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   const Fp8LinearConfig& c, Saved* saved, bool need_dx, bool need_dw) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::Tensor x = input.reshape_symint({-1, input.sym_size(-1)});
  const Quantized qx = quantize_operand(x, c.forward_dtype, c, 0, saved != nullptr && need_dw);
  const Quantized qw = quantize_operand(weight, c.forward_dtype, c, 1, saved != nullptr && need_dx);
  at::Tensor y = scaled_mm(qx.q, qw.q.t(), qx.inv_scale, qw.inv_scale, c.out_dtype, c.rowwise);
  if (bias.has_value() && bias->defined()) {
    y = at::add(y, bias->to(c.out_dtype));
  }
  if (saved != nullptr) {
    *saved = Saved{qx.q_t, qw.q_t, qx.inv_scale_t, qw.inv_scale_t};
  }
  std::vector<c10::SymInt> shape(input.sym_sizes().begin(), input.sym_sizes().end() - 1);
  shape.push_back(weight.sym_size(0));
  return y.view_symint(shape);
}

class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const Fp8LinearConfig& c) {
    Saved s;
    const bool need_dx = input.requires_grad();
    const bool need_dw = weight.requires_grad();
    at::Tensor y = detail::forward(input, weight, bias, c, &s, need_dx, need_dw);
    ctx->save_for_backward({s.q_x_t, s.q_w_t, s.inv_x_t, s.inv_w_t});
    // Delayed scaling's grad_output history and scale: no version check (the scale the backward finds is used).
    ctx->saved_data["delayed"] = c.delayed();
    if (c.delayed()) {
      ctx->saved_data["grad_output_history"] = c.histories[2];
      ctx->saved_data["grad_output_scale"] = c.scales[2];
    }
    ctx->saved_data["op"] = std::string(c.op);
    ctx->saved_data["backward_dtype"] = c.backward_dtype;
    ctx->saved_data["epsilon"] = c.epsilon;
    ctx->saved_data["power_of_2"] = c.power_of_2;
    ctx->saved_data["rowwise"] = c.rowwise;
    ctx->saved_data["input_dtype"] = input.scalar_type();
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["bias_dtype"] = bias.has_value() && bias->defined() ? bias->scalar_type() : at::kFloat;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const std::string op = d.at("op").toStringRef();
    Fp8LinearConfig c{op == "fp8_linear" ? "fp8_linear" : "fp8_linear_delayed",
                      at::ScalarType::Float8_e4m3fn,
                      d.at("backward_dtype").toScalarType(),
                      d.at("epsilon").toDouble(),
                      d.at("power_of_2").toBool(),
                      at::kFloat,
                      {},
                      {},
                      d.at("rowwise").toBool()};
    if (d.at("delayed").toBool()) {
      c.histories = {at::Tensor(), at::Tensor(), d.at("grad_output_history").toTensor()};
      c.scales = {at::Tensor(), at::Tensor(), d.at("grad_output_scale").toTensor()};
    }
    const at::Tensor& grad = grads[0];
    const at::Tensor dy = grad.reshape_symint({-1, grad.sym_size(-1)});
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_dw = ctx->needs_input_grad(1);
    // needs_input_grad counts the tensor arguments given: bias is the third only when it was given.
    const bool need_db = d.at("has_bias").toBool() && ctx->needs_input_grad(2);
    at::Tensor dx;
    at::Tensor dw;
    at::Tensor db;
    if (need_dx || need_dw) {
      const Quantized qdy = quantize_operand(dy, c.backward_dtype, c, 2, need_dw);
      if (need_dx) {
        // input's shape: grad's leading dimensions and in_features (the rows of q(W)^T).
        std::vector<c10::SymInt> shape(grad.sym_sizes().begin(), grad.sym_sizes().end() - 1);
        shape.push_back(saved[1].sym_size(0));
        dx = scaled_mm(qdy.q, saved[1].t(), qdy.inv_scale, saved[3], d.at("input_dtype").toScalarType(), c.rowwise)
                 .view_symint(shape);
      }
      if (need_dw) {
        dw =
            scaled_mm(qdy.q_t, saved[0].t(), qdy.inv_scale_t, saved[2], d.at("weight_dtype").toScalarType(), c.rowwise);
      }
    }
    if (need_db) {
      db = dy.sum(0, /*keepdim=*/false, at::kFloat).to(d.at("bias_dtype").toScalarType());
    }
    return {dx, dw, db, at::Tensor()};
  }
};

// Below autograd (CPU, CUDA): the forward alone; on Meta, the output's shape and dtype.
at::Tensor fp8_linear_forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              c10::string_view fp8_format, double amax_epsilon, bool power_of_2,
                              std::optional<at::ScalarType> out_dtype, c10::string_view granularity) {
  const auto c = current_config(input, weight, bias, fp8_format, amax_epsilon, power_of_2, out_dtype, granularity);
  return forward(input, weight, bias, c, nullptr, false, false);
}

at::Tensor fp8_linear_delayed_forward(const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, at::TensorList amax_histories,
                                      at::TensorList scales, c10::string_view fp8_format,
                                      std::optional<at::ScalarType> out_dtype) {
  const auto c = delayed_config(input, weight, bias, amax_histories, scales, fp8_format, out_dtype);
  return forward(input, weight, bias, c, nullptr, false, false);
}

at::Tensor meta_result(const at::Tensor& input, const at::Tensor& weight, const Fp8LinearConfig& c) {
  std::vector<c10::SymInt> shape(input.sym_sizes().begin(), input.sym_sizes().end() - 1);
  shape.push_back(weight.sym_size(0));
  return at::empty_symint(shape, input.options().dtype(c.out_dtype));
}

at::Tensor fp8_linear_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::string_view fp8_format, double amax_epsilon, bool power_of_2,
                           std::optional<at::ScalarType> out_dtype, c10::string_view granularity) {
  return meta_result(input, weight,
                     current_config(input, weight, bias, fp8_format, amax_epsilon, power_of_2, out_dtype, granularity));
}

at::Tensor fp8_linear_delayed_meta(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, at::TensorList amax_histories,
                                   at::TensorList scales, c10::string_view fp8_format,
                                   std::optional<at::ScalarType> out_dtype) {
  return meta_result(input, weight, delayed_config(input, weight, bias, amax_histories, scales, fp8_format, out_dtype));
}

}  // namespace

at::Tensor fp8_linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               c10::string_view fp8_format, double amax_epsilon, bool power_of_2,
                               std::optional<at::ScalarType> out_dtype, c10::string_view granularity) {
  const auto c = current_config(input, weight, bias, fp8_format, amax_epsilon, power_of_2, out_dtype, granularity);
  return Fp8LinearFunction::apply(input, weight, bias, c);
}

at::Tensor fp8_linear_delayed_autograd(const at::Tensor& input, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, at::TensorList amax_histories,
                                       at::TensorList scales, c10::string_view fp8_format,
                                       std::optional<at::ScalarType> out_dtype) {
  const auto c = delayed_config(input, weight, bias, amax_histories, scales, fp8_format, out_dtype);
  return Fp8LinearFunction::apply(input, weight, bias, c);
}

}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  m.impl("fp8_linear", &ampkit::detail::fp8_linear_forward);
  m.impl("fp8_linear_delayed", &ampkit::detail::fp8_linear_delayed_forward);
}

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  m.impl("fp8_linear", &ampkit::detail::fp8_linear_forward);
  m.impl("fp8_linear_delayed", &ampkit::detail::fp8_linear_delayed_forward);
}

TORCH_LIBRARY_IMPL(ampkit, Meta, m) {
  m.impl("fp8_linear", &ampkit::detail::fp8_linear_meta);
  m.impl("fp8_linear_delayed", &ampkit::detail::fp8_linear_delayed_meta);
}
