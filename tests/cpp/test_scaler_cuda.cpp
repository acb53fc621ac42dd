// ampkit::GradScaler across CUDA streams (NOTE [Scaler streams]): flags recorded from two streams are all
// counted, and the inverse scale read from another stream waits for the update() that changed it. A stream kept
// busy by a sleep kernel makes the order of the two streams' work certain. Label "cuda"; the CPU side of the same
// state is tests/cpp/test_grad_scaler_buffers.cpp.
#include "support/catch_torch.h"

#include <limits>

#if defined(AMPKIT_TEST_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

using ampkit::GradScaler;
using ampkit::GradScalerOptions;

#if defined(AMPKIT_TEST_WITH_CUDA)
namespace {

const at::Device kCuda(at::kCUDA, 0);
constexpr int64_t kSleepCycles = 200'000'000;  // ~0.1 s: far longer than the host takes to enqueue the rest

at::Tensor flag(float v) { return at::full({1}, v, at::TensorOptions(at::kFloat).device(kCuda)); }

}  // namespace

TEST_CASE("GradScaler (CUDA): flags recorded from two streams are all counted", "[scaler][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  // As DDP's bucket callbacks: the first bucket records from a stream still busy, the second, holding the Inf,
  // from an idle one. With one shared flag the first bucket's zeroing ran last and erased the Inf.
  const bool consumer_waits = GENERATE(true, false);  // DDP's reducer waits for the callbacks' streams itself
  INFO("the consumer stream waits for the recording streams itself: " << consumer_waits);
  at::Tensor p = torch::ones({1024}, at::TensorOptions().device(kCuda)).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.5));
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  scaler.scale(p.sum()).backward();
  p.mutable_grad().mul_(scaler.unscale_factor(kCuda));
  torch::cuda::synchronize();
  const auto main = c10::cuda::getCurrentCUDAStream();
  const auto busy = c10::cuda::getStreamFromPool();
  const auto idle = c10::cuda::getStreamFromPool();
  {
    const c10::cuda::CUDAStreamGuard guard(busy);
    at::cuda::sleep(kSleepCycles);
    scaler.record_unscaled_grads(flag(0.f));
  }
  {
    const c10::cuda::CUDAStreamGuard guard(idle);
    scaler.record_unscaled_grads(flag(1.f));
  }
  if (consumer_waits) {
    for (const auto& s : {busy, idle}) {
      at::cuda::CUDAEvent done;
      done.record(s);
      done.block(main);
    }
  }
  const at::Tensor before = p.detach().clone();
  scaler.step(opt);  // the generic path reads the flag on the host, after the scaler's own waits
  scaler.update();
  REQUIRE_FALSE(scaler.last_step_ran().item<bool>());
  REQUIRE(torch::equal(p.detach(), before));
  REQUIRE(scaler.get_scale() == 512.0);
}

TEST_CASE("GradScaler (CUDA): the inverse scale read from another stream waits for the update that changed it",
          "[scaler][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  at::Tensor p = torch::ones({1024}, at::TensorOptions().device(kCuda)).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.5));
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  scaler.scale(p.sum()).backward();
  REQUIRE(scaler.unscale_factor(kCuda).item<float>() == 1.f / 1024.f);
  p.mutable_grad()[-1] = std::numeric_limits<float>::infinity();
  scaler.step(opt);
  torch::cuda::synchronize();
  at::cuda::sleep(kSleepCycles);
  scaler.update();  // halves the scale, late: behind the sleep on this stream
  at::Tensor seen;
  {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    seen = scaler.unscale_factor(kCuda).clone();
  }
  torch::cuda::synchronize();  // `seen` was written on the other stream
  REQUIRE(seen.item<float>() == 1.f / 512.f);
}
#else
TEST_CASE("GradScaler (CUDA): streams", "[scaler][cuda]") {
  FAIL("this build of ampkit has no CUDA support: run the cuda label against a CUDA build");
}
#endif
