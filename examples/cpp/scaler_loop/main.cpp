// A LibTorch training loop with ampkit::GradScaler: autocast forward (BF16 on the CPU, FP16 on CUDA), scaled
// backward, gradient clipping on unscaled grads, a skipped step on an injected overflow, and a checkpoint of
// the scaler written with torch::save (Python reads it with ampkit.load_scaler_state).
//
// Usage: scaler_loop [checkpoint_path]
#include <torch/torch.h>

#include <ampkit/ampkit.h>

#include <cstdio>
#include <limits>

int main(int argc, char** argv) {
  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const auto lowp = cuda ? torch::kHalf : torch::kBFloat16;
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(1024.0).growth_interval(20));

  auto x = torch::randn({256, 32}, device);
  auto y = x.narrow(1, 0, 4).sum(1, true);
  for (int step = 1; step <= 60; ++step) {
    optimizer.zero_grad();
    at::Tensor loss;
    {
      ampkit::AutocastGuard autocast(device.type(), lowp);  // torch.autocast's scope, in C++
      loss = torch::mse_loss(model->forward(x).to(torch::kFloat), y);
    }

    scaler.scale(loss).backward();
    if (step == 30) {
      model->parameters().back().mutable_grad()[0] = std::numeric_limits<float>::infinity();
    }
    scaler.unscale_(optimizer);  // grads are now true grads: clip them
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    scaler.step(optimizer);  // skipped when a grad held Inf/NaN
    scaler.update();
    if (step % 10 == 0) {
      std::printf("step %3d  loss %.5f  scale %.0f\n", step, loss.item<double>(), scaler.get_scale());
    }
  }
  const auto stats = scaler.stats();
  std::printf("steps %lld, skipped %lld (last: step %lld), final scale %.0f\n", static_cast<long long>(stats.steps),
              static_cast<long long>(stats.skipped_steps), static_cast<long long>(stats.last_overflow_step),
              stats.scale);
  if (argc > 1) {
    torch::save(scaler, argv[1]);
    std::printf("scaler checkpoint written to %s\n", argv[1]);
  }
  return stats.skipped_steps == 1 && stats.last_overflow_step == 30 ? 0 : 1;
}
