// The scale update kernel of kernels/cuda (update_scale_, update_scale_hysteresis_), executed on the CPU through
// the emulated host build of the same source, compared bit for bit with ampkit's CPU op over random overflow
// sequences. Built and run as test_emulated.cpp is.

#include "support/catch_torch.h"

#include <cstring>

#include "kernels/cuda/amp_launch.h"
#include "support/emulated_helpers.h"

using namespace ampkit::test::emulated;

TEST_CASE("emulated update_scale: matches the CPU op over random overflow sequences, with and without hysteresis",
          "[emulated]") {
  torch::manual_seed(5);
  struct Config {
    int64_t hysteresis;
    double min_scale;
    double max_scale;
    bool dynamic;
    bool plain;  // update_scale_ (no tracker, no stats)
  };
  for (const Config c : {Config{1, 0.0, 3.4e38, true, true}, Config{1, 0.0, 3.4e38, true, false},
                         Config{3, 4.0, 1e6, true, false}, Config{2, 1.0, 512.0, false, false}}) {
    auto scale = scalar_f32(65536.f);
    auto tracker = at::zeros({1}, at::kInt);
    auto hyst = at::full({1}, static_cast<int>(c.hysteresis), at::kInt);
    auto stats = at::zeros({4}, at::kLong);
    float e_scale = 65536.f;
    int32_t e_tracker = 0;
    int32_t e_hyst = static_cast<int32_t>(c.hysteresis);
    int64_t e_stats[4] = {0, 0, 0, 0};
    const kern::UpdateScaleOp op =
        c.plain ? kern::UpdateScaleOp{2.0, 0.5, 3} : kern::UpdateScaleOp{2.0,
                                                                         0.5,
                                                                         3,
                                                                         static_cast<int32_t>(c.hysteresis),
                                                                         static_cast<float>(c.min_scale),
                                                                         static_cast<float>(c.max_scale),
                                                                         c.dynamic};
    const auto overflows = at::rand({400}) < 0.3;
    for (int64_t i = 0; i < overflows.numel(); ++i) {
      const float f = overflows[i].item<bool>() ? 1.f : 0.f;
      if (c.plain) {
        ampkit::update_scale_(scale, tracker, scalar_f32(f), 2.0, 0.5, 3);
        REQUIRE(kern::launch_update_scale(&e_scale, &e_tracker, nullptr, nullptr, &f, op, nullptr).ok());
      } else {
        ampkit::update_scale_hysteresis_(scale, tracker, hyst, stats, scalar_f32(f), 2.0, 0.5, 3, c.hysteresis,
                                         c.min_scale, c.max_scale, c.dynamic);
        REQUIRE(kern::launch_update_scale(&e_scale, &e_tracker, &e_hyst, e_stats, &f, op, nullptr).ok());
        REQUIRE(e_hyst == hyst.item<int>());
        for (int k = 0; k < 4; ++k) {
          REQUIRE(e_stats[k] == stats[k].item<int64_t>());
        }
      }
      REQUIRE(std::memcmp(&e_scale, scale.data_ptr<float>(), sizeof(float)) == 0);
      REQUIRE(e_tracker == tracker.item<int>());
    }
  }
}
