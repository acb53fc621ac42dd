// The cast passes of kernels/cuda (cast_divide_, cast_unscale_and_check_), executed on the CPU through the
// emulated host build of the same sources, compared bit for bit with ampkit's CPU kernels on seeded random inputs,
// and the bytes they move. Built and run as test_emulated.cpp is.

#include "support/catch_torch.h"

#include <vector>

#include "kernels/cuda/amp_launch.h"
#include "kernels/cuda/multi_tensor_apply.cuh"
#include "support/emulated_helpers.h"

using namespace ampkit::test::emulated;

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
  const kern::LaunchStatus status =
      kern::launch_cast(src_refs.data(), out_refs.data(), static_cast<int64_t>(src.size()), divisor, inv,
                        inv != nullptr ? &found_emu : nullptr, nullptr);
  const emu::Traffic traffic = emu::reset_traffic();
  REQUIRE(status.ok());
  REQUIRE(found_emu == found_cpu.item<float>());
  for (size_t i = 0; i < src.size(); ++i) {
    INFO("pair " << i << " of " << src.size() << ", " << src[i].scalar_type() << " -> " << out_dtypes[i] << ", numel "
                 << src[i].numel());
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
