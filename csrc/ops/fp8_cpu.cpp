// CPU kernels of fp8_quantize, fp8_compute_scale and fp8_update_amax_history_and_scale_: at::parallel_for loops
// over the functors of kernels/fp8_functors.h, after the checks of op_kernels.h; the quantize's rows run the vector
// loop of cpu/fp8_loops.h (one copy per instruction set). Also the FP8 -> FP32 widening of fp8_linear's CPU GEMMs
// (fp8_linear.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/cpu_loops.h"
#include "descriptors.h"
#include "fp8_linear.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

// Elements per parallel work item of the quantize.
constexpr int64_t kQuantizeGrain = 32768;

void quantize_all(const kernels::Fp8QuantizeParams& p) {
  const CpuLoops& loops = cpu_loops();
  std::atomic<uint32_t> amax{0};
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrain / std::max<int64_t>(p.cols, 1));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    const uint32_t local = loops.fp8_quantize_rows(p, begin, end);
    uint32_t seen = amax.load(std::memory_order_relaxed);
    while (local > seen && !amax.compare_exchange_weak(seen, local, std::memory_order_relaxed)) {
    }
  });
  *p.amax = kernels::bit_cast<float>(amax.load());
}

void fp8_quantize_cpu(const Fp8QuantizeArgs& a, const Fp8QuantizeResult& out) {
  if (a.x.numel() == 0) {
    return;
  }
  const at::Tensor x = a.x.contiguous();  // read only: a staging copy when x is not contiguous
  const at::Tensor scale = a.scale.contiguous();
  quantize_all(fp8_quantize_params(a, x, scale, out));
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
  // The data pointers on the calling thread: taking a mutable one materializes a copy-on-write storage, which
  // at::parallel_for forbids inside its loop.
  const size_t n = a.amax_histories.size();
  std::vector<float*> histories(n);
  std::vector<float*> scales(n);
  for (size_t i = 0; i < n; ++i) {
    histories[i] = a.amax_histories[i].mutable_data_ptr<float>();
    scales[i] = a.scales[i].mutable_data_ptr<float>();
  }
  at::parallel_for(0, static_cast<int64_t>(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const kernels::Fp8HistoryOp op = fp8_history_op(a, static_cast<size_t>(i));
      float* history = histories[i];
      float* scale = scales[i];
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
