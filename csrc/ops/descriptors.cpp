// Tensor lists as kernel descriptors (see descriptors.h).
#include "descriptors.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace ampkit::detail {

kernels::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kDouble:
      return kernels::DType::kFloat64;
    default:
      TORCH_INTERNAL_ASSERT(false, "ampkit: no kernel dtype for ", t);
  }
}

DenseList::DenseList(at::TensorList list, bool keep_empty) {
  refs_.reserve(list.size());
  for (const at::Tensor& t : list) {
    if (t.numel() == 0) {
      if (keep_empty) {
        refs_.push_back({nullptr, 0, kernel_dtype(t.scalar_type())});
      }
      continue;
    }
    if (t.is_non_overlapping_and_dense()) {
      refs_.push_back({t.data_ptr(), t.numel(), kernel_dtype(t.scalar_type())});
    } else {
      at::Tensor dense = t.contiguous();
      refs_.push_back({dense.data_ptr(), dense.numel(), kernel_dtype(dense.scalar_type())});
      staged_.emplace_back(t, std::move(dense));
    }
  }
}

void DenseList::write_back() {
  for (auto& [original, dense] : staged_) {
    original.copy_(dense);
  }
}

DensePairs::DensePairs(at::TensorList src, at::TensorList out) {
  for (size_t i = 0; i < src.size(); ++i) {
    const at::Tensor& s = src[i];
    const at::Tensor& o = out[i];
    if (s.numel() == 0) {
      continue;
    }
    if (s.is_non_overlapping_and_dense() && o.is_non_overlapping_and_dense() && s.strides() == o.strides()) {
      src_.push_back({s.data_ptr(), s.numel(), kernel_dtype(s.scalar_type())});
      out_.push_back({o.data_ptr(), o.numel(), kernel_dtype(o.scalar_type())});
      continue;
    }
    src_copies_.push_back(s.contiguous());
    src_.push_back({src_copies_.back().data_ptr(), s.numel(), kernel_dtype(s.scalar_type())});
    if (o.is_contiguous()) {
      out_.push_back({o.data_ptr(), o.numel(), kernel_dtype(o.scalar_type())});
    } else {
      at::Tensor dense = at::empty(o.sizes(), o.options().memory_format(at::MemoryFormat::Contiguous));
      out_.push_back({dense.data_ptr(), dense.numel(), kernel_dtype(dense.scalar_type())});
      staged_.emplace_back(o, std::move(dense));
    }
  }
}

void DensePairs::write_back() {
  for (auto& [original, dense] : staged_) {
    original.copy_(dense);
  }
}

at::Tensor grad_stats_result(const GradStatsArgs& a) {
  const at::Device device = !a.grads.empty() ? a.grads[0].device() : a.inv_scale->device();
  return at::empty({static_cast<int64_t>(a.grads.size()), kernels::kGradStatsColumns},
                   at::TensorOptions().dtype(at::kDouble).device(device));
}

at::Tensor grad_norm_result(const GradNormArgs& a) {
  const at::Device device = !a.grads.empty() ? a.grads[0].device() : a.grad_scale->device();
  return at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
}

}  // namespace ampkit::detail
