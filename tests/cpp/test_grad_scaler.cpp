// ampkit::GradScaler from C++ with torch::optim optimizers: the scale follows torch's rule, skipped steps leave
// everything untouched, unskipped steps equal an unscaled FP32 run bit for bit (power-of-two scales are exact),
// error messages, hysteresis and bounds, torch::save / torch::load, and two ranks over a c10d process group.
#include "support/catch_torch.h"
#include "support/scaler_scenarios.h"
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <sstream>
#include <thread>

#include "support/test_helpers.h"

using ampkit::GradScaler;
using ampkit::GradScalerOptions;
using ampkit::test::bits_equal;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Problem {
  torch::nn::Linear model{nullptr};
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
};

Problem make_problem(int steps) {
  torch::manual_seed(0);
  Problem p{torch::nn::Linear(16, 4), {}};
  for (int i = 0; i < steps; ++i) {
    p.data.emplace_back(torch::randn({32, 16}), torch::randn({32, 4}));
  }
  return p;
}

// Independent statement of torch._amp_update_scale_'s rule.
struct ReferenceScale {
  double scale;
  int64_t tracker = 0;
  void update(bool overflow, int64_t interval) {
    if (overflow) {
      scale *= 0.5;
      tracker = 0;
    } else if (++tracker == interval) {
      scale *= 2.0;
      tracker = 0;
    }
  }
};

template <typename MakeOptimizer>
void require_matches_unscaled_run(MakeOptimizer make_optimizer) {
  const int steps = 30;
  const std::set<int> overflow_steps = {2, 3, 17};
  Problem scaled = make_problem(steps);
  Problem plain = make_problem(steps);
  auto opt_scaled = make_optimizer(scaled.model->parameters());
  auto opt_plain = make_optimizer(plain.model->parameters());
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(4));
  ReferenceScale ref{1024.0};
  for (int step = 0; step < steps; ++step) {
    const auto& [x, y] = scaled.data[step];
    opt_scaled.zero_grad();
    scaler.scale(torch::mse_loss(scaled.model(x), y)).backward();
    const bool overflow = overflow_steps.count(step) > 0;
    if (overflow) {
      scaled.model->bias.mutable_grad()[3] = step == 3 ? std::nan("") : kInf;
    }
    const auto before = scaled.model->weight.detach().clone();
    scaler.step(opt_scaled);
    scaler.update();
    ref.update(overflow, 4);
    REQUIRE(scaler.get_scale() == ref.scale);
    REQUIRE(scaler.last_step_ran().item<bool>() == !overflow);
    if (overflow) {
      REQUIRE(bits_equal(scaled.model->weight.detach(), before));
      continue;
    }
    opt_plain.zero_grad();
    torch::mse_loss(plain.model(x), y).backward();
    opt_plain.step();
    REQUIRE(bits_equal(scaled.model->weight.detach(), plain.model->weight.detach()));
    REQUIRE(bits_equal(scaled.model->bias.detach(), plain.model->bias.detach()));
  }
  const auto stats = scaler.stats();
  CHECK(stats.steps == steps);
  CHECK(stats.skipped_steps == 3);
  CHECK(stats.last_overflow_step == 18);
}

}  // namespace

TEST_CASE("GradScaler: SGD with momentum equals an unscaled run and skips overflow steps", "[scaler][cpu]") {
  require_matches_unscaled_run([](std::vector<at::Tensor> params) {
    return torch::optim::SGD(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  });
}

TEST_CASE("GradScaler: Adam equals an unscaled run and skips overflow steps", "[scaler][cpu]") {
  require_matches_unscaled_run([](std::vector<at::Tensor> params) {
    return torch::optim::Adam(params, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
  });
}

TEST_CASE("GradScaler: unscale_ then clipping, and the stage errors torch raises", "[scaler][cpu]") {
  Problem p = make_problem(1);
  torch::optim::SGD opt(p.model->parameters(), 0.1);
  GradScaler scaler;
  // C++ callers get C++ advice (Python callers get torch's wording, see test_grad_scaler.py).
  REQUIRE_THROWS_WITH(scaler.step(opt), Catch::Contains("GradScaler::step: the scaler has no scale yet: call "
                                                        "scaler.scale(loss) in this iteration before step()"));
  scaler.scale(torch::mse_loss(p.model(p.data[0].first), p.data[0].second)).backward();
  const auto scaled_grad = p.model->weight.grad().clone();
  scaler.unscale_(opt);
  REQUIRE(bits_equal(p.model->weight.grad(), scaled_grad / 65536.0));
  torch::nn::utils::clip_grad_norm_(p.model->parameters(), 0.1);
  REQUIRE_THROWS_WITH(
      scaler.unscale_(opt),
      Catch::StartsWith("unscale_() has already been called on this optimizer since the last update()."));
  scaler.step(opt);
  REQUIRE_THROWS_WITH(scaler.step(opt), Catch::StartsWith("step() has already been called since the last update()."));
  REQUIRE_THROWS_WITH(scaler.unscale_(opt), Catch::StartsWith("unscale_() is being called after step()."));
  scaler.update();
  REQUIRE_THROWS_AS(scaler.update(), ampkit::ScalerAssertionError);
  REQUIRE_THROWS_AS(GradScaler(GradScalerOptions().growth_factor(0.9)), ampkit::ScalerAssertionError);
  REQUIRE_THROWS_WITH(GradScaler(GradScalerOptions().hysteresis(0)), Catch::Contains("hysteresis must be in"));
}

TEST_CASE("GradScaler: grads given apart from .grad are checked and unscaled as .grad would be", "[scaler][cpu]") {
  // What a compiled step passes: the grads its graph computed, which .grad does not hold yet.
  Problem p = make_problem(1);
  const std::vector<at::Tensor> params = p.model->parameters();
  GradScaler scaler;
  scaler.scale(torch::ones({1}));
  std::vector<at::Tensor> grads;
  for (const auto& q : params) {
    grads.push_back(torch::randn_like(q) * 1024);
  }
  grads.back().view(-1)[-1] = kInf;  // Inf in the last element of the last grad
  REQUIRE(!params[0].grad().defined());
  auto [grad_scale, found_inf] = scaler.prepare_fused_step(1, params, grads);
  REQUIRE(grad_scale.defined());
  REQUIRE(found_inf.item<float>() == 1.0f);
  scaler.mark_stepped(1);
  scaler.update();
  REQUIRE(scaler.get_scale() == 32768.0);  // backed off: the given grads were the ones checked
  // unscale_params_ with given grads writes them, not .grad; a length or shape mismatch changes nothing.
  scaler.scale(torch::ones({1}));
  grads.back().view(-1)[-1] = 1.0f;
  const auto before = grads[0].clone();
  REQUIRE_THROWS_WITH(scaler.unscale_params_(2, params, {grads[0]}), Catch::Contains("2 params but 1 grads"));
  REQUIRE_THROWS_WITH(scaler.unscale_params_(2, params, {grads[1], grads[0]}),
                      Catch::Contains("grads[0] has shape [4] but its parameter has shape [4, 16]"));
  REQUIRE(bits_equal(grads[0], before));
  scaler.unscale_params_(2, params, {grads[0], at::Tensor()});
  REQUIRE(bits_equal(grads[0], before / 32768.0));
  REQUIRE(scaler.found_inf_per_device(2).at(0).item<float>() == 0.0f);
}

TEST_CASE("GradScaler: hysteresis and bounds", "[scaler][cpu]") {
  GradScaler scaler(
      GradScalerOptions().init_scale(64.0).growth_interval(2).hysteresis(2).min_scale(16.0).max_scale(128.0));
  auto p = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD opt({p}, 0.01);
  std::vector<double> history;
  for (const bool overflow : {true, true, true, true, false, false, false, false}) {
    opt.zero_grad();
    scaler.scale(p.sum()).backward();
    if (overflow) {
      p.mutable_grad()[0] = kInf;
    }
    scaler.step(opt);
    scaler.update();
    history.push_back(scaler.get_scale());
  }
  // Tolerated, backed off (2nd overflow), 16 (3rd), held at min_scale (4th); growth to 32, then 64.
  CHECK(history == std::vector<double>{64, 32, 16, 16, 16, 32, 32, 64});
  CHECK(scaler.stats().overflows_at_min_scale == 1);
}

TEST_CASE("GradScaler: a static loss scale stays put, skips and counts overflows, minimize() is step + update",
          "[scaler][cpu]") {
  GradScaler scaler(GradScalerOptions().init_scale(128.0).growth_interval(1).dynamic(false));
  auto p = torch::ones({4}, torch::requires_grad());
  torch::optim::SGD opt({p}, 0.01);
  int skipped = 0;
  for (const bool overflow : {false, true, false, false, true, false}) {
    opt.zero_grad();
    scaler.scale(p.sum()).backward();
    if (overflow) {
      p.mutable_grad()[0] = kInf;
    }
    const auto before = p.detach().clone();
    scaler.minimize(opt);
    CHECK(scaler.get_scale() == 128.0);
    CHECK(torch::equal(p.detach(), before) == overflow);
    skipped += overflow ? 1 : 0;
  }
  CHECK(scaler.stats().skipped_steps == skipped);
  const auto state = scaler.state_dict();
  CHECK(state.back().first == "dynamic");
  CHECK(state.back().second.toBool() == false);
  GradScaler dynamic;
  REQUIRE_THROWS_WITH(dynamic.load_state_dict(state), Catch::Contains("the state is of a static-scale scaler"));
  REQUIRE_THROWS_WITH(scaler.update(64.0), Catch::Contains("this scaler has a static loss scale"));
}

TEST_CASE("GradScaler: the scaling option is in the checkpoint, one of the other kind is refused and changes "
          "nothing",
          "[scaler][cpu]") {
  // Runs a few steps (one skipped) so that the scale, trackers and statistics are not their initial values.
  auto train = [](GradScaler& scaler) {
    auto p = torch::ones({4}, torch::requires_grad());
    torch::optim::SGD opt({p}, 0.01);
    for (int i = 0; i < 4; ++i) {
      opt.zero_grad();
      scaler.scale(p.sum()).backward();
      if (i == 2) {
        p.mutable_grad()[1] = kInf;
      }
      scaler.step(opt);
      scaler.update();
    }
  };
  GradScaler fixed(GradScalerOptions().scaling(false));
  GradScaler scaling(GradScalerOptions().init_scale(256.0).growth_interval(2));
  train(fixed);
  train(scaling);
  REQUIRE(scaling.get_scale() == 256.0);  // grown to 512 after two clean steps, backed off at the overflow
  const ampkit::ScalerState fixed_state = fixed.state_dict();
  const ampkit::ScalerState scaling_state = scaling.state_dict();
  auto value = [](const ampkit::ScalerState& state, const std::string& key) {
    for (const auto& [k, v] : state) {
      if (k == key) {
        return v;
      }
    }
    FAIL("no '" << key << "' in the state");
    return c10::IValue();
  };
  CHECK(value(fixed_state, "scaling").toBool() == false);
  CHECK(value(scaling_state, "scaling").toBool() == true);
  CHECK(fixed_state.back().first == "dynamic");  // "scaling" comes just before it

  auto same = [](const ampkit::ScalerState& a, const ampkit::ScalerState& b) {
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO(a[i].first);
      CHECK(a[i].first == b[i].first);
      CHECK(a[i].second == b[i].second);
    }
  };
  // Through torch::save / torch::load: a scale-1 checkpoint into a scaling scaler would go on at scale 1.
  std::ostringstream fixed_file;
  torch::save(fixed, fixed_file);
  std::istringstream in(fixed_file.str());
  REQUIRE_THROWS_WITH(torch::load(scaling, in),
                      Catch::Contains("GradScaler.load_state_dict: 'scaling' must equal this scaler's "
                                      "(scaling=True), but the state has scaling=False: its scale is fixed at 1"));
  same(scaling.state_dict(), scaling_state);
  CHECK(scaling.get_scale() == 256.0);
  // The other way round the scaling entry is named first, before the scale that scaling=False refuses anyway.
  REQUIRE_THROWS_WITH(fixed.load_state_dict(scaling_state),
                      Catch::Contains("'scaling' must equal this scaler's (scaling=False), but the state has "
                                      "scaling=True: it scales the loss; build the scaler with scaling=True "
                                      "(GradScalerOptions().scaling(true) in C++)"));
  same(fixed.state_dict(), fixed_state);
  ampkit::ScalerState wrong_type = fixed_state;
  for (auto& [k, v] : wrong_type) {
    if (k == "scaling") {
      v = c10::IValue(int64_t{0});
    }
  }
  REQUIRE_THROWS_WITH(fixed.load_state_dict(wrong_type), Catch::Contains("'scaling' must be a bool, but got Int"));
  same(fixed.state_dict(), fixed_state);

  // Same kind: loads. A state without the entry (torch's, or ampkit's before it) loads as before.
  GradScaler fixed_again(GradScalerOptions().scaling(false));
  std::istringstream in_again(fixed_file.str());
  torch::load(fixed_again, in_again);
  same(fixed_again.state_dict(), fixed_state);
  ampkit::ScalerState older;
  for (const auto& entry : fixed_state) {
    if (entry.first != "scaling") {
      older.push_back(entry);
    }
  }
  GradScaler takes_older(GradScalerOptions().init_scale(8.0));
  takes_older.load_state_dict(older);
  CHECK(takes_older.get_scale() == 1.0);
  CHECK(takes_older.stats().skipped_steps == 1);
}

TEST_CASE("GradScaler: torch::save / torch::load round trip, and a failed load changes nothing", "[scaler][cpu]") {
  GradScaler scaler(ampkit::test::hysteresis_scenario_options());
  ampkit::test::run_hysteresis_scenario(scaler, at::kCPU);
  const std::string path = "ampkit_test_scaler.pt";
  torch::save(scaler, path);
  GradScaler loaded;
  torch::load(loaded, path);
  std::remove(path.c_str());
  const auto a = scaler.state_dict();
  const auto b = loaded.state_dict();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK(a[i].first == b[i].first);
    CHECK(a[i].second == b[i].second);
  }
  CHECK(loaded.get_scale() == scaler.get_scale());
  CHECK(loaded.stats().skipped_steps == 1);

  ampkit::ScalerState bad = a;
  bad[0].second = c10::IValue(-4.0);  // scale
  REQUIRE_THROWS_WITH(loaded.load_state_dict(bad), Catch::Contains("'scale' must be a finite number > 0"));
  CHECK(loaded.get_scale() == scaler.get_scale());
}

TEST_CASE("GradScaler: two ranks over a c10d process group skip together", "[scaler][cpu][distributed]") {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_test_store_" + std::to_string(::getpid()))).string();
  std::remove(path.c_str());
  std::vector<std::vector<double>> scales(2);
  std::vector<std::vector<float>> weights(2);
  auto rank_main = [&](int rank) {
    auto store = c10::make_intrusive<c10d::FileStore>(path, 2);
    // ampkit's store process group (NOTE [Store process group]): the wheel's headers cannot build Gloo's; the
    // Python tests run the same scenario on Gloo itself.
    auto pg = ampkit::distributed::store_process_group(store, rank, 2);
    GradScaler scaler(GradScalerOptions().init_scale(1024.0).process_group(pg));
    auto w = torch::ones({4}, torch::requires_grad());
    torch::optim::SGD opt({w}, 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      scaler.scale(w.sum()).backward();
      if (step == 1 && rank == 1) {
        w.mutable_grad()[3] = kInf;  // only rank 1 overflows
      }
      scaler.step(opt);
      scaler.update();
      scales[rank].push_back(scaler.get_scale());
      weights[rank].push_back(w[0].item<float>());
    }
  };
  std::thread r0(rank_main, 0);
  std::thread r1(rank_main, 1);
  r0.join();
  r1.join();
  std::remove(path.c_str());
  CHECK(scales[0] == std::vector<double>{1024, 512, 512});
  CHECK(scales[1] == scales[0]);
  // Rank 0's grads were finite, yet it skipped step 1 with rank 1.
  CHECK(weights[0][1] == weights[0][0]);
  CHECK(weights[0] == weights[1]);
}

TEST_CASE("GradScaler: calibrate sets the first scale from the first iteration's largest gradient", "[scaler][cpu]") {
  // The formula in float64 (NOTE [Calibrated first scale]).
  auto expected = [](double amax, double margin) {  // at most 2^32 without max_scale
    return std::min(std::exp2(std::floor(std::log2(65504.0 / (amax * std::exp2(margin))))), std::exp2(32.0));
  };
  for (const double margin : {0.0, 3.0}) {
    for (const double amax : {2.5e-6, 0.75, 900.0}) {  // 2.5e-6 at margin 0: capped at 2^32
      torch::manual_seed(4);
      torch::nn::Linear model(6, 3);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      GradScaler scaler(GradScalerOptions().calibrate(true).calibration_margin(margin).init_scale(1024.0));
      auto target = torch::randn({3, 6}, torch::kDouble);
      target = (target / target.abs().max() * amax).to(torch::kFloat);
      const at::Tensor before = model->weight.detach().clone();
      scaler.scale((model->weight * target).sum() + model->bias.sum() * 0.0f).backward();
      CHECK(scaler.get_scale() == 1.0);  // the first iteration runs at 1, whatever init_scale says
      scaler.step(opt);
      scaler.update();
      CHECK_FALSE(torch::equal(before, model->weight));  // an ordinary, applied step
      CHECK(scaler.get_scale() == expected(target.abs().max().item<double>(), margin));
      CHECK(scaler.get_growth_tracker() == 0);
      const double calibrated = scaler.get_scale();
      opt.zero_grad();
      scaler.scale((model->weight * target).sum()).backward();
      CHECK(torch::equal(model->weight.grad(), target * calibrated));
      scaler.step(opt);
      scaler.update();
      CHECK(scaler.get_scale() == calibrated);  // the second update() is an ordinary one
      CHECK(scaler.get_growth_tracker() == 1);
    }
  }
  // An overflow in the first iteration backs off from 1.
  torch::nn::Linear model(2, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler(GradScalerOptions().calibrate(true));
  scaler.scale(model(torch::randn({3, 2})).sum()).backward();
  model->bias.mutable_grad()[1] = kInf;
  scaler.step(opt);
  scaler.update();
  CHECK(scaler.get_scale() == 0.5);
  CHECK(scaler.stats().skipped_steps == 1);
}

TEST_CASE("GradScaler: calibrate refuses options it cannot honour", "[scaler][cpu]") {
  auto message = [](const GradScalerOptions& o) {
    try {
      GradScaler s(o);
    } catch (const c10::ValueError& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  CHECK_THAT(message(GradScalerOptions().calibrate(true).scaling(false)),
             Catch::Contains("calibrate sets a first scale, so it needs a dynamic loss scale"));
  CHECK_THAT(message(GradScalerOptions().calibrate(true).dynamic(false)), Catch::Contains("dynamic=False"));
  CHECK_THAT(message(GradScalerOptions().calibrate(true).calibration_margin(-2.0)),
             Catch::Contains("calibration_margin must be a finite number >= 0, but got -2"));
  CHECK_THAT(message(GradScalerOptions().calibrate(true).min_scale(4.0)),
             Catch::Contains("calibrate runs its first iteration at scale 1"));
}
