// The CPU loops built for AVX2 + FMA + F16C (compiled with CPU_CAPABILITY_AVX2, see CMakeLists.txt).
#define AMPKIT_CPU_NS cpu_avx2
#include "cast_loops.h"
#include "fp8_loops.h"
#include "lamb_loops.h"
#include "optim_loops.h"
#include "stats_loops.h"
#include "unscale_loops.h"

namespace ampkit::detail::cpu_avx2 {
const CpuLoops kLoops{&unscale_and_check, &adam_step, &sgd_step,          &cast_pass, &grad_stats,
                      &grad_norm,         &lamb_step, &fp8_quantize_rows, "avx2"};
}
