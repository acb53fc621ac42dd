// ampkit::AutocastGuard: the scope sets and restores autocast state exactly as torch.autocast, nests, survives
// exceptions, and clears the cast cache when the outermost scope exits.
#include "catch_torch.h"

#include <ATen/autocast_mode.h>

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
