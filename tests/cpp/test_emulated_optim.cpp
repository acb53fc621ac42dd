// The fused Adam/AdamW and SGD steps of kernels/cuda, run on the CPU through the emulated host build of the same
// sources and through the CUDA op's own host glue (csrc/ops/optim_cuda_launch.h: the tail width and parameters
// the GPU gets), compared with the CPU op as NOTE [torch's scalar tail] states: bit for bit with the CPU op on
// copies padded to a multiple of its tail width, and bit for bit with the CPU op itself but in the last
// numel % tail_width elements of each tensor, which are within a stated tolerance. Built and run as
// test_emulated.cpp is (two chunk sizes, sanitizers).

#include "support/catch_torch.h"

#include <vector>

#include "support/emulated_optim_helpers.h"

using namespace ampkit::test::emulated;

TEST_CASE("emulated adam step: AdamW/Adam, every master mode, skip, grad scale and device lr match the CPU",
          "[emulated]") {
  torch::manual_seed(6);
  const std::vector<int64_t> sizes = {1, 3, 4, 7, 8, 9, 33, kChunk - 1, kChunk + 5, 0};
  int64_t tail_differences = 0;
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
      if ((master == Master::kRemainder && dtype != at::kBFloat16) ||
          (master != Master::kNone && dtype == at::kFloat)) {
        continue;
      }
      for (const bool decoupled : {true, false}) {
        for (const bool amsgrad : {false, true}) {
          for (const int64_t offset : {0, 1}) {
            const bool maximize = amsgrad && decoupled;
            const Scalars sc{1024.f, 0.f, 2e-3f, true, true, offset == 1};
            INFO("dtype " << dtype << ", master " << static_cast<int>(master) << ", decoupled " << decoupled
                          << ", amsgrad " << amsgrad << ", offset " << offset);
            StepRuns runs(make_params(sizes, dtype, master, true, amsgrad, false, offset));
            const kern::AdamParams hp{1e-3, 0.9, 0.999, 0.01, 1e-8, amsgrad, maximize, decoupled};
            for (int step = 0; step < 3; ++step) {
              runs.adam(hp, sc);
            }
            tail_differences += runs.tail_differences;
          }
        }
      }
    }
  }
  // The scalar tail's formula rounds differently: the padded reference is what the CUDA op must equal.
  CHECK(tail_differences > 0);
}

TEST_CASE("emulated optimizer steps: one misaligned stream goes element-wise, the others stay vectorized, and "
          "all match the CPU",
          "[emulated]") {
  // NOTE [Optimizer chunk loop]: alignment is decided per stream. Each case moves one stream 1 element off its
  // 16-byte boundary (a copy of the same values) and compares AdamW (amsgrad) and SGD with momentum to the CPU.
  torch::manual_seed(11);
  const std::vector<int64_t> sizes = {3, 9, 4 * 512 * 2 + 7, kChunk + 6};
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
      if ((master == Master::kRemainder && dtype != at::kBFloat16) ||
          (master != Master::kNone && dtype == at::kFloat)) {
        continue;
      }
      for (auto field : {&ParamState::param, &ParamState::grad, &ParamState::master, &ParamState::remainder,
                         &ParamState::exp_avg, &ParamState::exp_avg_sq, &ParamState::max_exp_avg_sq}) {
        for (const bool adam : {true, false}) {
          auto initial = make_params(sizes, dtype, master, adam, adam, !adam, 0);
          if (!(initial[0].*field).defined()) {
            continue;
          }
          for (auto& ps : initial) {
            ps.*field = at_offset(ps.*field, 1);
          }
          INFO("dtype " << dtype << ", master " << static_cast<int>(master) << ", adam " << adam);
          StepRuns runs(initial);
          const Scalars sc{256.f, 0.f, 0.f, true, true, false};
          for (int step = 0; step < 2; ++step) {
            if (adam) {
              runs.adam(kern::AdamParams{1e-3, 0.9, 0.999, 0.01, 1e-8, true, false, true}, sc);
            } else {
              runs.sgd(kern::SgdParams{0.05, 0.9, 0.0, 1e-4, true, false}, sc);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("emulated sgd step: momentum, nesterov, dampening, masters and remainders match the CPU", "[emulated]") {
  torch::manual_seed(7);
  const std::vector<int64_t> sizes = {1, 5, 8, 17, kChunk + 3};
  struct Config {
    float momentum, dampening, weight_decay;
    bool nesterov, maximize;
  };
  int64_t tail_differences = 0;
  for (const Config c : {Config{0.f, 0.f, 0.f, false, false}, Config{0.9f, 0.f, 1e-4f, true, false},
                         Config{0.9f, 0.1f, 0.f, false, true}}) {
    for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
        if ((master == Master::kRemainder && dtype != at::kBFloat16) ||
            (master != Master::kNone && dtype == at::kFloat)) {
          continue;
        }
        INFO("momentum " << c.momentum << ", dtype " << dtype << ", master " << static_cast<int>(master));
        const bool momentum = c.momentum != 0.f;
        StepRuns runs(make_params(sizes, dtype, master, false, false, momentum, 1));
        const kern::SgdParams hp{0.05, c.momentum, c.dampening, c.weight_decay, c.nesterov, c.maximize};
        const Scalars sc{512.f, 0.f, 0.f, true, true, false};
        for (int step = 0; step < 3; ++step) {
          runs.sgd(hp, sc);
        }
        tail_differences += runs.tail_differences;
      }
    }
  }
  CHECK(tail_differences > 0);  // the momentum buffer's tail formula rounds differently
}

TEST_CASE("emulated optimizer steps: found_inf skips every write, step counts included", "[emulated]") {
  torch::manual_seed(8);
  for (const Master master : {Master::kFp32, Master::kRemainder}) {
    auto state = make_params({9, kChunk + 1}, at::kBFloat16, master, true, true, false, 0);
    std::vector<ParamState> before = clones(state);
    const kern::AdamParams hp{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, true, false, true};
    emu::reset_traffic();
    adam_on(adam_cuda(), state, hp, Scalars{65536.f, 1.f, 0.f, true, true, false});
    CHECK(emu::reset_traffic().written == 0);
    require_same_state(state, before);
  }
}

TEST_CASE("emulated optimizer steps: lists over several launches match the CPU", "[emulated]") {
  torch::manual_seed(9);
  using Args = kern::cuda::MultiTensorArgs<8>;  // the largest table any functor leaves room for
  std::vector<int64_t> sizes;
  for (int i = 0; i < Args::kMaxTensors + 13; ++i) {
    sizes.push_back(1 + (i * 53) % 200);
  }
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  sizes.push_back((Args::kMaxBlocks + 2) * kChunk + 3);  // one tensor continues into a further launch
#endif
  StepRuns runs(make_params(sizes, at::kHalf, Master::kFp32, true, false, false, 0));
  const kern::AdamParams hp{1e-3, 0.9, 0.999, 0.0, 1e-8, false, false, true};
  const Scalars none{1.f, 0.f, 0.f, false, false, false};
  adam_on(adam_cpu(), runs.cpu, hp, none);
  adam_on(adam_cpu(), runs.reference.full, hp, none);
  emu::reset_traffic();
  adam_on(adam_cuda(), runs.cuda, hp, none);
  CHECK(emu::reset_traffic().launches >= 3);  // two or more chunk tables, then the step counts
  runs.check();
}

TEST_CASE("emulated adamw step: FP16/BF16 params with FP32 masters move 28 bytes per parameter", "[emulated]") {
  torch::manual_seed(10);
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const int64_t n = 2 * kChunk;
    auto state = make_params({n}, dtype, Master::kFp32, true, false, false, 0);
    const kern::AdamParams hp{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, false, false, true};
    emu::reset_traffic();
    adam_on(adam_cuda(), state, hp, Scalars{1024.f, 0.f, 0.f, true, true, false}, /*write_unscaled_grads=*/false);
    const emu::Traffic t = emu::reset_traffic();
    CHECK(t.read + t.written == static_cast<uint64_t>(28 * n));
  }
}

TEST_CASE("emulated lean steps: Kahan and stochastic rounding (Adam, AdamW, SGD) match the CPU bit for bit",
          "[emulated]") {
  torch::manual_seed(11);
  const std::vector<int64_t> sizes = {1, 3, 4, 7, 8, 9, 33, kChunk - 1, kChunk + 5, 0};
  for (const Master master : {Master::kKahan, Master::kStochastic}) {
    for (const int64_t offset : {0, 1}) {
      for (const bool decoupled : {true, false}) {
        INFO("master " << static_cast<int>(master) << ", offset " << offset << ", decoupled " << decoupled);
        StepRuns runs(make_params(sizes, at::kBFloat16, master, true, decoupled, false, offset));
        const kern::AdamParams hp{1e-3, 0.9, 0.999, 0.01, 1e-8, decoupled, false, decoupled};
        const Scalars sc{1024.f, 0.f, 2e-3f, true, true, offset == 1};
        for (int step = 0; step < 3; ++step) {
          runs.adam(hp, sc);
        }
      }
      for (const float momentum : {0.f, 0.9f}) {
        INFO("sgd, master " << static_cast<int>(master) << ", offset " << offset << ", momentum " << momentum);
        StepRuns runs(make_params(sizes, at::kBFloat16, master, false, false, momentum != 0.f, offset));
        const kern::SgdParams hp{0.05, momentum, 0.0, 1e-4, false, false};
        const Scalars sc{512.f, 0.f, 0.f, true, true, false};
        for (int step = 0; step < 3; ++step) {
          runs.sgd(hp, sc);
        }
      }
    }
  }
}

TEST_CASE("emulated lean steps: found_inf skips every write, the rounding's counter included", "[emulated]") {
  torch::manual_seed(12);
  for (const Master master : {Master::kKahan, Master::kStochastic}) {
    auto state = make_params({9, kChunk + 1}, at::kBFloat16, master, true, false, false, 0);
    std::vector<ParamState> before = clones(state);
    const kern::AdamParams hp{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, false, false, true};
    emu::reset_traffic();
    adam_on(adam_cuda(), state, hp, Scalars{65536.f, 1.f, 0.f, true, true, false});
    CHECK(emu::reset_traffic().written == 0);
    require_same_state(state, before);
    // The step after the skipped one rounds as if the skip had not happened: the same bits as a fresh copy.
    std::vector<ParamState> fresh = clones(before);
    const Scalars clean{65536.f, 0.f, 0.f, true, true, false};
    adam_on(adam_cuda(), state, hp, clean);
    adam_on(adam_cuda(), fresh, hp, clean);
    require_same_state(state, fresh);
  }
}

TEST_CASE("emulated adamw step: lean BF16 modes move their minimum bytes per parameter", "[emulated]") {
  torch::manual_seed(13);
  const int64_t n = 2 * kChunk;
  // BF16 weight read + written (4), BF16 grad read (2), FP32 moments read + written (16): 22; Kahan adds its BF16
  // compensation read + written (4). The per-tensor scalars (step, seed, scale, found_inf) are not element traffic.
  for (const Master master : {Master::kKahan, Master::kStochastic}) {
    auto state = make_params({n}, at::kBFloat16, master, true, false, false, 0);
    const kern::AdamParams hp{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, false, false, true};
    emu::reset_traffic();
    adam_on(adam_cuda(), state, hp, Scalars{1024.f, 0.f, 0.f, true, true, false}, /*write_unscaled_grads=*/false);
    const emu::Traffic t = emu::reset_traffic();
    INFO("master " << static_cast<int>(master) << ": " << t.read + t.written << " bytes for " << n);
    const uint64_t per_param = master == Master::kKahan ? 26 : 22;
    CHECK(t.read + t.written == static_cast<uint64_t>(per_param * n));
  }
}

namespace {

// Moments as a state dtype stores them: BF16 rounded to nearest even, or packed 8-bit block-wise (NOTE [8-bit
// block-wise states] in kernels/blockwise8.h).
at::Tensor as_state(const at::Tensor& values, at::ScalarType dtype, bool is_signed) {
  if (!values.defined() || dtype == at::kFloat) {
    return values;
  }
  return dtype == at::kBFloat16 ? values.to(at::kBFloat16) : ampkit::blockwise8_quantize(values, is_signed);
}

// `steps` AdamW (amsgrad) or SGD (momentum, nesterov) steps of the emulated CUDA op on `cuda` and of the CPU op on
// `cpu`, under a grad scale and, at step 1, a device lr, requiring the same bits after each.
void step_both_alike(bool adam, std::vector<ParamState>& cuda, std::vector<ParamState>& cpu, int steps) {
  for (int step = 0; step < steps; ++step) {
    const Scalars sc{1024.f, 0.f, step == 1 ? 2e-3f : 0.f, true, true, step == 1};
    if (adam) {
      const kern::AdamParams hp{1e-3, 0.9, 0.999, 0.01, 1e-8, true, false, true};
      adam_on(adam_cuda(), cuda, hp, sc);
      adam_on(adam_cpu(), cpu, hp, sc);
    } else {
      const kern::SgdParams hp{0.05, 0.9, 0.0, 1e-4, true, false};
      sgd_on(sgd_cuda(), cuda, hp, sc);
      sgd_on(sgd_cpu(), cpu, hp, sc);
    }
    require_same_state(cpu, cuda);
  }
}

}  // namespace

TEST_CASE("emulated state-block steps: BF16 and 8-bit moments in every weight mode match the CPU bit for bit",
          "[emulated]") {
  // NOTE [State-block chunk loop]. Sizes are multiples of 8 (no element takes the CPU's scalar tail): one
  // element, whole and partial quantization blocks, and several chunks.
  torch::manual_seed(14);
  const std::vector<int64_t> sizes = {8, 256, 264, 4096, 4104, 3 * kChunk + 264};
  const std::pair<at::ScalarType, at::ScalarType> dtypes[] = {
      {at::kByte, at::kByte}, {at::kBFloat16, at::kBFloat16}, {at::kByte, at::kBFloat16}, {at::kFloat, at::kByte}};
  for (const auto& [m_dtype, v_dtype] : dtypes) {
    for (const auto& [dtype, master] :
         {std::pair(at::kFloat, Master::kNone), std::pair(at::kHalf, Master::kFp32),
          std::pair(at::kBFloat16, Master::kRemainder), std::pair(at::kBFloat16, Master::kKahan),
          std::pair(at::kBFloat16, Master::kStochastic)}) {
      for (const bool adam : {true, false}) {
        INFO("moments " << m_dtype << "/" << v_dtype << ", dtype " << dtype << ", master " << static_cast<int>(master)
                        << ", adam " << adam);
        auto initial = make_params(sizes, dtype, master, adam, adam, !adam, 0);
        for (auto& s : initial) {
          s.exp_avg = as_state(s.exp_avg, m_dtype, true);
          s.exp_avg_sq = adam ? as_state(s.exp_avg_sq, v_dtype, false) : s.exp_avg_sq;
        }
        auto cuda = clones(initial);
        auto cpu = clones(initial);
        step_both_alike(adam, cuda, cpu, 3);
        // The states moved (a step that wrote nothing would pass the comparison too).
        REQUIRE_FALSE(bits_equal(cpu.back().exp_avg, initial.back().exp_avg));
      }
    }
  }
}

TEST_CASE("emulated optimizer steps: FP32 grads of FP16/BF16 params, every weight mode and moment storage, match "
          "the CPU bit for bit",
          "[emulated]") {
  // NOTE [FP32 grads of low-precision params]: the element-wise loop (aligned, and misaligned streams going
  // element-wise) and the state-block loop read the grad as FP32, and store it so when unscaled. Sizes are
  // multiples of 8 (no element takes the CPU's scalar tail).
  torch::manual_seed(18);
  const std::vector<int64_t> sizes = {8, 264, 4104, kChunk + 264};
  const std::pair<at::ScalarType, at::ScalarType> moments[] = {{at::kFloat, at::kFloat}, {at::kByte, at::kBFloat16}};
  for (const auto& [m_dtype, v_dtype] : moments) {
    for (const auto& [dtype, master] :
         {std::pair(at::kHalf, Master::kNone), std::pair(at::kHalf, Master::kFp32),
          std::pair(at::kBFloat16, Master::kNone), std::pair(at::kBFloat16, Master::kFp32),
          std::pair(at::kBFloat16, Master::kRemainder), std::pair(at::kBFloat16, Master::kKahan),
          std::pair(at::kBFloat16, Master::kStochastic)}) {
      for (const bool adam : {true, false}) {
        for (const int64_t offset : {0, 1}) {
          if (offset == 1 && m_dtype != at::kFloat) {
            continue;  // a packed 8-bit state has no element offset
          }
          INFO("moments " << m_dtype << "/" << v_dtype << ", dtype " << dtype << ", master " << static_cast<int>(master)
                          << ", adam " << adam << ", offset " << offset);
          auto initial = make_params(sizes, dtype, master, adam, adam, !adam, offset);
          for (auto& s : initial) {
            s.grad = at_offset(random_grad(s.param.numel(), at::kFloat, 100.0), offset);
            s.exp_avg = as_state(s.exp_avg, m_dtype, true);
            s.exp_avg_sq = adam ? as_state(s.exp_avg_sq, v_dtype, false) : s.exp_avg_sq;
          }
          auto cuda = clones(initial);
          auto cpu = clones(initial);
          step_both_alike(adam, cuda, cpu, 2);
          // The grads stayed FP32 and were stored unscaled; the weights moved.
          REQUIRE(cuda.back().grad.scalar_type() == at::kFloat);
          REQUIRE_FALSE(bits_equal(cuda.back().grad, initial.back().grad));
          REQUIRE_FALSE(bits_equal(cuda.back().param, initial.back().param));
        }
      }
    }
  }
}

TEST_CASE("emulated state-block steps: found_inf skips every write", "[emulated]") {
  torch::manual_seed(15);
  auto state = make_params({4104}, at::kBFloat16, Master::kStochastic, true, false, false, 0);
  state[0].exp_avg = as_state(state[0].exp_avg, at::kByte, true);
  state[0].exp_avg_sq = as_state(state[0].exp_avg_sq, at::kBFloat16, false);
  const std::vector<ParamState> before = clones(state);
  emu::reset_traffic();
  adam_on(adam_cuda(), state, kern::AdamParams{1e-3, 0.9, 0.999, 0.01, 1e-8, false, false, true},
          Scalars{65536.f, 1.f, 0.f, true, true, false});
  CHECK(emu::reset_traffic().written == 0);
  require_same_state(state, before);
}

TEST_CASE("emulated adamw step: BF16 and 8-bit moments move their minimum bytes per parameter", "[emulated]") {
  torch::manual_seed(16);
  const int64_t n = 2 * kChunk;
  // Stochastic rounding (no master): BF16 weight read + written (4), BF16 grad read (2), then per moment: BF16
  // read + written (4), or its code read + written (2) plus the block's FP32 absmax read + written (8 per 256).
  for (const at::ScalarType moments : {at::kBFloat16, at::kByte}) {
    auto state = make_params({n}, at::kBFloat16, Master::kStochastic, true, false, false, 0);
    state[0].exp_avg = as_state(state[0].exp_avg, moments, true);
    state[0].exp_avg_sq = as_state(state[0].exp_avg_sq, moments, false);
    emu::reset_traffic();
    adam_on(adam_cuda(), state, kern::AdamParams{1e-3, 0.9, 0.999, 0.01, 1e-8, false, false, true},
            Scalars{1024.f, 0.f, 0.f, true, true, false}, /*write_unscaled_grads=*/false);
    const emu::Traffic t = emu::reset_traffic();
    INFO(moments << ": " << t.read + t.written << " bytes for " << n);
    const uint64_t expected = moments == at::kBFloat16 ? 14 * n : 10 * n + 2 * 8 * (n / 256);
    CHECK(t.read + t.written == expected);
  }
}
