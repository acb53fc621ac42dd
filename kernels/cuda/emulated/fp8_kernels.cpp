// The emulated host build of kernels/cuda/fp8_kernels.cu (compiled with AMPKIT_CUDA_EMULATION; see emulation.h).
#include "../fp8_kernels.cu"
