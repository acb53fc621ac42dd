// The fused steps' checks in parts (NOTE [Checks in parts] in csrc/ops/checks.cpp): when they run, that the
// descriptors and errors are those of one pass, and that a part gives up on a copy-on-write storage and on errors;
// and that the pass's look-ahead (NOTE [Metadata prefetch]) changes no error and no descriptor.

#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "csrc/ops/op_args.h"
#include "support/catch_torch.h"

namespace {

namespace ops = ampkit::detail;
using ampkit::kernels::OptimTensor;

struct Lists {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
};

Lists make_lists(int n) {
  Lists l;
  for (int i = 0; i < n; ++i) {
    l.params.push_back(at::randn({13 + i % 4}));
    l.grads.push_back(at::randn({13 + i % 4}));
    l.exp_avgs.push_back(at::zeros({13 + i % 4}));
    l.exp_avg_sqs.push_back(at::zeros({13 + i % 4}));
    l.steps.push_back(at::zeros({}));
  }
  return l;
}

ops::AdamStepArgs args_of(const Lists& l) {
  ops::AdamStepArgs a{};
  a.op = "adamw_step_";
  a.lists.params = l.params;
  a.lists.grads = l.grads;
  a.lists.exp_avgs = l.exp_avgs;
  a.lists.exp_avg_sqs = l.exp_avg_sqs;
  a.lists.state_steps = l.steps;
  a.hparams.lr = 1e-3;
  a.hparams.beta1 = 0.9;
  a.hparams.beta2 = 0.999;
  a.hparams.eps = 1e-8;
  return a;
}

// The descriptors (or the error's first line) of `l` checked with `threads` intra-op threads.
std::vector<OptimTensor> descriptors(const Lists& l, int threads, std::string* error = nullptr) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  std::vector<OptimTensor> out;
  try {
    ops::check_and_build_descriptors(args_of(l), &out);
  } catch (const c10::Error& e) {
    if (error == nullptr) {
      throw;
    }
    *error = e.what_without_backtrace();
  }
  at::set_num_threads(before);
  return out;
}

void require_same(const std::vector<OptimTensor>& a, const std::vector<OptimTensor>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].param == b[i].param);
    CHECK(a[i].grad == b[i].grad);
    CHECK(a[i].exp_avg == b[i].exp_avg);
    CHECK(a[i].exp_avg_sq == b[i].exp_avg_sq);
    CHECK(a[i].step == b[i].step);
    CHECK(a[i].numel == b[i].numel);
    CHECK(a[i].dtype == b[i].dtype);
  }
}

}  // namespace

TEST_CASE("checks in parts: from 512 parameters on two threads, the descriptors of one pass", "[ops][cpu]") {
  at::manual_seed(20261207);
  const Lists l = make_lists(700);
  const auto before = ops::checks_in_parts_count();
  const std::vector<OptimTensor> parts = descriptors(l, 2);
  const auto after = ops::checks_in_parts_count();
  CHECK(after.ran == before.ran + 1);
  CHECK(after.gave_up == before.gave_up);
  const std::vector<OptimTensor> one = descriptors(l, 1);
  CHECK(ops::checks_in_parts_count().ran == after.ran);  // one thread: one pass
  require_same(parts, one);
  for (size_t i = 0; i < one.size(); ++i) {
    CHECK(one[i].param == l.params[i].data_ptr());
    CHECK(one[i].exp_avg_sq == l.exp_avg_sqs[i].data_ptr());
  }
  const Lists few = make_lists(511);
  descriptors(few, 2);
  CHECK(ops::checks_in_parts_count().ran == after.ran);  // below 512: one pass
}

TEST_CASE("checks in parts: a copy-on-write storage or a failed check gives up to one pass", "[ops][cpu]") {
  at::manual_seed(20261208);
  SECTION("a lazy clone in the second part: materialized by the one pass, its source left alone") {
    Lists l = make_lists(700);
    const at::Tensor source = at::randn({13 + 600 % 4});
    l.exp_avgs[600] = at::_lazy_clone(source);
    const auto before = ops::checks_in_parts_count();
    const std::vector<OptimTensor> got = descriptors(l, 2);
    CHECK(ops::checks_in_parts_count().gave_up == before.gave_up + 1);
    CHECK(ops::checks_in_parts_count().ran == before.ran);
    CHECK(got[600].exp_avg == l.exp_avgs[600].const_data_ptr());
    CHECK(got[600].exp_avg != source.const_data_ptr());
    require_same(got, descriptors(l, 1));
  }
  SECTION("errors in both parts: the first parameter's, as one pass gives it") {
    Lists l = make_lists(700);
    l.grads[650] = at::randn({2});
    l.exp_avg_sqs[120] = l.exp_avg_sqs[120].to(at::kDouble);
    std::string two;
    std::string one;
    const auto before = ops::checks_in_parts_count();
    descriptors(l, 2, &two);
    CHECK(ops::checks_in_parts_count().gave_up == before.gave_up + 1);
    descriptors(l, 1, &one);
    CHECK(two == one);
    CHECK_THAT(two, Catch::Contains("exp_avg_sqs[120]"));
  }
}

TEST_CASE("metadata prefetch: tensors read ahead change no error and no descriptor", "[ops][cpu]") {
  // NOTE [Metadata prefetch]: the pass prefetches the tensors 8 parameters ahead and the storages 4 ahead.
  at::manual_seed(20261207);
  for (const int n : {12, 700}) {  // one pass; in parts on two threads
    for (const int threads : {1, 2}) {
      SECTION("n " + std::to_string(n) + ", " + std::to_string(threads) + " threads: an undefined grad ahead") {
        Lists l = make_lists(n);
        l.exp_avgs[3] = l.exp_avgs[3].to(at::kDouble);
        l.grads[7] = at::Tensor();   // 4 ahead of the failing parameter
        l.grads[11] = at::Tensor();  // 8 ahead of it
        std::string error;
        descriptors(l, threads, &error);
        CHECK_THAT(error, Catch::Contains("exp_avgs[3] must be Float"));
        l.exp_avgs[3] = at::zeros_like(l.params[3]);
        error.clear();
        descriptors(l, threads, &error);
        CHECK_THAT(error, Catch::Contains("grads[7] is undefined"));
      }
      SECTION("n " + std::to_string(n) + ", " + std::to_string(threads) + " threads: the last parameters") {
        const Lists l = make_lists(n);
        const auto before = ops::checks_in_parts_count();
        const std::vector<OptimTensor> got = descriptors(l, threads);
        // in parts where they run (the worker threads' prefetch tested too), else one pass
        CHECK(ops::checks_in_parts_count().ran == before.ran + (n >= 512 && threads == 2 ? 1 : 0));
        REQUIRE(got.size() == static_cast<size_t>(n));
        for (int i = n - 9; i < n; ++i) {  // none ahead of them
          CHECK(got[i].param == l.params[i].const_data_ptr());
          CHECK(got[i].step == l.steps[i].const_data_ptr());
        }
      }
    }
  }
}
