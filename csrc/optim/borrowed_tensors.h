// A list of tensors borrowed from tensors that outlive it, for the op calls of an optimizer step.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/MaybeOwned.h>

#include <vector>

namespace ampkit::detail {

// NOTE [Borrowed tensor lists]
// An optimizer step over thousands of parameters passes each tensor through several lists (the parameters with a
// grad, the per-call lists of the ops). Copying an at::Tensor changes its reference count, and for a tensor that
// Python also holds, torch may take the GIL to keep the Python object's count in step: that was the largest
// single cost of a step over small tensors. A BorrowedTensors holds its tensors without a reference (torch's
// MaybeOwned borrows): the tensors it is built from must outlive it, which holds for a step's lists, built from the
// parameters, their grads and their states and dropped before the step returns.
class BorrowedTensors {
 public:
  BorrowedTensors() = default;
  BorrowedTensors(const BorrowedTensors&) = delete;
  BorrowedTensors& operator=(const BorrowedTensors&) = delete;
  ~BorrowedTensors() {
    for (auto& t : tensors_) {
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    }
  }
  void reserve(size_t n) { tensors_.reserve(n); }
  void push_back(const at::Tensor& t) { tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t)); }
  size_t size() const { return tensors_.size(); }
  bool empty() const { return tensors_.empty(); }
  const at::Tensor& operator[](size_t i) const { return tensors_[i]; }
  operator at::TensorList() const { return tensors_; }  // NOLINT(google-explicit-constructor)

 private:
  std::vector<at::Tensor> tensors_;
};

}  // namespace ampkit::detail
