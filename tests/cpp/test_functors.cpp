// The element-wise functors of kernels/ checked without Torch against independent float64 references: the
// same arithmetic the CPU loops and the CUDA kernels run.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/amp_functors.h"
#include "kernels/blockwise8.h"
#include "kernels/fp8_functors.h"
#include "kernels/optim_functors.h"
#include "kernels/stochastic_rounding.h"

using ampkit::kernels::is_non_finite;
using ampkit::kernels::UnscaleOp;
using ampkit::kernels::UpdateScaleOp;

namespace {

template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

}  // namespace

TEST_CASE("is_non_finite: flags exactly Inf, -Inf and NaN", "[functors][cpu]") {
  const float fmax = std::numeric_limits<float>::max();
  const double dmax = std::numeric_limits<double>::max();
  CHECK(is_non_finite(std::numeric_limits<float>::infinity()));
  CHECK(is_non_finite(-std::numeric_limits<float>::infinity()));
  CHECK(is_non_finite(std::numeric_limits<float>::quiet_NaN()));
  CHECK(is_non_finite(-std::numeric_limits<float>::quiet_NaN()));
  CHECK(is_non_finite(std::numeric_limits<float>::signaling_NaN()));
  CHECK_FALSE(is_non_finite(fmax));
  CHECK_FALSE(is_non_finite(-fmax));
  CHECK_FALSE(is_non_finite(0.f));
  CHECK_FALSE(is_non_finite(-0.f));
  CHECK_FALSE(is_non_finite(std::numeric_limits<float>::denorm_min()));
  CHECK(is_non_finite(std::numeric_limits<double>::infinity()));
  CHECK(is_non_finite(std::numeric_limits<double>::quiet_NaN()));
  CHECK_FALSE(is_non_finite(dmax));
  CHECK_FALSE(is_non_finite(std::numeric_limits<double>::denorm_min()));
  // A float that is finite but overflows FP16 is still finite in opmath.
  CHECK_FALSE(is_non_finite(70000.f));

  std::mt19937 gen(1234);
  std::uniform_int_distribution<uint32_t> bits32;
  for (int i = 0; i < 100000; ++i) {
    const uint32_t b = bits32(gen);
    float f;
    std::memcpy(&f, &b, sizeof(f));
    REQUIRE(is_non_finite(f) == !std::isfinite(static_cast<double>(f)));
  }
}

TEST_CASE("UnscaleOp: FP32 product matches the float64 product rounded once", "[functors][cpu]") {
  std::mt19937 gen(42);
  std::normal_distribution<float> val(0.f, 1000.f);
  std::uniform_real_distribution<float> exponent(-20.f, 20.f);
  for (int i = 0; i < 200000; ++i) {
    const float x = val(gen);
    const float inv = std::exp2(exponent(gen)) * 1.2345f;
    const UnscaleOp<float> op(inv);
    // Two floats multiply exactly in double (24 + 24 bits < 53), so one rounding to float is the IEEE result.
    const float expected = static_cast<float>(static_cast<double>(x) * static_cast<double>(inv));
    REQUIRE(same_bits(op(x), expected));
  }
  // Products that overflow FP32 give Inf, as the unscaled value would.
  CHECK(std::isinf(UnscaleOp<float>(4.f)(FLT_MAX)));
}

TEST_CASE("UnscaleOp: FP64 grads multiply by the FP32 inv_scale widened to double", "[functors][cpu]") {
  std::mt19937_64 gen(7);
  std::normal_distribution<double> val(0.0, 1e3);
  for (int i = 0; i < 100000; ++i) {
    const double x = val(gen);
    const float inv = 1.f / 3.f;
    const UnscaleOp<double> op(inv);
    REQUIRE(same_bits(op(x), std::fma(x, static_cast<double>(inv), 0.0)));
  }
}

TEST_CASE("UnscaleOp: inv_scale == 1 returns its input bit for bit", "[functors][cpu]") {
  const UnscaleOp<float> op(1.f);
  CHECK(op.identity);
  for (const float x : {-0.f, 0.f, 1.5f, -FLT_MAX, std::numeric_limits<float>::denorm_min(),
                        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    CHECK(same_bits(op(x), x));
  }
  CHECK_FALSE(UnscaleOp<float>(0.5f).identity);
}

namespace {

// An independent statement of torch._amp_update_scale_'s rule, in double.
struct ReferenceScaler {
  double scale;
  int64_t tracker = 0;
  void step(bool overflow, double growth, double backoff, int64_t interval) {
    if (overflow) {
      scale = static_cast<float>(scale * backoff);
      tracker = 0;
    } else if (++tracker == interval) {
      const double grown = scale * growth;
      if (static_cast<float>(grown) <= FLT_MAX) {
        scale = static_cast<float>(grown);
      }
      tracker = 0;
    }
  }
};

}  // namespace

TEST_CASE("CastOp: a division is exact IEEE division, also when a power-of-two divisor becomes a multiply",
          "[functors][cpu]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(-2.f, 2.f);
  std::uniform_int_distribution<int> exponent(-149, 127);
  for (const float divisor : {1.f, 2.f, 3.f, 4.f, 7.f, 0.125f, 0.3f, 1024.f, std::ldexp(1.f, 126),
                              std::ldexp(1.f, -126), std::ldexp(1.f, 127), std::ldexp(1.f, -127)}) {
    const auto op = ampkit::kernels::CastOp::divide_by(divisor);
    for (int i = 0; i < 20000; ++i) {
      const float x = std::ldexp(mantissa(rng), exponent(rng));  // normals, subnormals, results that overflow
      const volatile float expected = x / divisor;
      INFO("x " << x << " / " << divisor);
      REQUIRE(same_bits(op(x), static_cast<float>(expected)));
    }
    REQUIRE(same_bits(op(0.f), 0.f / divisor));
    REQUIRE(same_bits(op(-0.f), -0.f / divisor));
  }
  const auto unscale = ampkit::kernels::CastOp::multiply_by(0.5f);
  REQUIRE(unscale(3.f) == 1.5f);
  REQUIRE(ampkit::kernels::CastOp::multiply_by(1.f).identity);
}

TEST_CASE("UpdateScaleOp: follows torch's grow/back-off rule over random overflow sequences", "[functors][cpu]") {
  const int64_t interval = GENERATE(1, 2, 3, 7);
  const double growth = GENERATE(2.0, 1.5);
  const double backoff = GENERATE(0.5, 0.25);
  std::mt19937 gen(static_cast<uint32_t>(interval * 100 + growth * 10 + backoff * 4));
  std::bernoulli_distribution overflow(0.2);
  const UpdateScaleOp op{growth, backoff, interval};
  float scale = 65536.f;
  int32_t tracker = 0;
  ReferenceScaler ref{65536.0};
  for (int i = 0; i < 2000; ++i) {
    const bool o = overflow(gen);
    op(&scale, &tracker, o ? 1.f : 0.f);
    ref.step(o, growth, backoff, interval);
    REQUIRE(static_cast<double>(scale) == ref.scale);
    REQUIRE(tracker == ref.tracker);
  }
}

TEST_CASE("UpdateScaleOp: never grows past the largest finite float", "[functors][cpu]") {
  const UpdateScaleOp op{2.0, 0.5, 1};
  float scale = 0x1p127f;
  int32_t tracker = 0;
  op(&scale, &tracker, 0.f);
  CHECK(scale == 0x1p127f);  // 2^128 is Inf in FP32: kept
  CHECK(tracker == 0);
  op(&scale, &tracker, 1.f);
  CHECK(scale == 0x1p126f);
}

TEST_CASE("UpdateScaleOp: any nonzero found_inf (NaN included) backs off", "[functors][cpu]") {
  const UpdateScaleOp op{2.0, 0.5, 2000};
  float scale = 1024.f;
  int32_t tracker = 17;
  op(&scale, &tracker, std::numeric_limits<float>::quiet_NaN());
  CHECK(scale == 512.f);
  CHECK(tracker == 0);
}

TEST_CASE("split_remainder / join_remainder: the FP32 master survives exactly, ties and extremes included",
          "[functors][cpu]") {
  using ampkit::kernels::join_remainder;
  using ampkit::kernels::split_remainder;
  auto bits_of = [](float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof(b));
    return b;
  };
  auto from_bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  };
  std::vector<float> values = {0.f,
                               -0.f,
                               1.f,
                               -1.f,
                               FLT_MAX,
                               -FLT_MAX,
                               FLT_MIN,
                               std::numeric_limits<float>::denorm_min(),
                               from_bits(0x3F808000u),
                               from_bits(0x3F818000u),
                               from_bits(0xBF808000u),
                               from_bits(0x7F7E8000u),
                               from_bits(0x7F7F7FFFu),
                               from_bits(0x00008000u)};
  std::mt19937 gen(99);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const float f = from_bits(any(gen));
    if (!std::isnan(f) && !std::isinf(f)) {
      values.push_back(f);
    }
  }
  for (const float v : values) {
    uint16_t weight = 0;
    int16_t remainder = 0;
    split_remainder(v, &weight, &remainder);
    REQUIRE(bits_of(join_remainder(weight, remainder)) == bits_of(v));
    // The weight is the high half rounded to nearest (ties away from zero): within half a BF16 ulp of v.
    const double w = static_cast<double>(from_bits(static_cast<uint32_t>(weight) << 16));
    const double truncated = static_cast<double>(from_bits(bits_of(v) & 0xffff0000u));
    const double ulp = std::abs(static_cast<double>(from_bits((bits_of(v) & 0xffff0000u) + 0x10000u)) - truncated);
    if (std::isfinite(w)) {
      REQUIRE(std::abs(w - static_cast<double>(v)) <= ulp / 2);
    }
  }
}

TEST_CASE("step_power: correctly rounded beta^step, and FP32 bias-correction factors equal to glibc pow's",
          "[functors][cpu]") {
  using ampkit::kernels::step_power;
  // Pairs where glibc's pow (0.52 ulp) is 1 ulp off and step_power returns the correctly rounded power (checked
  // against 400-bit arithmetic).
  struct Case {
    double beta, step, power;
  };
  for (const Case c : {Case{0x1.ff7ced916872bp-1, 2904, 0x1.c04c8a080419dp-5},   // 0.999
                       Case{0x1.fff2e48e8a71ep-1, 494, 0x1.e75210acd7d48p-1},    // 0.9999
                       Case{0x1.fffeb074a771dp-1, 75, 0x1.ff9dbb7c2ed5bp-1}}) {  // 0.99999
    CHECK(step_power(c.beta, c.step) == c.power);
  }
  CHECK(step_power(0.0, 1.0) == 0.0);
  CHECK(step_power(0.9, 0.0) == 1.0);
  CHECK(step_power(1.0, 123456.0) == 1.0);
  CHECK(step_power(0.9, 1.0) == 0.9);
  CHECK(step_power(0.9, 1e7) == 0.0);                 // underflows to zero, as pow does
  CHECK(step_power(0.9, 2.5) == std::pow(0.9, 2.5));  // not a step count: the platform's pow
  CHECK(std::isnan(step_power(0.9, std::nan(""))));

  // NOTE [Bias-correction powers]: the factors the functors use, rounded to FP32, equal those from glibc's pow
  // (torch's CPU kernels'), and the powers themselves are within 1 ulp of it.
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<std::pair<double, int64_t>> sweeps = {{0.9, 200000}, {0.99, 200000}, {0.999, 400000}, {0.9999, 400000}};
  for (int k = 0; k < 60; ++k) {
    sweeps.emplace_back(k % 2 ? unit(gen) : 1.0 - 1e-3 * unit(gen), 5000);
  }
  int64_t differing_powers = 0;
  for (const auto& [beta, steps] : sweeps) {
    for (int64_t s = 1; s <= steps; ++s) {
      const double ours = step_power(beta, static_cast<double>(s));
      const double glibc = std::pow(beta, static_cast<double>(s));
      if (ours == glibc) {
        continue;
      }
      ++differing_powers;
      INFO("beta " << beta << ", step " << s);
      REQUIRE((ours == std::nextafter(glibc, 0.0) || ours == std::nextafter(glibc, 1.0)));
      const double bc_ours = 1.0 - ours;
      const double bc_glibc = 1.0 - glibc;
      REQUIRE(static_cast<float>(bc_ours) == static_cast<float>(bc_glibc));
      REQUIRE(static_cast<float>(std::sqrt(bc_ours)) == static_cast<float>(std::sqrt(bc_glibc)));
      for (const double lr : {1e-3, 3e-4, 1e-2, 1.0}) {
        REQUIRE(static_cast<float>(-(lr / bc_ours)) == static_cast<float>(-(lr / bc_glibc)));
      }
    }
  }
  CHECK(differing_powers > 0);  // the sweep does reach glibc's misrounded cases
}

#include "csrc/ops/cuda_archs.h"

TEST_CASE("cuda_archs_cover: SASS runs on the same major with a higher minor, PTX on anything newer", "[archs][cpu]") {
  using ampkit::detail::cuda_archs_cover;
  using ampkit::detail::parse_cuda_archs;
  const auto torch_list = parse_cuda_archs("75,80,86,90,100,120");
  CHECK(torch_list.sass.size() == 6);
  CHECK(torch_list.ptx == 120);
  CHECK(cuda_archs_cover(torch_list, 9, 0));        // H100/H200
  CHECK(cuda_archs_cover(torch_list, 8, 9));        // L4/L40: sm_86 SASS
  CHECK(cuda_archs_cover(torch_list, 12, 1));       // sm_120 SASS
  CHECK(cuda_archs_cover(torch_list, 13, 0));       // PTX of sm_120
  CHECK_FALSE(cuda_archs_cover(torch_list, 7, 0));  // V100: nothing compiled for it
  const auto h100_only = parse_cuda_archs("90");
  CHECK(cuda_archs_cover(h100_only, 9, 0));
  CHECK(cuda_archs_cover(h100_only, 10, 0));  // PTX
  CHECK_FALSE(cuda_archs_cover(h100_only, 8, 0));
  CHECK_FALSE(cuda_archs_cover(h100_only, 8, 9));
  const auto ampere = parse_cuda_archs("80");
  CHECK(cuda_archs_cover(ampere, 8, 6));
  CHECK_FALSE(cuda_archs_cover(ampere, 7, 5));
  CHECK_FALSE(cuda_archs_cover(parse_cuda_archs(""), 9, 0));  // CPU-only build
}

TEST_CASE("philox4x32_10: Random123's known-answer vectors", "[functors][cpu]") {
  using ampkit::kernels::philox4x32_10;
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const auto r = philox4x32_10(k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3], k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) {
      CHECK(r.v[i] == k.out[i]);
    }
  }
}

TEST_CASE("bf16_bits_stochastic: rounds to a neighbour, up with probability (distance to the lower) / ulp",
          "[functors][cpu]") {
  using ampkit::kernels::bf16_bits_stochastic;
  using ampkit::kernels::bf16_bits_to_float;
  using ampkit::kernels::bit_cast;
  // Every one of the 2^16 random values once: the count rounding away from zero is exactly the low half.
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
  for (int trial = 0; trial < 50; ++trial) {
    const float x = trial == 0 ? 1.0f + 0x1p-10f : dist(gen);
    const uint32_t bits = bit_cast<uint32_t>(x);
    const auto down = static_cast<uint16_t>(bits >> 16);
    uint32_t up_count = 0;
    for (uint32_t r = 0; r < 65536u; ++r) {
      const uint16_t b = bf16_bits_stochastic(x, r);
      REQUIRE((b == down || b == static_cast<uint16_t>(down + 1)));
      up_count += b != down ? 1u : 0u;
    }
    INFO("x " << x);
    CHECK(up_count == (bits & 0xffffu));
    // Unbiased: the mean over all random values is x, exactly (in double).
    const double lo = bf16_bits_to_float(down);
    const double hi = bf16_bits_to_float(static_cast<uint16_t>(down + 1));
    CHECK((lo * (65536.0 - up_count) + hi * up_count) / 65536.0 == static_cast<double>(x));
  }
  // BF16 values stay, Inf stays Inf, NaN stays NaN, -0.0 stays -0.0.
  const float inf = std::numeric_limits<float>::infinity();
  for (uint32_t r : {0u, 1u, 0x8000u, 0xffffu}) {
    CHECK(bf16_bits_stochastic(1.5f, r) == 0x3fc0u);
    CHECK(bf16_bits_stochastic(inf, r) == 0x7f80u);
    CHECK(bf16_bits_stochastic(-inf, r) == 0xff80u);
    CHECK(bf16_bits_stochastic(std::numeric_limits<float>::quiet_NaN(), r) == 0x7fc0u);
    CHECK(bf16_bits_stochastic(bit_cast<float>(0x7fffffffu), r) == 0x7fc0u);
    CHECK(bf16_bits_stochastic(-0.0f, r) == 0x8000u);
  }
}

TEST_CASE("kahan_store: weight + compensation track the float64 sum of many small updates", "[functors][cpu]") {
  using ampkit::kernels::bf16_bits_nearest;
  using ampkit::kernels::bf16_bits_to_float;
  uint16_t w = bf16_bits_nearest(1.0f);
  uint16_t c = 0;
  double exact = 1.0;
  std::mt19937 gen(6);
  std::uniform_real_distribution<float> dist(-3e-4f, 1e-4f);
  for (int i = 0; i < 5000; ++i) {
    const float delta = dist(gen);
    const float w0 = bf16_bits_to_float(w);
    ampkit::kernels::kahan_store(w0, w0 + delta, &w, &c);
    exact += static_cast<double>(w0 + delta) - w0;  // the FP32 update as the kernels compute it
  }
  const double held = static_cast<double>(bf16_bits_to_float(w)) + bf16_bits_to_float(c);
  INFO("exact " << exact << ", weight " << bf16_bits_to_float(w) << ", held " << held);
  // Each step loses at most half a BF16 unit of the compensation (|c| <= 2^-9 here: 2^-18), unbiased: a random walk
  // of 5000 such losses, bounded at 4 standard deviations of its worst case; plain BF16 would not move at all.
  CHECK(std::abs(held - exact) < 4 * std::sqrt(5000.0) * 0x1p-19);
  CHECK(std::abs(bf16_bits_to_float(w) - exact) <= 0x1p-8);  // the weight is within one BF16 ulp at ~0.5
  CHECK(bf16_bits_nearest(1.0f + 0x1p-8f) == 0x3f80u);       // ties to even
  CHECK(bf16_bits_nearest(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81u);
}

namespace {

using ampkit::kernels::Fp8Format;

// The finite non-negative values of an FP8 format, by code (0 .. max code), from its definition in double.
std::vector<double> fp8_values(Fp8Format f) {
  const int mantissa = f == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = f == Fp8Format::kE4M3 ? 7 : 15;
  const int max_code = f == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  std::vector<double> values;
  for (int code = 0; code <= max_code; ++code) {
    const int e = code >> mantissa;
    const int m = code & ((1 << mantissa) - 1);
    values.push_back(e == 0 ? std::ldexp(m, 1 - bias - mantissa)
                            : std::ldexp(1.0 + std::ldexp(m, -mantissa), e - bias));
  }
  return values;
}

// The saturating cast of NOTE [Saturating FP8 cast], from the values: NaN -> 0x7F, beyond the maximum -> it,
// otherwise the nearest value, ties to the even code.
uint8_t fp8_reference(float v, const std::vector<double>& values) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  if (std::isnan(v)) {
    return sign | 0x7F;
  }
  const double a = std::fabs(static_cast<double>(v));
  if (a >= values.back()) {
    return static_cast<uint8_t>(sign | (values.size() - 1));
  }
  const auto hi = static_cast<size_t>(std::upper_bound(values.begin(), values.end(), a) - values.begin());
  const size_t lo = hi - 1;
  const double below = a - values[lo];
  const double above = values[hi] - a;
  const size_t code = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint8_t>(sign | code);
}

}  // namespace

TEST_CASE("fp8_from_float: the nearest FP8 value, ties to even, saturating, over a sweep of all FP32 bit patterns",
          "[functors][fp8][cpu]") {
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    INFO("format " << (f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"));
    const std::vector<double> values = fp8_values(f);
    REQUIRE(values.size() == (f == Fp8Format::kE4M3 ? 127u : 124u));
    size_t checked = 0;
    auto check = [&](float v) {
      ++checked;
      const uint8_t got = f == Fp8Format::kE4M3 ? ampkit::kernels::fp8_from_float<Fp8Format::kE4M3>(v)
                                                : ampkit::kernels::fp8_from_float<Fp8Format::kE5M2>(v);
      const uint8_t want = fp8_reference(v, values);
      if (got != want) {
        FAIL_CHECK("v = " << v << " (bits " << std::hex << ampkit::kernels::bit_cast<uint32_t>(v) << "): got 0x"
                          << int(got) << ", expected 0x" << int(want));
      }
    };
    // Every 997th bit pattern (both signs, every exponent, NaN and Inf included).
    for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 997) {
      check(ampkit::kernels::bit_cast<float>(static_cast<uint32_t>(b)));
    }
    // Every value, every midpoint between neighbours (the ties) and the FP32 numbers on either side of each.
    for (size_t i = 0; i + 1 < values.size(); ++i) {
      for (const double x : {values[i], (values[i] + values[i + 1]) / 2}) {
        const auto fx = static_cast<float>(x);
        for (const float v : {fx, std::nextafter(fx, 0.f), std::nextafter(fx, FLT_MAX)}) {
          check(v);
          check(-v);
        }
      }
    }
    for (const float v : {static_cast<float>(values.back()), std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min(), FLT_MIN, -0.f}) {
      check(v);
      check(-v);
    }
    CHECK(checked > (uint64_t{1} << 32) / 997);
  }
}

TEST_CASE("blockwise8_code_tree: the search tree gives blockwise8_code's code on every map value's neighbourhood",
          "[functors][cpu]") {
  // NOTE [Quantizer search tree]. Inputs: each map value and its float neighbours, the midpoints between map
  // values and their neighbours (where the final rounding decides), the ends, specials, and random values.
  using namespace ampkit::kernels;
  for (const bool is_signed : {true, false}) {
    const float* map = blockwise8_map(is_signed);
    float tree[kQuantBlock];
    for (int n = 0; n < kQuantBlock; ++n) {
      tree[n] = map[blockwise8_tree_source(n)];
    }
    std::vector<float> inputs = {0.f,
                                 -0.f,
                                 1.f,
                                 -1.f,
                                 2.f,
                                 -2.f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 1e-30f,
                                 -1e-30f,
                                 FLT_MIN,
                                 FLT_TRUE_MIN};
    for (int i = 0; i < kQuantBlock; ++i) {
      for (const float v : {map[i], i + 1 < kQuantBlock ? 0.5f * (map[i] + map[i + 1]) : map[i]}) {
        float lo = v;
        float hi = v;
        for (int k = 0; k < 3; ++k) {
          inputs.push_back(lo);
          inputs.push_back(hi);
          lo = std::nextafter(lo, -INFINITY);
          hi = std::nextafter(hi, INFINITY);
        }
      }
    }
    std::mt19937 rng(8);
    std::uniform_real_distribution<float> u(-1.25f, 1.25f);
    for (int i = 0; i < 200000; ++i) {
      inputs.push_back(std::ldexp(u(rng), -static_cast<int>(rng() % 12)));
    }
    int checked = 0;
    for (const float x : inputs) {
      for (const float scale : {1.f, 0.75f, 3e-5f}) {
        const float xs = x * scale;  // x / scale lands on (or next to) the intended input
        REQUIRE(blockwise8_code_tree(xs, scale, tree, map[kQuantBlock - 1]) == blockwise8_code(xs, scale, map));
        ++checked;
      }
    }
    CHECK(checked > 600000);
  }
  // The layout itself: the root is map[128], level 1 holds map[64] and map[192], the last level the odd indices.
  CHECK(blockwise8_tree_source(0) == 0);
  CHECK(blockwise8_tree_source(1) == 128);
  CHECK(blockwise8_tree_source(2) == 64);
  CHECK(blockwise8_tree_source(3) == 192);
  CHECK(blockwise8_tree_source(128) == 1);
  CHECK(blockwise8_tree_source(255) == 255);
}
