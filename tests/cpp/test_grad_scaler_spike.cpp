// ampkit::GradScaler's spike-aware skipping from C++ (NOTE [Spike-aware skipping]): an injected loss spike skips
// its step on the generic path (torch::optim::SGD) and on the fused one (ampkit::optim::AdamW) with everything
// untouched, a gradient-norm spike only with that signal, no back-off, the count kept apart, torch::save /
// torch::load carrying the windows (a resumed run decides the same), and option checks.
#include "support/catch_torch.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ampkit/optim.h"

using ampkit::GradScaler;
using ampkit::GradScalerOptions;
using ampkit::SpikeSkipOptions;

namespace {

// Runs `steps` steps of a small regression; the loss of step i is multiplied by loss_factor[i] and the weight's
// gradient by grad_factor[i]. Returns which steps ran, and whether each step left the weights unchanged.
struct Run {
  std::vector<int> skipped;
  std::vector<bool> unchanged;
};

template <typename Opt>
Run run(GradScaler& scaler, torch::nn::Linear& model, Opt& opt, int steps, const std::map<int, float>& loss_factor,
        const std::map<int, float>& grad_factor = {}) {
  torch::manual_seed(3);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int i = 0; i < steps; ++i) {
    data.emplace_back(torch::randn({16, 5}), torch::randn({16, 2}));
  }
  Run r;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    const float lf = loss_factor.count(i) ? loss_factor.at(i) : 1.0f;
    const float gf = grad_factor.count(i) ? grad_factor.at(i) : 1.0f;
    const at::Tensor w = model->weight * gf + model->weight.detach() * (1.0f - gf);  // scales dL/dW by gf
    const at::Tensor out = torch::nn::functional::linear(data[i].first, w, model->bias);
    const at::Tensor loss = torch::mse_loss(out, data[i].second) * lf;
    scaler.scale(loss).backward();
    const at::Tensor before = model->weight.detach().clone();
    scaler.step(opt);
    scaler.update();
    if (!scaler.last_step_ran().item<bool>()) {
      r.skipped.push_back(i);
    }
    r.unchanged.push_back(torch::equal(before, model->weight));
  }
  return r;
}

GradScalerOptions spiky(bool loss = true, bool grad_norm = false) {
  return GradScalerOptions().init_scale(1024.0).spike_skip(
      SpikeSkipOptions().window(16).warmup(8).loss(loss).grad_norm(grad_norm));
}

}  // namespace

TEST_CASE("GradScaler spike_skip: a loss spike skips its step on the generic and the fused path",
          "[scaler][spike][cpu]") {
  const std::map<int, float> spikes{{3, 1e3f}, {30, 1e3f}, {50, 40.0f}};  // 3 is inside the warm-up
  SECTION("torch::optim::SGD (host read)") {
    torch::manual_seed(0);
    torch::nn::Linear model(5, 2);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
    GradScaler scaler(spiky());
    const Run r = run(scaler, model, opt, 60, spikes);
    CHECK(r.skipped == std::vector<int>{30, 50});
    CHECK(r.unchanged[30]);
    CHECK(r.unchanged[50]);
    CHECK_FALSE(r.unchanged[3]);
    CHECK(scaler.stats().spike_skipped_steps == 2);
    CHECK(scaler.stats().skipped_steps == 0);
    CHECK(scaler.get_scale() == 1024.0);
  }
  SECTION("ampkit::optim::AdamW (skips on the device)") {
    torch::manual_seed(0);
    torch::nn::Linear model(5, 2);
    ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-2));
    GradScaler scaler(spiky());
    const Run r = run(scaler, model, opt, 60, spikes);
    CHECK(r.skipped == std::vector<int>{30, 50});
    CHECK(r.unchanged[30]);
    CHECK(scaler.stats().spike_skipped_steps == 2);
  }
}

TEST_CASE("GradScaler spike_skip: a gradient-norm spike needs the grad_norm signal", "[scaler][spike][cpu]") {
  const std::map<int, float> grad_spikes{{25, 1e3f}};
  for (const bool grad_norm : {true, false}) {
    torch::manual_seed(0);
    torch::nn::Linear model(5, 2);
    ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-2));
    GradScaler scaler(spiky(/*loss=*/!grad_norm, grad_norm));
    const Run r = run(scaler, model, opt, 35, {}, grad_spikes);
    CHECK(r.skipped == (grad_norm ? std::vector<int>{25} : std::vector<int>{}));
  }
}

TEST_CASE("GradScaler spike_skip: torch::save and torch::load carry the windows", "[scaler][spike][cpu]") {
  const std::map<int, float> spikes{{20, 1e3f}, {41, 1e3f}};
  torch::manual_seed(0);
  torch::nn::Linear whole_model(5, 2);
  torch::optim::SGD whole_opt(whole_model->parameters(), torch::optim::SGDOptions(1e-2));
  GradScaler whole(spiky());
  const Run uninterrupted = run(whole, whole_model, whole_opt, 45, spikes);
  REQUIRE(uninterrupted.skipped == std::vector<int>{20, 41});

  // The same run in two halves: 40 steps, a checkpoint, a new scaler, the last 5 steps on the same data.
  torch::manual_seed(0);
  torch::nn::Linear model(5, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-2));
  GradScaler first(spiky());
  run(first, model, opt, 40, spikes);
  const std::string path = (std::filesystem::temp_directory_path() / "ampkit_spike_scaler.pt").string();
  torch::save(first, path);
  GradScaler resumed(spiky());
  torch::load(resumed, path);
  std::remove(path.c_str());
  CHECK(resumed.stats().spike_skipped_steps == 1);
  const auto state = resumed.state_dict();
  const auto find = [&](const std::string& key) {
    for (const auto& [k, v] : state) {
      if (k == key) {
        return v;
      }
    }
    return c10::IValue();
  };
  CHECK(find("_spike_loss_count").toInt() == 40);
  CHECK(find("_spike_loss_history").toDoubleVector().size() == 16);
  // Steps 40..44 of the data: replay the data generator, skipping what the first half consumed.
  torch::manual_seed(3);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int i = 0; i < 45; ++i) {
    data.emplace_back(torch::randn({16, 5}), torch::randn({16, 2}));
  }
  std::vector<int> skipped;
  for (int i = 40; i < 45; ++i) {
    opt.zero_grad();
    const at::Tensor loss = torch::mse_loss(model(data[i].first), data[i].second) * (spikes.count(i) ? 1e3f : 1.0f);
    resumed.scale(loss).backward();
    resumed.step(opt);
    resumed.update();
    if (!resumed.last_step_ran().item<bool>()) {
      skipped.push_back(i);
    }
  }
  CHECK(skipped == std::vector<int>{41});
  CHECK(torch::equal(model->weight, whole_model->weight));
}

TEST_CASE("GradScaler spike_skip: options are checked", "[scaler][spike][cpu]") {
  auto message = [](const SpikeSkipOptions& o) {
    try {
      GradScaler s(GradScalerOptions().spike_skip(o));
    } catch (const c10::ValueError& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  CHECK_THAT(message(SpikeSkipOptions().window(1)), Catch::Contains("spike_skip window must be in [2, 2^24]"));
  CHECK_THAT(message(SpikeSkipOptions().warmup(129)), Catch::Contains("warmup must be in [2, window] = [2, 128]"));
  CHECK_THAT(message(SpikeSkipOptions().sigmas(-1.0)), Catch::Contains("sigmas must be a finite number > 0"));
  CHECK_THAT(message(SpikeSkipOptions().loss(false)), Catch::Contains("spike_skip needs a signal"));
  CHECK(message(SpikeSkipOptions()) == "no error");
}
