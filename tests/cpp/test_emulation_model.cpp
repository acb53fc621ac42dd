// Tests of the emulated CUDA execution model itself (kernels/cuda/emulation.h, NOTE [Emulated execution]):
// kernels written as a GPU would run them (shared memory, barriers, warp shuffles and votes), checked against
// references computed on the host; the reports of blocks that cannot go on (divergent barriers, mismatched
// masks); shared memory poisoned per block; the shuffled block order; the reuse of the fiber pool. Needs only
// Catch2, the CUDA toolkit's headers and the emulation runtime.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/launch.cuh"

namespace {

namespace emu = ampkit::kernels::emulation;
using ampkit::kernels::cuda::launch_kernel;
using ampkit::kernels::cuda::launch_kernel_shared;

unsigned linear_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

// ---- reductions and histograms in shared memory ----------------------------------------------------------------
// A tree over the block's threads: any block size (the upper half folds onto the lower while it exists).
__global__ void block_sum_kernel(const int64_t* in, int64_t n, int64_t* sums, double* dsums) {
  AMPKIT_SHARED(int64_t, s, 1024);
  AMPKIT_SHARED(double, d, 1024);
  const unsigned t = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + t;
  s[t] = i < n ? in[i] : 0;
  d[t] = i < n ? static_cast<double>(in[i]) : 0.0;
  __syncthreads();
  unsigned half = 1;
  while (half < blockDim.x) {
    half <<= 1;
  }
  for (half >>= 1; half > 0; half >>= 1) {
    if (t < half && t + half < blockDim.x) {
      s[t] += s[t + half];
      d[t] += d[t + half];
    }
    __syncthreads();
  }
  if (t == 0) {
    sums[blockIdx.x] = s[0];
    dsums[blockIdx.x] = d[0];
  }
}

TEST_CASE("emulation: a block tree reduction in shared memory equals the reference", "[emulated]") {
  const unsigned threads = GENERATE(32u, 33u, 256u, 1024u);
  const unsigned blocks = 3;
  const int64_t n = static_cast<int64_t>(threads) * blocks - 5;  // the last block is partial
  std::mt19937_64 rng(threads);
  std::vector<int64_t> in(static_cast<size_t>(n));
  for (auto& v : in) {
    v = static_cast<int64_t>(rng() % 2000001) - 1000000;
  }
  std::vector<int64_t> sums(blocks, -1);
  std::vector<double> dsums(blocks, -1.0);
  REQUIRE(launch_kernel(block_sum_kernel, dim3(blocks), dim3(threads), nullptr, in.data(), n, sums.data(),
                        dsums.data()) == cudaSuccess);
  for (unsigned b = 0; b < blocks; ++b) {
    int64_t ref = 0;
    double dref = 0.0;
    for (int64_t i = static_cast<int64_t>(b) * threads; i < std::min<int64_t>(n, (b + 1) * int64_t{threads}); ++i) {
      ref += in[static_cast<size_t>(i)];
      dref += static_cast<double>(in[static_cast<size_t>(i)]);  // exact: integers far below 2^53
    }
    CHECK(sums[b] == ref);
    CHECK(dsums[b] == dref);
  }
}

constexpr int kBins = 16;

__global__ void histogram_kernel(const uint32_t* in, int64_t n, unsigned long long* hist) {
  AMPKIT_SHARED(unsigned, h, kBins);
  if (threadIdx.x < kBins) {
    h[threadIdx.x] = 0;
  }
  __syncthreads();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&h[in[i] % kBins], 1u);
  }
  __syncthreads();
  if (threadIdx.x < kBins) {
    atomicAdd(&hist[threadIdx.x], static_cast<unsigned long long>(h[threadIdx.x]));
  }
}

TEST_CASE("emulation: a shared-memory histogram with __syncthreads equals the host's", "[emulated]") {
  const int64_t n = 10007;
  std::mt19937 rng(5);
  std::vector<uint32_t> in(static_cast<size_t>(n));
  std::vector<unsigned long long> ref(kBins, 0);
  for (auto& v : in) {
    v = static_cast<uint32_t>(rng() % 1000) * static_cast<uint32_t>(rng() % 7);  // skewed bins
    ref[v % kBins] += 1;
  }
  std::vector<unsigned long long> hist(kBins, 0);
  REQUIRE(launch_kernel(histogram_kernel, dim3(7), dim3(128), nullptr, in.data(), n, hist.data()) == cudaSuccess);
  CHECK(hist == ref);
}

// ---- warp primitives ---------------------------------------------------------------------------------------------
constexpr int kWarpOps = 16;

// Per thread: kWarpOps results of shuffles (int and double) and votes over the full warp or, in a partial last
// warp, over its lanes.
__global__ void warp_ops_kernel(const int* in, int width, int* out, double* dout) {
  const unsigned t = linear_thread();
  const unsigned lane = t % 32;
  const unsigned first = t - lane;
  const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
  const unsigned lanes = threads - first < 32 ? threads - first : 32;
  const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  const int v = in[t];
  int* o = out + static_cast<size_t>(t) * kWarpOps;
  o[0] = __shfl_sync(mask, v, static_cast<int>((lane * 7 + 3) % 32), width);
  o[1] = __shfl_up_sync(mask, v, 3, width);
  o[2] = __shfl_down_sync(mask, v, 5, width);
  o[3] = __shfl_xor_sync(mask, v, 6, width);
  o[4] = static_cast<int>(__ballot_sync(mask, v % 3 == 0));
  o[5] = __any_sync(mask, v % 97 == 0);
  o[6] = __all_sync(mask, v >= 0);
  o[7] = __all_sync(mask, v % 2 == 0);
  o[8] = __any_sync(mask, v < 0);
  o[9] = static_cast<int>(__match_any_sync(mask, v % 4));
  o[10] = __shfl_down_sync(mask, v, 1);  // default width
  __syncwarp(mask);
  o[11] = static_cast<int>(__activemask());
  o[12] = static_cast<int>(threadIdx.x);  // the fiber's own index after the primitives
  dout[t] = __shfl_xor_sync(mask, static_cast<double>(v) + 0.25, 1, width);
}

// CUDA's rules, written independently of the emulator: the value of lane `src` of the caller's warp, or the
// poison the emulator gives for a lane that does not exist.
struct WarpRef {
  const std::vector<int>& in;
  unsigned threads;
  int value(unsigned first, unsigned src) const {
    return first + src < threads ? in[first + src] : -1;  // 0xFF bytes
  }
};

TEST_CASE("emulation: shuffles, ballot, any, all and match_any equal CUDA's results", "[emulated]") {
  const int width = GENERATE(32, 16, 4);
  const dim3 block = GENERATE(dim3(64), dim3(16, 4), dim3(45));
  const unsigned threads = block.x * block.y * block.z;
  std::mt19937 rng(static_cast<unsigned>(width * 1000 + threads));
  std::vector<int> in(threads);
  for (auto& v : in) {
    v = static_cast<int>(rng() % 1000);
  }
  std::vector<int> out(static_cast<size_t>(threads) * kWarpOps, 0x12345678);
  std::vector<double> dout(threads, 0.0);
  REQUIRE(launch_kernel(warp_ops_kernel, dim3(1), block, nullptr, in.data(), width, out.data(), dout.data()) ==
          cudaSuccess);
  const WarpRef ref{in, threads};
  for (unsigned t = 0; t < threads; ++t) {
    INFO("thread " << t << " width " << width << " block " << block.x << "x" << block.y);
    const unsigned lane = t % 32;
    const unsigned first = t - lane;
    const unsigned lanes = std::min(32u, threads - first);
    const unsigned w = static_cast<unsigned>(width);
    const unsigned seg = lane / w * w;
    const int* o = out.data() + static_cast<size_t>(t) * kWarpOps;
    CHECK(o[0] == ref.value(first, seg + ((lane * 7 + 3) % 32) % w));
    CHECK(o[1] == (lane >= seg + 3 ? ref.value(first, lane - 3) : in[t]));
    CHECK(o[2] == (lane + 5 < seg + w ? ref.value(first, lane + 5) : in[t]));
    CHECK(o[3] == ((lane ^ 6u) < seg + w ? ref.value(first, lane ^ 6u) : in[t]));
    unsigned ballot = 0;
    unsigned match = 0;
    bool any97 = false, all_pos = true, all_even = true, any_neg = false;
    for (unsigned l = 0; l < lanes; ++l) {
      const int x = in[first + l];
      ballot |= (x % 3 == 0 ? 1u : 0u) << l;
      match |= (x % 4 == in[t] % 4 ? 1u : 0u) << l;
      any97 = any97 || x % 97 == 0;
      all_pos = all_pos && x >= 0;
      all_even = all_even && x % 2 == 0;
      any_neg = any_neg || x < 0;
    }
    CHECK(static_cast<unsigned>(o[4]) == ballot);
    CHECK(o[5] == (any97 ? 1 : 0));
    CHECK(o[6] == 1);
    CHECK(o[7] == (all_even ? 1 : 0));
    CHECK(o[8] == 0);
    CHECK(static_cast<unsigned>(o[9]) == match);
    CHECK(o[10] == (lane + 1 < 32 ? ref.value(first, lane + 1) : in[t]));
    CHECK(static_cast<unsigned>(o[11]) == (lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u));
    CHECK(o[12] == static_cast<int>(t % block.x));
    const unsigned xsrc = lane ^ 1u;  // inside the lane's segment for every width tested
    if (first + xsrc < threads) {
      CHECK(dout[t] == static_cast<double>(in[first + xsrc]) + 0.25);
    } else {
      uint64_t bits = 0;
      std::memcpy(&bits, &dout[t], sizeof bits);
      CHECK(bits == ~uint64_t{0});
    }
  }
}

__global__ void sync_votes_kernel(int* out, unsigned* idx_after) {
  const unsigned t = threadIdx.x;
  out[0 * blockDim.x + t] = __syncthreads_count(t % 3 == 0);
  out[1 * blockDim.x + t] = __syncthreads_and(t < blockDim.x);
  out[2 * blockDim.x + t] = __syncthreads_and(t != 17);
  out[3 * blockDim.x + t] = __syncthreads_or(t == blockDim.x - 1);
  out[4 * blockDim.x + t] = __syncthreads_or(t > blockDim.x);
  idx_after[t] = threadIdx.x;
}

TEST_CASE("emulation: __syncthreads_count, _and and _or reduce over the block", "[emulated]") {
  const unsigned threads = GENERATE(1u, 31u, 200u, 1024u);
  std::vector<int> out(5 * threads, -1);
  std::vector<unsigned> idx(threads, 0xdead);
  REQUIRE(launch_kernel(sync_votes_kernel, dim3(2), dim3(threads), nullptr, out.data(), idx.data()) == cudaSuccess);
  for (unsigned t = 0; t < threads; ++t) {
    CHECK(out[0 * threads + t] == static_cast<int>((threads + 2) / 3));
    CHECK(out[1 * threads + t] == 1);
    CHECK(out[2 * threads + t] == (threads > 17 ? 0 : 1));
    CHECK(out[3 * threads + t] == 1);
    CHECK(out[4 * threads + t] == 0);
    CHECK(idx[t] == t);
  }
}

// ---- reports of blocks that cannot go on -------------------------------------------------------------------------
int g_barrier_line = 0;
int g_other_line = 0;

__global__ void early_return_kernel(int* out) {
  if (blockIdx.x == 1 && threadIdx.x >= blockDim.x / 2) {
    return;
  }
  // __LINE__ names the line of the call after it, so the two stay on one line.
  // clang-format off
  g_barrier_line = __LINE__; __syncthreads();  // NOLINT: one line, so the report can be checked
  // clang-format on
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

__global__ void two_barriers_kernel(int* out) {
  // __LINE__ names the line of the call after it, so the two stay on one line.
  // clang-format off
  if (threadIdx.x % 2 == 0) {
    g_barrier_line = __LINE__; __syncthreads();  // NOLINT
  } else {
    g_other_line = __LINE__; __syncthreads_count(1);  // NOLINT
  }
  // clang-format on
  out[threadIdx.x] = 1;
}

__global__ void fine_kernel(int* out) {
  AMPKIT_SHARED(int, s, 256);
  s[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

void check_fine_launch_after_error() {
  std::vector<int> out(2 * 256, 0);
  REQUIRE(launch_kernel(fine_kernel, dim3(2), dim3(256), nullptr, out.data()) == cudaSuccess);
  CHECK(emu::last_error().empty());
  for (int i = 0; i < 512; ++i) {
    CHECK(out[static_cast<size_t>(i)] == 255 - i % 256);
  }
}

TEST_CASE("emulation: a divergent barrier is reported with block, thread and line", "[emulated]") {
  const emu::BlockOrder in_order{};
  emu::set_block_order(&in_order);
  std::vector<int> out(3 * 64, 0);
  CHECK(launch_kernel(early_return_kernel, dim3(3), dim3(64), nullptr, out.data()) == cudaErrorIllegalInstruction);
  const std::string& msg = emu::last_error();
  INFO(msg);
  CHECK(msg.find("block (1,0,0)") != std::string::npos);
  CHECK(msg.find("thread (0,0,0) waits at __syncthreads()") != std::string::npos);
  CHECK(msg.find("thread (32,0,0)") != std::string::npos);
  CHECK(msg.find("exited") != std::string::npos);
  CHECK(msg.find("test_emulation_model.cpp:" + std::to_string(g_barrier_line)) != std::string::npos);
  CHECK(g_barrier_line > 0);
  // Block 0 ran through; the launch stopped at block 1, so block 2 never ran.
  CHECK(std::count(out.begin(), out.begin() + 64, 1) == 64);
  CHECK(std::count(out.begin() + 128, out.end(), 1) == 0);
  emu::set_block_order(nullptr);
  check_fine_launch_after_error();
}

TEST_CASE("emulation: threads waiting at different barriers are reported", "[emulated]") {
  std::vector<int> out(64, 0);
  CHECK(launch_kernel(two_barriers_kernel, dim3(1), dim3(64), nullptr, out.data()) == cudaErrorIllegalInstruction);
  const std::string& msg = emu::last_error();
  INFO(msg);
  CHECK(msg.find("test_emulation_model.cpp:" + std::to_string(g_barrier_line)) != std::string::npos);
  CHECK(msg.find("test_emulation_model.cpp:" + std::to_string(g_other_line)) != std::string::npos);
  CHECK(msg.find("__syncthreads_count()") != std::string::npos);
  CHECK(msg.find("divergent barrier") != std::string::npos);
  CHECK(std::count(out.begin(), out.end(), 1) == 0);
  check_fine_launch_after_error();
}

int g_shfl_line = 0;

__global__ void mismatched_mask_kernel(int* out) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned mask = lane == 0 ? 0x00000003u : 0xffffffffu;  // lane 0 waits for 1, lane 1 for all
  // __LINE__ names the line of the call after it, so the two stay on one line.
  // clang-format off
  g_shfl_line = __LINE__; out[threadIdx.x] = __shfl_xor_sync(mask, static_cast<int>(lane), 1);  // NOLINT
  // clang-format on
}

__global__ void exited_lane_kernel(int* out) {
  if (threadIdx.x == 5) {
    return;
  }
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

__global__ void outside_own_mask_kernel(int* out) { out[threadIdx.x] = static_cast<int>(__ballot_sync(0x1u, 1)); }

TEST_CASE("emulation: a warp primitive whose mask does not match the arriving lanes is reported", "[emulated]") {
  std::vector<int> out(32, 0);
  SECTION("lanes with different masks") {
    CHECK(launch_kernel(mismatched_mask_kernel, dim3(1), dim3(32), nullptr, out.data()) == cudaErrorIllegalInstruction);
    const std::string& msg = emu::last_error();
    INFO(msg);
    CHECK(msg.find("block (0,0,0) thread (0,0,0) (lane 0) waits at __shfl_xor_sync(mask 0x00000003)") !=
          std::string::npos);
    CHECK(msg.find("lane 1 named in the mask, thread (1,0,0), waits at __shfl_xor_sync(mask 0xffffffff)") !=
          std::string::npos);
    CHECK(msg.find("test_emulation_model.cpp:" + std::to_string(g_shfl_line)) != std::string::npos);
    CHECK(msg.find("mask mismatch") != std::string::npos);
  }
  SECTION("a lane named in the mask exited") {
    CHECK(launch_kernel(exited_lane_kernel, dim3(1), dim3(32), nullptr, out.data()) == cudaErrorIllegalInstruction);
    const std::string& msg = emu::last_error();
    INFO(msg);
    CHECK(msg.find("lane 5 named in the mask, thread (5,0,0), exited") != std::string::npos);
    CHECK(msg.find("(it cannot arrive)") != std::string::npos);
  }
  SECTION("a lane outside its own mask") {
    CHECK(launch_kernel(outside_own_mask_kernel, dim3(1), dim3(32), nullptr, out.data()) ==
          cudaErrorIllegalInstruction);
    CHECK(emu::last_error().find("thread (1,0,0) (lane 1): __ballot_sync(mask 0x00000001)") != std::string::npos);
    CHECK(out[0] == 1);  // lane 0's own ballot completed before lane 1 arrived
    out[0] = 0;
  }
  CHECK(std::count(out.begin(), out.end(), 0) == 32);  // no other lane got past its primitive
  check_fine_launch_after_error();
}

// ---- shared memory -----------------------------------------------------------------------------------------------
__global__ void read_before_write_kernel(uint32_t* seen, uint32_t* dyn_seen) {
  AMPKIT_SHARED(uint32_t, s, 128);
  AMPKIT_DYNAMIC_SHARED(uint32_t, dyn);
  const unsigned t = threadIdx.x;
  seen[blockIdx.x * blockDim.x + t] = s[t];
  dyn_seen[blockIdx.x * blockDim.x + t] = dyn[t];
  __syncthreads();
  s[t] = blockIdx.x + 1;  // what the next block would see without a fresh, poisoned array
  dyn[t] = blockIdx.x + 1;
}

TEST_CASE("emulation: shared memory reads 0xFF bytes before the block writes it", "[emulated]") {
  const unsigned blocks = 4;
  std::vector<uint32_t> seen(blocks * 128, 0);
  std::vector<uint32_t> dyn_seen(blocks * 128, 0);
  REQUIRE(launch_kernel_shared(read_before_write_kernel, dim3(blocks), dim3(128), 128 * sizeof(uint32_t), nullptr,
                               seen.data(), dyn_seen.data()) == cudaSuccess);
  CHECK(std::count(seen.begin(), seen.end(), 0xFFFFFFFFu) == blocks * 128);
  CHECK(std::count(dyn_seen.begin(), dyn_seen.end(), 0xFFFFFFFFu) == blocks * 128);
  // Over the limit: refused before any block runs.
  CHECK(launch_kernel_shared(read_before_write_kernel, dim3(1), dim3(128), emu::kMaxSharedBytes + 1, nullptr,
                             seen.data(), dyn_seen.data()) == cudaErrorInvalidValue);
  CHECK(emu::last_error().find("dynamic shared memory") != std::string::npos);
}

// ---- block order -------------------------------------------------------------------------------------------------
__global__ void record_order_kernel(uint64_t* order, unsigned* next) {
  if (linear_thread() == 0) {
    const uint64_t b = blockIdx.x + static_cast<uint64_t>(gridDim.x) * (blockIdx.y + gridDim.y * blockIdx.z);
    order[atomicAdd(next, 1u)] = b;
  }
}

std::vector<uint64_t> run_recording(dim3 grid) {
  const size_t n = static_cast<size_t>(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> order(n, ~uint64_t{0});
  unsigned next = 0;
  REQUIRE(launch_kernel(record_order_kernel, grid, dim3(8, 2), nullptr, order.data(), &next) == cudaSuccess);
  REQUIRE(next == n);
  size_t count = 0;
  const uint64_t* last = emu::last_block_order(&count);
  REQUIRE(count == n);
  CHECK(std::vector<uint64_t>(last, last + count) == order);
  return order;
}

TEST_CASE("emulation: a shuffled block order is a permutation, the same for the same seed", "[emulated]") {
  const dim3 grid(10, 4, 3);
  const size_t n = 120;
  std::vector<uint64_t> identity(n);
  std::iota(identity.begin(), identity.end(), uint64_t{0});

  const emu::BlockOrder in_order{};
  emu::set_block_order(&in_order);
  CHECK(run_recording(grid) == identity);

  const emu::BlockOrder seed7{emu::BlockOrder::kShuffled, 7};
  emu::set_block_order(&seed7);
  const auto first = run_recording(grid);
  const auto second = run_recording(grid);  // the next launch draws another order
  CHECK(std::set<uint64_t>(first.begin(), first.end()).size() == n);
  CHECK(*std::max_element(first.begin(), first.end()) == n - 1);
  CHECK(first != identity);
  CHECK(second != first);
  emu::set_block_order(&seed7);
  CHECK(run_recording(grid) == first);
  CHECK(run_recording(grid) == second);

  const emu::BlockOrder seed8{emu::BlockOrder::kShuffled, 8};
  emu::set_block_order(&seed8);
  CHECK(run_recording(grid) != first);

  // The environment, read at every launch while no order is set.
  emu::set_block_order(nullptr);
  const char* saved = std::getenv("AMPKIT_EMULATION_BLOCK_ORDER");
  const std::string saved_value = saved != nullptr ? saved : "";
  setenv("AMPKIT_EMULATION_BLOCK_ORDER", "in_order", 1);
  CHECK(run_recording(grid) == identity);
  setenv("AMPKIT_EMULATION_BLOCK_ORDER", "shuffled:7", 1);
  emu::set_block_order(nullptr);  // restarts the launch count
  CHECK(run_recording(grid) == first);
  setenv("AMPKIT_EMULATION_BLOCK_ORDER", "sideways", 1);
  unsigned next = 0;
  std::vector<uint64_t> order(n);
  CHECK(launch_kernel(record_order_kernel, grid, dim3(8), nullptr, order.data(), &next) == cudaErrorInvalidValue);
  CHECK(next == 0);
  CHECK(emu::last_error().find("AMPKIT_EMULATION_BLOCK_ORDER must be") != std::string::npos);
  CHECK(emu::last_error().find("'sideways'") != std::string::npos);
  if (saved != nullptr) {
    setenv("AMPKIT_EMULATION_BLOCK_ORDER", saved_value.c_str(), 1);
  } else {
    unsetenv("AMPKIT_EMULATION_BLOCK_ORDER");
  }

  emu::BlockOrder parsed{};
  CHECK(emu::parse_block_order("shuffled:123", &parsed));
  CHECK(parsed.kind == emu::BlockOrder::kShuffled);
  CHECK(parsed.seed == 123);
  CHECK(emu::parse_block_order("shuffled", &parsed));
  CHECK(parsed.seed == 1);
  CHECK(emu::parse_block_order("", &parsed));
  CHECK(parsed.kind == emu::BlockOrder::kInOrder);
  CHECK_FALSE(emu::parse_block_order("shuffled:", &parsed));
  CHECK_FALSE(emu::parse_block_order("shuffled:12x", &parsed));
  CHECK_FALSE(emu::parse_block_order("shuffledx", &parsed));
}

// ---- the fiber pool ----------------------------------------------------------------------------------------------
TEST_CASE("emulation: launches in a row reuse the fiber stacks", "[emulated]") {
  std::vector<int64_t> in(4096, 3);
  std::vector<int64_t> sums(4);
  std::vector<double> dsums(4);
  REQUIRE(launch_kernel(block_sum_kernel, dim3(4), dim3(1024), nullptr, in.data(), int64_t{4096}, sums.data(),
                        dsums.data()) == cudaSuccess);
  const emu::FiberStats before = emu::fiber_stats();
  CHECK(before.fibers >= 1024);
  CHECK(before.stack_bytes > 0);
  std::vector<int> out(512);
  for (int i = 0; i < 200; ++i) {
    REQUIRE(launch_kernel(block_sum_kernel, dim3(4), dim3(1024), nullptr, in.data(), int64_t{4096}, sums.data(),
                          dsums.data()) == cudaSuccess);
    REQUIRE(launch_kernel(early_return_kernel, dim3(2), dim3(64), nullptr, out.data()) ==
            cudaErrorIllegalInstruction);  // abandoned fibers start afresh, on the same stacks
  }
  CHECK(sums == std::vector<int64_t>(4, 3 * 1024));
  const emu::FiberStats after = emu::fiber_stats();
  CHECK(after.fibers == before.fibers);
  CHECK(after.stack_bytes == before.stack_bytes);
}

}  // namespace
