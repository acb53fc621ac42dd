// CPU kernels of fp8_quantize, fp8_compute_scale and fp8_update_amax_history_and_scale_: at::parallel_for loops
// over the functors of kernels/fp8_functors.h, after the checks of op_kernels.h. (Scalar loops: the quantize is
// one integer conversion per element; SIMD loops are future work.)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>

#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

// Elements per parallel work item of the quantize.
constexpr int64_t kQuantizeGrain = 32768;

template <typename T>
uint32_t quantize_rows(const kernels::Fp8QuantizeParams& p, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(p.x);
  uint32_t amax = 0;
  for (int64_t r = begin; r < end; ++r) {
    const float s = p.scale[p.rowwise ? r : 0];
    for (int64_t c = 0; c < p.cols; ++c) {
      const int64_t i = r * p.cols + c;
      const float v = static_cast<float>(x[i]);
      const uint32_t b = kernels::fp8_abs_bits(v);
      amax = b > amax ? b : amax;
      const uint8_t q = kernels::fp8_quantize_value(v, s, p.format);
      p.q[i] = q;
      if (p.q_t != nullptr) {
        p.q_t[c * p.rows + r] = q;
      }
    }
  }
  return amax;
}

template <typename T>
void quantize_all(const kernels::Fp8QuantizeParams& p) {
  std::atomic<uint32_t> amax{0};
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrain / std::max<int64_t>(p.cols, 1));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    const uint32_t local = quantize_rows<T>(p, begin, end);
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

TORCH_LIBRARY_IMPL(ampkit, CPU, m) {
  using namespace ampkit::detail;
  m.impl("fp8_quantize", &fp8_quantize_kernel<fp8_quantize_cpu>);
  m.impl("fp8_compute_scale", &fp8_compute_scale_kernel<fp8_compute_scale_cpu>);
  m.impl("fp8_update_amax_history_and_scale_", &fp8_update_amax_history_and_scale_kernel<fp8_update_cpu>);
}
