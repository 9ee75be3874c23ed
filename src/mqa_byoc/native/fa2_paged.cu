// mqa_byoc FA2 attention over TVM's PagedKVCache pages (C API in fa2_paged.h).
//
// TVM's runtime hands its attention functions a CSR page list (page_indptr, page_values), the
// last-page lengths and a base-2 LSE output; FA2's split-KV kernel wants a padded block table, K
// lengths and writes a natural-log LSE. Two small kernels here bridge that (a third merges attention
// states in place of TVM's TIR merge); the attention itself is
// one of the FA2 kernel entries compiled from fa2_kernel_entry.cu (referenced weakly, as
// fa2_dispatch.cc does, so a library linked without one fails with a message, not a link error).
//
// Compiled by mqa_byoc.compiler.paged.build with nvcc for the target arch (it holds device code).

#include "fa2_paged.h"

#include "fa2_dispatch.h"
#include "lse_rule.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flash.h"  // flash-attn's Flash_fwd_params

namespace {
using Params = FLASH_NAMESPACE::Flash_fwd_params;
using EntryFn = void (*)(Params*, cudaStream_t);

thread_local std::string g_error;
int fail(const std::string& m) {
  g_error = m;
  return 1;
}

// The kernel families, workspace pool, SM count and split rule are the dispatcher's (fa2_dispatch.h):
// one definition of each, and the same split-KV behaviour as the fixed-length attention.
int kernel_hdim(int64_t d) { return mqa_byoc_fa2_kernel_hdim(d); }

EntryFn entry(int hdim, int is_bf16, bool causal, bool split) {
  return reinterpret_cast<EntryFn>(mqa_byoc_fa2_entry(hdim, is_bf16, causal ? 1 : 0, split ? 1 : 0));
}

std::string family(int hdim, int is_bf16, bool causal, bool split) {
  return std::string("hdim") + std::to_string(hdim) + (is_bf16 ? " bf16" : " fp16") +
         (causal ? " causal" : "") + (split ? " split" : "");
}

int not_built(int hdim, int is_bf16, bool causal, bool split) {
  return fail("FA2 kernel " + family(hdim, is_bf16, causal, split) +
              " is not linked into this library: run `mqa-byoc build-kernels --head-dims " +
              std::to_string(hdim) + " --dtypes " + (is_bf16 ? "bf16" : "fp16") +
              "` and export again with mqa_byoc.export_library");
}

// Stream-ordered workspace from the dispatcher's pool. 0 on success.
int alloc(void** ptr, size_t bytes, int device, cudaStream_t stream) {
  if (mqa_byoc_fa2_alloc_workspace(ptr, bytes, device, stream) == 0) return 0;
  *ptr = nullptr;
  return fail(mqa_byoc_fa2_last_error());
}

int num_sms(int device) { return mqa_byoc_fa2_num_sms(device); }

int num_splits(int64_t work, int sms, int n_blocks) { return mqa_byoc_fa2_num_splits(work, sms, n_blocks); }

// The per-element rules of the two bridging kernels, shared with their host twins below (which the
// CPU tests check against NumPy): one copy of each fact.
//
// A sequence's K/V length from its page count and last-page length (TVM's _get_kv_chunk_len).
__host__ __device__ inline int32_t kv_length(int32_t n_pages, int32_t page_size, int32_t last_page_len) {
  return n_pages > 0 ? (n_pages - 1) * page_size + last_page_len : 0;
}

// FA2's natural-log LSE -> TVM's base-2 LSE (lse_rule.h: FA2 marks a row without keys with +inf; TVM's
// kernels write -5e4 there).
__host__ __device__ inline float lse_base2(float v) { return mqa_byoc_lse_base2(v); }

// TVM's merge of two attention states (base-2 LSEs s, s_other): the weights of each state's V and
// the merged LSE. A state with -inf (or TVM's empty -5e4 against a real one) gets weight 0; when both
// are -inf no state has keys: weights 0 and LSE -inf (TVM's formula would give NaN there).
struct MergeWeights {
  float w, w_other, s;
};
__host__ __device__ inline MergeWeights merge_weights(float s, float s_other) {
  const float m = fmaxf(s, s_other);
  if (isinf(m) && m < 0.f) return {0.f, 0.f, -INFINITY};
  const float a = exp2f(s - m), b = exp2f(s_other - m);
  return {a / (a + b), b / (a + b), log2f(a + b) + m};
}
// One merged V element; a state without weight contributes nothing even if its V is not finite.
__host__ __device__ inline float merge_value(const MergeWeights& m, float v, float v_other) {
  return (m.w == 0.f ? 0.f : m.w * v) + (m.w_other == 0.f ? 0.f : m.w_other * v_other);
}

// CSR page list -> padded block table (batch, stride), per-sequence K/V lengths and "no K/V" flags.
// One CTA per sequence; entries past a sequence's pages are never read (FA2 stops at its K length).
// A sequence without pages is given one key of page 0 and flagged: FA2's split kernel, on a sequence
// without keys, writes its LSE at padded offsets (it ignores unpadded_lse on that early exit), outside
// our var-len LSE buffer; finish_rows then zeroes those rows' output and gives them TVM's empty LSE.
__global__ void csr_to_block_table(const int32_t* __restrict__ page_indptr,
                                   const int32_t* __restrict__ page_values,
                                   const int32_t* __restrict__ last_page_len, int page_size, int stride,
                                   int32_t* __restrict__ table, int32_t* __restrict__ seqlens_k,
                                   int32_t* __restrict__ empty) {
  const int b = blockIdx.x;
  const int start = page_indptr[b], n = page_indptr[b + 1] - start;
  for (int i = threadIdx.x; i < n; i += blockDim.x) table[int64_t(b) * stride + i] = page_values[start + i];
  if (threadIdx.x == 0) {
    const int32_t len = kv_length(n, page_size, last_page_len[b]);
    empty[b] = len == 0;
    seqlens_k[b] = len == 0 ? 1 : len;
    if (n == 0) table[int64_t(b) * stride] = 0;
  }
}

// The sequence of row r: r itself for decode (qo_indptr null), else the b with indptr[b] <= r < indptr[b+1].
__device__ inline int seq_of_row(const int32_t* __restrict__ qo_indptr, int batch, int64_t r) {
  if (qo_indptr == nullptr) return int(r);
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qo_indptr[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// LSE element (r, h) at r * row_stride + h * head_stride -> TVM's compact (rows, heads), base 2; rows of
// a sequence flagged empty get TVM's empty LSE and a zero output row (out: row / head strides, D elements).
template <typename T>
__global__ void finish_rows(const float* __restrict__ in, int64_t rows, int heads, int64_t row_stride,
                            int64_t head_stride, float* __restrict__ lse, const int32_t* __restrict__ empty,
                            const int32_t* __restrict__ qo_indptr, int batch, T* __restrict__ out,
                            int64_t o_row_stride, int64_t o_head_stride, int head_dim) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * heads) return;
  const int64_t r = i / heads, h = i % heads;
  if (empty != nullptr && empty[seq_of_row(qo_indptr, batch, r)]) {
    lse[i] = lse_base2(INFINITY);
    T* o = out + r * o_row_stride + h * o_head_stride;
    for (int d = 0; d < head_dim; ++d) o[d] = T(0.f);
    return;
  }
  lse[i] = lse_base2(in[r * row_stride + h * head_stride]);
}

__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// One warp per (row, head) of v (rows, heads, D): every pair is covered, whatever H is (TVM 0.27's TIR
// merge sizes its grid by H / its block's heads, rounded down, and leaves the remaining heads out).
template <typename T>
__global__ void merge_states(T* __restrict__ v, float* __restrict__ s, const T* __restrict__ v_other,
                             const float* __restrict__ s_other, int64_t rows, int heads, int head_dim,
                             int64_t v_row, int64_t v_head, int64_t s_row, int64_t s_head, int64_t vo_row,
                             int64_t vo_head, int64_t so_row, int64_t so_head) {
  const int64_t pair = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= rows * heads) return;
  const int64_t r = pair / heads, h = pair % heads;
  float* sp = s + r * s_row + h * s_head;
  const MergeWeights m = merge_weights(*sp, s_other[r * so_row + h * so_head]);
  T* vp = v + r * v_row + h * v_head;
  const T* op = v_other + r * vo_row + h * vo_head;
  for (int d = lane; d < head_dim; d += 32) vp[d] = T(merge_value(m, to_float(vp[d]), to_float(op[d])));
  __syncwarp();  // every lane has read *sp before lane 0 overwrites it
  if (lane == 0) *sp = m.s;
}

struct Workspace {
  void* ptr = nullptr;
  cudaStream_t stream = nullptr;
  ~Workspace() {
    if (ptr != nullptr) cudaFreeAsync(ptr, stream);
  }
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// TVM keeps the exact per-sequence lengths on the host only and passes the device CSR (qo_indptr), so
// the var-len grids are sized by total_q, a bound of every sequence: FA2 launches ceil(total_q / 128)
// row blocks for each (sequence, head), and at batch B about (B - 1) / B of them exit at once. Where
// those empty blocks cost more than a synchronizing read of the B + 1 offsets (about 65k of them), the
// longest sequence is read back instead; never while the stream is being captured into a CUDA graph.
constexpr int64_t kReadBackWastedBlocks = 1 << 16;

bool worth_reading_back(int64_t batch, int64_t heads, int64_t total_q) {
  return batch >= 2 && (batch - 1) * heads * ((total_q + 127) / 128) >= kReadBackWastedBlocks;
}

// The longest sequence of the device offsets `indptr` (batch + 1 int32 into `total` rows), or -1 when
// they are not read (graph capture, a failed copy, offsets that do not fit: the caller keeps its bound).
int64_t longest_sequence(const int32_t* indptr, int64_t batch, int64_t total, cudaStream_t stream) {
  if (indptr == nullptr) return -1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return -1;
  }
  thread_local std::vector<int32_t> host;
  host.resize(size_t(batch) + 1);
  if (cudaMemcpyAsync(host.data(), indptr, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream) !=
          cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = int64_t(host[b + 1]) - host[b];
    if (n < 0 || host[b + 1] > total) return -1;  // not offsets of these rows: keep the bound
    longest = std::max(longest, n);
  }
  return longest;
}

int check_common(int64_t num_heads, int64_t num_heads_k, int64_t head_dim, int64_t batch, int64_t total_q,
                 float softmax_scale) {
  if (!mqa_byoc_scale_ok(softmax_scale)) return fail(MQA_BYOC_SCALE_ERROR);
  if (num_heads <= 0 || num_heads_k <= 0 || num_heads % num_heads_k != 0) {
    return fail("H=" + std::to_string(num_heads) + " is not a positive multiple of H_kv=" +
                std::to_string(num_heads_k));
  }
  if (head_dim <= 0 || head_dim > 256 || head_dim % 8 != 0) {
    return fail("FA2 needs a head dim that is a multiple of 8 and at most 256, got " + std::to_string(head_dim));
  }
  if (batch < 0 || total_q < 0 || batch > INT_MAX || total_q > INT_MAX) return fail("bad batch / row count");
  return 0;
}

void fill_common(Params& p, int is_bf16, int64_t batch, int64_t h, int64_t h_k, int64_t seqlen_q,
                 int64_t seqlen_k, int64_t head_dim, float scale, bool causal) {
  p.is_bf16 = is_bf16 != 0;
  p.b = int(batch);
  p.h = int(h);
  p.h_k = int(h_k);
  p.h_h_k_ratio = int(h / h_k);
  p.seqlen_q = int(seqlen_q);
  p.seqlen_k = int(seqlen_k);
  p.seqlen_q_rounded = int((seqlen_q + 127) / 128 * 128);
  p.seqlen_k_rounded = int((seqlen_k + 127) / 128 * 128);
  p.d = int(head_dim);
  p.d_rounded = int(head_dim <= 128 ? (head_dim + 31) / 32 * 32 : (head_dim + 63) / 64 * 64);
  p.scale_softmax = scale;
  p.scale_softmax_log2 = float(double(scale) * 1.4426950408889634);
  p.p_dropout = 1.f;
  p.p_dropout_in_uint8_t = 255;
  p.rp_dropout = 1.f;
  p.scale_softmax_rp_dropout = scale;
  p.softcap = 0.f;
  p.is_causal = causal;
  // flash-attn's window form of the causal mask: (-1, 0) -> (seqlen_k, 0); no window: (-1, -1)
  p.window_size_left = causal ? int(seqlen_k) : -1;
  p.window_size_right = causal ? 0 : -1;
  p.seqlenq_ngroups_swapped = false;
}

int launch(EntryFn fn, Params* p, cudaStream_t stream, const std::string& what) {
  fn(p, stream);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail(what + " launch failed: " + cudaGetErrorString(err));
}

// Launches finish_rows for this call's rows (empty / qo_indptr null: no sequence without keys / decode).
int finish(const float* in, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, float* lse,
           const int32_t* empty, const int32_t* qo_indptr, int64_t batch, void* out, const int64_t* o_stride,
           int64_t head_dim, int is_bf16, cudaStream_t stream) {
  const int64_t n = rows * heads;
  if (n == 0) return 0;
  const unsigned grid = unsigned((n + 255) / 256);
  if (is_bf16) {
    finish_rows<__nv_bfloat16><<<grid, 256, 0, stream>>>(in, rows, int(heads), row_stride, head_stride, lse, empty,
                                                         qo_indptr, int(batch), static_cast<__nv_bfloat16*>(out),
                                                         o_stride[0], o_stride[1], int(head_dim));
  } else {
    finish_rows<__half><<<grid, 256, 0, stream>>>(in, rows, int(heads), row_stride, head_stride, lse, empty, qo_indptr,
                                                  int(batch), static_cast<__half*>(out), o_stride[0], o_stride[1],
                                                  int(head_dim));
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail(std::string("LSE conversion launch failed: ") + cudaGetErrorString(err));
}

struct DeviceGuard {
  int prev = -1;
  bool changed = false;
  int set(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) return fail("cudaGetDevice failed");
    if (prev != device) {
      if (cudaSetDevice(device) != cudaSuccess) return fail("cannot select CUDA device " + std::to_string(device));
      changed = true;
    }
    cudaGetLastError();
    return 0;
  }
  ~DeviceGuard() {
    if (changed) cudaSetDevice(prev);
  }
};

}  // namespace

extern "C" const char* mqa_byoc_fa2_paged_last_error(void) { return g_error.c_str(); }


// Host twins of the two bridging kernels (same per-element rules), for the CPU tests (exported so
// that a test can load them with ctypes).
#define MQA_BYOC_PAGED_EXPORT __attribute__((visibility("default")))
extern "C" MQA_BYOC_PAGED_EXPORT void mqa_byoc_fa2_paged_host_block_table(
    const int32_t* page_indptr, const int32_t* page_values, const int32_t* last_page_len, int64_t batch,
    int page_size, int stride, int32_t* table, int32_t* seqlens_k, int32_t* empty) {
  for (int64_t b = 0; b < batch; ++b) {
    const int start = page_indptr[b], n = page_indptr[b + 1] - start;
    for (int i = 0; i < n; ++i) table[b * stride + i] = page_values[start + i];
    const int32_t len = kv_length(n, page_size, last_page_len[b]);
    empty[b] = len == 0;
    seqlens_k[b] = len == 0 ? 1 : len;
    if (n == 0) table[b * stride] = 0;
  }
}

extern "C" MQA_BYOC_PAGED_EXPORT void mqa_byoc_fa2_paged_host_lse(const float* in, int64_t rows, int heads, int64_t row_stride,
                                            int64_t head_stride, float* out) {
  for (int64_t i = 0; i < rows * heads; ++i) out[i] = lse_base2(in[(i / heads) * row_stride + (i % heads) * head_stride]);
}

extern "C" MQA_BYOC_PAGED_EXPORT void mqa_byoc_fa2_paged_host_merge(float* v, float* s, const float* v_other,
                                                                     const float* s_other, int64_t rows,
                                                                     int64_t num_heads, int64_t head_dim) {
  for (int64_t i = 0; i < rows * num_heads; ++i) {
    const MergeWeights m = merge_weights(s[i], s_other[i]);
    float* vi = v + i * head_dim;
    const float* oi = v_other + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) vi[d] = merge_value(m, vi[d], oi[d]);
    s[i] = m.s;
  }
}

extern "C" int mqa_byoc_fa2_paged_merge_state(void* v, float* s, const void* v_other, const float* s_other,
                                              int64_t rows, int64_t num_heads, int64_t head_dim,
                                              const int64_t* v_stride, const int64_t* s_stride,
                                              const int64_t* vo_stride, const int64_t* so_stride, int is_bf16,
                                              int device_id, void* stream_handle) {
  g_error.clear();
  if (rows < 0 || num_heads <= 0 || num_heads > INT_MAX || head_dim <= 0 || head_dim > INT_MAX) {
    return fail("merge_state: bad shape (rows " + std::to_string(rows) + ", heads " + std::to_string(num_heads) +
                ", head dim " + std::to_string(head_dim) + ")");
  }
  if (v_stride[2] != 1 || vo_stride[2] != 1) return fail("merge_state: v and v_other need a contiguous head-dim axis");
  const int64_t pairs = rows * num_heads;
  if (pairs == 0) return 0;
  if ((pairs + 7) / 8 > INT_MAX) return fail("merge_state: too many rows");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard;
  if (int rc = guard.set(device_id)) return rc;
  const unsigned grid = unsigned((pairs + 7) / 8);  // 8 warps of 256 threads, one (row, head) each
  if (is_bf16) {
    merge_states<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        static_cast<__nv_bfloat16*>(v), s, static_cast<const __nv_bfloat16*>(v_other), s_other, rows, int(num_heads),
        int(head_dim), v_stride[0], v_stride[1], s_stride[0], s_stride[1], vo_stride[0], vo_stride[1], so_stride[0],
        so_stride[1]);
  } else {
    merge_states<__half><<<grid, 256, 0, stream>>>(
        static_cast<__half*>(v), s, static_cast<const __half*>(v_other), s_other, rows, int(num_heads), int(head_dim),
        v_stride[0], v_stride[1], s_stride[0], s_stride[1], vo_stride[0], vo_stride[1], so_stride[0], so_stride[1]);
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail(std::string("merge_state launch failed: ") + cudaGetErrorString(err));
}

extern "C" int mqa_byoc_fa2_paged_page_unit(int64_t head_dim) {
  const int hd = kernel_hdim(head_dim);
  if (hd < 0 || head_dim <= 0) return -1;
  return hd <= 64 ? 256 : (hd <= 128 ? 128 : 64);  // run_mha_fwd_splitkv_dispatch's kBlockN
}

extern "C" int mqa_byoc_fa2_paged_forward(const void* q, const int32_t* qo_indptr, const void* pages,
                                          const int32_t* page_indptr, const int32_t* page_values,
                                          const int32_t* last_page_len, void* out, float* lse,
                                          int64_t batch, int64_t total_q, int64_t nnz_pages,
                                          int64_t page_size, int64_t num_heads, int64_t num_heads_k,
                                          int64_t head_dim, const int64_t* q_stride,
                                          const int64_t* page_stride, const int64_t* o_stride,
                                          int is_bf16, float softmax_scale, int causal, int device_id,
                                          void* stream_handle) {
  g_error.clear();
  if (int rc = check_common(num_heads, num_heads_k, head_dim, batch, total_q, softmax_scale)) return rc;
  const int unit = mqa_byoc_fa2_paged_page_unit(head_dim);
  if (page_size <= 0 || page_size % unit != 0) {
    return fail("page size " + std::to_string(page_size) + " is not a multiple of " + std::to_string(unit) +
                ": FA2's split-KV kernel reads K/V tiles of " + std::to_string(unit) + " rows (head dim " +
                std::to_string(head_dim) + ") from one page");
  }
  if (q_stride[2] != 1 || o_stride[2] != 1 || page_stride[4] != 1) return fail("q, out and pages need a contiguous head-dim axis");
  if (qo_indptr == nullptr && total_q != batch) return fail("decode needs one query row per sequence");
  if (batch == 0 || total_q == 0) return 0;
  if (nnz_pages < 0 || nnz_pages * page_size > INT_MAX) return fail("bad page count " + std::to_string(nnz_pages));
  const int64_t stride = std::max<int64_t>(nnz_pages, 1);  // a sequence has at most all the pages (or one fake)

  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard;
  if (int rc = guard.set(device_id)) return rc;

  const bool decode = qo_indptr == nullptr;
  if (decode && mqa_byoc_fa2_own_decode_fits(head_dim, num_heads, num_heads_k, batch)) {
    // our grouped-query decode kernel reads the pages through the CSR list itself (no block table)
    mqa_byoc_decode_args a{};
    const char* base = static_cast<const char*>(pages);
    a.q = q, a.k = base, a.v = base + page_stride[1] * 2, a.out = out, a.lse = lse;
    a.q_stride[0] = q_stride[0], a.q_stride[1] = q_stride[1];
    a.o_stride[0] = o_stride[0], a.o_stride[1] = o_stride[1];
    a.k_stride[0] = a.v_stride[0] = page_stride[0];  // (page, row in page, head)
    a.k_stride[1] = a.v_stride[1] = page_stride[3];
    a.k_stride[2] = a.v_stride[2] = page_stride[2];
    a.page_indptr = page_indptr, a.page_values = page_values, a.last_page_len = last_page_len;
    a.page_size = page_size, a.nnz_pages = nnz_pages;
    a.batch = batch, a.num_heads = num_heads, a.num_heads_k = num_heads_k, a.head_dim = head_dim;
    a.is_bf16 = is_bf16, a.softmax_scale = softmax_scale, a.window_left = -1;
    a.lse_empty = -5e4f;  // TVM's "no keys" LSE
    if (mqa_byoc_fa2_own_decode(&a, device_id, stream) != 0) return fail(mqa_byoc_fa2_last_error());
    return 0;
  }
  MqaByocNvtxRange range("flash_attn_paged[h=%lld,kv=%lld,d=%lld]", num_heads, num_heads_k, head_dim);
  const bool is_causal = causal != 0 && !decode;
  const int hdim = kernel_hdim(head_dim);
  const EntryFn split_fn = entry(hdim, is_bf16, is_causal, true);
  if (split_fn == nullptr) return not_built(hdim, is_bf16, is_causal, true);

  // Decode with grouped K/V: view the H query heads of a sequence as g = H / H_kv query rows of
  // H_kv heads (flash-attn's own decode trick): one K/V tile serves the whole group.
  const int64_t g = num_heads / num_heads_k;
  const bool swap = decode && g > 1;
  const int64_t h = swap ? num_heads_k : num_heads;
  const int64_t longest_q =
      !decode && worth_reading_back(batch, h, total_q) ? longest_sequence(qo_indptr, batch, total_q, stream) : -1;
  // total_q bounds every sequence's rows (or the longest, read back)
  const int64_t sq = decode ? (swap ? g : 1) : (longest_q > 0 ? longest_q : total_q);
  const int64_t seqlen_k_bound = stride * page_size;      // bounds every sequence's K length

  Params p{};
  fill_common(p, is_bf16, batch, h, num_heads_k, sq, seqlen_k_bound, head_dim, softmax_scale, is_causal);
  p.q_ptr = const_cast<void*>(q);
  p.o_ptr = out;
  if (decode) {
    p.q_batch_stride = q_stride[0];
    p.o_batch_stride = o_stride[0];
    p.q_row_stride = swap ? q_stride[1] : q_stride[0];
    p.o_row_stride = swap ? o_stride[1] : o_stride[0];
    p.q_head_stride = swap ? q_stride[1] * g : q_stride[1];
    p.o_head_stride = swap ? o_stride[1] * g : o_stride[1];
  } else {
    p.cu_seqlens_q = const_cast<int*>(reinterpret_cast<const int*>(qo_indptr));
    p.q_row_stride = q_stride[0];
    p.q_head_stride = q_stride[1];
    p.o_row_stride = o_stride[0];
    p.o_head_stride = o_stride[1];
    p.total_q = int(total_q);
    p.unpadded_lse = true;  // (H, total_q)
  }
  const char* base = static_cast<const char*>(pages);
  const size_t elem = 2;
  p.k_ptr = const_cast<char*>(base);
  p.v_ptr = const_cast<char*>(base + page_stride[1] * elem);
  p.k_batch_stride = p.v_batch_stride = page_stride[0];  // one "batch" of FA2's cache = one page
  p.k_head_stride = p.v_head_stride = page_stride[2];
  p.k_row_stride = p.v_row_stride = page_stride[3];
  p.page_block_size = int(page_size);
  p.block_table_batch_stride = stride;
  p.is_seqlens_k_cumulative = false;       // cu_seqlens_k holds each sequence's K length

  const int n_blocks = int((seqlen_k_bound + unit - 1) / unit);
  const int64_t m_blocks = (sq + 63) / 64;
  // Prefill keeps one split (the var-len LSE path of the split kernel); decode splits K/V to fill the GPU.
  // FA2 cuts [0, seqlen_k) into equal splits, and our seqlen_k is the bound (all the call's pages), about
  // `batch` times a mean sequence: choose the split count for a mean sequence, then multiply it by
  // bound / mean so that each split still covers about the intended share of a sequence (splits past a
  // sequence's end exit at once and the combine kernel weighs them zero).
  int splits = 1;
  if (decode) {
    const int mean_blocks = int(std::max<int64_t>(1, (n_blocks + batch - 1) / batch));
    splits = num_splits(batch * h * m_blocks, num_sms(device_id) * 2, mean_blocks);
    if (splits > 1) splits = int(std::min<int64_t>(128, int64_t(splits) * ((n_blocks + mean_blocks - 1) / mean_blocks)));
  }
  p.num_splits = splits;

  const size_t rows = size_t(batch) * size_t(h) * size_t(sq);  // split accumulators: padded (b, h, sq)
  // LSE: decode (B, H); var-len prefill (H, total_q), except that a causal call may leave rows without
  // keys, whose LSE FA2 writes at padded offsets (TVM 0.27 calls the paged prefill non-causal only)
  const size_t lse_rows = decode || is_causal ? rows : size_t(num_heads) * size_t(total_q);
  const size_t table_bytes = align256(size_t(batch) * size_t(stride) * 4);
  const size_t seqlen_bytes = align256(size_t(batch) * 4) * 2;  // K lengths, then the "no K/V" flags
  const size_t lse_bytes = align256(lse_rows * 4);
  const size_t lse_acc_bytes = splits > 1 ? align256(size_t(splits) * rows * 4) : 0;
  const size_t o_acc_bytes = splits > 1 ? align256(size_t(splits) * rows * size_t(p.d_rounded) * 4) : 0;
  Workspace ws;
  ws.stream = stream;
  if (int rc = alloc(&ws.ptr, table_bytes + seqlen_bytes + lse_bytes + lse_acc_bytes + o_acc_bytes, device_id, stream)) {
    return rc;
  }
  cudaError_t err;
  char* w = static_cast<char*>(ws.ptr);
  int32_t* table = reinterpret_cast<int32_t*>(w);
  int32_t* seqlens_k = reinterpret_cast<int32_t*>(w + table_bytes);
  int32_t* empty = seqlens_k + seqlen_bytes / 8;
  float* lse_nat = reinterpret_cast<float*>(w + table_bytes + seqlen_bytes);
  p.block_table = table;
  p.cu_seqlens_k = seqlens_k;
  p.softmax_lse_ptr = lse_nat;
  if (splits > 1) {
    p.softmax_lseaccum_ptr = w + table_bytes + seqlen_bytes + lse_bytes;
    p.oaccum_ptr = w + table_bytes + seqlen_bytes + lse_bytes + lse_acc_bytes;
  }

  csr_to_block_table<<<unsigned(batch), 128, 0, stream>>>(page_indptr, page_values, last_page_len, int(page_size),
                                                          int(stride), table, seqlens_k, empty);
  if ((err = cudaGetLastError()) != cudaSuccess) return fail(std::string("block table launch failed: ") + cudaGetErrorString(err));
  if (is_causal && !decode) {  // rows a causal mask leaves without keys keep NaN here: finish gives them -5e4
    if ((err = cudaMemsetAsync(lse_nat, 0xFF, lse_bytes, stream)) != cudaSuccess) {
      return fail(std::string("cudaMemsetAsync: ") + cudaGetErrorString(err));
    }
  }
  if (int rc = launch(split_fn, &p, stream, "FA2 paged " + family(hdim, is_bf16, is_causal, true))) return rc;
  // LSE: decode writes (B, h, sq) = (B, H) row-major (also when swapped); prefill (H, total_q).
  return decode ? finish(lse_nat, batch, num_heads, num_heads, 1, lse, empty, nullptr, batch, out, o_stride, head_dim,
                         is_bf16, stream)
                : finish(lse_nat, total_q, num_heads, 1, total_q, lse, empty, qo_indptr, batch, out, o_stride, head_dim,
                         is_bf16, stream);
}

extern "C" int mqa_byoc_fa2_ragged_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                                           const int32_t* qo_indptr, const int32_t* kv_indptr, int64_t batch,
                                           int64_t total_q, int64_t total_k, int64_t num_heads,
                                           int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                                           const int64_t* k_stride, const int64_t* v_stride,
                                           const int64_t* o_stride, int is_bf16, float softmax_scale,
                                           int causal, int device_id, void* stream_handle) {
  g_error.clear();
  if (int rc = check_common(num_heads, num_heads_k, head_dim, batch, total_q, softmax_scale)) return rc;
  if (total_k < 0 || total_k > INT_MAX) return fail("bad K/V row count");
  if (q_stride[2] != 1 || k_stride[2] != 1 || v_stride[2] != 1 || o_stride[2] != 1) {
    return fail("q, k, v and out need a contiguous head-dim axis");
  }
  if (batch == 0 || total_q == 0) return 0;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard;
  if (int rc = guard.set(device_id)) return rc;
  MqaByocNvtxRange range("flash_attn_ragged[h=%lld,kv=%lld,d=%lld]", num_heads, num_heads_k, head_dim);
  const bool is_causal = causal != 0;
  const int hdim = kernel_hdim(head_dim);
  EntryFn fn = entry(hdim, is_bf16, is_causal, false);
  if (fn == nullptr) fn = entry(hdim, is_bf16, is_causal, true);
  if (fn == nullptr) return not_built(hdim, is_bf16, is_causal, false);

  // total_q / total_k bound every sequence's lengths (TVM keeps the exact ones on the host only).
  // ... or the longest sequences, read back where the bound's empty row blocks would cost more
  const bool worth = worth_reading_back(batch, num_heads, total_q);
  const int64_t longest_q = worth ? longest_sequence(qo_indptr, batch, total_q, stream) : -1;
  const int64_t longest_k = longest_q > 0 ? longest_sequence(kv_indptr, batch, total_k, stream) : -1;
  const bool read_back = longest_q > 0 && longest_k > 0;
  Params p{};
  fill_common(p, is_bf16, batch, num_heads, num_heads_k, read_back ? longest_q : total_q,
              std::max<int64_t>(read_back ? longest_k : total_k, 1), head_dim, softmax_scale, is_causal);
  p.q_ptr = const_cast<void*>(q);
  p.k_ptr = const_cast<void*>(k);
  p.v_ptr = const_cast<void*>(v);
  p.o_ptr = out;
  p.q_row_stride = q_stride[0];
  p.q_head_stride = q_stride[1];
  p.k_row_stride = k_stride[0];
  p.k_head_stride = k_stride[1];
  p.v_row_stride = v_stride[0];
  p.v_head_stride = v_stride[1];
  p.o_row_stride = o_stride[0];
  p.o_head_stride = o_stride[1];
  p.cu_seqlens_q = const_cast<int*>(reinterpret_cast<const int*>(qo_indptr));
  p.cu_seqlens_k = const_cast<int*>(reinterpret_cast<const int*>(kv_indptr));
  p.is_seqlens_k_cumulative = true;
  p.total_q = int(total_q);
  p.unpadded_lse = true;
  p.num_splits = 1;

  Workspace ws;
  ws.stream = stream;
  if (int rc = alloc(&ws.ptr, align256(size_t(num_heads) * size_t(total_q) * 4), device_id, stream)) return rc;
  p.softmax_lse_ptr = ws.ptr;
  if (int rc = launch(fn, &p, stream, "FA2 ragged " + family(hdim, is_bf16, is_causal, false))) return rc;
  return finish(static_cast<const float*>(ws.ptr), total_q, num_heads, 1, total_q, lse, nullptr, qo_indptr, batch,
                out, o_stride, head_dim, is_bf16, stream);
}
