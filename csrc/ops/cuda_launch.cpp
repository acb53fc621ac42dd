// The launch and device checks of cuda_launch.h.
#include "cuda_launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>

#include "cuda_archs.h"

namespace ampkit::detail {

void check_launch(const char* op, const kernels::LaunchStatus& status) {
  if (status.ok()) {
    return;
  }
  TORCH_CHECK(status.launches == 0, "ampkit::", op, ": CUDA kernel launch failed after ", status.launches,
              " kernel(s) of this call had been queued, so part of the tensor list is updated and the rest is not: ",
              cudaGetErrorString(status.error));
  TORCH_CHECK(false, "ampkit::", op,
              ": CUDA kernel launch failed (nothing was written): ", cudaGetErrorString(status.error));
}

void check_cuda_device(const char* op, const at::Device& device) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<bool>, kMaxDevices> checked{};
  const int index = device.index() >= 0 ? device.index() : at::cuda::current_device();
  if (index < kMaxDevices && checked[index].load(std::memory_order_acquire)) {
    return;
  }
  int driver = 0;
  TORCH_CHECK(cudaDriverGetVersion(&driver) == cudaSuccess, "ampkit::", op, ": cannot read the CUDA driver version");
  TORCH_CHECK(driver >= 12010, "ampkit::", op, ": the CUDA driver supports CUDA ", driver / 1000, ".",
              (driver % 1000) / 10,
              ", but ampkit's kernels take 32 KB kernel parameters, which need a driver for CUDA 12.1 or newer");
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
  const CudaArchs archs = parse_cuda_archs(AMPKIT_CUDA_ARCHS_STRING);
  TORCH_CHECK(cuda_archs_cover(archs, prop->major, prop->minor), "ampkit::", op, ": GPU ", index, " (", prop->name,
              ", compute capability ", prop->major, ".", prop->minor,
              ") is not covered by the CUDA architectures this ampkit was built for (", AMPKIT_CUDA_ARCHS_STRING,
              "; PTX for the last). Rebuild with AMPKIT_CUDA_ARCHS including ", prop->major * 10 + prop->minor, ".");
  if (index < kMaxDevices) {
    checked[index].store(true, std::memory_order_release);
  }
}

}  // namespace ampkit::detail
