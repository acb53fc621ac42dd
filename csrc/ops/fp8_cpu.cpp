// CPU kernels of fp8_quantize, fp8_compute_scale and fp8_update_amax_history_and_scale_: at::parallel_for loops
// over the functors of kernels/fp8_functors.h, after the checks of op_kernels.h. (Scalar loops: the quantize is
// one integer conversion per element; SIMD loops are future work.) Also the FP8 -> FP32 widening of fp8_linear's
// CPU GEMMs (fp8_linear.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "descriptors.h"
#include "fp8_linear.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

// Elements per parallel work item of the quantize.
constexpr int64_t kQuantizeGrain = 32768;

// Rows [begin, end) of x: q (and q_t, x's transpose, when asked for), returning their amax as fp8_abs_bits.
template <typename T, kernels::Fp8Format F>
uint32_t quantize_rows(const kernels::Fp8QuantizeParams& p, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(p.x);
  uint32_t amax = 0;
  for (int64_t r = begin; r < end; ++r) {
    const float s = p.scale[p.rowwise ? r : 0];
    const T* row = x + r * p.cols;
    uint8_t* q = p.q + r * p.cols;
    for (int64_t c = 0; c < p.cols; ++c) {
      const float v = static_cast<float>(row[c]);
      const uint32_t b = kernels::fp8_abs_bits(v);
      amax = b > amax ? b : amax;
      q[c] = kernels::fp8_from_float<F>(v * s);
    }
  }
  if (p.q_t != nullptr) {  // the transposed copy from the rows just written (in L2), in tiles of 64 x 64
    constexpr int64_t kTile = 64;
    for (int64_t c0 = 0; c0 < p.cols; c0 += kTile) {
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* q = p.q + r * p.cols;
        for (int64_t c = c0; c < std::min(c0 + kTile, p.cols); ++c) {
          p.q_t[c * p.rows + r] = q[c];
        }
      }
    }
  }
  return amax;
}

template <typename T, kernels::Fp8Format F>
void quantize_all(const kernels::Fp8QuantizeParams& p) {
  std::atomic<uint32_t> amax{0};
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrain / std::max<int64_t>(p.cols, 1));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    const uint32_t local = quantize_rows<T, F>(p, begin, end);
    uint32_t seen = amax.load(std::memory_order_relaxed);
    while (local > seen && !amax.compare_exchange_weak(seen, local, std::memory_order_relaxed)) {
    }
  });
  *p.amax = kernels::bit_cast<float>(amax.load());
}

template <typename T>
void quantize_all(const kernels::Fp8QuantizeParams& p) {
  if (p.format == kernels::Fp8Format::kE4M3) {
    quantize_all<T, kernels::Fp8Format::kE4M3>(p);
  } else {
    quantize_all<T, kernels::Fp8Format::kE5M2>(p);
  }
}

void fp8_quantize_cpu(const Fp8QuantizeArgs& a, const Fp8QuantizeResult& out) {
  if (a.x.numel() == 0) {
    return;
  }
  const at::Tensor x = a.x.contiguous();  // read only: a staging copy when x is not contiguous
  const at::Tensor scale = a.scale.contiguous();
  const kernels::Fp8QuantizeParams p = fp8_quantize_params(a, x, scale, out);
  switch (x.scalar_type()) {
    case at::kHalf:
      quantize_all<c10::Half>(p);
      break;
    case at::kBFloat16:
      quantize_all<c10::BFloat16>(p);
      break;
    default:
      quantize_all<float>(p);
      break;
  }
}

void fp8_compute_scale_cpu(const Fp8ComputeScaleArgs& a, const at::Tensor& scale) {
  const at::Tensor amax = a.amax.contiguous();
  const kernels::Fp8ScaleOp op = fp8_scale_op(a.fp8_max, a.margin, a.epsilon, a.power_of_2);
  const float* in = amax.const_data_ptr<float>();
  float* out = scale.mutable_data_ptr<float>();
  for (int64_t i = 0; i < amax.numel(); ++i) {
    out[i] = op(in[i], 1.f);
  }
}

void fp8_update_cpu(const Fp8UpdateArgs& a) {
  at::parallel_for(0, static_cast<int64_t>(a.amax_histories.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const kernels::Fp8HistoryOp op = fp8_history_op(a, static_cast<size_t>(i));
      float* history = a.amax_histories[i].mutable_data_ptr<float>();
      float* scale = a.scales[i].mutable_data_ptr<float>();
      const int64_t cols = a.scales[i].numel();
      for (int64_t c = 0; c < cols; ++c) {
        op(history + c, cols, scale + c);
      }
    }
  });
}

}  // namespace

}  // namespace ampkit::detail

namespace ampkit {

double fp8_max(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::ScalarType::Float8_e4m3fn || dtype == at::ScalarType::Float8_e5m2,
                    "ampkit::fp8_max: dtype must be Float8_e4m3fn or Float8_e5m2, but got ", dtype);
  return dtype == at::ScalarType::Float8_e5m2 ? kernels::kFp8E5M2Max : kernels::kFp8E4M3Max;
}

std::array<at::ScalarType, 3> fp8_dtypes(c10::string_view fp8_format) {
  const std::string_view format(fp8_format.data(), fp8_format.size());
  TORCH_CHECK_VALUE(format == "hybrid" || format == "e4m3",
                    "ampkit::fp8_dtypes: fp8_format must be 'hybrid' or 'e4m3', but got '", format, "'");
  return {at::ScalarType::Float8_e4m3fn, at::ScalarType::Float8_e4m3fn,
          format == "hybrid" ? at::ScalarType::Float8_e5m2 : at::ScalarType::Float8_e4m3fn};
}

}  // namespace ampkit

namespace ampkit::detail {

at::Tensor fp8_to_float_cpu(const at::Tensor& q) {
  TORCH_INTERNAL_ASSERT(q.device().is_cpu() && (q.scalar_type() == at::ScalarType::Float8_e4m3fn ||
                                                q.scalar_type() == at::ScalarType::Float8_e5m2));
  const at::Tensor in = q.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kFloat));
  // A table of the 256 codes' values: one load per element.
  float table[256];
  const bool e4m3 = q.scalar_type() == at::ScalarType::Float8_e4m3fn;
  for (uint32_t code = 0; code < 256; ++code) {
    const auto c = static_cast<uint8_t>(code);
    table[code] = e4m3 ? kernels::fp8_to_float<kernels::Fp8Format::kE4M3>(c)
                       : kernels::fp8_to_float<kernels::Fp8Format::kE5M2>(c);
  }
  const auto* src = static_cast<const uint8_t*>(in.const_data_ptr());
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, in.numel(), kQuantizeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = table[src[i]];
    }
  });
  return out;
}

}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  using namespace ampkit::detail;
  m.impl("fp8_quantize", &fp8_quantize_kernel<fp8_quantize_cpu>);
  m.impl("fp8_compute_scale", &fp8_compute_scale_kernel<fp8_compute_scale_cpu>);
  m.impl("fp8_update_amax_history_and_scale_", &fp8_update_amax_history_and_scale_kernel<fp8_update_cpu>);
}
