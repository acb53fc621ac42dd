// GradScaler's all-reduce of found_inf over its process group, and the tensors that travel with it
// (NOTE [Tensors reduced with found_inf] in <ampkit/grad_scaler.h>).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ampkit/distributed.h"
#include "ampkit/grad_scaler.h"

namespace ampkit {

void GradScaler::reduce_with_found_inf(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK_VALUE(options_.process_group(),
                    "ampkit::GradScaler::reduce_with_found_inf: needs options().process_group() (the group whose "
                    "ranks must agree), but this scaler has none");
  const bool now = !enabled_ || !scale_.defined();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided, "ampkit::GradScaler::reduce_with_found_inf: tensors[",
                      i, "] must be a defined strided tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "ampkit::GradScaler::reduce_with_found_inf: tensors[", i,
                     "] must be a Float tensor, but got ", t.scalar_type());
    const at::Device expected = now ? tensors[0].device() : scale_.device();
    TORCH_CHECK(t.device() == expected, "ampkit::GradScaler::reduce_with_found_inf: tensors[", i, "] must be on ",
                now ? "tensors[0]'s device (" : "the scale's device (", expected, "), but is on ", t.device());
  }
  if (now) {
    distributed::all_reduce_max(tensors, options_.process_group());
    return;
  }
  reduce_with_found_inf_.insert(reduce_with_found_inf_.end(), tensors.begin(), tensors.end());
}

void GradScaler::all_reduce_found_inf(const at::Tensor& flag) {
  std::vector<at::Tensor> tensors{flag};
  tensors.insert(tensors.end(), reduce_with_found_inf_.begin(), reduce_with_found_inf_.end());
  reduce_with_found_inf_.clear();
  distributed::all_reduce_max(tensors, options_.process_group());
}

}  // namespace ampkit
