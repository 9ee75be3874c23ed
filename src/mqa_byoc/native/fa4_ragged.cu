// Ragged (var-len) prefill of TVM's PagedKVCache on FA4's sm90 forward (hopper provider).
//
// TVM's ragged entry is the self-attention of a prefill's new tokens: q (total_q, H, D) over k, v
// (total_k, H_kv, D), the sequences cut by qo_indptr / kv_indptr (device int32). FA4's "varlen" objects
// take exactly that (cu_seqlens_q, cu_seqlens_k) and map their tiles to sequences on the GPU, so the
// launch needs no longest length (TVM keeps the lengths on the host side only) and starts no tiles
// past a sequence's end. FA4 writes the LSE (H, total_q) in natural log; a small kernel converts it to
// TVM's compact base-2 (total_q, H) (lse_rule.h, fa2_paged.cu's rule). Two launches: FA4, the conversion.
#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <stdint.h>
#include <tvm/ffi/c_api.h>

#include "fa4_call.h"

#include "fa2_dispatch.h"  // workspace pool and error message (fa2_dispatch.cc)
#include "lse_rule.h"

namespace {

// lse[r * heads + h] = base 2 of lse_nat[h * rows + r]
__global__ void lse_to_tvm(const float* __restrict__ lse_nat, int64_t rows, int heads, float* __restrict__ lse) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads) return;
  const int64_t r = i / heads, h = i % heads;
  lse[i] = mqa_byoc_lse_base2(lse_nat[h * rows + r]);
}

}  // namespace

extern "C" {

// fa4: the "varlen" or "varlen_causal" object's function (q, k, v, out, lse, scale, cu_seqlens_q,
// cu_seqlens_k), which launches on the TVM-FFI environment's stream of `device_id`: the caller makes it
// `stream`. Strides: 3 per tensor (row, head, dim) in elements, dim contiguous. lse: compact (total_q, H)
// float32, base 2 (TVM's), or NULL when the caller needs none (FA4 writes its own to a workspace). Returns 0; -1 when FA4 raised a TVM-FFI error; -2 when
// mqa_byoc_fa2_last_error() holds the message.
__attribute__((visibility("default"))) int mqa_byoc_fa4_ragged_forward(
    mqa_byoc_ffi_fn fa4, const void* q, const void* k, const void* v, void* out, float* lse, const int32_t* qo_indptr,
    const int32_t* kv_indptr, int64_t batch, int64_t total_q, int64_t total_k, int64_t num_heads,
    int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride, const int64_t* k_stride, const int64_t* v_stride,
    const int64_t* o_stride, int is_bf16, double scale, int device_id, void* stream) {
  if (batch <= 0 || total_q <= 0) return 0;
  const size_t lse_bytes = (size_t(num_heads) * size_t(total_q) * 4 + 255) / 256 * 256;
  void* ws = nullptr;
  if (mqa_byoc_fa2_alloc_workspace(&ws, lse_bytes, device_id, stream) != 0) return -2;
  const DLDataType half_t = {uint8_t(is_bf16 ? kDLBfloat : kDLFloat), 16, 1};
  const DLDataType f32 = {kDLFloat, 32, 1}, i32 = {kDLInt, 32, 1};
  int64_t q_shape[3] = {total_q, num_heads, head_dim}, q_str[3] = {q_stride[0], q_stride[1], 1};
  int64_t k_shape[3] = {total_k, num_heads_k, head_dim}, k_str[3] = {k_stride[0], k_stride[1], 1};
  int64_t v_shape[3] = {total_k, num_heads_k, head_dim}, v_str[3] = {v_stride[0], v_stride[1], 1};
  int64_t o_shape[3] = {total_q, num_heads, head_dim}, o_str[3] = {o_stride[0], o_stride[1], 1};
  int64_t l_shape[2] = {num_heads, total_q}, l_str[2] = {total_q, 1};
  int64_t c_shape[1] = {batch + 1}, c_str[1] = {1};
  DLTensor tq = mqa_byoc_cuda_view(const_cast<void*>(q), half_t, device_id, 3, q_shape, q_str);
  DLTensor tk = mqa_byoc_cuda_view(const_cast<void*>(k), half_t, device_id, 3, k_shape, k_str);
  DLTensor tv = mqa_byoc_cuda_view(const_cast<void*>(v), half_t, device_id, 3, v_shape, v_str);
  DLTensor to = mqa_byoc_cuda_view(out, half_t, device_id, 3, o_shape, o_str);
  DLTensor tl = mqa_byoc_cuda_view(ws, f32, device_id, 2, l_shape, l_str);
  DLTensor tcq = mqa_byoc_cuda_view(const_cast<int32_t*>(qo_indptr), i32, device_id, 1, c_shape, c_str);
  DLTensor tck = mqa_byoc_cuda_view(const_cast<int32_t*>(kv_indptr), i32, device_id, 1, c_shape, c_str);
  TVMFFIAny args[8] = {mqa_byoc_tensor_arg(&tq),  mqa_byoc_tensor_arg(&tk), mqa_byoc_tensor_arg(&tv),
                       mqa_byoc_tensor_arg(&to),  mqa_byoc_tensor_arg(&tl), {},
                       mqa_byoc_tensor_arg(&tcq), mqa_byoc_tensor_arg(&tck)};
  args[5] = mqa_byoc_float_arg(scale);
  TVMFFIAny result = mqa_byoc_none_result();
  int rc = fa4(nullptr, args, 8, &result);
  if (rc == 0 && lse != nullptr) {
    const int64_t n = total_q * num_heads;
    lse_to_tvm<<<unsigned((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const float*>(ws), total_q, int(num_heads), lse);
  }
  const cudaError_t err = rc == 0 ? cudaGetLastError() : cudaSuccess;
  cudaFreeAsync(ws, static_cast<cudaStream_t>(stream));
  if (rc != 0) return -1;
  if (err != cudaSuccess) {
    mqa_byoc_fa2_fail(cudaGetErrorString(err));
    return -2;
  }
  return 0;
}

}  // extern "C"
