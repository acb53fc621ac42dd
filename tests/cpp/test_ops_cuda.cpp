// The AMP ops on CUDA, compared bit for bit with the CPU kernels (themselves bit-identical to torch's; the optimizer
// steps as NOTE [torch's scalar tail] states) and with torch's CUDA kernel where it accepts the input. These run only where a device exists (ctest label "cuda");
// without one each test fails, so that a run that could not test CUDA never reads as a pass.

#include "support/catch_torch.h"
#include <cstdio>
#include <limits>

#include "support/scaler_scenarios.h"
#include "support/test_helpers.h"

using ampkit::test::bits_equal;
using ampkit::test::random_grad;
using ampkit::test::reference_unscale;

namespace {

const at::Device kCuda(at::kCUDA, 0);

at::Tensor scalar_f32(float v, const at::Device& d) {
  return at::full({1}, v, at::TensorOptions(at::kFloat).device(d));
}

// Runs the op on CUDA and on CPU copies; requires identical results.
void require_cuda_matches_cpu(const std::vector<at::Tensor>& cpu_grads, float inv) {
  std::vector<at::Tensor> on_gpu;
  std::vector<at::Tensor> on_cpu;
  for (const auto& g : cpu_grads) {
    on_gpu.push_back(g.to(kCuda));
    on_cpu.push_back(g.clone());
  }
  auto found_gpu = scalar_f32(0.f, kCuda);
  auto found_cpu = scalar_f32(0.f, at::kCPU);
  ampkit::unscale_and_check_(on_gpu, found_gpu, scalar_f32(inv, kCuda));
  ampkit::unscale_and_check_(on_cpu, found_cpu, scalar_f32(inv, at::kCPU));
  REQUIRE(found_gpu.item<float>() == found_cpu.item<float>());
  for (size_t i = 0; i < cpu_grads.size(); ++i) {
    INFO("tensor " << i << " dtype " << cpu_grads[i].scalar_type() << " numel " << cpu_grads[i].numel());
    REQUIRE(bits_equal(on_gpu[i].cpu(), on_cpu[i]));
  }
}

}  // namespace

TEST_CASE("unscale_and_check_ (CUDA): every dtype and size matches the CPU and the float64 reference", "[ops][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(10);
  const int64_t n = GENERATE(1, 7, 8, 9, 65535, 65536, 65537, 1000003);
  const float inv = GENERATE(1.f / 65536.f, 1.f, 3.f);
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble}) {
    const auto g = random_grad(n, dtype, 1000.0);
    require_cuda_matches_cpu({g}, inv);
    auto d = g.to(kCuda);
    auto found = scalar_f32(0.f, kCuda);
    ampkit::unscale_and_check_({d}, found, scalar_f32(inv, kCuda));
    REQUIRE(bits_equal(d.cpu(), reference_unscale(g, inv)));
  }
}

TEST_CASE("unscale_and_check_ (CUDA): mixed dtypes, strided, misaligned, zero-size, one launch or many",
          "[ops][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(11);
  const auto base = at::randn({300, 200}) * 100;
  require_cuda_matches_cpu(
      {base.t(), base.to(at::kHalf).slice(1, 0, 200, 3), base.to(at::kBFloat16).flatten().narrow(0, 1, 59999),
       at::empty({0}), base.to(at::kDouble).select(1, 5)},
      1.f / 1024.f);
  // More tensors than one chunk table holds, and more chunks than one launch takes.
  std::vector<at::Tensor> many;
  for (int i = 0; i < 2500; ++i) {
    many.push_back(random_grad(1 + (i * 131) % 3000, i % 2 ? at::kHalf : at::kBFloat16, 10.0));
  }
  many.back()[-1] = std::numeric_limits<float>::infinity();
  require_cuda_matches_cpu(many, 0.5f);
  std::vector<at::Tensor> big;
  for (int i = 0; i < 1400; ++i) {
    big.push_back(random_grad(2 * 65536 + 1, at::kHalf, 10.0));
  }
  big.back()[-1] = std::numeric_limits<float>::quiet_NaN();
  require_cuda_matches_cpu(big, 0.5f);
}

TEST_CASE("unscale_and_check_ (CUDA): agrees with torch's CUDA kernel where torch accepts the input", "[ops][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(12);
  for (const auto dtype : {at::kHalf, at::kFloat, at::kDouble}) {
    std::vector<at::Tensor> ours = {random_grad(100000, dtype, 1e3, kCuda), random_grad(33, dtype, 1e3, kCuda)};
    ours.back()[-1] = -std::numeric_limits<float>::infinity();
    std::vector<at::Tensor> theirs = {ours[0].clone(), ours[1].clone()};
    auto f0 = scalar_f32(0.f, kCuda);
    auto f1 = scalar_f32(0.f, kCuda);
    ampkit::unscale_and_check_(ours, f0, scalar_f32(0.125f, kCuda));
    at::_amp_foreach_non_finite_check_and_unscale_(theirs, f1, scalar_f32(0.125f, kCuda));
    REQUIRE(f0.item<float>() == 1.f);
    REQUIRE(f1.item<float>() == 1.f);
    REQUIRE(bits_equal(ours[0].cpu(), theirs[0].cpu()));
    REQUIRE(bits_equal(ours[1].cpu(), theirs[1].cpu()));
  }
}

TEST_CASE("unscale_and_check_ (CUDA): grads on another device than found_inf raise and change nothing", "[ops][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  auto g_gpu = random_grad(64, at::kFloat, 1.0, kCuda);
  auto g_cpu = random_grad(64, at::kFloat, 1.0);
  const auto before_gpu = g_gpu.clone();
  const auto before_cpu = g_cpu.clone();
  auto found = scalar_f32(0.f, kCuda);
  REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g_gpu, g_cpu}, found, scalar_f32(0.5f, kCuda)),
                      Catch::Contains("grads[1] must be on cuda:0"));
  REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g_gpu}, found, scalar_f32(0.5f, at::kCPU)),
                      Catch::Contains("inv_scale must be on the device of found_inf (cuda:0)"));
  CHECK(bits_equal(g_gpu.cpu(), before_gpu.cpu()));
  CHECK(bits_equal(g_cpu, before_cpu));
  CHECK(found.item<float>() == 0.f);
}

TEST_CASE("check_finite_ and update_scale_ (CUDA): match the CPU kernels", "[ops][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(13);
  auto t = random_grad(200001, at::kBFloat16, 1e3, kCuda);
  const auto before = t.clone();
  auto found = scalar_f32(0.f, kCuda);
  ampkit::check_finite_({t}, found);
  CHECK(found.item<float>() == 0.f);
  t[-1] = std::numeric_limits<float>::quiet_NaN();
  ampkit::check_finite_({t}, found);
  CHECK(found.item<float>() == 1.f);
  CHECK(bits_equal(t.slice(0, 0, -1).cpu(), before.slice(0, 0, -1).cpu()));

  auto scale = scalar_f32(65536.f, kCuda);
  auto tracker = at::zeros({1}, at::TensorOptions(at::kInt).device(kCuda));
  auto c_scale = scale.cpu();
  auto c_tracker = tracker.cpu();
  const auto overflows = at::rand({500}) < 0.1;
  for (int64_t i = 0; i < overflows.numel(); ++i) {
    const float f = overflows[i].item<bool>() ? 1.f : 0.f;
    ampkit::update_scale_(scale, tracker, scalar_f32(f, kCuda), 2.0, 0.5, 3);
    ampkit::update_scale_(c_scale, c_tracker, scalar_f32(f, at::kCPU), 2.0, 0.5, 3);
    REQUIRE(scale.item<float>() == c_scale.item<float>());
    REQUIRE(tracker.item<int>() == c_tracker.item<int>());
  }
}

TEST_CASE("GradScaler (CUDA): stats(), state_dict() and torch::save work on a CUDA scaler", "[scaler][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  ampkit::GradScaler scaler(ampkit::test::hysteresis_scenario_options());
  ampkit::test::run_hysteresis_scenario(scaler, kCuda);
  const std::string path = "ampkit_test_cuda_scaler.pt";
  torch::save(scaler, path);
  ampkit::GradScaler loaded;
  torch::load(loaded, path);
  std::remove(path.c_str());
  CHECK(loaded.get_scale() == scaler.get_scale());
  CHECK(loaded.stats().skipped_steps == 1);
}

TEST_CASE("adamw_step_ (CUDA): bitwise equal to the CPU op without its scalar tail, masters included",
          "[optim][cuda]") {
  // NOTE [torch's scalar tail] (kernels/optim_functors.h): the CUDA op takes no scalar tail. Its reference is the
  // CPU op on tensors padded to a multiple of the CPU's tail width (every element of the first n through the
  // vector formulas): bit for bit. Against the CPU op on the same n elements it is bit for bit but in the last
  // n % tail_width, which stay within the stated tolerance.
  AMPKIT_REQUIRE_CUDA_DEVICE();
  torch::manual_seed(14);
  const int64_t width = ampkit::build_info().cpu_optim_tail_width;
  const int64_t n = 70001;
  const int64_t padded = (n + width - 1) / width * width;
  const int64_t body = n - n % width;
  REQUIRE(body < n);  // the case has a tail
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    INFO("dtype " << dtype);
    const bool with_master = dtype != at::kFloat;
    struct State {
      at::Tensor p, g, master, m, v, step;
    };
    const auto w = at::randn({padded});
    const auto g = (at::randn({padded}) * 100).to(dtype);
    auto make = [&](int64_t size, const at::Device& d) {  // copies: every run owns its tensors
      auto copy = [&](const at::Tensor& t, at::ScalarType type) {
        return t.narrow(0, 0, size).to(d, type, /*non_blocking=*/false, /*copy=*/true);
      };
      return State{copy(w, dtype),
                   copy(g, dtype),
                   copy(w, at::kFloat),
                   at::zeros({size}, at::TensorOptions().device(d)),
                   at::zeros({size}, at::TensorOptions().device(d)),
                   at::zeros({1}, at::TensorOptions().device(d))};
    };
    State gpu = make(n, kCuda);
    State cpu = make(n, at::kCPU);
    State ref = make(padded, at::kCPU);
    for (int i = 0; i < 3; ++i) {
      for (State* s : {&gpu, &cpu, &ref}) {
        const at::Device d = s->p.device();
        ampkit::adamw_step_({s->p}, {s->g}, with_master ? at::TensorList(s->master) : at::TensorList(), {}, {s->m},
                            {s->v}, {}, {s->step}, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false, true,
                            scalar_f32(64.f, d), scalar_f32(0.f, d), std::nullopt);
      }
    }
    auto first = [](const at::Tensor& t, int64_t k) { return t.narrow(0, 0, k); };
    std::vector<std::pair<at::Tensor, at::Tensor>> pairs = {{gpu.p, cpu.p}, {gpu.m, cpu.m}, {gpu.v, cpu.v}};
    if (with_master) {
      pairs.emplace_back(gpu.master, cpu.master);
    }
    REQUIRE(bits_equal(gpu.p.cpu(), first(ref.p, n)));
    REQUIRE(bits_equal(gpu.m.cpu(), first(ref.m, n)));
    REQUIRE(bits_equal(gpu.v.cpu(), first(ref.v, n)));
    if (with_master) {
      REQUIRE(bits_equal(gpu.master.cpu(), first(ref.master, n)));
    }
    for (const auto& [on_gpu, on_cpu] : pairs) {
      const at::Tensor a = on_gpu.cpu();
      REQUIRE(bits_equal(first(a, body), first(on_cpu, body)));
      const at::Tensor x = a.narrow(0, body, n - body).to(at::kDouble);
      const at::Tensor y = on_cpu.narrow(0, body, n - body).to(at::kDouble);
      const at::ScalarType type = on_gpu.scalar_type();
      const double rtol = type == at::kHalf ? 0x1p-10 : type == at::kBFloat16 ? 0x1p-7 : 1e-6;
      REQUIRE((x - y).abs().le(at::maximum(x.abs(), y.abs()) * rtol).all().item<bool>());
    }
    REQUIRE(gpu.step.item<float>() == 3.f);
  }
}

#if defined(AMPKIT_TEST_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>

TEST_CASE("precision_support (CUDA): a device without an index is the current device", "[autocast][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  for (int index = 0; index < static_cast<int>(torch::cuda::device_count()); ++index) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    const ampkit::PrecisionSupport plain = ampkit::precision_support(c10::Device(c10::kCUDA));
    const ampkit::PrecisionSupport indexed =
        ampkit::precision_support(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
    INFO("device " << index);
    CHECK(plain.reason == indexed.reason);
    CHECK(plain.bf16 == indexed.bf16);
    CHECK(plain.fp16_fast == indexed.fp16_fast);
  }
}

TEST_CASE("O2 step (C++): captured in a CUDA graph and replayed, equal to the same steps run eagerly",
          "[optim][cuda]") {
  AMPKIT_REQUIRE_CUDA_DEVICE();
  struct Run {
    torch::nn::Sequential model{torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 8)};
    std::unique_ptr<ampkit::optim::AdamW> opt;
    ampkit::GradScaler scaler{ampkit::GradScalerOptions().init_scale(1024.0).growth_interval(5)};
    Run() {
      torch::manual_seed(0);
      model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 8));
      model->to(kCuda);
      opt = std::make_unique<ampkit::optim::AdamW>(model->parameters(), ampkit::optim::AdamWOptions(1e-3));
      opt->init_master_params();
      model->to(torch::kHalf);
    }
    void step(const at::Tensor& x, const at::Tensor& y) {
      for (auto& p : model->parameters()) {
        if (p.grad().defined()) {
          p.mutable_grad().zero_();
        }
      }
      auto loss = torch::mse_loss(model->forward(x).to(torch::kFloat), y);
      scaler.scale(loss).backward();
      scaler.step(*opt);
      scaler.update();
    }
  };
  const auto xs = torch::randn({53, 16, 32}, torch::TensorOptions().device(kCuda)).to(torch::kHalf);
  const auto ys = torch::randn({53, 16, 8}, torch::TensorOptions().device(kCuda));
  Run eager;
  for (int64_t i = 0; i < 53; ++i) {
    eager.step(xs[i], ys[i]);
  }
  Run captured;
  auto x = xs[0].clone();
  auto y = ys[0].clone();
  auto side = c10::cuda::getStreamFromPool();
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream());
  ready.block(side);
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    for (int64_t i = 0; i < 3; ++i) {  // warm-up on the capture stream: state and buffers exist before capture
      x.copy_(xs[i]);
      y.copy_(ys[i]);
      captured.step(x, y);
    }
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    captured.step(x, y);
    graph.capture_end();
    for (int64_t i = 3; i < 53; ++i) {
      x.copy_(xs[i]);
      y.copy_(ys[i]);
      graph.replay();
    }
  }
  torch::cuda::synchronize();
  const auto a = eager.model->parameters();
  const auto b = captured.model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(bits_equal(a[i].detach().cpu(), b[i].detach().cpu()));
  }
  CHECK(eager.scaler.get_scale() == captured.scaler.get_scale());
}
#endif
