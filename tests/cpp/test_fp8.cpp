// ampkit::fp8::Float8Linear and the FP8 ops through LibTorch on the CPU: SQNR against torch::nn::Linear, the
// delayed-scaling buffers and their serialization, bad input.

#include "support/catch_torch.h"
#include <unistd.h>

#include <ampkit/ampkit.h>

#include <cmath>
#include <filesystem>
#include <string>

namespace {

double sqnr(const at::Tensor& ref, const at::Tensor& got) {
  const auto r = ref.to(at::kDouble);
  const auto g = got.to(at::kDouble);
  return 10.0 * std::log10(r.pow(2).sum().item<double>() / (r - g).pow(2).sum().item<double>());
}

}  // namespace

TEST_CASE("fp8 Float8Linear: current tensorwise scaling by default, close to nn::Linear", "[fp8][cpu]") {
  torch::manual_seed(0);
  ampkit::fp8::Float8Linear f8(torch::nn::LinearOptions(128, 64));
  torch::nn::Linear ref(torch::nn::LinearOptions(128, 64));
  {
    torch::NoGradGuard no_grad;
    ref->weight.copy_(f8->weight);
    ref->bias.copy_(f8->bias);
  }
  REQUIRE(std::holds_alternative<ampkit::fp8::CurrentScaling>(f8->recipe));
  REQUIRE(f8->named_buffers().size() == 0);
  const auto x = torch::randn({4, 32, 128});
  const auto dy = torch::randn({4, 32, 64});
  auto x8 = x.clone().requires_grad_();
  auto xr = x.clone().requires_grad_();
  const auto y8 = f8->forward(x8);
  const auto yr = ref->forward(xr);
  REQUIRE(y8.sizes() == yr.sizes());
  REQUIRE(y8.scalar_type() == at::kFloat);
  y8.backward(dy);
  yr.backward(dy);
  CHECK(sqnr(yr, y8) >= 25.0);
  CHECK(sqnr(xr.grad(), x8.grad()) >= 20.0);
  CHECK(sqnr(ref->weight.grad(), f8->weight.grad()) >= 20.0);
  CHECK(torch::allclose(ref->bias.grad(), f8->bias.grad()));
}

TEST_CASE("fp8 Float8Linear: delayed scaling keeps its histories and scales as buffers, saved and loaded",
          "[fp8][cpu]") {
  torch::manual_seed(1);
  const auto recipe = ampkit::fp8::DelayedScaling().amax_history_len(8).amax_compute_algo("most_recent");
  ampkit::fp8::Float8Linear f8(torch::nn::LinearOptions(32, 48), recipe);
  REQUIRE(f8->named_buffers().size() == 6);
  const auto x = torch::randn({16, 32});
  const auto dy = torch::randn({16, 48});
  f8->forward(x).backward(dy);
  CHECK(f8->amax_history_input[0].item<float>() == x.abs().amax().item<float>());
  CHECK(f8->amax_history_grad_output[0].item<float>() == dy.abs().amax().item<float>());
  CHECK(f8->scale_input.item<float>() == 1.f);  // iteration 0 ran with the initial scales
  f8->forward(x).backward(dy);
  CHECK(f8->scale_input.item<float>() == 448.f / x.abs().amax().item<float>());
  CHECK(f8->scale_grad_output.item<float>() == 57344.f / dy.abs().amax().item<float>());
  const auto path = std::filesystem::temp_directory_path() / ("ampkit_fp8_" + std::to_string(::getpid()) + ".pt");
  torch::save(f8, path.string());
  ampkit::fp8::Float8Linear loaded(torch::nn::LinearOptions(32, 48), recipe);
  torch::load(loaded, path.string());
  std::filesystem::remove(path);
  CHECK(torch::equal(loaded->scale_grad_output, f8->scale_grad_output));
  CHECK(torch::equal(loaded->amax_history_weight, f8->amax_history_weight));
  loaded->eval();
  f8->eval();
  CHECK(torch::equal(loaded->forward(x), f8->forward(x)));
}

TEST_CASE("fp8 ops from C++: quantize's amax, empty update lists, bad input", "[fp8][cpu]") {
  const auto x = torch::randn({8, 16}) * 1000;
  const auto [q, amax, q_t] = ampkit::fp8_quantize(x, torch::ones({1}), at::ScalarType::Float8_e4m3fn, false);
  CHECK(amax.item<float>() == x.abs().amax().item<float>());
  CHECK(!q_t.has_value());
  CHECK(q.to(at::kFloat).abs().amax().item<float>() == 448.f);  // saturated, not NaN
  ampkit::fp8_update_amax_history_and_scale_({}, {}, "max", {448.0}, 0.0);
  CHECK_THROWS_WITH(ampkit::fp8_update_amax_history_and_scale_({}, {}, "mean", {448.0}, 0.0),
                    Catch::Contains("ampkit::fp8_update_amax_history_and_scale_: amax_compute_algo"));
  CHECK_THROWS_WITH(ampkit::fp8::Float8Linear(torch::nn::LinearOptions(20, 32)), Catch::Contains("multiples of 16"));
  CHECK_THROWS_WITH(ampkit::fp8::Float8Linear(torch::nn::LinearOptions(32, 32),
                                              ampkit::fp8::CurrentScaling().granularity("columnwise")),
                    Catch::Contains("granularity must be 'tensorwise' or 'rowwise', but got 'columnwise'"));
}

TEST_CASE("fp8 Float8Linear: casts and decorate keep the scaling state FP32, rowwise scaling", "[fp8][cpu]") {
  torch::manual_seed(1);
  const auto delayed = ampkit::fp8::DelayedScaling().amax_history_len(4);
  torch::nn::Sequential model(ampkit::fp8::Float8Linear(torch::nn::LinearOptions(32, 32), delayed));
  model->forward(torch::randn({4, 32})).sum().backward();
  auto layer = model[0]->as<ampkit::fp8::Float8LinearImpl>();
  REQUIRE(layer != nullptr);
  const float odd = 1.0f + std::ldexp(1.0f, -20);  // not a BF16 value: a round trip through BF16 would change it
  layer->amax_history_input[0].fill_(odd);
  SECTION("to(dtype) and to(device, dtype)") {
    model->to(torch::kBFloat16);
    CHECK(layer->weight.scalar_type() == at::kBFloat16);
    model->to(torch::kCPU, torch::kHalf);
    CHECK(layer->weight.scalar_type() == at::kHalf);
  }
  SECTION("decorate O2 with a master-weight optimizer") {
    ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-3));
    model->zero_grad();  // the FP32 grads of the first backward
    ampkit::decorate(*model, opt, ampkit::OptLevel::kO2, torch::kBFloat16);
    CHECK(layer->weight.scalar_type() == at::kBFloat16);
    const auto x = torch::randn({4, 32}, torch::kBFloat16);
    model->forward(x).sum().backward();
    opt.step();
    CHECK(layer->amax_history_input[3].item<float>() == odd);  // rolled to the last row by the forward, exact
  }
  for (const auto& b : layer->named_buffers()) {
    CHECK(b.value().scalar_type() == at::kFloat);
  }
  ampkit::fp8::Float8Linear rowwise(torch::nn::LinearOptions(64, 32),
                                    ampkit::fp8::CurrentScaling().granularity("rowwise"));
  const auto x = torch::randn({16, 64}) * torch::logspace(-3, 3, 16).view({16, 1});  // rows of every magnitude
  const auto ref = torch::nn::functional::linear(x, rowwise->weight, rowwise->bias);
  CHECK(sqnr(ref, rowwise->forward(x)) >= 25.0);
}
