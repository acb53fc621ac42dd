// The CUDA graph capture a stream is in, for the scaler's stream ordering (NOTE in scaler_buffers.cpp); the CUDA
// side lives in scaler_cuda.cpp, so the scaler's other sources include no CUDA header.
#pragma once

#include <c10/core/Stream.h>

#include <cstdint>

namespace ampkit::detail {

// The id of the CUDA graph capture `stream` (a CUDA stream) is in; 0 when it is not being captured. CUDA builds only.
uint64_t cuda_capture_id(const c10::Stream& stream);

}  // namespace ampkit::detail
