// The lane sums of NOTE [Lane sums side by side] (csrc/ops/cpu/lamb_loops.h), in the portable copy of the CPU loops
// (libampkit hides its symbols, so the test compiles the header): every sum run side by side with others is its own
// lanes added in lane order from 0.0, bit for bit, and leaving out the lanes no element reached changes none.
#define AMPKIT_CPU_NS cpu_lane_sums_test
#include "csrc/ops/cpu/lamb_loops.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "support/catch_torch.h"

namespace {

namespace loops = ampkit::detail::cpu_lane_sums_test;
using Lanes = std::array<double, ampkit::kernels::kNormLanes>;

uint64_t bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

double in_lane_order(const Lanes& lanes) {
  double s = 0.0;
  for (const double l : lanes) {
    s = s + l;
  }
  return s;
}

}  // namespace

TEST_CASE("lane sums side by side: each in lane order bit for bit, the lanes past `used` left out", "[cpu_loops]") {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-45, 45);  // squares of gradients: wide magnitudes
  int order_sensitive = 0;
  for (int count = 1; count <= loops::kMaxChains; ++count) {
    for (const int64_t used : {int64_t{1}, int64_t{3}, int64_t{255}, int64_t{511}, int64_t{512}}) {
      std::vector<Lanes> lanes(static_cast<size_t>(count));
      const double* pointers[loops::kMaxChains];
      for (int c = 0; c < count; ++c) {
        for (int64_t l = 0; l < ampkit::kernels::kNormLanes; ++l) {
          lanes[c][l] = l < used ? std::ldexp(mantissa(rng), exponent(rng)) : 0.0;
        }
        pointers[c] = lanes[c].data();
      }
      double out[loops::kMaxChains];
      loops::lane_sums(pointers, count, used, out);
      for (int c = 0; c < count; ++c) {
        REQUIRE(bits(out[c]) == bits(in_lane_order(lanes[c])));
        double reversed = 0.0;
        for (int64_t l = ampkit::kernels::kNormLanes - 1; l >= 0; --l) {
          reversed = reversed + lanes[c][l];
        }
        order_sensitive += bits(reversed) != bits(out[c]) ? 1 : 0;
      }
    }
  }
  CHECK(order_sensitive > 20);  // the data tells lane order from another order
}

TEST_CASE("lane sums side by side: +0.0 lanes, Inf and NaN as in lane order", "[cpu_loops]") {
  Lanes zeros{};
  Lanes inf{};
  Lanes nan{};
  inf[7] = std::numeric_limits<double>::infinity();
  nan[300] = std::numeric_limits<double>::quiet_NaN();
  nan[2] = 1.0;
  const double* pointers[] = {zeros.data(), inf.data(), nan.data()};
  double out[3];
  loops::lane_sums(pointers, 3, 512, out);
  CHECK(bits(out[0]) == bits(0.0));
  CHECK(std::isinf(out[1]));
  CHECK(std::isnan(out[2]));
  loops::lane_sums(pointers, 3, 8, out);  // lanes from 8 on left out: the NaN at 300 is not reached
  CHECK(bits(out[0]) == bits(0.0));
  CHECK(std::isinf(out[1]));
  CHECK(out[2] == 1.0);
}
