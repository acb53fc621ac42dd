// The CPU loops built for the baseline instruction set of the target.
#define AMPKIT_CPU_NS cpu_default
#include "cast_loops.h"
#include "fp8_loops.h"
#include "lamb_loops.h"
#include "optim_loops.h"
#include "stats_loops.h"
#include "unscale_loops.h"

namespace ampkit::detail::cpu_default {
const CpuLoops kLoops{&unscale_and_check, &adam_step, &sgd_step,          &cast_pass, &grad_stats,
                      &grad_norm,         &lamb_step, &fp8_quantize_rows, "default"};
}
