// CPU loop of grad_stats (NOTE [Gradient statistics] in kernels/amp_functors.h): one at::parallel_for over
// (tensor, chunk) work items of kNormChunk elements, each summing squares lane by lane in the order of the CUDA
// kernel (NOTE [Deterministic norm]), so that CPU and CUDA norms agree bit for bit. Compiled once per instruction
// set like unscale_loops.h.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cmath>
#include <vector>

#include "../../../kernels/amp_functors.h"
#include "cpu_loops.h"

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

template <typename T>
void stats_span(const T* g, int64_t n, float inv_scale, StatsItem& item) {
  std::array<double, kernels::kNormLanes> lanes{};
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(g[i]);
    if (kernels::is_non_finite(x)) {
      ++item.non_finite;
    } else if (x == 0.f) {
      ++item.zeros;
    } else {
      const double xd = static_cast<double>(x);
      double& lane = lanes[i % kernels::kNormLanes];
      lane += xd * xd;
      item.max_abs = std::max(item.max_abs, std::fabs(x));
      ++item.hist[kernels::grad_hist_bin(x, inv_scale)];
    }
  }
  double chunk_sum = 0.0;
  for (const double lane : lanes) {
    chunk_sum += lane;
  }
  item.sum = chunk_sum;
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
