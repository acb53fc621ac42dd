// A LibTorch program driving dynamic loss scaling with ampkit's ops: each step scales a small model's loss,
// back-propagates low-precision gradients, unscales and checks them on the device, skips the step on
// overflow and updates the loss scale, all without reading a value back to the host inside the step.
// Runs on CUDA in FP16 when a device is present, else on the CPU in BF16.
//
// Usage: ops_demo [--steps N] [--overflow-every K]
#include <torch/torch.h>

#include <ampkit/ampkit.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

int main(int argc, char** argv) {
  int steps = 60;
  int overflow_every = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) {
      steps = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--overflow-every") == 0) {
      overflow_every = std::atoi(argv[i + 1]);
    }
  }
  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  const auto lowp = cuda ? torch::kHalf : torch::kBFloat16;
  const auto info = ampkit::build_info();
  std::printf("ampkit ops demo on %s (%s), CUDA kernels compiled: %s [%s], CPU loops: %s, torch %s\n",
              cuda ? "CUDA" : "CPU", cuda ? "FP16" : "BF16", info.cuda_compiled ? "yes" : "no", info.cuda_archs,
              info.cpu_isa, info.torch_version);

  torch::manual_seed(0);
  // y = 3x - 1 + noise, learnt by a low-precision linear layer with FP32 master weights.
  auto x = torch::randn({512, 16}, device);
  auto y = x.sum(1, true) * 3 - 1 + 0.01 * torch::randn({512, 1}, device);
  auto master_w = torch::zeros({1, 16}, device);
  auto master_b = torch::zeros({1}, device);
  const double lr = 0.2;

  auto opts_f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  auto scale = torch::full({1}, 1024.f, opts_f32);
  auto growth_tracker = torch::zeros({1}, opts_f32.dtype(torch::kInt));
  auto found_inf = torch::zeros({1}, opts_f32);

  const double initial_loss = torch::mse_loss(torch::nn::functional::linear(x, master_w, master_b), y).item<double>();
  std::printf("%5s %12s %12s %8s\n", "step", "loss", "scale", "skipped");
  int skipped = 0;
  for (int step = 1; step <= steps; ++step) {
    auto w = master_w.to(lowp).requires_grad_();
    auto b = master_b.to(lowp).requires_grad_();
    auto pred = torch::nn::functional::linear(x.to(lowp), w, b);
    auto loss = torch::mse_loss(pred.to(torch::kFloat), y);
    (loss * scale).backward();

    auto grad_w = w.grad();
    auto grad_b = b.grad();
    if (overflow_every > 0 && step % overflow_every == 0) {
      grad_w.view(-1)[-1] = std::numeric_limits<float>::infinity();  // what an FP16 overflow looks like
    }
    found_inf.zero_();
    const auto inv_scale = scale.to(torch::kDouble).reciprocal().to(torch::kFloat);
    ampkit::unscale_and_check_({grad_w, grad_b}, found_inf, inv_scale);

    // Skip on the device: the update is multiplied by (1 - found_inf), no host read needed.
    const auto keep = 1 - found_inf;
    master_w.sub_(lr * keep * grad_w.to(torch::kFloat).nan_to_num(0, 0, 0));
    master_b.sub_(lr * keep * grad_b.to(torch::kFloat).nan_to_num(0, 0, 0));
    ampkit::update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 5);

    // Reported after the step, outside the hot path.
    const bool was_skipped = found_inf.item<float>() != 0.f;
    skipped += was_skipped ? 1 : 0;
    if (step % 5 == 0 || was_skipped) {
      std::printf("%5d %12.6f %12.1f %8s\n", step, loss.item<double>(), scale.item<double>(), was_skipped ? "yes" : "");
    }
  }
  const double final_loss = torch::mse_loss(torch::nn::functional::linear(x, master_w, master_b), y).item<double>();
  std::printf("final FP32 loss %.6f, skipped steps %d of %d, final scale %.1f\n", final_loss, skipped, steps,
              scale.item<double>());
  // The run must have learnt (loss down 100x) and skipped exactly the injected overflows.
  const int expected_skips = overflow_every > 0 ? steps / overflow_every : 0;
  const bool ok = final_loss < initial_loss / 100 && skipped == expected_skips;
  if (!ok) {
    std::printf("FAILED: initial loss %.6f, expected %d skipped steps\n", initial_loss, expected_skips);
  }
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
