// The emulated host build of kernels/cuda/amp_kernels.cu (compiled with AMPKIT_CUDA_EMULATION; see emulation.h).
#include "../amp_kernels.cu"
