// ampkit::distributed from C++: GradientAllReduce over ampkit's store process group (ranks as threads here; the
// Python tests run it on Gloo ranks and the ddp_demo example as separate processes): ranks agree bit for bit, an
// FP32 all-reduce follows one process over the global batch, FP16 compression with a scaler skips an Inf on one
// rank on every rank, and bad arguments throw.
#include "support/catch_torch.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/version.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace {

// Ranks are threads here and share torch's default generator: seeding and drawing hold this lock.
std::mutex rng_mutex;

torch::nn::Sequential make_model() {
  const std::lock_guard<std::mutex> lock(rng_mutex);
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank, int world) {
  const std::lock_guard<std::mutex> lock(rng_mutex);
  torch::manual_seed(100 + step);
  const auto x = torch::randn({world * 4, 8});
  const auto y = torch::randn({world * 4, 4});
  return {x.narrow(0, rank * 4, 4), y.narrow(0, rank * 4, 4)};
}

struct RankResult {
  std::vector<at::Tensor> params;
  std::vector<bool> ran;
  int64_t bytes = 0;
};

RankResult train(int rank, int world, const std::string& path, ampkit::distributed::Compression compression,
                 bool inject) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world);
  auto pg = ampkit::distributed::store_process_group(store, rank, world);
  auto model = make_model();
  ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-2));
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(1024.0));
  ampkit::distributed::GradientAllReduce sync(
      model->parameters(), pg,
      ampkit::distributed::GradientAllReduceOptions().compression(compression).bucket_bytes(256), &scaler);
  RankResult out;
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = batch(step, rank, world);
    if (inject && step == 2 && rank == 1) {
      x = x.clone();
      x[0][0] = std::numeric_limits<float>::infinity();
    }
    opt.zero_grad();
    scaler.scale(torch::mse_loss(model->forward(x), y)).backward();
    sync.synchronize();
    scaler.step(opt);
    scaler.update();
    out.ran.push_back(scaler.last_step_ran().item<bool>());
  }
  for (const auto& p : model->parameters()) {
    out.params.push_back(p.detach().clone());
  }
  out.bytes = sync.bytes_reduced();
  return out;
}

std::vector<RankResult> run_ranks(int world, ampkit::distributed::Compression compression, bool inject) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_test_allreduce_" + std::to_string(::getpid()))).string();
  std::remove(path.c_str());
  std::vector<RankResult> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { results[r] = train(r, world, path, compression, inject); });
  }
  for (auto& t : threads) {
    t.join();
  }
  std::remove(path.c_str());
  return results;
}

}  // namespace

TEST_CASE("distributed: an FP32 GradientAllReduce follows one process over the global batch", "[distributed][cpu]") {
  const auto results = run_ranks(2, ampkit::distributed::Compression::kNone, false);
  auto model = make_model();
  ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 4; ++step) {
    auto [x0, y0] = batch(step, 0, 2);
    auto [x1, y1] = batch(step, 1, 2);
    opt.zero_grad();
    torch::mse_loss(model->forward(torch::cat({x0, x1})), torch::cat({y0, y1})).backward();
    opt.step();
  }
  const auto params = model->parameters();
  int64_t numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    CHECK(torch::equal(results[0].params[i], results[1].params[i]));
    CHECK(torch::allclose(results[0].params[i], params[i].detach(), /*rtol=*/1e-5, /*atol=*/1e-6));
    numel += params[i].numel();
  }
  CHECK(results[0].bytes == 4 * numel * 4);  // 4 steps, FP32 on the wire
  CHECK(results[0].ran == std::vector<bool>{true, true, true, true});
}

TEST_CASE("distributed: FP16 compression with a scaler skips an Inf on one rank on every rank", "[distributed][cpu]") {
  const auto results = run_ranks(2, ampkit::distributed::Compression::kFP16, true);
  for (const auto& r : results) {
    CHECK(r.ran == std::vector<bool>{true, true, false, true});
  }
  int64_t numel = 0;
  for (size_t i = 0; i < results[0].params.size(); ++i) {
    CHECK(torch::equal(results[0].params[i], results[1].params[i]));
    CHECK(torch::isfinite(results[0].params[i]).all().item<bool>());
    numel += results[0].params[i].numel();
  }
  CHECK(results[0].bytes == 4 * numel * 2);  // half the bytes of FP32
}

TEST_CASE("distributed: GradientAllReduce and store_process_group refuse bad arguments", "[distributed][cpu]") {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_test_allreduce_bad_" + std::to_string(::getpid()))).string();
  std::remove(path.c_str());
  auto store = c10::make_intrusive<c10d::FileStore>(path, 1);
  auto pg = ampkit::distributed::store_process_group(store, 0, 1);
  auto p = torch::ones({3}, torch::requires_grad());
  using ampkit::distributed::GradientAllReduce;
  CHECK_THROWS_WITH(GradientAllReduce({p, p}, pg), Catch::Contains("params[0] and params[1] are the same tensor"));
  CHECK_THROWS_WITH(GradientAllReduce({torch::ones({3})}, pg),
                    Catch::Contains("params[0] must be a leaf tensor that requires grad"));
  CHECK_THROWS_WITH(GradientAllReduce({p}, nullptr), Catch::Contains("process_group must not be null"));
  CHECK_THROWS_WITH(GradientAllReduce({p}, pg, ampkit::distributed::GradientAllReduceOptions().bucket_bytes(0)),
                    Catch::Contains("bucket_bytes must be positive"));
  CHECK_THROWS_WITH(ampkit::distributed::store_process_group(store, 2, 2),
                    Catch::Contains("expected 0 <= rank < size"));
  // One rank: the all-reduce is the identity (divided by 1), the bytes are counted.
  GradientAllReduce one({p}, pg);
  (p * 2).sum().backward();
  one.synchronize();
  CHECK(torch::equal(p.grad(), torch::full({3}, 2.f)));
  CHECK(one.bytes_reduced() == 12);
  std::remove(path.c_str());
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
TEST_CASE("distributed: GradientAllReduce keeps FP32 grads of BF16 params (grad_dtype) in FP32", "[distributed][cpu]") {
  // NOTE [FP32 grads of low-precision params]. One rank: the all-reduce is the identity (divided by 1), so the
  // grads come back bit for bit unless the wire rounds them to BF16.
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_test_allreduce_fp32_" + std::to_string(::getpid()))).string();
  std::remove(path.c_str());
  auto store = c10::make_intrusive<c10d::FileStore>(path, 1);
  auto pg = ampkit::distributed::store_process_group(store, 0, 1);
  torch::manual_seed(5);
  auto w = torch::randn({33}).to(at::kBFloat16).requires_grad_();
  auto unused = torch::randn({5}).to(at::kBFloat16).requires_grad_();
  w.set_grad_dtype(at::kFloat);
  unused.set_grad_dtype(at::kFloat);
  ampkit::distributed::GradientAllReduce sync({w, unused}, pg);
  const auto g = torch::randn({33}) * (1 + 0x1p-12);  // values BF16 cannot hold
  w.mutable_grad() = g.clone();
  sync.synchronize();
  CHECK(w.grad().scalar_type() == at::kFloat);
  CHECK(torch::equal(w.grad(), g));
  CHECK(unused.grad().scalar_type() == at::kFloat);  // no grad on this rank: zeros, in the grads' dtype
  CHECK(torch::equal(unused.grad(), torch::zeros({5})));
  CHECK(sync.bytes_reduced() == (33 + 5) * 4);
  std::remove(path.c_str());
}
#endif

namespace {

struct Fp8RankResult {
  std::vector<at::Tensor> before;  // this rank's amaxes before the reduction, per iteration
  std::vector<at::Tensor> after;
  std::vector<at::Tensor> scales;
};

Fp8RankResult train_fp8(int rank, int world, const std::string& path) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world);
  auto pg = ampkit::distributed::store_process_group(store, rank, world);
  torch::nn::Sequential model;
  {
    const std::lock_guard<std::mutex> lock(rng_mutex);
    torch::manual_seed(0);
    const auto recipe = ampkit::fp8::DelayedScaling().amax_history_len(3);
    model =
        torch::nn::Sequential(ampkit::fp8::Float8Linear(torch::nn::LinearOptions(16, 32), recipe), torch::nn::ReLU(),
                              ampkit::fp8::Float8Linear(torch::nn::LinearOptions(32, 16), recipe));
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(256.0).process_group(pg));
  Fp8RankResult out;
  for (int step = 0; step < 3; ++step) {
    at::Tensor x;
    {
      const std::lock_guard<std::mutex> lock(rng_mutex);
      torch::manual_seed(100 + 10 * step + rank);
      x = torch::randn({8, 16}) * (1.0 + 3.0 * rank);
    }
    opt.zero_grad();
    scaler.scale(model->forward(x).pow(2).mean()).backward();
    const auto amaxes = ampkit::fp8::current_amaxes(*model);
    out.before.push_back(torch::cat(amaxes).clone());
    scaler.reduce_with_found_inf(amaxes);
    scaler.step(opt);
    scaler.update();
    out.after.push_back(torch::cat(ampkit::fp8::current_amaxes(*model)).clone());
  }
  for (const auto& b : model->named_buffers()) {
    if (b.key().find("scale_") != std::string::npos) {
      out.scales.push_back(b.value().clone());
    }
  }
  return out;
}

}  // namespace

TEST_CASE("distributed: FP8 amaxes reduced in the scaler's found_inf all-reduce agree on every rank",
          "[distributed][fp8][cpu]") {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_test_fp8_amax_" + std::to_string(::getpid()))).string();
  std::remove(path.c_str());
  std::vector<Fp8RankResult> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { results[r] = train_fp8(r, 2, path); });
  }
  for (auto& t : threads) {
    t.join();
  }
  std::remove(path.c_str());
  for (size_t step = 0; step < 3; ++step) {
    REQUIRE(results[0].before[step].numel() == 6);
    CHECK(!torch::equal(results[0].before[step], results[1].before[step]));  // the ranks' amaxes differed
    const auto expected = torch::maximum(results[0].before[step], results[1].before[step]);
    CHECK(torch::equal(results[0].after[step], expected));
    CHECK(torch::equal(results[1].after[step], expected));
  }
  REQUIRE(results[0].scales.size() == 6);
  for (size_t i = 0; i < 6; ++i) {
    CHECK(torch::equal(results[0].scales[i], results[1].scales[i]));
  }
}

TEST_CASE("distributed: reduce_with_found_inf and all_reduce_max refuse bad arguments", "[distributed][cpu]") {
  ampkit::GradScaler plain;
  CHECK_THROWS_WITH(plain.reduce_with_found_inf({torch::zeros({1})}),
                    Catch::Contains("needs options().process_group()"));
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_test_fp8_bad_" + std::to_string(::getpid()))).string();
  std::remove(path.c_str());
  auto store = c10::make_intrusive<c10d::FileStore>(path, 1);
  auto pg = ampkit::distributed::store_process_group(store, 0, 1);
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().process_group(pg));
  CHECK_THROWS_WITH(scaler.reduce_with_found_inf({torch::zeros({1}), torch::zeros({1}, torch::kDouble)}),
                    Catch::Contains("tensors[1] must be a Float tensor, but got Double"));
  CHECK_THROWS_WITH(ampkit::distributed::all_reduce_max({torch::zeros({2}), torch::zeros({2}, torch::kHalf)}, pg),
                    Catch::Contains("tensors[1] must be floating and of tensors[0]'s dtype"));
  // One rank: the maximum is the tensor itself; a non-contiguous view is written through.
  auto t = torch::arange(6, torch::kFloat).view({2, 3});
  auto col = t.select(1, 1);
  ampkit::distributed::all_reduce_max({col, torch::ones({2})}, pg);
  CHECK(torch::equal(t, torch::arange(6, torch::kFloat).view({2, 3})));
  std::remove(path.c_str());
}
