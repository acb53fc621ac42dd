// The callbacks behind the memory-transaction model's instrumentation (NOTE [Memory transaction model]): code
// compiled with GCC's or Clang's `-fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0`
// (CMake: ampkit_memory_model_instrument) calls one of these before every load and store, with the address; the
// model keeps the ones that land in the block's shared memory. Linked only into the programs built that way (the
// AddressSanitizer runtime defines the same names).
#include <cstddef>
#include <cstdint>

#include "emulation_runtime.h"

namespace {
// `pc`: the hook's return address, in the instrumented code (the site of the access).
inline void seen(void* pc, uintptr_t p, size_t bytes, bool store) {
  if (ampkit::kernels::emulation::detail::model_recording) {
    ampkit::kernels::emulation::detail::model_record_instrumented(reinterpret_cast<uintptr_t>(pc), p,
                                                                  static_cast<uint32_t>(bytes), store);
  }
}
}  // namespace

#define AMPKIT_MODEL_HOOKS(n)                                                        \
  extern "C" __attribute__((noinline)) void __asan_load##n##_noabort(uintptr_t p) {  \
    seen(__builtin_return_address(0), p, n, false);                                  \
  }                                                                                  \
  extern "C" __attribute__((noinline)) void __asan_store##n##_noabort(uintptr_t p) { \
    seen(__builtin_return_address(0), p, n, true);                                   \
  }
AMPKIT_MODEL_HOOKS(1)
AMPKIT_MODEL_HOOKS(2)
AMPKIT_MODEL_HOOKS(4)
AMPKIT_MODEL_HOOKS(8)
AMPKIT_MODEL_HOOKS(16)
#undef AMPKIT_MODEL_HOOKS

extern "C" __attribute__((noinline)) void __asan_loadN_noabort(uintptr_t p, size_t n) {
  seen(__builtin_return_address(0), p, n, false);
}
extern "C" __attribute__((noinline)) void __asan_storeN_noabort(uintptr_t p, size_t n) {
  seen(__builtin_return_address(0), p, n, true);
}
extern "C" void __asan_handle_no_return() {}
// Around the dynamic initialisers of an instrumented file: nothing to do here.
extern "C" void __asan_before_dynamic_init(const char*) {}
extern "C" void __asan_after_dynamic_init() {}
