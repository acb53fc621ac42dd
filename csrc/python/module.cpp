// The pybind11 module ampkit._C: assembles the component bindings, one file each (bind_scaler.cpp,
// bind_autocast.cpp, bind_monitor.cpp, bind_optim.cpp, bind_distributed.cpp, bind_fp8.cpp; shared helpers in
// binding.h) and binds the build's description. The ops reach Python through the dispatcher (torch.ops.ampkit.*), registered
// when this module's dependency libampkit is loaded.
#include <torch/extension.h>

#include <string>

#include "ampkit/ops.h"
#include "binding.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ampkit C++ core";
  m.def(
      "build_info",
      []() {
        const ampkit::BuildInfo info = ampkit::build_info();
        py::dict d;
        d["cuda_compiled"] = info.cuda_compiled;
        d["cuda_archs"] = std::string(info.cuda_archs);
        d["cpu_isa"] = std::string(info.cpu_isa);
        d["torch_version"] = std::string(info.torch_version);
        d["cpu_optim_tail_width"] = info.cpu_optim_tail_width;
        return d;
      },
      "What this build contains: CUDA kernels compiled and for which architectures, the CPU loops' instruction "
      "set on this machine, the torch version it was built against, and the scalar-tail width of the CPU "
      "optimizer steps (that of torch's fused CPU kernels: 8 under AVX2 and AVX-512).");
  m.def("cuda_arch_supported", &ampkit::cuda_arch_supported, py::arg("major"), py::arg("minor"),
        "Whether this build's CUDA kernels run on a GPU of compute capability major.minor.");

  ampkit::python::bind_scaler(m);
  ampkit::python::bind_autocast(m);
  ampkit::python::bind_monitor(m);
  ampkit::python::bind_optim(m);
  ampkit::python::bind_distributed(m);
  ampkit::python::bind_fp8(m);
}
