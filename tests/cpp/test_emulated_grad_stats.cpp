// The grad_stats kernel of kernels/cuda, executed on the CPU through the emulated host build of the same source,
// compared with ampkit's CPU op column by column: the norm bit for bit with the real chunk size (NOTE
// [Deterministic norm]). Built and run as test_emulated.cpp is.

#include "support/catch_torch.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cuda/amp_launch.h"
#include "support/emulated_helpers.h"

using namespace ampkit::test::emulated;

TEST_CASE("emulated grad_stats: every column matches the CPU op (the norm bit for bit with the real chunk size)",
          "[emulated][cross_block]") {
  torch::manual_seed(14);
  std::vector<at::Tensor> grads{random_grad(kChunk + 5, at::kHalf, 1e3), random_grad(9, at::kFloat, 1e-30),
                                at::empty({0}, at::kBFloat16),
                                at_offset(random_grad(3 * kChunk + 1, at::kBFloat16, 1.0), 1),
                                random_grad(kernels_norm_chunk() + 3, at::kFloat, 1e-3)};
  grads[0][7] = 0.f;
  grads[0][-1] = kInf;
  grads[3][-1] = kNaN;
  grads[3][5] = 0.f;
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  // More chunks than the finish kernel's threads: its chunk sums come in several tiles.
  grads.push_back(random_grad(130 * kChunk + 7, at::kFloat, 1.0));
#endif
  for (const float inv : {1.f, 1.f / 65536.f, 3.f}) {
    INFO("inv " << inv);
    const at::Tensor on_cpu = ampkit::grad_stats(grads, scalar_f32(inv));
    const auto refs = refs_of(grads);
    int64_t rows = 0;
    for (const auto& r : refs) {
      rows += kern::grad_stats_chunks(r.numel);
    }
    std::vector<unsigned long long> counters(grads.size() * kern::kGradStatsCounterColumns, 0);
    std::vector<double> partials(static_cast<size_t>(std::max<int64_t>(rows, 1)) * kern::kNormLanes, -1.0);
    at::Tensor on_emu = at::full({static_cast<int64_t>(grads.size()), kern::kGradStatsColumns}, kNaN, at::kDouble);
    const kern::LaunchStatus status =
        kern::launch_grad_stats(refs.data(), static_cast<int64_t>(refs.size()), &inv, on_emu.data_ptr<double>(),
                                counters.data(), partials.data(), nullptr);
    REQUIRE(status.ok());
    // The norm from the kernel's own lane sums, added in lane and chunk order (NOTE [Deterministic norm]).
    int64_t first_row = 0;
    for (size_t i = 0; i < refs.size(); ++i) {
      const int64_t chunks = kern::grad_stats_chunks(refs[i].numel);
      double total = 0.0;
      for (int64_t c = 0; c < chunks; ++c) {
        double chunk_sum = 0.0;
        for (int l = 0; l < kern::kNormLanes; ++l) {
          chunk_sum += partials[static_cast<size_t>((first_row + c) * kern::kNormLanes + l)];
        }
        total += chunk_sum;
      }
      first_row += chunks;
      CHECK(on_emu[static_cast<int64_t>(i)][kern::kStatNorm].item<double>() ==
            std::sqrt(total) * static_cast<double>(inv));
    }
#if defined(AMPKIT_MTA_CHUNK_SIZE)
    // Small chunks sum the norm in another order (NOTE [Deterministic norm]): equal up to that order.
    REQUIRE(on_emu.narrow(1, 0, 1).equal(on_cpu.narrow(1, 0, 1)));
    REQUIRE(at::allclose(on_emu.narrow(1, 1, 1), on_cpu.narrow(1, 1, 1), 1e-13, 0.0));
    REQUIRE(on_emu.narrow(1, 2, on_emu.size(1) - 2).equal(on_cpu.narrow(1, 2, on_cpu.size(1) - 2)));
#else
    REQUIRE(bits_equal(on_emu, on_cpu));
#endif
  }
}
