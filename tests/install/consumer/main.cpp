// Trains y = 2x for a few steps with ampkit's scaler and fused AdamW on the CPU; exits non-zero unless the loss
// falls and the build information is what the install claims.
#include <ampkit/ampkit.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  torch::manual_seed(0);
  auto w = torch::zeros({1}, torch::requires_grad());
  ampkit::optim::AdamW opt({w}, ampkit::optim::AdamWOptions(0.1).weight_decay(0.0));
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(1024.0));
  const auto x = torch::randn({64, 1});
  const auto y = 2 * x;
  double first = 0, last = 0;
  for (int step = 0; step < 50; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(x * w, y);
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    (step == 0 ? first : last) = loss.item<double>();
  }
  const ampkit::BuildInfo info = ampkit::build_info();
  const bool want_cuda = argc > 1 && std::strcmp(argv[1], "--expect-cuda") == 0;
  std::printf("consumer: loss %.4f -> %.4f, torch %s, cuda compiled %d, cpu loops %s\n", first, last,
              info.torch_version, info.cuda_compiled, info.cpu_isa);
  return last < first / 10 && info.cuda_compiled == want_cuda ? 0 : 1;
}
