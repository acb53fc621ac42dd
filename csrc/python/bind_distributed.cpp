// ampkit._C's binding of ampkit::distributed::GradientAllReduce, for ampkit.distributed.GradientAllReduce.
#include <torch/extension.h>

#include <string>
#include <utility>
#include <vector>

#include "ampkit/distributed.h"
#include "ampkit/grad_scaler.h"
#include "binding.h"

namespace ampkit::python {

void bind_distributed(py::module_& m) {
  m.def(
      "all_reduce_max",
      [](const std::vector<at::Tensor>& tensors, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        guarded([&] {
          const py::gil_scoped_release release;  // waits on the process group
          ampkit::distributed::all_reduce_max(tensors, group);
        });
      },
      py::arg("tensors"), py::arg("process_group"),
      "The elementwise MAX over the group's ranks of each tensor, in one all-reduce (packed).");
  // ampkit::distributed::GradientAllReduce, for ampkit.distributed.GradientAllReduce. Destroyed without the GIL:
  // dropping the last reference to a Gloo process group joins its worker thread, which may need the GIL to free
  // Python state of finished work.
  py::class_<ampkit::distributed::GradientAllReduce, GilFreeDelete<ampkit::distributed::GradientAllReduce>::Ptr>(
      m, "GradientAllReduce")
      .def(py::init([](std::vector<at::Tensor> params, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const std::string& compression, int64_t bucket_bytes, bool overlap, ampkit::GradScaler* scaler) {
             using ampkit::distributed::Compression;
             TORCH_CHECK_VALUE(compression == "none" || compression == "fp16" || compression == "bf16",
                               "GradientAllReduce: compression must be None, 'fp16' or 'bf16', but got '", compression,
                               "'");
             const Compression c = compression == "fp16"   ? Compression::kFP16
                                   : compression == "bf16" ? Compression::kBF16
                                                           : Compression::kNone;
             return guarded([&] {
               return GilFreeDelete<ampkit::distributed::GradientAllReduce>::Ptr(
                   new ampkit::distributed::GradientAllReduce(std::move(params), group,
                                                              ampkit::distributed::GradientAllReduceOptions()
                                                                  .compression(c)
                                                                  .bucket_bytes(bucket_bytes)
                                                                  .overlap(overlap),
                                                              scaler));
             });
           }),
           py::arg("params"), py::arg("process_group"), py::arg("compression"), py::arg("bucket_bytes"),
           py::arg("overlap"), py::arg("scaler").none(true), py::keep_alive<1, 7>())
      .def("synchronize",
           [](ampkit::distributed::GradientAllReduce& g) {
             guarded([&] {
               const py::gil_scoped_release release;  // waits on the process group
               g.synchronize();
             });
           })
      .def("set_require_sync", &ampkit::distributed::GradientAllReduce::set_require_sync)
      .def("require_sync", &ampkit::distributed::GradientAllReduce::require_sync)
      .def("bucket_indices", &ampkit::distributed::GradientAllReduce::bucket_indices)
      .def("bytes_reduced", &ampkit::distributed::GradientAllReduce::bytes_reduced)
      .def("allreduces", &ampkit::distributed::GradientAllReduce::allreduces);
}

}  // namespace ampkit::python
