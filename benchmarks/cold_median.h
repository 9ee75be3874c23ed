// The timing both standalone GEMM benchmarks use (cublaslt_search.cu, cutlass_gemv.cu): the median GPU
// time of a call, each timed call after a pass that evicts the L2 (each benchmark brings its own pass).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

// Median of `reps` timed calls of `call` (µs, CUDA events e0 / e1 on the default stream), each after
// `evict(r)`; one untimed call first. -1 when a call returns nonzero or CUDA reports an error.
template <typename Call, typename Evict>
float median_cold_us(Call&& call, Evict&& evict, int reps, cudaEvent_t e0, cudaEvent_t e1) {
  if (call() != 0) return -1;
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    evict(r);
    cudaEventRecord(e0, 0);
    if (call() != 0) return -1;
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    t.push_back(ms * 1000.f);
  }
  if (cudaGetLastError() != cudaSuccess) return -1;
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
