// ampkit::GradScaler's reused state on the CPU: update() allocates nothing after the first step while flags
// handed out by last_step_ran() keep their values (NOTE [Step-ran flags]); flags recorded by
// record_unscaled_grads are each kept and all summed (NOTE [Scaler streams]); the min_scale watch warns and
// raises from update() (NOTE [Watching min_scale]). The CUDA side: tests/cpp/test_scaler_cuda.cpp.
#include "support/catch_torch.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <deque>
#include <limits>
#include <set>
#include <string>

using ampkit::GradScaler;
using ampkit::GradScalerOptions;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Counts the CPU allocator's allocations while installed.
class CountingAllocator final : public c10::Allocator {
 public:
  CountingAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~CountingAllocator() override { c10::SetCPUAllocator(inner_, kPriority); }
  CountingAllocator(const CountingAllocator&) = delete;
  CountingAllocator& operator=(const CountingAllocator&) = delete;

  c10::DataPtr allocate(size_t n) override {
    count_.fetch_add(1);
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { inner_->copy_data(dest, src, count); }
  int64_t count() const { return count_.load(); }

 private:
  static constexpr uint8_t kPriority = 200;
  c10::Allocator* inner_;
  std::atomic<int64_t> count_{0};
};

struct Loop {
  at::Tensor p = torch::ones({8}).requires_grad_();
  torch::optim::SGD opt{std::vector<at::Tensor>{p}, torch::optim::SGDOptions(0.5)};

  // One step up to update() (excluded); an Inf in the last element on overflow steps.
  void backward(GradScaler& scaler, bool overflow) {
    opt.zero_grad();
    scaler.scale(p.sum()).backward();
    if (overflow) {
      p.mutable_grad()[7] = kInf;
    }
    scaler.step(opt);
  }
};

bool overflow_at(int step) { return step % 3 == 1; }

// TORCH_WARN messages issued while alive.
struct Warnings : c10::WarningHandler {
  std::vector<std::string> messages;
  c10::WarningUtils::WarningHandlerGuard guard{this};
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
};

}  // namespace

TEST_CASE("GradScaler: update() allocates nothing after the first step", "[scaler][cpu]") {
  Loop loop;
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(2).min_scale(1.0).hysteresis(2));
  std::set<const void*> written;
  for (int step = 0; step < 12; ++step) {
    loop.backward(scaler, overflow_at(step));
    int64_t allocated = 0;
    {
      CountingAllocator counting;
      scaler.update();
      allocated = counting.count();
    }
    if (step > 0) {  // the first update() creates the min_scale watch's host copy
      REQUIRE(allocated == 0);
    }
    const at::Tensor ran = scaler.last_step_ran();
    REQUIRE(ran.scalar_type() == at::kBool);
    REQUIRE(ran.item<bool>() == !overflow_at(step));
    written.insert(ran.const_data_ptr());
  }
  REQUIRE(written.size() == 1);  // nobody held a flag: always the same one
}

TEST_CASE("GradScaler: flags handed out by last_step_ran() keep their values", "[scaler][cpu]") {
  Loop loop;
  GradScaler scaler(GradScalerOptions().init_scale(1024.0));
  std::deque<std::pair<at::Tensor, bool>> held;  // the last three flags, read only when they leave
  std::vector<at::Tensor> kept;                  // every fifth flag, read at the end
  std::vector<bool> kept_truth;
  std::set<const void*> written;
  int64_t allocated_late = 0;
  for (int step = 0; step < 40; ++step) {
    loop.backward(scaler, overflow_at(step));
    {
      CountingAllocator counting;
      scaler.update();
      if (step >= 20) {
        allocated_late += counting.count();
      }
    }
    at::Tensor ran = scaler.last_step_ran();
    written.insert(ran.const_data_ptr());
    if (step % 5 == 0) {
      kept.push_back(ran.view({1}));  // a view holds the storage, not the tensor
      kept_truth.push_back(!overflow_at(step));
    }
    held.emplace_back(std::move(ran), !overflow_at(step));
    if (held.size() > 3) {
      REQUIRE(held.front().first.item<bool>() == held.front().second);
      held.pop_front();
    }
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    REQUIRE(kept[i].item<bool>() == kept_truth[i]);
  }
  // Three held flags plus the one written: four flags while the loop holds three; one more per kept view.
  REQUIRE(written.size() <= 4 + kept.size());
  REQUIRE(allocated_late <= static_cast<int64_t>(kept.size()));  // only for the views kept since step 20
}

TEST_CASE("GradScaler: every recorded flag counts, each copied when recorded", "[scaler][cpu]") {
  const std::vector<std::vector<float>> cases = {{0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {0, 0, 1}, {0}, {1}};
  for (const auto& flags : cases) {
    Loop loop;
    GradScaler scaler(GradScalerOptions().init_scale(8.0));
    loop.opt.zero_grad();
    scaler.scale(loop.p.sum()).backward();
    loop.p.mutable_grad().mul_(scaler.unscale_factor(at::kCPU));
    at::Tensor reused = torch::zeros({1});
    for (float f : flags) {
      reused.fill_(f);
      scaler.record_unscaled_grads(reused);  // one tensor for every bucket: the scaler keeps copies
    }
    reused.fill_(0.f);
    REQUIRE(scaler.grads_unscaled_outside());
    scaler.step(loop.opt);
    scaler.update();
    const bool overflow = std::find(flags.begin(), flags.end(), 1.f) != flags.end();
    REQUIRE(scaler.last_step_ran().item<bool>() == !overflow);
    REQUIRE(scaler.get_scale() == (overflow ? 4.0 : 8.0));
    REQUIRE(scaler.stats().skipped_steps == (overflow ? 1 : 0));
    REQUIRE_FALSE(scaler.grads_unscaled_outside());  // update() ended the iteration
  }
}

TEST_CASE("GradScaler: overflows at min_scale warn once from update(), or raise from every update()", "[scaler][cpu]") {
  SECTION("warn") {
    Loop loop;
    GradScaler scaler(GradScalerOptions().init_scale(4.0).min_scale(2.0));
    Warnings warnings;
    for (int step = 0; step < 5; ++step) {
      loop.backward(scaler, step >= 1);  // 4 -> 2 at step 1, at min_scale from step 2 on
      scaler.update();
      // On the CPU the watch reads the count in the update() of the overflow itself.
      REQUIRE(warnings.messages.size() == (step >= 2 ? 1u : 0u));
    }
    REQUIRE(warnings.messages[0].find("min_scale (2.000000), 1 time(s)") != std::string::npos);
    REQUIRE(scaler.stats().overflows_at_min_scale == 3);
  }
  SECTION("raise, then a loaded state without overflows at min_scale stops it") {
    Loop loop;
    GradScaler scaler(GradScalerOptions().init_scale(2.0).min_scale(2.0).raise_at_min_scale(true));
    loop.backward(scaler, false);
    scaler.update();
    loop.backward(scaler, true);
    REQUIRE_THROWS_WITH(scaler.update(), Catch::Contains("kept overflowing with the loss scale at min_scale"));
    REQUIRE_FALSE(scaler.in_iteration());  // the iteration was closed before the raise
    loop.backward(scaler, false);
    REQUIRE_THROWS_WITH(scaler.update(), Catch::Contains("1 time(s)"));  // every update() after it
    auto state = scaler.state_dict();
    for (auto& [key, value] : state) {
      if (key == "_overflows_at_min_scale") {
        value = int64_t{0};
      }
    }
    scaler.load_state_dict(state);
    loop.backward(scaler, false);
    REQUIRE_NOTHROW(scaler.update());
    REQUIRE(scaler.stats().steps == 4);
  }
}
