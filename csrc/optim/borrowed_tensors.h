// Tensors held without a reference for the length of an optimizer step: BorrowedTensors (the lists of the op
// calls) and BorrowedStates (the states a step from Python reads from the caller's dicts).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/MaybeOwned.h>

#include <cstdint>
#include <vector>

#include "ampkit/optim_core.h"

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

namespace ampkit::optim::core {

// NOTE [Borrowed states]
// A step from Python reads each parameter's state from a dict the caller holds. A reference to a tensor Python
// holds costs a GIL round trip each way, three or four per parameter: BorrowedStates lets the binding borrow the
// entries instead, as BorrowedTensors borrows the parameters. A borrowed entry must never be assigned over (the
// assignment would drop a reference never taken). The core says where that cannot happen: with
// may_replace_entries(config) false, a step only fills entries a state lacks. Where it is true (a remainder made
// from a loaded master replaces the master), every entry is referenced. The destructor gives the borrowed entries
// back unreferenced on every exit; an entry replaced anyway would already have lost a reference it never had, so
// that stops the process (an internal assert in a destructor) rather than go on with a tensor freed under its
// owner.
class BorrowedStates {
 public:
  // `n` empty states; `borrow`: whether set() may borrow (!may_replace_entries(config) for the step to come).
  BorrowedStates(size_t n, bool borrow)
      : states_(n), pointers_(n), before_(n * kFields, nullptr), borrowed_(n * kFields, 0), borrow_(borrow) {
    TORCH_INTERNAL_ASSERT(ParamState::fields().size() == kFields);
    for (size_t i = 0; i < n; ++i) {
      pointers_[i] = &states_[i];
    }
  }
  BorrowedStates(const BorrowedStates&) = delete;
  BorrowedStates& operator=(const BorrowedStates&) = delete;
  ~BorrowedStates() {
    const auto& fields = ParamState::fields();
    for (size_t i = 0; i < states_.size(); ++i) {
      for (size_t k = 0; k < kFields; ++k) {
        if (borrowed_[i * kFields + k] != 0) {
          at::Tensor& t = states_[i].*(fields[k].second);
          TORCH_INTERNAL_ASSERT(t.unsafeGetTensorImpl() == before_[i * kFields + k],
                                "ampkit: a borrowed optimizer state entry was replaced");
          t.unsafeReleaseTensorImpl();  // unreferenced: borrowed
        }
      }
    }
  }

  // Sets entry k (ParamState::fields() order) of state i, which must be absent: borrowed where borrowing is allowed
  // and `borrowable` (the tensor's owner outlives this object), else referenced.
  void set(size_t i, size_t k, const at::Tensor& t, bool borrowable) {
    at::Tensor& entry = states_[i].*(ParamState::fields()[k].second);
    TORCH_INTERNAL_ASSERT(!entry.defined() && borrowed_[i * kFields + k] == 0);
    if (borrow_ && borrowable) {
      entry = c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t);
      borrowed_[i * kFields + k] = 1;
    } else {
      entry = t;
    }
    before_[i * kFields + k] = t.unsafeGetTensorImpl();
  }
  // The TensorImpl entry k of state i had when it was set (nullptr: absent): what a step created or replaced is
  // what differs from it.
  const c10::TensorImpl* before(size_t i, size_t k) const { return before_[i * kFields + k]; }
  bool borrowed(size_t i, size_t k) const { return borrowed_[i * kFields + k] != 0; }
  size_t size() const { return states_.size(); }
  ParamState& operator[](size_t i) { return states_[i]; }
  const std::vector<ParamState*>& pointers() const { return pointers_; }

 private:
  static constexpr size_t kFields = 9;  // ParamState::fields().size()
  std::vector<ParamState> states_;      // never reallocated: the borrows are released where they were made
  std::vector<ParamState*> pointers_;
  std::vector<const c10::TensorImpl*> before_;
  std::vector<uint8_t> borrowed_;
  bool borrow_;
};

}  // namespace ampkit::optim::core
