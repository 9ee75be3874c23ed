// The fastest a kernel reads a buffer: the floor under any decode kernel that reads the same K/V bytes.
// Each thread streams 16-byte vectors (four loads in flight per iteration) and folds them into one
// word, written only when it matches a value the caller never sees, so the loads cannot be dropped.
#include <cuda_runtime.h>
#include <stdint.h>

__global__ void mqa_byoc_read_floor_kernel(const uint4* __restrict__ p, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = __ldg(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

__global__ void mqa_byoc_empty_kernel() {}

extern "C" int mqa_byoc_read_floor_launch(const void* p, int64_t bytes, void* sink, int blocks, int threads,
                                          cudaStream_t stream) {
  if (blocks <= 0) {
    mqa_byoc_empty_kernel<<<1, 32, 0, stream>>>();
  } else {
    mqa_byoc_read_floor_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint4*>(p), bytes / 16,
                                                              static_cast<uint32_t*>(sink));
  }
  return static_cast<int>(cudaGetLastError());
}
