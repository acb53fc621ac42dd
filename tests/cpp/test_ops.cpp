// The AMP ops through LibTorch on the CPU: bit-exact against torch._amp_foreach_non_finite_check_and_unscale_
// and torch._amp_update_scale_, against a float64 reference, and bad input that must change nothing.

#include "support/catch_torch.h"
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "support/test_helpers.h"

using ampkit::test::bits_equal;
using ampkit::test::random_grad;
using ampkit::test::reference_unscale;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble};

at::Tensor scalar_f32(float v) { return at::full({1}, v, at::kFloat); }

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) {
    out.push_back(t.clone());
  }
  return out;
}

// Runs ampkit and torch on clones of `grads` and requires identical grads and found_inf.
void require_matches_torch(const std::vector<at::Tensor>& grads, float inv) {
  auto ours = clone_all(grads);
  auto theirs = clone_all(grads);
  auto found_ours = scalar_f32(0.f);
  auto found_theirs = scalar_f32(0.f);
  ampkit::unscale_and_check_(ours, found_ours, scalar_f32(inv));
  at::_amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, scalar_f32(inv));
  REQUIRE(found_ours.item<float>() == found_theirs.item<float>());
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("tensor " << i << " dtype " << grads[i].scalar_type() << " numel " << grads[i].numel());
    REQUIRE(bits_equal(ours[i], theirs[i]));
  }
}

}  // namespace

TEST_CASE("unscale_and_check_: bit-identical to torch and to the float64 reference", "[ops][cpu]") {
  torch::manual_seed(0);
  const int64_t n = GENERATE(1, 7, 8, 9, 15, 16, 17, 31, 33, 32767, 32768, 32769, 100003);
  const float inv = GENERATE(1.f / 65536.f, 1.f / 3.f, 1.f, 7.f);
  for (const auto dtype : kDtypes) {
    INFO("dtype " << dtype << " n " << n << " inv " << inv);
    const auto g = random_grad(n, dtype, 3000.0);
    require_matches_torch({g}, inv);

    auto ours = g.clone();
    auto found = scalar_f32(0.f);
    ampkit::unscale_and_check_({ours}, found, scalar_f32(inv));
    REQUIRE(found.item<float>() == 0.f);
    REQUIRE(bits_equal(ours, reference_unscale(g, inv)));
  }
}

TEST_CASE("unscale_and_check_: Inf and NaN anywhere set found_inf, finite lists leave it alone", "[ops][cpu]") {
  torch::manual_seed(1);
  const float bad = GENERATE(std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN());
  // 0: last element of the last chunk of the last tensor; 1: first element of the first; 2: middle tensor.
  const int where = GENERATE(0, 1, 2);
  for (const auto dtype : kDtypes) {
    INFO("dtype " << dtype << " position " << where);
    std::vector<at::Tensor> grads = {random_grad(40000, dtype, 10.0), random_grad(100, dtype, 10.0),
                                     random_grad(65537, dtype, 10.0)};
    if (where == 0) {
      grads.back()[-1] = bad;
    } else if (where == 1) {
      grads.front()[0] = bad;
    } else {
      grads[1][50] = bad;
    }
    require_matches_torch(grads, 0.25f);
    auto found = scalar_f32(0.f);
    auto copy = clone_all(grads);
    ampkit::unscale_and_check_(copy, found, scalar_f32(0.25f));
    REQUIRE(found.item<float>() == 1.f);
  }
}

TEST_CASE("unscale_and_check_: found_inf is never cleared", "[ops][cpu]") {
  auto g = random_grad(1000, at::kFloat, 1.0);
  auto found = scalar_f32(1.f);
  ampkit::unscale_and_check_({g}, found, scalar_f32(0.5f));
  CHECK(found.item<float>() == 1.f);
}

TEST_CASE("unscale_and_check_: mixed dtypes, strided views, misaligned and zero-size tensors", "[ops][cpu]") {
  torch::manual_seed(2);
  const auto base = at::randn({300, 200}, at::kFloat) * 100;
  std::vector<at::Tensor> grads = {
      base.t(),                                              // dense but permuted: in place
      base.to(at::kHalf).slice(1, 0, 200, 3),                // non-dense: staged
      base.to(at::kBFloat16).flatten().narrow(0, 1, 59999),  // offset by one element
      at::empty({0}, at::kFloat),                            // zero-size
      base.to(at::kDouble).select(1, 5),                     // strided column
      at::empty({3, 0, 2}, at::kHalf),
  };
  require_matches_torch(grads, 1.f / 1024.f);

  // Strided views are written through to their storage, and nothing outside the view changes.
  auto storage = base.to(at::kHalf);
  auto view = storage.slice(1, 0, 200, 3);
  const auto before = storage.clone();
  auto found = scalar_f32(0.f);
  ampkit::unscale_and_check_({view}, found, scalar_f32(0.5f));
  const auto mask = at::zeros_like(storage, at::kBool);
  mask.slice(1, 0, 200, 3).fill_(true);
  REQUIRE(bits_equal(storage.masked_select(mask.logical_not()), before.masked_select(mask.logical_not())));
  REQUIRE(bits_equal(view, reference_unscale(before.slice(1, 0, 200, 3), 0.5f)));
}

TEST_CASE("unscale_and_check_: many tensors, subnormals, -0.0 and FP16 overflow after scaling", "[ops][cpu]") {
  torch::manual_seed(3);
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 300; ++i) {
    grads.push_back(random_grad(1 + (i * 37) % 500, kDtypes[i % 4], 50.0));
  }
  require_matches_torch(grads, 1.f / 128.f);

  auto special = at::tensor({-0.0, 5.96e-8, 6.1e-5, 65504.0, -65504.0, 1.0}, at::kDouble).to(at::kHalf);
  require_matches_torch({special}, 2.f);  // 65504 * 2 overflows FP16 to Inf; found_inf stays 0 as in torch
  auto s = special.clone();
  auto found = scalar_f32(0.f);
  ampkit::unscale_and_check_({s}, found, scalar_f32(2.f));
  CHECK(found.item<float>() == 0.f);
  CHECK(std::isinf(s[3].item<float>()));
  CHECK(std::signbit(s[0].item<float>()));
}

TEST_CASE("unscale_and_check_: bad input raises naming the argument and changes nothing", "[ops][cpu]") {
  auto g0 = random_grad(100, at::kFloat, 1.0);
  auto g1 = random_grad(100, at::kHalf, 1.0);
  const auto g0_before = g0.clone();
  const auto g1_before = g1.clone();
  auto found = scalar_f32(0.f);
  const auto inv = scalar_f32(0.5f);
  auto expect_unchanged = [&]() {
    REQUIRE(bits_equal(g0, g0_before));
    REQUIRE(bits_equal(g1, g1_before));
    REQUIRE(found.item<float>() == 0.f);
  };
  SECTION("found_inf of the wrong dtype") {
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, g1}, at::zeros({1}, at::kDouble), inv),
                        Catch::Contains("found_inf must be a Float tensor"));
  }
  SECTION("found_inf of two elements") {
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, g1}, at::zeros({2}, at::kFloat), inv),
                        Catch::Contains("found_inf must have exactly one element"));
  }
  SECTION("inv_scale of the wrong dtype") {
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, g1}, found, at::ones({1}, at::kHalf)),
                        Catch::Contains("inv_scale must be a Float tensor"));
  }
  SECTION("integer grad last in the list") {
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, g1, at::ones({4}, at::kLong)}, found, inv),
                        Catch::Contains("grads[2] must be Half, BFloat16, Float or Double"));
  }
  SECTION("sparse grad") {
    auto sparse = at::eye(3, at::kFloat).to_sparse();
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, g1, sparse}, found, inv),
                        Catch::Contains("grads[2] must be a strided"));
  }
  SECTION("expanded (overlapping) grad") {
    auto expanded = at::ones({1}, at::kFloat).expand({8});
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, g1, expanded}, found, inv),
                        Catch::Contains("grads[2] is written in place"));
  }
  SECTION("undefined grad") {
    REQUIRE_THROWS_WITH(ampkit::unscale_and_check_({g0, at::Tensor()}, found, inv),
                        Catch::Contains("grads[1] is undefined"));
  }
  expect_unchanged();
}

TEST_CASE("unscale_and_check_: an empty list is a no-op", "[ops][cpu]") {
  auto found = scalar_f32(0.f);
  ampkit::unscale_and_check_({}, found, scalar_f32(0.5f));
  CHECK(found.item<float>() == 0.f);
}

TEST_CASE("check_finite_: detects Inf/NaN and never writes the tensors", "[ops][cpu]") {
  torch::manual_seed(4);
  for (const auto dtype : kDtypes) {
    std::vector<at::Tensor> ts = {random_grad(70001, dtype, 1e3), random_grad(17, dtype, 1e3).slice(0, 0, 17, 2)};
    const auto before = clone_all(ts);
    auto found = scalar_f32(0.f);
    ampkit::check_finite_(ts, found);
    CHECK(found.item<float>() == 0.f);
    ts[1][-1] = std::numeric_limits<float>::quiet_NaN();
    const auto with_nan = clone_all(ts);
    ampkit::check_finite_(ts, found);
    CHECK(found.item<float>() == 1.f);
    CHECK(bits_equal(ts[0], before[0]));
    CHECK(bits_equal(ts[1], with_nan[1]));
  }
}

TEST_CASE("update_scale_: step for step identical to torch._amp_update_scale_", "[ops][cpu]") {
  torch::manual_seed(5);
  const int64_t interval = GENERATE(1, 3, 2000);
  auto scale = scalar_f32(65536.f);
  auto tracker = at::zeros({1}, at::kInt);
  auto t_scale = scale.clone();
  auto t_tracker = tracker.clone();
  const auto overflows = at::rand({3000}) < 0.05;
  for (int64_t i = 0; i < overflows.numel(); ++i) {
    const auto found = scalar_f32(overflows[i].item<bool>() ? 1.f : 0.f);
    ampkit::update_scale_(scale, tracker, found, 2.0, 0.5, interval);
    at::_amp_update_scale_(t_scale, t_tracker, found, 2.0, 0.5, interval);
    REQUIRE(scale.item<float>() == t_scale.item<float>());
    REQUIRE(tracker.item<int>() == t_tracker.item<int>());
  }
}

TEST_CASE("update_scale_: bad input raises and changes nothing", "[ops][cpu]") {
  auto scale = scalar_f32(1024.f);
  auto tracker = at::full({1}, 5, at::kInt);
  const auto found = scalar_f32(0.f);
  SECTION("growth_tracker not int32") {
    REQUIRE_THROWS_WITH(ampkit::update_scale_(scale, at::zeros({1}, at::kLong), found, 2.0, 0.5, 10),
                        Catch::Contains("growth_tracker must be a Int tensor"));
  }
  SECTION("growth_interval < 1") {
    REQUIRE_THROWS_WITH(ampkit::update_scale_(scale, tracker, found, 2.0, 0.5, 0),
                        Catch::Contains("growth_interval must be in"));
  }
  SECTION("backoff_factor not finite") {
    REQUIRE_THROWS_WITH(ampkit::update_scale_(scale, tracker, found, 2.0, std::numeric_limits<double>::infinity(), 10),
                        Catch::Contains("backoff_factor must be a finite number > 0"));
  }
  CHECK(scale.item<float>() == 1024.f);
  CHECK(tracker.item<int>() == 5);
}

TEST_CASE("ops: Meta kernels check arguments without touching data", "[ops][meta]") {
  const auto meta = at::TensorOptions().device(at::kMeta);
  auto g = at::empty({10}, meta.dtype(at::kHalf));
  ampkit::unscale_and_check_({g}, at::empty({1}, meta.dtype(at::kFloat)), at::empty({1}, meta.dtype(at::kFloat)));
  ampkit::check_finite_({g}, at::empty({1}, meta.dtype(at::kFloat)));
  ampkit::update_scale_(at::empty({1}, meta.dtype(at::kFloat)), at::empty({1}, meta.dtype(at::kInt)),
                        at::empty({1}, meta.dtype(at::kFloat)), 2.0, 0.5, 10);
  REQUIRE_THROWS_WITH(
      ampkit::unscale_and_check_({g}, at::empty({1}, meta.dtype(at::kHalf)), at::empty({1}, meta.dtype(at::kFloat))),
      Catch::Contains("found_inf must be a Float tensor"));
}

TEST_CASE("build_info: reports the CPU loop instruction set", "[ops][cpu]") {
  const auto info = ampkit::build_info();
  const std::string isa = info.cpu_isa;
  CHECK((isa == "avx512" || isa == "avx2" || isa == "default"));
  CHECK(std::string(info.torch_version).size() > 0);
}

TEST_CASE("grad_stats (C++ entry point): columns against a float64 reference, empty lists, bad input", "[ops][cpu]") {
  torch::manual_seed(21);
  auto g = random_grad(70001, at::kBFloat16, 1e-2);
  g[3] = 0.f;
  g[-1] = std::numeric_limits<float>::infinity();
  const auto inv = at::full({1}, 0.25f);
  const at::Tensor row = ampkit::grad_stats({g}, inv)[0];
  REQUIRE(row.size(0) == ampkit::kGradStatsColumns);
  const at::Tensor x = g.to(at::kDouble);
  const at::Tensor finite = x.isfinite();
  const at::Tensor live = x.masked_select(finite.logical_and(x.ne(0))).abs() * 0.25;
  CHECK(row[2].item<double>() == 1.0);
  CHECK(row[3].item<double>() == (x == 0).sum().item<double>());
  CHECK(row[0].item<double>() == live.max().item<double>());
  CHECK(row[1].item<double>() ==
        Approx(x.masked_select(finite).square().sum().sqrt().item<double>() * 0.25).epsilon(1e-12));
  const at::Tensor e = at::floor(at::log2(live)).to(at::kLong) - ampkit::kGradStatsHistMinExp + 1;
  const at::Tensor expect = at::bincount(e, {}, ampkit::kGradStatsColumns - ampkit::kGradStatsHistFirst);
  CHECK(row.narrow(0, ampkit::kGradStatsHistFirst, expect.size(0)).to(at::kLong).equal(expect));
  CHECK(ampkit::grad_stats({}).sizes() == at::IntArrayRef({0, ampkit::kGradStatsColumns}));
  CHECK_THROWS_WITH(ampkit::grad_stats({at::ones({3}, at::kDouble)}),
                    Catch::Contains("grads[0] must be Half, BFloat16 or Float, but got Double"));
}

TEST_CASE("GradStatsLog: one JSON line per logged step with the scaler's and grad_stats' values", "[ops][cpu]") {
  torch::manual_seed(22);
  torch::nn::Linear fc(8, 3);
  ampkit::GradScaler scaler(ampkit::GradScalerOptions().init_scale(256.0));
  scaler.scale(fc->forward(at::randn({4, 8})).square().mean()).backward();
  const std::string path =
      (std::filesystem::temp_directory_path() / ("ampkit_gradlog_" + std::to_string(::getpid()) + ".jsonl")).string();
  std::filesystem::remove(path);
  {
    ampkit::GradStatsLog log(path, 5);
    CHECK_FALSE(log.log(3, fc->named_parameters(), &scaler));
    CHECK(log.log(10, fc->named_parameters(), &scaler));
  }
  std::ifstream in(path);
  std::string line;
  REQUIRE(std::getline(in, line));
  std::string extra;
  CHECK_FALSE(std::getline(in, extra));
  std::filesystem::remove(path);
  CHECK(line.rfind("{\"step\": 10, \"scaler\": {\"scale\": 256, \"steps\": 0, \"skipped_steps\": 0", 0) == 0);
  const at::Tensor rows = ampkit::grad_stats({fc->weight.grad(), fc->bias.grad()}, scaler.unscale_factor(at::kCPU));
  for (const auto& [name, r] : {std::pair<std::string, int>{"weight", 0}, {"bias", 1}}) {
    const auto at_name = line.find("\"name\": \"" + name + "\"");
    REQUIRE(at_name != std::string::npos);
    const auto at_norm = line.find("\"norm\": ", at_name);
    CHECK(std::stod(line.substr(at_norm + 8)) == rows[r][1].item<double>());  // 17 digits: the same double
  }
  CHECK_THROWS_WITH(ampkit::GradStatsLog(path, 0), Catch::Contains("every must be >= 1, but got 0"));
  CHECK_THROWS_WITH(ampkit::GradStatsLog("/nonexistent-dir/x.jsonl"), Catch::Contains("cannot open"));
}
