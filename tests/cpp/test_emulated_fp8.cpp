// The FP8 kernels of kernels/cuda (quantize, scale, amax-history update), executed on the CPU through the emulated
// host build of the same sources, compared bit for bit with ampkit's CPU kernels (through the dispatcher) on seeded
// random inputs with Inf, NaN, subnormals and saturating values. Built and run as test_emulated.cpp is.

#include "support/catch_torch.h"

#include <cmath>
#include <vector>

#include "ampkit/ops.h"
#include "kernels/cuda/fp8_launch.h"
#include "support/emulated_helpers.h"

using namespace ampkit::test::emulated;

namespace {

at::Tensor fp8_input(int64_t rows, int64_t cols, at::ScalarType dtype, int64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({rows * cols}) * torch::exp2(torch::randint(-24, 24, {rows * cols}).to(at::kFloat));
  const std::vector<float> specials{0.f, -0.f, kInf, -kInf, kNaN, 1e-40f, 460.f, -61440.f, 1e30f};
  for (size_t i = 0; i < specials.size() && static_cast<int64_t>(i) < x.numel(); ++i) {
    x[static_cast<int64_t>(i) * 7 % x.numel()] = specials[i];
  }
  return x.reshape({rows, cols}).to(dtype);
}

kern::Fp8Format format_of(at::ScalarType t) {
  return t == at::ScalarType::Float8_e5m2 ? kern::Fp8Format::kE5M2 : kern::Fp8Format::kE4M3;
}

}  // namespace

TEST_CASE("emulated fp8_quantize: q, q_t and amax match the CPU kernel bit for bit", "[emulated][cross_block]") {
  const int64_t rows = GENERATE(1, 3, 64, 257);
  const int64_t cols = GENERATE(1, 16, 33);
  for (const auto xdtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto fp8 : {at::ScalarType::Float8_e4m3fn, at::ScalarType::Float8_e5m2}) {
      for (const bool rowwise : {false, true}) {
        INFO(xdtype << " -> " << fp8 << ", " << rows << " x " << cols << (rowwise ? ", rowwise" : ""));
        const auto x = fp8_input(rows, cols, xdtype, rows * 100 + cols);
        const auto scale = rowwise ? torch::rand({rows, 1}) * 300.f : scalar_f32(0.37f);
        const auto [q, amax, q_t] = ampkit::fp8_quantize(x, scale, fp8, true);
        // With the transposed copy (the tiled path, NOTE [FP8 quantize kernel]) and without it.
        for (const bool transpose : {true, false}) {
          INFO((transpose ? "with" : "without") << " the transposed copy");
          auto q_emu = at::full({rows, cols}, 0x55, at::kByte);
          auto q_t_emu = at::full({cols, rows}, 0x55, at::kByte);
          float amax_emu = 0.f;
          const kern::Fp8QuantizeParams p{x.data_ptr(),
                                          dtype_of(xdtype),
                                          rows,
                                          cols,
                                          scale.data_ptr<float>(),
                                          rowwise,
                                          q_emu.data_ptr<uint8_t>(),
                                          transpose ? q_t_emu.data_ptr<uint8_t>() : nullptr,
                                          &amax_emu,
                                          format_of(fp8)};
          REQUIRE(kern::launch_fp8_quantize(p, nullptr).ok());
          REQUIRE(torch::equal(q_emu, q.view(at::kByte)));
          if (transpose) {
            REQUIRE(torch::equal(q_t_emu, q_t->view(at::kByte)));
          } else {
            REQUIRE(torch::equal(q_t_emu, at::full({cols, rows}, 0x55, at::kByte)));  // untouched
          }
          REQUIRE(bits_equal(scalar_f32(amax_emu), amax.reshape({1})));
        }
      }
    }
  }
}

#if !defined(AMPKIT_MTA_CHUNK_SIZE)  // (4096 blocks: once, in the build with the real chunk size; about 15 s)
TEST_CASE("emulated fp8_quantize: more 32 x 32 tiles than blocks, each block walking several", "[emulated]") {
  // 4101 tiles (one column of them) against a grid of at most 4096 blocks; the last tile row and the tile column
  // partial.
  const int64_t rows = 32 * 4100 + 5;
  const int64_t cols = 8;
  const auto x = fp8_input(rows, cols, at::kBFloat16, 4101);
  const auto scale = scalar_f32(2.5f);
  const auto [q, amax, q_t] = ampkit::fp8_quantize(x, scale, at::ScalarType::Float8_e4m3fn, true);
  auto q_emu = at::full({rows, cols}, 0x55, at::kByte);
  auto q_t_emu = at::full({cols, rows}, 0x55, at::kByte);
  float amax_emu = 0.f;
  const kern::Fp8QuantizeParams p{x.data_ptr(),
                                  kern::DType::kBFloat16,
                                  rows,
                                  cols,
                                  scale.data_ptr<float>(),
                                  false,
                                  q_emu.data_ptr<uint8_t>(),
                                  q_t_emu.data_ptr<uint8_t>(),
                                  &amax_emu,
                                  kern::Fp8Format::kE4M3};
  REQUIRE(kern::launch_fp8_quantize(p, nullptr).ok());
  REQUIRE(torch::equal(q_emu, q.view(at::kByte)));
  REQUIRE(torch::equal(q_t_emu, q_t->view(at::kByte)));
  REQUIRE(bits_equal(scalar_f32(amax_emu), amax.reshape({1})));
}
#endif

TEST_CASE("emulated fp8_compute_scale matches the CPU kernel on edge amaxes", "[emulated]") {
  const auto amax = torch::tensor({0.f, -0.f, kInf, kNaN, 1e-45f, 1e-40f, 1e-12f, 1.f, 448.f, 3.4e38f});
  for (const double margin : {0.0, 2.0}) {
    for (const double epsilon : {0.0, 1e-12}) {
      for (const bool power_of_2 : {false, true}) {
        const auto cpu = ampkit::fp8_compute_scale(amax, 448.0, margin, epsilon, power_of_2);
        auto emu = at::full_like(amax, kNaN);
        const kern::Fp8ScaleOp op{448.f, static_cast<float>(std::exp2(margin)), static_cast<float>(epsilon),
                                  power_of_2};
        REQUIRE(kern::launch_fp8_compute_scale(amax.data_ptr<float>(), emu.data_ptr<float>(), amax.numel(), op, nullptr)
                    .ok());
        REQUIRE(bits_equal(emu, cpu));
      }
    }
  }
}

TEST_CASE("emulated fp8 history update matches the CPU kernel, over several launches", "[emulated]") {
  torch::manual_seed(5);
  using Args = kern::cuda::MultiTensorArgsFor<2, kern::Fp8HistoryOp>;
  const int64_t rows = GENERATE(1, 4, 33);
  for (const bool most_recent : {false, true}) {
    std::vector<at::Tensor> histories;
    std::vector<at::Tensor> scales;
    for (int i = 0; i < Args::kMaxTensors + 5; ++i) {
      const int64_t cols = 1 + (i * 7) % 5 + (i == 3 ? kChunk + 3 : 0);
      auto h = torch::rand({rows, cols}) * 1000.f;
      if (i % 11 == 0) {
        h[0][0] = kNaN;
      } else if (i % 13 == 0) {
        h[rows - 1][cols - 1] = kInf;
      } else if (i % 17 == 0) {
        h[0][0] = 0.f;
      } else if (i % 19 == 0) {
        h[0][0] = 1e-45f;
      }
      histories.push_back(h);
      scales.push_back(torch::rand({cols}) + 0.5f);
    }
    auto h_emu = clones(histories);
    auto s_emu = clones(scales);
    ampkit::fp8_update_amax_history_and_scale_(histories, scales, most_recent ? "most_recent" : "max", {57344.0}, 1.0);
    std::vector<kern::TensorRef> s_refs;
    std::vector<kern::TensorRef> h_refs;
    for (size_t i = 0; i < h_emu.size(); ++i) {
      s_refs.push_back({s_emu[i].data_ptr(), s_emu[i].numel(), kern::DType::kFloat32});
      h_refs.push_back({h_emu[i].data_ptr(), s_emu[i].numel(), kern::DType::kFloat32});
    }
    const kern::Fp8HistoryOp op{kern::Fp8ScaleOp{57344.f, 2.f, 0.f, false}, rows, most_recent};
    const auto status =
        kern::launch_fp8_update_history(s_refs.data(), h_refs.data(), static_cast<int64_t>(s_refs.size()), op, nullptr);
    REQUIRE(status.ok());
    REQUIRE(status.launches >= 2);
    for (size_t i = 0; i < h_emu.size(); ++i) {
      INFO("pair " << i << (most_recent ? ", most_recent" : ", max") << ", rows " << rows);
      REQUIRE(bits_equal(h_emu[i], histories[i]));
      REQUIRE(bits_equal(s_emu[i], scales[i]));
    }
  }
}
