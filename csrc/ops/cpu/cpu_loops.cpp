// Picks the CPU loop variant once per process from the processor's features (as ATen's DispatchStub does: the
// widest of AVX-512, AVX2 and the baseline that this machine supports).
#include "cpu_loops.h"

#include <ATen/Version.h>

#include <cstdlib>
#include <string>

namespace ampkit::detail {
namespace {

// AMPKIT_CPU_ISA=avx2 or default caps the choice (as ATEN_CPU_CAPABILITY does torch's), so that every copy of the
// loops can run, and be compared, on one machine (tests/python/test_cpu_isa_copies.py); a wider or unknown value
// changes nothing.
const CpuLoops& detect() {
  const char* env = std::getenv("AMPKIT_CPU_ISA");
  const std::string cap = env != nullptr ? env : "";
#if defined(AMPKIT_HAVE_X86_LOOPS)
  __builtin_cpu_init();
  if (cap != "avx2" && cap != "default" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return cpu_avx512::kLoops;
  }
  if (cap != "default" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return cpu_avx2::kLoops;
  }
#endif
  return cpu_default::kLoops;
}

}  // namespace

const CpuLoops& cpu_loops() {
  static const CpuLoops& loops = detect();
  return loops;
}

int torch_cpu_float_vector_width() {
  static const int width = [] {
    const std::string cap = at::get_cpu_capability();
    // AVX-512: torch's kernels run 16-float vectors, but the compiler turned their scalar tail loop into 8-float
    // vector code (then a scalar remainder), and that code rounds as the vector body: measured on torch 2.13's
    // wheel, only the last numel % 8 elements take the scalar formulas, as with AVX2
    // (tests/python/test_optim_bitwise_torch.py checks every size around both widths).
    if (cap == "AVX512") {
      return 8;
    }
    if (cap == "SVE128") {
      return 4;
    }
#if defined(__aarch64__)
    return cap == "SVE256" ? 8 : 4;  // NEON: 128-bit vectors
#else
    return 8;  // AVX2, and the 32-byte generic vectors of torch's DEFAULT build
#endif
  }();
  return width;
}

}  // namespace ampkit::detail
