// Host-side helpers shared by the CUDA kernels of every op: the launch check, and the first-use check that the
// device and driver can run this build's kernels.
#pragma once

#include <c10/core/Device.h>

#include "../../kernels/cuda/amp_launch.h"

namespace ampkit::detail {

// Throws unless the launches succeeded; says how many kernels of the call were queued before the failure (their
// tensors are, or will be, updated: the call is not atomic then).
void check_launch(const char* op, const kernels::LaunchStatus& status);

// Once per device: throws unless the device's compute capability is covered by the archs this build compiled
// (naming the GPU, its capability and the archs) and the driver takes 32 KB kernel parameters (CUDA >= 12.1).
void check_cuda_device(const char* op, const at::Device& device);

}  // namespace ampkit::detail
