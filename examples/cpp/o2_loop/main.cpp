// O2 in a LibTorch program: the model runs in FP16 (CUDA) or BF16 (CPU), ampkit::optim::AdamW keeps FP32 masters
// taken from the FP32 weights before the cast and writes the rounded weights back in the same fused pass, and
// ampkit::GradScaler drives it without a host sync (FP16: dynamic scaling; BF16: check-and-skip only).
#include <torch/torch.h>

#include <ampkit/ampkit.h>

#include <cstdio>

int main() {
  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const auto lowp = cuda ? torch::kHalf : torch::kBFloat16;
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  model->to(device);

  ampkit::optim::AdamW optimizer(model->parameters(), ampkit::optim::AdamWOptions(3e-3));
  optimizer.init_master_params();  // FP32 masters from the FP32 weights...
  model->to(lowp);                 // ...then the model goes low precision
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(1024.0).scaling(lowp == torch::kHalf));

  auto x = torch::randn({512, 32}, device);
  auto y = torch::sin(x.narrow(1, 0, 4).sum(1, true));
  double first = 0;
  double last = 0;
  for (int step = 1; step <= 200; ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x.to(lowp)).to(torch::kFloat), y);
    scaler.scale(loss).backward();
    scaler.step(optimizer);  // fused: unscale inline, skip on the device on overflow
    scaler.update();
    if (step == 1) {
      first = loss.item<double>();
    }
    if (step % 50 == 0) {
      last = loss.item<double>();
      std::printf("step %3d  loss %.5f  scale %.0f\n", step, last, scaler.get_scale());
    }
  }
  const at::Tensor w = model->parameters()[0];
  const auto& state = static_cast<ampkit::optim::AdamParamState&>(*optimizer.state().at(w.unsafeGetTensorImpl()));
  const bool rounded = torch::equal(w, state.master_param().to(lowp));
  std::printf("weights %s, masters %s, weight == master rounded: %s\n", c10::toString(w.scalar_type()),
              c10::toString(state.master_param().scalar_type()), rounded ? "yes" : "no");
  return (last < first / 5 && rounded) ? 0 : 1;
}
