// The scheduler of the emulated CUDA build (NOTE [Emulated execution] in emulation.h): per host thread, a pool
// of fibers that run a block's threads, the block's shared-memory arena, the barriers and warp primitives that
// suspend and resume fibers, the report of a block that cannot go on, and the order of a grid's blocks. The
// fiber switch is a dozen instructions of assembly on x86-64 (swapcontext elsewhere, which costs a sigprocmask
// system call per switch), annotated for AddressSanitizer.
#include "emulation_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "emulation.h"

#if defined(__SANITIZE_ADDRESS__)
#define AMPKIT_EMULATION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMPKIT_EMULATION_ASAN 1
#endif
#endif
#if defined(AMPKIT_EMULATION_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && defined(__linux__) && !defined(AMPKIT_EMULATION_UCONTEXT)
#define AMPKIT_EMULATION_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace ampkit::kernels::emulation {
namespace {

// ---- contexts ----------------------------------------------------------------------------------------------------
[[noreturn]] void fiber_entry();

#if defined(AMPKIT_EMULATION_ASM_SWITCH)
}  // namespace
}  // namespace ampkit::kernels::emulation

// Saves the callee-saved registers of the System V ABI on the current stack, stores the stack pointer in
// *save_sp, and continues on load_sp's stack, whose registers it pops. The floating-point control words are one
// per host thread, shared by its fibers, as they were when threads ran on the host stack.
extern "C" void ampkit_emulation_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl ampkit_emulation_switch
  .hidden ampkit_emulation_switch
  .type ampkit_emulation_switch,@function
  .p2align 4
ampkit_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ampkit_emulation_switch, .-ampkit_emulation_switch
)");

namespace ampkit::kernels::emulation {
namespace {

struct Context {
  void* sp = nullptr;
};
void context_switch(Context* from, Context* to) { ampkit_emulation_switch(&from->sp, to->sp); }
// A stack whose first switch pops six zero registers and returns into fiber_entry, with the stack pointer as
// after a call (8 mod 16) and a zero return address above it, where unwinders stop.
void context_init(Context* c, char* lo, size_t size) {
  auto top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<uintptr_t*>(top);
  slots[-1] = 0;
  slots[-2] = reinterpret_cast<uintptr_t>(&fiber_entry);
  for (int i = 3; i <= 8; ++i) {
    slots[-i] = 0;
  }
  c->sp = slots - 8;
}
#else
struct Context {
  ucontext_t uc;
};
void context_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
void context_init(Context* c, char* lo, size_t size) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = lo;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, &fiber_entry, 0);
}
#endif

// Under ASan the runtime keeps one stack per thread; each switch tells it which stack comes next.
void asan_start_switch(void** fake_stack_save, const void* bottom, size_t size) {
#if defined(AMPKIT_EMULATION_ASAN)
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, size);
#else
  (void)fake_stack_save, (void)bottom, (void)size;
#endif
}
void asan_finish_switch(void* fake_stack_save, const void** old_bottom, size_t* old_size) {
#if defined(AMPKIT_EMULATION_ASAN)
  __sanitizer_finish_switch_fiber(fake_stack_save, old_bottom, old_size);
#else
  (void)fake_stack_save, (void)old_bottom, (void)old_size;
#endif
}
void asan_poison(const void* p, size_t n) {
#if defined(AMPKIT_EMULATION_ASAN)
  ASAN_POISON_MEMORY_REGION(p, n);
#else
  (void)p, (void)n;
#endif
}
void asan_unpoison(const void* p, size_t n) {
#if defined(AMPKIT_EMULATION_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
  (void)p, (void)n;
#endif
}

// ---- fibers and the block's threads ----------------------------------------------------------------------------
#if defined(AMPKIT_EMULATION_ASAN)
constexpr size_t kStackBytes = 512 * 1024;  // ASan's redzones make frames several times larger
#else
constexpr size_t kStackBytes = 256 * 1024;
#endif

struct Fiber {
  Context ctx;
  char* map = nullptr;  // guard page, then the stack
  char* stack = nullptr;
  void* fake_stack = nullptr;
  bool fresh = true;  // the next resume starts fiber_entry from the top of the stack
  size_t top_bytes = kStackBytes;  // where the stack starts, below its end by the fiber's colour
  int thread = -1;                  // the block's thread it runs, -1 while parked

  explicit Fiber(size_t index) {
    // Stacks of one size, mapped side by side, would put every fiber's hot frames at the same cache sets: offset
    // each top by a different multiple of a line, spread over 64 KB.
    top_bytes = kStackBytes - (index % 64) * 64 - (index / 64 % 16) * 4096;
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "ampkit emulation: cannot map a %zu-byte fiber stack\n", kStackBytes);
      std::abort();
    }
    map = static_cast<char*>(m);
    mprotect(map, page, PROT_NONE);  // a stack overflow faults instead of writing into the next mapping
    stack = map + page;
  }
  ~Fiber() {
    asan_unpoison(stack, kStackBytes);  // the shadow of frames left on the stack would outlive the mapping
    munmap(map, kStackBytes + static_cast<size_t>(sysconf(_SC_PAGESIZE)));
  }
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
};

enum class State : uint8_t { kRunnable, kBarrier, kWarp, kExited };

struct ThreadState {
  uint3 idx{};
  State state = State::kRunnable;
  detail::BarrierKind barrier = detail::BarrierKind::kSync;
  int pred = 0;
  const char* file = nullptr;
  int line = 0;
  detail::WarpOp warp{};
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

  Scheduler() : arena_storage(kArenaBytes + 64) {
    arena = arena_storage.data() + (64 - reinterpret_cast<uintptr_t>(arena_storage.data()) % 64) % 64;
  }
};

Scheduler& scheduler() {
  thread_local Scheduler s;
  return s;
}
// The scheduler of the launch running on this host thread (set for its duration; primitives called outside a
// launch find none).
thread_local Scheduler* tls_active = nullptr;

std::string thread_name(const uint3& t) {
  return "thread (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) + ")";
}
std::string block_name() {
  return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
         std::to_string(blockIdx.z) + ")";
}
std::string site_name(const char* file, int line) { return std::string(file) + ":" + std::to_string(line); }

const char* barrier_name(detail::BarrierKind k) {
  switch (k) {
    case detail::BarrierKind::kSync:
      return "__syncthreads()";
    case detail::BarrierKind::kCount:
      return "__syncthreads_count()";
    case detail::BarrierKind::kAnd:
      return "__syncthreads_and()";
    case detail::BarrierKind::kOr:
      return "__syncthreads_or()";
  }
  return "?";
}
const char* warp_name(detail::WarpKind k) {
  switch (k) {
    case detail::WarpKind::kSync:
      return "__syncwarp";
    case detail::WarpKind::kShfl:
      return "__shfl_sync";
    case detail::WarpKind::kShflUp:
      return "__shfl_up_sync";
    case detail::WarpKind::kShflDown:
      return "__shfl_down_sync";
    case detail::WarpKind::kShflXor:
      return "__shfl_xor_sync";
    case detail::WarpKind::kBallot:
      return "__ballot_sync";
    case detail::WarpKind::kAny:
      return "__any_sync";
    case detail::WarpKind::kAll:
      return "__all_sync";
    case detail::WarpKind::kMatchAny:
      return "__match_any_sync";
  }
  return "?";
}
std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}
// Where a waiting or exited thread is, for a report.
std::string where(const ThreadState& t) {
  switch (t.state) {
    case State::kExited:
      return "exited";
    case State::kBarrier:
      return std::string("waits at ") + barrier_name(t.barrier) + " at " + site_name(t.file, t.line);
    case State::kWarp:
      return std::string("waits at ") + warp_name(t.warp.kind) + "(mask " + hex(t.warp.mask) + ") at " +
             site_name(t.warp.file, t.warp.line);
    case State::kRunnable:
      break;
  }
  return "runs";
}

// Back to the host stack; returns when the scheduler resumes this fiber.
void yield_to_host(Scheduler& s) {
  Fiber& f = *s.fibers[static_cast<size_t>(s.current_fiber)];
  asan_start_switch(&f.fake_stack, s.host_stack_bottom, s.host_stack_size);
  context_switch(&f.ctx, &s.host);
  asan_finish_switch(f.fake_stack, &s.host_stack_bottom, &s.host_stack_size);
}

// Reports an error of the running thread's block and never returns: the host abandons the block's fibers.
[[noreturn]] void fail(Scheduler& s, cudaError_t code, const std::string& message) {
  s.failed = true;
  s.failure = code;
  s.error = "ampkit emulation: " + message;
  yield_to_host(s);
  std::fprintf(stderr, "ampkit emulation: an abandoned fiber was resumed\n");
  std::abort();
}

Scheduler& active(const char* what) {
  if (tls_active == nullptr) {
    std::fprintf(stderr, "ampkit emulation: %s called outside a kernel launch\n", what);
    std::abort();
  }
  return *tls_active;
}

// A fiber runs its thread and, when that exits, the next thread not started yet, on the same stack without a
// switch: a block that never waits runs on one fiber. A fiber with no thread left to start parks on the host.
void fiber_entry() {
  Scheduler* s = tls_active;
  asan_finish_switch(nullptr, &s->host_stack_bottom, &s->host_stack_size);
  const int me = s->current_fiber;
  for (;;) {
    int t = s->fibers[static_cast<size_t>(me)]->thread;
    for (;;) {
      s->current = t;
      threadIdx = s->threads[static_cast<size_t>(t)].idx;
      s->body(s->ctx);
      s->threads[static_cast<size_t>(t)].state = State::kExited;
      s->live -= 1;
      if (s->next_unstarted >= s->n_threads) {
        break;
      }
      t = s->next_unstarted++;
      s->threads[static_cast<size_t>(t)].fiber = me;
      s->fibers[static_cast<size_t>(me)]->thread = t;
    }
    s->fibers[static_cast<size_t>(me)]->thread = -1;
    s->free_fibers.push_back(me);
    yield_to_host(*s);
    s = tls_active;
  }
}

void resume_fiber(Scheduler& s, int fiber) {
  Fiber& f = *s.fibers[static_cast<size_t>(fiber)];
  if (f.fresh) {
    context_init(&f.ctx, f.stack, f.top_bytes);
    f.fresh = false;
  }
  s.current_fiber = fiber;
  s.current = f.thread;
  threadIdx = s.threads[static_cast<size_t>(f.thread)].idx;
  asan_start_switch(&s.host_fake_stack, f.stack, kStackBytes);
  context_switch(&s.host, &f.ctx);
  asan_finish_switch(s.host_fake_stack, nullptr, nullptr);
}

// Starts the next thread on a parked fiber (or a new one, the first time a block needs that many).
void start_next(Scheduler& s) {
  if (s.free_fibers.empty()) {
    s.free_fibers.push_back(static_cast<int>(s.fibers.size()));
    s.fibers.push_back(std::make_unique<Fiber>(s.fibers.size()));
  }
  const int f = s.free_fibers.back();
  s.free_fibers.pop_back();
  const int t = s.next_unstarted++;
  s.threads[static_cast<size_t>(t)].fiber = f;
  s.fibers[static_cast<size_t>(f)]->thread = t;
  resume_fiber(s, f);
}

// The fibers of a block that stopped part-way keep their frames: start them afresh next time, with a clean stack.
void abandon_block(Scheduler& s) {
  for (auto& f : s.fibers) {
    if (f->thread >= 0) {
      f->thread = -1;
      f->fresh = true;
      f->fake_stack = nullptr;
      asan_unpoison(f->stack, kStackBytes);
    }
  }
}

// The message for a block in which no fiber can run: the first waiting thread and a thread it waits for.
std::string stuck_message(const Scheduler& s) {
  const auto& th = s.threads;
  for (int t = 0; t < s.n_threads; ++t) {
    const ThreadState& me = th[static_cast<size_t>(t)];
    if (me.state == State::kBarrier) {
      for (int o = 0; o < s.n_threads; ++o) {
        const ThreadState& other = th[static_cast<size_t>(o)];
        if (other.state != State::kBarrier) {
          return block_name() + " " + thread_name(me.idx) + " waits at " + barrier_name(me.barrier) + " at " +
                 site_name(me.file, me.line) + ", which " + thread_name(other.idx) + " never reaches: it " +
                 where(other) + " (divergent barrier)";
        }
      }
    }
    if (me.state == State::kWarp) {
      const int warp_base = t / 32 * 32;
      for (int l = 0; l < 32 && warp_base + l < s.n_threads; ++l) {
        const ThreadState& other = th[static_cast<size_t>(warp_base + l)];
        if (((me.warp.mask >> l) & 1u) == 0 || &other == &me) {
          continue;
        }
        if (other.state != State::kWarp || other.warp.kind != me.warp.kind || other.warp.mask != me.warp.mask ||
            other.warp.width != me.warp.width || other.warp.bytes != me.warp.bytes) {
          return block_name() + " " + thread_name(me.idx) + " (lane " + std::to_string(t % 32) + ") waits at " +
                 warp_name(me.warp.kind) + "(mask " + hex(me.warp.mask) + ") at " +
                 site_name(me.warp.file, me.warp.line) + ", but lane " + std::to_string(l) + " named in the mask, " +
                 thread_name(other.idx) + ", " + where(other) +
                 (other.state == State::kExited ? " (it cannot arrive)" : " (mask mismatch)");
        }
      }
    }
  }
  return block_name() + " cannot go on";
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

const std::string& last_error() { return scheduler().error; }

bool parse_block_order(const char* text, BlockOrder* out) {
  if (text == nullptr || *text == '\0' || std::strcmp(text, "in_order") == 0) {
    *out = BlockOrder{};
    return true;
  }
  constexpr const char* kShuffled = "shuffled";
  const size_t n = std::strlen(kShuffled);
  if (std::strncmp(text, kShuffled, n) != 0) {
    return false;
  }
  BlockOrder order{BlockOrder::kShuffled, 1};
  if (text[n] == ':') {
    const char* digits = text + n + 1;
    if (*digits < '0' || *digits > '9') {
      return false;
    }
    char* end = nullptr;
    order.seed = std::strtoull(digits, &end, 10);
    if (*end != '\0') {
      return false;
    }
  } else if (text[n] != '\0') {
    return false;
  }
  *out = order;
  return true;
}

void set_block_order(const BlockOrder* order) {
  Scheduler& s = scheduler();
  s.order_set = order != nullptr;
  if (order != nullptr) {
    s.order = *order;
  }
  s.launches_since_order = 0;
}

const uint64_t* last_block_order(size_t* count) {
  Scheduler& s = scheduler();
  *count = s.last_order.size();
  return s.last_order.data();
}

FiberStats fiber_stats() {
  const Scheduler& s = scheduler();
  return FiberStats{s.fibers.size(), s.fibers.size() * kStackBytes};
}

namespace detail {

cudaError_t run_blocks(dim3 grid, dim3 block, size_t dynamic_shared_bytes, void (*body)(const void*),
                       const void* ctx) {
  Scheduler& s = scheduler();
  if (s.in_launch) {
    s.error = "ampkit emulation: a kernel launched a kernel (the emulated build has no dynamic parallelism)";
    return cudaErrorNotSupported;
  }
  s.error.clear();
  if (dynamic_shared_bytes > kMaxSharedBytes) {
    s.error = "ampkit emulation: a launch asked for " + std::to_string(dynamic_shared_bytes) +
              " bytes of dynamic shared memory, but at most " + std::to_string(kMaxSharedBytes) + " are available";
    return cudaErrorInvalidValue;
  }
  BlockOrder order = s.order;
  if (!s.order_set) {
    const char* env = std::getenv("AMPKIT_EMULATION_BLOCK_ORDER");
    if (!parse_block_order(env, &order)) {
      s.error = std::string("ampkit emulation: AMPKIT_EMULATION_BLOCK_ORDER must be 'in_order', 'shuffled' or "
                            "'shuffled:<seed>', but got '") +
                env + "'";
      return cudaErrorInvalidValue;
    }
  }
  const uint64_t n_blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  s.last_order.resize(n_blocks);
  for (uint64_t b = 0; b < n_blocks; ++b) {
    s.last_order[b] = b;
  }
  if (order.kind == BlockOrder::kShuffled) {
    uint64_t state = order.seed;
    uint64_t launch = s.launches_since_order;
    state ^= splitmix64(launch);
    for (uint64_t i = n_blocks; i > 1; --i) {
      const uint64_t j = splitmix64(state) % i;
      std::swap(s.last_order[i - 1], s.last_order[j]);
    }
  }
  s.launches_since_order += 1;

  const int n = static_cast<int>(block.x * block.y * block.z);
  s.threads.resize(static_cast<size_t>(n));
  int t = 0;
  for (unsigned tz = 0; tz < block.z; ++tz) {
    for (unsigned ty = 0; ty < block.y; ++ty) {
      for (unsigned tx = 0; tx < block.x; ++tx) {
        s.threads[static_cast<size_t>(t++)].idx = uint3{tx, ty, tz};
      }
    }
  }
  s.n_threads = n;
  s.body = body;
  s.ctx = ctx;
  s.dynamic_bytes = dynamic_shared_bytes;
  s.static_begin = (dynamic_shared_bytes + 15) / 16 * 16 + kRedzone;
  s.failed = false;
  s.in_launch = true;
  tls_active = &s;
  gridDim = grid;
  blockDim = block;

  cudaError_t result = cudaSuccess;
  for (uint64_t i = 0; i < n_blocks && result == cudaSuccess; ++i) {
    const uint64_t b = s.last_order[i];
    blockIdx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / (static_cast<uint64_t>(grid.x) * grid.y))};
    for (auto& th : s.threads) {
      th.state = State::kRunnable;
      th.fiber = -1;
    }
    s.free_fibers.clear();
    for (size_t f = s.fibers.size(); f > 0; --f) {
      s.free_fibers.push_back(static_cast<int>(f - 1));  // fiber 0 first: the stack used last is warm
    }
    s.next_unstarted = 0;
    s.live = n;
    s.arrived = 0;
    s.sites.clear();
    s.arena_used = s.static_begin;
    asan_poison(s.arena, kArenaBytes);
    asan_unpoison(s.arena, s.dynamic_bytes);
    std::memset(s.arena, 0xFF, s.dynamic_bytes);
    while (s.live > 0) {
      bool ran = false;
      for (int k = 0; k < s.next_unstarted && !s.failed; ++k) {
        const ThreadState& th = s.threads[static_cast<size_t>(k)];
        if (th.state == State::kRunnable && th.fiber >= 0) {
          ran = true;
          resume_fiber(s, th.fiber);
        }
      }
      while (s.next_unstarted < n && !s.failed) {
        ran = true;
        start_next(s);
      }
      if (!s.failed && !ran) {
        s.failed = true;
        s.failure = cudaErrorIllegalInstruction;
        s.error = "ampkit emulation: " + stuck_message(s);
      }
      if (s.failed) {
        abandon_block(s);
        result = s.failure;
        break;
      }
    }
  }
  asan_unpoison(s.arena, kArenaBytes);
  tls_active = nullptr;
  s.in_launch = false;
  return result;
}

void* block_shared(const void* site, size_t bytes, size_t align) {
  Scheduler& s = active("AMPKIT_SHARED");
  for (const SharedSite& known : s.sites) {
    if (known.site == site) {
      return known.ptr;
    }
  }
  const size_t a = align < 16 ? 16 : align;
  const size_t offset = (s.arena_used + a - 1) / a * a;
  if (offset + bytes - s.static_begin > kMaxSharedBytes) {
    fail(s, cudaErrorInvalidValue,
         block_name() + " " + thread_name(threadIdx) + ": the block's static shared memory exceeds " +
             std::to_string(kMaxSharedBytes) + " bytes");
  }
  unsigned char* p = s.arena + offset;
  asan_unpoison(p, bytes);
  std::memset(p, 0xFF, bytes);
  s.arena_used = offset + bytes + kRedzone;
  s.sites.push_back(SharedSite{site, p});
  return p;
}

void* dynamic_shared() { return active("AMPKIT_DYNAMIC_SHARED").arena; }

int block_barrier(BarrierKind kind, int pred, const char* file, int line) {
  Scheduler& s = active(barrier_name(kind));
  ThreadState& me = s.threads[static_cast<size_t>(s.current)];
  me.state = State::kBarrier;
  me.barrier = kind;
  me.pred = pred != 0 ? 1 : 0;
  me.file = file;
  me.line = line;
  s.arrived += 1;
  if (s.arrived < s.n_threads) {
    yield_to_host(s);
    return static_cast<int>(me.result);
  }
  // Every thread waits here: the same barrier (line and kind) for all, or the block is divergent.
  int count = 0;
  const ThreadState& first = s.threads[0];
  for (const ThreadState& t : s.threads) {
    if (t.barrier != first.barrier || t.line != first.line || std::strcmp(t.file, first.file) != 0) {
      fail(s, cudaErrorIllegalInstruction,
           block_name() + " " + thread_name(first.idx) + " waits at " + barrier_name(first.barrier) + " at " +
               site_name(first.file, first.line) + ", but " + thread_name(t.idx) +
               " waits at " + barrier_name(t.barrier) + " at " + site_name(t.file, t.line) + " (divergent barrier)");
    }
    count += t.pred;
  }
  const int r = kind == BarrierKind::kCount ? count
                : kind == BarrierKind::kAnd ? (count == s.n_threads ? 1 : 0)
                : kind == BarrierKind::kOr  ? (count > 0 ? 1 : 0)
                                            : 0;
  for (ThreadState& t : s.threads) {
    t.state = State::kRunnable;
    t.result = static_cast<uint64_t>(r);
  }
  s.arrived = 0;
  return r;
}

uint64_t warp_op(const WarpOp& op) {
  Scheduler& s = active(warp_name(op.kind));
  const int me_index = s.current;
  ThreadState& me = s.threads[static_cast<size_t>(me_index)];
  const int lane = me_index % 32;
  const int base = me_index - lane;
  const int lanes = s.n_threads - base < 32 ? s.n_threads - base : 32;
  const unsigned existing = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  const std::string here = block_name() + " " + thread_name(me.idx) + " (lane " + std::to_string(lane) + "): " +
                           warp_name(op.kind) + "(mask " + hex(op.mask) + ") at " + site_name(op.file, op.line);
  if (((op.mask >> lane) & 1u) == 0) {
    fail(s, cudaErrorIllegalInstruction, here + " is called by a lane outside its mask");
  }
  if (op.width < 1 || op.width > 32 || (op.width & (op.width - 1)) != 0) {
    fail(s, cudaErrorIllegalInstruction, here + ": width " + std::to_string(op.width) +
                                             " is not a power of two from 1 to 32");
  }
  me.state = State::kWarp;
  me.warp = op;
  const unsigned lanes_in = op.mask & existing;
  for (int l = 0; l < lanes; ++l) {
    if (((lanes_in >> l) & 1u) == 0) {
      continue;
    }
    const ThreadState& t = s.threads[static_cast<size_t>(base + l)];
    if (t.state != State::kWarp || t.warp.kind != op.kind || t.warp.mask != op.mask || t.warp.width != op.width ||
        t.warp.bytes != op.bytes) {
      yield_to_host(s);  // a lane named in the mask has not arrived: the last to arrive completes the primitive
      return me.result;
    }
  }
  // Every lane of the mask waits here: each gets its result.
  auto value = [&](int l) { return s.threads[static_cast<size_t>(base + l)].warp.value; };
  auto takes_part = [&](int l) { return l >= 0 && l < 32 && ((lanes_in >> l) & 1u) != 0; };
  unsigned votes = 0;
  for (int l = 0; l < lanes; ++l) {
    if (takes_part(l) && value(l) != 0) {
      votes |= 1u << l;
    }
  }
  const uint64_t poison = ~uint64_t{0};
  for (int l = 0; l < lanes; ++l) {
    if (!takes_part(l)) {
      continue;
    }
    ThreadState& t = s.threads[static_cast<size_t>(base + l)];
    const int w = op.width;
    const int seg_lo = l & ~(w - 1);
    const int seg_hi = seg_lo + w - 1;
    const int arg = t.warp.lane_arg;
    int src = l;
    switch (op.kind) {
      case WarpKind::kShfl:
        src = seg_lo + (arg & (w - 1));
        break;
      case WarpKind::kShflUp:
        src = l - arg >= seg_lo ? l - arg : l;
        break;
      case WarpKind::kShflDown:
        src = l + arg <= seg_hi ? l + arg : l;
        break;
      case WarpKind::kShflXor:
        src = (l ^ arg) <= seg_hi ? (l ^ arg) : l;
        break;
      default:
        break;
    }
    uint64_t r = 0;
    switch (op.kind) {
      case WarpKind::kSync:
        break;
      case WarpKind::kShfl:
      case WarpKind::kShflUp:
      case WarpKind::kShflDown:
      case WarpKind::kShflXor:
        r = takes_part(src) ? value(src) : poison;  // CUDA leaves a value from a lane not taking part undefined
        break;
      case WarpKind::kBallot:
        r = votes;
        break;
      case WarpKind::kAny:
        r = votes != 0 ? 1 : 0;
        break;
      case WarpKind::kAll:
        r = votes == lanes_in ? 1 : 0;
        break;
      case WarpKind::kMatchAny: {
        unsigned same = 0;
        for (int k = 0; k < lanes; ++k) {
          if (takes_part(k) && value(k) == value(l)) {
            same |= 1u << k;
          }
        }
        r = same;
        break;
      }
    }
    t.result = r;
  }
  for (int l = 0; l < lanes; ++l) {
    if (takes_part(l)) {
      s.threads[static_cast<size_t>(base + l)].state = State::kRunnable;
    }
  }
  return me.result;
}

unsigned active_mask() {
  Scheduler& s = active("__activemask");
  const int base = s.current / 32 * 32;
  unsigned mask = 0;
  for (int l = 0; l < 32 && base + l < s.n_threads; ++l) {
    if (s.threads[static_cast<size_t>(base + l)].state != State::kExited) {
      mask |= 1u << l;
    }
  }
  return mask;
}

}  // namespace detail
}  // namespace ampkit::kernels::emulation
