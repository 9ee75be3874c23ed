// C API of mqa_byoc's FA2 attention over TVM's PagedKVCache (fa2_paged.cu).
//
// The TVM-FFI wrappers emitted by mqa_byoc.compiler.paged.codegen repeat these declarations (TVM
// compiles them without our include path); keep the two in sync.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Attention of query rows over K/V held in TVM's pages, through FA2's split-KV kernel with a block table.
//   q (total_q, H, D) and out (total_q, H, D): *_stride = 3 strides (row, head, dim) in elements.
//   qo_indptr: device int32 (batch + 1) cumulative query rows; NULL = decode, one row per sequence.
//   pages: (num_pages, 2, H_kv, page_size, D) (TVM's layout; index 0 of axis 1 is K, 1 is V);
//     page_stride = its 5 strides in elements.
//   page_indptr (batch + 1), page_values (nnz_pages), last_page_len (batch): device int32, TVM's CSR
//     page list; a sequence's K/V length is (its pages - 1) * page_size + last_page_len (0 without pages).
//   lse: device float32 (total_q, H), compact; receives TVM's base-2 log-sum-exp of the scaled scores
//     (-5e4, TVM's own "empty" value, and a zero output row, for a sequence without K/V).
//   causal: bottom-right aligned per sequence (TVM's and FA2's rule alike); it needs every sequence's
//     K/V length >= its query rows (TVM appends before a causal paged attention, so it always is).
//   page_size must be a multiple of mqa_byoc_fa2_paged_page_unit(head_dim) (FA2 reads a K/V tile of
//   that many rows from one page).
// Returns 0, or nonzero with mqa_byoc_fa2_paged_last_error().
int mqa_byoc_fa2_paged_forward(const void* q, const int32_t* qo_indptr, const void* pages,
                               const int32_t* page_indptr, const int32_t* page_values,
                               const int32_t* last_page_len, void* out, float* lse, int64_t batch,
                               int64_t total_q, int64_t nnz_pages, int64_t page_size, int64_t num_heads,
                               int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                               const int64_t* page_stride, const int64_t* o_stride, int is_bf16,
                               float softmax_scale, int causal, int device_id, void* stream);

// Ragged (var-len) attention: q (total_q, H, D), k and v (total_k, H_kv, D), out (total_q, H, D);
// qo_indptr / kv_indptr: device int32 (batch + 1) cumulative lengths; lse as above.
int mqa_byoc_fa2_ragged_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                                const int32_t* qo_indptr, const int32_t* kv_indptr, int64_t batch,
                                int64_t total_q, int64_t total_k, int64_t num_heads, int64_t num_heads_k,
                                int64_t head_dim, const int64_t* q_stride, const int64_t* k_stride,
                                const int64_t* v_stride, const int64_t* o_stride, int is_bf16,
                                float softmax_scale, int causal, int device_id, void* stream);

// In-place merge of two attention states (TVM's merge_state: the ragged self-attention of new tokens
// and the paged attention over their prefix), for every (row, head) of v (rows, H, D):
//   v = (2^s v + 2^s_other v_other) / (2^s + 2^s_other), s = log2(2^s + 2^s_other) (base-2 LSE).
//   v, v_other: *_stride = 3 strides (row, head, dim) in elements, dim contiguous; s, s_other: float32
//   (rows, H) with s*_stride = 2 strides. A state with LSE -inf or TVM's empty -5e4 against a real one
//   gets no weight; a row whose two states both have -inf gets v = 0, s = -inf.
// Replaces TVM 0.27's TIR merge kernel, which leaves heads out when H is not a multiple of its block.
int mqa_byoc_fa2_paged_merge_state(void* v, float* s, const void* v_other, const float* s_other, int64_t rows,
                                   int64_t num_heads, int64_t head_dim, const int64_t* v_stride,
                                   const int64_t* s_stride, const int64_t* vo_stride, const int64_t* so_stride,
                                   int is_bf16, int device_id, void* stream);

// The page-size unit of head dim d: the kBlockN of FA2's split-KV kernel (256 for d <= 64, 128 for
// d <= 128, 64 for d <= 256); -1 for a head dim FA2 has no kernel for.
int mqa_byoc_fa2_paged_page_unit(int64_t head_dim);

// Host twins of the two bridging kernels (same per-element rules; for the CPU tests):
//   CSR page list -> table (batch, stride) (entries past a sequence's pages untouched), K/V lengths and
//   "no K/V" flags (such a sequence gets one key of page 0; its rows are zeroed afterwards);
//   FA2 LSE (element (r, h) at r * row_stride + h * head_stride, natural log) -> compact base-2 LSE.
void mqa_byoc_fa2_paged_host_block_table(const int32_t* page_indptr, const int32_t* page_values,
                                         const int32_t* last_page_len, int64_t batch, int page_size,
                                         int stride, int32_t* table, int32_t* seqlens_k, int32_t* empty);
void mqa_byoc_fa2_paged_host_lse(const float* in, int64_t rows, int heads, int64_t row_stride,
                                 int64_t head_stride, float* out);

// Host twin of the merge kernel's per-(row, head) rule, on float32 compact (rows, H, D) / (rows, H).
void mqa_byoc_fa2_paged_host_merge(float* v, float* s, const float* v_other, const float* s_other, int64_t rows,
                                   int64_t num_heads, int64_t head_dim);

// The message of this thread's last failed call above ("" if none).
const char* mqa_byoc_fa2_paged_last_error(void);

#ifdef __cplusplus
}
#endif
