// Data-parallel training from a LibTorch program: each process is one rank; ampkit::distributed::GradientAllReduce
// averages the gradients over a c10d process group, compressed to FP16 and unscaled and checked for the
// GradScaler on the way back, and ampkit::optim::AdamW steps without a host sync. The model is train_demo's
// classifier (64 -> 256 -> 256 -> 10, LayerNorm, ReLU), the data a fixed synthetic 10-class problem (labels from a
// random teacher network), each rank taking its share of every global batch.
//
// Usage: ddp_demo STORE_FILE RANK WORLD_SIZE [--steps N] [--compression none|fp16|bf16]
//   Start WORLD_SIZE processes with the same STORE_FILE (a path on a shared file system) and ranks 0..WORLD_SIZE-1.
//   The process group is ampkit's store process group (NOTE [Store process group]): the PyPI wheel's headers
//   cannot construct torch's Gloo group; a program built where they can (or on GPUs, with NCCL) passes that one.
// Prints the loss every 10 steps (rank 0) and, at the end, a checksum of the weights that is the same on every rank.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <ampkit/ampkit.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(1);
  return torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::LayerNorm(torch::nn::LayerNormOptions({256})),
                               torch::nn::ReLU(), torch::nn::Linear(256, 256),
                               torch::nn::LayerNorm(torch::nn::LayerNormOptions({256})), torch::nn::ReLU(),
                               torch::nn::Linear(256, 10));
}

// Step `step`'s global batch (the same on every rank and for every world size), this rank's rows of it.
std::pair<torch::Tensor, torch::Tensor> batch(const torch::Tensor& teacher, int step, int rank, int world,
                                              int64_t per_rank) {
  torch::manual_seed(1000 + step);
  const auto x = torch::randn({per_rank * world, 64});
  const auto y = x.matmul(teacher).argmax(1);
  return {x.narrow(0, rank * per_rank, per_rank), y.narrow(0, rank * per_rank, per_rank)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s STORE_FILE RANK WORLD_SIZE [--steps N] [--compression none|fp16|bf16]\n", argv[0]);
    return 2;
  }
  const std::string store_path = argv[1];
  const int rank = std::atoi(argv[2]);
  const int world = std::atoi(argv[3]);
  int steps = 60;
  auto compression = ampkit::distributed::Compression::kFP16;
  for (int i = 4; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) {
      steps = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--compression") == 0) {
      const std::string c = argv[i + 1];
      compression = c == "none"   ? ampkit::distributed::Compression::kNone
                    : c == "bf16" ? ampkit::distributed::Compression::kBF16
                                  : ampkit::distributed::Compression::kFP16;
    }
  }
  torch::set_num_threads(1);  // one core per rank
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto process_group = ampkit::distributed::store_process_group(store, rank, world);

  auto model = make_model();
  ampkit::optim::AdamW optimizer(model->parameters(), ampkit::optim::AdamWOptions(2e-3));
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(65536.0).growth_interval(20));
  ampkit::distributed::GradientAllReduce sync(
      model->parameters(), process_group,
      ampkit::distributed::GradientAllReduceOptions().compression(compression).bucket_bytes(int64_t{1} << 18), &scaler);

  torch::manual_seed(7);
  const auto teacher = torch::randn({64, 10});
  const int64_t per_rank = 64 / world;
  double first_loss = 0.0;
  double loss_value = 0.0;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(teacher, step, rank, world, per_rank);
    optimizer.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(x), y);
    scaler.scale(loss).backward();
    sync.synchronize();  // averaged, unscaled grads; the scaler holds the Inf/NaN flag of the reduced buckets
    scaler.step(optimizer);
    scaler.update();
    loss_value = loss.item<double>();
    if (step == 0) {
      first_loss = loss_value;
    }
    if (rank == 0 && step % 10 == 0) {
      std::printf("step %3d  loss %.4f  scale %.0f\n", step, loss_value, scaler.get_scale());
    }
  }
  double checksum = 0.0;
  for (const auto& p : model->parameters()) {
    checksum += p.detach().to(torch::kDouble).abs().sum().item<double>();
  }
  const auto stats = scaler.stats();
  std::printf("rank %d: first loss %.4f, last loss %.4f, skipped %lld of %lld steps, sent %lld bytes in %lld "
              "all-reduces, weight checksum %.17g\n",
              rank, first_loss, loss_value, static_cast<long long>(stats.skipped_steps),
              static_cast<long long>(stats.steps), static_cast<long long>(sync.bytes_reduced()),
              static_cast<long long>(sync.allreduces()), checksum);
  return 0;
}
