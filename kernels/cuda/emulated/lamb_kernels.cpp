// The emulated host build of kernels/cuda/lamb_kernels.cu (compiled with AMPKIT_CUDA_EMULATION; see emulation.h).
#include "../lamb_kernels.cu"
