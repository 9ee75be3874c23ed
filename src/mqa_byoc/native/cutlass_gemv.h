// CUTLASS's GEMV configurations that the cuBLASLt dispatcher (cublaslt_gemm.cc) times with its own
// candidates for GEMMs of one row, and the arguments their entries take (cutlass_gemv.cu).
#pragma once
#include <stdint.h>

// D (1 x N) = X (1 x K) @ W^T + beta * C: W (N, K) row-major, X and C (bias or residual, N) and D
// contiguous, all of one type (fp16 or bf16); C is read only when beta != 0.
typedef struct {
  int64_t n, k;
  const void* x;
  const void* w;
  const void* c;
  void* out;
  float beta;
  // Bytes of its first rows of W each block asks the L2 for before it waits for the previous kernel (0:
  // none; a multiple of 16). The entries wait (PDL's griddepcontrol.wait) before reading any operand and
  // then let a dependent kernel start: a plain launch runs them as before.
  int64_t prefetch_bytes;
} mqa_byoc_gemv_args;

// Configuration i: blocks of kGemvThreads[i] threads, kGemvPerRow[i] of them (one warp or part of one)
// per row of W, so kGemvThreads[i] / kGemvPerRow[i] rows a block. Entries (in the fatbin):
// mqa_byoc_gemv_f16_<i> and mqa_byoc_gemv_bf16_<i>, each taking one mqa_byoc_gemv_args.
#define MQA_BYOC_GEMV_CONFIGS(X) \
  X(0, 128, 32)                  \
  X(1, 256, 32)                  \
  X(2, 512, 32)                  \
  X(3, 128, 16)

// Elements per 16-byte load: K must be a multiple (and X, W 16-byte aligned).
#define MQA_BYOC_GEMV_VECTOR 8
