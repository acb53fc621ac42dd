// The GCC/Clang vector types of the CPU loops written with vector extensions (stats_loops.h, fp8_loops.h), shared
// by the loops of one instruction set inside AMPKIT_CPU_NS.
#pragma once

#include <cstdint>

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

// GCC/Clang vector extensions of kWidth elements: the compiler lowers them to the instruction set this copy of the
// loops is compiled for (the FP64 vectors: four SSE registers in the portable copy, two AVX2 ones, two AVX-512 ones
// of 16 elements: the AVX-512 copy takes a whole register of floats per step, 15-20% faster than 8 on a Xeon).
// They are passed by reference and bit-cast with the builtin, so no function takes or returns one by value (an ABI
// that differs between the copies).
#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef float VF __attribute__((vector_size(4 * kWidth)));
typedef int32_t VI __attribute__((vector_size(4 * kWidth)));
typedef uint32_t VW __attribute__((vector_size(4 * kWidth)));
typedef double VD __attribute__((vector_size(8 * kWidth)));
typedef uint64_t VU __attribute__((vector_size(8 * kWidth)));
typedef uint8_t VB __attribute__((vector_size(kWidth)));

}  // namespace
}  // namespace ampkit::detail::AMPKIT_CPU_NS
