// Argument checks shared by every backend of the AMP ops, and the conversion of a tensor list into the dense
// descriptors the kernels take. Everything here runs before the first write, so a failed check changes nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "../../kernels/amp_functors.h"
#include "../../kernels/common.h"

namespace ampkit::detail {

// Throws unless `t` is a defined, strided, one-element tensor of `dtype`, on `device` when one is given.
// `op` and `arg` name the op and the argument in the message.
void check_scalar_tensor(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype,
                         const std::optional<at::Device>& device);

// Throws unless every tensor of `list` is defined, strided, FP16/BF16/FP32/FP64, free of internal overlap
// (when `mutated`) and on `device`.
void check_float_list(const char* op, const char* arg, at::TensorList list, const at::Device& device, bool mutated);

kernels::DType kernel_dtype(at::ScalarType t);

// Dense descriptors of a tensor list. Tensors whose memory is one dense block (any permutation of a contiguous
// tensor) are used in place; the others go through a contiguous staging copy that `write_back()` copies back.
class DenseList {
 public:
  explicit DenseList(at::TensorList list);
  const kernels::TensorRef* data() const { return refs_.data(); }
  int64_t size() const { return static_cast<int64_t>(refs_.size()); }
  void write_back();

 private:
  std::vector<kernels::TensorRef> refs_;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged_;  // (original, contiguous copy)
};

}  // namespace ampkit::detail

namespace ampkit::detail {

// Full argument checks of each op, shared by its CPU, CUDA and Meta kernels.
void check_unscale_and_check_args(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale);
void check_check_finite_args(at::TensorList tensors, const at::Tensor& found_inf);
void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval);
void check_update_scale_hysteresis_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& hysteresis_tracker, const at::Tensor& stats,
                                        const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                                        int64_t growth_interval, int64_t hysteresis, double min_scale,
                                        double max_scale);

// The kernel signature of update_scale_hysteresis_, shared by its CPU, CUDA and Meta kernels.
#define AMPKIT_UPDATE_SCALE_HYSTERESIS_ARGS                                                                        \
  const at::Tensor &scale, const at::Tensor &growth_tracker, const at::Tensor &hysteresis_tracker,                \
      const at::Tensor &stats, const at::Tensor &found_inf, double growth_factor, double backoff_factor,           \
      int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale, bool dynamic
#define AMPKIT_CHECK_UPDATE_SCALE_HYSTERESIS()                                                                      \
  ::ampkit::detail::check_update_scale_hysteresis_args(scale, growth_tracker, hysteresis_tracker, stats, found_inf, \
                                                       growth_factor, backoff_factor, growth_interval, hysteresis,  \
                                                       min_scale, max_scale)

// The functor of update_scale_hysteresis_ for the op's (checked) arguments.
inline kernels::HysteresisScaleOp hysteresis_scale_op(double growth_factor, double backoff_factor,
                                                      int64_t growth_interval, int64_t hysteresis, double min_scale,
                                                      double max_scale, bool dynamic) {
  return {growth_factor,
          backoff_factor,
          growth_interval,
          static_cast<int32_t>(hysteresis),
          static_cast<float>(min_scale),
          static_cast<float>(max_scale),
          dynamic};
}

}  // namespace ampkit::detail
