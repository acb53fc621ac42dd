// The CUDA side of the scaler's stream ordering: which graph capture a stream is in (see capture.h).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "capture.h"

namespace ampkit::detail {

uint64_t cuda_capture_id(const c10::Stream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(c10::cuda::CUDAStream(stream).stream(), &status, &id));
  return status == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) : 0;
}

}  // namespace ampkit::detail
