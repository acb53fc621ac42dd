// The memory-transaction model of the emulated CUDA build (emulation_runtime.h): what the warps of a launch ask
// of the memory system, recorded lane by lane while the block runs and grouped into warp instructions when it ends.
//
// NOTE [Memory transaction model]
// A GPU serves a warp's load or store as one request: global memory moves the 32-byte sectors the 32 lanes'
// addresses fall in, shared memory takes one pass (wavefront) per distinct 4-byte word one of its 32 banks must
// serve, and an atomic on an address that other lanes of the instruction also update is serialised. The emulated
// build runs a block's threads one after another, so the model rebuilds the warp instructions afterwards: while
// set_memory_model(true) holds, every access of tensor data (global_load / global_store, which pass their caller's
// file:line), every atomic (atomicAdd / atomicMax, likewise) and, in code compiled with the model's
// instrumentation, every access that lands in the block's shared memory (its code address is the site) is
// recorded with the running thread. When the block ends, the threads are cut into warps of 32 (linear thread
// index), and the n-th time lane L reached a site is grouped with the n-th time every other lane of its warp
// reached that site: the same dynamic instruction in code whose control flow the warp shares (a loop's k-th
// iteration, a tail lane that stops early simply takes no part in the later instructions). Each group is then
// costed as the hardware would: global sectors = the distinct 32-byte-aligned sectors its lanes' bytes touch,
// global bytes = the distinct bytes they ask for; shared wavefronts = the most distinct 4-byte words one bank
// serves (a word read by several lanes is a broadcast and counts once; a 16-byte access counts its four words);
// atomic conflicts = lanes whose address another lane of the group already updates. No cache is modelled: the
// figures are those of Nsight Compute's sectors per request and bank-conflict counters, which is what a kernel
// controls. Limits: lanes that skip a site in the middle of a loop (a predicated access, the leader of a group
// doing an atomic for the others) shift the pairing of their later occurrences, so such a site's per-instruction
// figures (its sectors, its atomics' conflicts) are approximate, while its counts of accesses and atomics stay
// exact; local memory (a thread's arrays indexed at run time) is not seen; a launch that fails leaves the totals
// as they were before it. Sites are compared by file and line, so two accesses on one line, or a helper function called from
// two places, count as one site: their occurrences pair up in the order each lane made them, which is the same
// pairing for warp-uniform code.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "emulation_scheduler.h"

namespace ampkit::kernels::emulation {
namespace detail {
namespace {

enum class Space : uint8_t { kGlobal, kShared };

struct Site {
  const char* file;  // null for an instrumented (shared-memory) site: then `line` holds the code address
  uintptr_t line;
  bool operator==(const Site& o) const { return file == o.file && line == o.line; }
  bool operator<(const Site& o) const {
    return file != o.file ? std::less<const char*>()(file, o.file) : line < o.line;
  }
};

struct Record {
  Site site;
  uintptr_t addr;
  uint32_t bytes;
  Access kind;
  Space space;
};

struct Grouped {
  Site site;
  Access kind;
  Space space;
  uint32_t occurrence;
  uintptr_t addr;
  uint32_t bytes;
  bool same_instruction(const Grouped& o) const {
    return site == o.site && kind == o.kind && space == o.space && occurrence == o.occurrence;
  }
  bool operator<(const Grouped& o) const {
    if (!(site == o.site)) {
      return site < o.site;
    }
    if (kind != o.kind) {
      return kind < o.kind;
    }
    if (space != o.space) {
      return space < o.space;
    }
    return occurrence < o.occurrence;
  }
};

struct SiteCost {
  Site site;
  uint64_t sectors = 0;
  uint64_t bytes = 0;
};

struct Recorder {
  std::vector<std::vector<Record>> lanes;  // per thread of the running block
  MemoryModel before_launch;               // the totals as the running launch found them
  std::vector<SiteCost> sites_before_launch;
  std::vector<Grouped> warp;  // scratch
  std::vector<uintptr_t> scratch;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  std::vector<SiteCost> sites;
  MemoryModel totals;
};

thread_local Recorder recorder;
thread_local bool in_atomic = false;  // between an atomic's record and model_atomic_done()

bool in_shared(const Scheduler& s, uintptr_t p) {
  const auto base = reinterpret_cast<uintptr_t>(s.arena);
  return p >= base && p < base + kArenaBytes;
}

// The group [b, e) of one warp instruction, costed into the totals.
void cost(Recorder& r, const Grouped* b, const Grouped* e) {
  MemoryModel& t = r.totals;
  if (b->kind == Access::kAtomic) {
    r.scratch.clear();
    for (const Grouped* g = b; g != e; ++g) {
      r.scratch.push_back(g->addr);
    }
    std::sort(r.scratch.begin(), r.scratch.end());
    const auto distinct = static_cast<uint64_t>(std::unique(r.scratch.begin(), r.scratch.end()) - r.scratch.begin());
    const auto lanes = static_cast<uint64_t>(e - b);
    (b->space == Space::kGlobal ? t.global_atomics : t.shared_atomics) += lanes;
    (b->space == Space::kGlobal ? t.global_atomic_conflicts : t.shared_atomic_conflicts) += lanes - distinct;
    return;
  }
  if (b->space == Space::kGlobal) {
    r.scratch.clear();
    r.ranges.clear();
    for (const Grouped* g = b; g != e; ++g) {
      for (uintptr_t s = g->addr >> 5; s <= (g->addr + g->bytes - 1) >> 5; ++s) {
        r.scratch.push_back(s);
      }
      r.ranges.emplace_back(g->addr, g->addr + g->bytes);
    }
    std::sort(r.scratch.begin(), r.scratch.end());
    const auto sectors = static_cast<uint64_t>(std::unique(r.scratch.begin(), r.scratch.end()) - r.scratch.begin());
    std::sort(r.ranges.begin(), r.ranges.end());
    uint64_t bytes = 0;
    uintptr_t covered = 0;  // end of the union so far
    for (const auto& [lo, hi] : r.ranges) {
      const uintptr_t from = std::max(lo, covered);
      if (hi > from) {
        bytes += hi - from;
        covered = hi;
      }
    }
    t.global_requests += 1;
    t.global_sectors += sectors;
    t.global_bytes += bytes;
    // By file name and line: every translation unit has its own copy of a header's file name.
    auto it = std::find_if(r.sites.begin(), r.sites.end(), [&](const SiteCost& c) {
      return c.site.line == b->site.line && std::strcmp(c.site.file, b->site.file) == 0;
    });
    if (it == r.sites.end()) {
      r.sites.push_back(SiteCost{b->site});
      it = r.sites.end() - 1;
    }
    it->sectors += sectors;
    it->bytes += bytes;
    return;
  }
  // Shared memory: the distinct 4-byte words, then the most that fall in one bank.
  r.scratch.clear();
  for (const Grouped* g = b; g != e; ++g) {
    for (uintptr_t w = g->addr >> 2; w <= (g->addr + g->bytes - 1) >> 2; ++w) {
      r.scratch.push_back(w);
    }
  }
  std::sort(r.scratch.begin(), r.scratch.end());
  r.scratch.erase(std::unique(r.scratch.begin(), r.scratch.end()), r.scratch.end());
  uint32_t per_bank[32] = {};
  uint32_t most = 0;
  for (const uintptr_t w : r.scratch) {
    most = std::max(most, ++per_bank[w % 32]);
  }
  t.shared_requests += 1;
  t.shared_wavefronts += most;
}

}  // namespace

void model_record(const void* p, uint32_t bytes, Access kind, const char* file, int line) {
  Scheduler& s = active("a recorded memory access");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  Recorder& r = recorder;
  if (r.lanes.size() < static_cast<size_t>(s.n_threads)) {
    r.lanes.resize(static_cast<size_t>(s.n_threads));
  }
  r.lanes[static_cast<size_t>(s.current)].push_back(Record{Site{file, static_cast<uintptr_t>(line)}, addr, bytes, kind,
                                                           in_shared(s, addr) ? Space::kShared : Space::kGlobal});
  in_atomic = kind == Access::kAtomic;
}

void model_atomic_done() { in_atomic = false; }

void model_record_instrumented(uintptr_t pc, uintptr_t p, uint32_t bytes, bool store) {
  Scheduler& s = scheduler();
  if (!s.in_launch || in_atomic || !in_shared(s, p)) {
    return;  // outside a launch, an atomic's own access, or not shared memory (global accesses are recorded by
             // global_load / global_store, the stack and the host's data are not the model's)
  }
  Recorder& r = recorder;
  if (r.lanes.size() < static_cast<size_t>(s.n_threads)) {
    r.lanes.resize(static_cast<size_t>(s.n_threads));
  }
  r.lanes[static_cast<size_t>(s.current)].push_back(
      Record{Site{nullptr, pc}, p, bytes, store ? Access::kStore : Access::kLoad, Space::kShared});
}

// Called by run_blocks when a block has run to its end: its accesses grouped into warp instructions and costed.
void model_end_block(int n_threads) {
  Recorder& r = recorder;
  const auto n = std::min(static_cast<size_t>(n_threads), r.lanes.size());
  std::vector<std::pair<Site, uint32_t>> seen;  // occurrences per site of the lane being read
  for (size_t w = 0; w < n; w += 32) {
    r.warp.clear();
    for (size_t lane = w; lane < std::min(n, w + 32); ++lane) {
      seen.clear();
      for (const Record& a : r.lanes[lane]) {
        auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& x) { return x.first == a.site; });
        if (it == seen.end()) {
          seen.emplace_back(a.site, 0u);
          it = seen.end() - 1;
        }
        r.warp.push_back(Grouped{a.site, a.kind, a.space, it->second++, a.addr, a.bytes});
      }
      r.lanes[lane].clear();
    }
    std::stable_sort(r.warp.begin(), r.warp.end());
    for (size_t i = 0; i < r.warp.size();) {
      size_t j = i + 1;
      while (j < r.warp.size() && r.warp[j].same_instruction(r.warp[i])) {
        ++j;
      }
      cost(r, r.warp.data() + i, r.warp.data() + j);
      i = j;
    }
  }
}

void model_abandon_block() {
  for (auto& l : recorder.lanes) {
    l.clear();
  }
}

void model_begin_launch() {
  recorder.before_launch = recorder.totals;
  recorder.sites_before_launch = recorder.sites;
}

// A launch that failed part-way: its blocks' figures are dropped, as if it had not run.
void model_abandon_launch() {
  model_abandon_block();
  recorder.totals = recorder.before_launch;
  recorder.sites = recorder.sites_before_launch;
}

}  // namespace detail

void set_memory_model(bool on) {
  detail::model_recording = on;
  detail::model_abandon_block();
  detail::recorder.totals = MemoryModel{};
  detail::recorder.sites.clear();
}

MemoryModel take_memory_model() {
  detail::Recorder& r = detail::recorder;
  MemoryModel m = r.totals;
  const detail::SiteCost* worst = nullptr;
  for (const auto& c : r.sites) {
    if (worst == nullptr || c.sectors * 32 - c.bytes > worst->sectors * 32 - worst->bytes) {
      worst = &c;
    }
  }
  if (worst != nullptr && worst->sectors * 32 > worst->bytes) {
    std::string file = worst->site.file;
    const auto slash = file.find_last_of('/');
    m.worst_site =
        (slash == std::string::npos ? file : file.substr(slash + 1)) + ":" + std::to_string(worst->site.line);
    m.worst_site_sectors = worst->sectors;
    m.worst_site_bytes = worst->bytes;
  }
  r.totals = MemoryModel{};
  r.sites.clear();
  return m;
}

}  // namespace ampkit::kernels::emulation
