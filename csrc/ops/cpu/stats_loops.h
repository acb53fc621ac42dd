// CPU loop of grad_stats (NOTE [Gradient statistics] in kernels/amp_functors.h): one at::parallel_for over
// (tensor, chunk) work items of kNormChunk elements, each summing squares lane by lane in the order of the CUDA
// kernel (NOTE [Deterministic norm]), so that CPU and CUDA norms agree bit for bit. Compiled once per instruction
// set like unscale_loops.h.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <vector>

#include "../../../kernels/amp_functors.h"
#include "cpu_loops.h"
#include "vec_io.h"

namespace ampkit::detail::AMPKIT_CPU_NS {
namespace {

struct StatsItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
  double sum = 0.0;
  uint64_t non_finite = 0;
  uint64_t zeros = 0;
  float max_abs = 0.f;
  std::array<uint64_t, kernels::kGradHistBins> hist{};
};

// Histogram slots past the kGradHistBins bins: zeros and Inf/NaN are counted in the same branch-free increment.
constexpr int kZeroSlot = kernels::kGradHistBins;
constexpr int kNonFiniteSlot = kernels::kGradHistBins + 1;
constexpr int kHistSlots = kernels::kGradHistBins + 2;
// Copies of the histogram that consecutive elements increment in turn: gradients fall into a few bins, and one
// copy would make every increment wait for the store of the one before it.
constexpr int kHistCopies = 4;

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
typedef double VD __attribute__((vector_size(8 * kWidth)));
typedef uint64_t VU __attribute__((vector_size(8 * kWidth)));

// How the histogram's exponent is found. kPow2: inv_scale is 2^k with a normal k, so floor(log2(|x| * inv_scale))
// is floor(log2 |x|) + k, read from x's float exponent (a subnormal |x| scaled by 2^64 first, exactly). kExact: any
// other inv_scale: the exponent of the exact double product, as grad_hist_bin reads it.
enum class BinPath { kPow2, kExact };

// An FP16 or BF16 row as FP32, by at::vec's conversion (F16C where the loop's instruction set has it) and a
// scalar tail.
template <typename T>
void row_as_float(const T* g, int len, float* xs) {
  constexpr int kStep = 2 * VecF::size();
  int j = 0;
  for (; j + kStep <= len; j += kStep) {
    VecF lo, hi;
    load2(g + j, lo, hi);
    lo.store(xs + j);
    hi.store(xs + j + VecF::size());
  }
  for (; j < len; ++j) {
    xs[j] = static_cast<float>(g[j]);
  }
}

template <BinPath kPath>
void hist_bins(const VF& ax, const VD& ax_d, int pow2_exp, double inv, VI& bin) {
  VI e;
  if constexpr (kPath == BinPath::kPow2) {
    const VI exp_field = __builtin_bit_cast(VI, ax) >> 23;
    const VI sub_field = __builtin_bit_cast(VI, ax * 0x1p64f) >> 23;  // exact: a subnormal becomes normal
    e = (exp_field == 0 ? sub_field - 64 : exp_field) - 127 + pow2_exp;
  } else {
    e = __builtin_convertvector((__builtin_bit_cast(VU, ax_d * inv) >> 52) & 0x7ff, VI) - 1023;
  }
  bin = e - (kernels::kGradHistMinExp - 1);
  bin = bin < 0 ? 0 : bin;
  bin = bin > kernels::kGradHistBins - 1 ? kernels::kGradHistBins - 1 : bin;
}

// The running statistics of one chunk: its lanes (NOTE [Deterministic norm]), its histogram in kHistCopies copies,
// and the running maximum.
struct ChunkStats {
  alignas(64) double lanes[kernels::kNormLanes] = {};
  alignas(64) int32_t slots[kernels::kNormLanes];
  uint32_t hist[kHistCopies][kHistSlots] = {};
  float max_abs = 0.f;
};

// One row of a chunk (len <= kNormLanes elements), row element j adding its square to lane j, so that every lane
// sums its elements in element order (NOTE [Deterministic norm]). The vector part has no branch: a zero or an
// Inf/NaN adds +0.0 to its lane (which leaves a lane of finite squares unchanged bit for bit) and goes to a slot of
// its own past the histogram's bins; only the histogram increments stay scalar.
template <BinPath kPath>
void stats_row(const float* g, int len, int pow2_exp, double inv, ChunkStats& cs) {
  static_assert(kernels::kNormLanes % kWidth == 0);
  VF vmax = {};  // a local: in cs, every store of the loop could alias it
  for (int j = 0; j < len; j += kWidth) {
    VF x;
    if (j + kWidth <= len) {
      std::memcpy(&x, g + j, sizeof(x));
    } else {  // the row's last, partial vector: zeros past its end (they add +0.0; their slots are not counted)
      float tail[kWidth] = {};
      std::copy(g + j, g + len, tail);
      std::memcpy(&x, tail, sizeof(x));
    }
    const VI mag = __builtin_bit_cast(VI, x) & 0x7fffffff;
    const VI finite = mag < 0x7f800000;
    const VI live = finite & (mag != 0);
    const VF ax = __builtin_bit_cast(VF, mag & live);  // |x| for a non-zero finite x, else +0
    vmax = ax > vmax ? ax : vmax;
    const VD ax_d = __builtin_convertvector(ax, VD);
    VD lane;
    std::memcpy(&lane, cs.lanes + j, sizeof(VD));
    lane += ax_d * ax_d;
    std::memcpy(cs.lanes + j, &lane, sizeof(VD));
    VI bin;
    hist_bins<kPath>(ax, ax_d, pow2_exp, inv, bin);
    const VI slot = live ? bin : (finite ? VI{} + kZeroSlot : VI{} + kNonFiniteSlot);
    std::memcpy(cs.slots + j, &slot, sizeof(slot));
  }
  for (int k = 0; k < kWidth; ++k) {
    cs.max_abs = std::max(cs.max_abs, vmax[k]);
  }
  int j = 0;
  for (; j + kHistCopies <= len; j += kHistCopies) {
    for (int c = 0; c < kHistCopies; ++c) {
      ++cs.hist[c][cs.slots[j + c]];
    }
  }
  for (; j < len; ++j) {
    ++cs.hist[0][cs.slots[j]];
  }
}

template <BinPath kPath, typename T>
void stats_span(const T* g, int64_t n, float inv_scale, StatsItem& item) {
  ChunkStats cs;
  const double inv = static_cast<double>(inv_scale);
  const int pow2_exp = static_cast<int>(c10::bit_cast<uint32_t>(inv_scale) >> 23) - 127;
  for (int64_t row = 0; row < n; row += kernels::kNormLanes) {
    const int len = static_cast<int>(std::min<int64_t>(kernels::kNormLanes, n - row));
    if constexpr (!std::is_same_v<T, float>) {
      alignas(64) float staged[kernels::kNormLanes];
      row_as_float(g + row, len, staged);
      stats_row<kPath>(staged, len, pow2_exp, inv, cs);
    } else {
      stats_row<kPath>(g + row, len, pow2_exp, inv, cs);
    }
  }
  double chunk_sum = 0.0;
  for (const double lane : cs.lanes) {
    chunk_sum += lane;
  }
  item.sum = chunk_sum;
  item.max_abs = cs.max_abs;
  for (int c = 0; c < kHistCopies; ++c) {
    for (int k = 0; k < kernels::kGradHistBins; ++k) {
      item.hist[k] += cs.hist[c][k];
    }
    item.zeros += cs.hist[c][kZeroSlot];
    item.non_finite += cs.hist[c][kNonFiniteSlot];
  }
}

template <typename T>
void stats_span(const T* g, int64_t n, float inv_scale, StatsItem& item) {
  const uint32_t bits = c10::bit_cast<uint32_t>(inv_scale);
  const bool pow2 = (bits & 0x7fffff) == 0 && (bits >> 23) != 0 && (bits >> 23) < 0xff;  // positive, normal
  if (pow2) {
    stats_span<BinPath::kPow2>(g, n, inv_scale, item);
  } else {
    stats_span<BinPath::kExact>(g, n, inv_scale, item);
  }
}

}  // namespace

void grad_stats(const kernels::TensorRef* grads, int64_t n, float inv_scale, double* out) {
  std::vector<StatsItem> items;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < grads[t].numel; b += kernels::kNormChunk) {
      StatsItem item;
      item.tensor = t;
      item.begin = b;
      item.end = std::min(grads[t].numel, b + kernels::kNormChunk);
      items.push_back(item);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      StatsItem& item = items[k];
      const kernels::TensorRef& ref = grads[item.tensor];
      const int64_t len = item.end - item.begin;
      switch (ref.dtype) {
        case kernels::DType::kFloat16:
          stats_span(static_cast<const c10::Half*>(ref.data) + item.begin, len, inv_scale, item);
          break;
        case kernels::DType::kBFloat16:
          stats_span(static_cast<const c10::BFloat16*>(ref.data) + item.begin, len, inv_scale, item);
          break;
        default:
          stats_span(static_cast<const float*>(ref.data) + item.begin, len, inv_scale, item);
          break;
      }
    }
  });
  // Rows in item order: chunk sums in chunk order, as the CUDA kernel's last pass adds them.
  std::vector<double> totals(static_cast<size_t>(n), 0.0);
  std::vector<float> maxima(static_cast<size_t>(n), 0.f);
  for (int64_t t = 0; t < n; ++t) {
    double* row = out + t * kernels::kGradStatsColumns;
    std::fill(row, row + kernels::kGradStatsColumns, 0.0);
  }
  for (const StatsItem& item : items) {
    double* row = out + item.tensor * kernels::kGradStatsColumns;
    totals[item.tensor] += item.sum;
    maxima[item.tensor] = std::max(maxima[item.tensor], item.max_abs);
    row[kernels::kStatNonFinite] += static_cast<double>(item.non_finite);
    row[kernels::kStatZeros] += static_cast<double>(item.zeros);
    for (int k = 0; k < kernels::kGradHistBins; ++k) {
      row[4 + k] += static_cast<double>(item.hist[k]);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    double* row = out + t * kernels::kGradStatsColumns;
    row[kernels::kStatMaxAbs] = static_cast<double>(maxima[t]) * static_cast<double>(inv_scale);
    row[kernels::kStatNorm] = std::sqrt(totals[t]) * static_cast<double>(inv_scale);
  }
}

}  // namespace ampkit::detail::AMPKIT_CPU_NS
