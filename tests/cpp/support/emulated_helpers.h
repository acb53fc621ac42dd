// Helpers of the emulated CUDA tests (test_emulated*.cpp): the chunk size of this build, descriptors of CPU
// tensors for the launchers, and copies that keep a tensor's offset from a 16-byte boundary (so that a misaligned
// case stays misaligned). `using namespace ampkit::test::emulated;` also brings the kernels' namespaces (kern,
// emu) and the shared test helpers.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cuda/emulation.h"
#include "kernels/cuda/multi_tensor_apply.cuh"
#include "test_helpers.h"

namespace ampkit::test::emulated {

namespace kern = ampkit::kernels;
namespace emu = ampkit::kernels::emulation;
using ampkit::test::bits_equal;
using ampkit::test::random_grad;

constexpr int64_t kChunk = kern::cuda::kChunkSize;
constexpr int64_t kernels_norm_chunk() { return kern::kNormChunk; }
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline at::Tensor scalar_f32(float v) { return at::full({1}, v, at::kFloat); }

inline kern::DType dtype_of(at::ScalarType t) {
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

inline std::vector<kern::TensorRef> refs_of(const std::vector<at::Tensor>& ts) {
  std::vector<kern::TensorRef> out;
  for (const auto& t : ts) {
    REQUIRE(t.is_contiguous());
    out.push_back({t.data_ptr(), t.numel(), dtype_of(t.scalar_type())});
  }
  return out;
}

// A contiguous tensor of `n` elements whose storage starts `offset` elements into its allocation (misaligned for
// the 16-byte paths when offset is not a multiple of 16 / element size).
inline at::Tensor at_offset(const at::Tensor& t, int64_t offset) {
  auto buf = at::empty({t.numel() + offset}, t.options());
  auto view = buf.narrow(0, offset, t.numel());
  view.copy_(t.flatten());
  return view;
}

// A copy at the same offset from a 16-byte boundary as `t` (clone() would align it, and a misaligned case would
// test the aligned kernel path).
inline at::Tensor copy_keeping_offset(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
  return at_offset(t, misalign / static_cast<int64_t>(t.element_size())).view(t.sizes());
}

inline std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) {
    out.push_back(copy_keeping_offset(t));
  }
  return out;
}

}  // namespace ampkit::test::emulated
