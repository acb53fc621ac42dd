// The CPU loops built for AVX-512 F/BW/VL/DQ + FMA (compiled with CPU_CAPABILITY_AVX512, see CMakeLists.txt).
#define AMPKIT_CPU_NS cpu_avx512
#include "cast_loops.h"
#include "lamb_loops.h"
#include "optim_loops.h"
#include "stats_loops.h"
#include "unscale_loops.h"

namespace ampkit::detail::cpu_avx512 {
const CpuLoops kLoops{&unscale_and_check, &adam_step, &sgd_step,  &cast_pass,
                      &grad_stats,        &grad_norm, &lamb_step, "avx512"};
}
