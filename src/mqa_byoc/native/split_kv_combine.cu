// Split-KV decode pieces of our own, shared by both linked providers (compiled per arch by
// mqa_byoc.kernels.build.support_object, linked next to the dispatcher):
//
// - mqa_byoc_chunk_lengths: the key count of each chunk of a decode's keys, for an FA2 call that treats
//   the chunks as a batch (fa2_dispatch.cc, non-cumulative cu_seqlens_k);
// - mqa_byoc_combine_chunks: merges the chunks' outputs by their LSEs into the attention output.
//
// Why not FA2's own split-KV: its combine kernel runs b*h*g/4 blocks that walk the splits one after
// another (about 9 us of a 30 us decode at 16k keys on the H200); here one block per query head reads
// all chunks at once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__global__ void chunk_lengths(int32_t* lens, int n, int64_t chunk, int64_t s_kv) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    lens[i] = int32_t(min(chunk, s_kv - int64_t(i) * chunk));
  }
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// out[head, :] = sum_i w_i o_part[i, head, :], w_i = exp(lse[i, head] - max) / sum_j exp(lse[j, head] - max).
// o_part (n, h, d) and lse (n, h) are compact; one block per head, one thread per column (d <= 256). The
// weights are computed once per block into shared memory (n <= kMaxChunks).
constexpr int kMaxChunks = 1024;

template <typename T>
__global__ void combine(const T* __restrict__ o_part, const float* __restrict__ lse, T* __restrict__ out,
                        int64_t out_head_stride, int n, int h, int d) {
  __shared__ float w[kMaxChunks];
  __shared__ float red[32];
  const int head = blockIdx.x, tid = threadIdx.x;
  float m = -INFINITY;
  for (int i = tid; i < n; i += blockDim.x) m = fmaxf(m, lse[int64_t(i) * h + head]);
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((tid & 31) == 0) red[tid >> 5] = m;
  __syncthreads();
  if (tid < 32) {
    float x = tid < (blockDim.x + 31) / 32 ? red[tid] : -INFINITY;
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    if (tid == 0) red[0] = x;
  }
  __syncthreads();
  m = red[0];
  __syncthreads();
  float s = 0.f;
  for (int i = tid; i < n; i += blockDim.x) {
    const float l = lse[int64_t(i) * h + head];
    const float e = m == -INFINITY ? 0.f : __expf(l - m);
    w[i] = e;
    s += e;
  }
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if ((tid & 31) == 0) red[tid >> 5] = s;
  __syncthreads();
  float total = 0.f;
  for (int j = 0; j < (blockDim.x + 31) / 32; ++j) total += red[j];
  if (tid < d) {
    float acc = 0.f;
    const T* p = o_part + int64_t(head) * d + tid;
    const int64_t step = int64_t(h) * d;
#pragma unroll 4
    for (int i = 0; i < n; ++i) acc += w[i] * to_float(p[i * step]);
    out[int64_t(head) * out_head_stride + tid] = from_float<T>(total > 0.f ? acc / total : 0.f);
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int mqa_byoc_chunk_lengths(int32_t* lens, int n, int64_t chunk, int64_t s_kv,
                                                                  void* stream) {
  chunk_lengths<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(lens, n, chunk, s_kv);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

// o_part (n, h, d) and lse (n, h) compact, out (h, d) with head stride out_head_stride; d <= 256, n <= 1024.
__attribute__((visibility("default"))) int mqa_byoc_combine_chunks(const void* o_part, const float* lse, void* out,
                                                                   int64_t out_head_stride, int n, int h, int d,
                                                                   int is_bf16, void* stream) {
  if (n < 1 || n > kMaxChunks || d < 1 || d > 256) return 2;
  const int threads = d <= 64 ? 64 : (d <= 128 ? 128 : 256);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (is_bf16) {
    combine<__nv_bfloat16><<<h, threads, 0, st>>>(static_cast<const __nv_bfloat16*>(o_part), lse,
                                                   static_cast<__nv_bfloat16*>(out), out_head_stride, n, h, d);
  } else {
    combine<__half><<<h, threads, 0, st>>>(static_cast<const __half*>(o_part), lse, static_cast<__half*>(out),
                                           out_head_stride, n, h, d);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

}  // extern "C"
