// Argument checks shared by the CPU, CUDA and Meta kernels of the AMP ops (see checks.h).
#include "checks.h"

#include "../../kernels/amp_functors.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace ampkit::detail {

void check_scalar_tensor(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype,
                         const std::optional<at::Device>& device) {
  TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, " must be a defined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, " must be a strided tensor, but got layout ",
              t.layout());
  TORCH_CHECK(t.numel() == 1, "ampkit::", op, ": ", arg, " must have exactly one element, but got ", t.numel(),
              " elements (shape ", t.sizes(), ")");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampkit::", op, ": ", arg, " must be a ", dtype, " tensor, but got ",
                   t.scalar_type());
  if (device.has_value()) {
    TORCH_CHECK(t.device() == *device, "ampkit::", op, ": ", arg, " must be on ", *device,
                " like the other arguments, but is on ", t.device());
  }
}

void check_float_list(const char* op, const char* arg, at::TensorList list, const at::Device& device, bool mutated) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.defined(), "ampkit::", op, ": ", arg, "[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, "ampkit::", op, ": ", arg, "[", i,
                "] must be a strided (dense) tensor, but got layout ", t.layout());
    const auto dtype = t.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                     "ampkit::", op, ": ", arg, "[", i, "] must be Half, BFloat16, Float or Double, but got ", dtype);
    TORCH_CHECK(t.device() == device, "ampkit::", op, ": ", arg, "[", i, "] must be on ", device,
                " like found_inf and the other tensors, but is on ", t.device());
    if (mutated && t.device().type() != at::kMeta) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "ampkit::", op, ": ", arg, "[", i,
                  "] is written in place and must not have overlapping elements (an expanded view?)");
    }
  }
}

kernels::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kDouble:
      return kernels::DType::kFloat64;
    default:
      TORCH_INTERNAL_ASSERT(false, "ampkit: no kernel dtype for ", t);
  }
}

DenseList::DenseList(at::TensorList list) {
  refs_.reserve(list.size());
  for (const at::Tensor& t : list) {
    if (t.numel() == 0) {
      continue;
    }
    if (t.is_non_overlapping_and_dense()) {
      refs_.push_back({t.data_ptr(), t.numel(), kernel_dtype(t.scalar_type())});
    } else {
      at::Tensor dense = t.contiguous();
      refs_.push_back({dense.data_ptr(), dense.numel(), kernel_dtype(dense.scalar_type())});
      staged_.emplace_back(t, std::move(dense));
    }
  }
}

void DenseList::write_back() {
  for (auto& [original, dense] : staged_) {
    original.copy_(dense);
  }
}

}  // namespace ampkit::detail

namespace ampkit::detail {

void check_unscale_and_check_args(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  constexpr const char* kOp = "unscale_and_check_";
  check_scalar_tensor(kOp, "found_inf", found_inf, at::kFloat, std::nullopt);
  check_scalar_tensor(kOp, "inv_scale", inv_scale, at::kFloat, found_inf.device());
  check_float_list(kOp, "grads", grads, found_inf.device(), /*mutated=*/true);
}

void check_check_finite_args(at::TensorList tensors, const at::Tensor& found_inf) {
  constexpr const char* kOp = "check_finite_";
  check_scalar_tensor(kOp, "found_inf", found_inf, at::kFloat, std::nullopt);
  check_float_list(kOp, "tensors", tensors, found_inf.device(), /*mutated=*/false);
}

namespace {

void check_scale_factors(const char* op, double growth_factor, double backoff_factor, int64_t growth_interval) {
  TORCH_CHECK_VALUE(std::isfinite(growth_factor) && growth_factor > 0, "ampkit::", op,
                    ": growth_factor must be a finite number > 0, but got ", growth_factor);
  TORCH_CHECK_VALUE(std::isfinite(backoff_factor) && backoff_factor > 0, "ampkit::", op,
                    ": backoff_factor must be a finite number > 0, but got ", backoff_factor);
  TORCH_CHECK_VALUE(growth_interval >= 1 && growth_interval <= std::numeric_limits<int32_t>::max(), "ampkit::", op,
                    ": growth_interval must be in [1, 2^31 - 1], but got ", growth_interval);
}

}  // namespace

void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval) {
  constexpr const char* kOp = "update_scale_";
  check_scalar_tensor(kOp, "scale", scale, at::kFloat, std::nullopt);
  check_scalar_tensor(kOp, "growth_tracker", growth_tracker, at::kInt, scale.device());
  check_scalar_tensor(kOp, "found_inf", found_inf, at::kFloat, scale.device());
  check_scale_factors(kOp, growth_factor, backoff_factor, growth_interval);
}

void check_update_scale_hysteresis_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& hysteresis_tracker, const at::Tensor& stats,
                                        const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                                        int64_t growth_interval, int64_t hysteresis, double min_scale,
                                        double max_scale) {
  constexpr const char* kOp = "update_scale_hysteresis_";
  check_scalar_tensor(kOp, "scale", scale, at::kFloat, std::nullopt);
  check_scalar_tensor(kOp, "growth_tracker", growth_tracker, at::kInt, scale.device());
  check_scalar_tensor(kOp, "hysteresis_tracker", hysteresis_tracker, at::kInt, scale.device());
  check_scalar_tensor(kOp, "found_inf", found_inf, at::kFloat, scale.device());
  TORCH_CHECK(stats.defined() && stats.layout() == at::kStrided && stats.dim() == 1 &&
                  stats.numel() == kernels::kNumStats && stats.is_contiguous(),
              "ampkit::", kOp, ": stats must be a contiguous 1-D tensor of ", static_cast<int>(kernels::kNumStats),
              " elements, but got ", stats.defined() ? stats.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kLong, "ampkit::", kOp, ": stats must be a Long tensor, but got ",
                   stats.scalar_type());
  TORCH_CHECK(stats.device() == scale.device(), "ampkit::", kOp, ": stats must be on ", scale.device(),
              " like the other arguments, but is on ", stats.device());
  check_scale_factors(kOp, growth_factor, backoff_factor, growth_interval);
  TORCH_CHECK_VALUE(hysteresis >= 1 && hysteresis <= std::numeric_limits<int32_t>::max(), "ampkit::", kOp,
                    ": hysteresis must be in [1, 2^31 - 1], but got ", hysteresis);
  TORCH_CHECK_VALUE(min_scale >= 0 && max_scale >= min_scale && !std::isnan(max_scale), "ampkit::", kOp,
                    ": min_scale and max_scale must satisfy 0 <= min_scale <= max_scale, but got min_scale=",
                    min_scale, ", max_scale=", max_scale);
}

}  // namespace ampkit::detail
