// Bytes of tensor data each CUDA kernel reads and writes per parameter, counted by running the kernels through
// the emulated host build (kernels/cuda/emulation.h counts every global_load / global_store), next to the
// minimum the design promises, and what the memory-transaction model (NOTE [Memory transaction model]) makes of
// the same launches: the share of the 32-byte sectors moved that the kernel asked for, shared-memory wavefronts
// per request, atomics per million elements, and the modelled fraction of copy bandwidth (the minimum bytes over
// the sector bytes moved). Prints one JSON object per line; Torch-free; bench/run.py --traffic runs it.
// `ampkit_traffic --check` (a ctest) also fails when a row misses its goal: more bytes than its minimum, a sector
// efficiency below its goal, or an atomic on an address another lane of the same instruction updates.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/blockwise8.h"
#include "kernels/cuda/emulation.h"
#include "kernels/cuda/fp8_launch.h"
#include "kernels/cuda/optim_launch.h"

namespace kern = ampkit::kernels;

namespace {

constexpr int64_t kN = 1 << 20;

// Tensor storage aligned as the CUDA caching allocator aligns it (512 bytes), so that the model's sector counts
// are those of real tensors.
template <typename T>
struct Aligned512 {
  using value_type = T;
  Aligned512() = default;
  template <typename U>
  Aligned512(const Aligned512<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{512})); }
  void deallocate(T* p, size_t) { ::operator delete (p, std::align_val_t{512}); }
  bool operator==(const Aligned512&) const { return true; }
  bool operator!=(const Aligned512&) const { return false; }
};
template <typename T>
using Vec = std::vector<T, Aligned512<T>>;

struct Buffers {
  Vec<uint16_t> half_param, half_grad;
  Vec<float> f_param, f_grad, master, m, v;
  Vec<int16_t> remainder;
  Vec<uint16_t> comp;
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

// Rows that miss a goal (bytes more than 1% above the minimum, sectors below the goal, atomics on a shared address): with
// --check, each is named on stderr and the exit status is 1.
int misses = 0;

// Clears the byte counters and the model before a launch whose row follows.
void reset_all() {
  kern::emulation::reset_traffic();
  kern::emulation::take_memory_model();
}

// The row of the launches since reset_all(): `minimum` bytes per element over `n` elements; `goal`: the sector
// efficiency the kernel is held to.
void print_row(const char* kernel, const char* dtype, double minimum, double goal = 0.8, int64_t n = kN) {
  const kern::emulation::Traffic t = kern::emulation::reset_traffic();
  const kern::emulation::MemoryModel m = kern::emulation::take_memory_model();
  const double per_param = static_cast<double>(t.read + t.written) / static_cast<double>(n);
  const double sector_bytes = 32.0 * static_cast<double>(m.global_sectors);
  const double modelled = sector_bytes == 0 ? 1.0 : std::min(1.0, minimum * static_cast<double>(n) / sector_bytes);
  const double per_m = 1e6 / static_cast<double>(n);
  std::printf(
      "{\"kernel\": \"%s\", \"dtype\": \"%s\", \"bytes_per_param\": %.4f, \"min_bytes_per_param\": %.4f, "
      "\"sector_efficiency\": %.4f, \"goal\": %.2f, \"sectors_per_param\": %.4f, \"shared_wavefronts_per_request\": "
      "%.3f, \"global_atomics_per_M\": %.1f, \"same_address_atomics_per_M\": %.1f, \"shared_atomics_per_M\": %.1f, "
      "\"modelled_copy_bw_fraction\": %.4f, \"worst_site\": \"%s\"}\n",
      kernel, dtype, per_param, minimum, m.sector_efficiency(), goal,
      static_cast<double>(m.global_sectors) / static_cast<double>(n), m.wavefronts_per_request(),
      static_cast<double>(m.global_atomics) * per_m, static_cast<double>(m.global_atomic_conflicts) * per_m,
      static_cast<double>(m.shared_atomics) * per_m, modelled, m.worst_site.c_str());
  std::fflush(stdout);
  // (1% over the minimum: a launch's or a block's scalars, such as the scale fp8_quantize reads once per block.)
  if (per_param > minimum * 1.01 || m.sector_efficiency() < goal || m.global_atomic_conflicts != 0) {
    std::fprintf(stderr,
                 "ampkit_traffic: %s (%s) misses its goal: %.4f bytes per element (minimum %.4f), sector efficiency "
                 "%.3f (goal %.2f), %llu global atomics on an address another lane of the instruction updates; "
                 "worst site %s\n",
                 kernel, dtype, per_param, minimum, m.sector_efficiency(), goal,
                 static_cast<unsigned long long>(m.global_atomic_conflicts), m.worst_site.c_str());
    ++misses;
  }
}

kern::DType dtype_of(const char* name) {
  return name[0] == 'f' && name[1] == 'p' && name[2] == '1' ? kern::DType::kFloat16
         : name[0] == 'b'                                   ? kern::DType::kBFloat16
                                                            : kern::DType::kFloat32;
}

}  // namespace

int main(int argc, char** argv) {
  const bool check = argc > 1 && std::strcmp(argv[1], "--check") == 0;
  kern::emulation::set_memory_model(true);
  Buffers b;
  // Gradients as a network has them for the rows that look at their values: signs and magnitudes spread over 24
  // binades (the histogram's bins), one in 64 exactly zero.
  Vec<float> spread_f(kN);
  Vec<uint16_t> spread_h(kN), spread_b(kN);
  uint64_t lcg = 0x9e3779b97f4a7c15ull;
  for (int64_t i = 0; i < kN; ++i) {
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    const float u = static_cast<float>(static_cast<int64_t>(lcg >> 40) - (1 << 23)) / static_cast<float>(1 << 23);
    const float x = i % 64 == 0 ? 0.f : std::ldexp(u, -static_cast<int>((lcg >> 20) % 24));
    spread_f[static_cast<size_t>(i)] = x;
    spread_h[static_cast<size_t>(i)] = __half_as_ushort(__float2half_rn(x));
    spread_b[static_cast<size_t>(i)] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  auto spread = [&](kern::DType dt) -> const void* {
    return dt == kern::DType::kFloat32   ? static_cast<const void*>(spread_f.data())
           : dt == kern::DType::kFloat16 ? static_cast<const void*>(spread_h.data())
                                         : static_cast<const void*>(spread_b.data());
  };
  const float inv = 0.5f;
  float found = 0.f;
  for (const char* dtype : {"fp16", "bf16", "fp32"}) {
    const kern::DType dt = dtype_of(dtype);
    const int size = kern::dtype_size(dt);
    void* data = dt == kern::DType::kFloat32 ? static_cast<void*>(b.f_grad.data()) : b.half_grad.data();
    const kern::TensorRef ref{data, kN, dt};
    reset_all();
    kern::launch_unscale_and_check(&ref, 1, &found, &inv, nullptr);
    print_row("unscale_and_check", dtype, 2 * size);
    kern::launch_check_finite(&ref, 1, &found, nullptr);
    print_row("check_finite", dtype, size);
    // Plus 512 lane sums (doubles) per 64K-element chunk: 0.0625 bytes per element.
    Vec<double> lanes(static_cast<size_t>(kern::norm_chunks(kN)) * kern::kNormLanes);
    Vec<double> sums(static_cast<size_t>(kern::norm_chunks(kN)));
    float norm = 0.f;
    kern::launch_grad_norm(&ref, 1, nullptr, &norm, lanes.data(), sums.data(), nullptr);
    print_row("grad_norm", dtype, size + 8.0 * kern::kNormLanes / 65536);
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
    bool fp32_grad = false;   // FP32 grads of the low-precision params (NOTE [FP32 grads of low-precision params])
  };
  for (const Case c : {Case{"fp16+fp32_master", true, false}, Case{"bf16+fp32_master", true, false},
                       Case{"bf16+remainder", false, true}, Case{"bf16+kahan", false, false, true},
                       Case{"bf16+stochastic", false, false, false, true}, Case{"fp32", false, false},
                       Case{"bf16+fp32_master+fp32_grads", true, false, false, false, true}}) {
    const kern::DType dt = dtype_of(c.dtype);
    const bool low = dt != kern::DType::kFloat32;
    const int size = kern::dtype_size(dt);
    kern::OptimTensor t{low ? static_cast<void*>(b.half_param.data()) : b.f_param.data(),
                        low && !c.fp32_grad ? static_cast<void*>(b.half_grad.data()) : b.f_grad.data(),
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
    t.grad_fp32 = c.fp32_grad;
    const int grad_size = c.fp32_grad ? 4 : size;
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
      const double grad = write_grads ? 2 * grad_size : grad_size;
      t.exp_avg_sq = b.v.data();
      reset_all();
      kern::launch_adam_step(&t, 1, hp, &scale, &found, nullptr, nullptr);
      print_row(write_grads ? "adamw_step" : "adamw_step(grads left scaled)", c.dtype, grad + weight + 16);
      t.exp_avg_sq = nullptr;
      b.step = 0.f;
      kern::launch_sgd_step(&t, 1, sp, &scale, &found, nullptr, nullptr);
      print_row(write_grads ? "sgd_step(momentum)" : "sgd_step(momentum, grads left scaled)", c.dtype,
                grad + weight + 8);
    }
    // LAMB (NOTE [LAMB passes]): the moments pass reads the grad and the weight, reads and writes both moments;
    // the apply pass reads the weight (and the Kahan compensation) and the moments and writes the weight (and the
    // compensation). Plus the norm scratch: 2 x 512 lane
    // sums (doubles) per 64K-element chunk, 0.125 bytes per parameter.
    const double weight_read = c.master ? 4 : (c.remainder ? size + 2 : size);
    const kern::LambParams lamb{1e-3, 0.9, 0.999, 0.01, 1e-6, true, true, true, false, 0.0};
    Vec<double> lanes(static_cast<size_t>(kern::norm_chunks(kN)) * 2 * kern::kNormLanes);
    Vec<double> sums(static_cast<size_t>(kern::norm_chunks(kN)) * 2);
    t.exp_avg_sq = b.v.data();
    reset_all();
    kern::launch_lamb_step(&t, 1, lamb, &scale, &found, nullptr, nullptr, lanes.data(), sums.data(), nullptr);
    print_row(
        "lamb_step", c.dtype,
        grad_size + weight_read + 16 + weight_read + 8 + (weight - weight_read) + 16.0 * kern::kNormLanes / 65536);
  }
  // Moments in BF16 or 8-bit block-wise (exp_avg_dtype / exp_avg_sq_dtype; NOTE [8-bit block-wise states]): per
  // moment 4 bytes (BF16 read + written) or 2 (its code read + written) plus its block's FP32 absmax read +
  // written, 8 bytes per 256 parameters. Grads left scaled (the minimum).
  Vec<uint16_t> m16(kN, 0), v16(kN, 0);
  Vec<uint8_t> m8(static_cast<size_t>(kern::blockwise8_bytes(kN)), 0), v8(m8.size(), 0);
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
                        spread_b.data(),  // the moments' codes depend on the values (the quantizer's lookups)
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
    reset_all();
    kern::launch_adam_step(&t, 1, hp, &scale, &found, nullptr, nullptr);
    print_row("adamw_step(grads left scaled)", c.dtype, 2 + weight + 2 * per_moment);
    kern::SgdParams sp = sgd;
    sp.write_unscaled_grads = false;
    t.exp_avg_sq = nullptr;
    b.step = 0.f;
    kern::launch_sgd_step(&t, 1, sp, &scale, &found, nullptr, nullptr);
    print_row("sgd_step(momentum, grads left scaled)", c.dtype, 2 + weight + per_moment);
  }
  // grad_stats (NOTE [Gradient statistics]): the grads read once, plus 512 lane sums (doubles) per 64K-element
  // chunk written; the finish kernel's reads of the sums are not tensor data. Held to 70%.
  for (const char* dtype : {"fp16", "bf16", "fp32"}) {
    const kern::DType dt = dtype_of(dtype);
    const kern::TensorRef ref{const_cast<void*>(spread(dt)), kN, dt};
    Vec<double> out(kern::kGradStatsColumns);
    Vec<unsigned long long> counters(kern::kGradStatsCounterColumns, 0);
    Vec<double> partials(static_cast<size_t>(kern::grad_stats_chunks(kN)) * kern::kNormLanes);
    reset_all();
    kern::launch_grad_stats(&ref, 1, &inv, out.data(), counters.data(), partials.data(), nullptr);
    print_row("grad_stats", dtype, kern::dtype_size(dt) + 8.0 * kern::kNormLanes / 65536, 0.7);
  }
  // fp8_quantize of a 1024 x 1024 matrix (tensorwise scale): the input read, the FP8 codes written, and with the
  // transposed copy the codes written a second time.
  {
    Vec<uint8_t> q(kN), q_t(kN);
    float amax = 0.f;
    const float fp8_scale = 1.f;
    for (const char* dtype : {"bf16", "fp32"}) {
      const kern::DType dt = dtype_of(dtype);
      const void* x = spread(dt);
      for (const bool transpose : {false, true}) {
        const kern::Fp8QuantizeParams p{x,          dt,
                                        1024,       1024,
                                        &fp8_scale, false,
                                        q.data(),   transpose ? q_t.data() : nullptr,
                                        &amax,      kern::Fp8Format::kE4M3};
        reset_all();
        kern::launch_fp8_quantize(p, nullptr);
        print_row(transpose ? "fp8_quantize(+transpose)" : "fp8_quantize", dtype,
                  kern::dtype_size(dt) + (transpose ? 2.0 : 1.0));
      }
    }
  }
  return check && misses > 0 ? 1 : 0;
}
