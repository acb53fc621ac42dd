// The pybind11 module ampkit._C. It binds ampkit's C++ classes only: the ops reach Python through the
// dispatcher (torch.ops.ampkit.*), registered when this module's dependency libampkit is loaded.
#include <torch/extension.h>

#include "ampkit/ampkit.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "ampkit C++ core";
  m.def(
      "build_info",
      []() {
        const ampkit::BuildInfo info = ampkit::build_info();
        pybind11::dict d;
        d["cuda_compiled"] = info.cuda_compiled;
        d["cuda_archs"] = std::string(info.cuda_archs);
        d["cpu_isa"] = std::string(info.cpu_isa);
        d["torch_version"] = std::string(info.torch_version);
        return d;
      },
      "What this build contains: CUDA kernels compiled and for which architectures, the CPU loops' instruction "
      "set on this machine, and the torch version it was built against.");
}
