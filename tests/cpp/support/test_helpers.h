// Helpers shared by the LibTorch op tests: bit-exact comparison (NaN equal to NaN), seeded random grads that
// are never all zero, a float64 reference of the unscale, and an optimizer's archive as bytes and back.
#pragma once

#include <torch/torch.h>

#include <sstream>
#include <string>

namespace ampkit::test {

inline at::ScalarType same_size_int(at::ScalarType t) {
  switch (c10::elementSize(t)) {
    case 1:
      return at::kByte;
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    default:
      return at::kLong;
  }
}

// True when a and b hold the same bits everywhere, except that any NaN equals any NaN (payloads may differ
// between SIMD and scalar conversion paths, in torch's kernels as in ours).
inline bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) {
    return false;
  }
  const at::Tensor nan_a = a.isnan();
  if (!at::equal(nan_a, b.isnan())) {
    return false;
  }
  const auto it = same_size_int(a.scalar_type());
  const at::Tensor ia = a.contiguous().masked_fill(nan_a, 0).view(it);
  const at::Tensor ib = b.contiguous().masked_fill(nan_a, 0).view(it);
  return at::equal(ia, ib);
}

// Seeded normal values scaled by `scale` in the given dtype; never all zero.
inline at::Tensor random_grad(int64_t n, at::ScalarType dtype, double scale, const at::Device& device = at::kCPU) {
  auto t = (at::randn({n}, at::TensorOptions().dtype(at::kDouble)) * scale).to(device, dtype);
  return t;
}

// float64 reference of the unscale for one tensor: the product is exact in double (operands have at most 24
// significant bits), rounded once to opmath (float, or double for FP64) and once to the storage dtype.
inline at::Tensor reference_unscale(const at::Tensor& g, float inv) {
  if (inv == 1.f) {
    return g.clone();
  }
  const at::Tensor prod = g.to(at::kDouble) * static_cast<double>(inv);
  if (g.scalar_type() == at::kDouble) {
    return g * static_cast<double>(inv);
  }
  return prod.to(at::kFloat).to(g.scalar_type());
}

// An optimizer's torch::save archive as bytes, and those bytes loaded into an optimizer (torch::load).
template <typename Opt>
std::string saved(const Opt& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

template <typename Opt>
void load_from(Opt& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

}  // namespace ampkit::test
