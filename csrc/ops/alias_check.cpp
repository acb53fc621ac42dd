// The check of AliasCheck (alias_check.h, NOTE [Aliasing]): the recorded byte ranges sorted, candidate pairs
// confirmed with ATen's overlap test, and the last passing verdict kept per thread (NOTE [Alias check memo]).
#include "alias_check.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ampkit::detail {

void AliasCheck::check() {
  // NOTE [Alias check memo]
  // An optimizer's lists are the same tensors step after step (and, with grads kept between steps or reused
  // by the allocator, the same memory). The verdict depends only on the ranges and which of them are read-only
  // when every tensor is contiguous (two contiguous tensors share an element iff their ranges overlap), so the
  // last call that passed on this thread is kept: the same ranges in the same order pass again without the sort.
  // Compared in place; the key is built (before the sort reorders the ranges) only when it differs.
  thread_local std::vector<uintptr_t> passed;
  thread_local const char* passed_op = nullptr;
  std::vector<uintptr_t> key;
  if (all_contiguous_) {
    bool same = passed_op == op_ && passed.size() == ranges_.size() * 3;
    for (size_t i = 0; same && i < ranges_.size(); ++i) {
      const Range& r = ranges_[i];
      same = passed[3 * i] == r.begin && passed[3 * i + 1] == r.end &&
             passed[3 * i + 2] == (entries_[r.entry].read_only ? 1u : 0u);
    }
    if (same) {
      return;
    }
    key.reserve(ranges_.size() * 3);
    for (const Range& r : ranges_) {
      key.push_back(r.begin);
      key.push_back(r.end);
      key.push_back(entries_[r.entry].read_only ? 1 : 0);
    }
  }
  std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<const Range*> open;
  uintptr_t max_end = 0;
  for (const Range& r : ranges_) {
    if (r.begin >= max_end) {
      open.clear();
    } else {
      open.erase(std::remove_if(open.begin(), open.end(), [&](const Range* o) { return o->end <= r.begin; }),
                 open.end());
      const Entry& e = entries_[r.entry];
      for (const Range* o : open) {
        const Entry& oe = entries_[o->entry];
        if (oe.read_only && e.read_only) {
          continue;
        }
        const at::MemOverlapStatus status = at::get_overlap_status(*oe.t, *e.t);
        if (status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial) {
          TORCH_CHECK(false, "ampkit::", op_, ": ", name(oe), " and ", name(e),
                      " share memory, but every tensor the op writes (and each device scalar it reads) must be "
                      "distinct: the same tensor twice in a list, or two overlapping views of one buffer?");
        }
      }
    }
    open.push_back(&r);
    max_end = std::max(max_end, r.end);
  }
  if (all_contiguous_) {
    passed = std::move(key);
    passed_op = op_;
  }
}

std::string AliasCheck::name(const Entry& e) {
  return e.index < 0 ? std::string(e.arg) : std::string(e.arg) + "[" + std::to_string(e.index) + "]";
}

}  // namespace ampkit::detail
