// Picks the CPU loop variant once per process from the processor's features (as ATen's DispatchStub does:
// the widest of AVX-512, AVX2 and the baseline that this machine supports).
#include "amp_cpu_loops.hpp"

namespace ampkit::detail {
namespace {

enum class Isa { kDefault, kAvx2, kAvx512 };

Isa detect_isa() {
#if defined(AMPKIT_HAVE_X86_LOOPS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return Isa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kDefault;
}

Isa isa() {
  static const Isa detected = detect_isa();
  return detected;
}

}  // namespace

bool cpu_unscale_and_check(const kernels::TensorRef* tensors, int64_t n, float inv_scale, bool write) {
  switch (isa()) {
#if defined(AMPKIT_HAVE_X86_LOOPS)
    case Isa::kAvx512:
      return cpu_avx512::unscale_and_check(tensors, n, inv_scale, write);
    case Isa::kAvx2:
      return cpu_avx2::unscale_and_check(tensors, n, inv_scale, write);
#endif
    default:
      return cpu_default::unscale_and_check(tensors, n, inv_scale, write);
  }
}

void cpu_adam_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::AdamParams& params, float grad_scale) {
  switch (isa()) {
#if defined(AMPKIT_HAVE_X86_LOOPS)
    case Isa::kAvx512:
      return cpu_avx512::adam_step(tensors, n, params, grad_scale);
    case Isa::kAvx2:
      return cpu_avx2::adam_step(tensors, n, params, grad_scale);
#endif
    default:
      return cpu_default::adam_step(tensors, n, params, grad_scale);
  }
}

void cpu_sgd_step(const kernels::OptimTensor* tensors, int64_t n, const kernels::SgdParams& params, float grad_scale) {
  switch (isa()) {
#if defined(AMPKIT_HAVE_X86_LOOPS)
    case Isa::kAvx512:
      return cpu_avx512::sgd_step(tensors, n, params, grad_scale);
    case Isa::kAvx2:
      return cpu_avx2::sgd_step(tensors, n, params, grad_scale);
#endif
    default:
      return cpu_default::sgd_step(tensors, n, params, grad_scale);
  }
}

const char* cpu_loop_isa() {
  switch (isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

}  // namespace ampkit::detail
