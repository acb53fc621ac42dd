// The CPU loops built for the baseline instruction set of the target.
#define AMPKIT_CPU_NS cpu_default
#include "amp_cpu_loops.h"
#include "optim_cpu_loops.h"
