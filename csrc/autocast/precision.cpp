// ampkit::precision_support: which low-precision dtypes a device runs, and runs fast (see <ampkit/autocast.h>).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ampkit/autocast.h"
#include "precision_cuda.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace ampkit {
namespace {

struct CpuUnits {
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_fp16 = false;
};

CpuUnits cpu_units() {
  CpuUnits u;
#if defined(__x86_64__)
  __builtin_cpu_init();
  u.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  u.avx512_fp16 = __builtin_cpu_supports("avx512fp16");
  u.amx_bf16 = __builtin_cpu_supports("amx-bf16");
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    u.amx_fp16 = (eax >> 21) & 1u;  // CPUID.(EAX=7,ECX=1):EAX[21]
  }
#endif
  return u;
}

// NOTE [CPU precision probe]
// Instruction flags do not tell how fast torch runs a dtype on the CPU: with AVX512-FP16, torch's FP16 convolution
// backward still runs through a slow reference path (two DCGAN batches: 1.4 s in BF16, 40.6 s in FP16). So the
// first precision_support(CPU) of a process times, per dtype, a small conv2d (2 x 16 x 16 x 16, 3x3, 16 channels)
// and a linear (64 x 256 x 256), each forward and backward, the best of three rounds after one, the dtypes
// interleaved within each round, on private inputs (the
// global RNG is not touched), on a thread of its own (none of the caller's autograd hooks, modes or autocast); about 10 ms where every dtype has fast kernels,
// a few tens where one has none. A dtype counts as fast with its units and no op 3 times or more slower than in the
// fastest of the three dtypes for that op (against all three, so that one slow FP32 timing cannot make a slow
// dtype look fast); the advice compares FP16 with BF16 op by op. Factors of 3 stand far above the timing's noise.
double elapsed_ms(const std::function<void()>& run) {
  const auto t0 = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct CpuProbe {
  ProbeTimes fp32, bf16, fp16;
};

// The three dtypes timed interleaved, round by round (fp32, bf16, fp16, fp32, ...), each its best of rounds 1-3
// (round 0 warms up): a burst of other work on the machine slows every dtype of a round alike, and cannot make one
// dtype look fast against the others.
CpuProbe probe() {
  const at::AutoGradMode grad(true);
  const c10::InferenceMode not_inference(false);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // Real tensors even when a Python mode (a fake tensor mode while torch.compile traces) is active.
  const c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/0);
  struct Inputs {
    at::Tensor x, w, a, b;
  };
  const c10::ScalarType dtypes[3] = {c10::kFloat, c10::kBFloat16, c10::kHalf};
  std::vector<Inputs> inputs;
  for (const c10::ScalarType dtype : dtypes) {
    const auto make = [&](at::IntArrayRef shape) {
      return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)).to(dtype).requires_grad_();
    };
    inputs.push_back({make({2, 16, 16, 16}), make({16, 16, 3, 3}), make({64, 256}), make({256, 256})});
  }
  ProbeTimes best[3];
  for (int round = 0; round < 4; ++round) {
    for (int d = 0; d < 3; ++d) {
      const Inputs& in = inputs[d];
      const double conv = elapsed_ms([&] { at::conv2d(in.x, in.w, {}, 1, 1).sum().backward(); });
      const double linear = elapsed_ms([&] { at::matmul(in.a, in.b).sum().backward(); });
      if (round == 1 || (round > 1 && conv < best[d].conv2d_ms)) {
        best[d].conv2d_ms = conv;
      }
      if (round == 1 || (round > 1 && linear < best[d].linear_ms)) {
        best[d].linear_ms = linear;
      }
    }
  }
  return {best[0], best[1], best[2]};
}

// On a thread of its own, which starts with none of the caller's thread-local state: no saved-tensor hooks (a
// non-reentrant checkpoint's), anomaly mode, autocast, grad mode or Python modes reach the probe's autograd.
CpuProbe run_probe() {
  CpuProbe p;
  std::exception_ptr failed;
  std::thread worker([&] {
    try {
      p = probe();
    } catch (...) {
      failed = std::current_exception();
    }
  });
  worker.join();
  if (failed) {
    std::rethrow_exception(failed);
  }
  return p;
}

const CpuProbe& cpu_probe() {
  static const CpuProbe p = run_probe();
  return p;
}

// Per op, the fastest dtype's time.
ProbeTimes fastest(const CpuProbe& p) {
  return {std::min({p.fp32.conv2d_ms, p.bf16.conv2d_ms, p.fp16.conv2d_ms}),
          std::min({p.fp32.linear_ms, p.bf16.linear_ms, p.fp16.linear_ms})};
}

// How many times slower than `base` the slowest op of `t` runs, and that op's name.
std::pair<double, const char*> worst_ratio(const ProbeTimes& t, const ProbeTimes& base) {
  const double conv = t.conv2d_ms / std::max(base.conv2d_ms, 1e-6);
  const double linear = t.linear_ms / std::max(base.linear_ms, 1e-6);
  return conv >= linear ? std::make_pair(conv, "conv2d") : std::make_pair(linear, "linear");
}

constexpr double kSlowFactor = 3.0;

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

}  // namespace

PrecisionSupport precision_support(const c10::Device& device) {
  PrecisionSupport s;
  std::ostringstream why;
  if (device.is_cpu()) {
    const CpuUnits u = cpu_units();
    const CpuProbe& p = cpu_probe();
    s.measured = true;
    s.fp32_probe = p.fp32;
    s.bf16_probe = p.bf16;
    s.fp16_probe = p.fp16;
    const ProbeTimes best = fastest(p);
    const auto [bf16_slow, bf16_op] = worst_ratio(p.bf16, best);
    const auto [fp16_slow, fp16_op] = worst_ratio(p.fp16, best);
    s.fp16 = true;  // ATen computes FP16/BF16 on any CPU, through FP32 where it has no kernel
    s.bf16 = true;
    s.bf16_fast = (u.avx512_bf16 || u.amx_bf16) && bf16_slow < kSlowFactor;
    s.fp16_fast = (u.avx512_fp16 || u.amx_fp16) && fp16_slow < kSlowFactor;
    s.lowp_dtype = c10::kBFloat16;
    why << "CPU: " << (u.avx512_bf16 || u.amx_bf16 ? "BF16 units (" : "no BF16 units (")
        << (u.amx_bf16      ? "AMX-BF16"
            : u.avx512_bf16 ? "AVX512-BF16"
                            : "neither AVX512-BF16 nor AMX-BF16")
        << "); " << (u.avx512_fp16 || u.amx_fp16 ? "FP16 units (" : "no FP16 units (")
        << (u.amx_fp16      ? "AMX-FP16"
            : u.avx512_fp16 ? "AVX512-FP16"
                            : "neither AVX512-FP16 nor AMX-FP16")
        << "). Measured: the slowest op runs " << fixed(bf16_slow, 1) << "x the fastest dtype's time in BF16 ("
        << bf16_op << "), " << fixed(fp16_slow, 1) << "x in FP16 (" << fp16_op << "). "
        << (s.bf16_fast ? "BF16 autocast (no loss scaling needed) computes faster than FP32."
            : (u.avx512_bf16 || u.amx_bf16)
                ? "BF16 has an op without a fast kernel here: FP32 is faster for it."
                : "BF16 runs through FP32 here: it halves activation memory but does not speed up arithmetic; "
                  "FP32 is as fast.");
  } else if (device.is_cuda()) {
#if defined(AMPKIT_WITH_CUDA)
    const detail::CudaDeviceInfo cap = detail::cuda_device_info(device.has_index() ? device.index() : -1);
    const int cc = cap.major * 10 + cap.minor;
    s.fp16 = cc >= 53;
    s.fp16_fast = cc >= 70;  // Tensor Cores from Volta
    s.bf16 = cc >= 80;
    s.bf16_fast = cc >= 80;
    s.lowp_dtype = c10::kHalf;
    why << "CUDA: " << cap.name << ", compute capability " << cap.major << "." << cap.minor << ". "
        << (s.fp16_fast ? "Tensor Cores run FP16 (with a GradScaler)"
                        : "no Tensor Cores (they start with sm_70): FP16 gives no speed-up over FP32")
        << (s.bf16_fast ? "; BF16 as well (sm_80+), which needs no loss scaling." : "; no native BF16 (sm_80+).");
#else
    TORCH_CHECK(false,
                "ampkit::precision_support: this build of ampkit has no CUDA support (AMPKIT_WITH_CUDA=OFF), "
                "so it cannot query ",
                device);
#endif
  } else {
    TORCH_CHECK_VALUE(false, "ampkit::precision_support: device must be a CPU or CUDA device, but got ", device);
  }
  s.fast = s.lowp_dtype == c10::kBFloat16 ? s.bf16_fast : s.fp16_fast;
  s.recommended = s.fast ? s.lowp_dtype : c10::kFloat;
  s.reason = why.str();
  return s;
}

std::string autocast_dtype_advice(c10::DeviceType device, c10::ScalarType dtype, const PrecisionSupport& support) {
  if (device != c10::DeviceType::CPU || dtype != c10::kHalf || !support.measured) {
    return {};
  }
  const double conv = support.fp16_probe.conv2d_ms / std::max(support.bf16_probe.conv2d_ms, 1e-6);
  const double linear = support.fp16_probe.linear_ms / std::max(support.bf16_probe.linear_ms, 1e-6);
  if (std::max(conv, linear) < kSlowFactor) {
    return {};
  }
  const bool conv_worse = conv >= linear;
  return "FP16 autocast on this CPU: " + std::string(conv_worse ? "conv2d" : "linear") + " forward and backward runs " +
         fixed(conv_worse ? conv : linear, 0) + "x slower in FP16 than in BF16 (" +
         fixed(conv_worse ? support.fp16_probe.conv2d_ms : support.fp16_probe.linear_ms, 2) + " ms against " +
         fixed(conv_worse ? support.bf16_probe.conv2d_ms : support.bf16_probe.linear_ms, 2) +
         " ms, measured here; torch has no fast FP16 kernel for it on this CPU" +
         (support.reason.find("no FP16 units") != std::string::npos ? ", which has no FP16 units" : "") +
         "); use BF16 on the CPU, which needs no loss scaling (" +
         (support.bf16_fast ? "and is faster than FP32 here)" : "FP32 is as fast here, BF16 halves activation memory)");
}

}  // namespace ampkit
