// The CPU loops built for AVX-512 (F, BW, VL, DQ) + FMA (compiled with CPU_CAPABILITY_AVX512, see CMakeLists.txt).
#define AMPKIT_CPU_NS cpu_avx512
#include "amp_cpu_loops.h"
#include "optim_cpu_loops.h"
