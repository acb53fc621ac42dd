// ampkit._C's autocast functions: per-scope overrides, register_autocast, precision_support and the dtype advice.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "ampkit/autocast.h"
#include "binding.h"

namespace ampkit::python {

void bind_autocast(py::module_& m) {
  auto device_of = [](const std::string& device_type) { return c10::Device(device_type).type(); };
  m.def("_push_autocast_overrides",
        [device_of](const std::string& device_type, const std::vector<std::string>& fp32_ops,
                    const std::vector<std::string>& lowp_ops) {
          guarded([&] { ampkit::push_autocast_overrides(device_of(device_type), {fp32_ops, lowp_ops}); });
        });
  m.def("_pop_autocast_overrides", [] { guarded([] { ampkit::pop_autocast_overrides(); }); });
  m.def(
      "register_autocast",
      [device_of](const std::string& op, const std::string& device_type, const std::string& policy) {
        ampkit::AutocastPolicy p;
        if (policy == "lowp") {
          p = ampkit::AutocastPolicy::kLowerPrecision;
        } else if (policy == "fp32") {
          p = ampkit::AutocastPolicy::kFp32;
        } else if (policy == "promote") {
          p = ampkit::AutocastPolicy::kPromote;
        } else {
          throw py::value_error("register_autocast: policy must be 'lowp', 'fp32' or 'promote', but got '" + policy +
                                "'");
        }
        guarded([&] { ampkit::register_autocast(op, device_of(device_type), p); });
      },
      py::arg("op"), py::arg("device_type"), py::arg("policy"));
  m.def(
      "precision_support",
      [](const std::string& device) {
        // Without the GIL: the first CPU call times a probe through autograd (NOTE [CPU precision probe]).
        const ampkit::PrecisionSupport s = guarded([&] {
          const py::gil_scoped_release no_gil;
          return ampkit::precision_support(c10::Device(device));
        });
        py::dict d;
        d["fp16"] = s.fp16;
        d["bf16"] = s.bf16;
        d["fp16_fast"] = s.fp16_fast;
        d["bf16_fast"] = s.bf16_fast;
        d["lowp_dtype"] = std::string(c10::toString(s.lowp_dtype));
        d["fast"] = s.fast;
        d["recommended"] = std::string(c10::toString(s.recommended));
        d["reason"] = s.reason;
        if (s.measured) {
          py::dict ms;
          for (const auto& [name, t] :
               {std::make_pair("float32", s.fp32_probe), std::make_pair("bfloat16", s.bf16_probe),
                std::make_pair("float16", s.fp16_probe)}) {
            py::dict one;
            one["conv2d"] = t.conv2d_ms;
            one["linear"] = t.linear_ms;
            ms[name] = one;
          }
          d["measured_ms"] = ms;
        }
        return d;
      },
      py::arg("device"), "ampkit::precision_support as a dict (dtypes by their c10 names).");
  m.def(
      "autocast_dtype_advice",
      [](const std::string& device, bool half) {
        return guarded([&] {
          const c10::Device d(device);
          const py::gil_scoped_release no_gil;  // precision_support may time its probe through autograd
          return ampkit::autocast_dtype_advice(d.type(), half ? c10::kHalf : c10::kBFloat16,
                                               ampkit::precision_support(d));
        });
      },
      py::arg("device"), py::arg("half"));
}

}  // namespace ampkit::python
