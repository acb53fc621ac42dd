// Tests of the memory-transaction model (NOTE [Memory transaction model] in kernels/cuda/emulation_model.cpp) on
// access patterns whose cost on a GPU is known: coalesced and vector copies, strides, a naive transpose, shared
// memory with and without bank conflicts, same-address atomics. Built like the programs that read the model: the
// kernels below are compiled with the load/store callbacks, the runtime is not (tests/cpp/CMakeLists.txt).
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/launch.cuh"

namespace {

namespace emu = ampkit::kernels::emulation;
using ampkit::kernels::cuda::global_load;
using ampkit::kernels::cuda::global_store;
using ampkit::kernels::cuda::launch_kernel;

// Runs `launch()` with the model recording and returns what it saw.
template <typename F>
emu::MemoryModel modelled(F&& launch) {
  emu::set_memory_model(true);
  REQUIRE(launch() == cudaSuccess);
  emu::MemoryModel m = emu::take_memory_model();
  emu::set_memory_model(false);
  return m;
}

__global__ void copy_float4(const float4* in, float4* out, int64_t n4) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n4) {
    global_store(out + i, global_load(in + i));
  }
}

__global__ void copy_float(const float* in, float* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    global_store(out + i, global_load(in + i));
  }
}

// Reads only (the sum goes to a plain host array the model does not see): one float at stride `stride`.
__global__ void read_strided(const float* in, float* sink, int64_t n, int stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    sink[i] = global_load(in + i * stride);
  }
}

// Each thread reads `per_thread` consecutive floats with scalar loads: lanes `per_thread` floats apart.
__global__ void read_runs(const float* in, float* sink, int64_t threads, int per_thread) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < threads) {
    float s = 0.f;
    for (int k = 0; k < per_thread; ++k) {
      s += global_load(in + i * per_thread + k);
    }
    sink[i] = s;
  }
}

// A naive transpose of a rows x cols byte matrix: reads along a row (coalesced), writes one byte per lane at
// stride `rows` (plain reads, so that only the writes are modelled).
__global__ void transpose_bytes_naive(const uint8_t* in, uint8_t* out, int rows, int cols) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<int64_t>(rows) * cols) {
    const int64_t r = i / cols;
    const int64_t c = i % cols;
    global_store(out + c * rows + r, in[i]);
  }
}

// One shared-memory store and one load per lane at word `lane * stride` (stride 0: every lane the same word).
__global__ void shared_stride(int stride, float* sink) {
  AMPKIT_SHARED(float, s, 32 * 33);
  const unsigned lane = threadIdx.x % 32;
  s[lane * stride] = static_cast<float>(lane);
  __syncthreads();
  sink[threadIdx.x] = s[lane * stride];
}

// A 32 x 32 float tile through shared memory, padded to 33 columns or not: written along rows, read along columns.
__global__ void shared_tile(bool padded, float* sink) {
  AMPKIT_SHARED(float, tile, 32 * 33);
  const unsigned ld = padded ? 33 : 32;
  const unsigned x = threadIdx.x % 32;
  const unsigned y = threadIdx.x / 32;
  tile[y * ld + x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  sink[threadIdx.x] = tile[x * ld + y];
}

__global__ void atomics(unsigned* counters, int pattern) {
  const unsigned lane = threadIdx.x % 32;
  AMPKIT_SHARED(unsigned, hist, 32);
  if (threadIdx.x < 32) {
    hist[threadIdx.x] = 0;
  }
  __syncthreads();
  switch (pattern) {
    case 0:  // every lane, one address
      atomicAdd(counters, 1u);
      break;
    case 1:  // the warp's lane 0 for the warp
      if (lane == 0) {
        atomicAdd(counters, 32u);
      }
      break;
    case 2:  // every lane its own address
      atomicAdd(counters + lane, 1u);
      break;
    default:  // shared memory, four bins
      atomicAdd(&hist[lane % 4], 1u);
      break;
  }
}

TEST_CASE("memory model: a float4 copy moves whole sectors, one request per warp and direction", "[model]") {
  constexpr int64_t n4 = 4096 + 32;  // 130 warps, the last block partial
  alignas(32) static float4 in[n4];
  alignas(32) static float4 out[n4];
  const emu::MemoryModel m =
      modelled([&] { return launch_kernel(copy_float4, dim3(17), dim3(256), nullptr, +in, +out, n4); });
  CHECK(m.global_requests == 2 * static_cast<uint64_t>(n4) / 32);
  CHECK(m.global_bytes == 2 * static_cast<uint64_t>(n4) * 16);
  CHECK(m.global_sectors == m.global_bytes / 32);
  CHECK(m.sector_efficiency() == 1.0);
  CHECK(m.shared_requests == 0);
  CHECK(m.global_atomics == 0);
  CHECK(m.worst_site.empty());
}

TEST_CASE("memory model: a float copy off a sector boundary touches one sector more per warp", "[model]") {
  std::vector<float> in(64 + 1), out(64 + 1);
  // 32 floats from in+1: 128 bytes over 5 sectors; the writes at out (aligned): 4 sectors.
  const emu::MemoryModel m =
      modelled([&] { return launch_kernel(copy_float, dim3(1), dim3(32), nullptr, in.data() + 1, out.data(), 32); });
  const uint64_t in_sectors =
      (reinterpret_cast<uintptr_t>(in.data() + 33) - 1) / 32 - reinterpret_cast<uintptr_t>(in.data() + 1) / 32 + 1;
  const uint64_t out_sectors =
      (reinterpret_cast<uintptr_t>(out.data() + 32) - 1) / 32 - reinterpret_cast<uintptr_t>(out.data()) / 32 + 1;
  CHECK(m.global_requests == 2);
  CHECK(m.global_bytes == 256);
  CHECK(m.global_sectors == in_sectors + out_sectors);
}

TEST_CASE("memory model: a stride-2 float read uses half of every sector", "[model]") {
  alignas(32) static float in[2 * 256 * 4];
  std::vector<float> sink(1024);
  const emu::MemoryModel m = modelled(
      [&] { return launch_kernel(read_strided, dim3(4), dim3(256), nullptr, +in, sink.data(), int64_t{1024}, 2); });
  CHECK(m.global_requests == 32);
  CHECK(m.sector_efficiency() == 0.5);
  CHECK(m.worst_site.find("test_memory_model.cpp:") == 0);
  CHECK(m.worst_site_bytes * 2 == m.worst_site_sectors * 32);
}

TEST_CASE("memory model: lanes walking runs of scalars pay a sector per lane pair", "[model]") {
  alignas(32) static float in[256 * 8];
  std::vector<float> sink(256);
  // 8 floats per lane: each instruction's 32 lanes are 32 bytes apart (one sector each, 4 bytes used): 12.5%.
  const emu::MemoryModel m8 = modelled(
      [&] { return launch_kernel(read_runs, dim3(1), dim3(256), nullptr, +in, sink.data(), int64_t{256}, 8); });
  CHECK(m8.global_requests == 8 * 8);
  CHECK(m8.sector_efficiency() == 0.125);
  // 4 floats per lane: 16 bytes apart, two lanes per sector: 25%.
  const emu::MemoryModel m4 = modelled(
      [&] { return launch_kernel(read_runs, dim3(1), dim3(256), nullptr, +in, sink.data(), int64_t{256}, 4); });
  CHECK(m4.sector_efficiency() == 0.25);
}

TEST_CASE("memory model: a naive byte transpose writes one byte per sector", "[model]") {
  const int rows = 64;
  const int cols = 96;
  alignas(32) static uint8_t in[64 * 96];
  alignas(32) static uint8_t out[64 * 96];
  for (int i = 0; i < rows * cols; ++i) {
    in[i] = static_cast<uint8_t>(i * 7);
  }
  const emu::MemoryModel m = modelled([&] {
    return launch_kernel(transpose_bytes_naive, dim3(rows * cols / 128), dim3(128), nullptr, +in, +out, rows, cols);
  });
  CHECK(m.global_requests == static_cast<uint64_t>(rows) * cols / 32);
  CHECK(m.sector_efficiency() == 1.0 / 32);  // about 3%
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      REQUIRE(out[c * rows + r] == in[r * cols + c]);
    }
  }
}

TEST_CASE("memory model: shared-memory bank conflicts cost one wavefront per word a bank serves", "[model]") {
  struct Case {
    int stride;
    double wavefronts;
  };
  const Case c = GENERATE(Case{1, 1.0}, Case{0, 1.0}, Case{2, 2.0}, Case{33, 1.0}, Case{16, 16.0}, Case{32, 32.0});
  std::vector<float> sink(64);
  const emu::MemoryModel m =
      modelled([&] { return launch_kernel(shared_stride, dim3(1), dim3(64), nullptr, c.stride, sink.data()); });
  INFO("stride " << c.stride);
  CHECK(m.shared_requests == 4);  // a store and a load per warp
  CHECK(m.wavefronts_per_request() == c.wavefronts);
  CHECK(m.global_requests == 0);
  for (unsigned t = 0; t < 64; ++t) {
    CHECK(sink[t] == static_cast<float>(c.stride == 0 ? 31 : t % 32));
  }
}

TEST_CASE("memory model: a 32x32 tile read by columns conflicts 32-way unless padded", "[model]") {
  std::vector<float> sink(1024);
  const emu::MemoryModel plain =
      modelled([&] { return launch_kernel(shared_tile, dim3(1), dim3(1024), nullptr, false, sink.data()); });
  CHECK(plain.shared_requests == 64);
  CHECK(plain.shared_wavefronts == 32 + 32 * 32);  // the row writes are conflict-free, the column reads 32-way
  const emu::MemoryModel padded =
      modelled([&] { return launch_kernel(shared_tile, dim3(1), dim3(1024), nullptr, true, sink.data()); });
  CHECK(padded.shared_wavefronts == 64);
  for (unsigned t = 0; t < 1024; ++t) {
    CHECK(sink[t] == static_cast<float>((t % 32) * 32 + t / 32));
  }
}

TEST_CASE("memory model: atomics are counted per lane, same-address ones as conflicts", "[model]") {
  struct Case {
    int pattern;
    uint64_t global, global_conflicts, shared, shared_conflicts;
  };
  // Two warps.
  const Case c = GENERATE(Case{0, 64, 62, 0, 0}, Case{1, 2, 0, 0, 0}, Case{2, 64, 0, 0, 0}, Case{3, 0, 0, 64, 56});
  std::vector<unsigned> counters(32, 0);
  const emu::MemoryModel m =
      modelled([&] { return launch_kernel(atomics, dim3(1), dim3(64), nullptr, counters.data(), c.pattern); });
  INFO("pattern " << c.pattern);
  CHECK(m.global_atomics == c.global);
  CHECK(m.global_atomic_conflicts == c.global_conflicts);
  CHECK(m.shared_atomics == c.shared);
  CHECK(m.shared_atomic_conflicts == c.shared_conflicts);
  // The atomic's own read and write are not requests of their own: only the zeroing store of the histogram.
  CHECK(m.shared_requests == 1);
  uint64_t total = 0;
  for (const unsigned v : counters) {
    total += v;
  }
  CHECK(total == (c.pattern == 3 ? 0u : 64u));
}

// Block 1's thread 0 waits at a barrier its block's other threads never reach: the launch fails there, after
// block 0 ran to its end.
__global__ void copy_then_stuck(const float* in, float* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  global_store(out + i, global_load(in + i));
  if (blockIdx.x == 1 && threadIdx.x == 0) {
    __syncthreads();
  }
}

TEST_CASE("memory model: a launch that fails part-way leaves the totals as they were", "[model]") {
  std::vector<float> in(128), out(128);
  emu::set_memory_model(true);
  REQUIRE(launch_kernel(copy_float, dim3(1), dim3(64), nullptr, in.data(), out.data(), int64_t{64}) == cudaSuccess);
  REQUIRE(launch_kernel(copy_then_stuck, dim3(2), dim3(64), nullptr, in.data(), out.data()) ==
          cudaErrorIllegalInstruction);
  const emu::MemoryModel m = emu::take_memory_model();
  emu::set_memory_model(false);
  CHECK(m.global_requests == 4);  // the first launch's 2 warps, a load and a store each; none of the second's
  CHECK(m.global_bytes == 2 * 64 * 4);
}

TEST_CASE("memory model: nothing is recorded while the model is off, and reading it clears it", "[model]") {
  std::vector<float> in(256), out(256);
  emu::set_memory_model(false);
  REQUIRE(launch_kernel(copy_float, dim3(1), dim3(256), nullptr, in.data(), out.data(), int64_t{256}) == cudaSuccess);
  emu::set_memory_model(true);
  CHECK(emu::take_memory_model().global_requests == 0);
  REQUIRE(launch_kernel(copy_float, dim3(1), dim3(256), nullptr, in.data(), out.data(), int64_t{256}) == cudaSuccess);
  CHECK(emu::take_memory_model().global_requests == 16);
  CHECK(emu::take_memory_model().global_requests == 0);
  emu::set_memory_model(false);
}

}  // namespace
