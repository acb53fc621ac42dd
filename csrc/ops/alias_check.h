// The alias check of the ops: it records the byte range of every tensor an op writes or reads while writing, and
// refuses two that share an element (NOTE [Aliasing]). Recording is inline (the fused steps record every
// parameter's tensors in their one pass, NOTE [One pass per parameter] in checks.cpp); the check is in
// alias_check.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/COW.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ampkit::detail {

// NOTE [Aliasing]
// The tensors an op writes (and the device scalars it reads while writing) must not share memory: two views of
// one buffer in a list would be updated twice, a master aliasing a moment would corrupt the weight, found_inf
// aliasing inv_scale would change the scale mid-launch. Byte ranges are sorted to find candidate pairs in
// O(n log n); a candidate is confirmed with ATen's overlap test, as ATen's own in-place ops do: full or partial
// overlap is refused, while views it cannot decide (interleaved strided views of one buffer, such as the even and
// odd columns of a matrix, which share no element) are accepted.
class AliasCheck {
 public:
  // `op` names the op in the error message; it must outlive the check.
  explicit AliasCheck(const char* op) : op_(op) {}

  void add(const char* arg, const at::Tensor& t, int64_t index = -1, bool read_only = false) {
    if (t.defined()) {
      add_range(arg, t, index, read_only, nullptr);
    }
  }

  // add() of a defined tensor that also returns its data pointer when `data` (t.mutable_data_ptr(): its metadata
  // and storage read once for both; nullptr without `data`). In a part (make_part()), a tensor whose storage would
  // materialize on that call (copy-on-write, a lazy materializer) throws GiveUp instead (NOTE [Checks in parts] in
  // checks.cpp).
  void* add_defined(const char* arg, const at::Tensor& t, int64_t index, bool read_only, bool data) {
    if (data && part_ && materializes(t)) {
      throw GiveUp{};
    }
    void* ptr = data ? t.mutable_data_ptr() : nullptr;
    add_range(arg, t, index, read_only, ptr);
    return ptr;
  }

  // The ranges of one part of a pass run on a worker thread (NOTE [Checks in parts] in checks.cpp), and what a
  // part throws where it must leave the parameters to one pass on the calling thread.
  void make_part() { part_ = true; }
  bool is_part() const { return part_; }
  struct GiveUp {};

  // Appends the ranges `part` recorded, after this one's: as if they had been added here, in that order.
  void append(const AliasCheck& part) {
    reserve(part.ranges_.size());
    const auto offset = static_cast<uint32_t>(entries_.size());
    for (Range r : part.ranges_) {
      r.entry += offset;
      ranges_.push_back(r);
    }
    entries_.insert(entries_.end(), part.entries_.begin(), part.entries_.end());
    all_contiguous_ = all_contiguous_ && part.all_contiguous_;
  }

  void reserve(size_t more) {
    // Growing geometrically (an exact reserve per list would copy every earlier record).
    if (ranges_.capacity() < ranges_.size() + more) {
      ranges_.reserve(std::max(ranges_.size() + more, 2 * ranges_.capacity()));
      entries_.reserve(ranges_.capacity());
    }
  }

 private:
  // `ptr`: t's data pointer when the caller has it.
  void add_range(const char* arg, const at::Tensor& t, int64_t index, bool read_only, const void* ptr) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->device_type() == c10::DeviceType::Meta || impl->numel() == 0 || !impl->has_storage()) {
      return;
    }
    int64_t extent = 1;  // elements from the first to one past the last (a contiguous tensor: its numel)
    if (impl->is_contiguous()) {
      extent = impl->numel();
    } else {
      all_contiguous_ = false;
      const auto sizes = impl->sizes();
      const auto strides = impl->strides();
      for (size_t d = 0; d < sizes.size(); ++d) {
        extent += (sizes[d] - 1) * strides[d];
      }
    }
    const auto begin = reinterpret_cast<uintptr_t>(ptr != nullptr ? ptr : t.const_data_ptr());
    ranges_.push_back({begin, begin + static_cast<uintptr_t>(extent * static_cast<int64_t>(impl->itemsize())),
                       static_cast<uint32_t>(entries_.size())});
    entries_.push_back({arg, index, &t, read_only});
  }

 public:
  // `read_only`: the list is only read, so its tensors may share memory with each other (never with the others).
  void add(const char* arg, at::TensorList list, bool read_only = false) {
    reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      add(arg, list[i], static_cast<int64_t>(i), read_only);
    }
  }

  void add(const char* arg, const std::optional<at::Tensor>& t, bool read_only = false) {
    if (t.has_value()) {
      add(arg, *t, -1, read_only);
    }
  }

  // Throws, naming both arguments, if any two added tensors share an element. Ranges are sorted by start (small
  // records); a range that starts at or after the end of every earlier one overlaps none of them, so only the
  // others are compared with the ranges still open.
  void check();

  // How many checks this thread passed from the memo (NOTE [Alias check memo] in alias_check.cpp), for tests.
  static uint64_t memo_hits();

 private:
  struct Range {
    uintptr_t begin;
    uintptr_t end;
    uint32_t entry;
  };
  struct Entry {
    const char* arg;
    int64_t index;
    const at::Tensor* t;
    bool read_only;
  };

  static std::string name(const Entry& e);
  // Whether t.mutable_data_ptr() would materialize t's storage: copy-on-write (torch forbids that inside
  // at::parallel_for), or from torch 2.12 on any lazy materializer.
  static bool materializes(const at::Tensor& t) {
    const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();
    if (!storage) {
      return false;
    }
    const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
    if (impl->has_materializer()) {
      return true;
    }
#endif
    return c10::impl::cow::is_cow_data_ptr(impl->data_ptr());
  }

  const char* op_;
  std::vector<Range> ranges_;
  std::vector<Entry> entries_;
  bool all_contiguous_ = true;
  bool part_ = false;
};

}  // namespace ampkit::detail
