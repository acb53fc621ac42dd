// The conversion of checked tensor lists into the Torch-free descriptors the kernels take (kernels/common.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "../../kernels/common.h"
#include "op_args.h"

namespace ampkit::detail {

kernels::DType kernel_dtype(at::ScalarType t);

// Dense descriptors of a tensor list. Tensors whose memory is one dense block (any permutation of a contiguous
// tensor) are used in place; the others go through a contiguous staging copy that `write_back()` copies back.
// Zero-size tensors are dropped, or kept as null descriptors with `keep_empty` (one descriptor per tensor).
class DenseList {
 public:
  explicit DenseList(at::TensorList list, bool keep_empty = false);
  const kernels::TensorRef* data() const { return refs_.data(); }
  int64_t size() const { return static_cast<int64_t>(refs_.size()); }
  void write_back();

 private:
  std::vector<kernels::TensorRef> refs_;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged_;  // (original, contiguous copy)
};

// Dense descriptors of (src[i], out[i]) pairs whose elements correspond one to one: a pair whose tensors are both
// dense with the same strides is used in place; otherwise src goes through a contiguous copy and out through a
// contiguous staging tensor that `write_back()` copies back. Zero-size pairs are dropped.
class DensePairs {
 public:
  DensePairs(at::TensorList src, at::TensorList out);
  const kernels::TensorRef* src() const { return src_.data(); }
  const kernels::TensorRef* out() const { return out_.data(); }
  int64_t size() const { return static_cast<int64_t>(src_.size()); }
  void write_back();

 private:
  std::vector<kernels::TensorRef> src_;
  std::vector<kernels::TensorRef> out_;
  std::vector<at::Tensor> src_copies_;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged_;  // (out, contiguous staging tensor)
};

// The data pointer of an optional one-element FP32 tensor, or null.
inline const float* float_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

}  // namespace ampkit::detail
