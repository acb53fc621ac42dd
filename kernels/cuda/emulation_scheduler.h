// The scheduler state of the emulated CUDA build (NOTE [Emulated execution] in emulation.h) that its two sources
// share: emulation_runtime.cpp runs a grid's blocks on fibers (contexts, stacks, the block order, shared memory),
// emulation_sync.cpp has the barriers and warp primitives that suspend and resume them and the report of a block
// that cannot go on. Host only; included by those two files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "emulation.h"

#if defined(__x86_64__) && defined(__linux__) && !defined(AMPKIT_EMULATION_UCONTEXT)
#define AMPKIT_EMULATION_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace ampkit::kernels::emulation::detail {

// A fiber's saved context: its stack pointer (the assembly switch), or a ucontext.
#if defined(AMPKIT_EMULATION_ASM_SWITCH)
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

// A stack that runs the block's threads (emulation_runtime.cpp).
struct Fiber;

enum class State : uint8_t { kRunnable, kBarrier, kWarp, kExited };

struct ThreadState {
  uint3 idx{};
  State state = State::kRunnable;
  BarrierKind barrier = BarrierKind::kSync;
  int pred = 0;
  const char* file = nullptr;
  int line = 0;
  WarpOp warp{};
  uint64_t result = 0;
  int fiber = -1;  // -1 until the thread starts
};

constexpr size_t kRedzone = 64;
constexpr size_t kArenaBytes = 2 * kMaxSharedBytes + 64 * kRedzone;

struct SharedSite {
  const void* site;
  unsigned char* ptr;
};

struct Scheduler {
  std::vector<std::unique_ptr<Fiber>> fibers;
  std::vector<ThreadState> threads;
  Context host;
  void* host_fake_stack = nullptr;
  const void* host_stack_bottom = nullptr;
  size_t host_stack_size = 0;
  void (*body)(const void*) = nullptr;
  const void* ctx = nullptr;
  bool in_launch = false;
  // The block being run: the running thread and fiber, the next thread to start, the parked fibers.
  int current = 0;
  int current_fiber = 0;
  int next_unstarted = 0;
  std::vector<int> free_fibers;
  int n_threads = 0;
  int live = 0;
  int arrived = 0;
  bool failed = false;
  cudaError_t failure = cudaSuccess;
  std::string error;
  // Shared memory: [dynamic | redzone | static array | redzone | ...].
  std::vector<unsigned char> arena_storage;
  unsigned char* arena = nullptr;
  size_t dynamic_bytes = 0;
  size_t static_begin = 0;
  size_t arena_used = 0;
  std::vector<SharedSite> sites;
  // Block order.
  bool order_set = false;
  BlockOrder order;
  uint64_t launches_since_order = 0;
  std::vector<uint64_t> last_order;

  // Out of line, where Fiber is complete.
  Scheduler();
};

// This host thread's scheduler.
Scheduler& scheduler();
// The scheduler of the launch running on this host thread; aborts, naming `what`, when called outside a launch.
Scheduler& active(const char* what);
// Back to the host stack; returns when the scheduler resumes this fiber.
void yield_to_host(Scheduler& s);
// Reports an error of the running thread's block and never returns: the host abandons the block's fibers.
[[noreturn]] void fail(Scheduler& s, cudaError_t code, const std::string& message);

// Names of a thread and of the running block, for reports.
std::string thread_name(const uint3& t);
std::string block_name();
// The memory-transaction model (emulation_model.cpp): a launch begins, a block ran to its end, a launch failed.
void model_begin_launch();
void model_end_block(int n_threads);
void model_abandon_block();
void model_abandon_launch();

// The message for a block in which no fiber can run: the first waiting thread and a thread it waits for.
std::string stuck_message(const Scheduler& s);

}  // namespace ampkit::kernels::emulation::detail
