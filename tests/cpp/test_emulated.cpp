// Every CUDA kernel of kernels/cuda, executed on the CPU through the emulated host build of the same sources
// (kernels/cuda/emulation.h), compared bit for bit with ampkit's CPU kernels on seeded random inputs. Built twice:
// with the real chunk size, and with small chunks (AMPKIT_MTA_CHUNK_SIZE) so that a list split across several
// launches, and a tensor split across launches, are reached with little data. Both builds run under
// AddressSanitizer and UndefinedBehaviorSanitizer.

#include "catch_torch.h"

#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cuda/emulation.h"
#include "kernels/cuda/multi_tensor_apply.cuh"
#include "kernels/cuda/amp_launch.h"
#include "kernels/cuda/optim_launch.h"
#include "test_helpers.h"

namespace kern = ampkit::kernels;
namespace emu = ampkit::kernels::emulation;
using ampkit::test::bits_equal;
using ampkit::test::random_grad;

namespace {

constexpr int64_t kChunk = kern::cuda::kChunkSize;
constexpr int64_t kernels_norm_chunk() { return kern::kNormChunk; }
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

at::Tensor scalar_f32(float v) { return at::full({1}, v, at::kFloat); }

kern::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return kern::DType::kFloat16;
    case at::kBFloat16:
      return kern::DType::kBFloat16;
    case at::kFloat:
      return kern::DType::kFloat32;
    default:
      return kern::DType::kFloat64;
  }
}

std::vector<kern::TensorRef> refs_of(const std::vector<at::Tensor>& ts) {
  std::vector<kern::TensorRef> out;
  for (const auto& t : ts) {
    REQUIRE(t.is_contiguous());
    out.push_back({t.data_ptr(), t.numel(), dtype_of(t.scalar_type())});
  }
  return out;
}

// A contiguous tensor of `n` elements whose storage starts `offset` elements into its allocation (misaligned for
// the 16-byte paths when offset is not a multiple of 16 / element size).
at::Tensor at_offset(const at::Tensor& t, int64_t offset) {
  auto buf = at::empty({t.numel() + offset}, t.options());
  auto view = buf.narrow(0, offset, t.numel());
  view.copy_(t.flatten());
  return view;
}

// A copy at the same offset from a 16-byte boundary as `t` (clone() would align it, and a misaligned case would
// test the aligned kernel path).
at::Tensor copy_keeping_offset(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
  return at_offset(t, misalign / static_cast<int64_t>(t.element_size())).view(t.sizes());
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) {
    out.push_back(copy_keeping_offset(t));
  }
  return out;
}

// Runs unscale_and_check_ (or check_finite_ when inv is null) through the CPU op and the emulated CUDA kernel on
// copies of `grads`; requires identical flags and bits. Returns the emulated traffic.
emu::Traffic require_unscale_matches(const std::vector<at::Tensor>& grads, const float* inv) {
  auto on_cpu = clones(grads);
  auto on_emu = clones(grads);
  auto found_cpu = scalar_f32(0.f);
  float found_emu = 0.f;
  if (inv != nullptr) {
    ampkit::unscale_and_check_(on_cpu, found_cpu, scalar_f32(*inv));
  } else {
    ampkit::check_finite_(on_cpu, found_cpu);
  }
  const auto refs = refs_of(on_emu);
  emu::reset_traffic();
  const kern::LaunchStatus status =
      inv != nullptr ? kern::launch_unscale_and_check(refs.data(), static_cast<int64_t>(refs.size()), &found_emu, inv,
                                                      nullptr)
                     : kern::launch_check_finite(refs.data(), static_cast<int64_t>(refs.size()), &found_emu, nullptr);
  const emu::Traffic traffic = emu::reset_traffic();
  REQUIRE(status.ok());
  REQUIRE(found_emu == found_cpu.item<float>());
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("tensor " << i << " of " << grads.size() << ", " << grads[i].scalar_type() << ", numel "
                   << grads[i].numel());
    REQUIRE(bits_equal(on_emu[i], on_cpu[i]));
    if (inv == nullptr) {
      REQUIRE(bits_equal(on_emu[i], grads[i]));
    }
  }
  return traffic;
}

}  // namespace

TEST_CASE("emulated unscale_and_check / check_finite: every dtype, size, scale and alignment matches the CPU",
          "[emulated]") {
  torch::manual_seed(1);
  const int64_t n = GENERATE(1, 7, 8, 9, 15, 16, 17, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 5);
  const float inv = GENERATE(1.f / 65536.f, 1.f, 3.f);
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble}) {
    for (const int64_t offset : {0, 1, 3}) {
      INFO("dtype " << dtype << ", n " << n << ", offset " << offset << ", inv " << inv);
      const auto g = at_offset(random_grad(n, dtype, 1000.0), offset);
      require_unscale_matches({g}, &inv);
      require_unscale_matches({g}, nullptr);
    }
  }
}

TEST_CASE("emulated unscale_and_check: Inf and NaN anywhere, mixed dtypes in one launch", "[emulated]") {
  torch::manual_seed(2);
  const float inv = 0.25f;
  auto make_list = [] {
    return std::vector<at::Tensor>{random_grad(kChunk + 3, at::kHalf, 10.0), random_grad(100, at::kFloat, 10.0),
                                   at::empty({0}, at::kHalf), random_grad(2 * kChunk + 9, at::kBFloat16, 10.0),
                                   at_offset(random_grad(3 * kChunk + 1, at::kDouble, 10.0), 1)};
  };
  SECTION("all finite") {
    require_unscale_matches(make_list(), &inv);
  }
  for (const float bad : {kInf, -kInf, kNaN}) {
    for (const int where : {0, 1, 2}) {  // first element of the first tensor, middle, last of the last chunk
      auto list = make_list();
      at::Tensor target = where == 0 ? list[0] : (where == 1 ? list[3] : list.back());
      const int64_t index = where == 0 ? 0 : (where == 1 ? target.numel() / 2 : target.numel() - 1);
      target[index] = bad;
      INFO("bad value " << bad << " at tensor position " << where);
      require_unscale_matches(list, &inv);
      require_unscale_matches(list, nullptr);
    }
  }
  SECTION("FP16 max overflows after scaling up, -0.0 and subnormals stay exact") {
    auto g = random_grad(1000, at::kHalf, 1.0);
    g[0] = 65504.f;
    g[1] = -0.f;
    g[2] = 5.96e-8f;
    const float up = 2.f;
    require_unscale_matches({g}, &up);
  }
}

TEST_CASE("emulated unscale_and_check: lists that need several launches", "[emulated]") {
  torch::manual_seed(3);
  using Args = kern::cuda::MultiTensorArgs<1>;  // the largest table any functor leaves room for
  const float inv = 0.5f;
  SECTION("more tensors than one chunk table holds") {
    std::vector<at::Tensor> many;
    for (int i = 0; i < Args::kMaxTensors + 77; ++i) {
      many.push_back(random_grad(1 + (i * 37) % 300, i % 2 ? at::kHalf : at::kBFloat16, 10.0));
    }
    many.back()[-1] = kInf;
    const emu::Traffic t = require_unscale_matches(many, &inv);
    CHECK(t.launches >= 2);
  }
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  // Only the small-chunk build: with the real chunk size this list would be 175 M elements.
  SECTION("more chunks than one launch takes: a tensor continues in the next launch") {
    const int64_t n = (Args::kMaxBlocks + 3) * kChunk + 11;
    auto g = random_grad(n, at::kHalf, 10.0);
    g[-1] = kNaN;
    const emu::Traffic t = require_unscale_matches({random_grad(5, at::kFloat, 1.0), g}, &inv);
    CHECK(t.launches == 2);
  }
#endif
}

TEST_CASE("emulated unscale_and_check: bytes moved per element are the design's minimum", "[emulated]") {
  torch::manual_seed(4);
  const int64_t n = 4 * kChunk;
  for (const auto dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
    const auto g = random_grad(n, dtype, 1.0);
    const float inv = 0.5f;
    const int64_t size = c10::elementSize(dtype);
    const emu::Traffic rw = require_unscale_matches({g}, &inv);
    CHECK(rw.read == static_cast<uint64_t>(n * size));
    CHECK(rw.written == static_cast<uint64_t>(n * size));
    const emu::Traffic ro = require_unscale_matches({g}, nullptr);
    CHECK(ro.read == static_cast<uint64_t>(n * size));
    CHECK(ro.written == 0);
  }
}

namespace {

// Runs cast_divide_ (inv null) or cast_unscale_and_check_ through the CPU op and the emulated CUDA kernel on the
// same sources into NaN-poisoned outputs; requires identical outputs and flags. Returns the emulated traffic.
emu::Traffic require_cast_matches(const std::vector<at::Tensor>& src, const std::vector<at::ScalarType>& out_dtypes,
                                  float divisor, const float* inv) {
  std::vector<at::Tensor> on_cpu;
  std::vector<at::Tensor> on_emu;
  for (size_t i = 0; i < src.size(); ++i) {
    on_cpu.push_back(at::full(src[i].sizes(), kNaN, at::TensorOptions().dtype(out_dtypes[i])));
    on_emu.push_back(on_cpu.back().clone());
  }
  auto found_cpu = scalar_f32(0.f);
  float found_emu = 0.f;
  if (inv != nullptr) {
    ampkit::cast_unscale_and_check_(src, on_cpu, found_cpu, scalar_f32(*inv));
  } else {
    ampkit::cast_divide_(src, on_cpu, divisor);
  }
  const auto src_refs = refs_of(src);
  const auto out_refs = refs_of(on_emu);
  emu::reset_traffic();
  const kern::LaunchStatus status = kern::launch_cast(src_refs.data(), out_refs.data(),
                                                      static_cast<int64_t>(src.size()), divisor, inv,
                                                      inv != nullptr ? &found_emu : nullptr, nullptr);
  const emu::Traffic traffic = emu::reset_traffic();
  REQUIRE(status.ok());
  REQUIRE(found_emu == found_cpu.item<float>());
  for (size_t i = 0; i < src.size(); ++i) {
    INFO("pair " << i << " of " << src.size() << ", " << src[i].scalar_type() << " -> " << out_dtypes[i]
                 << ", numel " << src[i].numel());
    REQUIRE(bits_equal(on_emu[i], on_cpu[i]));
  }
  return traffic;
}

}  // namespace

TEST_CASE("emulated cast passes: every dtype pair, size, factor and alignment matches the CPU", "[emulated]") {
  torch::manual_seed(11);
  const int64_t n = GENERATE(1, 7, 8, 9, 17, kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 5);
  const float factor = GENERATE(1.f, 2.f, 3.f, 1.f / 65536.f);
  const std::vector<at::ScalarType> wire{at::kHalf, at::kBFloat16, at::kFloat};
  for (const auto sd : wire) {
    for (const auto od : wire) {
      for (const int64_t offset : {0, 1, 3}) {
        INFO(sd << " -> " << od << ", n " << n << ", offset " << offset << ", factor " << factor);
        auto s = at_offset(random_grad(n, sd, 1000.0), offset);
        s[-1] = 70000.f;  // overflows FP16 on the way
        require_cast_matches({s}, {od}, factor, nullptr);
        require_cast_matches({s}, {od}, 1.f, &factor);
      }
    }
  }
}

TEST_CASE("emulated cast passes: Inf/NaN in the last element of the last chunk, mixed lists over several launches",
          "[emulated]") {
  torch::manual_seed(12);
  using Args = kern::cuda::MultiTensorArgs<2>;
  std::vector<at::Tensor> src;
  std::vector<at::ScalarType> out_dtypes;
  for (int i = 0; i < Args::kMaxTensors + 13; ++i) {
    src.push_back(random_grad(1 + (i * 53) % 400, i % 3 == 0 ? at::kFloat : at::kHalf, 10.0));
    out_dtypes.push_back(i % 2 ? at::kBFloat16 : at::kFloat);
  }
  src.push_back(random_grad(3 * kChunk + 7, at::kFloat, 10.0));
  out_dtypes.push_back(at::kHalf);
  const float inv = 0.5f;
  CHECK(require_cast_matches(src, out_dtypes, 4.f, nullptr).launches >= 2);
  for (const float bad : {kInf, -kInf, kNaN}) {
    src.back()[-1] = bad;
    require_cast_matches(src, out_dtypes, 1.f, &inv);
  }
}

TEST_CASE("emulated cast passes: each element is read once and written once", "[emulated]") {
  torch::manual_seed(13);
  const int64_t n = 4 * kChunk;
  const float inv = 0.5f;
  const auto s = random_grad(n, at::kFloat, 1.0);
  const emu::Traffic down = require_cast_matches({s}, {at::kHalf}, 2.f, nullptr);
  CHECK(down.read == static_cast<uint64_t>(n * 4));
  CHECK(down.written == static_cast<uint64_t>(n * 2));
  const auto h = random_grad(n, at::kHalf, 1.0);
  const emu::Traffic up = require_cast_matches({h}, {at::kFloat}, 1.f, &inv);
  CHECK(up.read == static_cast<uint64_t>(n * 2));
  CHECK(up.written == static_cast<uint64_t>(n * 4));
}

TEST_CASE("emulated grad_stats: every column matches the CPU op (the norm bit for bit with the real chunk size)",
          "[emulated]") {
  torch::manual_seed(14);
  std::vector<at::Tensor> grads{random_grad(kChunk + 5, at::kHalf, 1e3), random_grad(9, at::kFloat, 1e-30),
                                at::empty({0}, at::kBFloat16), at_offset(random_grad(3 * kChunk + 1, at::kBFloat16, 1.0), 1),
                                random_grad(kernels_norm_chunk() + 3, at::kFloat, 1e-3)};
  grads[0][7] = 0.f;
  grads[0][-1] = kInf;
  grads[3][-1] = kNaN;
  grads[3][5] = 0.f;
  for (const float inv : {1.f, 1.f / 65536.f, 3.f}) {
    INFO("inv " << inv);
    const at::Tensor on_cpu = ampkit::grad_stats(grads, scalar_f32(inv));
    const auto refs = refs_of(grads);
    int64_t rows = 0;
    for (const auto& r : refs) {
      rows += kern::grad_stats_chunks(r.numel);
    }
    std::vector<unsigned long long> counters(grads.size() * kern::kGradStatsCounterColumns, 0);
    std::vector<double> partials(static_cast<size_t>(std::max<int64_t>(rows, 1)) * kern::kNormLanes, -1.0);
    at::Tensor on_emu = at::full({static_cast<int64_t>(grads.size()), kern::kGradStatsColumns}, kNaN, at::kDouble);
    const kern::LaunchStatus status =
        kern::launch_grad_stats(refs.data(), static_cast<int64_t>(refs.size()), &inv, on_emu.data_ptr<double>(),
                                counters.data(), partials.data(), nullptr);
    REQUIRE(status.ok());
#if defined(AMPKIT_MTA_CHUNK_SIZE)
    // Small chunks sum the norm in another order (NOTE [Deterministic norm]): equal up to that order.
    REQUIRE(on_emu.narrow(1, 0, 1).equal(on_cpu.narrow(1, 0, 1)));
    REQUIRE(at::allclose(on_emu.narrow(1, 1, 1), on_cpu.narrow(1, 1, 1), 1e-13, 0.0));
    REQUIRE(on_emu.narrow(1, 2, on_emu.size(1) - 2).equal(on_cpu.narrow(1, 2, on_cpu.size(1) - 2)));
#else
    REQUIRE(bits_equal(on_emu, on_cpu));
#endif
  }
}

TEST_CASE("emulated update_scale: matches the CPU op over random overflow sequences, with and without hysteresis",
          "[emulated]") {
  torch::manual_seed(5);
  struct Config {
    int64_t hysteresis;
    double min_scale;
    double max_scale;
    bool dynamic;
    bool plain;  // update_scale_ (no tracker, no stats)
  };
  for (const Config c : {Config{1, 0.0, 3.4e38, true, true}, Config{1, 0.0, 3.4e38, true, false},
                         Config{3, 4.0, 1e6, true, false}, Config{2, 1.0, 512.0, false, false}}) {
    auto scale = scalar_f32(65536.f);
    auto tracker = at::zeros({1}, at::kInt);
    auto hyst = at::full({1}, static_cast<int>(c.hysteresis), at::kInt);
    auto stats = at::zeros({4}, at::kLong);
    float e_scale = 65536.f;
    int32_t e_tracker = 0;
    int32_t e_hyst = static_cast<int32_t>(c.hysteresis);
    int64_t e_stats[4] = {0, 0, 0, 0};
    const kern::UpdateScaleOp op = c.plain ? kern::UpdateScaleOp{2.0, 0.5, 3}
                                           : kern::UpdateScaleOp{2.0, 0.5, 3, static_cast<int32_t>(c.hysteresis),
                                                                 static_cast<float>(c.min_scale),
                                                                 static_cast<float>(c.max_scale), c.dynamic};
    const auto overflows = at::rand({400}) < 0.3;
    for (int64_t i = 0; i < overflows.numel(); ++i) {
      const float f = overflows[i].item<bool>() ? 1.f : 0.f;
      if (c.plain) {
        ampkit::update_scale_(scale, tracker, scalar_f32(f), 2.0, 0.5, 3);
        REQUIRE(kern::launch_update_scale(&e_scale, &e_tracker, nullptr, nullptr, &f, op, nullptr).ok());
      } else {
        ampkit::update_scale_hysteresis_(scale, tracker, hyst, stats, scalar_f32(f), 2.0, 0.5, 3, c.hysteresis,
                                         c.min_scale, c.max_scale, c.dynamic);
        REQUIRE(kern::launch_update_scale(&e_scale, &e_tracker, &e_hyst, e_stats, &f, op, nullptr).ok());
        REQUIRE(e_hyst == hyst.item<int>());
        for (int k = 0; k < 4; ++k) {
          REQUIRE(e_stats[k] == stats[k].item<int64_t>());
        }
      }
      REQUIRE(std::memcmp(&e_scale, scale.data_ptr<float>(), sizeof(float)) == 0);
      REQUIRE(e_tracker == tracker.item<int>());
    }
  }
}

// ---- optimizer kernels ---------------------------------------------------------------------------------------

namespace {

enum class Master { kNone, kFp32, kRemainder };

// One parameter's tensors for a fused step, in the layout of the ops' lists.
struct ParamState {
  at::Tensor param, grad, master, remainder, exp_avg, exp_avg_sq, max_exp_avg_sq, step;

  // A copy whose tensors keep the originals' offsets from a 16-byte boundary.
  ParamState clone() const {
    auto c = [](const at::Tensor& t) { return copy_keeping_offset(t); };
    return {c(param), c(grad), c(master), c(remainder), c(exp_avg), c(exp_avg_sq), c(max_exp_avg_sq), c(step)};
  }
};

std::vector<ParamState> make_params(const std::vector<int64_t>& sizes, at::ScalarType dtype, Master master,
                                    bool adam, bool amsgrad, bool momentum, int64_t offset) {
  std::vector<ParamState> out;
  for (const int64_t n : sizes) {
    ParamState s;
    const auto w32 = at::randn({n}, at::kFloat);
    s.param = at_offset(w32.to(dtype), offset);
    s.grad = at_offset(random_grad(n, dtype, 100.0), offset);
    if (master == Master::kFp32) {
      s.master = at_offset(w32, offset);
    } else if (master == Master::kRemainder) {
      s.remainder = at_offset(at::randint(-32768, 32767, {n}, at::kShort), offset);
    }
    if (adam || momentum) {
      s.exp_avg = at_offset(at::randn({n}, at::kFloat) * 0.1, offset);
    }
    if (adam) {
      s.exp_avg_sq = at_offset(at::rand({n}, at::kFloat) * 0.01, offset);
    }
    if (amsgrad) {
      s.max_exp_avg_sq = at_offset(at::rand({n}, at::kFloat) * 0.02, offset);
    }
    if (adam || momentum) {
      s.step = scalar_f32(adam ? 3.f : 0.f);
    }
    out.push_back(s);
  }
  return out;
}

std::vector<at::Tensor> list_of(const std::vector<ParamState>& ps, at::Tensor ParamState::*field) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    if ((p.*field).defined()) {
      out.push_back(p.*field);
    }
  }
  return out;
}

std::vector<kern::OptimTensor> descriptors_of(const std::vector<ParamState>& ps) {
  std::vector<kern::OptimTensor> out;
  auto f = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  for (const auto& p : ps) {
    out.push_back({p.param.data_ptr(), p.grad.data_ptr(), f(p.master),
                   p.remainder.defined() ? p.remainder.data_ptr<int16_t>() : nullptr, f(p.exp_avg), f(p.exp_avg_sq),
                   f(p.max_exp_avg_sq), f(p.step), p.param.numel(), dtype_of(p.param.scalar_type())});
  }
  return out;
}

void require_same_state(const std::vector<ParamState>& a, const std::vector<ParamState>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("param " << i << ", numel " << a[i].param.numel());
    for (auto field : {&ParamState::param, &ParamState::grad, &ParamState::master, &ParamState::remainder,
                       &ParamState::exp_avg, &ParamState::exp_avg_sq, &ParamState::max_exp_avg_sq,
                       &ParamState::step}) {
      if ((a[i].*field).defined()) {
        REQUIRE(bits_equal(a[i].*field, b[i].*field));
      }
    }
  }
}

// The device scalars of one step: grad scale, skip flag and device lr (each optional).
struct Scalars {
  float grad_scale;
  float found_inf;
  float lr;
  bool use_scale;
  bool use_found;
  bool use_lr;
  std::optional<at::Tensor> t(bool use, float v) const {
    return use ? std::optional<at::Tensor>(scalar_f32(v)) : std::nullopt;
  }
};

// The CPU ops' settings: torch's scalar tail and the unscaled grads stored back.
template <typename Params>
Params as_cpu_op(Params p) {
  p.tail_width = ampkit::build_info().cpu_optim_tail_width;
  p.write_unscaled_grads = true;
  return p;
}

}  // namespace

TEST_CASE("emulated adam step: AdamW/Adam, every master mode, skip, grad scale and device lr match the CPU",
          "[emulated]") {
  torch::manual_seed(6);
  const std::vector<int64_t> sizes = {1, 3, 4, 7, 8, 9, 33, kChunk - 1, kChunk + 5, 0};
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
      if ((master == Master::kRemainder && dtype != at::kBFloat16) || (master != Master::kNone && dtype == at::kFloat)) {
        continue;
      }
      for (const bool decoupled : {true, false}) {
        for (const bool amsgrad : {false, true}) {
          for (const int64_t offset : {0, 1}) {
            const bool maximize = amsgrad && decoupled;
            const Scalars sc{1024.f, 0.f, 2e-3f, true, true, offset == 1};
            INFO("dtype " << dtype << ", master " << static_cast<int>(master) << ", decoupled " << decoupled
                          << ", amsgrad " << amsgrad << ", offset " << offset);
            auto cpu = make_params(sizes, dtype, master, true, amsgrad, false, offset);
            auto emu_state = std::vector<ParamState>();
            for (const auto& p : cpu) {
              emu_state.push_back(p.clone());
            }
            const auto hp = as_cpu_op(kern::AdamParams{1e-3, 0.9, 0.999, 0.01, 1e-8, amsgrad, maximize, decoupled});
            for (int step = 0; step < 3; ++step) {
              ampkit::adamw_step_(list_of(cpu, &ParamState::param), list_of(cpu, &ParamState::grad),
                                  list_of(cpu, &ParamState::master), list_of(cpu, &ParamState::remainder),
                                  list_of(cpu, &ParamState::exp_avg), list_of(cpu, &ParamState::exp_avg_sq),
                                  list_of(cpu, &ParamState::max_exp_avg_sq), list_of(cpu, &ParamState::step), hp.lr,
                                  hp.beta1, hp.beta2, hp.weight_decay, hp.eps, amsgrad, maximize, decoupled,
                                  sc.t(sc.use_scale, sc.grad_scale), sc.t(sc.use_found, sc.found_inf),
                                  sc.t(sc.use_lr, sc.lr));
              const auto d = descriptors_of(emu_state);
              REQUIRE(kern::launch_adam_step(d.data(), static_cast<int64_t>(d.size()), hp, &sc.grad_scale,
                                             &sc.found_inf, sc.use_lr ? &sc.lr : nullptr, nullptr)
                          .ok());
              require_same_state(cpu, emu_state);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("emulated optimizer steps: one misaligned stream goes element-wise, the others stay vectorized, and "
          "all match the CPU", "[emulated]") {
  // NOTE [Optimizer chunk loop]: alignment is decided per stream. Each case moves one stream 1 element off its
  // 16-byte boundary (a copy of the same values) and compares AdamW (amsgrad) and SGD with momentum to the CPU.
  torch::manual_seed(11);
  const std::vector<int64_t> sizes = {3, 9, 4 * 512 * 2 + 7, kChunk + 6};
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
      if ((master == Master::kRemainder && dtype != at::kBFloat16) || (master != Master::kNone && dtype == at::kFloat)) {
        continue;
      }
      for (auto field : {&ParamState::param, &ParamState::grad, &ParamState::master, &ParamState::remainder,
                         &ParamState::exp_avg, &ParamState::exp_avg_sq, &ParamState::max_exp_avg_sq}) {
        for (const bool adam : {true, false}) {
          auto cpu = make_params(sizes, dtype, master, adam, adam, !adam, 0);
          if (!(cpu[0].*field).defined()) {
            continue;
          }
          for (auto& ps : cpu) {
            ps.*field = at_offset(ps.*field, 1);
          }
          INFO("dtype " << dtype << ", master " << static_cast<int>(master) << ", adam " << adam);
          std::vector<ParamState> emu_state;
          for (const auto& ps : cpu) {
            emu_state.push_back(ps.clone());
          }
          const float scale = 256.f;
          const float found = 0.f;
          for (int step = 0; step < 2; ++step) {
            const auto d = descriptors_of(emu_state);
            if (adam) {
              const auto hp = as_cpu_op(kern::AdamParams{1e-3, 0.9, 0.999, 0.01, 1e-8, true, false, true});
              ampkit::adamw_step_(list_of(cpu, &ParamState::param), list_of(cpu, &ParamState::grad),
                                  list_of(cpu, &ParamState::master), list_of(cpu, &ParamState::remainder),
                                  list_of(cpu, &ParamState::exp_avg), list_of(cpu, &ParamState::exp_avg_sq),
                                  list_of(cpu, &ParamState::max_exp_avg_sq), list_of(cpu, &ParamState::step), hp.lr,
                                  hp.beta1, hp.beta2, hp.weight_decay, hp.eps, true, false, true, scalar_f32(scale),
                                  scalar_f32(found), std::nullopt);
              REQUIRE(kern::launch_adam_step(d.data(), static_cast<int64_t>(d.size()), hp, &scale, &found, nullptr,
                                             nullptr)
                          .ok());
            } else {
              const auto hp = as_cpu_op(kern::SgdParams{0.05, 0.9, 0.0, 1e-4, true, false});
              ampkit::sgd_step_(list_of(cpu, &ParamState::param), list_of(cpu, &ParamState::grad),
                                list_of(cpu, &ParamState::master), list_of(cpu, &ParamState::remainder),
                                list_of(cpu, &ParamState::exp_avg), list_of(cpu, &ParamState::step), hp.lr,
                                hp.momentum, hp.dampening, hp.weight_decay, hp.nesterov, hp.maximize,
                                scalar_f32(scale), scalar_f32(found), std::nullopt);
              REQUIRE(kern::launch_sgd_step(d.data(), static_cast<int64_t>(d.size()), hp, &scale, &found, nullptr,
                                            nullptr)
                          .ok());
            }
            require_same_state(cpu, emu_state);
          }
        }
      }
    }
  }
}

TEST_CASE("emulated sgd step: momentum, nesterov, dampening, masters and remainders match the CPU", "[emulated]") {
  torch::manual_seed(7);
  const std::vector<int64_t> sizes = {1, 5, 8, 17, kChunk + 3};
  struct Config {
    float momentum, dampening, weight_decay;
    bool nesterov, maximize;
  };
  for (const Config c : {Config{0.f, 0.f, 0.f, false, false}, Config{0.9f, 0.f, 1e-4f, true, false},
                         Config{0.9f, 0.1f, 0.f, false, true}}) {
    for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
        if ((master == Master::kRemainder && dtype != at::kBFloat16) ||
            (master != Master::kNone && dtype == at::kFloat)) {
          continue;
        }
        INFO("momentum " << c.momentum << ", dtype " << dtype << ", master " << static_cast<int>(master));
        const bool momentum = c.momentum != 0.f;
        auto cpu = make_params(sizes, dtype, master, false, false, momentum, 1);
        std::vector<ParamState> emu_state;
        for (const auto& p : cpu) {
          emu_state.push_back(p.clone());
        }
        const auto hp = as_cpu_op(kern::SgdParams{0.05, c.momentum, c.dampening, c.weight_decay, c.nesterov, c.maximize});
        const float scale = 512.f;
        const float found = 0.f;
        for (int step = 0; step < 3; ++step) {
          ampkit::sgd_step_(list_of(cpu, &ParamState::param), list_of(cpu, &ParamState::grad),
                            list_of(cpu, &ParamState::master), list_of(cpu, &ParamState::remainder),
                            list_of(cpu, &ParamState::exp_avg), list_of(cpu, &ParamState::step), hp.lr, hp.momentum,
                            hp.dampening, hp.weight_decay, hp.nesterov, hp.maximize, scalar_f32(scale),
                            scalar_f32(found), std::nullopt);
          const auto d = descriptors_of(emu_state);
          REQUIRE(kern::launch_sgd_step(d.data(), static_cast<int64_t>(d.size()), hp, &scale, &found, nullptr,
                                        nullptr)
                      .ok());
          require_same_state(cpu, emu_state);
        }
      }
    }
  }
}

TEST_CASE("emulated optimizer steps: found_inf skips every write, step counts included", "[emulated]") {
  torch::manual_seed(8);
  for (const Master master : {Master::kFp32, Master::kRemainder}) {
    auto state = make_params({9, kChunk + 1}, at::kBFloat16, master, true, true, false, 0);
    std::vector<ParamState> before;
    for (const auto& p : state) {
      before.push_back(p.clone());
    }
    const auto d = descriptors_of(state);
    const kern::AdamParams hp{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, true, false, true};
    const float scale = 65536.f;
    const float found = 1.f;
    emu::reset_traffic();
    REQUIRE(kern::launch_adam_step(d.data(), 2, hp, &scale, &found, nullptr, nullptr).ok());
    CHECK(emu::reset_traffic().written == 0);
    require_same_state(state, before);
  }
}

TEST_CASE("emulated optimizer steps: lists over several launches match the CPU", "[emulated]") {
  torch::manual_seed(9);
  using Args = kern::cuda::MultiTensorArgs<8>;  // the largest table any functor leaves room for
  std::vector<int64_t> sizes;
  for (int i = 0; i < Args::kMaxTensors + 13; ++i) {
    sizes.push_back(1 + (i * 53) % 200);
  }
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  sizes.push_back((Args::kMaxBlocks + 2) * kChunk + 3);  // one tensor continues into a further launch
#endif
  auto cpu = make_params(sizes, at::kHalf, Master::kFp32, true, false, false, 0);
  std::vector<ParamState> emu_state;
  for (const auto& p : cpu) {
    emu_state.push_back(p.clone());
  }
  const auto hp = as_cpu_op(kern::AdamParams{1e-3, 0.9, 0.999, 0.0, 1e-8, false, false, true});
  ampkit::adamw_step_(list_of(cpu, &ParamState::param), list_of(cpu, &ParamState::grad),
                      list_of(cpu, &ParamState::master), {}, list_of(cpu, &ParamState::exp_avg),
                      list_of(cpu, &ParamState::exp_avg_sq), {}, list_of(cpu, &ParamState::step), hp.lr, hp.beta1,
                      hp.beta2, hp.weight_decay, hp.eps, false, false, true, std::nullopt, std::nullopt, std::nullopt);
  const auto d = descriptors_of(emu_state);
  emu::reset_traffic();
  REQUIRE(kern::launch_adam_step(d.data(), static_cast<int64_t>(d.size()), hp, nullptr, nullptr, nullptr, nullptr)
              .ok());
  CHECK(emu::reset_traffic().launches >= 3);  // two or more chunk tables, then the step counts
  require_same_state(cpu, emu_state);
}

TEST_CASE("emulated adamw step: FP16/BF16 params with FP32 masters move 28 bytes per parameter", "[emulated]") {
  torch::manual_seed(10);
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const int64_t n = 2 * kChunk;
    auto state = make_params({n}, dtype, Master::kFp32, true, false, false, 0);
    const auto d = descriptors_of(state);
    const kern::AdamParams hp{1e-3f, 0.9f, 0.999f, 0.01f, 1e-8f, false, false, true};
    const float scale = 1024.f;
    const float found = 0.f;
    emu::reset_traffic();
    REQUIRE(kern::launch_adam_step(d.data(), 1, hp, &scale, &found, nullptr, nullptr).ok());
    const emu::Traffic t = emu::reset_traffic();
    CHECK(t.read + t.written == static_cast<uint64_t>(28 * n));
  }
}

namespace {

// LAMB through the CPU op and the emulated kernels on copies of `cpu`; the grad norm (when clipping) is the CPU
// op's, given to both. Returns the emulated traffic.
emu::Traffic run_lamb_both(std::vector<ParamState>& cpu, std::vector<ParamState>& emu_state,
                           const kern::LambParams& hp, const Scalars& sc) {
  std::optional<at::Tensor> norm;
  float norm_value = 0.f;
  if (hp.max_grad_norm > 0) {
    norm = ampkit::grad_norm(list_of(cpu, &ParamState::grad), sc.t(sc.use_scale, sc.grad_scale));
    norm_value = norm->item<float>();
  }
  ampkit::lamb_step_(list_of(cpu, &ParamState::param), list_of(cpu, &ParamState::grad),
                     list_of(cpu, &ParamState::master), list_of(cpu, &ParamState::remainder),
                     list_of(cpu, &ParamState::exp_avg), list_of(cpu, &ParamState::exp_avg_sq),
                     list_of(cpu, &ParamState::step), hp.lr, hp.beta1, hp.beta2, hp.weight_decay, hp.eps,
                     hp.bias_correction, hp.adam_w_mode, hp.grad_averaging, hp.use_nvlamb, hp.max_grad_norm, norm,
                     sc.t(sc.use_scale, sc.grad_scale), sc.t(sc.use_found, sc.found_inf), sc.t(sc.use_lr, sc.lr));
  const auto d = descriptors_of(emu_state);
  int64_t rows = 0;
  for (const auto& t : d) {
    rows += kern::norm_chunks(t.numel);
  }
  std::vector<double> lanes(static_cast<size_t>(std::max<int64_t>(rows, 1)) * 2 * kern::kNormLanes, kNaN);
  std::vector<double> sums(static_cast<size_t>(std::max<int64_t>(rows, 1)) * 2, kNaN);
  emu::reset_traffic();
  REQUIRE(kern::launch_lamb_step(d.data(), static_cast<int64_t>(d.size()), hp,
                                 sc.use_scale ? &sc.grad_scale : nullptr, sc.use_found ? &sc.found_inf : nullptr,
                                 sc.use_lr ? &sc.lr : nullptr, norm ? &norm_value : nullptr, lanes.data(),
                                 sums.data(), nullptr)
              .ok());
  return emu::reset_traffic();
}

// Same moments and steps; weights bit for bit with the real chunk size (the CPU sums norms in its chunks), else
// equal up to the order of the norms' sums.
void require_same_lamb_state(const std::vector<ParamState>& cpu, const std::vector<ParamState>& emu_state) {
#if defined(AMPKIT_MTA_CHUNK_SIZE)
  for (size_t i = 0; i < cpu.size(); ++i) {
    INFO("param " << i << ", numel " << cpu[i].param.numel());
    REQUIRE(bits_equal(cpu[i].exp_avg, emu_state[i].exp_avg));
    REQUIRE(bits_equal(cpu[i].exp_avg_sq, emu_state[i].exp_avg_sq));
    REQUIRE(bits_equal(cpu[i].step, emu_state[i].step));
    const at::Tensor& w_cpu = cpu[i].master.defined() ? cpu[i].master : cpu[i].param;
    const at::Tensor& w_emu = emu_state[i].master.defined() ? emu_state[i].master : emu_state[i].param;
    REQUIRE(at::allclose(w_cpu.to(at::kFloat), w_emu.to(at::kFloat), 1e-5, 1e-6));
  }
#else
  require_same_state(cpu, emu_state);
#endif
}

}  // namespace

TEST_CASE("emulated lamb step: every master mode and option, clipping, skip, scale and device lr match the CPU",
          "[emulated]") {
  torch::manual_seed(15);
  const std::vector<int64_t> sizes = {1, 7, 8, 9, 33, kChunk - 1, kChunk + 5, 0, kernels_norm_chunk() + 9};
  struct Config {
    double weight_decay;
    bool adam_w_mode, grad_averaging, use_nvlamb, bias_correction;
    double max_grad_norm;
  };
  for (const Config c : {Config{0.01, true, true, false, true, 1.0}, Config{0.01, false, false, false, true, 0.0},
                         Config{0.0, true, true, true, false, 0.5}, Config{0.0, true, true, false, true, 0.0}}) {
    for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (const Master master : {Master::kNone, Master::kFp32, Master::kRemainder}) {
        if ((master == Master::kRemainder && dtype != at::kBFloat16) ||
            (master != Master::kNone && dtype == at::kFloat)) {
          continue;
        }
        const int64_t offset = dtype == at::kHalf ? 1 : 0;
        INFO("wd " << c.weight_decay << ", adam_w " << c.adam_w_mode << ", nvlamb " << c.use_nvlamb << ", clip "
                   << c.max_grad_norm << ", dtype " << dtype << ", master " << static_cast<int>(master));
        auto cpu = make_params(sizes, dtype, master, true, false, false, offset);
        std::vector<ParamState> emu_state;
        for (const auto& p : cpu) {
          emu_state.push_back(p.clone());
        }
        const kern::LambParams hp{1e-2, 0.9, 0.999, c.weight_decay, 1e-6, c.bias_correction, c.adam_w_mode,
                                  c.grad_averaging, c.use_nvlamb, c.max_grad_norm};
        const Scalars sc{256.f, 0.f, 3e-3f, true, true, offset == 1};
        for (int step = 0; step < 2; ++step) {
          run_lamb_both(cpu, emu_state, hp, sc);
          require_same_lamb_state(cpu, emu_state);
        }
      }
    }
  }
}

TEST_CASE("emulated lamb step: found_inf skips every write, and the traffic is the design's", "[emulated]") {
  torch::manual_seed(16);
  const kern::LambParams hp{1e-3, 0.9, 0.999, 0.01, 1e-6, true, true, true, false, 0.0};
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const int64_t n = 2 * kChunk + 16;
    auto cpu = make_params({n}, dtype, Master::kFp32, true, false, false, 0);
    std::vector<ParamState> emu_state;
    for (const auto& p : cpu) {
      emu_state.push_back(p.clone());
    }
    Scalars sc{1024.f, 1.f, 0.f, true, true, false};
    const std::vector<ParamState> before{emu_state[0].clone()};
    CHECK(run_lamb_both(cpu, emu_state, hp, sc).written == 0);
    require_same_state(emu_state, before);
    require_same_state(cpu, before);
    sc.found_inf = 0.f;
    const emu::Traffic t = run_lamb_both(cpu, emu_state, hp, sc);
    // NOTE [LAMB passes]: 22 bytes in the moments pass, 18 in the apply pass, plus 2 x 512 lane sums per chunk.
    const int64_t chunks = kern::norm_chunks(n);
    CHECK(t.read + t.written == static_cast<uint64_t>(40 * n + chunks * 2 * kern::kNormLanes * 8));
    require_same_lamb_state(cpu, emu_state);
  }
}

TEST_CASE("emulated grad_norm: matches the CPU op (bit for bit with the real chunk size)", "[emulated]") {
  torch::manual_seed(17);
  std::vector<at::Tensor> grads{random_grad(kChunk + 5, at::kHalf, 1e3), random_grad(9, at::kFloat, 1e-20),
                                at::empty({0}, at::kBFloat16), random_grad(3 * kChunk + 1, at::kBFloat16, 1.0),
                                random_grad(kernels_norm_chunk() + 3, at::kFloat, 1e-3)};
  for (const float scale : {1.f, 65536.f, 0.25f}) {
    INFO("scale " << scale);
    const float on_cpu = ampkit::grad_norm(grads, scalar_f32(scale)).item<float>();
    double reference = 0.0;
    for (const auto& g : grads) {
      reference += g.to(at::kDouble).pow(2).sum().item<double>();
    }
    REQUIRE(std::abs(on_cpu - std::sqrt(reference) / scale) <= 1e-6 * std::sqrt(reference) / scale);
    const auto refs = refs_of(grads);
    int64_t rows = 0;
    for (const auto& r : refs) {
      rows += kern::norm_chunks(r.numel);
    }
    std::vector<double> lanes(static_cast<size_t>(rows) * kern::kNormLanes, kNaN);
    std::vector<double> sums(static_cast<size_t>(rows), kNaN);
    float on_emu = kNaN;
    REQUIRE(kern::launch_grad_norm(refs.data(), static_cast<int64_t>(refs.size()), &scale, &on_emu, lanes.data(),
                                   sums.data(), nullptr)
                .ok());
#if defined(AMPKIT_MTA_CHUNK_SIZE)
    REQUIRE(std::abs(on_emu - on_cpu) <= 1e-6f * on_cpu);
#else
    REQUIRE(kern::bit_cast<uint32_t>(on_emu) == kern::bit_cast<uint32_t>(on_cpu));
#endif
  }
}

namespace {
__global__ void count_threads_kernel(int* counter, int* last_x) {
  *counter += 1;
  *last_x = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
}
}  // namespace

TEST_CASE("emulator: runs every thread of every block, refuses what the driver refuses", "[emulated]") {
  int counter = 0;
  int last = -1;
  emu::reset_traffic();
  REQUIRE(kern::cuda::launch_kernel(count_threads_kernel, dim3(3, 2), dim3(4, 2), nullptr, &counter, &last) ==
          cudaSuccess);
  CHECK(counter == 3 * 2 * 4 * 2);
  CHECK(last == 2 * 4 + 3);
  CHECK(emu::reset_traffic().launches == 1);
  counter = 0;
  CHECK(kern::cuda::launch_kernel(count_threads_kernel, dim3(0), dim3(32), nullptr, &counter, &last) ==
        cudaErrorInvalidConfiguration);
  CHECK(kern::cuda::launch_kernel(count_threads_kernel, dim3(1), dim3(2048), nullptr, &counter, &last) ==
        cudaErrorInvalidConfiguration);
  CHECK(counter == 0);
  // A list with nothing to do launches nothing and succeeds.
  float found = 0.f;
  const kern::TensorRef none{nullptr, 0, kern::DType::kFloat32};
  const kern::LaunchStatus empty = kern::launch_check_finite(&none, 1, &found, nullptr);
  CHECK(empty.ok());
  CHECK(empty.launches == 0);
}
