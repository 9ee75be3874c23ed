// Split-KV decode around FA4's sm90 forward, which has no split-KV of its own (hopper provider).
//
// One query row (batch 1, S_q = 1) over S_kv keys: the keys are cut into n chunks, and one FA4 call of
// its "splitkv" object (K/V var-len through cu_seqlens_k, the LSE written) computes every chunk as a
// sequence of its own with the query repeated: n x H_kv tiles of packed query heads, about one per SM,
// each reading only its chunk. A combine kernel then merges the n partial outputs by their LSEs.
// Three launches: prepare (chunk offsets, repeated query), FA4, combine (split_kv_combine.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <stdint.h>
#include <tvm/ffi/c_api.h>

#include "fa4_call.h"

#include <algorithm>

#include "fa2_dispatch.h"  // workspace pool and error message (fa2_dispatch.cc), combine (split_kv_combine.cu)

namespace {

constexpr int kChunkAlign = 128;  // the FA4 kernel's tile_n: a chunk is whole key tiles

// cu[i] = min(i * chunk, s_kv) for i <= n; q_rep[i] = q for i < n (rows of H * D elements).
template <typename T>
__global__ void prepare(int32_t* cu, int n, int64_t chunk, int64_t s_kv, const T* q, int64_t q_head_stride,
                        T* q_rep, int h, int d) {
  const int i = blockIdx.x;
  if (i == 0) {
    for (int j = threadIdx.x; j <= n; j += blockDim.x) cu[j] = int32_t(min(int64_t(j) * chunk, s_kv));
  }
  for (int e = threadIdx.x; e < h * d; e += blockDim.x) {
    const int head = e / d, col = e - head * d;
    q_rep[int64_t(i) * h * d + e] = q[head * q_head_stride + col];
  }
}



}  // namespace

extern "C" {

// Number of key chunks the decode uses for S_kv keys and H_kv K/V heads on `num_sms` SMs.
__attribute__((visibility("default"))) int mqa_byoc_fa4_decode_chunks(int64_t s_kv, int64_t num_heads_k, int num_sms) {
  const int64_t tiles = (s_kv + kChunkAlign - 1) / kChunkAlign;
  const int64_t want = std::max<int64_t>(1, (num_sms + num_heads_k - 1) / num_heads_k);
  return int(std::max<int64_t>(1, std::min<int64_t>(want, tiles)));
}

// q (H, D) with head stride q_head_stride; k, v (S_kv, H_kv, D) with row / head strides k_stride[0..1],
// v_stride[0..1]; out (H, D) with head stride out_head_stride. fa4: the "splitkv" object's function.
// Returns 0; -1 when FA4 raised a TVM-FFI error; -2 when mqa_byoc_fa2_last_error() holds the message.
__attribute__((visibility("default"))) int mqa_byoc_fa4_decode(
    mqa_byoc_ffi_fn fa4, const void* q, int64_t q_head_stride, const void* k, const int64_t* k_stride, const void* v,
    const int64_t* v_stride, void* out, int64_t out_head_stride, int64_t s_kv, int64_t num_heads, int64_t num_heads_k,
    int64_t head_dim, int is_bf16, double scale, int num_sms, int device_id, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int n0 = mqa_byoc_fa4_decode_chunks(s_kv, num_heads_k, num_sms);
  int64_t chunk = (s_kv + n0 - 1) / n0;
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  const int n = int((s_kv + chunk - 1) / chunk);  // no empty chunk
  const int64_t h = num_heads, d = head_dim;
  const size_t elt = 2;
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t q_bytes = align(size_t(n) * h * d * elt), o_bytes = q_bytes, lse_bytes = align(size_t(n) * h * 4),
               cu_bytes = align(size_t(n + 1) * 4);
  void* ws = nullptr;
  if (mqa_byoc_fa2_alloc_workspace(&ws, q_bytes + o_bytes + lse_bytes + cu_bytes, device_id, stream) != 0) {
    return -2;
  }
  char* base = static_cast<char*>(ws);
  void* q_rep = base;
  void* o_part = base + q_bytes;
  float* lse = reinterpret_cast<float*>(base + q_bytes + o_bytes);
  int32_t* cu = reinterpret_cast<int32_t*>(base + q_bytes + o_bytes + lse_bytes);

  const int threads = 256;
  if (is_bf16) {
    prepare<__nv_bfloat16><<<n, threads, 0, stream>>>(cu, n, chunk, s_kv, static_cast<const __nv_bfloat16*>(q),
                                                      q_head_stride, static_cast<__nv_bfloat16*>(q_rep), int(h), int(d));
  } else {
    prepare<__half><<<n, threads, 0, stream>>>(cu, n, chunk, s_kv, static_cast<const __half*>(q), q_head_stride,
                                               static_cast<__half*>(q_rep), int(h), int(d));
  }
  const DLDataType half_t = {uint8_t(is_bf16 ? kDLBfloat : kDLFloat), 16, 1};
  const DLDataType f32 = {kDLFloat, 32, 1}, i32 = {kDLInt, 32, 1};
  int64_t q_shape[4] = {n, 1, h, d}, q_str[4] = {h * d, h * d, d, 1};
  int64_t k_shape[3] = {s_kv, num_heads_k, d}, k_str[3] = {k_stride[0], k_stride[1], 1};
  int64_t v_shape[3] = {s_kv, num_heads_k, d}, v_str[3] = {v_stride[0], v_stride[1], 1};
  int64_t o_shape[4] = {n, 1, h, d}, o_str[4] = {h * d, h * d, d, 1};
  int64_t l_shape[3] = {n, h, 1}, l_str[3] = {h, 1, 1};
  int64_t c_shape[1] = {n + 1}, c_str[1] = {1};
  DLTensor tq = mqa_byoc_cuda_view(q_rep, half_t, device_id, 4, q_shape, q_str);
  DLTensor tk = mqa_byoc_cuda_view(const_cast<void*>(k), half_t, device_id, 3, k_shape, k_str);
  DLTensor tv = mqa_byoc_cuda_view(const_cast<void*>(v), half_t, device_id, 3, v_shape, v_str);
  DLTensor to = mqa_byoc_cuda_view(o_part, half_t, device_id, 4, o_shape, o_str);
  DLTensor tl = mqa_byoc_cuda_view(lse, f32, device_id, 3, l_shape, l_str);
  DLTensor tc = mqa_byoc_cuda_view(cu, i32, device_id, 1, c_shape, c_str);
  TVMFFIAny args[7] = {mqa_byoc_tensor_arg(&tq), mqa_byoc_tensor_arg(&tk), mqa_byoc_tensor_arg(&tv),
                       mqa_byoc_tensor_arg(&to), mqa_byoc_tensor_arg(&tl), {}, mqa_byoc_tensor_arg(&tc)};
  args[5] = mqa_byoc_float_arg(scale);
  TVMFFIAny result = mqa_byoc_none_result();
  int rc = fa4(nullptr, args, 7, &result);
  int combine_rc = 0;
  if (rc == 0) {
    combine_rc = mqa_byoc_combine_chunks(o_part, lse, out, out_head_stride, n, int(h), int(d), is_bf16, stream);
  }
  cudaFreeAsync(ws, stream);
  if (rc != 0) return -1;
  cudaError_t err = cudaGetLastError();
  if (combine_rc != 0 || err != cudaSuccess) {
    mqa_byoc_fa2_fail(cudaGetErrorString(err));
    return -2;
  }
  return 0;
}

}  // extern "C"
