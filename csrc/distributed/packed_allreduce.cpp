// ampkit::distributed::all_reduce_max: several tensors reduced (MAX) in one collective.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ampkit/distributed.h"

namespace ampkit::distributed {

void all_reduce_max(const std::vector<at::Tensor>& tensors,
                    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group) {
  TORCH_CHECK_VALUE(process_group, "ampkit::distributed::all_reduce_max: process_group must be a process group");
  if (tensors.empty()) {
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided, "ampkit::distributed::all_reduce_max: tensors[", i,
                      "] must be a defined strided tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type() && t.is_floating_point(),
                     "ampkit::distributed::all_reduce_max: tensors[", i,
                     "] must be floating and of tensors[0]'s dtype (", tensors[0].scalar_type(), "), but got ",
                     t.scalar_type());
    TORCH_CHECK(t.device() == tensors[0].device(), "ampkit::distributed::all_reduce_max: tensors[", i,
                "] must be on tensors[0]'s device (", tensors[0].device(), "), but is on ", t.device());
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  if (tensors.size() == 1 && tensors[0].is_contiguous()) {
    std::vector<at::Tensor> one{tensors[0]};
    process_group->allreduce(one, opts)->wait();
    return;
  }
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  std::vector<at::Tensor> packed{at::cat(flat)};
  process_group->allreduce(packed, opts)->wait();
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    const_cast<at::Tensor&>(t).copy_(packed[0].narrow(0, offset, n).view(t.sizes()));
    offset += n;
  }
}

}  // namespace ampkit::distributed
