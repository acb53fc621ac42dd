// The ops' alias check (csrc/ops/alias_check.h, NOTE [Aliasing]) on its own: which tensors it refuses as sharing
// memory, across lists and within one, which views of one storage it lets pass, the read-only lists, and that
// its memo (NOTE [Alias check memo]) never lets a refused set pass.

#include "support/catch_torch.h"

#include <optional>
#include <string>
#include <vector>

#include "csrc/ops/alias_check.h"

using ampkit::detail::AliasCheck;

namespace {

at::Tensor seeded(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) {
  return at::randn(sizes, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

// Checks `a` and `b` (each a one-tensor argument, written unless `*_read_only`) and returns the error message,
// empty when the check passes. The message names the argument whose memory starts first first.
std::string check_pair(const at::Tensor& a, const at::Tensor& b, bool a_read_only = false, bool b_read_only = false) {
  AliasCheck alias("test_op");
  alias.add("a", a, -1, a_read_only);
  alias.add("b", b, -1, b_read_only);
  try {
    alias.check();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST_CASE("AliasCheck: overlapping views of one buffer are refused, naming both arguments", "[ops][cpu]") {
  at::manual_seed(20261205);
  const at::Tensor buffer = seeded({64});

  SECTION("the same tensor twice") {
    // Equal ranges: either may be named first.
    const std::string message = check_pair(buffer, buffer);
    CHECK_THAT(message, Catch::Contains("ampkit::test_op: a and b share memory") ||
                            Catch::Contains("ampkit::test_op: b and a share memory"));
  }
  SECTION("a view and its base") {
    CHECK_THAT(check_pair(buffer, buffer.narrow(0, 10, 5)), Catch::Contains("share memory"));
  }
  SECTION("partial overlap: same storage, offsets one element apart") {
    CHECK_THAT(check_pair(buffer.narrow(0, 0, 16), buffer.narrow(0, 1, 16)), Catch::Contains("share memory"));
  }
  SECTION("a transposed view of the same elements (non-contiguous ranges)") {
    const at::Tensor m = buffer.view({8, 8});
    CHECK_THAT(check_pair(m, m.t()), Catch::Contains("share memory"));
  }
  SECTION("a one-element device scalar inside a list's tensor") {
    CHECK_THAT(check_pair(buffer, buffer.narrow(0, 63, 1)), Catch::Contains("share memory"));
  }
  SECTION("views of different dtypes over the same bytes") {
    CHECK_THAT(check_pair(buffer, buffer.view(at::kInt)), Catch::Contains("share memory"));
  }
}

TEST_CASE("AliasCheck: disjoint memory passes, views of one storage included", "[ops][cpu]") {
  at::manual_seed(20261206);
  const at::Tensor buffer = seeded({64});

  SECTION("separate tensors") { CHECK(check_pair(seeded({64}), seeded({64})).empty()); }
  SECTION("adjacent views of one storage: one ends where the other starts") {
    CHECK(check_pair(buffer.narrow(0, 0, 32), buffer.narrow(0, 32, 32)).empty());
  }
  SECTION("views with a gap between them") {
    CHECK(check_pair(buffer.narrow(0, 0, 10), buffer.narrow(0, 11, 10)).empty());
  }
  SECTION("interleaved strided views that share no element: even and odd columns") {
    const at::Tensor m = buffer.view({8, 8});
    CHECK(check_pair(m.slice(1, 0, 8, 2), m.slice(1, 1, 8, 2)).empty());
  }
  SECTION("FP16 halves of one buffer") {
    const at::Tensor half = seeded({64}, at::kHalf);
    CHECK(check_pair(half.narrow(0, 0, 31), half.narrow(0, 31, 33)).empty());
  }
}

TEST_CASE("AliasCheck: zero-size, undefined, absent and Meta tensors take no part", "[ops][cpu]") {
  at::manual_seed(20261207);
  const at::Tensor buffer = seeded({16});

  SECTION("a zero-size view at the data pointer of another tensor") {
    CHECK(check_pair(buffer, buffer.narrow(0, 4, 0)).empty());
  }
  SECTION("the same zero-size tensor twice") {
    const at::Tensor empty = seeded({0});
    CHECK(check_pair(empty, empty).empty());
  }
  SECTION("an undefined tensor and an absent optional") {
    AliasCheck alias("test_op");
    alias.add("a", buffer);
    alias.add("b", at::Tensor());
    alias.add("c", std::optional<at::Tensor>());
    CHECK_NOTHROW(alias.check());
  }
  SECTION("Meta tensors have no memory") {
    const at::Tensor meta = at::empty({16}, at::TensorOptions().device(at::kMeta));
    CHECK(check_pair(meta, meta).empty());
  }
}

TEST_CASE("AliasCheck: lists name the index, within a list and across lists", "[ops][cpu]") {
  at::manual_seed(20261208);
  const at::Tensor buffer = seeded({96});
  std::vector<at::Tensor> params = {seeded({8}), buffer.narrow(0, 0, 32), seeded({5})};

  SECTION("within a list: the same tensor at two indices") {
    params.push_back(params[0]);
    AliasCheck alias("test_op");
    alias.add("params", params);
    CHECK_THROWS_WITH(alias.check(), Catch::Contains("params[0] and params[3] share memory") ||
                                         Catch::Contains("params[3] and params[0] share memory"));
  }
  SECTION("within a list: overlapping views") {
    params.push_back(buffer.narrow(0, 31, 2));
    AliasCheck alias("test_op");
    alias.add("params", params);
    CHECK_THROWS_WITH(alias.check(), Catch::Contains("params[1] and params[3] share memory"));
  }
  SECTION("across lists") {
    const std::vector<at::Tensor> exp_avgs = {seeded({8}), seeded({32}), buffer.narrow(0, 16, 5)};
    AliasCheck alias("test_op");
    alias.add("params", params);
    alias.add("exp_avgs", exp_avgs);
    CHECK_THROWS_WITH(alias.check(), Catch::Contains("params[1] and exp_avgs[2] share memory"));
  }
  SECTION("across lists, disjoint views of one storage pass") {
    const std::vector<at::Tensor> exp_avgs = {seeded({8}), buffer.narrow(0, 32, 32), buffer.narrow(0, 64, 5)};
    AliasCheck alias("test_op");
    alias.add("params", params);
    alias.add("exp_avgs", exp_avgs);
    CHECK_NOTHROW(alias.check());
  }
  SECTION("a list and a device scalar") {
    const std::optional<at::Tensor> found_inf = buffer.narrow(0, 3, 1);
    AliasCheck alias("test_op");
    alias.add("params", params);
    alias.add("found_inf", found_inf);
    CHECK_THROWS_WITH(alias.check(), Catch::Contains("params[1] and found_inf share memory"));
  }
}

TEST_CASE("AliasCheck: read-only tensors may share memory with each other only", "[ops][cpu]") {
  at::manual_seed(20261209);
  const at::Tensor buffer = seeded({32});

  SECTION("two read-only tensors") { CHECK(check_pair(buffer, buffer.narrow(0, 2, 4), true, true).empty()); }
  SECTION("a read-only tensor and a written one") {
    CHECK_THAT(check_pair(buffer, buffer.narrow(0, 2, 4), true, false), Catch::Contains("share memory"));
    CHECK_THAT(check_pair(buffer, buffer.narrow(0, 2, 4), false, true), Catch::Contains("share memory"));
  }
  SECTION("a read-only list holding one tensor twice, and a written list apart from it") {
    const std::vector<at::Tensor> src = {buffer, buffer};
    const std::vector<at::Tensor> out = {seeded({32}), seeded({32})};
    AliasCheck alias("test_op");
    alias.add("out", out);
    alias.add("src", src, /*read_only=*/true);
    CHECK_NOTHROW(alias.check());
  }
  SECTION("a written list overlapping a read-only one") {
    const std::vector<at::Tensor> src = {seeded({32}), buffer};
    const std::vector<at::Tensor> out = {seeded({32}), buffer.narrow(0, 8, 8)};
    AliasCheck alias("test_op");
    alias.add("out", out);
    alias.add("src", src, /*read_only=*/true);
    CHECK_THROWS_WITH(alias.check(), Catch::Contains("src[1] and out[1] share memory"));
  }
}

TEST_CASE("AliasCheck: a remembered pass never lets an aliasing set through", "[ops][cpu]") {
  at::manual_seed(20261210);
  const at::Tensor buffer = seeded({32});

  // The same ranges pass again (the memo), then the same ranges with the read-only flags changed must not.
  CHECK(check_pair(buffer, buffer, true, true).empty());
  CHECK(check_pair(buffer, buffer, true, true).empty());
  CHECK_THAT(check_pair(buffer, buffer, false, true), Catch::Contains("share memory"));
  // A passing set, then one tensor replaced by a view of the other.
  const at::Tensor other = seeded({32});
  CHECK(check_pair(buffer, other).empty());
  CHECK(check_pair(buffer, other).empty());
  CHECK_THAT(check_pair(buffer, buffer.narrow(0, 0, 32)), Catch::Contains("share memory"));
  // Two storages over the same memory (from_blob twice): ATen's overlap test sees no alias and the pair passes,
  // but is not remembered, so the same ranges as views of one storage are refused right after it.
  const at::Tensor a = at::from_blob(buffer.data_ptr(), {32});
  const at::Tensor b = at::from_blob(buffer.data_ptr(), {32});
  CHECK(check_pair(a, b).empty());
  CHECK(check_pair(a, b).empty());
  CHECK_THAT(check_pair(buffer, buffer.view({32})), Catch::Contains("share memory"));
}

TEST_CASE("AliasCheck: add_defined records the tensor and returns its data pointer on request", "[ops][cpu]") {
  at::manual_seed(20261211);
  const at::Tensor buffer = seeded({16});
  const at::Tensor view = buffer.narrow(0, 4, 4);
  AliasCheck alias("test_op");
  CHECK(alias.add_defined("a", view, 0, false, true) == view.data_ptr());
  CHECK(alias.add_defined("b", buffer, 1, false, false) == nullptr);
  CHECK_THROWS_WITH(alias.check(), Catch::Contains("b[1] and a[0] share memory"));
}

TEST_CASE("AliasCheck: parts appended in order check as one, and a part gives up on copy-on-write storages",
          "[ops][cpu]") {
  // NOTE [Checks in parts] in csrc/ops/checks.cpp: each part records its own ranges, appended afterwards.
  at::manual_seed(20261207);
  const at::Tensor buffer = seeded({64});
  const at::Tensor other = seeded({64});

  SECTION("an overlap between two parts is refused, naming both with their indices") {
    AliasCheck whole("test_op");
    AliasCheck first("test_op");
    AliasCheck second("test_op");
    first.add_defined("m", other, 0, false, true);
    first.add_defined("m", buffer.narrow(0, 0, 8), 1, false, true);
    second.add_defined("m", buffer.narrow(0, 4, 8), 2, false, true);
    whole.append(first);
    whole.append(second);
    CHECK_THROWS_WITH(whole.check(), Catch::Contains("m[1] and m[2] share memory"));
  }
  SECTION("disjoint parts pass, read-only flags kept") {
    AliasCheck whole("test_op");
    AliasCheck first("test_op");
    AliasCheck second("test_op");
    first.add_defined("g", buffer, 0, true, true);
    second.add_defined("g", buffer, 1, true, true);
    second.add_defined("m", other, 1, false, true);
    whole.append(first);
    whole.append(second);
    CHECK_NOTHROW(whole.check());
  }
  SECTION("a copy-on-write storage throws GiveUp in a part, and is left lazy") {
    const at::Tensor source = seeded({16});
    const at::Tensor lazy = at::_lazy_clone(source);
    AliasCheck part("test_op");
    part.make_part();
    CHECK(part.add_defined("m", other, 0, false, true) == other.data_ptr());
    CHECK_THROWS_AS(part.add_defined("m", lazy, 1, false, true), AliasCheck::GiveUp);
    CHECK(lazy.const_data_ptr() == source.const_data_ptr());  // not materialized
    // Without data pointers (a Meta or fake run) nothing is materialized, so nothing is refused.
    CHECK(part.add_defined("m", lazy, 2, false, false) == nullptr);
    // One pass takes its mutable data pointer: the storage is materialized, the source keeps its memory.
    AliasCheck one("test_op");
    void* ptr = one.add_defined("m", lazy, 1, false, true);
    CHECK(ptr != source.const_data_ptr());
    CHECK(ptr == lazy.const_data_ptr());
  }
}

TEST_CASE("AliasCheck: the memo keeps a step's verdict while other ops check between two steps", "[ops][cpu]") {
  // NOTE [Alias check memo]: several slots, the least recently used replaced. An optimizer step's ranges, then a
  // scaler-like inf check and scale update (ops of their own) and a second optimizer: the first step's ranges
  // still pass from the memo, and a refused set still raises.
  at::manual_seed(20261208);
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> moments;
  for (int i = 0; i < 64; ++i) {
    params.push_back(seeded({17}));
    moments.push_back(seeded({17}));
  }
  const auto step = [&](const char* op, const std::vector<at::Tensor>& written) {
    AliasCheck alias(op);
    alias.add("params", written);
    alias.add("exp_avgs", moments);
    alias.check();
  };
  const at::Tensor found_inf = seeded({1});
  const at::Tensor scale = seeded({1});
  const auto other_ops = [&] {
    AliasCheck inf("test_check_finite_");
    inf.add("found_inf", found_inf);
    inf.check();
    AliasCheck update("test_update_scale_");
    update.add("scale", scale);
    update.add("found_inf", found_inf);
    update.check();
  };
  std::vector<at::Tensor> second;
  for (int i = 0; i < 8; ++i) {
    second.push_back(seeded({5}));
  }
  step("test_step_", params);
  const uint64_t hits = AliasCheck::memo_hits();
  step("test_step_", params);
  CHECK(AliasCheck::memo_hits() == hits + 1);
  other_ops();
  {
    AliasCheck alias("test_step_");  // a second optimizer's step: another set under the same op
    alias.add("params", second);
    alias.check();
  }
  const uint64_t before = AliasCheck::memo_hits();
  step("test_step_", params);
  CHECK(AliasCheck::memo_hits() == before + 1);
  // The same lists with a moment replaced by a view of a parameter: refused, memo or not.
  std::vector<at::Tensor> aliased = params;
  aliased[40] = moments[40].view({17});
  CHECK_THROWS_WITH(step("test_step_", aliased), Catch::Contains("share memory"));
}
