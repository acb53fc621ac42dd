// ampkit._C's GradScaler: the C++ class ampkit.GradScaler (python/ampkit/grad_scaler.py) adapts, its state as
// Python dicts, and the scaler checkpoint files.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "ampkit/grad_scaler.h"
#include "binding.h"

namespace ampkit::python {
namespace {

// A scaler state to a Python dict (plain floats, ints and None, as torch.amp.GradScaler's).
py::dict to_py(const ampkit::ScalerState& state) {
  py::dict d;
  for (const auto& [key, v] : state) {
    if (v.isDouble()) {
      d[py::str(key)] = py::float_(v.toDouble());
    } else if (v.isInt()) {
      d[py::str(key)] = py::int_(v.toInt());
    } else if (v.isBool()) {
      d[py::str(key)] = py::bool_(v.toBool());
    } else if (v.isDoubleList()) {
      d[py::str(key)] = py::cast(v.toDoubleVector());
    } else {
      d[py::str(key)] = py::none();
    }
  }
  return d;
}

// A Python mapping to a scaler state; values must be numbers, bools or None (the C++ side checks ranges).
ampkit::ScalerState from_py(const py::dict& d) {
  ampkit::ScalerState state;
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (v.is_none()) {
      state.emplace_back(key, c10::IValue());
    } else if (py::isinstance<py::bool_>(v)) {
      state.emplace_back(key, c10::IValue(v.cast<bool>()));
    } else if (py::isinstance<py::int_>(v)) {
      state.emplace_back(key, c10::IValue(v.cast<int64_t>()));
    } else if (py::isinstance<py::float_>(v)) {
      state.emplace_back(key, c10::IValue(v.cast<double>()));
    } else if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
      std::vector<double> values;
      for (const py::handle x : v) {
        if (!(py::isinstance<py::float_>(x) || py::isinstance<py::int_>(x)) || py::isinstance<py::bool_>(x)) {
          throw py::type_error("GradScaler.load_state_dict: '" + key + "' must hold numbers, but holds a " +
                               std::string(py::str(py::type::of(x).attr("__name__"))));
        }
        values.push_back(x.cast<double>());
      }
      state.emplace_back(key, c10::IValue(values));
    } else if (THPVariable_Check(v.ptr()) && THPVariable_Unpack(v.ptr()).numel() == 1) {
      // torch.amp.GradScaler fills its tensors from whatever .fill_ takes: accept one-element tensors too.
      const at::Tensor t = THPVariable_Unpack(v.ptr());
      state.emplace_back(key, t.is_floating_point() ? c10::IValue(t.item<double>()) : c10::IValue(t.item<int64_t>()));
    } else {
      throw py::type_error("GradScaler.load_state_dict: '" + key +
                           "' must be a number, a list of numbers or None, "
                           "but got " +
                           std::string(py::str(py::type::of(v))));
    }
  }
  return state;
}

py::dict stats_to_py(const ampkit::GradScalerStats& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["skipped_steps"] = s.skipped_steps;
  d["last_overflow_step"] =
      s.last_overflow_step > 0 ? py::object(py::int_(s.last_overflow_step)) : py::object(py::none());
  d["scale"] = s.scale;
  d["growth_tracker"] = s.growth_tracker;
  d["hysteresis_tracker"] = s.hysteresis_tracker;
  d["overflows_at_min_scale"] = s.overflows_at_min_scale;
  d["spike_skipped_steps"] = s.spike_skipped_steps;
  return d;
}

}  // namespace

void bind_scaler(py::module_& m) {
  using ampkit::GradScaler;
  using Params = std::vector<at::Tensor>;
  // Destroyed without the GIL, as GradientAllReduce: it may hold the last reference to a process group.
  py::class_<GradScaler, GilFreeDelete<GradScaler>::Ptr>(m, "GradScaler")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                       bool enabled, int64_t hysteresis, std::optional<double> min_scale,
                       std::optional<double> max_scale, bool raise_at_min_scale, bool scaling, bool overflow_report,
                       py::object process_group, bool dynamic, bool calibrate, double calibration_margin,
                       const std::optional<py::dict>& spike_skip) {
             ampkit::GradScalerOptions o;
             o.init_scale(init_scale)
                 .growth_factor(growth_factor)
                 .backoff_factor(backoff_factor)
                 .growth_interval(growth_interval)
                 .enabled(enabled)
                 .hysteresis(hysteresis)
                 .min_scale(min_scale)
                 .max_scale(max_scale)
                 .raise_at_min_scale(raise_at_min_scale)
                 .scaling(scaling)
                 .dynamic(dynamic)
                 .calibrate(calibrate)
                 .calibration_margin(calibration_margin)
                 .overflow_report(overflow_report);
             if (!process_group.is_none()) {
               o.process_group(process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
             }
             if (spike_skip) {  // keys and types checked by ampkit.GradScaler; ranges by the C++ options check
               ampkit::SpikeSkipOptions so;
               const py::dict& d = *spike_skip;
               if (d.contains("window")) {
                 so.window(d["window"].cast<int64_t>());
               }
               if (d.contains("sigmas")) {
                 so.sigmas(d["sigmas"].cast<double>());
               }
               if (d.contains("warmup")) {
                 so.warmup(d["warmup"].cast<int64_t>());
               }
               if (d.contains("loss")) {
                 so.loss(d["loss"].cast<bool>());
               }
               if (d.contains("grad_norm")) {
                 so.grad_norm(d["grad_norm"].cast<bool>());
               }
               o.spike_skip(so);
             }
             return guarded_as("ampkit::GradScaler", "ampkit.GradScaler",
                               [&] { return GilFreeDelete<GradScaler>::Ptr(new GradScaler(o)); });
           }),
           py::arg("init_scale"), py::arg("growth_factor"), py::arg("backoff_factor"), py::arg("growth_interval"),
           py::arg("enabled"), py::arg("hysteresis"), py::arg("min_scale"), py::arg("max_scale"),
           py::arg("raise_at_min_scale"), py::arg("scaling"), py::arg("overflow_report"), py::arg("process_group"),
           py::arg("dynamic") = true, py::arg("calibrate") = false, py::arg("calibration_margin") = 2.0,
           py::arg("spike_skip") = py::none())
      .def("scale", [](GradScaler& s, const at::Tensor& t) { return guarded([&] { return s.scale(t); }); })
      .def("scale_factor",
           [](GradScaler& s, const at::Tensor& t) { return guarded([&] { return s.scale_factor(t); }); })
      .def("observe_loss", [](GradScaler& s, const at::Tensor& t) { guarded([&] { s.observe_loss(t); }); })
      .def(
          "unscale_params_",
          [](GradScaler& s, int64_t key, const Params& p, const std::optional<Params>& g) {
            guarded([&] { g ? s.unscale_params_(key, p, *g) : s.unscale_params_(key, p); });
          },
          py::arg("key"), py::arg("params"), py::arg("grads") = py::none())
      .def("begin_step", [](const GradScaler& s, int64_t key) { guarded([&] { s.begin_step(key); }); })
      .def("prepare_step",
           [](GradScaler& s, int64_t key, const Params& p) { return guarded([&] { return s.prepare_step(key, p); }); })
      .def(
          "prepare_fused_step",
          [](GradScaler& s, int64_t key, const Params& p, const std::optional<Params>& g) {
            auto [grad_scale, found_inf] =
                guarded([&] { return g ? s.prepare_fused_step(key, p, *g) : s.prepare_fused_step(key, p); });
            return py::make_tuple(optional_tensor(grad_scale), found_inf);
          },
          py::arg("key"), py::arg("params"), py::arg("grads") = py::none())
      .def("mark_stepped", &GradScaler::mark_stepped)
      .def("record_unscaled_grads",
           [](GradScaler& s, const at::Tensor& found_inf) { guarded([&] { s.record_unscaled_grads(found_inf); }); })
      .def("reduce_with_found_inf",
           [](GradScaler& s, const std::vector<at::Tensor>& tensors) {
             guarded_as("ampkit::GradScaler::reduce_with_found_inf", "GradScaler.reduce_with_found_inf", [&] {
               const py::gil_scoped_release release;  // may wait on the process group
               s.reduce_with_found_inf(tensors);
             });
           })
      .def("unscale_factor",
           [](GradScaler& s, const std::string& device) {
             return guarded([&] { return s.unscale_factor(c10::Device(device)); });
           })
      .def("grads_unscaled_outside", &GradScaler::grads_unscaled_outside)
      .def("in_iteration", &GradScaler::in_iteration)
      .def("stage", [](const GradScaler& s, int64_t key) { return static_cast<int>(s.stage(key)); })
      .def("found_inf_per_device", &GradScaler::found_inf_per_device)
      .def("update", [](GradScaler& s) { guarded([&] { s.update(); }); })
      .def("update_to", [](GradScaler& s, double v) { guarded([&] { s.update(v); }); })
      .def("update_to_tensor", [](GradScaler& s, const at::Tensor& v) { guarded([&] { s.update(v); }); })
      .def("get_scale", [](const GradScaler& s) { return guarded([&] { return s.get_scale(); }); })
      .def("get_scale_async", [](const GradScaler& s) { return optional_tensor(s.get_scale_async()); })
      .def("last_step_ran", [](const GradScaler& s) { return optional_tensor(s.last_step_ran()); })
      .def("last_step_ran_of", [](const GradScaler& s, int64_t key) { return optional_tensor(s.last_step_ran(key)); })
      .def("get_growth_factor", &GradScaler::get_growth_factor)
      .def("set_growth_factor", &GradScaler::set_growth_factor)
      .def("get_backoff_factor", &GradScaler::get_backoff_factor)
      .def("set_backoff_factor", &GradScaler::set_backoff_factor)
      .def("get_growth_interval", &GradScaler::get_growth_interval)
      .def("set_growth_interval", &GradScaler::set_growth_interval)
      .def("get_growth_tracker", [](const GradScaler& s) { return guarded([&] { return s.get_growth_tracker(); }); })
      .def("init_scale", &GradScaler::init_scale)
      .def("init_growth_tracker", &GradScaler::init_growth_tracker)
      .def("get_growth_tracker_async",
           [](const GradScaler& s) { return optional_tensor(s.get_growth_tracker_async()); })
      .def("lazy_init_state",
           [](GradScaler& s, const std::string& device) { guarded([&] { s.lazy_init_state(at::Device(device)); }); })
      .def("is_enabled", &GradScaler::is_enabled)
      .def("stats", [](const GradScaler& s) { return stats_to_py(guarded([&] { return s.stats(); })); })
      .def("overflow_report", [](const GradScaler& s) { return guarded([&] { return s.overflow_report(); }); })
      .def("set_parameter_names", &GradScaler::set_parameter_names)
      .def("state_dict", [](const GradScaler& s) { return to_py(guarded([&] { return s.state_dict(); })); })
      .def("load_state_dict",
           [](GradScaler& s, const py::dict& d) {
             const ampkit::ScalerState state = from_py(d);
             guarded([&] { s.load_state_dict(state); });
           })
      .def("save",
           [](const GradScaler& s, const std::string& path) {
             guarded([&] {
               torch::serialize::OutputArchive archive;
               s.save(archive);
               archive.save_to(path);
             });
           })
      .def("load", [](GradScaler& s, const std::string& path) {
        guarded([&] {
          torch::serialize::InputArchive archive;
          archive.load_from(path);
          s.load(archive);
        });
      });

  m.def(
      "read_scaler_state",
      [](const std::string& path) { return to_py(guarded([&] { return GradScaler::read_state(path); })); },
      "The state of a GradScaler checkpoint file (torch::save(scaler, path) in C++, GradScaler.save in Python) as "
      "a state_dict that torch.amp.GradScaler.load_state_dict accepts.");
  m.def(
      "write_scaler_state",
      [](const py::dict& d, const std::string& path) {
        const ampkit::ScalerState state = from_py(d);
        guarded([&] { GradScaler::write_state(state, path); });
      },
      "Writes a state_dict (torch.amp.GradScaler's or ampkit's) as a checkpoint file that torch::load(scaler, path) "
      "reads in C++.");
}

}  // namespace ampkit::python
