// The CUDA half of ampkit::precision_support, defined in precision_cuda.cpp (CUDA builds only).
#pragma once

#include <string>

namespace ampkit::detail {

struct CudaDeviceInfo {
  int major;
  int minor;
  std::string name;
};

// Compute capability and name of CUDA device `index`.
CudaDeviceInfo cuda_device_info(int index);

}  // namespace ampkit::detail
