// The unscale and finite-check kernels of kernels/cuda and the emulator's launches, executed on the CPU through
// the emulated host build of the same sources (kernels/cuda/emulation.h), compared bit for bit with ampkit's CPU
// kernels on seeded random inputs. The other emulated kernels: test_emulated_cast.cpp, test_emulated_scaler.cpp,
// test_emulated_grad_stats.cpp, test_emulated_optim.cpp, test_emulated_lamb.cpp. Built twice: with the real chunk
// size, and with small chunks (AMPKIT_MTA_CHUNK_SIZE) so that a list split across several launches, and a tensor
// split across launches, are reached with little data. Both builds run under AddressSanitizer and
// UndefinedBehaviorSanitizer.

#include "support/catch_torch.h"

#include <limits>
#include <vector>

#include "kernels/cuda/emulation.h"
#include "kernels/cuda/multi_tensor_apply.cuh"
#include "kernels/cuda/amp_launch.h"
#include "kernels/cuda/optim_launch.h"
#include "support/emulated_helpers.h"
#include "support/test_helpers.h"

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
      inv != nullptr
          ? kern::launch_unscale_and_check(refs.data(), static_cast<int64_t>(refs.size()), &found_emu, inv, nullptr)
          : kern::launch_check_finite(refs.data(), static_cast<int64_t>(refs.size()), &found_emu, nullptr);
  const emu::Traffic traffic = emu::reset_traffic();
  REQUIRE(status.ok());
  REQUIRE(found_emu == found_cpu.item<float>());
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("tensor " << i << " of " << grads.size() << ", " << grads[i].scalar_type() << ", numel " << grads[i].numel());
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
  SECTION("all finite") { require_unscale_matches(make_list(), &inv); }
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
