// The CPU loops built for AVX2 + FMA + F16C (compiled with CPU_CAPABILITY_AVX2, see CMakeLists.txt).
#define AMPKIT_CPU_NS cpu_avx2
#include "amp_cpu_loops.h"
#include "optim_cpu_loops.h"
