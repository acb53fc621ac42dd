// The emulated host build of kernels/cuda/optim_kernels.cu (compiled with AMPKIT_CUDA_EMULATION; see emulation.h).
#include "../optim_kernels.cu"
