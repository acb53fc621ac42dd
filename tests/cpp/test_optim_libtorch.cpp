// ampkit::optim and LibTorch's torch::optim archives, both ways (NOTE [LibTorch archives] in csrc/optim/optim.cpp):
// archives written by torch::optim::{Adam,AdamW,SGD} load into ampkit's optimizers (int steps, no masters, no
// ampkit options) and the next steps follow LibTorch's; ampkit's archives load into LibTorch's optimizers, which
// then step as ampkit's would; an FP32 LibTorch run continues in O2; archives of another kind are refused, naming
// the format and the key, and leave the optimizer as it was.
#include "support/catch_torch.h"

#include <sstream>

#include "support/libtorch_compare.h"
#include "support/test_helpers.h"

using ampkit::test::bits_equal;
using ampkit::test::load_from;
using ampkit::test::saved;
using ampkit::test::set_step_grads;
using ampkit::test::steps_agree;

namespace {

std::vector<at::Tensor> make_params(at::ScalarType dtype, int seed) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> ps;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{33, 17}, {17}, {5, 3, 2}, {1025}}) {
    ps.push_back(torch::randn(shape).to(dtype).requires_grad_());
  }
  return ps;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().to(dtype, false, true).requires_grad_());
  }
  return out;
}

// The moments of LibTorch's Adam/AdamW state and of ampkit's, compared bit for bit (FP32 on both sides).
template <typename TorchState>
void check_adam_state(const TorchState& theirs, const ampkit::optim::AdamParamState& ours, bool amsgrad) {
  REQUIRE(ours.step().defined());
  CHECK(ours.step().item<double>() == static_cast<double>(theirs.step()));
  CHECK(ours.step().scalar_type() == at::kFloat);
  CHECK(bits_equal(ours.exp_avg(), theirs.exp_avg()));
  CHECK(bits_equal(ours.exp_avg_sq(), theirs.exp_avg_sq()));
  CHECK(ours.max_exp_avg_sq().defined() == amsgrad);
  if (amsgrad) {
    CHECK(bits_equal(ours.max_exp_avg_sq(), theirs.max_exp_avg_sq()));
  }
}

}  // namespace

TEST_CASE("optim: archives of LibTorch's Adam and AdamW load into ampkit's, and the next steps follow LibTorch's",
          "[optim][cpu]") {
  const bool amsgrad = GENERATE(false, true);
  auto tp = make_params(at::kFloat, 1);
  auto op = clone_params(tp, at::kFloat);
  SECTION("Adam") {
    torch::optim::Adam theirs(tp,
                              torch::optim::AdamOptions(1e-2).betas({0.8, 0.99}).weight_decay(0.05).amsgrad(amsgrad));
    for (int step = 0; step < 3; ++step) {
      set_step_grads(tp, step);
      theirs.step();
    }
    op = clone_params(tp, at::kFloat);
    // Built with other options: the archive's replace them; those LibTorch lacks come from these defaults.
    ampkit::optim::Adam ours(op, ampkit::optim::AdamOptions(1.0).master_weights(false).write_unscaled_grads(false));
    load_from(ours, saved(theirs));
    const auto& o = static_cast<const ampkit::optim::AdamOptions&>(ours.param_groups()[0].options());
    CHECK(o.lr() == 1e-2);
    CHECK(o.betas() == std::make_tuple(0.8, 0.99));
    CHECK(o.weight_decay() == 0.05);
    CHECK(o.amsgrad() == amsgrad);
    CHECK(o.master_weights() == ampkit::optim::MasterWeights(false));
    CHECK(!o.write_unscaled_grads());
    CHECK(!o.maximize());
    for (size_t i = 0; i < tp.size(); ++i) {
      const auto& ts =
          static_cast<const torch::optim::AdamParamState&>(*theirs.state().at(tp[i].unsafeGetTensorImpl()));
      CHECK(ts.step() == 3);
      check_adam_state(ts, *ampkit::optim::state_of<ampkit::optim::AdamParamState>(ours, op[i]), amsgrad);
    }
    steps_agree(theirs, tp, ours, op, 3, 6);
  }
  SECTION("AdamW") {
    torch::optim::AdamW theirs(tp, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
    for (int step = 0; step < 4; ++step) {
      set_step_grads(tp, step);
      theirs.step();
    }
    op = clone_params(tp, at::kFloat);
    ampkit::optim::AdamW ours(op, ampkit::optim::AdamWOptions(1.0).weight_decay(0.0));
    load_from(ours, saved(theirs));
    const auto& o = static_cast<const ampkit::optim::AdamWOptions&>(ours.param_groups()[0].options());
    CHECK(o.lr() == 1e-2);
    CHECK(o.weight_decay() == 0.1);
    CHECK(o.master_weights() == ampkit::optim::MasterWeights());
    for (size_t i = 0; i < tp.size(); ++i) {
      const auto& ts =
          static_cast<const torch::optim::AdamWParamState&>(*theirs.state().at(tp[i].unsafeGetTensorImpl()));
      CHECK(ts.step() == 4);
      check_adam_state(ts, *ampkit::optim::state_of<ampkit::optim::AdamParamState>(ours, op[i]), amsgrad);
    }
    steps_agree(theirs, tp, ours, op, 4, 8);
  }
}

TEST_CASE("optim: archives of LibTorch's SGD load into ampkit's, and the next steps use the loaded buffers",
          "[optim][cpu]") {
  const bool nesterov = GENERATE(false, true);
  auto tp = make_params(at::kFloat, 2);
  torch::optim::SGD theirs(tp, torch::optim::SGDOptions(0.05)
                                   .momentum(0.9)
                                   .dampening(nesterov ? 0.0 : 0.2)
                                   .weight_decay(0.01)
                                   .nesterov(nesterov));
  for (int step = 0; step < 3; ++step) {
    set_step_grads(tp, step);
    theirs.step();
  }
  auto op = clone_params(tp, at::kFloat);
  ampkit::optim::SGD ours(op, ampkit::optim::SGDOptions(1.0));
  load_from(ours, saved(theirs));
  const auto& o = static_cast<const ampkit::optim::SGDOptions&>(ours.param_groups()[0].options());
  CHECK(o.lr() == 0.05);
  CHECK(o.momentum() == 0.9);
  CHECK(o.nesterov() == nesterov);
  for (size_t i = 0; i < tp.size(); ++i) {
    const auto& ts = static_cast<const torch::optim::SGDParamState&>(*theirs.state().at(tp[i].unsafeGetTensorImpl()));
    const auto* s = ampkit::optim::state_of<ampkit::optim::SGDParamState>(ours, op[i]);
    REQUIRE(s != nullptr);
    CHECK(bits_equal(s->momentum_buffer(), ts.momentum_buffer()));
    CHECK(!s->step().defined());  // LibTorch keeps none; the next step takes the buffer as filled
  }
  // A restart from the grad (step 0) would drift from LibTorch's run at once.
  steps_agree(theirs, tp, ours, op, 3, 6);
}

TEST_CASE("optim: LibTorch's optimizers load ampkit's archives and then step as ampkit's do", "[optim][cpu]") {
  auto op = make_params(at::kFloat, 3);
  SECTION("Adam and AdamW") {
    const bool decoupled = GENERATE(false, true);
    const auto options = ampkit::optim::AdamWOptions(1e-2).betas({0.85, 0.995}).weight_decay(0.02).amsgrad(true);
    std::unique_ptr<torch::optim::Optimizer> ours;
    if (decoupled) {
      ours = std::make_unique<ampkit::optim::AdamW>(op, options);
    } else {
      ours = std::make_unique<ampkit::optim::Adam>(
          op, ampkit::optim::AdamOptions(1e-2).betas({0.85, 0.995}).weight_decay(0.02).amsgrad(true));
    }
    for (int step = 0; step < 3; ++step) {
      set_step_grads(op, step);
      ours->step();
    }
    auto tp = clone_params(op, at::kFloat);
    auto check = [&](auto& theirs, auto state_type) {
      using TorchState = decltype(state_type);
      load_from(theirs, saved(*ours));
      CHECK(theirs.param_groups()[0].options().get_lr() == 1e-2);
      for (size_t i = 0; i < op.size(); ++i) {
        const auto& ts = static_cast<const TorchState&>(*theirs.state().at(tp[i].unsafeGetTensorImpl()));
        CHECK(ts.step() == 3);
        check_adam_state(ts, *ampkit::optim::state_of<ampkit::optim::AdamParamState>(*ours, op[i]), true);
      }
      steps_agree(theirs, tp, *ours, op, 3, 6);
    };
    if (decoupled) {
      torch::optim::AdamW theirs(tp, torch::optim::AdamWOptions(1.0));
      check(theirs, torch::optim::AdamWParamState());
      CHECK(static_cast<const torch::optim::AdamWOptions&>(theirs.param_groups()[0].options()).weight_decay() == 0.02);
    } else {
      torch::optim::Adam theirs(tp, torch::optim::AdamOptions(1.0));
      check(theirs, torch::optim::AdamParamState());
      CHECK(static_cast<const torch::optim::AdamOptions&>(theirs.param_groups()[0].options()).amsgrad());
    }
  }
  SECTION("SGD, a skipped first step included") {
    ampkit::optim::SGD ours(op, ampkit::optim::SGDOptions(0.05).momentum(0.9).dampening(0.3));
    // The first step of params 0 and 1 is skipped on an overflow: their states hold step 0 and a buffer no step
    // has filled. LibTorch must start those buffers from the grad, as ampkit does.
    std::vector<at::Tensor> first_two = {op[0], op[1]};
    ampkit::optim::SGD skipped_first(first_two, ampkit::optim::SGDOptions(0.05).momentum(0.9).dampening(0.3));
    std::vector<at::Tensor> rest = {op[2], op[3]};
    ampkit::optim::SGD stepped(rest, ampkit::optim::SGDOptions(0.05).momentum(0.9).dampening(0.3));
    set_step_grads(op, 0);
    skipped_first.set_amp_scaling(torch::ones({}), torch::ones({}));
    skipped_first.step();
    skipped_first.set_amp_scaling({}, {});
    stepped.step();
    CHECK(ampkit::optim::state_of<ampkit::optim::SGDParamState>(skipped_first, op[0])->step().item<double>() == 0);
    auto tp = clone_params(op, at::kFloat);
    std::vector<at::Tensor> tp_first = {tp[0], tp[1]}, tp_rest = {tp[2], tp[3]};
    torch::optim::SGD theirs_first(tp_first, torch::optim::SGDOptions(1.0));
    torch::optim::SGD theirs_rest(tp_rest, torch::optim::SGDOptions(1.0));
    load_from(theirs_first, saved(skipped_first));
    load_from(theirs_rest, saved(stepped));
    CHECK(theirs_first.state().empty());  // the unfilled states are not written
    REQUIRE(theirs_rest.state().size() == 2);
    CHECK(static_cast<const torch::optim::SGDOptions&>(theirs_rest.param_groups()[0].options()).dampening() == 0.3);
    for (size_t i = 0; i < 2; ++i) {
      const auto& ts =
          static_cast<const torch::optim::SGDParamState&>(*theirs_rest.state().at(tp_rest[i].unsafeGetTensorImpl()));
      CHECK(bits_equal(ts.momentum_buffer(),
                       ampkit::optim::state_of<ampkit::optim::SGDParamState>(stepped, rest[i])->momentum_buffer()));
    }
    steps_agree(theirs_first, tp_first, skipped_first, first_two, 1, 4);
    steps_agree(theirs_rest, tp_rest, stepped, rest, 1, 4);
    // ampkit reads its own archive of an unfilled state back as no state, and continues alike.
    ampkit::optim::SGD again({op[0]}, ampkit::optim::SGDOptions(0.05).momentum(0.9));
    again.set_amp_scaling(torch::ones({}), torch::ones({}));
    set_step_grads(op, 9);
    again.step();
    again.set_amp_scaling({}, {});
    ampkit::optim::SGD reloaded({tp[0]}, ampkit::optim::SGDOptions(1.0));
    load_from(reloaded, saved(again));
    CHECK(reloaded.state().empty());
  }
}

TEST_CASE("optim: an FP32 LibTorch run continues in O2 from its archive, masters taken from the FP32 weights",
          "[optim][cpu]") {
  auto tp = make_params(at::kFloat, 4);
  torch::optim::AdamW theirs(tp, torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    set_step_grads(tp, step);
    theirs.step();
  }
  const std::string archive = saved(theirs);
  // Load while the weights are FP32, take the masters from them, then cast to BF16 (what decorate does at O2).
  auto op = clone_params(tp, at::kFloat);
  ampkit::optim::AdamW ours(op, ampkit::optim::AdamWOptions(1.0));
  load_from(ours, archive);
  ours.init_master_params();
  {
    const torch::NoGradGuard no_grad;
    for (auto& p : op) {
      p.set_data(p.detach().to(at::kBFloat16));
    }
  }
  // Loaded into BF16 weights instead: no master in the archive, so it comes from the (rounded) weights.
  auto rounded = clone_params(tp, at::kBFloat16);
  ampkit::optim::AdamW late(rounded, ampkit::optim::AdamWOptions(1.0));
  load_from(late, archive);
  for (size_t i = 0; i < tp.size(); ++i) {
    const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(late, rounded[i]);
    CHECK(!s->master_param().defined());
    CHECK(s->exp_avg().scalar_type() == at::kFloat);  // states stay FP32 for a BF16 weight
  }
  for (int step = 3; step < 6; ++step) {
    set_step_grads(op, step);  // BF16 grads; LibTorch's run gets the same values in FP32
    for (size_t i = 0; i < tp.size(); ++i) {
      tp[i].mutable_grad() = op[i].grad().to(at::kFloat);
      rounded[i].mutable_grad() = op[i].grad().clone();
    }
    theirs.step();
    ours.step();
    late.step();
  }
  for (size_t i = 0; i < tp.size(); ++i) {
    INFO("param " << i);
    const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(ours, op[i]);
    REQUIRE(torch::allclose(s->master_param(), tp[i].detach(), 1e-5, 1e-6));
    CHECK(bits_equal(op[i].detach(), s->master_param().to(at::kBFloat16)));
    // The late load's masters started from rounded weights: off LibTorch's run by about a BF16 rounding.
    const auto* l = ampkit::optim::state_of<ampkit::optim::AdamParamState>(late, rounded[i]);
    REQUIRE(l->master_param().defined());
    CHECK(!torch::allclose(l->master_param(), tp[i].detach(), 1e-5, 1e-6));
    CHECK(torch::allclose(l->master_param(), tp[i].detach(), 1e-2, 1e-2));
  }
}

TEST_CASE("optim: archives that are not of this optimizer's kind are refused, naming the format and the key, "
          "and change nothing",
          "[optim][cpu]") {
  auto ps = make_params(at::kFloat, 5);
  ampkit::optim::Adam adam(ps, ampkit::optim::AdamOptions(1e-2));
  set_step_grads(ps, 0);
  adam.step();
  const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(adam, ps[0]);
  const auto exp_avg = s->exp_avg().clone();
  const auto step = s->step().clone();
  auto expect_unchanged = [&] {
    const auto* now = ampkit::optim::state_of<ampkit::optim::AdamParamState>(adam, ps[0]);
    REQUIRE(now != nullptr);
    CHECK(bits_equal(now->exp_avg(), exp_avg));
    CHECK(bits_equal(now->step(), step));
    CHECK(adam.param_groups()[0].options().get_lr() == 1e-2);
    CHECK(adam.state().size() == ps.size());
  };
  auto tp = clone_params(ps, at::kFloat);
  torch::optim::SGD sgd(tp, torch::optim::SGDOptions(0.5).momentum(0.9));
  set_step_grads(tp, 0);
  sgd.step();
  REQUIRE_THROWS_WITH(load_from(adam, saved(sgd)),
                      Catch::Contains("ampkit::optim::AdamOptions::serialize: the options in the archive must hold "
                                      "'betas', but they do not"));
  expect_unchanged();

  torch::serialize::OutputArchive old_format;  // LibTorch's layout before 1.5: no version key
  old_format.write("learning_rate", c10::IValue(0.5));
  std::ostringstream out;
  old_format.save_to(out);
  REQUIRE_THROWS_WITH(load_from(adam, out.str()),
                      Catch::Contains("ampkit::optim::Adam::load: the archive must hold 'pytorch_version' = "
                                      "\"1.5.0\"") &&
                          Catch::Contains("but it has none"));
  expect_unchanged();

  ampkit::optim::LAMB lamb(clone_params(ps, at::kFloat), ampkit::optim::LAMBOptions(1e-2));
  REQUIRE_THROWS_WITH(load_from(lamb, saved(adam)),
                      Catch::Contains("ampkit::optim::LAMBOptions::serialize: the options in the archive must hold "
                                      "'bias_correction'"));
  CHECK(lamb.state().empty());
}
