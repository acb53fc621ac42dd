// ampkit._C's monitoring classes: GradStatsLog (C++ programs' JSON lines, bound so that the tests read them from
// Python) and OpStatsGuard (per-op, per-dtype counts behind ampkit.op_stats).
#include <torch/extension.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ampkit/autocast.h"
#include "ampkit/grad_scaler.h"
#include "ampkit/monitor.h"
#include "binding.h"

namespace ampkit::python {

void bind_monitor(py::module_& m) {
  py::class_<ampkit::GradStatsLog>(m, "GradStatsLog")
      .def(py::init([](const std::string& path, int64_t every) {
             return guarded([&] { return std::make_unique<ampkit::GradStatsLog>(path, every); });
           }),
           py::arg("path"), py::arg("every") = 100)
      .def(
          "log",
          [](ampkit::GradStatsLog& self, int64_t step,
             const std::vector<std::pair<std::string, at::Tensor>>& named_parameters, ampkit::GradScaler* scaler,
             bool grads_scaled) {
            torch::OrderedDict<std::string, at::Tensor> named;
            for (const auto& [name, p] : named_parameters) {
              named.insert(name, p);
            }
            return guarded([&] { return self.log(step, named, scaler, grads_scaled); });
          },
          py::arg("step"), py::arg("named_parameters"), py::arg("scaler") = nullptr, py::arg("grads_scaled") = true);

  py::class_<ampkit::OpStatsGuard>(m, "OpStatsGuard")
      .def(py::init([](bool include_backward) {
             return guarded([&] { return std::make_unique<ampkit::OpStatsGuard>(include_backward); });
           }),
           py::arg("include_backward") = false)
      .def("counts", [](const ampkit::OpStatsGuard& g) {
        py::dict d;
        for (const auto& [key, n] : g.counts()) {
          d[py::make_tuple(key.first, key.second)] = n;
        }
        return d;
      });
}

}  // namespace ampkit::python
