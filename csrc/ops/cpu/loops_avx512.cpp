// The CPU loops built for AVX-512 F/BW/VL/DQ + FMA (compiled with CPU_CAPABILITY_AVX512, see CMakeLists.txt).
#define AMPKIT_CPU_NS cpu_avx512
// GCC 12 reports _mm512_undefined_epi32()'s deliberate self-initialisation (`__m512i __Y = __Y;`, in the
// intrinsics ATen's BF16 conversions call) as "used uninitialized" wherever such a conversion is not inlined into
// its caller; the value is never read. Before any header, so that it covers avx512fintrin.h.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "cast_loops.h"
#include "fp8_loops.h"
#include "lamb_loops.h"
#include "optim_loops.h"
#include "stats_loops.h"
#include "unscale_loops.h"

namespace ampkit::detail::cpu_avx512 {
const CpuLoops kLoops{&unscale_and_check, &adam_step, &sgd_step,          &cast_pass, &grad_stats,
                      &grad_norm,         &lamb_step, &fp8_quantize_rows, "avx512"};
}
