// C API of mqa_byoc's grouped-query decode kernel (gqa_decode.cu): one query row per sequence and head,
// K/V from a contiguous cache or from TVM's pages; split-KV and the combine in one launch.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The softmax scales the kernels take: FA2, FA4 and this decode kernel keep the running max of the
// unscaled scores, which is the max of the scaled ones only for a positive scale. 1: a positive, finite
// scale; the entries refuse others with MQA_BYOC_SCALE_ERROR.
static inline int mqa_byoc_scale_ok(float scale) { return scale > 0.f && isfinite(scale); }
#define MQA_BYOC_SCALE_ERROR "softmax scale is not a positive finite value"

typedef struct {
  const void* q;     // (B, H, D): q_stride = (batch, head) in elements, dim contiguous
  const void* k;     // contiguous cache: k_stride = (batch, row, head); pages: (page, row in page, head)
  const void* v;     // as k, v_stride
  void* out;         // (B, H, D): o_stride = (batch, head)
  float* lse;        // NULL, or (B, H) compact: base-2 log-sum-exp of the scaled scores
  int64_t q_stride[2], o_stride[2], k_stride[3], v_stride[3];
  // TVM's CSR page list (device int32), or page_values == NULL for a contiguous cache of seqlen_k keys.
  const int32_t* page_indptr;    // (B + 1)
  const int32_t* page_values;    // (nnz_pages)
  const int32_t* last_page_len;  // (B)
  int64_t page_size, nnz_pages;
  int64_t seqlen_k;
  int64_t batch, num_heads, num_heads_k, head_dim;  // query head h reads K/V head h / (H / H_kv)
  int is_bf16;
  float softmax_scale;
  int window_left;  // -1: every key; else only the last window_left + 1 keys (FA2's window for one row)
  float lse_empty;  // the LSE written for a sequence without keys (its output row is zero)
} mqa_byoc_decode_args;

// How the splits of a (sequence, K/V head) merge. AUTO: in a thread-block cluster through distributed
// shared memory when they are at most 16 and the grid's clusters are co-resident, else GLOBAL: the last
// block to finish merges the partials in the workspace (SharedTiles: a second kernel merges them). CLUSTER:
// only the former (launch returns 4 if not).
enum { MQA_BYOC_DECODE_MERGE_AUTO = 0, MQA_BYOC_DECODE_MERGE_GLOBAL = 1, MQA_BYOC_DECODE_MERGE_CLUSTER = 2 };

typedef struct {
  int splits, keys_per_split, row_groups;
  int64_t o_part_floats, counters;
  size_t workspace_bytes;  // device scratch for mqa_byoc_decode_launch (0: none needed)
  int merge;               // MQA_BYOC_DECODE_MERGE_*: the plan functions set AUTO (GLOBAL for packed splits)
  int warps;               // of a CTA: 8, or 4 for splits of at most 256 keys (the plan functions set it);
                           // SharedTiles: its row tiles, or twice them for two key groups (at most 5 row tiles)
  int row_tiles;           // M tiles of 16 query rows a warp carries: a CTA holds 16 x row_tiles query rows
  // 1: the group's row tiles are the warps of one CTA (`warps` of them, or half with two key groups, which
  // take one of each tile's two 32-key steps each; 16 query rows a row tile, up to 128 rows),
  // which load 64-key tiles together and each run their rows over them (the rule's choice at head dim 64
  // for more than 16 query rows a K/V head; splits of a multiple of 64 keys); 0: the CTA's warps split the
  // keys of its 16 x row_tiles rows; 2: SharedTiles with packed splits (on pages, where the per-sequence
  // splits would not merge in clusters): a split size for the whole batch, found by the kernel from the
  // lengths (at least keys_per_split keys) and evened out within each sequence (as many splits), each
  // sequence's splits numbered after the previous one's, and
  // `splits` the grid's x for every (K/V head, row group), at least one CTA a sequence: a long sequence
  // gets more CTAs than a short one (merge GLOBAL; at most 12288 sequences: their lengths fill the main buffer).
  // SharedTiles' splits outside a cluster merge in a second kernel on the same stream (no arrival counters:
  // its plans' `counters` 0; the workspace also holds each slot's first partial and split count)
  int shared_tiles;
  // 1 (the plan functions' choice; the library's dispatcher sets its launch_overlap option's): on sm_90 and
  // later the kernels launch as programmatic dependents (PDL):
  // their CTAs may be scheduled while the previous kernel on the stream ends, and wait for it before
  // reading anything; once all of a kernel's CTAs run, the next kernel launched as a dependent may start
  // (CUTLASS's GEMV of the offloaded GEMMs is, cublaslt_gemm.cc). 0: plain launches.
  int overlap;
} mqa_byoc_decode_plan;

// Query rows (query heads of one K/V head) one CTA of the classic blocks holds by the plan functions' rule
// (row_tiles 0): 16. A larger group makes several row groups, each reading the K/V head (from L2 after the
// first), unless the plan takes SharedTiles (its shared_tiles: up to 128 rows a CTA, fewer CTAs).
int mqa_byoc_decode_rows_per_cta(int64_t head_dim);
// 1 when the kernel serves this head dim and head grouping (head dim 64 or 128, H a multiple of H_kv).
int mqa_byoc_decode_supported(int64_t head_dim, int64_t num_heads, int64_t num_heads_k);
// The most M tiles a warp carries in this build: 1, or 3 where gqa_decode.cu was compiled with
// -DMQA_BYOC_DECODE_ROW_TILES=3 (the decode kernel's tests and benchmarks).
int mqa_byoc_decode_max_row_tiles(void);
// row_tiles below: 0 for the rule (mqa_byoc_decode_rows_per_cta / 16, or SharedTiles where the plan's
// shared_tiles says so), else the M tiles of 16 query rows a warp carries (1; 2 or 3 at head dim 64 for
// groups of more than 8 in a build with them; else the functions return 2): a benchmark's sweep (CTAs of
// 16 x row_tiles query rows); or MQA_BYOC_DECODE_SHARED_TILES: SharedTiles wherever it serves the call
// (head dim 64, more than 16 query rows a K/V head), whatever the batch; the functions return 2 elsewhere.
#define MQA_BYOC_DECODE_SHARED_TILES (-1)
// capacity[n - 1] (n = 1..16): how many thread-block clusters of n blocks of the kernel that serves `args`
// (head dim, dtype, pages or not, row tiles) device_id holds at once; what make_plan sizes cluster merges
// by. 0 on success (answers are cached per device and kernel); 1 CUDA error; 2 unsupported.
int mqa_byoc_decode_cluster_capacity(const mqa_byoc_decode_args* args, int row_tiles, int device_id, int* capacity);
// The grid and scratch of a call on a device with num_sms SMs and the given cluster capacity (NULL: plan
// for the workspace merge only). 0 on success.
int mqa_byoc_decode_make_plan(const mqa_byoc_decode_args* args, int row_tiles, int num_sms, const int* capacity,
                              mqa_byoc_decode_plan* plan);
// The plan with a given split size (a multiple of 16 keys, at most 128 splits; else 2): what make_plan
// ends with, for a benchmark's sweep of split sizes. Its grid: enough splits for the longest sequence the
// call can hold, on pages at most a typical sequence's (a longer sequence cuts larger splits itself).
int mqa_byoc_decode_plan_split(const mqa_byoc_decode_args* args, int64_t keys_per_split, int row_tiles,
                               mqa_byoc_decode_plan* plan);
// The same with the grid's x given: `splits` a (sequence, K/V head, row group), each sequence's keys cut
// into at most that many splits of at least keys_per_split keys (a benchmark's sweep of grids).
int mqa_byoc_decode_plan_grid(const mqa_byoc_decode_args* args, int64_t keys_per_split, int64_t splits,
                              int row_tiles, mqa_byoc_decode_plan* plan);
// Launches on `stream` (a cudaStream_t of device_id, current); workspace: plan->workspace_bytes (also when
// the splits merge in a cluster: the fallback needs it). 0 on success; 1 CUDA error; 2 unsupported;
// 3 no counters; 4 MQA_BYOC_DECODE_MERGE_CLUSTER asked for a grid whose clusters are not co-resident.
int mqa_byoc_decode_launch(const mqa_byoc_decode_args* args, const mqa_byoc_decode_plan* plan, void* workspace,
                           int device_id, void* stream);

#ifdef __cplusplus
}
#endif
