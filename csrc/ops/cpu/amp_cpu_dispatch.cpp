// Picks the CPU loop variant once per process from the processor's features.
#include "amp_cpu_loops.hpp"

namespace ampkit::detail {
namespace {

bool has_avx2() {
#if defined(AMPKIT_HAVE_AVX2_LOOPS) && (defined(__x86_64__) || defined(__i386__))
  static const bool supported =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return supported;
#else
  return false;
#endif
}

}  // namespace

bool cpu_unscale_and_check(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write) {
#if defined(AMPKIT_HAVE_AVX2_LOOPS)
  if (has_avx2()) {
    return cpu_avx2::unscale_and_check(tensors, n, inv_scale, write);
  }
#endif
  return cpu_default::unscale_and_check(tensors, n, inv_scale, write);
}

const char* cpu_loop_isa() { return has_avx2() ? "avx2" : "default"; }

}  // namespace ampkit::detail
