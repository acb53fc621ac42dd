// ampkit._C's FP8 helpers for ampkit.fp8: the recipe checks, the formats' largest values and the shape rule of
// Float8Linear, from <ampkit/fp8.h>, so that the Python and LibTorch modules decide alike.
#include <torch/extension.h>

#include <string>

#include "ampkit/fp8.h"
#include "ampkit/ops.h"
#include "binding.h"

namespace ampkit::python {

void bind_fp8(py::module_& m) {
  m.def(
      "fp8_maxes",
      [](const std::string& fp8_format) {
        const auto maxes = guarded_as("ampkit::fp8", "ampkit.fp8", [&] { return ampkit::fp8::fp8_maxes(fp8_format); });
        return py::make_tuple(maxes[0], maxes[1], maxes[2]);
      },
      py::arg("fp8_format"), "The FP8 maxima of (input, weight, grad_output) for a recipe's fp8_format.");
  m.def(
      "fp8_dtypes",
      [](const std::string& fp8_format) {
        const auto dtypes =
            guarded_as("ampkit::fp8_dtypes", "ampkit.fp8", [&] { return ampkit::fp8_dtypes(fp8_format); });
        return py::make_tuple(py::cast(dtypes[0]), py::cast(dtypes[1]), py::cast(dtypes[2]));
      },
      py::arg("fp8_format"), "The FP8 dtypes of (input, weight, grad_output) for a recipe's fp8_format.");
  m.def(
      "fp8_unsupported_reason",
      [](int64_t in_features, int64_t out_features) {
        return ampkit::fp8::unsupported_reason(in_features, out_features);
      },
      py::arg("in_features"), py::arg("out_features"),
      "Why a linear layer of these features cannot run in FP8, or '' when it can.");
  m.def(
      "fp8_check_current_scaling",
      [](const std::string& granularity, bool power_of_2, double amax_epsilon, const std::string& fp8_format) {
        guarded_as("ampkit::fp8", "ampkit.fp8", [&] {
          ampkit::fp8::check_recipe(ampkit::fp8::CurrentScaling()
                                        .granularity(granularity)
                                        .power_of_2(power_of_2)
                                        .amax_epsilon(amax_epsilon)
                                        .fp8_format(fp8_format));
        });
      },
      py::arg("granularity"), py::arg("power_of_2"), py::arg("amax_epsilon"), py::arg("fp8_format"),
      "Raises unless Float8Linear implements this current-scaling recipe.");
  m.def(
      "fp8_check_delayed_scaling",
      [](int64_t amax_history_len, double margin, const std::string& amax_compute_algo, const std::string& fp8_format) {
        guarded_as("ampkit::fp8", "ampkit.fp8", [&] {
          ampkit::fp8::check_recipe(ampkit::fp8::DelayedScaling()
                                        .amax_history_len(amax_history_len)
                                        .margin(margin)
                                        .amax_compute_algo(amax_compute_algo)
                                        .fp8_format(fp8_format));
        });
      },
      py::arg("amax_history_len"), py::arg("margin"), py::arg("amax_compute_algo"), py::arg("fp8_format"),
      "Raises unless Float8Linear implements this delayed-scaling recipe.");
}

}  // namespace ampkit::python
