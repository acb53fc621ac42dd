// CUDA kernels of fp8_quantize, fp8_compute_scale and fp8_update_amax_history_and_scale_: device guard, current
// stream and the launchers of kernels/cuda/fp8_launch.h (host code only), after the checks of op_kernels.h.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../../kernels/cuda/fp8_launch.h"
#include "cuda_launch.h"
#include "descriptors.h"
#include "op_kernels.h"

namespace ampkit::detail {
namespace {

void fp8_quantize_cuda(const Fp8QuantizeArgs& a, const Fp8QuantizeResult& out) {
  const c10::cuda::OptionalCUDAGuard guard(a.x.device());
  check_cuda_device(a.op, a.x.device());
  if (a.x.numel() == 0) {
    return;
  }
  const at::Tensor x = a.x.contiguous();  // read only: a staging copy when x is not contiguous
  const at::Tensor scale = a.scale.contiguous();
  const kernels::Fp8QuantizeParams p = fp8_quantize_params(a, x, scale, out);
  check_launch(a.op, kernels::launch_fp8_quantize(p, c10::cuda::getCurrentCUDAStream()));
}

void fp8_compute_scale_cuda(const Fp8ComputeScaleArgs& a, const at::Tensor& scale) {
  const c10::cuda::OptionalCUDAGuard guard(a.amax.device());
  check_cuda_device(a.op, a.amax.device());
  const at::Tensor amax = a.amax.contiguous();
  check_launch(
      a.op, kernels::launch_fp8_compute_scale(amax.const_data_ptr<float>(), scale.mutable_data_ptr<float>(),
                                              amax.numel(), fp8_scale_op(a.fp8_max, a.margin, a.epsilon, a.power_of_2),
                                              c10::cuda::getCurrentCUDAStream()));
}

// One launch per distinct fp8_max (two for the hybrid format's 448 and 57344), each over every pair it covers.
void fp8_update_cuda(const Fp8UpdateArgs& a) {
  const size_t n = a.amax_histories.size();
  if (n == 0) {
    return;
  }
  const at::Device device = a.amax_histories[0].device();
  const c10::cuda::OptionalCUDAGuard guard(device);
  check_cuda_device(a.op, device);
  std::vector<bool> done(n, false);
  for (size_t i = 0; i < n; ++i) {
    if (done[i]) {
      continue;
    }
    const kernels::Fp8HistoryOp op = fp8_history_op(a, i);
    std::vector<kernels::TensorRef> scales;
    std::vector<kernels::TensorRef> histories;
    for (size_t j = i; j < n; ++j) {
      const kernels::Fp8HistoryOp other = fp8_history_op(a, j);
      if (done[j] || other.scale_op.fp8_max != op.scale_op.fp8_max) {
        continue;
      }
      done[j] = true;
      scales.push_back({a.scales[j].mutable_data_ptr(), a.scales[j].numel(), kernels::DType::kFloat32});
      histories.push_back({a.amax_histories[j].mutable_data_ptr(), a.scales[j].numel(), kernels::DType::kFloat32});
    }
    check_launch(
        a.op, kernels::launch_fp8_update_history(scales.data(), histories.data(), static_cast<int64_t>(scales.size()),
                                                 op, c10::cuda::getCurrentCUDAStream()));
  }
}

}  // namespace
}  // namespace ampkit::detail

TORCH_LIBRARY_IMPL(ampkit, CUDA, m) {
  using namespace ampkit::detail;
  m.impl("fp8_quantize", &fp8_quantize_kernel<fp8_quantize_cuda>);
  m.impl("fp8_compute_scale", &fp8_compute_scale_kernel<fp8_compute_scale_cuda>);
  m.impl("fp8_update_amax_history_and_scale_", &fp8_update_amax_history_and_scale_kernel<fp8_update_cuda>);
}
