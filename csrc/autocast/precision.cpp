// ampkit::precision_support: which low-precision dtypes a device runs, and runs fast (see <ampkit/autocast.h>).
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

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

}  // namespace

PrecisionSupport precision_support(const c10::Device& device) {
  PrecisionSupport s;
  std::ostringstream why;
  if (device.is_cpu()) {
    const CpuUnits u = cpu_units();
    s.fp16 = true;  // ATen computes FP16/BF16 on any CPU, through FP32
    s.bf16 = true;
    s.bf16_fast = u.avx512_bf16 || u.amx_bf16;
    s.fp16_fast = u.avx512_fp16 || u.amx_fp16;
    s.lowp_dtype = c10::kBFloat16;
    why << "CPU: " << (s.bf16_fast ? "BF16 units (" : "no BF16 units (")
        << (u.amx_bf16      ? "AMX-BF16"
            : u.avx512_bf16 ? "AVX512-BF16"
                            : "neither AVX512-BF16 nor AMX-BF16")
        << "); " << (s.fp16_fast ? "FP16 units (" : "no FP16 units (")
        << (u.amx_fp16      ? "AMX-FP16"
            : u.avx512_fp16 ? "AVX512-FP16"
                            : "neither AVX512-FP16 nor AMX-FP16")
        << "). "
        << (s.bf16_fast ? "BF16 autocast (no loss scaling needed) computes faster than FP32."
                        : "BF16 runs through FP32 here: it halves activation memory but does not speed up "
                          "arithmetic; FP32 is as fast.");
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
  if (device != c10::DeviceType::CPU || dtype != c10::kHalf || support.fp16_fast) {
    return {};
  }
  return std::string("FP16 autocast on this CPU: it has no FP16 units (neither AVX512-FP16 nor AMX-FP16), so every "
                     "FP16 op runs through FP32 conversions and is many times slower than BF16 or FP32; use BF16 on "
                     "the CPU (") +
         (support.bf16_fast ? "it has BF16 units"
                            : "no BF16 units either: FP32 is as fast, BF16 halves activation "
                              "memory") +
         ")";
}

}  // namespace ampkit
