// ampkit::optim's decisions from C++ (ampkit::optim::core, shared with ampkit.optim): torch.optim's single-tensor
// path for FP64, complex, sparse and non-dense parameters against a float64 reference, master modes (auto, off,
// remainder), tensor learning rates, a resumed torch-style SGD momentum buffer, and loads that check and roll back.
#include "support/catch_torch.h"

#include <cmath>

#include "support/test_helpers.h"

using ampkit::optim::MasterWeights;
using ampkit::test::bits_equal;
using ampkit::test::load_from;
using ampkit::test::saved;

namespace {

// Adam/AdamW on float64, element by element: the formula of torch.optim.Adam (no amsgrad), independent of ATen.
struct AdamRef {
  double lr, beta1, beta2, eps, wd;
  bool decoupled;
  std::vector<double> p, m, v;
  void step(const std::vector<double>& g, int t) {
    for (size_t i = 0; i < p.size(); ++i) {
      double grad = g[i];
      if (wd != 0 && decoupled) {
        p[i] *= 1 - lr * wd;
      } else if (wd != 0) {
        grad += wd * p[i];
      }
      m[i] = beta1 * m[i] + (1 - beta1) * grad;
      v[i] = beta2 * v[i] + (1 - beta2) * grad * grad;
      const double bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
};

std::vector<double> values(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kDouble).contiguous().reshape(-1);
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

double max_abs_diff(const at::Tensor& t, const std::vector<double>& ref) {
  const auto v = values(t);
  double d = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    d = std::max(d, std::abs(v[i] - ref[i]));
  }
  return d;
}

}  // namespace

TEST_CASE("optim core: FP64 and complex parameters take torch.optim's single-tensor Adam (LibTorch AdamW)",
          "[optim][cpu]") {
  torch::manual_seed(3);
  auto p64 = torch::randn({37}, torch::kDouble).requires_grad_();
  // A complex parameter is Adam on its real view (torch.optim's view_as_real), here the same 2 x 37 numbers.
  auto pc = torch::view_as_complex(p64.detach().reshape({37, 1}).repeat({1, 2}).contiguous()).requires_grad_();
  AdamRef ref{1e-2, 0.9, 0.99, 1e-8, 0.1, true, values(p64), std::vector<double>(37), std::vector<double>(37)};
  AdamRef ref_c = ref;
  ref_c.p = values(torch::view_as_real(pc.detach()));
  ref_c.m.assign(74, 0);
  ref_c.v.assign(74, 0);
  const auto options = ampkit::optim::AdamWOptions(1e-2).betas({0.9, 0.99}).weight_decay(0.1);
  ampkit::optim::AdamW opt64({p64}, options);
  ampkit::optim::AdamW optc({pc}, options);
  for (int t = 1; t <= 20; ++t) {
    const auto g = torch::randn({37}, torch::kDouble);
    p64.mutable_grad() = g;
    const auto gc = torch::randn({37, 2}, torch::kDouble);
    pc.mutable_grad() = torch::view_as_complex(gc);
    opt64.step();
    optc.step();
    ref.step(values(g), t);
    ref_c.step(values(gc), t);
  }
  CHECK(max_abs_diff(p64, ref.p) < 1e-12);
  CHECK(max_abs_diff(torch::view_as_real(pc.detach()), ref_c.p) < 1e-12);
  // torch.optim's state format on this path: moments in the parameter's dtype, the step on the CPU.
  const auto* s = ampkit::optim::state_of<ampkit::optim::AdamParamState>(opt64, p64);
  REQUIRE(s != nullptr);
  CHECK(s->exp_avg().scalar_type() == at::kDouble);
  CHECK(s->step().item<double>() == 20.0);
  CHECK_FALSE(s->master_param().defined());
}

TEST_CASE("optim core: sparse SGD grads and parameters with gaps in memory step as dense ones do", "[optim][cpu]") {
  torch::manual_seed(4);
  auto dense_p = torch::randn({6, 3}).requires_grad_();
  auto sparse_p = dense_p.detach().clone().requires_grad_();
  auto strided_base = torch::randn({6, 6});
  auto strided_p = strided_base.index({torch::indexing::Slice(), torch::indexing::Slice(0, 6, 2)});
  strided_p.copy_(dense_p.detach());
  strided_p.requires_grad_();
  REQUIRE_FALSE(strided_p.is_contiguous());
  // No weight decay: torch.optim.SGD cannot add a dense parameter to a sparse grad either.
  const auto options = ampkit::optim::SGDOptions(0.1).momentum(0.9).nesterov(true);
  ampkit::optim::SGD a({dense_p}, options), b({sparse_p}, options), c({strided_p}, options);
  std::vector<double> ref = values(dense_p), buf(18, 0);
  for (int t = 0; t < 5; ++t) {
    const auto g = torch::randn({6, 3});
    const auto gv = values(g);
    for (size_t i = 0; i < ref.size(); ++i) {  // float64 SGD with nesterov momentum, buffer started from the grad
      const double d = gv[i];
      buf[i] = t == 0 ? d : 0.9 * buf[i] + d;
      ref[i] -= 0.1 * (d + 0.9 * buf[i]);
    }
    dense_p.mutable_grad() = g;
    sparse_p.mutable_grad() = g.to_sparse();
    strided_p.mutable_grad() = g.clone();
    a.step();
    b.step();
    c.step();
  }
  CHECK(max_abs_diff(dense_p, ref) < 1e-5);
  CHECK(max_abs_diff(sparse_p, ref) < 1e-5);
  CHECK(max_abs_diff(strided_p, ref) < 1e-5);
  // Adam refuses sparse grads (as torch.optim.Adam), before anything is written.
  auto q = torch::randn({4}).requires_grad_();
  ampkit::optim::Adam adam({q}, ampkit::optim::AdamOptions(0.1));
  q.mutable_grad() = torch::ones({4}).to_sparse();
  const auto q0 = q.detach().clone();
  REQUIRE_THROWS_WITH(adam.step(), Catch::Contains("Adam does not support sparse gradients"));
  CHECK(torch::equal(q.detach(), q0));
  CHECK(adam.state().empty());
}

TEST_CASE("optim core: master modes auto, off and remainder from C++", "[optim][cpu]") {
  torch::manual_seed(5);
  const auto start = torch::randn({1000});
  auto with_master = start.to(at::kBFloat16).requires_grad_();
  auto with_rem = start.to(at::kBFloat16).requires_grad_();
  auto without = start.to(at::kBFloat16).requires_grad_();
  ampkit::optim::AdamW m({with_master}, ampkit::optim::AdamWOptions(1e-3));
  ampkit::optim::AdamW r({with_rem}, ampkit::optim::AdamWOptions(1e-3).master_weights(MasterWeights::remainder()));
  ampkit::optim::AdamW n({without}, ampkit::optim::AdamWOptions(1e-3).master_weights(false));
  for (int t = 0; t < 30; ++t) {
    const auto g = torch::randn({1000}).to(at::kBFloat16);
    for (auto* p : {&with_master, &with_rem, &without}) {
      p->mutable_grad() = g.clone();
    }
    m.step();
    r.step();
    n.step();
  }
  const auto* sm = ampkit::optim::state_of<ampkit::optim::AdamParamState>(m, with_master);
  const auto* sr = ampkit::optim::state_of<ampkit::optim::AdamParamState>(r, with_rem);
  const auto* sn = ampkit::optim::state_of<ampkit::optim::AdamParamState>(n, without);
  REQUIRE(sm->master_param().defined());
  CHECK_FALSE(sr->master_param().defined());
  REQUIRE(sr->param_remainder().scalar_type() == at::kShort);
  CHECK_FALSE(sn->master_param().defined());
  CHECK_FALSE(sn->param_remainder().defined());
  // The remainder holds the FP32 master exactly: the same bits as the FP32-master run's master.
  const auto held = ampkit::optim::core::master_from_remainder(with_rem, sr->param_remainder());
  CHECK(bits_equal(held, sm->master_param()));
  // Without a master, 30 steps of 1e-3 are partly lost to BF16 rounding: the weight differs from the master run's.
  CHECK_FALSE(torch::equal(without.detach(), with_master.detach()));
  // Remainder mode needs BF16 parameters; the error names the option as C++ spells it.
  auto h = torch::randn({4}).to(at::kHalf).requires_grad_();
  ampkit::optim::SGD bad({h}, ampkit::optim::SGDOptions(0.1).master_weights(MasterWeights::remainder()));
  h.mutable_grad() = torch::ones({4}).to(at::kHalf);
  REQUIRE_THROWS_WITH(bad.step(), Catch::Contains("master_weights(MasterWeights::remainder()) needs BFloat16"));
  CHECK(MasterWeights::from_name("remainder") == MasterWeights::remainder());
  CHECK_THROWS_WITH(MasterWeights::from_name("half"),
                    Catch::Contains("expected 'auto', 'on', 'off', 'remainder', 'stochastic' or 'kahan'"));
}

TEST_CASE("optim core: a tensor learning rate gives the float lr's steps and follows in-place changes",
          "[optim][cpu]") {
  torch::manual_seed(6);
  auto a = torch::randn({257}).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  const auto lr = torch::full({}, 1e-2, torch::kFloat);
  ampkit::optim::AdamW by_value({a}, ampkit::optim::AdamWOptions(1e-2));
  ampkit::optim::AdamW by_tensor({b}, ampkit::optim::AdamWOptions().lr_tensor(lr));
  for (int t = 0; t < 6; ++t) {
    if (t == 3) {  // a schedule that writes the tensor in place
      lr.fill_(static_cast<float>(3e-3));
      static_cast<ampkit::optim::AdamWOptions&>(by_value.param_groups()[0].options()).lr(static_cast<float>(3e-3));
    }
    const auto g = torch::randn({257});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    by_value.step();
    by_tensor.step();
  }
  CHECK(bits_equal(a.detach(), b.detach()));
  // The tensor is saved with the options and comes back.
  ampkit::optim::AdamW loaded({b}, ampkit::optim::AdamWOptions(0.5));
  load_from(loaded, saved(by_tensor));
  const auto& o = static_cast<const ampkit::optim::AdamWOptions&>(loaded.param_groups()[0].options());
  REQUIRE(o.lr_tensor().defined());
  CHECK(o.lr_tensor().item<float>() == static_cast<float>(3e-3));
  // More than one element is refused (torch.optim's message).
  auto c = torch::randn({3}).requires_grad_();
  CHECK_THROWS_WITH(ampkit::optim::SGD({c}, ampkit::optim::SGDOptions(0.1).lr_tensor(torch::ones({2}))),
                    Catch::Contains("Tensor lr must be 1-element"));
}

TEST_CASE("optim core: an SGD momentum buffer loaded without a step is continued, not restarted", "[optim][cpu]") {
  // torch.optim.SGD's state has a momentum buffer and no step: p = 0, lr 1, momentum 0.9, grad 1 twice gives
  // p = -1 - (0.9 + 1) = -2.9 when the second step continues the buffer (restarting it would give -2).
  auto p = torch::zeros({3}).requires_grad_();
  ampkit::optim::SGD first({p}, ampkit::optim::SGDOptions(1.0).momentum(0.9));
  p.mutable_grad() = torch::ones({3});
  first.step();
  ampkit::optim::state_of<ampkit::optim::SGDParamState>(first, p)->step(at::Tensor());  // torch's format
  ampkit::optim::SGD resumed({p}, ampkit::optim::SGDOptions(1.0).momentum(0.9));
  load_from(resumed, saved(first));
  resumed.step();
  CHECK(torch::allclose(p.detach(), torch::full({3}, -2.9f)));
  // SGD without momentum or master keeps no state at all.
  auto q = torch::randn({3}).requires_grad_();
  ampkit::optim::SGD plain({q}, ampkit::optim::SGDOptions(0.1));
  q.mutable_grad() = torch::ones({3});
  plain.step();
  CHECK(plain.state().empty());
}

TEST_CASE("optim core: load checks shapes and partial states and leaves the optimizer as it was on failure",
          "[optim][cpu]") {
  torch::manual_seed(7);
  auto small = torch::randn({5}).requires_grad_();
  ampkit::optim::AdamW source({small}, ampkit::optim::AdamWOptions(1e-2));
  small.mutable_grad() = torch::randn({5});
  source.step();

  auto big = torch::randn({6}).requires_grad_();
  ampkit::optim::AdamW target({big}, ampkit::optim::AdamWOptions(5e-3));
  big.mutable_grad() = torch::randn({6});
  target.step();
  const auto* before = ampkit::optim::state_of<ampkit::optim::AdamParamState>(target, big);
  const auto exp_avg0 = before->exp_avg().clone();
  REQUIRE_THROWS_WITH(load_from(target, saved(source)), Catch::Contains("must have the parameter's shape"));
  const auto* after = ampkit::optim::state_of<ampkit::optim::AdamParamState>(target, big);
  CHECK(torch::equal(after->exp_avg(), exp_avg0));
  CHECK(static_cast<const ampkit::optim::AdamWOptions&>(target.param_groups()[0].options()).lr() == 5e-3);

  // A state with moments but no step would restart silently from step 0: refused.
  ampkit::optim::state_of<ampkit::optim::AdamParamState>(source, small)->step(at::Tensor());
  auto same = torch::randn({5}).requires_grad_();
  ampkit::optim::AdamW fresh({same}, ampkit::optim::AdamWOptions(1e-2));
  REQUIRE_THROWS_WITH(load_from(fresh, saved(source)), Catch::Contains("a partial state would silently restart"));
  CHECK(fresh.state().empty());

  // A BF16 parameter's saved FP32 state stays FP32 through a load (LibTorch restores tensors as saved).
  auto w = torch::randn({9}).to(at::kBFloat16).requires_grad_();
  ampkit::optim::AdamW src16({w}, ampkit::optim::AdamWOptions(1e-2));
  w.mutable_grad() = torch::randn({9}).to(at::kBFloat16);
  src16.step();
  ampkit::optim::AdamW dst16({w}, ampkit::optim::AdamWOptions(1e-2));
  load_from(dst16, saved(src16));
  const auto* s16 = ampkit::optim::state_of<ampkit::optim::AdamParamState>(dst16, w);
  CHECK(s16->exp_avg().scalar_type() == at::kFloat);
  CHECK(bits_equal(s16->master_param(),
                   ampkit::optim::state_of<ampkit::optim::AdamParamState>(src16, w)->master_param()));
}
