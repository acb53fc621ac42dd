// The CUDA half of ampkit::precision_support (precision.cpp): the device's compute capability.
#include "precision_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

namespace ampkit::detail {

CudaDeviceInfo cuda_device_info(int index) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index >= 0 ? index : c10::cuda::current_device());
  return {prop->major, prop->minor, prop->name};
}

}  // namespace ampkit::detail
