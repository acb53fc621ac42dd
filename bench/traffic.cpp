// Bytes of tensor data each CUDA kernel reads and writes per parameter, counted by running the kernels through
// the emulated host build (kernels/cuda/emulation.h counts every global_load / global_store), next to the
// minimum the design promises. Prints one JSON object per line: {"kernel", "dtype", "bytes_per_param",
// "min_bytes_per_param"}. Torch-free; bench/run.py --traffic runs it.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/blockwise8.h"
#include "kernels/cuda/emulation.h"
#include "kernels/cuda/optim_launch.h"

namespace kern = ampkit::kernels;

namespace {

constexpr int64_t kN = 1 << 20;

struct Buffers {
  std::vector<uint16_t> half_param, half_grad;
  std::vector<float> f_param, f_grad, master, m, v;
  std::vector<int16_t> remainder;
  std::vector<uint16_t> comp;
  int64_t seed = 0x5eed;
  float step = 0.f;
  Buffers()
      : half_param(kN, 0x3c00),  // 1.0 in FP16 and a small normal number in BF16
        half_grad(kN, 0x3c00),
        f_param(kN, 1.f),
        f_grad(kN, 1.f),
        master(kN, 1.f),
        m(kN, 0.f),
        v(kN, 0.f),
        remainder(kN, 0),
        comp(kN, 0) {}
};

void print_row(const char* kernel, const char* dtype, const kern::emulation::Traffic& t, double minimum) {
  const double per_param = static_cast<double>(t.read + t.written) / static_cast<double>(kN);
  std::printf("{\"kernel\": \"%s\", \"dtype\": \"%s\", \"bytes_per_param\": %.4f, \"min_bytes_per_param\": %.4f}\n",
              kernel, dtype, per_param, minimum);
}

kern::DType dtype_of(const char* name) {
  return name[0] == 'f' && name[1] == 'p' && name[2] == '1' ? kern::DType::kFloat16
         : name[0] == 'b'                                   ? kern::DType::kBFloat16
                                                            : kern::DType::kFloat32;
}

}  // namespace

int main() {
  Buffers b;
  const float inv = 0.5f;
  float found = 0.f;
  for (const char* dtype : {"fp16", "bf16", "fp32"}) {
    const kern::DType dt = dtype_of(dtype);
    const int size = kern::dtype_size(dt);
    void* data = dt == kern::DType::kFloat32 ? static_cast<void*>(b.f_grad.data()) : b.half_grad.data();
    const kern::TensorRef ref{data, kN, dt};
    kern::emulation::reset_traffic();
    kern::launch_unscale_and_check(&ref, 1, &found, &inv, nullptr);
    print_row("unscale_and_check", dtype, kern::emulation::reset_traffic(), 2 * size);
    kern::launch_check_finite(&ref, 1, &found, nullptr);
    print_row("check_finite", dtype, kern::emulation::reset_traffic(), size);
    // Plus 512 lane sums (doubles) per 64K-element chunk: 0.0625 bytes per element.
    std::vector<double> lanes(static_cast<size_t>(kern::norm_chunks(kN)) * kern::kNormLanes);
    std::vector<double> sums(static_cast<size_t>(kern::norm_chunks(kN)));
    float norm = 0.f;
    kern::launch_grad_norm(&ref, 1, nullptr, &norm, lanes.data(), sums.data(), nullptr);
    print_row("grad_norm", dtype, kern::emulation::reset_traffic(), size);
  }
  const float scale = 1024.f;
  const kern::AdamParams adam{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, false, false, true};
  const kern::SgdParams sgd{0.01f, 0.9f, 0.f, 0.f, false, false};
  struct Case {
    const char* dtype;
    bool master;
    bool remainder;
    bool kahan = false;       // BF16 weight + BF16 Kahan compensation (no master)
    bool stochastic = false;  // BF16 weight written with stochastic rounding (no master)
  };
  for (const Case c : {Case{"fp16+fp32_master", true, false}, Case{"bf16+fp32_master", true, false},
                       Case{"bf16+remainder", false, true}, Case{"bf16+kahan", false, false, true},
                       Case{"bf16+stochastic", false, false, false, true}, Case{"fp32", false, false}}) {
    const kern::DType dt = dtype_of(c.dtype);
    const bool low = dt != kern::DType::kFloat32;
    const int size = kern::dtype_size(dt);
    kern::OptimTensor t{low ? static_cast<void*>(b.half_param.data()) : b.f_param.data(),
                        low ? static_cast<void*>(b.half_grad.data()) : b.f_grad.data(),
                        c.master ? b.master.data() : nullptr,
                        c.remainder ? b.remainder.data() : nullptr,
                        b.m.data(),
                        b.v.data(),
                        nullptr,
                        &b.step,
                        kN,
                        dt,
                        c.kahan ? b.comp.data() : nullptr,
                        c.stochastic ? &b.seed : nullptr};
    // Grad read; weight read and written (the master when there is one, else the param, plus the remainder or the
    // Kahan compensation); moments read and written; the low-precision param written once when a master holds the
    // weight. Stochastic rounding reads one seed and the step per tensor (not per parameter).
    const double weight = c.master ? 8 + size : (c.remainder || c.kahan ? 2 * size + 4 : 2 * size);
    // With write_unscaled_grads (torch's behaviour, the ops' default) the unscaled grad is stored back too.
    for (const bool write_grads : {true, false}) {
      kern::AdamParams hp = adam;
      hp.write_unscaled_grads = write_grads;
      kern::SgdParams sp = sgd;
      sp.write_unscaled_grads = write_grads;
      const double grad = write_grads ? 2 * size : size;
      t.exp_avg_sq = b.v.data();
      kern::emulation::reset_traffic();
      kern::launch_adam_step(&t, 1, hp, &scale, &found, nullptr, nullptr);
      print_row(write_grads ? "adamw_step" : "adamw_step(grads left scaled)", c.dtype, kern::emulation::reset_traffic(),
                grad + weight + 16);
      t.exp_avg_sq = nullptr;
      b.step = 0.f;
      kern::launch_sgd_step(&t, 1, sp, &scale, &found, nullptr, nullptr);
      print_row(write_grads ? "sgd_step(momentum)" : "sgd_step(momentum, grads left scaled)", c.dtype,
                kern::emulation::reset_traffic(), grad + weight + 8);
    }
    // LAMB (NOTE [LAMB passes]): the moments pass reads the grad and the weight, reads and writes both moments;
    // the apply pass reads the weight (and the Kahan compensation) and the moments and writes the weight (and the
    // compensation). Plus the norm scratch: 2 x 512 lane
    // sums (doubles) per 64K-element chunk, 0.125 bytes per parameter.
    const double weight_read = c.master ? 4 : (c.remainder ? size + 2 : size);
    const kern::LambParams lamb{1e-3, 0.9, 0.999, 0.01, 1e-6, true, true, true, false, 0.0};
    std::vector<double> lanes(static_cast<size_t>(kern::norm_chunks(kN)) * 2 * kern::kNormLanes);
    std::vector<double> sums(static_cast<size_t>(kern::norm_chunks(kN)) * 2);
    t.exp_avg_sq = b.v.data();
    kern::emulation::reset_traffic();
    kern::launch_lamb_step(&t, 1, lamb, &scale, &found, nullptr, nullptr, lanes.data(), sums.data(), nullptr);
    print_row("lamb_step", c.dtype, kern::emulation::reset_traffic(),
              size + weight_read + 16 + weight_read + 8 + (weight - weight_read));
  }
  // Moments in BF16 or 8-bit block-wise (exp_avg_dtype / exp_avg_sq_dtype; NOTE [8-bit block-wise states]): per
  // moment 4 bytes (BF16 read + written) or 2 (its code read + written) plus its block's FP32 absmax read +
  // written, 8 bytes per 256 parameters. Grads left scaled (the minimum).
  std::vector<uint16_t> m16(kN, 0), v16(kN, 0);
  std::vector<uint8_t> m8(static_cast<size_t>(kern::blockwise8_bytes(kN)), 0), v8(m8.size(), 0);
  struct StateCase {
    const char* dtype;
    bool master;
    bool kahan;
    kern::StateType moments;
  };
  for (const StateCase c : {StateCase{"bf16+stochastic+bf16_states", false, false, kern::StateType::kBFloat16},
                            StateCase{"bf16+stochastic+8bit_states", false, false, kern::StateType::kBlockwise8},
                            StateCase{"bf16+kahan+8bit_states", false, true, kern::StateType::kBlockwise8},
                            StateCase{"bf16+fp32_master+8bit_states", true, false, kern::StateType::kBlockwise8}}) {
    const bool q8 = c.moments == kern::StateType::kBlockwise8;
    void* m = q8 ? static_cast<void*>(m8.data()) : m16.data();
    void* v = q8 ? static_cast<void*>(v8.data()) : v16.data();
    kern::OptimTensor t{b.half_param.data(),
                        b.half_grad.data(),
                        c.master ? b.master.data() : nullptr,
                        nullptr,
                        static_cast<float*>(m),
                        static_cast<float*>(v),
                        nullptr,
                        &b.step,
                        kN,
                        kern::DType::kBFloat16,
                        c.kahan ? b.comp.data() : nullptr,
                        c.master || c.kahan ? nullptr : &b.seed,
                        c.moments,
                        c.moments};
    const double weight = c.master ? 8 + 2 : c.kahan ? 8 : 4;
    const double per_moment = q8 ? 2 + 8.0 / kern::kQuantBlock : 4;
    kern::AdamParams hp = adam;
    hp.write_unscaled_grads = false;
    kern::emulation::reset_traffic();
    kern::launch_adam_step(&t, 1, hp, &scale, &found, nullptr, nullptr);
    print_row("adamw_step(grads left scaled)", c.dtype, kern::emulation::reset_traffic(), 2 + weight + 2 * per_moment);
    kern::SgdParams sp = sgd;
    sp.write_unscaled_grads = false;
    t.exp_avg_sq = nullptr;
    b.step = 0.f;
    kern::launch_sgd_step(&t, 1, sp, &scale, &found, nullptr, nullptr);
    print_row("sgd_step(momentum, grads left scaled)", c.dtype, kern::emulation::reset_traffic(),
              2 + weight + per_moment);
  }
  return 0;
}
