// The CPU loops' one parallel region: every tensor of a list cut into (tensor, chunk) work items of kCpuChunk
// elements, all run by a single at::parallel_for, the items split between threads by elements (for_item_ranges,
// also run by the LAMB and grad_stats loops over their own items). Included by the loops' headers inside their
// per-ISA namespace.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_loops.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

// Runs body(b, e) over runs [b, e) of `items` (each with a `begin` and an `end` element) on the intra-op threads,
// the runs cut where the running count of elements crosses equal shares: at::parallel_for cuts by item count, which
// left one thread with most of the elements wherever the large tensors of a list come first (a transformer's
// embedding) or the small chunks last. Items of fewer than `serial_below` elements in all run as one range on the
// calling thread. Which thread runs an item never changes a result (every item writes its own outputs, reduced in
// item order after the region).
template <typename Items, typename Body>
void for_item_ranges(const Items& items, int64_t serial_below, const Body& body) {
  const auto n = static_cast<int64_t>(items.size());
  if (n == 0) {
    return;
  }
  const auto size_of = [&](int64_t k) { return items[k].end - items[k].begin; };
  int64_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    total += size_of(k);
  }
  const int64_t threads =
      total < serial_below || at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    at::parallel_for(0, n, n + 1, body);  // inline, as at::parallel_for runs a range under its grain
    return;
  }
  std::vector<int64_t> cut(static_cast<size_t>(threads) + 1, n);
  cut[0] = 0;
  int64_t running = 0;
  int64_t part = 1;
  for (int64_t k = 0; k < n && part < threads; ++k) {
    running += size_of(k);
    while (part < threads && running * threads >= total * part) {
      cut[part++] = k + 1;
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      if (cut[p] < cut[p + 1]) {
        body(cut[p], cut[p + 1]);
      }
    }
  });
}

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Calls per_item(k, item) for every work item of the `n` tensors whose sizes numel_of(t) gives; returns the number
// of items. Lists under `serial_below` elements run on the calling thread.
template <typename NumelOf, typename PerItem>
size_t for_all_chunks(int64_t n, const NumelOf& numel_of, int64_t serial_below, const PerItem& per_item) {
  std::vector<WorkItem> items;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t numel = numel_of(t);
    for (int64_t b = 0; b < numel; b += kCpuChunk) {
      items.push_back({t, b, std::min(numel, b + kCpuChunk)});
    }
  }
  for_item_ranges(items, serial_below, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      per_item(static_cast<size_t>(k), items[k]);
    }
  });
  return items.size();
}

// Calls pred(item) for every work item, as for_all_chunks does, and returns whether any call returned true. Each
// item writes its own flag, reduced after the parallel region (no shared writes).
template <typename NumelOf, typename Pred>
bool any_chunk(int64_t n, const NumelOf& numel_of, int64_t serial_below, const Pred& pred) {
  size_t total_items = 0;
  for (int64_t t = 0; t < n; ++t) {
    total_items += static_cast<size_t>((numel_of(t) + kCpuChunk - 1) / kCpuChunk);
  }
  std::vector<uint8_t> flags(total_items, 0);
  for_all_chunks(n, numel_of, serial_below, [&](size_t k, const WorkItem& w) { flags[k] = pred(w) ? 1 : 0; });
  return std::any_of(flags.begin(), flags.end(), [](uint8_t f) { return f != 0; });
}

}  // namespace
}  // namespace ampkit::detail::AMPKIT_CPU_NS
