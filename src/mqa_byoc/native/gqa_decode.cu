// Grouped-query decode attention of our own: one query row per sequence and query head, all the query
// heads of one K/V head served by one read of its keys, split-KV and the combine in ONE launch (SharedTiles'
// splits outside a cluster: a second, short merge kernel).
//
// Why not FA2's split-KV kernel: at decode it streams K/V at about 3.2 TB/s on the H200 (64-row query tiles
// for 8 real rows, a 2-stage load) and needs a second kernel for the combine; cuDNN's decode is faster.
// Here each warp streams 16-key tiles of K and V through a cp.async pipeline in its own shared memory (no
// block barrier in the main loop), the G query rows of a K/V head are the M rows (or, G <= 8, the N) of
// m16n8k16 tensor-core MMAs, and the block's 8 (or 4) warps' states merge in shared memory. A warp carries
// one M tile of 16 query rows, or where a plan asks (row_tiles, head dim 64) two or three: each K and V
// fragment it loads from shared memory then serves every tile, and the K/V head is streamed once per 16 x
// row_tiles query rows; on the H200 that was no faster for Falcon's 71 heads (rule_row_tiles). The splits of a
// (sequence, K/V head) merge in a thread-block cluster through distributed shared memory when they fit
// one (at most 16, co-resident), else the last block to finish merges them from a workspace (an arrival
// counter, reset by that block); SharedTiles' (below) merge there in a second kernel.
//
// Keys come from a contiguous cache (batch, row, head strides) or from TVM's pages (CSR page list; the
// page size is any positive value; with a multiple of 16 a tile lies in one page, looked up once).
//
// The step is bound by the instructions it issues (ncu on the H200: ~0.6 warp instructions a cycle per
// scheduler, DRAM and L2 well below their peaks), so it spends few: the running max of the unscaled
// scores (the scale, positive, goes into the exponent's FMA), ex2.approx, no max across the quad and no
// rescale for a tile within 2^kSlack of its rows' max, page and row by shift and mask for power-of-two
// page sizes, K/V rows D apart loaded at constant offsets, one wide multiply-add for a tile's page.
// Sharing one K/V tile among the warps of several row tiles, the first warp loading it, cut L2 traffic
// but not time: not kept. What pays for large groups at head dim 64 with many sequences is SharedTiles
// (gqa_decode_shared_kernel): the group's row tiles are the warps of one CTA, and all of them load its
// 64-key tiles (71/1/64, 64 sequences of 16k keys: 43% fewer instructions, 0.46x the time).
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "gqa_decode.h"

// Phase timestamps of the classic blocks and SharedTiles, for benchmarks/decode_phases.py: compiled only with
// -DMQA_BYOC_DECODE_PHASES (the packaged libraries leave them out). Thread 0 of each CTA (warp 0) writes
// 16 words at (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * 16 of the buffer given
// to mqa_byoc_decode_set_phase_buffer (NULL: none): words 0-6 %globaltimer (ns) at the kernel's start,
// after the sequence's range (its CSR entries; SharedTiles' packed splits: every sequence's), after the
// prologue (Q, the first page, the pipeline's first loads issued), when warp 0's first tile has landed
// (SharedTiles: the CTA's), after warp 0's last tile, after the CTA's warps merged (SharedTiles: its rows
// normalized), at the end (the splits merged or, SharedTiles outside a cluster, its partial written; the
// output written); word 7 the SM; words 8-14 clock64 at the same points.
#ifdef MQA_BYOC_DECODE_PHASES
__device__ unsigned long long* g_mqa_byoc_decode_phases = nullptr;
extern "C" int mqa_byoc_decode_set_phase_buffer(void* buffer) {
  return int(cudaMemcpyToSymbol(g_mqa_byoc_decode_phases, &buffer, sizeof(buffer)));
}
#define MQA_BYOC_PHASE(slot)                                                                            \
  do {                                                                                                  \
    unsigned long long* buf_ = g_mqa_byoc_decode_phases;                                                \
    if (buf_ != nullptr && threadIdx.x == 0) {                                                          \
      unsigned long long t_;                                                                            \
      unsigned sm_;                                                                                     \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                           \
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                                                  \
      const size_t cta_ = blockIdx.x + size_t(gridDim.x) * (blockIdx.y + size_t(gridDim.y) * blockIdx.z); \
      buf_[cta_ * 16 + (slot)] = t_;                                                                    \
      buf_[cta_ * 16 + 8 + (slot)] = static_cast<unsigned long long>(clock64());                        \
      buf_[cta_ * 16 + 7] = sm_;                                                                        \
    }                                                                                                   \
  } while (0)
#else
#define MQA_BYOC_PHASE(slot) \
  do {                       \
  } while (0)
#endif

namespace {

// Warps of a CTA: 8, or 4 where 8 would stream at most two tiles each (make_plan, warps_for).
constexpr int kMaxWarps = 8;
constexpr int kFewWarps = 4;
constexpr int kTileKeys = 16;  // keys per warp step (one m16n8k16 K step of P @ V)
// M tiles of 16 query rows a warp may carry (head dim 64, RowsAsM): 1 in the libraries the package builds
// (the plan's rule keeps one: two and three were measured no faster, 2026-12-02-mqa-decode-tiles), 3 where
// the decode kernel's tests and benchmarks compile this file with -DMQA_BYOC_DECODE_ROW_TILES=3 to measure
// them (src/mqa_byoc/testing/decode_kernel.py): their kernels would cost exports compile time and size.
#ifndef MQA_BYOC_DECODE_ROW_TILES
#define MQA_BYOC_DECODE_ROW_TILES 1
#endif
constexpr int kMaxRowTiles = MQA_BYOC_DECODE_ROW_TILES;
static_assert(kMaxRowTiles == 1 || kMaxRowTiles == 3, "MQA_BYOC_DECODE_ROW_TILES: 1 or 3");
// Warps an SM holds: 16 at head dim 64 with one M tile a warp (registers: 128 a thread), else 8.
template <int D, int MT>
constexpr int kWarpsPerSm = D <= 64 && MT == 1 ? 16 : 8;
// Pipeline stages: each warp keeps 8 KB of K/V loads in flight beyond the tile it computes on (one tile of
// head dim 128, two of 64), 16 KB where head dim 64 has 8 warps an SM (MT > 1: the SM's 128 KB of one
// tile a warp; 8 KB there was within 1.5%). On the H200, a third stage at head dim 128 (16 KB) was 2-10%
// slower at 1k-8k keys (no faster at 16k-32k); two stages at head dim 64 slowed Falcon (71/1) by 5-17%
// from 2k keys on.
template <int D, int MT = 1>
constexpr int kStages = 1 + (D <= 64 ? 16 * 8192 / kWarpsPerSm<D, MT> : 8192) / (kTileKeys * D * 2 * 2);
// A tile whose scores all lie within 2^kSlack of their rows' running max (log2 domain) keeps that max
// as the base of its probabilities (at most 2^kSlack, fp16's range holds them): no max across the quad,
// no correction; a larger score takes the exact max and rescales O.
constexpr float kSlack = 8.f;
constexpr int kMaxSplits = 128;  // splits per (sequence, K/V head): the merging CTA keeps their weights
constexpr int kMaxCluster = 16;  // splits merged through distributed shared memory (non-portable size 16)

// m16n8k16 tensor-core MMA with fp32 accumulators on T (__half or __nv_bfloat16), and T's conversions.
template <typename T>
struct Mma {
  static constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  static __device__ __forceinline__ void run(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#define MQA_BYOC_MMA(TY)                                                                                      \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
               "{%0,%1,%2,%3};\n"                                                                             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (kBf16) {
      MQA_BYOC_MMA("bf16");
    } else {
      MQA_BYOC_MMA("f16");
    }
#undef MQA_BYOC_MMA
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    if constexpr (kBf16) {
      __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&h);
    } else {
      __half2 h = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<uint32_t*>(&h);
    }
  }
  static __device__ __forceinline__ T from_float(float x) {
    if constexpr (kBf16) {
      return __float2bfloat16_rn(x);
    } else {
      return __float2half_rn(x);
    }
  }
};

// 2^x by the MUFU alone (exp2f adds a range scaling for results below 2^-126, which the softmax's
// probabilities and correction factors may flush to zero); ex2(-inf) = 0
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (a shared-window address): whole, or src_bytes of them (0: zeros, for rows past
// the end: no NaN from stale memory)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The 8x8 b16 matrix whose fragment (thread g*4+t: row g, columns 2t, 2t+1) is x, transposed: the
// fragment of its transpose.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// A tile row is D/8 chunks of 16 bytes; chunk c of row r sits at c ^ (r & 7) so that the 8 rows an
// ldmatrix reads hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * (D / 8) + (chunk ^ (row & 7));
}

// A lane's byte offsets, in a swizzled tile, of the rows its ldmatrix reads at chunks 2 k + c (k = 0 ..
// D / 16 - 1): (2 k + c) ^ (row & 7) is ((c ^ row) & 7) ^ 2 (k % 4), plus 8 (k / 4), and a row starts at a
// multiple of 128 bytes (D >= 64), so one offset and an XOR serve every k (no table of offsets that the
// compiler rebuilds in the loop).
template <int D>
struct TileOffsets {
  static_assert(D % 64 == 0, "rows of whole 128-byte swizzle periods");
  uint32_t off0;
  __device__ __forceinline__ void init(int row, int c) { off0 = 16u * uint32_t(swz<D>(row, c)); }
  __device__ __forceinline__ uint32_t at(int k) const { return (off0 ^ (32u * uint32_t(k % 4))) + uint32_t(k / 4) * 128u; }
};

struct SeqRange {
  int begin, end;  // keys [begin, end) of this sequence that the query row attends to
};

__device__ __forceinline__ int seq_len(const mqa_byoc_decode_args& a, int b) {
  if (a.page_values != nullptr) {
    const int n = a.page_indptr[b + 1] - a.page_indptr[b];
    return n > 0 ? (n - 1) * int(a.page_size) + a.last_page_len[b] : 0;
  }
  return int(a.seqlen_k);
}

__device__ __forceinline__ SeqRange seq_range(const mqa_byoc_decode_args& a, int b) {
  const int len = seq_len(a, b);
  const int begin = a.window_left >= 0 ? max(0, len - 1 - a.window_left) : 0;
  return {begin, len};
}

// The keys of split `split` of a sequence cut into splits of kps keys: [k_begin, k_end), and whether it
// has any (a split past the sequence's end: empty, k_begin = k_end = the end).
struct SplitKeys {
  int n_splits, k_begin, k_end;
  bool active;
};
__device__ __forceinline__ SplitKeys split_keys(const SeqRange& sr, int split, int kps) {
  const int n_splits = max(1, (sr.end - sr.begin + kps - 1) / kps);
  const bool active = split < n_splits;
  const int k_begin = active ? sr.begin + split * kps : sr.end;
  return {n_splits, k_begin, active ? min(sr.end, k_begin + kps) : sr.end, active};
}

// Element offset of key `row` of sequence b, K/V head h (without the K-or-V base).
__device__ __forceinline__ int64_t row_offset(const mqa_byoc_decode_args& a, const int64_t* stride, int b, int row,
                                              int h) {
  if (a.page_values != nullptr) {
    const int page = __ldg(a.page_values + a.page_indptr[b] + row / int(a.page_size));
    return int64_t(page) * stride[0] + int64_t(row % int(a.page_size)) * stride[1] + int64_t(h) * stride[2];
  }
  return int64_t(b) * stride[0] + int64_t(row) * stride[1] + int64_t(h) * stride[2];
}

// Shared memory of one block of W warps of MT M tiles: the pipeline (per warp: kStages x (K tile, V
// tile)), reused after the loop for the warps' outputs (fp32), plus the per-row statistics.
template <int D, bool SWAP, int W, int MT>
struct Smem {
  static constexpr int kRows = 16 * MT;  // query rows of a block (8 used when SWAP)
  static constexpr int kTileBytes = kTileKeys * D * 2;
  static constexpr int kPipeBytes = W * kStages<D, MT> * 2 * kTileBytes;
  // the warps' outputs [warp][row][kOStride] (fp32): rows padded so that a warp's stores hit 32 different
  // banks (unpadded: 8-way conflicts, 1 us per call measured): float2s of 8 rows x 4 column pairs (RowsAsM),
  // floats of 8 dims x 4 row pairs (RowsAsN)
  static constexpr int kOStride = SWAP ? D + 4 : D + 8;
  static constexpr int kMergeBytes = W * kRows * kOStride * 4;
  static constexpr int kMainBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static constexpr int kStatsBytes = 3 * W * kRows * 4 + 64;  // row statistics, the arrival flag
  // the cluster merge's receive buffers: every peer's share of this block's slice (float4s), their LSEs
  static constexpr int kRecvBytes = (kRows * D / 4 + kMaxCluster) * 16 + kMaxCluster * kRows * 4;
  static constexpr int kBytes = kMainBytes + kStatsBytes + kRecvBytes;
  static_assert(kBytes <= 227 * 1024, "a block's shared memory (the H200's opt-in limit)");
};

// Thread-block clusters are sm_90's. A build for an older arch (sm_80, sm_86, sm_89) keeps every other
// path; the host never launches the cluster-merging instances there (no co-resident cluster: the plans
// merge through the workspace), and if one ran anyway it traps.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MQA_BYOC_NO_CLUSTERS 1
#endif

#ifdef MQA_BYOC_NO_CLUSTERS
__device__ __forceinline__ void cluster_arrive_relaxed() { __trap(); }
__device__ __forceinline__ void cluster_arrive_release() { __trap(); }
__device__ __forceinline__ void cluster_wait() { __trap(); }
#else
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
#endif

// The splits of one slot, a cluster of gridDim.x blocks (block rank = split), merge their outputs: s_o
// holds this block's W warps' shares ([warp][row][kOStride], fp32, normalized by the block's LSE), s_f
// the block's base-2 LSE per row. Block j merges slice j of the slot's output: every block sums its warps'
// shares of slice j and stores them, with its LSEs, into block j's receive buffers (distributed shared
// memory, outside the pipeline's memory that a slower peer may still stream into), then one cluster
// barrier, then each block merges from its own shared memory (s_o, no longer read by anyone, holds the
// weights). The caller's first barrier phase (arrived at the start) is waited for here: DSMEM of a block is
// only valid once every block of the cluster runs.
template <typename T, int D, int W, int kOStride>
__device__ __forceinline__ void merge_in_cluster(const mqa_byoc_decode_args& a, float* s_o, const float* s_f,
                                                 float4* recv, float* recv_l, int rows_here, int b, int head0,
                                                 int kRows, int n_threads) {
#ifdef MQA_BYOC_NO_CLUSTERS
  __trap();
#else
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int n = int(gridDim.x), me = int(blockIdx.x);
  const int n4 = rows_here * (D / 4), per = (n4 + n - 1) / n;
  cluster_wait();
  for (int idx = threadIdx.x; idx < n4; idx += n_threads) {
    const int r = idx / (D / 4), d4 = idx % (D / 4), owner = idx / per;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(s_o + (w * kRows + r) * kOStride + d4 * 4);
      v.x += x.x, v.y += x.y, v.z += x.z, v.w += x.w;
    }
    *cluster.map_shared_rank(recv + me * per + (idx - owner * per), owner) = v;
  }
  for (int i = threadIdx.x; i < rows_here * n; i += n_threads) {
    *cluster.map_shared_rank(recv_l + me * kRows + i % rows_here, i / rows_here) = s_f[i % rows_here];
  }
  cluster_arrive_release();
  cluster_wait();  // every block's shares of this block's slice have landed
  // weights: one warp per row of the slice, a lane per split (n <= kMaxCluster <= 32)
  const int first = me * per, last = min(n4, first + per);
  const int row_lo = first / (D / 4), rows = last > first ? (last - 1) / (D / 4) - row_lo + 1 : 0;
  float* s_w = s_o;  // [row of the slice][split], then 1 / sum per row at [rows * kMaxCluster + row]
  const int lane = threadIdx.x % 32;
  for (int rr = threadIdx.x / 32; rr < rows; rr += n_threads / 32) {
    const int r = row_lo + rr;
    const float l = lane < n ? recv_l[lane * kRows + r] : -INFINITY;
    float mx = l;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float w = l == -INFINITY ? 0.f : exp2f(l - mx);
    float tot = w;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, off);
    const float inv = tot > 0.f ? 1.f / tot : 0.f;
    if (lane < n) s_w[rr * kMaxCluster + lane] = w * inv;
    if (lane == 0 && a.lse != nullptr) a.lse[int64_t(b) * a.num_heads + head0 + r] = tot > 0.f ? mx + log2f(tot) : a.lse_empty;
  }
  __syncthreads();
  // one output element per thread: the weighted sum of the splits' shares
  const float* recv_f = reinterpret_cast<const float*>(recv);
  for (int e = threadIdx.x; e < (last - first) * 4; e += n_threads) {
    const int idx = first + e / 4, r = idx / (D / 4), d = (idx % (D / 4)) * 4 + e % 4;
    const float* w = s_w + (r - row_lo) * kMaxCluster;
    float v = 0.f;
    for (int sp = 0; sp < n; ++sp) v += w[sp] * recv_f[sp * per * 4 + e];
    static_cast<T*>(a.out)[int64_t(b) * a.o_stride[0] + int64_t(head0 + r) * a.o_stride[1] + d] = Mma<T>::from_float(v);
  }
#endif  // MQA_BYOC_NO_CLUSTERS
}

// One warp's attention over its key tiles, for the block's query rows (those past the group are zero):
// the Q fragments, the running max and sum, the output accumulators. Two orientations of m16n8k16:
//
// RowsAsM: MT tiles of 16 query rows are the M of S = Q K^T and O = P V (any group size, in 16-row tiles).
// Each K and V fragment a lane loads from shared memory serves the MT tiles; tiles past the group's rows
// (`live`, warp-uniform) compute nothing.
template <typename T, int D, int MT>
struct RowsAsM {
  using M = Mma<T>;
  // S's MMA chains per tile over the dims: two for one tile (half the dependent MMA latency); with more,
  // the tiles' chains are independent already
  static constexpr int kChains = MT == 1 ? 2 : 1;
  uint32_t qf[MT][D / 16][4];
  float acc[MT][D / 8][4];       // O: (row g, dims 8j + 2t, +1), (row g + 8, same) of each tile
  float m_run[MT][2], l_run[MT][2];  // rows g, g + 8; l_run: this thread's keys (summed over t at the end)
  int live;                          // tiles with a row of the group
  __device__ __forceinline__ bool on(int mt) const { return MT == 1 || mt < live; }
  // ldmatrix rows of K: (keys 0-7, dims 16k..+7), (keys 0-7, +8..+15), (keys 8-15, ...), (keys 8-15, +8..);
  // of V (transposed): (keys 0-7, dims 16jj..+7), (keys 8-15, same), (keys 0-7, +8..+15), (keys 8-15, +8..)
  TileOffsets<D> k_off, v_off;

  __device__ __forceinline__ void init(const T* q0, int64_t q_head_stride, int rows, int g, int t) {
    const int lane = g * 4 + t, mi = lane / 8;
    k_off.init((mi / 2) * 8 + lane % 8, mi % 2);
    v_off.init((mi % 2) * 8 + lane % 8, mi / 2);
    live = min(MT, (rows + 15) / 16);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mt * 16 + g + half * 8;
        const bool ok = r < rows;
        const T* qrow = q0 + int64_t(ok ? r : 0) * q_head_stride;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          qf[mt][ks][half] = ok ? *reinterpret_cast<const uint32_t*>(qrow + ks * 16 + 2 * t) : 0u;
          qf[mt][ks][2 + half] = ok ? *reinterpret_cast<const uint32_t*>(qrow + ks * 16 + 8 + 2 * t) : 0u;
        }
        m_run[mt][half] = -INFINITY;
        l_run[mt][half] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    }
  }

  // keys key0 .. key0 + 16 KC - 1 from the tiles at shared addresses ks / vs (KC chunks of 16 keys, each
  // 16 D elements after the last); kMasked: the keys hold k_end (the keys from it on are masked), a
  // separate instance so that whole tiles spend nothing on the test. KC = 2 (SharedTiles): one max, one
  // rescale and twice the independent MMAs per softmax step
  template <bool kMasked, int KC = 1>
  __device__ __forceinline__ void step(uint32_t ks, uint32_t vs, int key0, int k_end, float scale, int lane) {
    constexpr uint32_t kChunkBytes = 16 * D * 2;  // 16 keys of K (or V)
    constexpr int NT = 2 * KC;                     // n-tiles of 8 keys
    // S's chains over the dims per n-tile: kChains for one chunk; with two, its 2 NT chains are enough
    constexpr int kCh = KC == 1 ? kChains : 1;
    const int t = lane % 4;
    // S = Q K^T, 16 rows x 16 KC keys (NT n-tiles of 8 keys) per tile
    float s[MT][kCh][NT][4] = {};
#pragma unroll
    for (int kstep = 0; kstep < D / 16; ++kstep) {
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        uint32_t kb[4];
        ldmatrix_x4(kb, ks + c * kChunkBytes + k_off.at(kstep));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (on(mt)) {
            M::run(s[mt][kstep % kCh][2 * c], qf[mt][kstep], kb[0], kb[1]);
            M::run(s[mt][kstep % kCh][2 * c + 1], qf[mt][kstep], kb[2], kb[3]);
          }
        }
      }
    }
    // unscaled scores (the max of the scaled ones is the max of these times scale > 0); grow: some score
    // beyond 2^kSlack x its row's running max
    float x[MT][2][2 * NT];
    auto row_max = [](const float* xr) {  // of this thread's 2 NT scores of a row
      float mx = fmaxf(fmaxf(xr[0], xr[1]), fmaxf(xr[2], xr[3]));
#pragma unroll
      for (int e = 4; e < 2 * NT; e += 2) mx = fmaxf(mx, fmaxf(xr[e], xr[e + 1]));
      return mx;
    };
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (!on(mt)) continue;  // past the group
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float sum = s[mt][0][nt][half * 2 + e];
#pragma unroll
            for (int c = 1; c < kCh; ++c) sum += s[mt][c][nt][half * 2 + e];
            x[mt][half][nt * 2 + e] = sum;
            if (kMasked && key0 + nt * 8 + 2 * t + e >= k_end) x[mt][half][nt * 2 + e] = -INFINITY;
          }
        grow |= row_max(x[mt][half]) * scale > m_run[mt][half] + kSlack;
      }
    }
    uint32_t pf[MT][KC][4];
    // the probabilities against `base` (the row's max the accumulators are scaled to), the row sum
    // rescaled by corr; A fragment of P (row x key) per 16 keys c: a0 (row g, keys 2t..), a1 (row g+8,
    // 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
    auto probs = [&](int mt, int half, float base, float corr) {
      float p[2 * NT];
#pragma unroll
      for (int e = 0; e < 2 * NT; ++e) p[e] = ex2(fmaf(x[mt][half][e], scale, -base));
      float sum = (p[0] + p[1]) + (p[2] + p[3]);
#pragma unroll
      for (int e = 4; e < 2 * NT; e += 2) sum += p[e] + p[e + 1];
      l_run[mt][half] = l_run[mt][half] * corr + sum;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        pf[mt][c][half] = M::pack(p[4 * c], p[4 * c + 1]);
        pf[mt][c][2 + half] = M::pack(p[4 * c + 2], p[4 * c + 3]);
      }
    };
    if (__any_sync(0xffffffffu, grow)) {  // a new max: the rows' max across the quad, O rescaled
      float corr[MT][2];
      bool moved = false;  // some row's running max
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (!on(mt)) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = row_max(x[mt][half]);
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mt][half], mx * scale);
          const float base = m_new == -INFINITY ? 0.f : m_new;
          corr[mt][half] = ex2(m_run[mt][half] - base);
          m_run[mt][half] = m_new;
          moved |= corr[mt][half] != 1.f;
          probs(mt, half, base, corr[mt][half]);
        }
      }
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (on(mt)) {
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
              acc[mt][j][0] *= corr[mt][0], acc[mt][j][1] *= corr[mt][0];
              acc[mt][j][2] *= corr[mt][1], acc[mt][j][3] *= corr[mt][1];
            }
          }
        }
      }
    } else {  // every score within 2^kSlack of its row's running max: kept as the base (no max, no rescale)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (!on(mt)) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          probs(mt, half, m_run[mt][half] == -INFINITY ? 0.f : m_run[mt][half], 1.f);
        }
      }
    }
    // O += P V: the V tile (16 keys x D a chunk) as the B operand, transposed by ldmatrix
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vs + c * kChunkBytes + v_off.at(jj));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (on(mt)) {
            M::run(acc[mt][2 * jj], pf[mt][c], vb[0], vb[1]);
            M::run(acc[mt][2 * jj + 1], pf[mt][c], vb[2], vb[3]);
          }
        }
      }
    }
  }

  // the warp's row statistics into s_m / s_l ([warp][row], 16 MT rows a warp)
  __device__ __forceinline__ void stats(float* s_m, float* s_l, int warp, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float l = l_run[mt][half];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (lane % 4 == 0) {
          s_m[warp * 16 * MT + mt * 16 + lane / 4 + half * 8] = m_run[mt][half];
          s_l[warp * 16 * MT + mt * 16 + lane / 4 + half * 8] = l;
        }
      }
    }
  }

  // the warp's output, scaled by its share of the block's softmax (factor(row, own max)), into s_o
  template <int kOStride, typename F>
  __device__ __forceinline__ void output(float* s_o, int warp, int lane, F factor) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mt * 16 + g + half * 8;
        const float f = factor(r, m_run[mt][half]);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          *reinterpret_cast<float2*>(s_o + (warp * 16 * MT + r) * kOStride + j * 8 + 2 * t) =
              make_float2(acc[mt][j][half * 2] * f, acc[mt][j][half * 2 + 1] * f);
        }
      }
    }
  }
};

// RowsAsN (a group of at most 8 query rows): the rows are the N of S^T = K Q^T and O^T = V^T P^T, the keys
// and dims the M, so no MMA computes a padding row: half the tensor work and accumulators of RowsAsM.
// P^T's fragments become P's (the B operand) by transposing 8x8 blocks in registers (movmatrix).
template <typename T, int D>
struct RowsAsN {
  using M = Mma<T>;
  uint32_t qf[D / 16][2];    // B fragments of Q^T: (dims 16k + 2t, +1; row g), (dims 16k + 8 + 2t, +1; row g)
  float acc[D / 16][4];      // O^T: (dim 16j + g; rows 2t, 2t+1), (dim 16j + g + 8; rows 2t, 2t+1)
  float m_run[2], l_run[2];  // rows 2t, 2t + 1; l_run: this thread's keys (summed over g at the end)
  // ldmatrix rows of K (A fragment): (keys 0-7, dims 16k..+7), (keys 8-15, same), (keys 0-7, +8..),
  // (keys 8-15, +8..); of V^T: (keys 0-7, dims 16jj..+7), (keys 0-7, +8..+15), (keys 8-15, ...), (8-15, +8..)
  TileOffsets<D> k_off, v_off;

  __device__ __forceinline__ void init(const T* q0, int64_t q_head_stride, int rows, int g, int t) {
    const int lane = g * 4 + t, mi = lane / 8;
    k_off.init((mi % 2) * 8 + lane % 8, mi / 2);
    v_off.init((mi / 2) * 8 + lane % 8, mi % 2);
    const bool ok = g < rows;
    const T* qrow = q0 + int64_t(ok ? g : 0) * q_head_stride;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qf[ks][0] = ok ? *reinterpret_cast<const uint32_t*>(qrow + ks * 16 + 2 * t) : 0u;
      qf[ks][1] = ok ? *reinterpret_cast<const uint32_t*>(qrow + ks * 16 + 8 + 2 * t) : 0u;
    }
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  }

  template <bool kMasked>
  __device__ __forceinline__ void step(uint32_t ks, uint32_t vs, int key0, int k_end, float scale, int lane) {
    const int g = lane / 4;
    // S^T = K Q^T: 16 keys x 8 rows, two chains over the dims
    float s[2][4] = {};
#pragma unroll
    for (int kstep = 0; kstep < D / 16; ++kstep) {
      uint32_t ka[4];  // A fragment of K
      ldmatrix_x4(ka, ks + k_off.at(kstep));
      M::run(s[kstep % 2], ka, qf[kstep][0], qf[kstep][1]);
    }
    // this thread: keys g (x[0], x[1]) and g + 8 (x[2], x[3]) of rows 2t (x[0], x[2]) and 2t + 1
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = s[0][e] + s[1][e];  // unscaled (scale > 0), as RowsAsM's
      if (kMasked && key0 + g + (e / 2) * 8 >= k_end) x[e] = -INFINITY;
    }
    float p[4];
    bool grow = false;  // some score beyond 2^kSlack x its row's running max (RowsAsM's rule)
#pragma unroll
    for (int r = 0; r < 2; ++r) grow |= fmaxf(x[r], x[r + 2]) * scale > m_run[r] + kSlack;
    if (__any_sync(0xffffffffu, grow)) {
      float corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(x[r], x[r + 2]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_run[r], mx * scale);
        const float base = m_new == -INFINITY ? 0.f : m_new;
        corr[r] = ex2(m_run[r] - base);
        m_run[r] = m_new;
        p[r] = ex2(fmaf(x[r], scale, -base));
        p[r + 2] = ex2(fmaf(x[r + 2], scale, -base));
        l_run[r] = l_run[r] * corr[r] + (p[r] + p[r + 2]);
      }
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          acc[j][0] *= corr[0], acc[j][1] *= corr[1];
          acc[j][2] *= corr[0], acc[j][3] *= corr[1];
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float base = m_run[r] == -INFINITY ? 0.f : m_run[r];
        p[r] = ex2(fmaf(x[r], scale, -base));
        p[r + 2] = ex2(fmaf(x[r + 2], scale, -base));
        l_run[r] += p[r] + p[r + 2];
      }
    }
    // B fragments of P^T (key x row): (keys 2t, 2t+1; row g), (keys 2t+8, 2t+9; row g)
    const uint32_t b0 = movmatrix_trans(M::pack(p[0], p[1]));
    const uint32_t b1 = movmatrix_trans(M::pack(p[2], p[3]));
    // O^T += V^T P^T: A fragments of V^T, transposed from the V tile by ldmatrix
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      uint32_t va[4];
      ldmatrix_x4_trans(va, vs + v_off.at(jj));
      M::run(acc[jj], va, b0, b1);
    }
  }

  __device__ __forceinline__ void stats(float* s_m, float* s_l, int warp, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[r];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (lane < 4) {
        s_m[warp * 16 + 2 * lane + r] = m_run[r];
        s_l[warp * 16 + 2 * lane + r] = l;
      }
    }
  }

  template <int kOStride, typename F>
  __device__ __forceinline__ void output(float* s_o, int warp, int lane, F factor) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float f = factor(2 * t + r, m_run[r]);
      float* row = s_o + (warp * 16 + 2 * t + r) * kOStride + g;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        row[16 * j] = acc[j][r] * f;
        row[16 * j + 8] = acc[j][2 + r] * f;
      }
    }
  }
};

// The end of a block's work once s_o holds its rows' outputs ([kSumWarps][row][kOStride], fp32, normalized
// by the block's LSE, summed over the kSumWarps shares) and s_f their base-2 LSEs: written out (one split),
// merged in the cluster, or stored as a partial and merged by the slot's last block (`defer`: by the
// merge kernel launched after this one, gqa_decode_split_merge_kernel). kRows: rows a block holds (the
// partials' row stride), n_threads: the block's threads.
template <typename T, int D, bool CLUSTER, int kSumWarps, int kOStride>
__device__ __forceinline__ void finish_block(const mqa_byoc_decode_args& a, unsigned char* smem, float* s_o,
                                             const float* s_f, float* s_l, int* s_flag, float4* s_recv,
                                             float* s_recv_l, int n_splits, int kRows, int group, int row0, int b,
                                             int kvh, int rg, int row_groups, int64_t part0, int split,
                                             float* o_part, float* lse_part, int* counters, int n_threads,
                                             bool defer = false) {
  using M = Mma<T>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool single = n_splits == 1;
  const int rows_here = min(kRows, group - row0);
  T* out = static_cast<T*>(a.out);
  if constexpr (CLUSTER) {
    if (!single) {
      merge_in_cluster<T, D, kSumWarps, kOStride>(a, s_o, s_f, s_recv, s_recv_l, rows_here, b, kvh * group + row0, kRows, n_threads);
      return;
    }
  }
  const int64_t slot = (int64_t(b) * a.num_heads_k + kvh) * row_groups + rg;  // (sequence, K/V head, row group)
  // the slot's partials: part0 .. part0 + n_splits - 1 in the workspace
  float* my_o = o_part + (part0 + split) * kRows * D;
  if (!single) {  // a float4 at a time (kOStride and D multiples of 4)
    static_assert(kOStride % 4 == 0 && D % 4 == 0, "the partials' rows in float4s");
    for (int idx = threadIdx.x; idx < rows_here * (D / 4); idx += n_threads) {
      const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
      float4 v = *reinterpret_cast<const float4*>(s_o + r * kOStride + d);
#pragma unroll
      for (int w = 1; w < kSumWarps; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(s_o + (w * kRows + r) * kOStride + d);
        v.x += x.x, v.y += x.y, v.z += x.z, v.w += x.w;
      }
      *reinterpret_cast<float4*>(my_o + r * D + d) = v;
    }
  }
  if (single) {
    for (int idx = threadIdx.x; idx < rows_here * D; idx += n_threads) {
      const int r = idx / D, d = idx % D;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kSumWarps; ++w) v += s_o[(w * kRows + r) * kOStride + d];
      out[int64_t(b) * a.o_stride[0] + int64_t(kvh * group + row0 + r) * a.o_stride[1] + d] = M::from_float(v);
    }
    if (a.lse != nullptr && threadIdx.x < rows_here) {
      const float l = s_f[threadIdx.x];
      a.lse[int64_t(b) * a.num_heads + kvh * group + row0 + threadIdx.x] = l == -INFINITY ? a.lse_empty : l;
    }
    return;
  }
  if (threadIdx.x < rows_here) lse_part[(part0 + split) * kRows + threadIdx.x] = s_f[threadIdx.x];
  if (defer) return;  // the merge kernel, after this kernel, reads every split's partial

  // ---- the last block of this slot to arrive merges the splits ----
  // One acq_rel atomic by thread 0 after the barrier publishes this block's partial (release is cumulative
  // over the barrier) and, for the last block, makes the others' partials visible (acquire, then barrier).
  __syncthreads();
  if (threadIdx.x == 0) {
    int prev;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;\n" : "=r"(prev) : "l"(counters + slot) : "memory");
    *s_flag = prev == n_splits - 1;
  }
  __syncthreads();
  if (!*s_flag) return;
  const float* all_o = o_part + part0 * kRows * D;
  const float* all_l = lse_part + part0 * kRows;
  const int kSplitStride4 = kRows * D / 4;  // float4s between two splits' partials
  // this thread's first output element: its first kPre partials are loaded now, next to the LSEs (one
  // round trip to L2 instead of two)
  constexpr int kPre = 16;
  const int n4 = rows_here * (D / 4);
  const int r0 = threadIdx.x / (D / 4);
  const float4* src0 = reinterpret_cast<const float4*>(all_o + r0 * D) + threadIdx.x % (D / 4);
  float4 pre[kPre];
#pragma unroll
  for (int u = 0; u < kPre; ++u) {
    pre[u] = (threadIdx.x < n4 && u < n_splits) ? __ldcg(src0 + u * kSplitStride4) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // [split][row]: n_splits <= kMaxSplits, or SharedSmem's max_splits (the plans' bounds; the callers check
  // that these fit the main buffer)
  float* s_w = reinterpret_cast<float*>(smem);
  for (int idx = threadIdx.x; idx < n_splits * rows_here; idx += n_threads) {
    const int sp = idx / rows_here, r = idx % rows_here;
    s_w[sp * kRows + r] = __ldcg(all_l + sp * kRows + r);
  }
  __syncthreads();
  for (int r = warp; r < rows_here; r += n_threads / 32) {  // one warp per row: max, weights, sum
    float mx = -INFINITY;
    for (int sp = lane; sp < n_splits; sp += 32) mx = fmaxf(mx, s_w[sp * kRows + r]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float tot = 0.f;
    for (int sp = lane; sp < n_splits; sp += 32) {
      const float l = s_w[sp * kRows + r];
      const float w = l == -INFINITY ? 0.f : exp2f(l - mx);
      s_w[sp * kRows + r] = w;
      tot += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, off);
    if (lane == 0) {
      s_l[r] = tot > 0.f ? 1.f / tot : 0.f;
      if (a.lse != nullptr) {
        a.lse[int64_t(b) * a.num_heads + kvh * group + row0 + r] = tot > 0.f ? mx + log2f(tot) : a.lse_empty;
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < n4; idx += n_threads) {
    const int r = idx / (D / 4), d4 = idx % (D / 4);
    const float4* src = reinterpret_cast<const float4*>(all_o + r * D) + d4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    int sp = 0;
    if (idx == threadIdx.x) {  // the prefetched partials
#pragma unroll
      for (int u = 0; u < kPre; ++u) {
        const float w = u < n_splits ? s_w[u * kRows + r] : 0.f;
        v.x += w * pre[u].x, v.y += w * pre[u].y, v.z += w * pre[u].z, v.w += w * pre[u].w;
      }
      sp = kPre;
    }
    for (; sp + 8 <= n_splits; sp += 8) {
      float4 x[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) x[u] = __ldcg(src + (sp + u) * kSplitStride4);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float w = s_w[(sp + u) * kRows + r];
        v.x += w * x[u].x, v.y += w * x[u].y, v.z += w * x[u].z, v.w += w * x[u].w;
      }
    }
    for (; sp < n_splits; ++sp) {
      const float4 x = __ldcg(src + sp * kSplitStride4);
      const float w = s_w[sp * kRows + r];
      v.x += w * x.x, v.y += w * x.y, v.z += w * x.z, v.w += w * x.w;
    }
    const float inv = s_l[r];
    T* o = out + int64_t(b) * a.o_stride[0] + int64_t(kvh * group + row0 + r) * a.o_stride[1] + d4 * 4;
    o[0] = M::from_float(v.x * inv), o[1] = M::from_float(v.y * inv);
    o[2] = M::from_float(v.z * inv), o[3] = M::from_float(v.w * inv);
  }
  if (threadIdx.x == 0) counters[slot] = 0;  // ready for the next call on this stream
}

// CLUSTER: the grid's splits of a slot are one thread-block cluster and merge through distributed shared
// memory (merge_in_cluster): no workspace round trip, no arrival atomic. Otherwise the last block of a
// slot to arrive merges the partials in `o_part`.
// SWAP: the group's (at most 8) query rows as the N of the MMAs (RowsAsN), else MT 16-row tiles a warp
// as the M (RowsAsM; a block holds 16 MT query rows).
// W: warps of the block (kMaxWarps or kFewWarps); kWarpsPerSm of them an SM: 16 at head dim 64 with one
// tile a warp (shared memory), else 8 (shared memory at 128; registers for more tiles).
// Programmatic dependent launch (plan.overlap, sm_90+): each kernel below first waits until the kernel
// before it on the stream has ended and its writes are visible (nothing is read before), then lets the next
// kernel, if launched as a programmatic dependent, have its CTAs scheduled once all of this grid's CTAs
// have got here. Both instructions do nothing in a plain launch.
__device__ __forceinline__ void enter_after_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename T, int D, bool SWAP, bool PAGED, bool CLUSTER, int W, int MT>
__global__ void __launch_bounds__(W * 32, kWarpsPerSm<D, MT> / W)
    gqa_decode_kernel(const mqa_byoc_decode_args a, int keys_per_split, int row_groups, float* o_part, float* lse_part,
                      int* counters) {
  enter_after_previous_kernel();
  using M = Mma<T>;
  using S = Smem<D, SWAP, W, MT>;
  using Warp = std::conditional_t<SWAP, RowsAsN<T, D>, RowsAsM<T, D, MT>>;
  static_assert(!SWAP || MT == 1, "RowsAsN holds at most 8 rows");
  constexpr int kRows = S::kRows;
  constexpr int kStg = kStages<D, MT>;
  constexpr int kThreads = W * 32;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(128) unsigned char smem[];
  float* s_m = reinterpret_cast<float*>(smem + S::kMainBytes);  // [warp][row]
  float* s_l = s_m + W * kRows;
  float* s_f = s_l + W * kRows;  // the block's per-row combine values
  int* s_flag = reinterpret_cast<int*>(s_f + W * kRows);
  float4* s_recv = reinterpret_cast<float4*>(smem + S::kMainBytes + S::kStatsBytes);
  float* s_recv_l = reinterpret_cast<float*>(s_recv + kRows * D / 4 + kMaxCluster);

  const int split = blockIdx.x, kvh = blockIdx.y / row_groups, rg = blockIdx.y % row_groups, b = blockIdx.z;
  MQA_BYOC_PHASE(0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = int(a.num_heads / a.num_heads_k);
  const int row0 = rg * kRows;  // first query row (within the group) of this block
  const SeqRange sr = seq_range(a, b);
  // each sequence cuts its keys into at most gridDim.x splits of at least keys_per_split keys (a longer
  // one than the plan's grid was sized for: larger splits, of whole 16-key tiles); a shorter one leaves
  // splits without keys, which in a cluster still take part in the merge (as empty partials) unless the
  // sequence has one split
  const int per_cta = (sr.end - sr.begin + int(gridDim.x) * kTileKeys - 1) / (int(gridDim.x) * kTileKeys) * kTileKeys;
  const SplitKeys sk = split_keys(sr, split, max(keys_per_split, per_cta));
  const int n_splits = sk.n_splits, k_begin = sk.k_begin, k_end = sk.k_end;
  if (!sk.active && (!CLUSTER || n_splits == 1)) return;
  if constexpr (CLUSTER) {
    if (n_splits > 1) cluster_arrive_relaxed();  // waited for in merge_in_cluster
  }
  MQA_BYOC_PHASE(1);
  const T* kbase = static_cast<const T*>(a.k);
  const T* vbase = static_cast<const T*>(a.v);

  // ---- the warp's state; query rows kvh*group + row0 + r, those past the group zero ----
  Warp w;
  w.init(static_cast<const T*>(a.q) + int64_t(b) * a.q_stride[0] + int64_t(kvh * group + row0) * a.q_stride[1],
         a.q_stride[1], group - row0, lane / 4, lane % 4);

  // ---- this warp's tiles: k_begin + (warp + W i) * 16 ----
  const int n_tiles_split = (k_end - k_begin + kTileKeys - 1) / kTileKeys;
  const int my_tiles = n_tiles_split > warp ? (n_tiles_split - warp + W - 1) / W : 0;
  T* pipe = reinterpret_cast<T*>(smem) + warp * kStg * 2 * kTileKeys * D;

  // Each lane copies chunk `ch` of rows row_lane + it * kRowsPerIt of a tile: from one start pointer and
  // constant steps (few instructions per copy: the loop is issue-bound otherwise). Contiguous K/V: one
  // offset per tile. Pages: when a tile lies in one page (page size a multiple of 16), one page lookup per
  // tile, issued a tile ahead so that its latency hides behind the compute; otherwise each row's page.
  constexpr int kRowsPerIt = 32 / kChunks;
  const int ch = lane % kChunks, row_lane = lane / kChunks;
  const int64_t k_row = a.k_stride[1], v_row = a.v_stride[1];
  const int page_size = PAGED ? int(a.page_size) : 1;
  const bool tile_in_page = PAGED && page_size % kTileKeys == 0 && k_begin % kTileKeys == 0;
  // a tile's page and first row in it: a shift and a mask for a power-of-two page size (TVM's 16, 128,
  // 256; an integer division costs ~20 instructions of an issue-bound step), else a division
  const int page_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
  auto page_of = [&](int key) { return page_shift >= 0 ? key >> page_shift : key / page_size; };
  auto row_in_page = [&](int key) { return page_shift >= 0 ? key & (page_size - 1) : key % page_size; };
  const int* pages_of_b = PAGED ? a.page_values + a.page_indptr[b] : nullptr;
  const int64_t k_fixed = (PAGED ? 0 : int64_t(b) * a.k_stride[0]) + int64_t(kvh) * a.k_stride[2] + ch * 8;
  const int64_t v_fixed = (PAGED ? 0 : int64_t(b) * a.v_stride[0]) + int64_t(kvh) * a.v_stride[2] + ch * 8;
  auto tile_page = [&](int i) -> int {  // page of tile i (tile_in_page only); 0 past this warp's tiles
    return i < my_tiles ? __ldg(pages_of_b + page_of(k_begin + (warp + i * W) * kTileKeys)) : 0;
  };
  // This lane's shared-memory destinations in stage 0's K tile (V: + kVBytes, stage s: + s * kStageBytes):
  // the swizzle repeats every 8 rows, so kPeriod addresses serve all kIters rows of a tile.
  constexpr int kIters = kTileKeys / kRowsPerIt, kPeriod = 8 / kRowsPerIt < kIters ? 8 / kRowsPerIt : kIters;
  constexpr uint32_t kVBytes = kTileKeys * D * sizeof(T), kStageBytes = 2 * kVBytes;
  const uint32_t dst_base = smem_addr(pipe);  // the warp's stage 0
  uint32_t dst0[kPeriod];
#pragma unroll
  for (int p = 0; p < kPeriod; ++p) dst0[p] = dst_base + 16u * uint32_t(swz<D>(row_lane + p * kRowsPerIt, ch));
  auto dst = [&](uint32_t stage_off, int it) {  // rows it and it + kPeriod * m differ by 8 m rows of D * 2 bytes
    return dst0[it % kPeriod] + stage_off + uint32_t(it / kPeriod) * (8 * D * 2);
  };
  const int64_t k_step = kRowsPerIt * k_row, v_step = kRowsPerIt * v_row;  // between a lane's rows
  const bool rows_packed = k_row == D && v_row == D;  // TVM's pages, a contiguous cache of one K/V head
  // contiguous K/V: this lane's first row of the warp's next tile to load (one add per tile)
  const T* k_next = kbase + k_fixed + int64_t(k_begin + warp * kTileKeys + row_lane) * k_row;
  const T* v_next = vbase + v_fixed + int64_t(k_begin + warp * kTileKeys + row_lane) * v_row;
  const int64_t k_tile = int64_t(W) * kTileKeys * k_row, v_tile = int64_t(W) * kTileKeys * v_row;
  // TVM's pages (a tile in one page, rows D apart, K and V a fixed distance apart, a page stride of 32
  // bits): a tile's K rows from this lane's row of page 0 plus page x stride (one wide multiply), its V
  // rows at a constant distance from them
  const bool fast_pages = PAGED && tile_in_page && rows_packed && a.k_stride[0] == a.v_stride[0] &&
                          a.k_stride[0] >= 0 && a.k_stride[0] * int64_t(sizeof(T)) <= 0xffffffffll;
  // (bytes, unsigned: two wide multiply-adds a tile)
  const uint32_t page_bytes = uint32_t(a.k_stride[0]) * uint32_t(sizeof(T));
  const char* k_lane0 = reinterpret_cast<const char*>(kbase + k_fixed + row_lane * D);
  const int64_t kv_delta = fast_pages ? reinterpret_cast<const char*>(vbase + v_fixed) -
                                            reinterpret_cast<const char*>(kbase + k_fixed)
                                      : 0;  // one allocation: the pages
  auto load_tile = [&](int i, uint32_t stage, int page) {
    const int key0 = k_begin + (warp + i * W) * kTileKeys;
    if (fast_pages && key0 + kTileKeys <= k_end) {
      const char* kp = k_lane0 + uint64_t(uint32_t(page)) * page_bytes +
                       uint64_t(uint32_t(row_in_page(key0))) * uint32_t(D * sizeof(T));
      const char* vp = kp + kv_delta;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        cp_async16(dst(stage, it), kp + it * kRowsPerIt * D * sizeof(T));
        cp_async16(dst(stage, it) + kVBytes, vp + it * kRowsPerIt * D * sizeof(T));
      }
      return;
    }
    if (PAGED && !tile_in_page) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int r = row_lane + it * kRowsPerIt, key = key0 + r;
        const bool ok = key < k_end;
        const int64_t ko = ok ? row_offset(a, a.k_stride, b, key, kvh) + ch * 8 : 0;
        const int64_t vo = ok ? row_offset(a, a.v_stride, b, key, kvh) + ch * 8 : 0;
        cp_async16(dst(stage, it), kbase + ko, ok ? 16 : 0);
        cp_async16(dst(stage, it) + kVBytes, vbase + vo, ok ? 16 : 0);
      }
      return;
    }
    // first row of this lane: a row of the sequence (contiguous) or of the tile's page
    const T* kp = k_next;
    const T* vp = v_next;
    if constexpr (PAGED) {
      const int64_t row0 = row_in_page(key0) + row_lane;
      kp = kbase + k_fixed + int64_t(page) * a.k_stride[0] + row0 * k_row;
      vp = vbase + v_fixed + int64_t(page) * a.v_stride[0] + row0 * v_row;
    } else {
      k_next += k_tile;
      v_next += v_tile;
    }
    if (key0 + kTileKeys <= k_end) {  // a whole tile: no row past the end
      if (rows_packed) {  // rows D apart (pages; one K/V head): constant offsets from one address each
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
          cp_async16(dst(stage, it), kp + it * kRowsPerIt * D);
          cp_async16(dst(stage, it) + kVBytes, vp + it * kRowsPerIt * D);
        }
        return;
      }
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        cp_async16(dst(stage, it), kp);
        cp_async16(dst(stage, it) + kVBytes, vp);
        kp += k_step;
        vp += v_step;
      }
      return;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool ok = key0 + row_lane + it * kRowsPerIt < k_end;
      cp_async16(dst(stage, it), ok ? kp : kbase, ok ? 16 : 0);
      cp_async16(dst(stage, it) + kVBytes, ok ? vp : vbase, ok ? 16 : 0);
      kp += k_step;
      vp += v_step;
    }
  };

  int page_next = tile_in_page ? tile_page(0) : 0;
#pragma unroll
  for (int i = 0; i < kStg - 1; ++i) {
    const int page = page_next;
    page_next = tile_in_page ? tile_page(i + 1) : 0;
    if (i < my_tiles) load_tile(i, uint32_t(i) * kStageBytes, page);
    cp_async_commit();
  }
  MQA_BYOC_PHASE(2);

  const float scale = a.softmax_scale * 1.4426950408889634f;  // scores in the log2 domain

  // byte offsets of the stage computed on and of the one loaded next, rotating (no modulo in the loop)
  constexpr uint32_t kPipeBytes = kStg * kStageBytes;
  uint32_t stage_c = 0, stage_l = (kStg - 1) * kStageBytes;
  auto next_stage = [](uint32_t st) { return st + kStageBytes == kPipeBytes ? 0u : st + kStageBytes; };
  for (int i = 0; i < my_tiles; ++i) {
    {
      const int ahead = i + kStg - 1, page = page_next;
      page_next = tile_in_page ? tile_page(ahead + 1) : 0;
      if (ahead < my_tiles) load_tile(ahead, stage_l, page);
      stage_l = next_stage(stage_l);
    }
    cp_async_commit();
    cp_async_wait<kStg - 1>();
    __syncwarp();
    const uint32_t ks = dst_base + stage_c;
    if (i == 0) MQA_BYOC_PHASE(3);
    stage_c = next_stage(stage_c);
    const int key0 = k_begin + (warp + i * W) * kTileKeys;

    if (key0 + kTileKeys <= k_end) {
      w.template step<false>(ks, ks + kVBytes, key0, k_end, scale, lane);
    } else {
      w.template step<true>(ks, ks + kVBytes, key0, k_end, scale, lane);
    }
    __syncwarp();
  }
  cp_async_wait<0>();

  // ---- merge the W warps: row statistics first ----
  MQA_BYOC_PHASE(4);
  w.stats(s_m, s_l, warp, lane);
  __syncthreads();  // also: every warp is done with the pipeline memory reused below
  float* s_o = reinterpret_cast<float*>(smem);  // [warp][row][S::kOStride]
  w.template output<S::kOStride>(s_o, warp, lane, [&](int r, float mine) {
    float mx = -INFINITY;
#pragma unroll
    for (int v = 0; v < W; ++v) mx = fmaxf(mx, s_m[v * kRows + r]);
    float l_tot = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) {
      const float mv = s_m[v * kRows + r];
      l_tot += mv == -INFINITY ? 0.f : exp2f(mv - mx) * s_l[v * kRows + r];
    }
    if (warp == 0) s_f[r] = l_tot > 0.f ? mx + log2f(l_tot) : -INFINITY;  // block LSE (base 2)
    return (mine == -INFINITY || l_tot == 0.f) ? 0.f : exp2f(mine - mx) / l_tot;
  });
  __syncthreads();

  MQA_BYOC_PHASE(5);
  static_assert(kMaxSplits * kRows * 4 <= S::kMainBytes, "the split weights must fit the merge buffer");
  const int64_t part0 = (int64_t(b) * gridDim.y + blockIdx.y) * gridDim.x;  // the slot's gridDim.x partials
  finish_block<T, D, CLUSTER, W, S::kOStride>(a, smem, s_o, s_f, s_l, s_flag, s_recv, s_recv_l, n_splits, kRows, group,
                                              row0, b, kvh, rg, row_groups, part0, split, o_part, lse_part,
                                              counters, kThreads);
  MQA_BYOC_PHASE(6);
}

// ---- Groups of more than 16 query rows at head dim 64 (Falcon's 71, StarCoder-like MQA): SharedTiles ----
// The classic blocks above give each warp its own key tiles, so a group of R row tiles streams its K/V
// head R times, every warp issuing the loads of every tile it computes on (at 71/1/64 about a quarter of
// a 16-key step's instructions). Here the group's row tiles (up to 8, one a warp) are the warps of one
// CTA: the CTA loads 64-key tiles of K and V together (each thread a few 16-byte chunks: one read of the
// K/V head per 128 query rows), one barrier a tile, and every warp runs its 16 rows over the tile's four
// 16-key steps (RowsAsM's step). The warps hold distinct rows over the same keys: no merge among them;
// the splits merge as the classic blocks' do (finish_block).
constexpr int kShTileKeys = 64;  // keys of a CTA tile
constexpr int kShStages = 3;     // CTA tiles in flight (16 KB each at head dim 64)
constexpr int kShMaxWarps = 8;   // row tiles of a CTA: 128 query rows
// keys of a warp's softmax step (RowsAsM's step over two 16-key chunks: one max and one rescale per 32
// keys, twice the independent MMAs between them)
constexpr int kShStepKeys = 32;

template <int D>
struct SharedSmem {
  static constexpr int kMaxRows = 16 * kShMaxWarps;
  static constexpr int kTileBytes = kShTileKeys * D * 2;  // the K (or V) rows of a CTA tile
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kPipeBytes = kShStages * kStageBytes;
  static constexpr int kOStride = D + 8;  // RowsAsM's padded output rows (no bank conflicts)
  static constexpr int kMergeBytes = kMaxRows * kOStride * 4;
  static constexpr int kMainBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  static constexpr int kStatsBytes = 3 * kMaxRows * 4 + 64;
  // the splits merged through the workspace: the last CTA's split weights live in the main buffer
  static constexpr int max_splits(int rows) { return kMainBytes / (rows * 4) < kMaxSplits ? kMainBytes / (rows * 4) : kMaxSplits; }
  static constexpr size_t bytes(int rows, bool cluster) {
    return size_t(kMainBytes) + kStatsBytes +
           (cluster ? size_t(rows * D / 4 + kMaxCluster) * 16 + size_t(kMaxCluster) * rows * 4 : 0);
  }
};

// Packed splits (a SharedTiles plan's shared_tiles 2, on pages): every sequence is cut into splits, at
// least one a sequence, numbered across the sequences in their order; CTA x of
// the grid's x (the CTAs the SMs hold, at least one a sequence) takes split x. So a long sequence gets more
// CTAs than a short one and every CTA about the same work, where the per-slot plans give each sequence the
// same CTAs (with lengths of 1k-16k the 16k sequences' CTAs then set the time). The split size: the
// smallest multiple of 64 keys, at least `min_kps`, whose splits fit the grid and the merge's weights
// (max_splits a sequence), from the total of the keys up in steps of 1/16; a sequence then cuts its keys
// into as many splits of even size (whole tiles, none over that size). Every CTA finds it and its own
// sequence from the lengths (in s_len, the batch's ints, before the pipeline uses that memory), by block
// sums and one warp's prefix sum of the split counts. b = -1: a CTA past the last split.
struct PackedWork {
  int b, split, n_splits, first, kps;  // first: the number of the sequence's split 0
  int begin, end;                      // the sequence's keys (SeqRange), where found (end < 0: not)
};
// At most 32 sequences: warp 0 alone, a sequence a lane (shuffles, no block barrier but the last).
__device__ __forceinline__ PackedWork packed_work_warp(const mqa_byoc_decode_args& a, int min_kps, int max_splits,
                                                       PackedWork* s_work) {
  const int batch = int(a.batch), x = int(blockIdx.x), grid = int(gridDim.x), lane = threadIdx.x % 32;
  if (threadIdx.x < 32) {
    SeqRange sr{0, 0};
    if (lane < batch) sr = seq_range(a, lane);
    const int len = sr.end - sr.begin;
    int tiles = (len + kShTileKeys - 1) / kShTileKeys, longest = len;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      tiles += __shfl_xor_sync(0xffffffffu, tiles, off);
      longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, off));
    }
    auto up = [](int k) { return (k + kShTileKeys - 1) / kShTileKeys * kShTileKeys; };
    int kps = max(min_kps, max(up((longest + max_splits - 1) / max_splits), (tiles + grid - 1) / grid * kShTileKeys));
    int c;
    for (;;) {  // as packed_work: at most the longest sequence's keys (one split each: batch <= grid)
      c = lane < batch ? max(1, (len + kps - 1) / kps) : 0;
      int count = c;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) count += __shfl_xor_sync(0xffffffffu, count, off);
      if (count <= grid) break;
      kps = up(kps + max(kShTileKeys, kps / 16));
    }
    int incl = c;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    const int first = incl - c;
    const unsigned hit = __ballot_sync(0xffffffffu, c > 0 && x >= first && x < first + c);
    PackedWork w{-1, 0, 0, 0, kps, 0, -1};
    if (hit != 0u) {
      const int src = __ffs(hit) - 1, f = __shfl_sync(0xffffffffu, first, src);
      const int n = __shfl_sync(0xffffffffu, c, src), l = __shfl_sync(0xffffffffu, len, src);
      const int begin = __shfl_sync(0xffffffffu, sr.begin, src), end = __shfl_sync(0xffffffffu, sr.end, src);
      w = {src, x - f, n, f, max(kShTileKeys, up((l + n - 1) / n)), begin, end};
    }
    if (lane == 0) *s_work = w;
  }
  __syncthreads();
  return *s_work;
}

__device__ __forceinline__ PackedWork packed_work(const mqa_byoc_decode_args& a, int min_kps, int max_splits,
                                                  int* s_len, int* s_red, PackedWork* s_work, int n_threads) {
  const int batch = int(a.batch), x = int(blockIdx.x), grid = int(gridDim.x);
  if (batch <= 32) return packed_work_warp(a, min_kps, max_splits, s_work);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = n_threads / 32;
  auto block_sum = [&](int v) {  // every thread's v summed (a count: at most the grid, or keys / 64)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    int tot = 0;
    for (int w = 0; w < n_warps; ++w) tot += s_red[w];
    __syncthreads();  // s_red free again
    return tot;
  };
  int tiles = 0, longest = 0;  // 64-key tiles (the total's bound stays far from 2^31), the longest length
  for (int j = threadIdx.x; j < batch; j += n_threads) {
    const SeqRange sr = seq_range(a, j);
    const int len = sr.end - sr.begin;
    s_len[j] = len;
    tiles += (len + kShTileKeys - 1) / kShTileKeys;
    longest = max(longest, len);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, off));
  // the warps' maxima after the block sums' ints: a CTA has up to 2 kShMaxWarps warps (two key groups)
  if (lane == 0) s_red[2 * kShMaxWarps + warp] = longest;
  const int total_tiles = block_sum(tiles);  // (its barrier also publishes the maxima and s_len)
  for (int w = 0; w < n_warps; ++w) longest = max(longest, s_red[2 * kShMaxWarps + w]);
  auto up = [](int k) { return (k + kShTileKeys - 1) / kShTileKeys * kShTileKeys; };
  int kps = max(min_kps, max(up((longest + max_splits - 1) / max_splits), (total_tiles + grid - 1) / grid * kShTileKeys));
  for (;;) {  // at most the longest sequence's keys (one split each: batch <= grid)
    int count = 0;
    for (int j = threadIdx.x; j < batch; j += n_threads) count += max(1, (s_len[j] + kps - 1) / kps);
    if (block_sum(count) <= grid) break;
    kps = up(kps + max(kShTileKeys, kps / 16));
  }
  if (threadIdx.x < 32) {
    int carry = 0;
    PackedWork w{-1, 0, 0, 0, kps, 0, -1};
    for (int j0 = 0; j0 < batch; j0 += 32) {
      const int j = j0 + lane, c = j < batch ? max(1, (s_len[j] + kps - 1) / kps) : 0;
      int incl = c;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
      }
      const int first = carry + incl - c;
      const unsigned hit = __ballot_sync(0xffffffffu, c > 0 && x >= first && x < first + c);
      if (hit != 0u) {
        const int src = __ffs(hit) - 1, f = __shfl_sync(0xffffffffu, first, src);
        const int n = __shfl_sync(0xffffffffu, c, src), len = s_len[j0 + src];
        // the sequence's n splits of even size (whole tiles: still n of them, none over kps): a split of
        // kps keys and a short last one would set the pace
        w = {j0 + src, x - f, n, f, max(kShTileKeys, up((len + n - 1) / n)), 0, -1};
        break;
      }
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) *s_work = w;
  }
  __syncthreads();  // also: s_len is read, the pipeline may take its memory
  return *s_work;
}

template <typename T, int D, bool PAGED, bool CLUSTER, int KG>
__global__ void __launch_bounds__(KG * kShMaxWarps * 32, 2 / KG)
    gqa_decode_shared_kernel(const mqa_byoc_decode_args a, int keys_per_split, int row_groups, float* o_part,
                             float* lse_part, int* counters, int packed, int2* slot_splits) {
  enter_after_previous_kernel();
  using S = SharedSmem<D>;
  using Warp = RowsAsM<T, D, 1>;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTileChunks = kShTileKeys * kChunks;
  constexpr uint32_t kStepBytes = kShStepKeys * D * 2;  // the keys of one step of a warp
  // the row tiles (16 rows a warp), KG key groups of them (KG 2: warp w runs row tile w % row_warps over
  // step w / row_warps of each tile's two 32-key steps; the plan's `warps` are KG times the row tiles)
  const int n_threads = int(blockDim.x), kRows = n_threads / (2 * KG), row_warps = kRows / 16;
  const int group = int(a.num_heads / a.num_heads_k);
  extern __shared__ __align__(128) unsigned char smem[];
  float* s_m = reinterpret_cast<float*>(smem + S::kMainBytes);  // [row]
  float* s_l = s_m + S::kMaxRows;
  float* s_f = s_l + S::kMaxRows;
  int* s_flag = reinterpret_cast<int*>(s_f + S::kMaxRows);
  float4* s_recv = reinterpret_cast<float4*>(smem + S::kMainBytes + S::kStatsBytes);
  float* s_recv_l = reinterpret_cast<float*>(s_recv + kRows * D / 4 + kMaxCluster);

  const int kvh = blockIdx.y / row_groups, rg = blockIdx.y % row_groups;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = KG == 1 ? warp : warp % row_warps, kgi = KG == 1 ? 0 : warp / row_warps;
  const int row0 = rg * kRows;
  int split = blockIdx.x, b = blockIdx.z;
  MQA_BYOC_PHASE(0);
  int64_t part0;  // the workspace index of the slot's first partial
  SplitKeys sk;
  if (!CLUSTER && packed) {
    const int max_splits = min(S::kMainBytes / (kRows * 4), kMaxSplits);  // the merge's weights: SharedSmem's
    const PackedWork pw = packed_work(a, keys_per_split, max_splits, reinterpret_cast<int*>(smem),
                                      reinterpret_cast<int*>(s_m), reinterpret_cast<PackedWork*>(s_flag + 4),
                                      n_threads);
    if (pw.b < 0) return;
    b = pw.b, split = pw.split;
    part0 = int64_t(blockIdx.y) * gridDim.x + pw.first;
    sk = split_keys(pw.end >= 0 ? SeqRange{pw.begin, pw.end} : seq_range(a, b), split, pw.kps);
  } else {
    // each sequence cuts its own keys into at most gridDim.x splits of whole tiles, at least keys_per_split
    // each (the plan sizes the grid by the GPU, not by the longest sequence a call's pages could hold)
    const SeqRange sr = seq_range(a, b);
    const int len = sr.end - sr.begin;
    const int per_cta = (len + int(gridDim.x) * kShTileKeys - 1) / (int(gridDim.x) * kShTileKeys) * kShTileKeys;
    sk = split_keys(sr, split, max(keys_per_split, per_cta));
    part0 = (int64_t(b) * gridDim.y + blockIdx.y) * gridDim.x;
  }
  const int n_splits = sk.n_splits, k_begin = sk.k_begin, k_end = sk.k_end;
  if (!CLUSTER && slot_splits != nullptr && split == 0 && threadIdx.x == 0) {  // for the merge kernel
    slot_splits[int64_t(b) * gridDim.y + blockIdx.y] = make_int2(int(part0), n_splits);
  }
  if (!sk.active && (!CLUSTER || n_splits == 1)) return;
  if constexpr (CLUSTER) {
    if (n_splits > 1) cluster_arrive_relaxed();  // waited for in merge_in_cluster
  }
  MQA_BYOC_PHASE(1);
  const T* kbase = static_cast<const T*>(a.k);
  const T* vbase = static_cast<const T*>(a.v);

  Warp w;  // rows row0 + 16 warp .. + 15 of the group (those past it zero, never written)
  const int my_row0 = row0 + 16 * wr;
  w.init(static_cast<const T*>(a.q) + int64_t(b) * a.q_stride[0] +
             int64_t(kvh * group + min(my_row0, group - 1)) * a.q_stride[1],
         a.q_stride[1], group - my_row0, lane / 4, lane % 4);

  // ---- the CTA's tiles: keys k_begin + 64 t; thread x loads chunks x, x + n_threads, .. of K and of V ----
  const int n_tiles = (k_end - k_begin + kShTileKeys - 1) / kShTileKeys;
  const int page_size = PAGED ? int(a.page_size) : 1;
  const int page_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
  auto page_of = [&](int key) { return page_shift >= 0 ? key >> page_shift : key / page_size; };
  auto row_in_page = [&](int key) { return page_shift >= 0 ? key & (page_size - 1) : key % page_size; };
  const int* pages_of_b = PAGED ? a.page_values + a.page_indptr[b] : nullptr;
  const int64_t k_row = a.k_stride[1], v_row = a.v_stride[1];
  // a tile in one page with its rows D apart (TVM's pages; a one-head contiguous cache): its K rows are
  // 64 D contiguous elements, chunk x at 16 x bytes; V at a constant distance where the strides agree
  const bool contiguous_rows = k_row == D && v_row == D;
  const bool tile_in_page = !PAGED || (page_size % kShTileKeys == 0 && k_begin % kShTileKeys == 0);
  const bool fast = contiguous_rows && tile_in_page;
  const int64_t k_head = int64_t(kvh) * a.k_stride[2], v_head = int64_t(kvh) * a.v_stride[2];
  const uint32_t pipe = smem_addr(smem);
  auto load = [&](int t, uint32_t stage_off) {
    const int key0 = k_begin + t * kShTileKeys;
    const uint32_t dst0 = pipe + stage_off;
    if (fast) {
      int64_t kt, vt;  // element offsets of the tile's first K / V row
      if constexpr (PAGED) {
        const int page = __ldg(pages_of_b + page_of(key0));
        kt = int64_t(page) * a.k_stride[0] + int64_t(row_in_page(key0)) * D + k_head;
        vt = int64_t(page) * a.v_stride[0] + int64_t(row_in_page(key0)) * D + v_head;
      } else {
        kt = int64_t(b) * a.k_stride[0] + int64_t(key0) * D + k_head;
        vt = int64_t(b) * a.v_stride[0] + int64_t(key0) * D + v_head;
      }
      const char* kp = reinterpret_cast<const char*>(kbase + kt);
      const char* vp = reinterpret_cast<const char*>(vbase + vt);
      const int rows_left = k_end - key0;
      for (int x = threadIdx.x; x < kTileChunks; x += n_threads) {
        const int row = x / kChunks;
        const uint32_t d = dst0 + 16u * uint32_t(x ^ (row & 7));
        const bool ok = row < rows_left;  // rows past the end: zeros (no NaN from stale memory)
        cp_async16(d, ok ? kp + 16 * x : kp, ok ? 16 : 0);
        cp_async16(d + S::kTileBytes, ok ? vp + 16 * x : vp, ok ? 16 : 0);
      }
      return;
    }
    for (int x = threadIdx.x; x < kTileChunks; x += n_threads) {
      const int row = x / kChunks, ch = x % kChunks, key = key0 + row;
      const uint32_t d = dst0 + 16u * uint32_t(x ^ (row & 7));
      const bool ok = key < k_end;
      int64_t ko = 0, vo = 0;
      if (ok) {
        if constexpr (PAGED) {
          const int64_t page = __ldg(pages_of_b + page_of(key)), r = row_in_page(key);
          ko = page * a.k_stride[0] + r * k_row + k_head + ch * 8;
          vo = page * a.v_stride[0] + r * v_row + v_head + ch * 8;
        } else {
          ko = int64_t(b) * a.k_stride[0] + int64_t(key) * k_row + k_head + ch * 8;
          vo = int64_t(b) * a.v_stride[0] + int64_t(key) * v_row + v_head + ch * 8;
        }
      }
      cp_async16(d, kbase + ko, ok ? 16 : 0);
      cp_async16(d + S::kTileBytes, vbase + vo, ok ? 16 : 0);
    }
  };

#pragma unroll
  for (int t = 0; t < kShStages - 1; ++t) {
    if (t < n_tiles) load(t, uint32_t(t) * S::kStageBytes);
    cp_async_commit();
  }
  MQA_BYOC_PHASE(2);
  const float scale = a.softmax_scale * 1.4426950408889634f;  // scores in the log2 domain
  auto next_stage = [](uint32_t st) { return st + S::kStageBytes == S::kPipeBytes ? 0u : st + S::kStageBytes; };
  uint32_t stage_c = 0, stage_l = (kShStages - 1) * S::kStageBytes;
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<kShStages - 2>();  // this thread's chunks of tile t
    __syncthreads();                 // everyone's; and every warp is done with tile t - 1, whose stage is next
    if (t == 0) MQA_BYOC_PHASE(3);
    if (t + kShStages - 1 < n_tiles) load(t + kShStages - 1, stage_l);
    cp_async_commit();
    stage_l = next_stage(stage_l);
    const uint32_t ks = pipe + stage_c;
    stage_c = next_stage(stage_c);
    const int key0 = k_begin + t * kShTileKeys;
#pragma unroll
    for (int jj = 0; jj < kShTileKeys / kShStepKeys / KG; ++jj) {
      const int j = jj * KG + kgi;
      const int key = key0 + j * kShStepKeys;
      if (key >= k_end) break;
      const uint32_t kj = ks + uint32_t(j) * kStepBytes;
      if (key + kShStepKeys <= k_end) {
        w.template step<false, kShStepKeys / kTileKeys>(kj, kj + S::kTileBytes, key, k_end, scale, lane);
      } else {
        w.template step<true, kShStepKeys / kTileKeys>(kj, kj + S::kTileBytes, key, k_end, scale, lane);
      }
    }
  }
  cp_async_wait<0>();
  MQA_BYOC_PHASE(4);
  float* s_o = reinterpret_cast<float*>(smem);  // [key group][row][S::kOStride]
  if constexpr (KG == 1) {
    // ---- each warp's rows are its own: normalized by their sums, the block's LSE per row ----
    w.stats(s_m, s_l, warp, lane);  // [row of the CTA]: s_m[16 warp + r]
    __syncthreads();                // also: every warp is done with the pipeline memory reused below
    w.template output<S::kOStride>(s_o, warp, lane, [&](int r, float mine) {
      const float l = s_l[16 * warp + r];
      const bool none = mine == -INFINITY || l == 0.f;
      s_f[16 * warp + r] = none ? -INFINITY : mine + log2f(l);  // the block LSE (base 2)
      return none ? 0.f : 1.f / l;
    });
  } else {
    // ---- two key groups: each row's two shares weighted by the block's softmax (as the classic blocks'
    // warps); key group 1's statistics after both groups' outputs in the main buffer, once every warp is
    // done with the pipeline ----
    float* t_m = s_o + 2 * kRows * S::kOStride;
    float* t_l = t_m + kRows;
    __syncthreads();
    w.stats(kgi == 0 ? s_m : t_m, kgi == 0 ? s_l : t_l, wr, lane);
    __syncthreads();
    w.template output<S::kOStride>(s_o, warp, lane, [&](int r, float mine) {
      const int cr = 16 * wr + r;
      const float m0 = s_m[cr], m1 = t_m[cr], mx = fmaxf(m0, m1);
      const float l_tot = (m0 == -INFINITY ? 0.f : exp2f(m0 - mx) * s_l[cr]) +
                          (m1 == -INFINITY ? 0.f : exp2f(m1 - mx) * t_l[cr]);
      if (kgi == 0) s_f[cr] = l_tot > 0.f ? mx + log2f(l_tot) : -INFINITY;  // the block LSE (base 2)
      return (mine == -INFINITY || l_tot == 0.f) ? 0.f : exp2f(mine - mx) / l_tot;
    });
  }
  __syncthreads();
  MQA_BYOC_PHASE(5);
  finish_block<T, D, CLUSTER, KG, S::kOStride>(a, smem, s_o, s_f, s_l, s_flag, s_recv, s_recv_l, n_splits, kRows,
                                               group, row0, b, kvh, rg, row_groups, part0, split, o_part,
                                               lse_part, counters, n_threads, !CLUSTER);
  MQA_BYOC_PHASE(6);
}

// The merge of SharedTiles' splits outside a cluster, a kernel of its own after gqa_decode_shared_kernel
// on the stream: block (x, y, b) merges rows kRows x .. of slot (sequence b, K/V head and row group y) from the
// slot's partials (slot_splits[slot]: the first partial's index and the split count, written by the
// slot's split 0; a slot of one split wrote its output itself). A row's threads are its D / 4 float4s
// times G groups of splits (split sp in group sp % G), summed in shared memory at the end. Merged by the
// slot's last CTA instead (580 KB for 71 rows in 32 splits, 8 loads in flight a thread), the calls ran
// 20-29 us past their last tiles (71/1/64 on pages on the H200, 8 sequences in 28-32 splits a slot and 32
// in packed splits; benchmarks/results/2026-12-04-decode-phases-shared-tiles.md); here every row of every
// slot merges at once. G: 4 for a call of few slots (two rows a block; 16 loads in flight a thread
// cover 64 splits of a row; 8 groups, a row a block, took 0.98-1.08x the time at 1-8 sequences of
// 71/1/64), else 1 (8 rows a block, 16 splits in flight a thread: at 32 and 64 sequences 8 groups took
// 2-4x the time, 8 times the blocks; launch_shared_groups).
constexpr int kMergeThreads = 128;
constexpr int kMergeFewSlots = 8;  // slots up to which the merge runs 4 groups of splits a row
template <typename T, int D, int G>
__global__ void __launch_bounds__(kMergeThreads)
    gqa_decode_split_merge_kernel(const mqa_byoc_decode_args a, int k_rows, int row_groups, const float* o_part,
                                  const float* lse_part, const int2* slot_splits) {
  enter_after_previous_kernel();
  using M = Mma<T>;
  constexpr int kRowThreads = D / 4, kRows = kMergeThreads / (kRowThreads * G);
  __shared__ float s_w[kRows][kMaxSplits];
  __shared__ float4 s_acc[G][kMergeThreads / G];
  __shared__ float s_inv[kRows];
  const int b = blockIdx.z, y = blockIdx.y, kvh = y / row_groups, rg = y % row_groups;  // y: (K/V head, row group)
  const int2 ps = slot_splits[int64_t(b) * gridDim.y + y];
  const int n = ps.y;  // at most kMaxSplits (the plans' bound)
  if (n <= 1) return;
  const int group = int(a.num_heads / a.num_heads_k);
  const int row0 = rg * k_rows, rows_here = min(k_rows, group - row0), r_block = blockIdx.x * kRows;
  if (r_block >= rows_here) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The splits' weights, written out here and in finish_block's last-CTA merge: one shared helper for both
  // loops (and named helpers for the packed splits' arithmetic) made 8 sequences of 71/1/64 with mixed
  // lengths 1.06x slower on the H200, outputs equal to the bit (results/2026-12-05-decode-builds-bisect-71).
  for (int i = warp; i < kRows; i += kMergeThreads / 32) {  // a warp a row: the splits' weights
    const int row = r_block + i;
    float mx = -INFINITY;
    for (int sp = lane; sp < n; sp += 32) {
      const float l = row < rows_here ? __ldcg(lse_part + int64_t(ps.x + sp) * k_rows + row) : -INFINITY;
      s_w[i][sp] = l;
      mx = fmaxf(mx, l);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float tot = 0.f;
    for (int sp = lane; sp < n; sp += 32) {
      const float l = s_w[i][sp];
      const float w = l == -INFINITY ? 0.f : exp2f(l - mx);
      s_w[i][sp] = w;
      tot += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, off);
    if (lane == 0) {
      s_inv[i] = tot > 0.f ? 1.f / tot : 0.f;
      if (a.lse != nullptr && row < rows_here) {
        a.lse[int64_t(b) * a.num_heads + kvh * group + row0 + row] = tot > 0.f ? mx + log2f(tot) : a.lse_empty;
      }
    }
  }
  const int t = threadIdx.x % (kMergeThreads / G), g = threadIdx.x / (kMergeThreads / G);
  const int i = t / kRowThreads, d4 = t % kRowThreads, r = r_block + i;
  const bool live = r < rows_here;
  const int64_t stride4 = int64_t(k_rows) * D / 4;  // float4s between two splits' partials
  const float4* src = reinterpret_cast<const float4*>(o_part + int64_t(ps.x) * k_rows * D + int64_t(r) * D) + d4;
  constexpr int kFlight = 16;
  float4 x[kFlight];
  // the first kFlight of this thread's splits, in flight beside the weights
#pragma unroll
  for (int u = 0; u < kFlight; ++u) {
    const int sp = g + u * G;
    x[u] = live && sp < n ? __ldcg(src + sp * stride4) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __syncthreads();  // the weights
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = 0;; base += kFlight * G) {
#pragma unroll
    for (int u = 0; u < kFlight; ++u) {
      const int sp = base + g + u * G;
      const float w = sp < n ? s_w[i][sp] : 0.f;
      v.x += w * x[u].x, v.y += w * x[u].y, v.z += w * x[u].z, v.w += w * x[u].w;
    }
    if (base + kFlight * G >= n) break;
#pragma unroll
    for (int u = 0; u < kFlight; ++u) {
      const int sp = base + kFlight * G + g + u * G;
      x[u] = live && sp < n ? __ldcg(src + sp * stride4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if constexpr (G > 1) {
    s_acc[g][t] = v;
    __syncthreads();
    if (g != 0) return;
    for (int h = 1; h < G; ++h) {
      const float4 o = s_acc[h][t];
      v.x += o.x, v.y += o.y, v.z += o.z, v.w += o.w;
    }
  }
  if (!live) return;
  const float inv = s_inv[i];
  T* o = static_cast<T*>(a.out) + int64_t(b) * a.o_stride[0] + int64_t(kvh * group + row0 + r) * a.o_stride[1] + d4 * 4;
  o[0] = M::from_float(v.x * inv), o[1] = M::from_float(v.y * inv);
  o[2] = M::from_float(v.z * inv), o[3] = M::from_float(v.w * inv);
}

// Per (device, stream): a zeroed arrival-counter array that every kernel leaves zeroed again.
struct CounterKey {
  int device;
  cudaStream_t stream;
  bool operator<(const CounterKey& o) const { return device != o.device ? device < o.device : stream < o.stream; }
};
std::mutex g_counter_mutex;
std::map<CounterKey, std::pair<int*, int64_t>> g_counters;

int* counters_for(int device, cudaStream_t stream, int64_t n) {
  std::lock_guard<std::mutex> lock(g_counter_mutex);
  auto& e = g_counters[{device, stream}];
  if (e.second >= n) return e.first;
  const int64_t cap = std::max<int64_t>(n, 4096);
  int* p = nullptr;
  if (cudaMalloc(&p, size_t(cap) * sizeof(int)) != cudaSuccess) return nullptr;
  if (cudaMemsetAsync(p, 0, size_t(cap) * sizeof(int), stream) != cudaSuccess) return nullptr;
  // an older, smaller array may still be in use by queued kernels: it is kept (rare, small)
  e = {p, cap};
  return p;
}

// Keys of the longest sequence a call can have (contiguous: all alike; pages: all the call's pages),
// within the window.
int64_t longest_keys(const mqa_byoc_decode_args& a) {
  int64_t longest = a.page_values != nullptr ? a.nnz_pages * a.page_size : a.seqlen_k;
  if (a.window_left >= 0) longest = std::min<int64_t>(longest, a.window_left + 1);
  return std::max<int64_t>(longest, 1);
}

// Keys of a typical sequence of a call: contiguous, all alike; on pages, an even share of the call's
// pages (within the window).
int64_t typical_keys(const mqa_byoc_decode_args& a) {
  int64_t typical = a.page_values != nullptr ? (a.nnz_pages * a.page_size + a.batch - 1) / a.batch : a.seqlen_k;
  if (a.window_left >= 0) typical = std::min<int64_t>(typical, a.window_left + 1);
  return std::max<int64_t>(typical, 1);
}

// Splits (the grid's x) of a plan with splits of kps keys: enough for the longest sequence a call can
// hold; on pages, where that is all the call's pages, at most `slack` times a typical sequence's (a
// longer sequence cuts its keys into larger splits itself). Sized for the longest, a batch's grid was
// mostly CTAs without keys: 32 sequences of 2k keys (64/8/128) ran 256 CTAs with keys among 8192.
int64_t grid_splits(const mqa_byoc_decode_args& a, int64_t kps, int64_t slack = 1) {
  const int64_t longest = (longest_keys(a) + kps - 1) / kps;
  if (a.page_values == nullptr) return longest;
  return std::max<int64_t>(1, std::min<int64_t>(longest, (slack * typical_keys(a) + kps - 1) / kps));
}

// Whether a call's group (query heads per K/V head) runs as the MMAs' N (RowsAsN): at most 8.
bool rows_as_n(const mqa_byoc_decode_args& a) { return a.num_heads / a.num_heads_k <= 8; }

// The M tiles of 16 query rows a warp carries unless a plan asks for more: one. More at head dim 64 (71
// query rows in CTAs of 48 + 23 or 32 + 32 + 7, 40 in one of 48 or 32 + 8: each K/V head streamed by
// 1.5-3x fewer CTAs) were no faster on the H200: at most 4% faster (71 heads, 8 and 32 sequences of 16k
// keys), up to 1.4x slower at 8-64 sequences of mixed lengths 1k-16k, 1.3-2.1x slower for one sequence
// (fewer CTAs, each warp doing the MMAs and exponentials of two or three tiles per key tile;
// benchmarks/results/2026-12-02-mqa-decode-tiles.md). At head dim 128 a warp's O of one tile already takes
// 64 registers.
int rule_row_tiles(int64_t head_dim, int64_t group) {
  (void)head_dim;
  (void)group;
  return 1;
}

// The M tiles of a call: `asked` (1..kMaxRowTiles where a kernel carries them: head dim 64, RowsAsM) or,
// 0, the rule's; 0 if none.
int row_tiles_of(const mqa_byoc_decode_args& a, int asked) {
  if (asked == 0) return rule_row_tiles(a.head_dim, a.num_heads / a.num_heads_k);
  if (asked == 1) return 1;
  return asked > 1 && asked <= kMaxRowTiles && a.head_dim == 64 && !rows_as_n(a) ? asked : 0;
}

// SharedTiles (gqa_decode_shared_kernel) by the rule (row_tiles 0): head dim 64 and more than 16 query
// rows a K/V head, where the classic blocks stream the K/V head once per 16 rows.
// Its warps: the group's row tiles, at most 8 (more rows: several row groups).
int shared_warps(const mqa_byoc_decode_args& a) {
  const int64_t tiles = (a.num_heads / a.num_heads_k + 15) / 16;
  return int(std::min<int64_t>(kShMaxWarps, tiles));
}
// Two key groups (a plan's `warps` twice its row tiles: warp w runs row tile w % row tiles over one of each
// tile's two 32-key steps): both groups' outputs and group 1's row statistics fit the main buffer (up to 5
// row tiles: Falcon's 71 query rows).
constexpr bool shared_key_groups_fit(int row_warps) {
  return 2 * 16 * row_warps * (SharedSmem<64>::kOStride * 4 + 4) <= SharedSmem<64>::kMainBytes;
}
constexpr int kShMaxGrid = 64;   // splits (CTAs) a slot at most: the last CTA's merge reads them all
constexpr int kShMinKeys = 256;  // keys a split at least (the plan's)
// Slots ((sequence, K/V head, row group)) from which the rule takes SharedTiles, and the most splits its
// plan makes (a cluster's worth). Measured on the H200 (71/1/64 on TVM's pages,
// benchmarks/results/2026-12-02-decode-shared-tiles-sweep.md, -mid.md): 32 and 64 sequences 0.52-0.96x the
// classic blocks' time; 16 and 24 sequences in 16 splits 0.64-0.90x; 8 sequences at best 1.01-1.38x (one
// slot a sequence fills the GPU only with short splits); one sequence runs the classic blocks. With the
// 32-key step (benchmarks/results/2026-12-03-decode-shared-tiles-few.md): CTAs of 4 warps or more (71/1/64:
// 5) from 12 slots on (at 12-16 sequences 0.57-0.89x the classic blocks' time, at 10 1.03x with mixed
// lengths); of fewer warps (40/2/64: 2, each CTA's K/V tile shared by fewer rows) from 48 (at 24-64
// sequences, 48-128 slots, 0.62-0.95x; at 6-16 sequences 1.16-1.45x with mixed lengths). Since the
// splits merged through the workspace merge in a kernel of their own (gqa_decode_split_merge_kernel), CTAs of 4 warps
// or more take SharedTiles from 8 slots on pages, always in packed splits
// (benchmarks/results/2026-12-04-decode-shared-tiles-merge.md, 71/1/64 on pages of 256: packed splits at
// 8 sequences 0.70x the classic blocks' time with every sequence at 16k, 0.94x with mixed lengths; at 12
// and 16 sequences 0.66-0.88x the time of 16 splits merged in clusters (the plan before); at 4 sequences
// 1.07x with mixed lengths, 0.89x at 16k: classic blocks there). With two key
// groups (below), on pages whose size is a multiple of a 64-key tile (a tile's rows from one page), from
// 16 slots (benchmarks/results/2026-12-04-decode-shared-tiles-key-groups.md, 40/2/64 on pages of 256: at 8
// sequences 0.73-0.94x the classic blocks' time, at 12-64 0.59-0.98x; at 6, 12 slots, 1.04x with mixed
// lengths); on pages of 16 the 8 sequences of mixed lengths took 1.22x the classic blocks' time, so other
// K/V (and contiguous K/V of several heads, whose rows are loaded one by one too) keep 48.
// CTAs of 5 row tiles (Falcon's 71 query rows) on pages: packed splits from 4 slots and splits of at least 128
// keys; over two CTAs an SM (not the three it holds) up to 32 sequences on pages of whole 64-key tiles, up to 8 on
// others. Swept on the H100 (71/1/64, pages of 256, 4 to 32 sequences, mixed lengths and 16k, grids of 1-4 CTAs an
// SM x 64-512 keys a split): 0.74-1.00x the time of the plan before (three CTAs an SM, 256 keys, the classic
// blocks below 8 sequences; benchmarks/results/2026-12-07-decode-packed-grid-71-h100.md). Two CTAs an SM at every
// batch (2026-12-07-decode-builds-packed-71-first-h100.md) took 1.05-1.10x the time of three at 64 sequences on
// pages of 256, and on pages of 16 (a row's page looked up per row) 1.05-1.23x from 12 sequences at 16k and from
// 32 of mixed lengths on; this rule against the plan before, 1 to 64 sequences on pages of 256 and 16, fp16 and
// bf16 (2026-12-07-decode-builds-packed-71-h100.md): 0.71-1.01x.
constexpr int kShMinSlots = 12;
constexpr int kShMinSlotsPacked = 8;  // CTAs of 4 warps or more on pages (packed splits)
constexpr int kShPackedWideWarps = 5;  // CTAs of this many row tiles (the measured ones): the packed plan below
constexpr int kShMinSlotsPackedWide = 4;
constexpr int kShPackedWideCtasPerSm = 2;
constexpr int kShPackedWideMaxBatchTilePages = 32;  // two CTAs an SM up to this many sequences
constexpr int kShPackedWideMaxBatch = 8;            // the same on pages of other sizes
constexpr int kShPackedWideMinKeys = 128;
constexpr int kShMinSlotsFewWarps = 48;
constexpr int kShMinSlotsKeyGroups = 16;
// Key groups of a SharedTiles plan: two for CTAs of at most 2 row tiles (each warp's chain of steps
// halved, twice the warps an SM): 40/2/64 on pages of 256 at 4-64 sequences 0.70-0.96x the time of one
// group (same grid; the same file). At 5 row tiles (Falcon's 71/1/64: 10 warps, one CTA an SM) two
// were faster only where the grid held about a CTA an SM or fewer (0.83-0.88x at 6-8 sequences of 16k
// keys), slower with mixed lengths at 8 and from 10 sequences on, which a plan cannot tell from lengths
// it does not see (2026-12-04-decode-shared-tiles-key-groups-71.md): one there; 3 and 4 row tiles were not
// measured: one.
constexpr int kShKeyGroupsMaxRowTiles = 2;
int shared_key_groups(int row_warps) { return row_warps <= kShKeyGroupsMaxRowTiles ? 2 : 1; }
constexpr int kShMaxTarget = kMaxCluster;
// Whether a call runs SharedTiles: asked for (row_tiles MQA_BYOC_DECODE_SHARED_TILES) or by the rule
// (row_tiles 0), at head dim 64 for more than 16 query rows a K/V head.
bool shared_rule(const mqa_byoc_decode_args& a, int asked) {
  if ((asked != 0 && asked != MQA_BYOC_DECODE_SHARED_TILES) || a.head_dim != 64 ||
      a.num_heads / a.num_heads_k <= 16) {
    return false;
  }
  if (asked == MQA_BYOC_DECODE_SHARED_TILES) return true;
  const int warps = shared_warps(a);
  const int64_t rows = 16 * warps;
  const bool tile_pages = a.page_values != nullptr && a.page_size % kShTileKeys == 0;
  const int min_slots = warps == kShPackedWideWarps && a.page_values != nullptr ? kShMinSlotsPackedWide
                        : warps >= 4 && a.page_values != nullptr               ? kShMinSlotsPacked
                        : warps >= 4                                          ? kShMinSlots
                        : shared_key_groups(warps) == 2 && tile_pages ? kShMinSlotsKeyGroups
                                                                      : kShMinSlotsFewWarps;
  return a.batch * a.num_heads_k * ((a.num_heads / a.num_heads_k + rows - 1) / rows) >= min_slots;
}
// Its CTAs an SM holds: 16 warps of 128 registers, and the shared memory.
int shared_ctas_per_sm(int warps, bool cluster) {
  const int by_warps = 16 / warps;
  const int by_smem = int((227 * 1024) / SharedSmem<64>::bytes(16 * warps, cluster));
  return std::max(1, std::min(by_warps, by_smem));
}

template <typename T>
struct Tag {
  using type = T;
};
// Calls fn(Tag<T>, integral_constant D, bool_constant SWAP, integral_constant MT) with the kernel's types
// for a call of `tiles` M tiles a warp: its dtype, head dim (64 or 128; else 2), orientation (RowsAsN for
// groups of at most 8 query heads) and tiles (more than one only at head dim 64 with RowsAsM; else 2).
template <typename F>
int with_kernel_types(const mqa_byoc_decode_args& a, int tiles, F&& fn) {
  const bool swap = rows_as_n(a);
  auto by_tiles = [&](auto tag, auto d, auto sw) -> int {
    if constexpr (kMaxRowTiles > 1 && decltype(d)::value == 64 && !decltype(sw)::value) {
      if (tiles == 2) return fn(tag, d, sw, std::integral_constant<int, 2>{});
      if (tiles == 3) return fn(tag, d, sw, std::integral_constant<int, 3>{});
    }
    return tiles == 1 ? fn(tag, d, sw, std::integral_constant<int, 1>{}) : 2;
  };
  auto by_swap = [&](auto tag, auto d) {
    return swap ? by_tiles(tag, d, std::true_type{}) : by_tiles(tag, d, std::false_type{});
  };
  auto by_dim = [&](auto tag) {
    if (a.head_dim == 64) return by_swap(tag, std::integral_constant<int, 64>{});
    if (a.head_dim == 128) return by_swap(tag, std::integral_constant<int, 128>{});
    return 2;
  };
  return a.is_bf16 ? by_dim(Tag<__nv_bfloat16>{}) : by_dim(Tag<__half>{});
}

// A launch of `grid` blocks of `threads` threads, in clusters of `cluster` blocks along x (cluster > 0), and
// as a programmatic dependent where `overlap` (the plan's, on sm_90+: the kernels wait for the previous
// kernel themselves, enter_after_previous_kernel). Used in place: cfg points at attrs.
struct Launch {
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg = {};
  Launch(dim3 grid, unsigned threads, size_t smem, cudaStream_t stream, int cluster, bool overlap) {
    cfg.gridDim = grid, cfg.blockDim = dim3(threads), cfg.dynamicSmemBytes = smem, cfg.stream = stream;
    unsigned n = 0;
    if (cluster > 0) {
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = unsigned(cluster), attrs[n].val.clusterDim.y = 1, attrs[n].val.clusterDim.z = 1;
      ++n;
    }
    if (overlap) {
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cfg.attrs = attrs, cfg.numAttrs = n;
  }
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;
};

// The plan's overlap where the device has programmatic dependent launch (sm_90+), asked once per device.
bool overlap_on(const mqa_byoc_decode_plan& p, int device) {
  static std::mutex mutex;
  static std::map<int, bool> known;
  if (!p.overlap) return false;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    major = 0;
  }
  return known[device] = major >= 9;
}

// Max co-resident clusters of `n` blocks of a kernel on a device (0: none), asked once per (device, size).
template <typename K>
int max_clusters(K kernel, int warps, int device, int n, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, const void*, int, size_t>, int> known;
  std::lock_guard<std::mutex> lock(mutex);
  const std::tuple<int, int, const void*, int, size_t> key{device, n, reinterpret_cast<const void*>(kernel), warps,
                                                           smem};
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  int count = 0;
  const Launch l(dim3(unsigned(n)), unsigned(warps * 32), smem, nullptr, n, false);
  if (cudaOccupancyMaxActiveClusters(&count, kernel, &l.cfg) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  known[key] = count;
  return count;
}

// capacity[n - 1]: the co-resident clusters of n blocks (n = 1..kMaxCluster) of the cluster-merging kernel
// of 8 warps (the 4-warp blocks' capacity is at least as large).
template <typename T, int D, bool SWAP, int MT>
int cluster_capacity(bool paged, int device, int* capacity) {
  constexpr int W = kMaxWarps;
  using S = Smem<D, SWAP, W, MT>;
  auto kernel =
      paged ? gqa_decode_kernel<T, D, SWAP, true, true, W, MT> : gqa_decode_kernel<T, D, SWAP, false, true, W, MT>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  for (int n = 1; n <= kMaxCluster; ++n) capacity[n - 1] = max_clusters(kernel, W, device, n, S::kBytes);
  return 0;
}

template <typename T, int D, bool SWAP, int W, int MT>
int launch_typed(const mqa_byoc_decode_args& a, const mqa_byoc_decode_plan& p, void* ws, int* counters,
                 cudaStream_t stream) {
  using S = Smem<D, SWAP, W, MT>;
  static bool configured[2][2][64] = {};  // per kernel and device: the shared-memory (and cluster) opt-ins
  const bool paged = a.page_values != nullptr;
  dim3 grid(p.splits, unsigned(a.num_heads_k * p.row_groups), unsigned(a.batch));
  int device = 0;
  cudaGetDevice(&device);
  auto configure = [&](auto kernel, bool cluster) {
    if (device >= 0 && device < 64 && configured[paged][cluster][device]) return true;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes) != cudaSuccess) return false;
    if (cluster && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      return false;
    }
    if (device >= 0 && device < 64) configured[paged][cluster][device] = true;
    return true;
  };
  // The cluster merge when a slot's splits fit one cluster and every cluster of the grid is co-resident
  // (one wave, as the plan intends); else the workspace and the arrival counters.
  auto ckernel =
      paged ? gqa_decode_kernel<T, D, SWAP, true, true, W, MT> : gqa_decode_kernel<T, D, SWAP, false, true, W, MT>;
  bool cluster = false;
  if (p.merge != MQA_BYOC_DECODE_MERGE_GLOBAL && p.splits > 1 && p.splits <= kMaxCluster) {
    if (!configure(ckernel, true)) return 1;
    cluster = int64_t(grid.y) * grid.z <= max_clusters(ckernel, W, device, p.splits, S::kBytes);
  }
  if (p.merge == MQA_BYOC_DECODE_MERGE_CLUSTER && !cluster) return 4;
  float* o_part = static_cast<float*>(ws);
  float* lse_part = o_part + p.o_part_floats;
  const bool overlap = overlap_on(p, device);
  if (cluster) {
    const Launch l(grid, unsigned(W * 32), S::kBytes, stream, p.splits, overlap);
    return cudaLaunchKernelEx(&l.cfg, ckernel, a, p.keys_per_split, p.row_groups, o_part, lse_part, counters) ==
                   cudaSuccess
               ? 0
               : 1;
  }
  auto kernel =
      paged ? gqa_decode_kernel<T, D, SWAP, true, false, W, MT> : gqa_decode_kernel<T, D, SWAP, false, false, W, MT>;
  if (!configure(kernel, false)) return 1;
  const Launch l(grid, unsigned(W * 32), S::kBytes, stream, 0, overlap);
  return cudaLaunchKernelEx(&l.cfg, kernel, a, p.keys_per_split, p.row_groups, o_part, lse_part, counters) ==
                 cudaSuccess
             ? 0
             : 1;
}

template <typename T, int D, int KG>
int launch_shared_groups(const mqa_byoc_decode_args& a, const mqa_byoc_decode_plan& p, void* ws, int* counters,
                         cudaStream_t stream) {
  using S = SharedSmem<D>;
  static bool configured[2][2][64] = {};  // per kernel and device: the shared-memory (and cluster) opt-ins
  const bool paged = a.page_values != nullptr;
  const int rows = 16 * shared_warps(a);
  const int packed = p.shared_tiles == 2;  // the grid's x: every sequence's splits (packed_work)
  dim3 grid(p.splits, unsigned(a.num_heads_k * p.row_groups), packed ? 1u : unsigned(a.batch));
  int device = 0;
  cudaGetDevice(&device);
  auto configure = [&](auto kernel, bool cluster) {
    if (device >= 0 && device < 64 && configured[paged][cluster][device]) return true;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(S::bytes(S::kMaxRows, cluster))) != cudaSuccess) {
      return false;
    }
    if (cluster && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      return false;
    }
    if (device >= 0 && device < 64) configured[paged][cluster][device] = true;
    return true;
  };
  auto ckernel = paged ? gqa_decode_shared_kernel<T, D, true, true, KG> : gqa_decode_shared_kernel<T, D, false, true, KG>;
  bool cluster = false;
  if (!packed && p.merge != MQA_BYOC_DECODE_MERGE_GLOBAL && p.splits > 1 && p.splits <= kMaxCluster) {
    if (!configure(ckernel, true)) return 1;
    cluster = int64_t(grid.y) * grid.z <= max_clusters(ckernel, p.warps, device, p.splits, S::bytes(rows, true));
  }
  if (p.merge == MQA_BYOC_DECODE_MERGE_CLUSTER && !cluster) return 4;
  float* o_part = static_cast<float*>(ws);
  float* lse_part = o_part + p.o_part_floats;
  const bool overlap = overlap_on(p, device);
  if (cluster) {
    const Launch l(grid, unsigned(p.warps * 32), S::bytes(rows, true), stream, p.splits, overlap);
    return cudaLaunchKernelEx(&l.cfg, ckernel, a, p.keys_per_split, p.row_groups, o_part, lse_part, counters, 0,
                              static_cast<int2*>(nullptr)) == cudaSuccess
               ? 0
               : 1;
  }
  // through the workspace: the partials, then the merge kernel (slot_splits after the partials' LSEs)
  int2* slot_splits =
      p.splits == 1 && !packed ? nullptr : reinterpret_cast<int2*>(lse_part + p.o_part_floats / a.head_dim);
  auto kernel = paged ? gqa_decode_shared_kernel<T, D, true, false, KG> : gqa_decode_shared_kernel<T, D, false, false, KG>;
  if (!configure(kernel, false)) return 1;
  {
    const Launch l(grid, unsigned(p.warps * 32), S::bytes(rows, false), stream, 0, overlap);
    if (cudaLaunchKernelEx(&l.cfg, kernel, a, p.keys_per_split, p.row_groups, o_part, lse_part, counters, packed,
                           slot_splits) != cudaSuccess) {
      return 1;
    }
  }
  if (p.splits == 1 && !packed) return 0;  // every slot wrote its output
  // the grid's y and z: the main kernel's (K/V head, row group) and sequences (each within 65535: the plans')
  const unsigned ys = unsigned(a.num_heads_k * p.row_groups), batch = unsigned(a.batch);
  // few slots: 4 groups of splits a row, two rows a block; else one group, kRowsPerBlock rows a block
  const bool few = int64_t(ys) * batch <= kMergeFewSlots;
  constexpr int kRowsPerBlock = kMergeThreads / (D / 4);
  const dim3 mgrid(unsigned(few ? (rows + 1) / 2 : (rows + kRowsPerBlock - 1) / kRowsPerBlock), ys, batch);
  const Launch l(mgrid, kMergeThreads, 0, stream, 0, overlap);
  return cudaLaunchKernelEx(&l.cfg, few ? gqa_decode_split_merge_kernel<T, D, 4> : gqa_decode_split_merge_kernel<T, D, 1>,
                            a, rows, p.row_groups, static_cast<const float*>(o_part),
                            static_cast<const float*>(lse_part), static_cast<const int2*>(slot_splits)) == cudaSuccess
             ? 0
             : 1;
}

// A SharedTiles launch: one key group (`warps` the row tiles) or two (twice them, up to 5 row tiles).
template <typename T, int D>
int launch_shared(const mqa_byoc_decode_args& a, const mqa_byoc_decode_plan& p, void* ws, int* counters,
                  cudaStream_t stream) {
  const int row_warps = shared_warps(a);
  if (p.warps == row_warps) return launch_shared_groups<T, D, 1>(a, p, ws, counters, stream);
  if (p.warps == 2 * row_warps && shared_key_groups_fit(row_warps)) {
    return launch_shared_groups<T, D, 2>(a, p, ws, counters, stream);
  }
  return 2;
}

// The co-resident clusters of n blocks of the shared-tiles kernel with `warps` warps (n = 1..kMaxCluster).
// Plans are sized by the kernel of one key group (two key groups' launches check their clusters themselves).
template <typename T, int D>
int shared_cluster_capacity(bool paged, int warps, int device, int* capacity) {
  using S = SharedSmem<D>;
  auto kernel = paged ? gqa_decode_shared_kernel<T, D, true, true, 1> : gqa_decode_shared_kernel<T, D, false, true, 1>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::bytes(S::kMaxRows, true))) !=
          cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  for (int n = 1; n <= kMaxCluster; ++n) capacity[n - 1] = max_clusters(kernel, warps, device, n, S::bytes(16 * warps, true));
  return 0;
}

// Warps of a CTA streaming splits of kps keys: 4 where 8 would stream at most two tiles each. A CTA's fixed
// costs (its first tiles' latency, the merge of its warps' outputs) then weigh most: on the H200, 4 warps
// streaming twice the tiles were 3-10% faster there (1k-4k keys), 8 warps faster from four tiles a warp on.
int warps_for(int64_t kps) { return kps <= 2 * kMaxWarps * kTileKeys ? kFewWarps : kMaxWarps; }

// A SharedTiles plan: `splits` CTAs a slot (at most kShMaxGrid), each sequence's splits at least
// keys_per_split keys (a multiple of 64).
int shared_plan(const mqa_byoc_decode_args& a, int64_t keys_per_split, int64_t splits, mqa_byoc_decode_plan* p) {
  if (keys_per_split % kShTileKeys != 0) return 2;
  const int warps = shared_warps(a);
  const int64_t rows = 16 * warps;
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, std::min<int64_t>(kShMaxGrid, SharedSmem<64>::max_splits(int(rows)))));
  const int64_t row_groups = (a.num_heads / a.num_heads_k + rows - 1) / rows;
  if (a.batch > 65535 || a.num_heads_k * row_groups > 65535) return 2;  // grid z and y
  p->row_tiles = 1;
  p->row_groups = int(row_groups);
  p->keys_per_split = int(keys_per_split);
  p->splits = int(splits);
  p->warps = warps * shared_key_groups(warps);
  p->shared_tiles = 1;
  const int64_t slots = a.batch * a.num_heads_k * row_groups;
  p->o_part_floats = splits > 1 ? slots * splits * rows * a.head_dim : 0;
  // the partials, their LSEs and each slot's (first partial, splits) for the merge kernel
  p->workspace_bytes = splits > 1 ? size_t(p->o_part_floats + slots * splits * rows) * sizeof(float) +
                                        size_t(slots) * sizeof(int2)
                                  : 0;
  p->counters = 0;  // merged in a cluster or by the merge kernel
  p->merge = MQA_BYOC_DECODE_MERGE_AUTO;
  p->overlap = 1;
  return 0;
}

// A packed SharedTiles plan (shared_tiles 2, packed_work): a grid's x of `ctas` (at least one a sequence)
// for every (K/V head, row group); the kernel sizes the splits (a size of at least kShMinKeys keys for the
// batch, then evened out within each sequence: whole tiles, as many splits). The sequences'
// lengths live in the main buffer while it does: at most kPackMaxBatch of them.
constexpr int64_t kPackMaxBatch = SharedSmem<64>::kMainBytes / 4;
int shared_packed_plan(const mqa_byoc_decode_args& a, int64_t ctas, mqa_byoc_decode_plan* p) {
  const int warps = shared_warps(a);
  const int64_t rows = 16 * warps;
  const int64_t row_groups = (a.num_heads / a.num_heads_k + rows - 1) / rows;
  const int64_t ys = a.num_heads_k * row_groups;
  if (a.batch > kPackMaxBatch || ys > 65535) return 2;  // grid y
  const int64_t grid = std::max<int64_t>(ctas, a.batch);
  p->row_tiles = 1;
  p->row_groups = int(row_groups);
  p->keys_per_split = warps == kShPackedWideWarps ? kShPackedWideMinKeys : kShMinKeys;
  p->splits = int(grid);
  p->warps = warps * shared_key_groups(warps);
  p->shared_tiles = 2;
  p->o_part_floats = ys * grid * rows * a.head_dim;
  p->workspace_bytes = size_t(p->o_part_floats + ys * grid * rows) * sizeof(float) + size_t(a.batch * ys) * sizeof(int2);
  p->counters = 0;  // merged by the merge kernel
  p->merge = MQA_BYOC_DECODE_MERGE_GLOBAL;
  p->overlap = 1;
  return 0;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int mqa_byoc_decode_rows_per_cta(int64_t head_dim) {
  return 16 * rule_row_tiles(head_dim, 0);
}

__attribute__((visibility("default"))) int mqa_byoc_decode_max_row_tiles(void) { return kMaxRowTiles; }

__attribute__((visibility("default"))) int mqa_byoc_decode_supported(int64_t head_dim, int64_t num_heads,
                                                                     int64_t num_heads_k) {
  return (head_dim == 64 || head_dim == 128) && num_heads_k > 0 && num_heads % num_heads_k == 0 ? 1 : 0;
}

__attribute__((visibility("default"))) int mqa_byoc_decode_plan_grid(const mqa_byoc_decode_args* a,
                                                                     int64_t keys_per_split, int64_t splits,
                                                                     int row_tiles, mqa_byoc_decode_plan* p) {
  if (!mqa_byoc_decode_supported(a->head_dim, a->num_heads, a->num_heads_k) || a->batch <= 0) return 2;
  if (keys_per_split <= 0 || keys_per_split % kTileKeys != 0 || splits <= 0) return 2;
  if (!mqa_byoc_scale_ok(a->softmax_scale)) return 2;  // the running max of the unscaled scores
  if (shared_rule(*a, row_tiles)) return shared_plan(*a, keys_per_split, splits, p);
  const int tiles = row_tiles_of(*a, row_tiles);
  if (tiles == 0) return 2;
  if (splits > kMaxSplits) return 2;  // the merging CTA's weights live in shared memory
  const int64_t rows = 16 * tiles;
  const int64_t row_groups = (a->num_heads / a->num_heads_k + rows - 1) / rows;
  if (a->batch > 65535 || a->num_heads_k * row_groups > 65535) return 2;  // grid z and y
  p->row_tiles = tiles;
  p->row_groups = int(row_groups);
  p->keys_per_split = int(keys_per_split);
  p->splits = int(splits);
  p->warps = warps_for(keys_per_split);
  p->shared_tiles = 0;
  const int64_t slots = a->batch * a->num_heads_k * p->row_groups;
  p->o_part_floats = splits > 1 ? slots * splits * rows * a->head_dim : 0;
  const int64_t lse_floats = splits > 1 ? slots * splits * rows : 0;
  p->workspace_bytes = size_t(p->o_part_floats + lse_floats) * sizeof(float);
  p->counters = splits > 1 ? slots : 0;
  p->merge = MQA_BYOC_DECODE_MERGE_AUTO;
  p->overlap = 1;
  return 0;
}

__attribute__((visibility("default"))) int mqa_byoc_decode_plan_split(const mqa_byoc_decode_args* a,
                                                                      int64_t keys_per_split, int row_tiles,
                                                                      mqa_byoc_decode_plan* p) {
  if (keys_per_split <= 0) return 2;
  return mqa_byoc_decode_plan_grid(a, keys_per_split, grid_splits(*a, keys_per_split), row_tiles, p);
}

__attribute__((visibility("default"))) int mqa_byoc_decode_cluster_capacity(const mqa_byoc_decode_args* a,
                                                                            int row_tiles, int device_id,
                                                                            int* capacity) {
  if (!mqa_byoc_decode_supported(a->head_dim, a->num_heads, a->num_heads_k)) return 2;
  const bool shared = shared_rule(*a, row_tiles);
  const int tiles = shared ? -shared_warps(*a) : row_tiles_of(*a, row_tiles);  // the key's: warps when shared
  if (tiles == 0) return 2;
  // asked on every decode call (the dispatcher plans each): the device's answers are kept per kernel
  using Key = std::tuple<int, int64_t, int, bool, bool, int>;  // device, head dim, bf16, swap, pages, tiles
  static std::mutex mutex;
  static std::map<Key, std::array<int, kMaxCluster>> known;
  const bool paged = a->page_values != nullptr;
  const Key key{device_id, a->head_dim, a->is_bf16, rows_as_n(*a), paged, tiles};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(key);
  if (it == known.end()) {
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_id) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    std::array<int, kMaxCluster> found{};
    const int rc =
        shared ? (a->is_bf16 ? shared_cluster_capacity<__nv_bfloat16, 64>(paged, -tiles, device_id, found.data())
                             : shared_cluster_capacity<__half, 64>(paged, -tiles, device_id, found.data()))
               : with_kernel_types(*a, tiles, [&](auto tag, auto d, auto swap, auto mt) {
                   return cluster_capacity<typename decltype(tag)::type, decltype(d)::value, decltype(swap)::value,
                                           decltype(mt)::value>(paged, device_id, found.data());
                 });
    cudaSetDevice(previous);
    if (rc != 0) return rc;
    it = known.emplace(key, found).first;
  }
  std::copy(it->second.begin(), it->second.end(), capacity);
  return 0;
}

__attribute__((visibility("default"))) int mqa_byoc_decode_make_plan(const mqa_byoc_decode_args* a, int row_tiles,
                                                                     int num_sms, const int* capacity,
                                                                     mqa_byoc_decode_plan* p) {
  if (!mqa_byoc_decode_supported(a->head_dim, a->num_heads, a->num_heads_k) || a->batch <= 0) return 2;
  const bool shared = shared_rule(*a, row_tiles);
  const int tiles = shared ? 1 : row_tiles_of(*a, row_tiles);
  if (tiles == 0) return 2;
  const int64_t rows = shared ? 16 * shared_warps(*a) : 16 * tiles;
  const int64_t row_groups = (a->num_heads / a->num_heads_k + rows - 1) / rows;
  const int64_t longest = longest_keys(*a);
  const int64_t typical = typical_keys(*a);
  // Merged through the workspace: at most one CTA per SM (one wave) and 32 splits per slot (the last CTA's
  // merge reads every split: measured on the H200, more splits cost more there than they gain).
  const int64_t slots = a->batch * a->num_heads_k * row_groups;
  int64_t target = std::min<int64_t>(32, std::max<int64_t>(1, int64_t(std::max(num_sms, 1)) / slots));
  if (shared) {  // SharedTiles: the SMs' CTAs (several a SM: 16 warps), splits of whole 64-key tiles
    const int64_t per_sm = shared_ctas_per_sm(int(rows / 16), false), sms = std::max(num_sms, 1);
    target = std::min<int64_t>(kShMaxTarget, std::max<int64_t>(1, per_sm * sms / slots));
    int cluster = 0;
    for (int n = kMaxCluster; capacity != nullptr && n >= 2 && cluster == 0; n /= 2) {
      if (capacity[n - 1] >= slots) cluster = n;
    }
    if (cluster >= target) target = cluster;
    if (!mqa_byoc_scale_ok(a->softmax_scale)) return 2;
    // On pages, where the slots' splits would not merge in clusters: packed splits (every CTA about the
    // same keys, whatever the lengths). The grid: the CTAs the SMs hold per (K/V head, row group).
    // CTAs of 4 warps or more: packed on pages whether or not the slots' clusters would be co-resident
    const bool clustered = rows / 16 < 4 && capacity != nullptr && target > 1 && target <= kMaxCluster &&
                           capacity[target - 1] >= slots;
    if (a->page_values != nullptr && !clustered && a->batch <= kPackMaxBatch) {
      const int64_t wide_batch = a->page_size % kShTileKeys == 0 ? kShPackedWideMaxBatchTilePages : kShPackedWideMaxBatch;
      const int64_t packed_per_sm = rows / 16 == kShPackedWideWarps && a->batch <= wide_batch
                                        ? std::min<int64_t>(per_sm, kShPackedWideCtasPerSm)
                                        : per_sm;
      return shared_packed_plan(*a, packed_per_sm * sms / (a->num_heads_k * row_groups), p);
    }
    // splits of at least kShMinKeys: the grid's x is about `target` for a typical sequence
    const int64_t kps = std::max<int64_t>(kShMinKeys, (typical + target * kShTileKeys - 1) / (target * kShTileKeys) * kShTileKeys);
    // the grid's x: `target` (a sequence longer than typical cuts larger splits itself). Twice that, or
    // kShMaxGrid, with the same split size were 1.06-1.71x slower at 32 and 64 sequences (H200,
    // benchmarks/results/2026-12-02-decode-shared-tiles-grid.md).
    return shared_plan(*a, kps, std::min<int64_t>(target, (longest + kps - 1) / kps), p);
  }
  // Merged in a cluster (through the workspace takes 1.5-2.5 us more, measured on the H200): clusters of a
  // power of two blocks (clusters of 9 and splits of 912 keys ran 5-10% slower than 8 of 1024), the
  // largest of which every slot's can be co-resident. Worth its fewer splits (fitted to split/cluster
  // sweeps on the H200, docs/performance.md) when
  // - it has as many splits as the workspace plan would,
  // - or the group is small (RowsAsN) and clusters of at most 8 fill about half the GPU: the K/V stream
  //   is bandwidth-bound then (64/8/128 and 32/8/128 from 1k to 32k keys). A cluster lies in one GPC
  //   (16-18 SMs): four clusters of 16 stream through half the GPCs (32/4/128 at 32k keys: 12% slower
  //   than the same 64 CTAs merging through the workspace),
  // - or a split holds few keys: up to 640 + 2048 x the fraction of SMs the clusters fill (more splits
  //   shorten a stream that compute or one CTA's load rate bounds: Falcon's 71 heads at 32k keys, one K/V
  //   head of 8 query heads at 16k; 32/1/64 at 16k keys: 16 splits in clusters 9% faster than 32).
  int cluster = 0;
  for (int n = kMaxCluster; capacity != nullptr && n >= 2 && cluster == 0; n /= 2) {
    if (capacity[n - 1] >= slots) cluster = n;
  }
  const int64_t ctas = slots * cluster, sms = std::max(num_sms, 1);
  if (cluster > 0 && (cluster >= target || (rows_as_n(*a) && cluster <= 8 && 20 * ctas >= 9 * sms) ||
                      typical * sms <= cluster * (640 * sms + 2048 * ctas))) {
    target = cluster;
  }
  // whole tiles for every warp of 8; where that makes splits of 4-warp CTAs (warps_for), whole tiles for
  // every warp of 4: more splits, unless one split holds every key (no merge)
  auto split_keys = [&](int64_t warps) {
    const int64_t unit = warps * kTileKeys;
    int64_t kps = std::max<int64_t>((typical + target - 1) / target, unit);
    kps = std::max<int64_t>(kps, (longest + kMaxSplits - 1) / kMaxSplits);
    return (kps + unit - 1) / unit * unit;
  };
  int64_t kps = split_keys(kMaxWarps);
  if (warps_for(kps) == kFewWarps && kps < longest) kps = split_keys(kFewWarps);
  // On pages of several sequences the plan cannot see their lengths, only their mean (typical): the grid
  // covers twice a typical sequence (a sequence of up to twice the mean keeps the split size; a longer
  // one cuts its keys into larger splits; a shorter one leaves CTAs without keys). On the H200
  // (64/8/128, pages of 128, 4-64 sequences of 1k-16k keys each or mixed over 1k-16k, K/V from HBM;
  // benchmarks/results/2026-12-04-decode-grid.md), against the grid of the longest sequence the pages
  // could hold (the plan before: mostly CTAs without keys) 0.30-0.99x with every sequence alike,
  // 0.97-1.08x mixed; against a grid of one typical sequence 0.98-1.20x alike (the empty half of a
  // cluster waits for its merge) and 0.81-1.01x mixed (there a 16k sequence's few large splits set the
  // pace), so twice.
  const bool batch_pages = a->page_values != nullptr && a->batch > 1;
  const int64_t grid = grid_splits(*a, kps, batch_pages ? 2 : 1);
  return mqa_byoc_decode_plan_grid(a, kps, grid, tiles, p);
}

__attribute__((visibility("default"))) int mqa_byoc_decode_launch(const mqa_byoc_decode_args* a,
                                                                  const mqa_byoc_decode_plan* p, void* workspace,
                                                                  int device_id, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  int* counters = nullptr;
  if (p->counters > 0) {
    counters = counters_for(device_id, stream, p->counters);
    if (counters == nullptr) return 3;
  }
  if (p->shared_tiles) {
    if (a->head_dim != 64 || p->warps < 1 || p->warps > 2 * kShMaxWarps || p->keys_per_split % kShTileKeys != 0) return 2;
    if (p->shared_tiles == 2) {  // packed: the lengths fit the main buffer, one split a sequence at least
      if (a->batch > kPackMaxBatch || p->splits < a->batch || p->keys_per_split < kShTileKeys) return 2;
      if (p->merge == MQA_BYOC_DECODE_MERGE_CLUSTER) return 4;
    }
    return a->is_bf16 ? launch_shared<__nv_bfloat16, 64>(*a, *p, workspace, counters, stream)
                      : launch_shared<__half, 64>(*a, *p, workspace, counters, stream);
  }
  if (p->warps != kMaxWarps && p->warps != kFewWarps) return 2;
  if (p->row_tiles < 1 || row_tiles_of(*a, p->row_tiles) != p->row_tiles) return 2;
  return with_kernel_types(*a, p->row_tiles, [&](auto tag, auto d, auto swap, auto mt) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(d)::value;
    constexpr bool SWAP = decltype(swap)::value;
    constexpr int MT = decltype(mt)::value;
    return p->warps == kFewWarps ? launch_typed<T, D, SWAP, kFewWarps, MT>(*a, *p, workspace, counters, stream)
                                 : launch_typed<T, D, SWAP, kMaxWarps, MT>(*a, *p, workspace, counters, stream);
  });
}

}  // extern "C"
