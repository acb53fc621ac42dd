// The check of AliasCheck (alias_check.h, NOTE [Aliasing]): the recorded byte ranges sorted, candidate pairs
// confirmed with ATen's overlap test, and the last passing verdicts kept per thread (NOTE [Alias check memo]).
#include "alias_check.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ampkit::detail {

namespace {
thread_local uint64_t memo_hit_count = 0;
}  // namespace

uint64_t AliasCheck::memo_hits() { return memo_hit_count; }

void AliasCheck::check() {
  // NOTE [Alias check memo]
  // An optimizer's lists are the same tensors step after step (and, with grads kept between steps or reused
  // by the allocator, the same memory). Where every tensor is contiguous and no two ranges overlap, the verdict
  // (pass) depends only on the ranges and which of them are read-only, so such calls that passed on this thread
  // are kept, kMemoSlots of them, the least recently used replaced: the same ranges in
  // the same order pass again without the sort. A set that passed with overlapping ranges (read-only ones, or
  // memory that two storages share, which ATen's overlap test cannot see) is not kept: the same ranges as views
  // of one storage must be refused. Several slots, so that the scaler's inf check and scale update between two
  // steps (or a second optimizer's step) do not evict an optimizer's verdict; sets of more than kMemoMaxRanges
  // ranges are not kept (their keys would hold megabytes per thread). Compared in place; the key is built
  // (before the sort reorders the ranges) only when no slot holds it.
  struct Memo {
    const char* op = nullptr;
    std::vector<uintptr_t> key;  // (begin, end, read-only) per range, in the order they were added
    uint64_t used = 0;           // the memo clock when it last passed
  };
  constexpr size_t kMemoSlots = 4;
  constexpr size_t kMemoMaxRanges = size_t{1} << 16;
  thread_local Memo memos[kMemoSlots];
  thread_local uint64_t clock = 0;
  std::vector<uintptr_t> key;
  bool remember = all_contiguous_ && ranges_.size() <= kMemoMaxRanges;
  if (remember) {
    for (Memo& memo : memos) {
      bool same = memo.op == op_ && memo.key.size() == ranges_.size() * 3;
      for (size_t i = 0; same && i < ranges_.size(); ++i) {
        const Range& r = ranges_[i];
        same = memo.key[3 * i] == r.begin && memo.key[3 * i + 1] == r.end &&
               memo.key[3 * i + 2] == (entries_[r.entry].read_only ? 1u : 0u);
      }
      if (same) {
        memo.used = ++clock;
        ++memo_hit_count;
        return;
      }
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
      remember = false;  // ranges that overlap, and may pass: not kept
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
  if (remember) {
    Memo* oldest = &memos[0];
    for (Memo& memo : memos) {
      oldest = memo.used < oldest->used ? &memo : oldest;
    }
    oldest->op = op_;
    oldest->key = std::move(key);
    oldest->used = ++clock;
  }
}

std::string AliasCheck::name(const Entry& e) {
  return e.index < 0 ? std::string(e.arg) : std::string(e.arg) + "[" + std::to_string(e.index) + "]";
}

}  // namespace ampkit::detail
