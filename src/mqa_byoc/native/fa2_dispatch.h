// C API of the mqa_byoc FA2 forward dispatcher (fa2_dispatch.cc).
//
// The codegen's emitted wrappers repeat these declarations (TVM compiles them without our include
// path); keep the two in sync (mqa_byoc/compiler/codegen/native.py).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "gqa_decode.h"

#ifdef __cplusplus
extern "C" {
#endif

// The kernel choices of a library, fixed when it is built (mqa_byoc.build(kernel_options=...),
// mqa_byoc/compiler/kernel_options.py, which defines the one constant below in the library, hidden).
// Each field is 0 for the default. A library built without it (no definition: the weak reference is
// null) runs the defaults. No environment variable changes a kernel.
typedef struct {
  int decode_kernel;  // 0: our grouped-query decode kernel where it serves; 1: FA2 only
  int decode_merge;   // MQA_BYOC_DECODE_MERGE_* (gqa_decode.h): how its splits merge
  int split_combine;  // 0: batch-1 FA2 split-KV through chunks and our combine kernel; 1: FA2's own
  int hopper_fa4;     // hopper provider: 0 FA4 for prefill-sized calls, 1 for every call it can, 2 never
  int gemm_algorithm; // cuBLASLt GEMMs (cublaslt_gemm.cc): 0 measure small-M candidates once, 1 heuristic
  int gemm_gemv;      // GEMMs of one row: 0 CUTLASS's GEMV timed with cuBLASLt's candidates, 1 never, 2 always
  int launch_overlap; // 0 plain launches; sm_90+: 1 our decode kernel and the GEMV launch as programmatic
                      // dependents, 2 the same with the GEMV prefetching its first weight rows into L2
} mqa_byoc_kernel_options;

// The options of this library (all zero when it defines none).
const mqa_byoc_kernel_options* mqa_byoc_fa2_kernel_options(void);

// Flash Attention 2 forward, BSNH layout, destination passing.
//   q (B, S_q, H, D), k and v (B, S_kv, H_kv, D), out (B, S_q, H, D), all fp16 or all bf16.
//   *_stride: 4 strides each (batch, seq, head, dim), in elements; the dim stride must be 1.
//   Query head h reads K/V head h / (H / H_kv).
//   causal: FA2 causal (bottom-right aligned). window_left / window_right: -1 = unbounded.
//   stream: a cudaStream_t on device device_id (NULL = legacy default stream).
// Returns 0 on success; otherwise nonzero and mqa_byoc_fa2_last_error() (this thread) says why.
int mqa_byoc_fa2_forward(const void* q, const void* k, const void* v, void* out,
                         int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads,
                         int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                         const int64_t* k_stride, const int64_t* v_stride, const int64_t* o_stride,
                         int is_bf16, float softmax_scale, int causal, int window_left,
                         int window_right, int device_id, void* stream);

// Attention with sinks: mqa_byoc_fa2_forward, then each row of out scaled by sigmoid(lse - sinks[h]), lse
// the row's log-sum-exp of the scaled scores (the softmax over keys and one sink logit per query head, the
// sink's value zero). sinks (H,) on the device, sinks_dtype 0 float32, 1 float16, 2 bfloat16.
int mqa_byoc_fa2_forward_sink(const void* q, const void* k, const void* v, const void* sinks, int sinks_dtype,
                              void* out, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads,
                              int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                              const int64_t* k_stride, const int64_t* v_stride, const int64_t* o_stride,
                              int is_bf16, float softmax_scale, int causal, int window_left,
                              int window_right, int device_id, void* stream);

// Soft-capped attention (Gemma 2): mqa_byoc_fa2_forward with the scores softcap * tanh(qk * scale / softcap)
// before the mask and the softmax; softcap > 0. Runs the soft-capping kernel families (built with
// `mqa-byoc build-kernels --softcap`); decode runs FA2's split-KV (our decode kernel does not soft-cap).
int mqa_byoc_fa2_forward_softcap(const void* q, const void* k, const void* v, float softcap, void* out,
                                 int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads,
                                 int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                                 const int64_t* k_stride, const int64_t* v_stride, const int64_t* o_stride,
                                 int is_bf16, float softmax_scale, int causal, int window_left,
                                 int window_right, int device_id, void* stream);

// Flash Attention 2 var-len forward (R.nn.attention_var_len): sequences concatenated along the rows.
//   q (total_q, H, D), k and v (total_k, H_kv, D), out (total_q, H, D), all fp16 or all bf16;
//   *_stride: 3 strides each (row, head, dim), in elements; the dim stride must be 1.
//   cu_seqlens_q / cu_seqlens_k: device int32 arrays of batch + 1 cumulative lengths (leading 0).
//   max_seqlen_q / max_seqlen_k: upper bounds of the per-sequence lengths (they size the grid and
//   clamp the window: a bound below a real length leaves rows of that sequence unwritten).
//   causal: bottom-right aligned per sequence; window_left / window_right: -1 = unbounded.
//   Query head h reads K/V head h / (H / H_kv). Returns 0, or nonzero with mqa_byoc_fa2_last_error().
int mqa_byoc_fa2_varlen_forward(const void* q, const void* k, const void* v, void* out,
                                const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, int64_t batch,
                                int64_t total_q, int64_t total_k, int64_t max_seqlen_q,
                                int64_t max_seqlen_k, int64_t num_heads, int64_t num_heads_k,
                                int64_t head_dim, const int64_t* q_stride, const int64_t* k_stride,
                                const int64_t* v_stride, const int64_t* o_stride, int is_bf16,
                                float softmax_scale, int causal, int window_left, int window_right,
                                int device_id, void* stream);

// The message of this thread's last failed mqa_byoc_fa2_forward / _varlen_forward ("" if none).
const char* mqa_byoc_fa2_last_error(void);

// Workspace from the dispatcher's stream-ordered pool (free with cudaFreeAsync on `stream`), the
// device's SM count (0 if unknown), and setting this thread's error message (returns -1): shared with
// fa4_decode.cu.
int mqa_byoc_fa2_alloc_workspace(void** ws, size_t bytes, int device_id, void* stream);
int mqa_byoc_fa2_num_sms(int device_id);
int mqa_byoc_fa2_fail(const char* message);

// For fa2_paged.cu: flash-attn's split-count rule (no split when work >= 0.8 * num_sms, else the fewest
// splits within 85% of the best wave efficiency, at most 128), the FA2 head dim of a head dim (-1 when
// none), and the linked kernel entry of a family (NULL when not linked). The entry takes a
// Flash_fwd_params* and a cudaStream_t.
typedef void (*mqa_byoc_fa2_entry_fn)(void* params, void* stream);
int mqa_byoc_fa2_num_splits(int64_t work, int num_sms, int num_n_blocks);
int mqa_byoc_fa2_kernel_hdim(int64_t head_dim);
mqa_byoc_fa2_entry_fn mqa_byoc_fa2_entry(int hdim, int is_bf16, int causal, int split);

// split_kv_combine.cu (compiled per arch, linked next to the dispatcher): the key count of each of n
// chunks (lens[i] = min(chunk, s_kv - i * chunk)) and the merge of the chunks' outputs o_part (n, h, d)
// by their LSEs lse (n, h) into out (h, d), head stride out_head_stride. 0 on success.
int mqa_byoc_chunk_lengths(int32_t* lens, int n, int64_t chunk, int64_t s_kv, void* stream);
int mqa_byoc_combine_chunks(const void* o_part, const float* lse, void* out, int64_t out_head_stride, int n, int h,
                            int d, int is_bf16, void* stream);

// sink_epilogue.cu (in the support object): out (B, S_q, H, D), strides o_stride (batch, row, head), scaled
// row by row by sigmoid(lse - sinks[h]); lse (B, H, S_q) compact (base 2 when lse_base2). 0 on success.
int mqa_byoc_apply_sinks(void* out, const float* lse, const void* sinks, int sinks_dtype, int64_t batch, int64_t s_q,
                         int64_t h, int64_t d, const int64_t* o_stride, int is_bf16, int lse_base2, void* stream);

// Our grouped-query decode kernel (gqa_decode.cu) behind the dispatcher's checks, workspace pool and NVTX
// range: whether it serves a call (head dim, grouping, batch; the library's decode_kernel option set to FA2 says no), and
// the call (0, or nonzero with mqa_byoc_fa2_last_error()). Shared with fa2_paged.cu.
int mqa_byoc_fa2_own_decode_fits(int64_t head_dim, int64_t num_heads, int64_t num_heads_k, int64_t batch);
int mqa_byoc_fa2_own_decode(const mqa_byoc_decode_args* args, int device_id, void* stream);

// An NVTX range around a call, when MQA_BYOC_NVTX is on (a profiling aid: it changes no kernel): push names it by `format` (a
// "<name>[h=%lld,kv=%lld,d=%lld]" format) and returns 1 when it opened one, which the caller pops.
int mqa_byoc_fa2_nvtx_push(const char* format, int64_t num_heads, int64_t num_heads_k, int64_t head_dim);
void mqa_byoc_fa2_nvtx_pop(void);

// 1 when the kernel family (hdim in {32,64,96,128,192,256}) was linked in, else 0.
int mqa_byoc_fa2_kernel_available(int hdim, int is_bf16, int causal, int split);

#ifdef __cplusplus
}

// mqa_byoc_fa2_nvtx_push/pop for a scope (the dispatcher's calls and fa2_paged.cu's).
class MqaByocNvtxRange {
 public:
  MqaByocNvtxRange(const char* format, int64_t num_heads, int64_t num_heads_k, int64_t head_dim)
      : on_(mqa_byoc_fa2_nvtx_push(format, num_heads, num_heads_k, head_dim) != 0) {}
  ~MqaByocNvtxRange() {
    if (on_) mqa_byoc_fa2_nvtx_pop();
  }
  MqaByocNvtxRange(const MqaByocNvtxRange&) = delete;
  MqaByocNvtxRange& operator=(const MqaByocNvtxRange&) = delete;

 private:
  bool on_;
};
#endif
