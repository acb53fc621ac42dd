// The scheduler of the emulated CUDA build (NOTE [Emulated execution] in emulation.h): the entry points the
// kernel-facing header calls (a grid's blocks, shared memory, barriers, warp primitives) and what a test can ask
// of it (the last error, the block order, the fiber pool). Implemented in emulation_runtime.cpp and
// emulation_sync.cpp; host only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ampkit::kernels::emulation {

// The message of the last launch on this host thread that failed inside a block (a stuck barrier or warp
// primitive, shared memory beyond the limit, a bad block order), naming block, threads and file:line; empty
// after a launch that succeeded.
const std::string& last_error();

// The order in which a launch runs its blocks. kShuffled: a random permutation drawn from `seed` and the number of
// launches since the order was set, so a run is reproducible.
struct BlockOrder {
  enum Kind { kInOrder, kShuffled } kind = kInOrder;
  uint64_t seed = 1;
};

// Parses AMPKIT_EMULATION_BLOCK_ORDER's syntax: "" or "in_order", "shuffled" (seed 1) or "shuffled:<seed>".
// Returns false (and leaves `out` alone) for anything else.
bool parse_block_order(const char* text, BlockOrder* out);

// Overrides AMPKIT_EMULATION_BLOCK_ORDER on this host thread (nullptr: back to the environment, read at every
// launch), and restarts the launch count the shuffled order draws from.
void set_block_order(const BlockOrder* order);

// The blocks (linear indices, x fastest) of the last launch on this host thread, in the order they ran.
const uint64_t* last_block_order(size_t* count);

// The fiber pool of this host thread: fibers (each with its own stack) made so far, and their stack bytes.
struct FiberStats {
  size_t fibers = 0;
  size_t stack_bytes = 0;
};
FiberStats fiber_stats();

// Static shared memory per block, as on every GPU without an opt-in; dynamic shared memory has the same limit.
constexpr size_t kMaxSharedBytes = 48 * 1024;

// ---- the memory-transaction model (NOTE [Memory transaction model] in emulation_model.cpp) -------------------
// What the warps of the launches run on this host thread while the model records asked of the memory system:
// warp-level requests and the 32-byte sectors they touch in global memory, shared-memory requests and the
// wavefronts their bank conflicts cost, atomics and how many of them land on an address another lane of the same
// instruction also updates.
struct MemoryModel {
  uint64_t global_requests = 0;    // warp-level load or store instructions on tensor data (global_load/global_store)
  uint64_t global_sectors = 0;     // 32-byte sectors they touch, counted per instruction (no cache)
  uint64_t global_bytes = 0;       // distinct bytes they ask for, counted per instruction
  uint64_t shared_requests = 0;    // warp-level shared-memory loads and stores
  uint64_t shared_wavefronts = 0;  // passes they take: the most distinct 4-byte words one of the 32 banks serves
  uint64_t global_atomics = 0;     // lane operations
  uint64_t global_atomic_conflicts = 0;  // of those, ones on an address another lane of the same instruction hits
  uint64_t shared_atomics = 0;
  uint64_t shared_atomic_conflicts = 0;
  // The global site with the most sectors beyond its bytes ("file:line", empty if none), and its figures.
  std::string worst_site;
  uint64_t worst_site_sectors = 0;
  uint64_t worst_site_bytes = 0;

  double sector_efficiency() const {
    return global_sectors == 0 ? 1.0 : static_cast<double>(global_bytes) / (32.0 * static_cast<double>(global_sectors));
  }
  double wavefronts_per_request() const {
    return shared_requests == 0 ? 0.0 : static_cast<double>(shared_wavefronts) / static_cast<double>(shared_requests);
  }
};

// Starts (true) or stops recording on this host thread; starting clears what was recorded. Shared-memory
// requests are seen only in code built with the model's instrumentation (emulation_model_hooks.cpp).
void set_memory_model(bool on);
// What was recorded since the model started or was last read, then clears it (recording goes on).
MemoryModel take_memory_model();

namespace detail {

// Runs `body(ctx)` as every thread of every block of the grid (the caller checked the configuration).
cudaError_t run_blocks(dim3 grid, dim3 block, size_t dynamic_shared_bytes, void (*body)(const void*), const void* ctx);

// The block's array for the AMPKIT_SHARED declaration `site` (the address of a static that names it), handed out
// on the first call of the block (0xFF bytes) and the same array for every thread after.
void* block_shared(const void* site, size_t bytes, size_t align);
void* dynamic_shared();

enum class BarrierKind : int { kSync, kCount, kAnd, kOr };
int block_barrier(BarrierKind kind, int pred, const char* file, int line);

enum class WarpKind : int { kSync, kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kMatchAny };
struct WarpOp {
  WarpKind kind;
  unsigned mask;
  uint64_t value;  // the lane's operand: bits of the shuffled value, the predicate, the value to match
  int lane_arg;    // srcLane, delta or laneMask
  int width;
  int bytes;  // size of the shuffled or matched type
  const char* file;
  int line;
};
uint64_t warp_op(const WarpOp& op);
unsigned active_mask();

// The memory-transaction model's recorder: on while set_memory_model(true) holds on this host thread.
inline thread_local bool model_recording = false;
enum class Access : uint8_t { kLoad, kStore, kAtomic };
// One lane's access to `bytes` bytes at `p` from the source position file:line (global memory, or shared
// memory when `p` lies in the block's shared memory). An atomic's record holds back the instrumentation's reports
// of its own read and write until model_atomic_done().
void model_record(const void* p, uint32_t bytes, Access kind, const char* file, int line);
void model_atomic_done();
// The same for an access seen by the instrumentation (the site is a code address): shared memory only.
void model_record_instrumented(uintptr_t pc, uintptr_t p, uint32_t bytes, bool store);

}  // namespace detail
}  // namespace ampkit::kernels::emulation
