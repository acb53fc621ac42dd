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

}  // namespace detail
}  // namespace ampkit::kernels::emulation
