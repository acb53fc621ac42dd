// LAMB and the global grad norm of kernels/cuda (lamb_kernels.cu), run on the CPU through the emulated host build
// of the same sources and through the CUDA op's own host glue (csrc/ops/optim_cuda_launch.h), compared with the
// CPU op: bit for bit with the real chunk size (the CPU sums the norms in the CUDA chunks, NOTE [Deterministic
// norm]), up to the order of the norms' sums with small chunks. Built and run as test_emulated.cpp is.

#include "support/catch_torch.h"

#include <cmath>
#include <optional>
#include <vector>

#include "support/emulated_optim_helpers.h"

using namespace ampkit::test::emulated;

namespace {

// LAMB through the CPU op and the emulated CUDA op on copies of `cpu`; the grad norm (when clipping) is the CPU
// op's, given to both. Returns the emulated CUDA op's traffic.
emu::Traffic run_lamb_both(std::vector<ParamState>& cpu, std::vector<ParamState>& emu_state, const kern::LambParams& hp,
                           const Scalars& sc) {
  std::optional<at::Tensor> norm;
  if (hp.max_grad_norm > 0) {
    norm = ampkit::grad_norm(list_of(cpu, &ParamState::grad), sc.t(sc.use_scale, sc.grad_scale));
  }
  auto run = [&](auto fn, const std::vector<ParamState>& s) {
    fn(list_of(s, &ParamState::param), list_of(s, &ParamState::grad), list_of(s, &ParamState::master),
       list_of(s, &ParamState::remainder), list_of(s, &ParamState::exp_avg), list_of(s, &ParamState::exp_avg_sq),
       list_of(s, &ParamState::step), hp.lr, hp.beta1, hp.beta2, hp.weight_decay, hp.eps, hp.bias_correction,
       hp.adam_w_mode, hp.grad_averaging, hp.use_nvlamb, hp.max_grad_norm, norm, sc.t(sc.use_scale, sc.grad_scale),
       sc.t(sc.use_found, sc.found_inf), sc.t(sc.use_lr, sc.lr));
  };
  run(&ampkit::lamb_step_, cpu);
  emu::reset_traffic();
  run(&ampkit::detail::lamb_step_kernel<lamb_step_emulated>, emu_state);
  return emu::reset_traffic();
}

// Same moments and steps; weights bit for bit with the real chunk size (the CPU sums norms in its chunks), else
// equal up to the order of the norms' sums.
void require_same_lamb_state(const std::vector<ParamState>& cpu, const std::vector<ParamState>& emu_state) {
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  for (size_t i = 0; i < cpu.size(); ++i) {
    INFO("param " << i << ", numel " << cpu[i].param.numel());
    REQUIRE(bits_equal(cpu[i].exp_avg, emu_state[i].exp_avg));
    REQUIRE(bits_equal(cpu[i].exp_avg_sq, emu_state[i].exp_avg_sq));
    REQUIRE(bits_equal(cpu[i].step, emu_state[i].step));
    const at::Tensor& w_cpu = cpu[i].master.defined() ? cpu[i].master : cpu[i].param;
    const at::Tensor& w_emu = emu_state[i].master.defined() ? emu_state[i].master : emu_state[i].param;
    REQUIRE(at::allclose(w_cpu.to(at::kFloat), w_emu.to(at::kFloat), 1e-5, 1e-6));
  }
#else
  require_same_state(cpu, emu_state);
#endif
}

}  // namespace

TEST_CASE("emulated lamb step: every master mode and option, clipping, skip, scale and device lr match the CPU",
          "[emulated]") {
  torch::manual_seed(15);
  const std::vector<int64_t> sizes = {1, 7, 8, 9, 33, kChunk - 1, kChunk + 5, 0, kernels_norm_chunk() + 9};
  struct Config {
    double weight_decay;
    bool adam_w_mode, grad_averaging, use_nvlamb, bias_correction;
    double max_grad_norm;
  };
  for (const Config c : {Config{0.01, true, true, false, true, 1.0}, Config{0.01, false, false, false, true, 0.0},
                         Config{0.0, true, true, true, false, 0.5}, Config{0.0, true, true, false, true, 0.0}}) {
    for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (const Master master :
           {Master::kNone, Master::kFp32, Master::kRemainder, Master::kKahan, Master::kStochastic}) {
        const bool bf16_only =
            master == Master::kRemainder || master == Master::kKahan || master == Master::kStochastic;
        if ((bf16_only && dtype != at::kBFloat16) || (master != Master::kNone && dtype == at::kFloat)) {
          continue;
        }
        const int64_t offset = dtype == at::kHalf ? 1 : 0;
        INFO("wd " << c.weight_decay << ", adam_w " << c.adam_w_mode << ", nvlamb " << c.use_nvlamb << ", clip "
                   << c.max_grad_norm << ", dtype " << dtype << ", master " << static_cast<int>(master));
        auto cpu = make_params(sizes, dtype, master, true, false, false, offset);
        std::vector<ParamState> emu_state = clones(cpu);
        const kern::LambParams hp{1e-2,          0.9,
                                  0.999,         c.weight_decay,
                                  1e-6,          c.bias_correction,
                                  c.adam_w_mode, c.grad_averaging,
                                  c.use_nvlamb,  c.max_grad_norm};
        const Scalars sc{256.f, 0.f, 3e-3f, true, true, offset == 1};
        for (int step = 0; step < 2; ++step) {
          run_lamb_both(cpu, emu_state, hp, sc);
          require_same_lamb_state(cpu, emu_state);
        }
      }
    }
  }
}

TEST_CASE("emulated lamb step: FP32 grads of FP16/BF16 params match the CPU in every weight mode", "[emulated]") {
  // NOTE [FP32 grads of low-precision params], with clipping (the norm pass reads the FP32 grads too).
  torch::manual_seed(19);
  const std::vector<int64_t> sizes = {1, 9, 33, kChunk + 5, 0};
  const kern::LambParams hp{1e-2, 0.9, 0.999, 0.01, 1e-6, true, true, true, false, 0.5};
  for (const auto& [dtype, master] :
       {std::pair(at::kHalf, Master::kFp32), std::pair(at::kBFloat16, Master::kNone),
        std::pair(at::kBFloat16, Master::kRemainder), std::pair(at::kBFloat16, Master::kKahan),
        std::pair(at::kBFloat16, Master::kStochastic)}) {
    for (const int64_t offset : {0, 1}) {
      INFO("dtype " << dtype << ", master " << static_cast<int>(master) << ", offset " << offset);
      auto cpu = make_params(sizes, dtype, master, true, false, false, offset);
      for (auto& s : cpu) {
        s.grad = at_offset(random_grad(s.param.numel(), at::kFloat, 100.0), offset);
      }
      const std::vector<ParamState> initial = clones(cpu);
      std::vector<ParamState> emu_state = clones(cpu);
      const Scalars sc{256.f, 0.f, 3e-3f, true, true, offset == 1};
      for (int step = 0; step < 2; ++step) {
        run_lamb_both(cpu, emu_state, hp, sc);
        require_same_lamb_state(cpu, emu_state);
      }
      REQUIRE_FALSE(bits_equal(emu_state[3].param, initial[3].param));
    }
  }
}

TEST_CASE("emulated lamb step: found_inf skips every write, and the traffic is the design's", "[emulated]") {
  torch::manual_seed(16);
  const kern::LambParams hp{1e-3, 0.9, 0.999, 0.01, 1e-6, true, true, true, false, 0.0};
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const int64_t n = 2 * kChunk + 16;
    auto cpu = make_params({n}, dtype, Master::kFp32, true, false, false, 0);
    std::vector<ParamState> emu_state = clones(cpu);
    Scalars sc{1024.f, 1.f, 0.f, true, true, false};
    const std::vector<ParamState> before{emu_state[0].clone()};
    CHECK(run_lamb_both(cpu, emu_state, hp, sc).written == 0);
    require_same_state(emu_state, before);
    require_same_state(cpu, before);
    sc.found_inf = 0.f;
    const emu::Traffic t = run_lamb_both(cpu, emu_state, hp, sc);
    // NOTE [LAMB passes]: 22 bytes in the moments pass, 18 in the apply pass, plus 2 x 512 lane sums per chunk.
    const int64_t chunks = kern::norm_chunks(n);
    CHECK(t.read + t.written == static_cast<uint64_t>(40 * n + chunks * 2 * kern::kNormLanes * 8));
    require_same_lamb_state(cpu, emu_state);
  }
}

TEST_CASE("emulated lamb step: more tensors than one norm launch takes, and tensors of many chunks",
          "[emulated][cross_block]") {
  // The tensors' norms are summed once per tensor (kernels/cuda/lamb_kernels.cu, tensor_norms_kernel), in
  // launches of a bounded list: a list beyond one launch, zero-size tensors between, a tensor of many chunks.
  torch::manual_seed(18);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 2100; ++i) {
    sizes.push_back(i % 97 == 5 ? 0 : 1 + (i * 37) % 90);
  }
  sizes.push_back(5 * kernels_norm_chunk() + 3);
  sizes.push_back(7 * kChunk + 1);
  auto cpu = make_params(sizes, at::kBFloat16, Master::kFp32, true, false, false, 0);
  std::vector<ParamState> emu_state = clones(cpu);
  const kern::LambParams hp{1e-2, 0.9, 0.999, 0.01, 1e-6, true, true, true, false, 1.0};
  const Scalars sc{128.f, 0.f, 0.f, true, true, false};
  for (int step = 0; step < 2; ++step) {
    run_lamb_both(cpu, emu_state, hp, sc);
    require_same_lamb_state(cpu, emu_state);
  }
}

TEST_CASE("emulated grad_norm: matches the CPU op (bit for bit with the real chunk size)", "[emulated][cross_block]") {
  torch::manual_seed(17);
  std::vector<at::Tensor> grads{random_grad(kChunk + 5, at::kHalf, 1e3), random_grad(9, at::kFloat, 1e-20),
                                at::empty({0}, at::kBFloat16), random_grad(3 * kChunk + 1, at::kBFloat16, 1.0),
                                random_grad(kernels_norm_chunk() + 3, at::kFloat, 1e-3)};
  for (const float scale : {1.f, 65536.f, 0.25f}) {
    INFO("scale " << scale);
    const float on_cpu = ampkit::grad_norm(grads, scalar_f32(scale)).item<float>();
    double reference = 0.0;
    for (const auto& g : grads) {
      reference += g.to(at::kDouble).pow(2).sum().item<double>();
    }
    REQUIRE(std::abs(on_cpu - std::sqrt(reference) / scale) <= 1e-6 * std::sqrt(reference) / scale);
    const auto refs = refs_of(grads);
    int64_t rows = 0;
    for (const auto& r : refs) {
      rows += kern::norm_chunks(r.numel);
    }
    std::vector<double> lanes(static_cast<size_t>(rows) * kern::kNormLanes, kNaN);
    std::vector<double> sums(static_cast<size_t>(rows), kNaN);
    float on_emu = kNaN;
    REQUIRE(kern::launch_grad_norm(refs.data(), static_cast<int64_t>(refs.size()), &scale, &on_emu, lanes.data(),
                                   sums.data(), nullptr)
                .ok());
#if defined(AMPKIT_MTA_CHUNK_SIZE)
    REQUIRE(std::abs(on_emu - on_cpu) <= 1e-6f * on_cpu);
#else
    REQUIRE(kern::bit_cast<uint32_t>(on_emu) == kern::bit_cast<uint32_t>(on_cpu));
#endif
  }
}
TEST_CASE("emulated grad_norm: more chunks than finish lanes, summed in the finish-lane order", "[emulated]") {
  // 700 one-element tensors: 700 chunk sums (three finish-lane rounds), each x^2 exactly (a float's square is exact
  // in double), so the order of NOTE [Deterministic norm] can be written out here. The float result hides most
  // differences of order; the case holds the CPU op, the CUDA kernels and the written-out order to one answer.
  constexpr int kTensors = 700;
  std::vector<at::Tensor> grads;
  std::vector<double> squares;
  for (int i = 0; i < kTensors; ++i) {
    const float x = std::ldexp(1.f + static_cast<float>(i % 97) / 97.f, i / 20 - 17);
    grads.push_back(at::full({1}, x, at::kFloat));
    squares.push_back(static_cast<double>(x) * static_cast<double>(x));
  }
  std::vector<double> finish(kern::kNormFinishLanes, 0.0);
  for (size_t r = 0; r < squares.size(); ++r) {
    finish[r % kern::kNormFinishLanes] += squares[r];
  }
  double total = 0.0;
  for (const double s : finish) {
    total += s;
  }
  const float scale = 4.f;
  const float expect = static_cast<float>(std::sqrt(total) / 4.0);
  const float on_cpu = ampkit::grad_norm(grads, scalar_f32(scale)).item<float>();
  REQUIRE(kern::bit_cast<uint32_t>(on_cpu) == kern::bit_cast<uint32_t>(expect));
  const auto refs = refs_of(grads);
  std::vector<double> lanes(static_cast<size_t>(kTensors) * kern::kNormLanes, kNaN);
  std::vector<double> sums(static_cast<size_t>(kTensors), kNaN);
  float on_emu = kNaN;
  REQUIRE(kern::launch_grad_norm(refs.data(), kTensors, &scale, &on_emu, lanes.data(), sums.data(), nullptr).ok());
  REQUIRE(kern::bit_cast<uint32_t>(on_emu) == kern::bit_cast<uint32_t>(expect));
}
