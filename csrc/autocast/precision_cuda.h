// The CUDA half of ampkit::precision_support, defined in precision_cuda.cpp (CUDA builds only).
#pragma once

#include <string>

namespace ampkit::detail {

struct CudaDeviceInfo {
  int major;
  int minor;
  std::string name;
};

// Compute capability and name of CUDA device `index`; -1: the current device (what torch.device("cuda") and
// c10::Device(kCUDA) without an index mean).
CudaDeviceInfo cuda_device_info(int index);

}  // namespace ampkit::detail
