// The pybind11 module ampkit._C: assembles the component bindings, one file each (bind_scaler.cpp,
// bind_autocast.cpp, bind_monitor.cpp, bind_optim.cpp, bind_distributed.cpp; shared helpers in binding.h) and
// binds the build's description and grad_stats' layout (the op's rows by name). The ops reach Python through the dispatcher (torch.ops.ampkit.*), registered
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
  m.attr("GRAD_STATS_COLUMNS") = ampkit::kGradStatsColumns;
  m.attr("GRAD_STATS_HIST_FIRST") = ampkit::kGradStatsHistFirst;
  m.attr("GRAD_STATS_HIST_MIN_EXP") = ampkit::kGradStatsHistMinExp;
  m.def(
      "grad_stats_by_name",
      [](const at::Tensor& rows) {
        const ampkit::GradStats s = ampkit::python::guarded([&] { return ampkit::grad_stats_by_name(rows); });
        py::dict d;
        d["amax"] = s.amax;
        d["l2_norm"] = s.l2_norm;
        d["nonfinite"] = s.nonfinite;
        d["zeros"] = s.zeros;
        d["exp_hist"] = s.exp_hist;
        return d;
      },
      "ampkit::grad_stats_by_name: grad_stats' rows as named views.");
  m.def("cuda_arch_supported", &ampkit::cuda_arch_supported, py::arg("major"), py::arg("minor"),
        "Whether this build's CUDA kernels run on a GPU of compute capability major.minor.");

  ampkit::python::bind_scaler(m);
  ampkit::python::bind_autocast(m);
  ampkit::python::bind_monitor(m);
  ampkit::python::bind_optim(m);
  ampkit::python::bind_distributed(m);
}
