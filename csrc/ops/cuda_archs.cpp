// The architecture-coverage rule of cuda_archs.h.
#include "cuda_archs.h"

#include <sstream>

namespace ampkit::detail {

CudaArchs parse_cuda_archs(const std::string& list) {
  CudaArchs out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) {
      continue;
    }
    out.sass.push_back(std::stoi(item));
  }
  if (!out.sass.empty()) {
    out.ptx = out.sass.back();
  }
  return out;
}

bool cuda_archs_cover(const CudaArchs& archs, int major, int minor) {
  const int cap = major * 10 + minor;
  for (const int a : archs.sass) {
    if (a / 10 == major && a % 10 <= minor) {
      return true;
    }
  }
  return archs.ptx != 0 && archs.ptx <= cap;
}

}  // namespace ampkit::detail
