// The AMP kernels of kernels/cuda (the optimizer steps: test_emulated_optim.cpp, test_emulated_lamb.cpp), executed
// on the CPU through the emulated host build of the same sources (kernels/cuda/emulation.h), compared bit for bit
// with ampkit's CPU kernels on seeded random inputs, and the emulator itself. Built twice:
// with the real chunk size, and with small chunks (AMPKIT_MTA_CHUNK_SIZE) so that a list split across several
// launches, and a tensor split across launches, are reached with little data. Both builds run under
// AddressSanitizer and UndefinedBehaviorSanitizer.

#include "catch_torch.h"

#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cuda/emulation.h"
#include "kernels/cuda/multi_tensor_apply.cuh"
#include "kernels/cuda/amp_launch.h"
#include "kernels/cuda/optim_launch.h"
#include "emulated_helpers.h"
#include "test_helpers.h"

namespace kern = ampkit::kernels;
namespace emu = ampkit::kernels::emulation;
using ampkit::test::bits_equal;
using ampkit::test::random_grad;
using namespace ampkit::test::emulated;

namespace {

// Runs unscale_and_check_ (or check_finite_ when inv is null) through the CPU op and the emulated CUDA kernel on
// copies of `grads`; requires identical flags and bits. Returns the emulated traffic.
emu::Traffic require_unscale_matches(const std::vector<at::Tensor>& grads, const float* inv) {
  auto on_cpu = clones(grads);
  auto on_emu = clones(grads);
  auto found_cpu = scalar_f32(0.f);
  float found_emu = 0.f;
  if (inv != nullptr) {
    ampkit::unscale_and_check_(on_cpu, found_cpu, scalar_f32(*inv));
  } else {
    ampkit::check_finite_(on_cpu, found_cpu);
  }
  const auto refs = refs_of(on_emu);
  emu::reset_traffic();
  const kern::LaunchStatus status =
      inv != nullptr ? kern::launch_unscale_and_check(refs.data(), static_cast<int64_t>(refs.size()), &found_emu, inv,
                                                      nullptr)
                     : kern::launch_check_finite(refs.data(), static_cast<int64_t>(refs.size()), &found_emu, nullptr);
  const emu::Traffic traffic = emu::reset_traffic();
  REQUIRE(status.ok());
  REQUIRE(found_emu == found_cpu.item<float>());
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("tensor " << i << " of " << grads.size() << ", " << grads[i].scalar_type() << ", numel "
                   << grads[i].numel());
    REQUIRE(bits_equal(on_emu[i], on_cpu[i]));
    if (inv == nullptr) {
      REQUIRE(bits_equal(on_emu[i], grads[i]));
    }
  }
  return traffic;
}

}  // namespace

TEST_CASE("emulated unscale_and_check / check_finite: every dtype, size, scale and alignment matches the CPU",
          "[emulated]") {
  torch::manual_seed(1);
  const int64_t n = GENERATE(1, 7, 8, 9, 15, 16, 17, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 5);
  const float inv = GENERATE(1.f / 65536.f, 1.f, 3.f);
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble}) {
    for (const int64_t offset : {0, 1, 3}) {
      INFO("dtype " << dtype << ", n " << n << ", offset " << offset << ", inv " << inv);
      const auto g = at_offset(random_grad(n, dtype, 1000.0), offset);
      require_unscale_matches({g}, &inv);
      require_unscale_matches({g}, nullptr);
    }
  }
}

TEST_CASE("emulated unscale_and_check: Inf and NaN anywhere, mixed dtypes in one launch", "[emulated][cross_block]") {
  torch::manual_seed(2);
  const float inv = 0.25f;
  auto make_list = [] {
    return std::vector<at::Tensor>{random_grad(kChunk + 3, at::kHalf, 10.0), random_grad(100, at::kFloat, 10.0),
                                   at::empty({0}, at::kHalf), random_grad(2 * kChunk + 9, at::kBFloat16, 10.0),
                                   at_offset(random_grad(3 * kChunk + 1, at::kDouble, 10.0), 1)};
  };
  SECTION("all finite") {
    require_unscale_matches(make_list(), &inv);
  }
  for (const float bad : {kInf, -kInf, kNaN}) {
    for (const int where : {0, 1, 2}) {  // first element of the first tensor, middle, last of the last chunk
      auto list = make_list();
      at::Tensor target = where == 0 ? list[0] : (where == 1 ? list[3] : list.back());
      const int64_t index = where == 0 ? 0 : (where == 1 ? target.numel() / 2 : target.numel() - 1);
      target[index] = bad;
      INFO("bad value " << bad << " at tensor position " << where);
      require_unscale_matches(list, &inv);
      require_unscale_matches(list, nullptr);
    }
  }
  SECTION("FP16 max overflows after scaling up, -0.0 and subnormals stay exact") {
    auto g = random_grad(1000, at::kHalf, 1.0);
    g[0] = 65504.f;
    g[1] = -0.f;
    g[2] = 5.96e-8f;
    const float up = 2.f;
    require_unscale_matches({g}, &up);
  }
}

TEST_CASE("emulated unscale_and_check: lists that need several launches", "[emulated][cross_block]") {
  torch::manual_seed(3);
  using Args = kern::cuda::MultiTensorArgs<1>;  // the largest table any functor leaves room for
  const float inv = 0.5f;
  SECTION("more tensors than one chunk table holds") {
    std::vector<at::Tensor> many;
    for (int i = 0; i < Args::kMaxTensors + 77; ++i) {
      many.push_back(random_grad(1 + (i * 37) % 300, i % 2 ? at::kHalf : at::kBFloat16, 10.0));
    }
    many.back()[-1] = kInf;
    const emu::Traffic t = require_unscale_matches(many, &inv);
    CHECK(t.launches >= 2);
  }
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  // Only the small-chunk build: with the real chunk size this list would be 175 M elements.
  SECTION("more chunks than one launch takes: a tensor continues in the next launch") {
    const int64_t n = (Args::kMaxBlocks + 3) * kChunk + 11;
    auto g = random_grad(n, at::kHalf, 10.0);
    g[-1] = kNaN;
    const emu::Traffic t = require_unscale_matches({random_grad(5, at::kFloat, 1.0), g}, &inv);
    CHECK(t.launches == 2);
  }
#endif
}

TEST_CASE("emulated unscale_and_check: bytes moved per element are the design's minimum", "[emulated]") {
  torch::manual_seed(4);
  const int64_t n = 4 * kChunk;
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
    const auto g = random_grad(n, dtype, 1.0);
    const float inv = 0.5f;
    const int64_t size = c10::elementSize(dtype);
    const emu::Traffic rw = require_unscale_matches({g}, &inv);
    CHECK(rw.read == static_cast<uint64_t>(n * size));
    CHECK(rw.written == static_cast<uint64_t>(n * size));
    const emu::Traffic ro = require_unscale_matches({g}, nullptr);
    CHECK(ro.read == static_cast<uint64_t>(n * size));
    CHECK(ro.written == 0);
  }
}

namespace {

// Runs cast_divide_ (inv null) or cast_unscale_and_check_ through the CPU op and the emulated CUDA kernel on the
// same sources into NaN-poisoned outputs; requires identical outputs and flags. Returns the emulated traffic.
emu::Traffic require_cast_matches(const std::vector<at::Tensor>& src, const std::vector<at::ScalarType>& out_dtypes,
                                  float divisor, const float* inv) {
  std::vector<at::Tensor> on_cpu;
  std::vector<at::Tensor> on_emu;
  for (size_t i = 0; i < src.size(); ++i) {
    on_cpu.push_back(at::full(src[i].sizes(), kNaN, at::TensorOptions().dtype(out_dtypes[i])));
    on_emu.push_back(on_cpu.back().clone());
  }
  auto found_cpu = scalar_f32(0.f);
  float found_emu = 0.f;
  if (inv != nullptr) {
    ampkit::cast_unscale_and_check_(src, on_cpu, found_cpu, scalar_f32(*inv));
  } else {
    ampkit::cast_divide_(src, on_cpu, divisor);
  }
  const auto src_refs = refs_of(src);
  const auto out_refs = refs_of(on_emu);
  emu::reset_traffic();
  const kern::LaunchStatus status = kern::launch_cast(src_refs.data(), out_refs.data(),
                                                      static_cast<int64_t>(src.size()), divisor, inv,
                                                      inv != nullptr ? &found_emu : nullptr, nullptr);
  const emu::Traffic traffic = emu::reset_traffic();
  REQUIRE(status.ok());
  REQUIRE(found_emu == found_cpu.item<float>());
  for (size_t i = 0; i < src.size(); ++i) {
    INFO("pair " << i << " of " << src.size() << ", " << src[i].scalar_type() << " -> " << out_dtypes[i]
                 << ", numel " << src[i].numel());
    REQUIRE(bits_equal(on_emu[i], on_cpu[i]));
  }
  return traffic;
}

}  // namespace

TEST_CASE("emulated cast passes: every dtype pair, size, factor and alignment matches the CPU", "[emulated]") {
  torch::manual_seed(11);
  const int64_t n = GENERATE(1, 7, 8, 9, 17, kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 5);
  const float factor = GENERATE(1.f, 2.f, 3.f, 1.f / 65536.f);
  const std::vector<at::ScalarType> wire{at::kHalf, at::kBFloat16, at::kFloat};
  for (const auto sd : wire) {
    for (const auto od : wire) {
      for (const int64_t offset : {0, 1, 3}) {
        INFO(sd << " -> " << od << ", n " << n << ", offset " << offset << ", factor " << factor);
        auto s = at_offset(random_grad(n, sd, 1000.0), offset);
        s[-1] = 70000.f;  // overflows FP16 on the way
        require_cast_matches({s}, {od}, factor, nullptr);
        require_cast_matches({s}, {od}, 1.f, &factor);
      }
    }
  }
}

TEST_CASE("emulated cast passes: Inf/NaN in the last element of the last chunk, mixed lists over several launches",
          "[emulated][cross_block]") {
  torch::manual_seed(12);
  using Args = kern::cuda::MultiTensorArgs<2>;
  std::vector<at::Tensor> src;
  std::vector<at::ScalarType> out_dtypes;
  for (int i = 0; i < Args::kMaxTensors + 13; ++i) {
    src.push_back(random_grad(1 + (i * 53) % 400, i % 3 == 0 ? at::kFloat : at::kHalf, 10.0));
    out_dtypes.push_back(i % 2 ? at::kBFloat16 : at::kFloat);
  }
  src.push_back(random_grad(3 * kChunk + 7, at::kFloat, 10.0));
  out_dtypes.push_back(at::kHalf);
  const float inv = 0.5f;
  CHECK(require_cast_matches(src, out_dtypes, 4.f, nullptr).launches >= 2);
  for (const float bad : {kInf, -kInf, kNaN}) {
    src.back()[-1] = bad;
    require_cast_matches(src, out_dtypes, 1.f, &inv);
  }
}

TEST_CASE("emulated cast passes: each element is read once and written once", "[emulated]") {
  torch::manual_seed(13);
  const int64_t n = 4 * kChunk;
  const float inv = 0.5f;
  const auto s = random_grad(n, at::kFloat, 1.0);
  const emu::Traffic down = require_cast_matches({s}, {at::kHalf}, 2.f, nullptr);
  CHECK(down.read == static_cast<uint64_t>(n * 4));
  CHECK(down.written == static_cast<uint64_t>(n * 2));
  const auto h = random_grad(n, at::kHalf, 1.0);
  const emu::Traffic up = require_cast_matches({h}, {at::kFloat}, 1.f, &inv);
  CHECK(up.read == static_cast<uint64_t>(n * 2));
  CHECK(up.written == static_cast<uint64_t>(n * 4));
}

TEST_CASE("emulated grad_stats: every column matches the CPU op (the norm bit for bit with the real chunk size)",
          "[emulated][cross_block]") {
  torch::manual_seed(14);
  std::vector<at::Tensor> grads{random_grad(kChunk + 5, at::kHalf, 1e3), random_grad(9, at::kFloat, 1e-30),
                                at::empty({0}, at::kBFloat16), at_offset(random_grad(3 * kChunk + 1, at::kBFloat16, 1.0), 1),
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
    const kern::UpdateScaleOp op = c.plain ? kern::UpdateScaleOp{2.0, 0.5, 3}
                                           : kern::UpdateScaleOp{2.0, 0.5, 3, static_cast<int32_t>(c.hysteresis),
                                                                 static_cast<float>(c.min_scale),
                                                                 static_cast<float>(c.max_scale), c.dynamic};
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

namespace {
__global__ void count_threads_kernel(int* counter, int* last_x) {
  *counter += 1;
  *last_x = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
}
}  // namespace

TEST_CASE("emulator: runs every thread of every block, refuses what the driver refuses", "[emulated]") {
  int counter = 0;
  int last = -1;
  emu::reset_traffic();
  REQUIRE(kern::cuda::launch_kernel(count_threads_kernel, dim3(3, 2), dim3(4, 2), nullptr, &counter, &last) ==
          cudaSuccess);
  CHECK(counter == 3 * 2 * 4 * 2);
  CHECK(last == 2 * 4 + 3);
  CHECK(emu::reset_traffic().launches == 1);
  counter = 0;
  CHECK(kern::cuda::launch_kernel(count_threads_kernel, dim3(0), dim3(32), nullptr, &counter, &last) ==
        cudaErrorInvalidConfiguration);
  CHECK(kern::cuda::launch_kernel(count_threads_kernel, dim3(1), dim3(2048), nullptr, &counter, &last) ==
        cudaErrorInvalidConfiguration);
  CHECK(counter == 0);
  // A list with nothing to do launches nothing and succeeds.
  float found = 0.f;
  const kern::TensorRef none{nullptr, 0, kern::DType::kFloat32};
  const kern::LaunchStatus empty = kern::launch_check_finite(&none, 1, &found, nullptr);
  CHECK(empty.ok());
  CHECK(empty.launches == 0);
}
