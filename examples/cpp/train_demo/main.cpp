// ampkit's demo: one LibTorch program trains the same classifier on the handwritten-digits dataset in FP32, O1
// (AutocastGuard + GradScaler + LibTorch's AdamW) and O2 (decorate + ampkit::optim::AdamW with FP32 masters +
// GradScaler, sync-free), on CUDA in FP16 when a device is present, else on the CPU in BF16; prints a table per
// mode and writes the loss and loss-scale history as CSV (scripts/demo.sh plots it).
//
// Usage: train_demo DATA_PATH [--history CSV] [--grad-log JSONL] [--epochs N] [--inject-overflow K]
//   --grad-log: every 50 steps of O2, the scaler's statistics and each parameter's gradient statistics
//     (ampkit::GradStatsLog; `python -m ampkit.monitor JSONL LOGDIR` for TensorBoard, plot_demo.py's third panel).
//   --inject-overflow K: every K steps of O1/O2, write Inf into one gradient, as an FP16 overflow would; the
//   scaler backs off, skips the step, recovers, and its overflow report names the parameter.
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/torch.h>

#include <ampkit/ampkit.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>

namespace {

struct Data {
  torch::Tensor x_train, y_train, x_test, y_test;
};

Data load(const std::string& path, const torch::Device& device) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, "cannot open ", path, " (scripts/demo.sh exports it with examples/python/export_digits.py)");
  int32_t n = 0;
  int32_t d = 0;
  f.read(reinterpret_cast<char*>(&n), 4);
  f.read(reinterpret_cast<char*>(&d), 4);
  auto x = torch::empty({n, d}, torch::kFloat);
  auto y = torch::empty({n}, torch::kLong);
  f.read(reinterpret_cast<char*>(x.data_ptr<float>()), static_cast<std::streamsize>(x.nbytes()));
  f.read(reinterpret_cast<char*>(y.data_ptr<int64_t>()), static_cast<std::streamsize>(y.nbytes()));
  TORCH_CHECK(f, "truncated data file ", path);
  torch::manual_seed(0);
  const auto perm = torch::randperm(n);
  x = x.index_select(0, perm);
  y = y.index_select(0, perm);
  const int64_t n_test = n / 6;
  return {x.narrow(0, n_test, n - n_test).to(device), y.narrow(0, n_test, n - n_test).to(device),
          x.narrow(0, 0, n_test).to(device), y.narrow(0, 0, n_test).to(device)};
}

// fp8: the 64->256 and 256->256 layers as ampkit::fp8::Float8Linear with delayed scaling (the same initialisation);
// 256->10 stays torch::nn::Linear (FP8 GEMMs take multiples of 16).
torch::nn::Sequential make_model(bool fp8) {
  torch::manual_seed(1);
  const auto recipe = ampkit::fp8::DelayedScaling().amax_history_len(16);
  auto linear = [&](int64_t in, int64_t out) -> torch::nn::AnyModule {
    return fp8 ? torch::nn::AnyModule(ampkit::fp8::Float8Linear(torch::nn::LinearOptions(in, out), recipe))
               : torch::nn::AnyModule(torch::nn::Linear(in, out));
  };
  torch::nn::Sequential model;
  model->push_back(linear(64, 256));
  model->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({256})));
  model->push_back(torch::nn::ReLU());
  model->push_back(linear(256, 256));
  model->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({256})));
  model->push_back(torch::nn::ReLU());
  model->push_back(torch::nn::Linear(256, 10));
  return model;
}

struct Result {
  std::string mode;
  double loss = 0;       // the last training batch's
  double test_loss = 0;  // cross-entropy on the held-out digits
  double accuracy = 0;
  double steps_per_s = 0;
  double state_mb = 0;
  double peak_mb = -1;
  int64_t skipped = 0;
  double scale = 1;
};

// Peak resident set of this process since the last reset, in MB (Linux: VmHWM; reset by writing 5 to
// /proc/self/clear_refs). -1 where unavailable.
double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      double kb = 0;
      status >> kb;
      return kb / 1e3;
    }
  }
  return -1;
}

void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

double state_mb(const torch::nn::Module& model, const torch::optim::Optimizer& opt) {
  double bytes = 0;
  for (const auto& p : model.parameters()) {
    bytes += static_cast<double>(p.nbytes());
  }
  for (const auto& [key, state] : opt.state()) {
    if (const auto* s = dynamic_cast<const ampkit::optim::AdamParamState*>(state.get())) {
      for (const auto& t : {s->exp_avg(), s->exp_avg_sq(), s->master_param()}) {
        bytes += t.defined() ? static_cast<double>(t.nbytes()) : 0.0;
      }
    } else if (const auto* t = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      bytes += static_cast<double>(t->exp_avg().nbytes() + t->exp_avg_sq().nbytes());
    }
  }
  return bytes / 1e6;
}

Result train(const std::string& mode, const Data& data, const torch::Device& device, torch::ScalarType lowp, int epochs,
             int inject_every, std::ofstream& history, ampkit::GradStatsLog* grad_log) {
  const bool o2 = mode == "o2" || mode == "o2fp8";
  auto model = make_model(mode == "o2fp8");
  model->to(device);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (o2) {
    auto adamw = std::make_unique<ampkit::optim::AdamW>(model->parameters(), ampkit::optim::AdamWOptions(2e-3));
    adamw->init_master_params();  // FP32 masters from the FP32 weights, then the cast
    ampkit::decorate(*model, ampkit::OptLevel::kO2, lowp);
    opt = std::move(adamw);
  } else {
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(2e-3));
  }
  ampkit::GradScaler scaler(ampkit::GradScalerOptions()
                                .init_scale(65536.0)
                                .growth_interval(200)
                                .enabled(mode != "fp32")
                                .overflow_report(true));
  scaler.set_parameter_names([&] {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : model->named_parameters()) {
      named.emplace_back(p.key(), p.value());
    }
    return named;
  }());
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
  } else {
    reset_peak_rss();
  }
  const int64_t n = data.x_train.size(0);
  const int64_t batch = 50;
  int64_t step = 0;
  bool reported = false;
  double last_loss = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    const auto perm = torch::randperm(n, torch::TensorOptions().device(device));
    for (int64_t b = 0; b + batch <= n; b += batch) {
      const auto idx = perm.narrow(0, b, batch);
      const auto x = data.x_train.index_select(0, idx);
      const auto y = data.y_train.index_select(0, idx);
      opt->zero_grad();
      torch::Tensor loss;
      if (mode == "o1") {
        ampkit::AutocastGuard autocast(device.type(), lowp);
        loss = torch::cross_entropy_loss(model->forward(x).to(torch::kFloat), y);
      } else if (o2) {
        loss = torch::cross_entropy_loss(model->forward(x.to(lowp)).to(torch::kFloat), y);
      } else {
        loss = torch::cross_entropy_loss(model->forward(x), y);
      }
      scaler.scale(loss).backward();
      ++step;
      if (mode == "o2" && grad_log != nullptr) {
        grad_log->log(step, model->named_parameters(), &scaler);  // grads still scaled: statistics of g / scale
      }
      const bool inject = mode != "fp32" && inject_every > 0 && step % inject_every == 0;
      if (inject) {
        model->named_parameters()["3.weight"].mutable_grad().view(-1)[7] = std::numeric_limits<float>::infinity();
      }
      scaler.step(*opt);
      scaler.update();
      if (inject && !reported) {
        reported = true;
        std::printf("  [%s] step %lld: injected Inf -> step skipped: %s, overflow report: ", mode.c_str(),
                    static_cast<long long>(step), scaler.last_step_ran().item<bool>() ? "no" : "yes");
        for (const auto& name : scaler.overflow_report()) {
          std::printf("%s ", name.c_str());
        }
        std::printf("\n");
      }
      // For the history only (after the step: the O2 step itself made no host read).
      last_loss = loss.item<double>();
      const bool skipped = scaler.is_enabled() && !scaler.last_step_ran().item<bool>();
      history << mode << "," << step << "," << last_loss << "," << scaler.get_scale() << "," << (skipped ? 1 : 0)
              << "\n";
    }
    if (epoch % 10 == 0 || epoch == epochs) {
      std::printf("  [%s] epoch %3d  loss %.4f  scale %.0f\n", mode.c_str(), epoch, last_loss, scaler.get_scale());
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Result r;
  r.mode = mode;
  r.loss = last_loss;
  {
    const torch::NoGradGuard no_grad;
    model->eval();
    auto x = o2 ? data.x_test.to(lowp) : data.x_test;
    const auto logits = model->forward(x).to(torch::kFloat);
    r.accuracy = logits.argmax(1).eq(data.y_test).to(torch::kDouble).mean().item<double>();
    r.test_loss = torch::cross_entropy_loss(logits, data.y_test).item<double>();
  }
  r.steps_per_s = static_cast<double>(step) / seconds;
  r.state_mb = state_mb(*model, *opt);
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    r.peak_mb = static_cast<double>(stats.allocated_bytes[0].peak) / 1e6;
  } else {
    r.peak_mb = peak_rss_mb();
  }
  const auto s = scaler.stats();
  r.skipped = s.skipped_steps;
  r.scale = mode == "fp32" ? 1.0 : s.scale;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: train_demo DATA_PATH [--history CSV] [--grad-log JSONL] [--epochs N] [--inject-overflow K]\n");
    return 2;
  }
  // Line-buffered: each progress line shows when it is printed, through a pipe too.
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  std::string history_path = "demo_history.csv";
  std::string grad_log_path;
  int epochs = 40;
  int inject = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--history") == 0) {
      history_path = argv[i + 1];
    } else if (std::strcmp(argv[i], "--grad-log") == 0) {
      grad_log_path = argv[i + 1];
    } else if (std::strcmp(argv[i], "--epochs") == 0) {
      epochs = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--inject-overflow") == 0) {
      inject = std::atoi(argv[i + 1]);
    }
  }
  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const auto lowp = cuda ? torch::kHalf : torch::kBFloat16;
  const Data data = load(argv[1], device);
  std::printf("ampkit demo: digits (%lld train / %lld test), MLP 64-256-256-10 with LayerNorm, AdamW, %d epochs, "
              "%s, low precision %s\n",
              static_cast<long long>(data.x_train.size(0)), static_cast<long long>(data.x_test.size(0)), epochs,
              cuda ? "CUDA" : "CPU", cuda ? "FP16" : "BF16");
  std::ofstream history(history_path);
  std::unique_ptr<ampkit::GradStatsLog> grad_log;
  if (!grad_log_path.empty()) {
    std::ofstream(grad_log_path, std::ios::trunc).close();  // a fresh log per run
    grad_log = std::make_unique<ampkit::GradStatsLog>(grad_log_path, 50);
  }
  history << "mode,step,loss,scale,skipped\n";
  std::vector<Result> results;
  for (const char* mode : {"fp32", "o1", "o2", "o2fp8"}) {
    std::printf("training %s ...\n", mode);
    results.push_back(train(mode, data, device, lowp, epochs, inject, history, grad_log.get()));
  }
  std::printf("\n%-6s %9s %9s %9s %9s %9s %9s %8s %12s\n", "mode", "test loss", "test acc", "steps/s", "vs FP32",
              "state MB", cuda ? "peak MB" : "peak RSS", "skipped", "final scale");
  bool ok = true;
  for (const auto& r : results) {
    std::printf("%-6s %9.4f %8.1f%% %9.1f %8.2fx %9.2f %9s %8lld %12.0f\n", r.mode.c_str(), r.test_loss,
                100 * r.accuracy, r.steps_per_s, r.steps_per_s / results.front().steps_per_s, r.state_mb,
                r.peak_mb < 0 ? "n/a" : std::to_string(static_cast<int>(r.peak_mb)).c_str(),
                static_cast<long long>(r.skipped), r.scale);
    ok = ok && r.accuracy > 0.9;
  }
  std::printf("test loss: cross-entropy on the %lld held-out digits; vs FP32: steps/s over FP32's\n",
              static_cast<long long>(data.x_test.size(0)));
  std::printf("history written to %s\n", history_path.c_str());
  return ok ? 0 : 1;
}
