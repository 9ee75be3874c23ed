// Attention sinks (GPT-OSS) as an epilogue on an attention output and its log-sum-exp, compiled into the
// support object with the decode kernels (decode_support.cu).
//
// A sink is one more logit per query head, sink_h, in every row's softmax, with a value of zero. With
// o = softmax(s) V and lse = log sum_j exp(s_j) of the row (the scaled scores), the row's output with the
// sink is o * exp(lse) / (exp(lse) + exp(sink_h)) = o * sigmoid(lse - sink_h): exact, one read and one
// write of the output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace mqa_byoc_sinks {

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(__half* p, int64_t i, float x) { p[i] = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float x) { p[i] = __float2bfloat16_rn(x); }

// One block per (batch, query row, head) row, one thread per column. lse (B, H, S_q) compact, in base 2
// when lse_base2 (our decode kernel's), else natural (FA2's); out (B, S_q, H, D) with strides o_stride.
template <typename T, typename S>
__global__ void apply(T* __restrict__ out, const float* __restrict__ lse, const S* __restrict__ sinks, int64_t s_q,
                      int64_t h, int d, int64_t ob, int64_t os, int64_t oh, int lse_base2) {
  const int64_t row = blockIdx.x;  // (b, s, head) with head fastest
  const int64_t head = row % h, s = (row / h) % s_q, b = row / (h * s_q);
  float l = lse[(b * h + head) * s_q + s];
  if (lse_base2) l *= 0.6931471805599453f;  // ln 2
  const float factor = 1.f / (1.f + __expf(load(sinks, head) - l));
  T* o = out + b * ob + s * os + head * oh;
  for (int c = threadIdx.x; c < d; c += blockDim.x) store(o, c, load(o, c) * factor);
}

template <typename T>
int launch(void* out, const float* lse, const void* sinks, int sinks_dtype, int64_t rows, int64_t s_q, int64_t h,
           int d, const int64_t* o_stride, int lse_base2, cudaStream_t st) {
  const int threads = d <= 64 ? 64 : (d <= 128 ? 128 : 256);
  T* o = static_cast<T*>(out);
  if (sinks_dtype == 0) {
    apply<T, float><<<rows, threads, 0, st>>>(o, lse, static_cast<const float*>(sinks), s_q, h, d, o_stride[0],
                                               o_stride[1], o_stride[2], lse_base2);
  } else if (sinks_dtype == 1) {
    apply<T, __half><<<rows, threads, 0, st>>>(o, lse, static_cast<const __half*>(sinks), s_q, h, d, o_stride[0],
                                                o_stride[1], o_stride[2], lse_base2);
  } else {
    apply<T, __nv_bfloat16><<<rows, threads, 0, st>>>(o, lse, static_cast<const __nv_bfloat16*>(sinks), s_q, h, d,
                                                       o_stride[0], o_stride[1], o_stride[2], lse_base2);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

}  // namespace mqa_byoc_sinks

extern "C" {

// out (B, S_q, H, D) (strides o_stride: batch, row, head; the dim contiguous) *= sigmoid(lse - sinks[h]);
// lse (B, H, S_q) compact float32 (base 2 when lse_base2); sinks (H,) of sinks_dtype 0 float32, 1 float16,
// 2 bfloat16. 0 on success, 1 on a launch error, 2 for bad arguments.
__attribute__((visibility("default"))) int mqa_byoc_apply_sinks(void* out, const float* lse, const void* sinks,
                                                                int sinks_dtype, int64_t batch, int64_t s_q, int64_t h,
                                                                int64_t d, const int64_t* o_stride, int is_bf16,
                                                                int lse_base2, void* stream) {
  const int64_t rows = batch * s_q * h;
  if (rows <= 0) return 0;
  if (d < 1 || d > 256 || sinks_dtype < 0 || sinks_dtype > 2 || rows > 0x7fffffff) return 2;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return is_bf16 ? mqa_byoc_sinks::launch<__nv_bfloat16>(out, lse, sinks, sinks_dtype, rows, s_q, h, int(d), o_stride,
                                                         lse_base2, st)
                 : mqa_byoc_sinks::launch<__half>(out, lse, sinks, sinks_dtype, rows, s_q, h, int(d), o_stride,
                                                  lse_base2, st);
}

}  // extern "C"
