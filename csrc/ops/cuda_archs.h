// Which GPUs a build's CUDA architecture list can run on. Plain C++ (no CUDA header), so the rule is tested on
// machines without a GPU and shared by the C++ first-use check and ampkit's import-time check.
#pragma once

#include <string>
#include <vector>

namespace ampkit::detail {

// An architecture list as CMake's AMPKIT_CUDA_ARCHS gives it ("75,80,90", SASS for each and PTX for the last).
struct CudaArchs {
  std::vector<int> sass;  // e.g. 80 for sm_80
  int ptx = 0;            // 0: none
};

CudaArchs parse_cuda_archs(const std::string& list);

// Whether a device of compute capability major.minor runs this build: SASS of the same major and a minor no
// higher (sm_80 code runs on sm_86 and sm_89), or PTX of a capability no higher that the driver compiles.
bool cuda_archs_cover(const CudaArchs& archs, int major, int minor);

}  // namespace ampkit::detail
