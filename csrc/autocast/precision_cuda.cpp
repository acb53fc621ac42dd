// The CUDA half of ampkit::precision_support (precision.cpp): the device's compute capability.
#include <ATen/cuda/CUDAContext.h>

#include <string>

namespace ampkit::detail {

struct CudaDeviceInfo {
  int major;
  int minor;
  std::string name;
};

CudaDeviceInfo cuda_device_info(int index) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
  return {prop->major, prop->minor, prop->name};
}

}  // namespace ampkit::detail
