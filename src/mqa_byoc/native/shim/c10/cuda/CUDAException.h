#pragma once
// Stand-in for the one c10 header flash-attn's forward kernels include: error checks only.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define C10_CUDA_CHECK(expr)                                                            \
  do {                                                                                  \
    cudaError_t mqa_err_ = (expr);                                                      \
    if (mqa_err_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "mqa_byoc fa2: %s at %s:%d\n", cudaGetErrorString(mqa_err_), \
                   __FILE__, __LINE__);                                                 \
    }                                                                                   \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
