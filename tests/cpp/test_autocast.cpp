// ampkit::AutocastGuard: the scope sets and restores autocast state exactly as torch.autocast, nests, survives
// exceptions, and clears the cast cache when the outermost scope exits.
#include "support/catch_torch.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <new>
#include <sstream>
#include <thread>

#include "support/test_helpers.h"

using ampkit::test::bits_equal;

TEST_CASE("AutocastGuard: ops run in the low-precision dtype inside, state is restored outside", "[autocast][cpu]") {
  const auto a = torch::randn({8, 8});
  const auto b = torch::randn({8, 8});
  REQUIRE_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  const auto prev_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16);
    CHECK(at::autocast::is_autocast_enabled(at::kCPU));
    CHECK(torch::mm(a, b).scalar_type() == at::kBFloat16);
    {
      ampkit::AutocastGuard off(at::kCPU, at::kBFloat16, /*enabled=*/false);
      CHECK(torch::mm(a, b).scalar_type() == at::kFloat);
    }
    CHECK(torch::mm(a, b).scalar_type() == at::kBFloat16);
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  CHECK(at::autocast::get_autocast_dtype(at::kCPU) == prev_dtype);
  CHECK(torch::mm(a, b).scalar_type() == at::kFloat);
}

TEST_CASE("AutocastGuard: an exception inside the scope still restores the state", "[autocast][cpu]") {
  const bool cache_before = at::autocast::is_autocast_cache_enabled();
  try {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16, true, /*cache_enabled=*/!cache_before);
    CHECK(at::autocast::is_autocast_cache_enabled() == !cache_before);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  CHECK(at::autocast::is_autocast_cache_enabled() == cache_before);
  // Nesting is back at zero: a new outermost guard clears the cache on exit (checked below).
  CHECK(at::autocast::increment_nesting() == 1);
  CHECK(at::autocast::decrement_nesting() == 0);
}

TEST_CASE("AutocastGuard: the weight cast cache is cleared when the outermost scope exits", "[autocast][cpu]") {
  auto w = torch::randn({16, 16}, torch::requires_grad());  // a leaf that requires grad: cached when cast
  const auto x = torch::randn({4, 16});
  c10::weak_intrusive_ptr<c10::TensorImpl> cast_weight{c10::intrusive_ptr<c10::TensorImpl>()};
  {
    ampkit::AutocastGuard outer(at::kCPU, at::kBFloat16);
    {
      ampkit::AutocastGuard inner(at::kCPU, at::kBFloat16);
      auto cast = at::autocast::cached_cast(at::kBFloat16, w, c10::DeviceType::CPU);
      CHECK(cast.scalar_type() == at::kBFloat16);
      cast_weight = c10::weak_intrusive_ptr<c10::TensorImpl>(cast.getIntrusivePtr());
    }
    // The inner exit is not the outermost one: the cache still holds the cast weight.
    CHECK_FALSE(cast_weight.expired());
  }
  CHECK(cast_weight.expired());
}

TEST_CASE("AutocastGuard: rejects a dtype autocast cannot use", "[autocast][cpu]") {
  REQUIRE_THROWS_WITH(ampkit::AutocastGuard(at::kCPU, at::kFloat), Catch::Contains("dtype must be Half or BFloat16"));
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

namespace {

// A custom op defined from C++, for register_autocast: returns x * 2 in x's dtype.
at::Tensor ampkit_test_twice(const at::Tensor& x) { return x * 2; }

}  // namespace

TORCH_LIBRARY(ampkit_cpp_test, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(ampkit_cpp_test, CPU, m) { m.impl("twice", &ampkit_test_twice); }

TEST_CASE("AutocastGuard: per-scope overrides force FP32 or low precision, nest, and stay on their thread",
          "[autocast][cpu]") {
  const auto a = torch::randn({8, 16});
  const auto w = torch::randn({4, 16});
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16, true, std::nullopt,
                                ampkit::AutocastOverrides{{"linear"}, {"sum"}});
    CHECK(at::linear(a, w).scalar_type() == at::kFloat);
    CHECK(a.sum().scalar_type() == at::kBFloat16);
    CHECK(torch::mm(a, w.t()).scalar_type() == at::kBFloat16);  // not overridden: torch's rule
    {
      ampkit::AutocastGuard inner(at::kCPU, at::kBFloat16, true, std::nullopt,
                                  ampkit::AutocastOverrides{{}, {"aten::linear"}});
      CHECK(at::linear(a, w).scalar_type() == at::kBFloat16);
    }
    CHECK(at::linear(a, w).scalar_type() == at::kFloat);
    at::ScalarType other_thread = at::kDouble;
    std::thread t([&] {
      ampkit::AutocastGuard plain(at::kCPU, at::kBFloat16);
      other_thread = at::linear(a, w).scalar_type();
    });
    t.join();
    CHECK(other_thread == at::kBFloat16);
  }
  ampkit::AutocastGuard plain(at::kCPU, at::kBFloat16);
  CHECK(at::linear(a, w).scalar_type() == at::kBFloat16);
  REQUIRE_THROWS_WITH(
      ampkit::AutocastGuard(at::kCPU, at::kBFloat16, true, std::nullopt, ampkit::AutocastOverrides{{"no_such_op"}, {}}),
      Catch::Contains("no operator named 'aten::no_such_op'"));
}

TEST_CASE("AutocastGuard: overrides act on the op autocast sees (torch::nn::Linear runs addmm/matmul, not linear)",
          "[autocast][cpu]") {
  torch::nn::Linear linear(16, 4);
  const auto x2 = torch::randn({8, 16});
  const auto x3 = torch::randn({2, 8, 16});
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16, true, std::nullopt, ampkit::AutocastOverrides{{"linear"}, {}});
    CHECK(linear->forward(x2).scalar_type() == at::kBFloat16);  // addmm: "linear" never runs
    CHECK(linear->forward(x3).scalar_type() == at::kBFloat16);  // matmul
  }
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16, true, std::nullopt,
                                ampkit::AutocastOverrides{{"addmm", "matmul"}, {}});
    CHECK(linear->forward(x2).scalar_type() == at::kFloat);
    CHECK(linear->forward(x3).scalar_type() == at::kFloat);
  }
}

TEST_CASE("register_autocast: a C++ custom op gets each policy, with no Python involved", "[autocast][cpu]") {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ampkit_cpp_test::twice", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  const auto x = torch::randn({4});
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16);
    CHECK(op.call(x).scalar_type() == at::kFloat);  // no policy yet: falls through, as torch
  }
  ampkit::register_autocast("ampkit_cpp_test::twice", at::kCPU, ampkit::AutocastPolicy::kLowerPrecision);
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16);
    const auto y = op.call(x);
    CHECK(y.scalar_type() == at::kBFloat16);
    CHECK(torch::equal(y, x.to(at::kBFloat16) * 2));
  }
  CHECK(op.call(x).scalar_type() == at::kFloat);  // outside autocast: untouched
  ampkit::register_autocast("ampkit_cpp_test::twice", at::kCPU, ampkit::AutocastPolicy::kFp32);
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16);
    CHECK(op.call(x.to(at::kBFloat16)).scalar_type() == at::kFloat);
  }
}

TEST_CASE("AutocastGuard: CUDA without a CUDA device warns and leaves autocast off", "[autocast][cpu]") {
  if (at::globalContext().hasCUDA()) {
    WARN("a CUDA device exists: nothing to check here");
    return;
  }
  struct Collect : c10::WarningHandler {
    std::vector<std::string> messages;
    void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  } handler;
  c10::WarningUtils::WarningHandlerGuard use(&handler);
  {
    ampkit::AutocastGuard guard(at::kCUDA, at::kHalf);
    CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
  // TORCH_WARN_ONCE: the first such guard of the process warns (no other test makes one; ctest runs each case in
  // a process of its own).
  REQUIRE(handler.messages.size() == 1);
  CHECK(handler.messages[0].find("CUDA is not available") != std::string::npos);
  {
    ampkit::AutocastGuard cpu(at::kCPU, at::kBFloat16);  // the CPU is untouched
    CHECK(at::autocast::is_autocast_enabled(at::kCPU));
  }
}

TEST_CASE("OpStatsGuard: counts ops per dtype", "[autocast][cpu]") {
  const auto a = torch::randn({8, 16});
  const auto w = torch::randn({4, 16});
  ampkit::OpStatsGuard stats;
  {
    ampkit::AutocastGuard guard(at::kCPU, at::kBFloat16);
    at::linear(a, w);
  }
  at::linear(a, w);
  const auto counts = stats.counts();
  CHECK(counts.at({"aten::linear", "BFloat16"}) == 1);
  CHECK(counts.at({"aten::linear", "Float"}) == 1);
}

TEST_CASE("OpStatsGuard: integer ops, tensor-list outputs and boolean outputs", "[autocast][cpu]") {
  ampkit::OpStatsGuard stats;
  at::arange(8).add(0);        // no floating tensor anywhere: read its inputs at its start
  torch::randn({6}).split(2);  // a tensor list out
  torch::randn({4}, torch::kBFloat16).chunk(2);
  torch::randn({4}, torch::kHalf).gt(0);  // a boolean output: the input's dtype
  const auto counts = stats.counts();
  CHECK(counts.at({"aten::add", "other"}) == 1);
  CHECK(counts.at({"aten::split", "Float"}) == 1);
  CHECK(counts.at({"aten::chunk", "BFloat16"}) == 1);
  CHECK(counts.at({"aten::gt", "Half"}) == 1);
}

TEST_CASE("OpStatsGuard: the backward's ops only when asked for", "[autocast][cpu]") {
  const auto x = torch::randn({8, 16});
  const auto w = torch::randn({4, 16}, torch::requires_grad());
  std::map<std::pair<std::string, std::string>, int64_t> counts[2];
  for (const bool backward : {false, true}) {
    ampkit::OpStatsGuard stats(backward);
    at::linear(x, w).sum().backward();
    counts[backward] = stats.counts();
  }
  CHECK(counts[0].count({"aten::linear", "Float"}) == 1);
  CHECK(counts[0].count({"aten::mm", "Float"}) == 0);  // the grad of the linear is the backward's
  CHECK(counts[1].count({"aten::mm", "Float"}) == 1);
  for (const auto& [key, n] : counts[0]) {
    CHECK(key.first.find("Backward") == std::string::npos);
  }
}

TEST_CASE("decorate: O2 keeps norms FP32, casts the rest, and the model trains with FP32 masters", "[autocast][cpu]") {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::BatchNorm1d(32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 32), torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
                              torch::nn::Linear(32, 1));
  const auto fp32_weight = model->parameters()[0].detach().clone();
  ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(3e-3));
  opt.init_master_params();
  ampkit::decorate(*model, ampkit::OptLevel::kO2, at::kBFloat16);
  const auto params = model->named_parameters();
  CHECK(params["0.weight"].scalar_type() == at::kBFloat16);
  CHECK(params["1.weight"].scalar_type() == at::kFloat);
  CHECK(model->named_buffers()["1.running_mean"].scalar_type() == at::kFloat);
  CHECK(params["4.weight"].scalar_type() == at::kFloat);
  CHECK(params["5.weight"].scalar_type() == at::kBFloat16);
  const auto* state = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, params["0.weight"]);
  REQUIRE(state != nullptr);
  CHECK(torch::equal(state->master_param(), fp32_weight));
  CHECK(ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, torch::zeros({1})) == nullptr);
  REQUIRE_THROWS_WITH(ampkit::optim::state_of<ampkit::optim::SGDParamState>(opt, params["0.weight"]),
                      Catch::Contains("ampkit::optim::state_of: the optimizer keeps a"));
  const auto x = torch::randn({128, 16});
  const auto y = x.narrow(1, 0, 3).sum(1, true);
  double first = 0;
  double last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x.to(at::kBFloat16)).to(at::kFloat), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  CHECK(last < first / 4);
  torch::nn::Sequential fresh(torch::nn::Linear(4, 4));
  REQUIRE_THROWS_WITH(ampkit::decorate(*fresh, ampkit::OptLevel::kO3, at::kBFloat16, true, {"nope"}),
                      Catch::Contains("excluded module 'nope' is not in the model"));
  CHECK(fresh->parameters()[0].scalar_type() == at::kFloat);
}

namespace {

// TORCH_WARN messages issued while alive.
struct Warnings : c10::WarningHandler {
  std::vector<std::string> messages;
  c10::WarningUtils::WarningHandlerGuard guard{this};
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
};

}  // namespace

TEST_CASE("decorate with the optimizer: O2 masters come from the FP32 weights before the cast, and the model "
          "steps as its FP32 twin",
          "[autocast][cpu]") {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
                              torch::nn::Linear(16, 2));
  torch::nn::Sequential twin(torch::nn::Linear(8, 16), torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
                             torch::nn::Linear(16, 2));
  {
    const torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      twin->parameters()[i].copy_(model->parameters()[i]);
    }
  }
  const auto names = model->named_parameters();
  const auto fp32_weight = names["0.weight"].detach().clone();
  ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-2));
  ampkit::optim::AdamW twin_opt(twin->parameters(), ampkit::optim::AdamWOptions(1e-2));
  Warnings warnings;
  ampkit::decorate(*model, opt, ampkit::OptLevel::kO2, at::kBFloat16);
  CHECK(warnings.messages.empty());
  CHECK(names["0.weight"].scalar_type() == at::kBFloat16);
  CHECK(names["1.weight"].scalar_type() == at::kFloat);  // LayerNorm kept FP32: no master, no state
  CHECK(ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, names["1.weight"]) == nullptr);
  const auto* state = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, names["0.weight"]);
  REQUIRE(state != nullptr);
  CHECK(bits_equal(state->master_param(), fp32_weight));  // not the rounded copy
  CHECK(!bits_equal(state->master_param(), names["0.weight"].detach().to(at::kFloat)));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(10 + step);
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      auto p = model->parameters()[i];
      p.mutable_grad() = torch::randn(p.sizes()).to(p.scalar_type());
      twin->parameters()[i].mutable_grad() = p.grad().to(at::kFloat);
    }
    opt.step();
    twin_opt.step();
  }
  for (const auto& item : twin->named_parameters()) {
    INFO(item.key());
    const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, names[item.key()]);
    REQUIRE(s != nullptr);
    const at::Tensor ours = s->master_param().defined() ? s->master_param() : names[item.key()].detach();
    CHECK(torch::allclose(ours, item.value().detach(), 1e-6, 1e-7));
  }
}

TEST_CASE("decorate with the optimizer: groups with a lean master_weights get no FP32 master", "[autocast][cpu]") {
  torch::manual_seed(4);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Linear(16, 2));
  const auto names = model->named_parameters();
  const auto mode = GENERATE(ampkit::optim::MasterWeights::stochastic(), ampkit::optim::MasterWeights::kahan());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      std::vector<at::Tensor>{names["0.weight"], names["0.bias"]},
      std::make_unique<ampkit::optim::AdamWOptions>(ampkit::optim::AdamWOptions(1e-2).master_weights(mode)));
  groups.emplace_back(std::vector<at::Tensor>{names["1.weight"], names["1.bias"]});
  ampkit::optim::AdamW opt(std::move(groups), ampkit::optim::AdamWOptions(1e-2));
  const auto fp32_weight = names["1.weight"].detach().clone();
  ampkit::decorate(*model, opt, ampkit::OptLevel::kO2, at::kBFloat16);
  CHECK(names["0.weight"].scalar_type() == at::kBFloat16);
  const auto* lean = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, names["0.weight"]);
  CHECK((lean == nullptr || !lean->master_param().defined()));
  const auto* kept = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, names["1.weight"]);
  REQUIRE(kept != nullptr);
  CHECK(torch::equal(kept->master_param(), fp32_weight));
  model->forward(torch::randn({4, 8}, torch::kBFloat16)).to(torch::kFloat).sum().backward();
  opt.step();
  lean = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, names["0.weight"]);
  REQUIRE(lean != nullptr);
  CHECK(!lean->master_param().defined());
}

TEST_CASE("decorate: a second O2/O3 decorate is refused and changes nothing, another optimizer is refused",
          "[autocast][cpu]") {
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
  ampkit::optim::SGD opt(model->parameters(), ampkit::optim::SGDOptions(0.1).momentum(0.9));
  SECTION("a torch::optim optimizer at O2/O3 (at O0/O1 nothing happens to either)") {
    torch::optim::AdamW theirs(model->parameters(), torch::optim::AdamWOptions(1e-3));
    REQUIRE_NOTHROW(ampkit::decorate(*model, theirs, ampkit::OptLevel::kO1, at::kBFloat16));
    REQUIRE_THROWS_WITH(ampkit::decorate(*model, theirs, ampkit::OptLevel::kO2, at::kBFloat16),
                        Catch::Contains("ampkit::decorate: optimizer must be an ampkit::optim optimizer (Adam, AdamW, "
                                        "SGD or LAMB) at O2/O3, which keep the FP32 masters, but got "
                                        "torch::optim::AdamW"));
    CHECK(model->parameters()[0].scalar_type() == at::kFloat);
    CHECK(theirs.state().empty());
  }
  const auto master_before = model->parameters()[0].detach().clone();
  ampkit::decorate(*model, opt, ampkit::OptLevel::kO2, at::kBFloat16);  // the refusal above marked nothing
  const auto* state = ampkit::optim::state_of<ampkit::optim::SGDParamState>(opt, model->parameters()[0]);
  REQUIRE(state != nullptr);
  CHECK(bits_equal(state->master_param(), master_before));
  const auto weight = model->parameters()[0].detach().clone();
  for (const auto level : {ampkit::OptLevel::kO2, ampkit::OptLevel::kO3}) {
    REQUIRE_THROWS_WITH(ampkit::decorate(*model, opt, level, at::kHalf),
                        Catch::Contains("ampkit::decorate: module must not be decorated yet, but it was decorated "
                                        "at O2 already; decorating it again would take the optimizer's masters "
                                        "from rounded weights"));
    REQUIRE_THROWS_WITH(ampkit::decorate(*model, level, at::kHalf), Catch::Contains("decorated at O2 already"));
  }
  CHECK(bits_equal(model->parameters()[0].detach(), weight));                // still BF16, not cast to FP16
  CHECK(model->named_parameters()["1.weight"].scalar_type() == at::kFloat);  // O3 did not cast the norm
  CHECK(bits_equal(state->master_param(), master_before));                   // not retaken from the rounded weight
  REQUIRE_NOTHROW(ampkit::decorate(*model, opt, ampkit::OptLevel::kO1));     // O0/O1 change nothing, as in Python
  // A new module (even at a freed one's address) is not the decorated one.
  for (int i = 0; i < 3; ++i) {
    torch::nn::Sequential other(torch::nn::Linear(4, 4));
    REQUIRE_NOTHROW(ampkit::decorate(*other, ampkit::OptLevel::kO2, at::kBFloat16));
  }
}

namespace {

// A module held by value, as LibTorch's examples declare their models (`Net model;`): no shared_ptr owns it.
struct ByValueNet : torch::nn::Module {
  ByValueNet() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc2 = register_module("fc2", torch::nn::Linear(16, 2));
    scale = register_parameter("scale", torch::ones({2}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(norm(fc1(x)).to(at::kFloat)) * scale; }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::Tensor scale;
};

}  // namespace

TEST_CASE("decorate: a module held by value is decorated once, its own parameters included", "[autocast][cpu]") {
  torch::manual_seed(5);
  ByValueNet model;
  const auto fp32_weight = model.fc1->weight.detach().clone();
  ampkit::optim::AdamW opt(model.parameters(), ampkit::optim::AdamWOptions(1e-2));
  ampkit::decorate(model, opt, ampkit::OptLevel::kO2, at::kBFloat16, true, {"fc2"});
  CHECK(model.fc1->weight.scalar_type() == at::kBFloat16);
  CHECK(model.scale.scalar_type() == at::kBFloat16);  // the root's own parameter
  CHECK(model.norm->weight.scalar_type() == at::kFloat);
  CHECK(model.fc2->weight.scalar_type() == at::kFloat);  // excluded
  const auto* state = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, model.fc1->weight);
  REQUIRE(state != nullptr);
  CHECK(bits_equal(state->master_param(), fp32_weight));
  REQUIRE_THROWS_WITH(
      ampkit::decorate(model, opt, ampkit::OptLevel::kO3, at::kHalf),
      Catch::Contains("ampkit::decorate: module must not be decorated yet, but it was decorated at O2"));
  CHECK(model.fc1->weight.scalar_type() == at::kBFloat16);
  const auto x = torch::randn({4, 8});
  auto loss = model.forward(x.to(at::kBFloat16)).to(at::kFloat).square().mean();
  loss.backward();
  REQUIRE_NOTHROW(opt.step());
  // New modules held by value at one address, one after the other (built in one buffer), are not the decorated one.
  alignas(ByValueNet) unsigned char slot[sizeof(ByValueNet)];
  for (int i = 0; i < 3; ++i) {
    auto* other = new (slot) ByValueNet();
    REQUIRE_NOTHROW(ampkit::decorate(*other, ampkit::OptLevel::kO2, at::kBFloat16));
    CHECK(other->fc1->weight.scalar_type() == at::kBFloat16);
    other->~ByValueNet();
  }
}

TEST_CASE("decorate with the optimizer: a tied parameter gets one master, already-rounded weights warn",
          "[autocast][cpu]") {
  torch::manual_seed(4);
  // The embedding's weight is also the model's own parameter (a decoder tied to it): two names, one tensor.
  struct Tied : torch::nn::Module {
    torch::nn::Embedding emb{nullptr};
    at::Tensor tied;
    Tied() {
      emb = register_module("emb", torch::nn::Embedding(11, 6));
      tied = register_parameter("tied", emb->weight);
    }
  };
  auto model = std::make_shared<Tied>();
  auto& emb = model->emb;
  const auto fp32_weight = emb->weight.detach().clone();
  ampkit::optim::LAMB lamb({emb->weight}, ampkit::optim::LAMBOptions(1e-2));
  {
    Warnings warnings;
    ampkit::decorate(*model, lamb, ampkit::OptLevel::kO2, at::kBFloat16);
    CHECK(warnings.messages.empty());  // no "already rounded" master for the second name
  }
  CHECK(model->tied.unsafeGetTensorImpl() == emb->weight.unsafeGetTensorImpl());
  CHECK(emb->weight.scalar_type() == at::kBFloat16);
  CHECK(bits_equal(ampkit::optim::state_of<ampkit::optim::AdamParamState>(lamb, emb->weight)->master_param(),
                   fp32_weight));

  torch::nn::Sequential half(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  half->parameters()[0].set_data(half->parameters()[0].detach().to(at::kBFloat16));
  const auto rounded = half->parameters()[0].detach().to(at::kFloat);
  ampkit::optim::Adam adam(half->parameters(), ampkit::optim::AdamOptions(1e-3));
  Warnings warnings;
  ampkit::decorate(*half, adam, ampkit::OptLevel::kO2, at::kBFloat16);
  REQUIRE(warnings.messages.size() == 1);
  CHECK(warnings.messages[0].find("ampkit::decorate: 1 parameter(s) were already FP16/BF16, so their FP32 masters "
                                  "are copies of rounded weights") != std::string::npos);
  CHECK(bits_equal(ampkit::optim::state_of<ampkit::optim::AdamParamState>(adam, half->parameters()[0])->master_param(),
                   rounded));
}

TEST_CASE("decorate: every owner of a tied weight stays FP32 with an excluded one", "[autocast][cpu]") {
  // GPT-2's shape: the output head's weight is the embedding's (two modules, one tensor).
  struct Head : torch::nn::Module {
    at::Tensor weight;
    explicit Head(const at::Tensor& w) { weight = register_parameter("weight", w); }
  };
  struct LM : torch::nn::Module {
    torch::nn::Embedding wte{nullptr};
    torch::nn::Linear mid{nullptr};
    std::shared_ptr<Head> lm_head;
    LM() {
      wte = register_module("wte", torch::nn::Embedding(11, 6));
      mid = register_module("mid", torch::nn::Linear(6, 6));
      lm_head = register_module("lm_head", std::make_shared<Head>(wte->weight));
    }
  };
  for (const std::vector<std::string>& excluded :
       {std::vector<std::string>{"wte"}, std::vector<std::string>{"lm_head"},
        std::vector<std::string>{"wte", "lm_head"}, std::vector<std::string>{}}) {
    CAPTURE(excluded);
    torch::manual_seed(5);
    auto model = std::make_shared<LM>();
    const auto tied = model->wte->weight.detach().clone();
    ampkit::optim::AdamW opt(model->parameters(), ampkit::optim::AdamWOptions(1e-3));
    ampkit::decorate(*model, opt, ampkit::OptLevel::kO2, at::kBFloat16, /*keep_norm_fp32=*/true, excluded);
    REQUIRE(model->lm_head->weight.unsafeGetTensorImpl() == model->wte->weight.unsafeGetTensorImpl());
    CHECK(model->mid->weight.scalar_type() == at::kBFloat16);
    if (excluded.empty()) {
      CHECK(model->wte->weight.scalar_type() == at::kBFloat16);
    } else {
      CHECK(model->wte->weight.scalar_type() == at::kFloat);
      CHECK(bits_equal(model->wte->weight, tied));  // not even rounded on the way
      // the FP32 owners compute in FP32: the head's logits from the embedding's FP32 rows
      const auto ids = torch::tensor({1, 4, 9}, at::kLong);
      const auto logits = at::linear(model->wte(ids), model->lm_head->weight);
      CHECK(logits.scalar_type() == at::kFloat);
    }
  }
}

TEST_CASE("decorate with the optimizer after loading a LibTorch archive: the loaded moments stay, the masters "
          "are the FP32 weights",
          "[autocast][optim][cpu]") {
  torch::manual_seed(5);
  torch::nn::Linear theirs_model(6, 3);
  torch::optim::Adam theirs(theirs_model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 2; ++step) {
    theirs.zero_grad();
    theirs_model(torch::randn({4, 6})).square().sum().backward();
    theirs.step();
  }
  std::ostringstream out;
  torch::save(theirs, out);
  torch::nn::Linear model(6, 3);
  {
    const torch::NoGradGuard no_grad;
    model->weight.copy_(theirs_model->weight);
    model->bias.copy_(theirs_model->bias);
  }
  ampkit::optim::Adam opt(model->parameters(), ampkit::optim::AdamOptions(1.0));
  std::istringstream in(out.str());
  torch::load(opt, in);
  ampkit::decorate(*model, opt, ampkit::OptLevel::kO2, at::kBFloat16);
  const auto& ts =
      static_cast<const torch::optim::AdamParamState&>(*theirs.state().at(theirs_model->weight.unsafeGetTensorImpl()));
  const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt, model->weight);
  REQUIRE(s != nullptr);
  CHECK(s->step().item<double>() == 2);
  CHECK(bits_equal(s->exp_avg(), ts.exp_avg()));
  CHECK(bits_equal(s->master_param(), theirs_model->weight.detach()));
  CHECK(model->weight.scalar_type() == at::kBFloat16);
}

TEST_CASE("decorate: no dtype picks BF16 for a CPU module, and a bad dtype changes nothing", "[autocast][cpu]") {
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
  REQUIRE_THROWS_WITH(ampkit::decorate(*model, ampkit::OptLevel::kO2, at::kDouble),
                      Catch::Contains("dtype must be Half or BFloat16, but got Double"));
  CHECK(model->named_parameters()["0.weight"].scalar_type() == at::kFloat);
  ampkit::decorate(*model, ampkit::OptLevel::kO2);
  CHECK(model->named_parameters()["0.weight"].scalar_type() == at::kBFloat16);
  CHECK(model->named_parameters()["1.weight"].scalar_type() == at::kFloat);
}

TEST_CASE("precision_support: the CPU runs both low-precision dtypes, fast with their units and a probe without a "
          "slow op",
          "[autocast][cpu]") {
  const ampkit::PrecisionSupport s = ampkit::precision_support(c10::Device(c10::kCPU));
  CHECK(s.fp16);
  CHECK(s.bf16);
  CHECK(s.lowp_dtype == at::kBFloat16);
  CHECK(s.fast == s.bf16_fast);
  CHECK(s.recommended == (s.fast ? at::kBFloat16 : at::kFloat));
  CHECK(s.reason.rfind("CPU: ", 0) == 0);
  REQUIRE(s.measured);
  for (const auto& t : {s.fp32_probe, s.bf16_probe, s.fp16_probe}) {
    CHECK(t.conv2d_ms > 0);
    CHECK(t.linear_ms > 0);
  }
  if (s.fp16_fast) {  // fast only without an op 3 times or more slower than in another dtype
    CHECK(s.fp16_probe.conv2d_ms < 3 * std::min(s.fp32_probe.conv2d_ms, s.bf16_probe.conv2d_ms));
    CHECK(s.fp16_probe.linear_ms < 3 * std::min(s.fp32_probe.linear_ms, s.bf16_probe.linear_ms));
  }
  const ampkit::PrecisionSupport again = ampkit::precision_support(c10::Device(c10::kCPU));
  CHECK(again.fp16_probe.conv2d_ms == s.fp16_probe.conv2d_ms);  // measured once per process
  REQUIRE_THROWS_WITH(ampkit::precision_support(c10::Device(c10::kMeta)),
                      Catch::Contains("device must be a CPU or CUDA device, but got meta"));
}

TEST_CASE("autocast_dtype_advice: FP16 on a CPU where an op runs 3x slower than BF16 is called slow, nothing else is",
          "[autocast][cpu]") {
  ampkit::PrecisionSupport slow;
  slow.fp16 = slow.bf16 = true;
  slow.measured = true;
  slow.reason = "CPU: BF16 units (AVX512-BF16); FP16 units (AVX512-FP16).";
  slow.fp32_probe = {0.4, 0.4};
  slow.bf16_probe = {0.5, 0.45};
  slow.fp16_probe = {60.0, 0.33};  // torch's FP16 convolution backward without a fast kernel
  const std::string said = ampkit::autocast_dtype_advice(c10::DeviceType::CPU, at::kHalf, slow);
  CHECK(said.find("FP16 autocast on this CPU: conv2d forward and backward runs 120x slower in FP16 than in BF16") !=
        std::string::npos);
  CHECK(said.find("60.00 ms against 0.50 ms") != std::string::npos);
  CHECK(said.find("no FP16 units") == std::string::npos);
  ampkit::PrecisionSupport linear_slow = slow;
  linear_slow.fp16_probe = {0.6, 2.0};
  CHECK(ampkit::autocast_dtype_advice(c10::DeviceType::CPU, at::kHalf, linear_slow).find("linear forward") !=
        std::string::npos);
  ampkit::PrecisionSupport close = slow;
  close.fp16_probe = {1.4, 1.2};  // under 3x BF16's time on every op
  CHECK(ampkit::autocast_dtype_advice(c10::DeviceType::CPU, at::kHalf, close).empty());
  ampkit::PrecisionSupport unmeasured = slow;
  unmeasured.measured = false;
  CHECK(ampkit::autocast_dtype_advice(c10::DeviceType::CPU, at::kHalf, unmeasured).empty());
  CHECK(ampkit::autocast_dtype_advice(c10::DeviceType::CPU, at::kBFloat16, slow).empty());
  CHECK(ampkit::autocast_dtype_advice(c10::DeviceType::CUDA, at::kHalf, slow).empty());
  // the process's own answer agrees with its measurement
  const auto here = ampkit::precision_support(c10::Device(c10::kCPU));
  const bool fp16_slow = here.fp16_probe.conv2d_ms >= 3 * here.bf16_probe.conv2d_ms ||
                         here.fp16_probe.linear_ms >= 3 * here.bf16_probe.linear_ms;
  CHECK(ampkit::autocast_dtype_advice(c10::DeviceType::CPU, at::kHalf, here).empty() == !fp16_slow);
}
