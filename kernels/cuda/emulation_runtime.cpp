// The scheduler of the emulated CUDA build (NOTE [Emulated execution] in emulation.h): per host thread, a pool
// of fibers that run a block's threads, the block's shared-memory arena and the order of a grid's blocks. The
// fiber switch is a dozen instructions of assembly on x86-64 (swapcontext elsewhere, which costs a sigprocmask
// system call per switch), annotated for AddressSanitizer. The barriers and warp primitives that suspend and
// resume fibers, and the report of a block that cannot go on, are in emulation_sync.cpp.
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
#include "emulation_scheduler.h"

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

namespace ampkit::kernels::emulation::detail {
namespace {

// ---- contexts ----------------------------------------------------------------------------------------------------
[[noreturn]] void fiber_entry();

#if defined(AMPKIT_EMULATION_ASM_SWITCH)
}  // namespace
}  // namespace ampkit::kernels::emulation::detail

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

namespace ampkit::kernels::emulation::detail {
namespace {

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

}  // namespace

struct Fiber {
  Context ctx;
  char* map = nullptr;  // guard page, then the stack
  char* stack = nullptr;
  void* fake_stack = nullptr;
  bool fresh = true;               // the next resume starts fiber_entry from the top of the stack
  size_t top_bytes = kStackBytes;  // where the stack starts, below its end by the fiber's colour
  int thread = -1;                 // the block's thread it runs, -1 while parked

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

Scheduler::Scheduler() : arena_storage(kArenaBytes + 64) {
  arena = arena_storage.data() + (64 - reinterpret_cast<uintptr_t>(arena_storage.data()) % 64) % 64;
}

Scheduler& scheduler() {
  thread_local Scheduler s;
  return s;
}

namespace {

// The scheduler of the launch running on this host thread (set for its duration; primitives called outside a
// launch find none).
thread_local Scheduler* tls_active = nullptr;

}  // namespace

void yield_to_host(Scheduler& s) {
  Fiber& f = *s.fibers[static_cast<size_t>(s.current_fiber)];
  asan_start_switch(&f.fake_stack, s.host_stack_bottom, s.host_stack_size);
  context_switch(&f.ctx, &s.host);
  asan_finish_switch(f.fake_stack, &s.host_stack_bottom, &s.host_stack_size);
}

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

namespace {

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

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace
}  // namespace ampkit::kernels::emulation::detail

namespace ampkit::kernels::emulation {

const std::string& last_error() { return detail::scheduler().error; }

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
  detail::Scheduler& s = detail::scheduler();
  s.order_set = order != nullptr;
  if (order != nullptr) {
    s.order = *order;
  }
  s.launches_since_order = 0;
}

const uint64_t* last_block_order(size_t* count) {
  detail::Scheduler& s = detail::scheduler();
  *count = s.last_order.size();
  return s.last_order.data();
}

FiberStats fiber_stats() {
  const detail::Scheduler& s = detail::scheduler();
  return FiberStats{s.fibers.size(), s.fibers.size() * detail::kStackBytes};
}

namespace detail {

cudaError_t run_blocks(dim3 grid, dim3 block, size_t dynamic_shared_bytes, void (*body)(const void*), const void* ctx) {
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
  if (model_recording) {
    model_begin_launch();
  }

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
        if (model_recording) {
          model_abandon_launch();
        }
        result = s.failure;
        break;
      }
    }
    if (model_recording && !s.failed) {
      model_end_block(n);
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

}  // namespace detail
}  // namespace ampkit::kernels::emulation
