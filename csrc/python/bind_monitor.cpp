// ampkit._C's monitoring: grad_stats' row layout and its rows by name (ampkit.grad_stats), GradStatsLog (C++
// programs' JSON lines, bound so that the tests read them from Python) and OpStatsGuard (per-op, per-dtype counts
// behind ampkit.op_stats).
#include <torch/extension.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ampkit/autocast.h"
#include "ampkit/grad_scaler.h"
#include "ampkit/monitor.h"
#include "ampkit/ops.h"
#include "binding.h"

namespace ampkit::python {

void bind_monitor(py::module_& m) {
  m.attr("GRAD_STATS_COLUMNS") = ampkit::kGradStatsColumns;
  m.attr("GRAD_STATS_HIST_FIRST") = ampkit::kGradStatsHistFirst;
  m.attr("GRAD_STATS_HIST_MIN_EXP") = ampkit::kGradStatsHistMinExp;
  m.def(
      "grad_stats_by_name",
      [](const at::Tensor& rows) {
        const ampkit::GradStats s = guarded([&] { return ampkit::grad_stats_by_name(rows); });
        py::dict d;
        d["amax"] = s.amax;
        d["l2_norm"] = s.l2_norm;
        d["nonfinite"] = s.nonfinite;
        d["zeros"] = s.zeros;
        d["exp_hist"] = s.exp_hist;
        return d;
      },
      "ampkit::grad_stats_by_name: grad_stats' rows as named views.");
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
