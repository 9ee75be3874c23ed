// mqa_byoc FA2 forward dispatcher: fills flash-attn's Flash_fwd_params from raw pointers, shapes
// and strides, picks split-KV or not, allocates the small workspaces and calls one of the kernel
// entry points compiled from fa2_kernel_entry.cu. Host code only; no torch, no Python.
//
// The kernel entries are referenced weakly, so this object links with whatever subset was built;
// a call that needs a missing one fails with a message saying how to build it.
//
// NVTX: with MQA_BYOC_NVTX=1 in the environment (read once, at the first call; the one variable a library
// reads, a profiling aid that changes no kernel) each kernel launch is
// wrapped in an NVTX range "flash_attn[h=H,kv=H_kv,d=D]" (NVTX3, header-only from the CUDA toolkit;
// without a tool such as nsys attached a push/pop is a call into an empty stub). Unset, the only cost is
// one check of a static flag.

#include "fa2_dispatch.h"
#include "gqa_decode.h"
#include "nvtx_switch.h"

#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "flash.h"  // flash-attn's Flash_fwd_params (from the fetched sources)

// Defined (hidden) by the library's options module when the build gives one; null otherwise.
extern "C" __attribute__((weak, visibility("hidden"))) const mqa_byoc_kernel_options mqa_byoc_library_kernel_options;

namespace {

using Params = FLASH_NAMESPACE::Flash_fwd_params;
using EntryFn = void (*)(Params*, cudaStream_t);

}  // namespace

// ---- weak references to every kernel entry fa2_kernel_entry.cu can produce -------------------

#define MQA_BYOC_DT_CAUSAL(X, hd) X(hd, fp16, ) X(hd, fp16, _causal) X(hd, bf16, ) X(hd, bf16, _causal)
#define MQA_BYOC_ALL(X)                                                                     \
  MQA_BYOC_DT_CAUSAL(X, 32) MQA_BYOC_DT_CAUSAL(X, 64) MQA_BYOC_DT_CAUSAL(X, 96)             \
  MQA_BYOC_DT_CAUSAL(X, 128) MQA_BYOC_DT_CAUSAL(X, 192) MQA_BYOC_DT_CAUSAL(X, 256)

#define MQA_BYOC_DECL(hd, dt, c)                                                             \
  extern "C" __attribute__((weak, visibility("hidden"))) void                               \
      mqa_byoc_fa2_fwd_hdim##hd##_##dt##c(Params*, cudaStream_t);                            \
  extern "C" __attribute__((weak, visibility("hidden"))) void                               \
      mqa_byoc_fa2_fwd_split_hdim##hd##_##dt##c(Params*, cudaStream_t);
MQA_BYOC_ALL(MQA_BYOC_DECL)

// the soft-capping families (kernels/keys.py KernelKey.softcap): flash-attn's templates with soft-capping
// compiled in, in a namespace of their own; entries named like the others with a _softcap suffix
#define MQA_BYOC_DECL_SOFTCAP(hd, dt, c)                                                     \
  extern "C" __attribute__((weak, visibility("hidden"))) void                               \
      mqa_byoc_fa2_fwd_hdim##hd##_##dt##c##_softcap(Params*, cudaStream_t);                  \
  extern "C" __attribute__((weak, visibility("hidden"))) void                               \
      mqa_byoc_fa2_fwd_split_hdim##hd##_##dt##c##_softcap(Params*, cudaStream_t);
MQA_BYOC_ALL(MQA_BYOC_DECL_SOFTCAP)

namespace {

struct Entry {
  int hdim;
  int is_bf16;
  int causal;
  EntryFn fwd;
  EntryFn split;
};

#define MQA_BYOC_IS_BF16_fp16 0
#define MQA_BYOC_IS_BF16_bf16 1
#define MQA_BYOC_ROW(hd, dt, c)                                                             \
  {hd, MQA_BYOC_IS_BF16_##dt, sizeof(#c) > 1, &mqa_byoc_fa2_fwd_hdim##hd##_##dt##c,          \
   &mqa_byoc_fa2_fwd_split_hdim##hd##_##dt##c},
const Entry kEntries[] = {MQA_BYOC_ALL(MQA_BYOC_ROW)};
#define MQA_BYOC_ROW_SOFTCAP(hd, dt, c)                                                     \
  {hd, MQA_BYOC_IS_BF16_##dt, sizeof(#c) > 1, &mqa_byoc_fa2_fwd_hdim##hd##_##dt##c##_softcap,  \
   &mqa_byoc_fa2_fwd_split_hdim##hd##_##dt##c##_softcap},
const Entry kSoftcapEntries[] = {MQA_BYOC_ALL(MQA_BYOC_ROW_SOFTCAP)};

const Entry* find_entry(int hdim, int is_bf16, int causal, bool softcap = false) {
  for (const Entry& e : softcap ? kSoftcapEntries : kEntries) {
    if (e.hdim == hdim && e.is_bf16 == (is_bf16 != 0) && e.causal == (causal != 0)) return &e;
  }
  return nullptr;
}

thread_local std::string g_last_error;

int fail(const std::string& msg) {
  g_last_error = msg;
  return 1;
}

int kernel_hdim(int64_t d) {
  static const int dims[] = {32, 64, 96, 128, 192, 256};
  for (int x : dims)
    if (d <= x) return x;
  return -1;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Same rule as flash-attn's split heuristic: if the (batch x heads x m-blocks) grid nearly fills the
// SMs, no split; else the smallest split count whose wave efficiency is >= 85% of the best one.
int num_splits_heuristic(int batch_nheads_mblocks, int num_sms, int num_n_blocks, int max_splits) {
  if (batch_nheads_mblocks >= 0.8f * num_sms) return 1;
  max_splits = std::min({max_splits, num_sms, num_n_blocks});
  if (max_splits < 1) return 1;
  auto ceildiv = [](int a, int b) { return (a + b - 1) / b; };
  // a split count is useless if it gives the same blocks per split as one fewer split
  auto eligible = [&](int s) {
    return s == 1 || ceildiv(num_n_blocks, s) != ceildiv(num_n_blocks, s - 1);
  };
  std::vector<float> eff(max_splits + 1, 0.f);
  float best = 0.f;
  for (int s = 1; s <= max_splits; ++s) {
    if (!eligible(s)) continue;
    float waves = float(batch_nheads_mblocks) * s / num_sms;
    eff[s] = waves / std::ceil(waves);
    best = std::max(best, eff[s]);
  }
  for (int s = 1; s <= max_splits; ++s) {
    if (eligible(s) && eff[s] >= 0.85f * best) return s;
  }
  return 1;
}

std::mutex g_mu;
std::vector<int> g_num_sms;              // per device, 0 = unknown
std::vector<cudaMemPool_t> g_pools;      // per device, nullptr = not created
std::vector<char> g_pool_failed;         // per device

// A positive device attribute, asked once per device and kept in `cache` (0: not known, the query failed).
int cached_device_attribute(std::vector<int>& cache, cudaDeviceAttr attr, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, attr, device) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return 0;
    }
    cache[device] = n;
  }
  return cache[device];
}

int num_sms(int device) { return cached_device_attribute(g_num_sms, cudaDevAttrMultiProcessorCount, device); }

// A private stream-ordered pool per device that keeps its memory (the workspaces are small and
// needed on every call); falls back to the device's default pool.
cudaMemPool_t workspace_pool(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (device >= static_cast<int>(g_pools.size())) {
    g_pools.resize(device + 1, nullptr);
    g_pool_failed.resize(device + 1, 0);
  }
  if (g_pools[device] == nullptr && !g_pool_failed[device]) {
    cudaMemPoolProps props;
    std::memset(&props, 0, sizeof(props));
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      g_pools[device] = pool;
    } else {
      cudaGetLastError();
      g_pool_failed[device] = 1;
    }
  }
  return g_pools[device];
}

struct DeviceGuard {
  int prev = -1;
  bool changed = false;
  cudaError_t set(int device) {
    cudaError_t e = cudaGetDevice(&prev);
    if (e != cudaSuccess) return e;
    if (prev != device) {
      e = cudaSetDevice(device);
      if (e != cudaSuccess) return e;
      changed = true;
    }
    return cudaSuccess;
  }
  ~DeviceGuard() {
    if (changed) cudaSetDevice(prev);
  }
};

std::string kernel_name(int hdim, int is_bf16, int causal, bool softcap = false) {
  std::ostringstream os;
  os << "hdim" << hdim << (is_bf16 ? " bf16" : " fp16") << (causal ? " causal" : "") << (softcap ? " softcap" : "");
  return os.str();
}

std::string arch_of(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return "sm_" + std::to_string(major * 10 + minor);
}

bool fits_int(int64_t x) { return x >= 0 && x <= INT_MAX; }

const mqa_byoc_kernel_options kDefaultOptions = {0, 0, 0, 0, 0, 0, 0};

// The kernel options the build compiled into this library (mqa_byoc_kernel_options in fa2_dispatch.h).
const mqa_byoc_kernel_options& library_options() {
  return &mqa_byoc_library_kernel_options != nullptr ? mqa_byoc_library_kernel_options : kDefaultOptions;
}

}  // namespace

extern "C" int mqa_byoc_fa2_nvtx_push(const char* format, int64_t num_heads, int64_t num_heads_k, int64_t head_dim) {
  if (!mqa_byoc::nvtx_enabled()) return 0;
  char name[96];
  std::snprintf(name, sizeof(name), format, static_cast<long long>(num_heads), static_cast<long long>(num_heads_k),
                static_cast<long long>(head_dim));
  nvtxRangePushA(name);
  return 1;
}

extern "C" void mqa_byoc_fa2_nvtx_pop(void) { nvtxRangePop(); }

namespace {

// ---- pieces both entry points share ----------------------------------------------------------

// The head-count, head-dim and stride checks of both entry points; last_axis is the index of the
// head-dim stride (3 for (B, S, H, D), 2 for var-len's (total, H, D)). 0 when they pass.
int check_heads_and_strides(int64_t num_heads, int64_t num_heads_k, int64_t head_dim,
                            const int64_t* q_stride, const int64_t* k_stride,
                            const int64_t* v_stride, const int64_t* o_stride, int last_axis) {
  if (head_dim <= 0 || head_dim > 256 || head_dim % 8 != 0) {
    return fail("FA2 needs a head dim that is a multiple of 8 and at most 256, got " +
                std::to_string(head_dim));
  }
  if (num_heads % num_heads_k != 0) {
    return fail("H=" + std::to_string(num_heads) + " is not a multiple of H_kv=" +
                std::to_string(num_heads_k));
  }
  if (q_stride == nullptr || k_stride == nullptr || v_stride == nullptr || o_stride == nullptr) {
    return fail("null stride array");
  }
  if (q_stride[last_axis] != 1 || k_stride[last_axis] != 1 || v_stride[last_axis] != 1 ||
      o_stride[last_axis] != 1) {
    return fail("q, k, v and out must have a contiguous last (head dim) axis");
  }
  return 0;
}

// Makes device_id current for the guard's lifetime and clears a stale error of this runtime, so
// it is not blamed on the launch. 0 on success.
int select_device(DeviceGuard& guard, int device_id) {
  cudaError_t err = guard.set(device_id);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fail(std::string("cannot select CUDA device ") + std::to_string(device_id) + ": " +
                cudaGetErrorString(err));
  }
  cudaGetLastError();
  return 0;
}

// Fills the Flash_fwd_params fields both entry points set alike: data pointers, sizes (seqlen_q /
// seqlen_k: the lengths the grid is sized by, the max lengths for var-len), the softmax scale, no
// dropout, no softcap, and flash-attn's last window step: (-1, 0) is the causal mask, and a
// one-sided window gets its open side set to seqlen_k. wl / wr: the caller's normalised window.
void fill_shared_params(Params& p, const void* q, const void* k, const void* v, void* out,
                        int is_bf16, int64_t batch, int64_t num_heads, int64_t num_heads_k,
                        int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim, float softmax_scale,
                        int wl, int wr) {
  p.is_bf16 = is_bf16 != 0;
  p.q_ptr = const_cast<void*>(q);
  p.k_ptr = const_cast<void*>(k);
  p.v_ptr = const_cast<void*>(v);
  p.o_ptr = out;
  p.b = int(batch);
  p.h = int(num_heads);
  p.h_k = int(num_heads_k);
  p.h_h_k_ratio = int(num_heads / num_heads_k);
  p.seqlen_q = int(seqlen_q);
  p.seqlen_k = int(seqlen_k);
  p.seqlen_q_rounded = int(round_up(seqlen_q, 128));
  p.seqlen_k_rounded = int(round_up(seqlen_k, 128));
  p.d = int(head_dim);
  p.d_rounded = int(round_up(head_dim, head_dim <= 128 ? 32 : 64));
  p.softcap = 0.f;
  p.scale_softmax = softmax_scale;
  p.scale_softmax_log2 = float(double(softmax_scale) * 1.4426950408889634);  // log2(e)
  p.p_dropout = 1.f;  // probability to keep
  p.p_dropout_in_uint8_t = 255;
  p.rp_dropout = 1.f;
  p.scale_softmax_rp_dropout = softmax_scale;
  p.is_causal = wl < 0 && wr == 0;
  if (wl < 0 && wr >= 0) wl = int(seqlen_k);
  if (wl >= 0 && wr < 0) wr = int(seqlen_k);
  p.window_size_left = wl;
  p.window_size_right = wr;
  p.is_seqlens_k_cumulative = true;
  p.seqlenq_ngroups_swapped = false;
}

// The failure for a kernel family this library was linked without, with the command that builds it.
int fail_not_built(int hdim, int is_bf16, bool causal, int device_id, bool softcap = false) {
  std::string arch = arch_of(device_id);
  return fail("FA2 kernel " + kernel_name(hdim, is_bf16, causal, softcap) +
              " not built: run `mqa-byoc build-kernels" + (arch.empty() ? "" : " --arch " + arch) +
              " --head-dims " + std::to_string(hdim) + " --dtypes " + (is_bf16 ? "bf16" : "fp16") +
              (softcap ? " --softcap" : "") + "` and export again");
}

// Allocates `bytes` of workspace on `stream`, from the device's pool when it has one. 0 on success.
int alloc_workspace(void** ws, size_t bytes, int device_id, cudaStream_t stream) {
  cudaMemPool_t pool = workspace_pool(device_id);
  cudaError_t err = pool != nullptr ? cudaMallocFromPoolAsync(ws, bytes, pool, stream)
                                    : cudaMallocAsync(ws, bytes, stream);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fail("cannot allocate " + std::to_string(bytes) + " bytes of FA2 workspace: " +
                cudaGetErrorString(err));
  }
  return 0;
}

// Runs fn(p) (inside an NVTX range named by `range_format`, a "<name>[h=%lld,kv=%lld,d=%lld]" format,
// when MQA_BYOC_NVTX is on) and frees the workspace behind it; `what` names the kernel in a launch
// failure. 0 on success.
int launch_and_free(EntryFn fn, Params* p, cudaStream_t stream, void* ws, const char* range_format,
                    int64_t num_heads, int64_t num_heads_k, int64_t head_dim, const std::string& what,
                    const std::function<int()>& after = nullptr) {
  int after_rc = 0;
  {
    MqaByocNvtxRange range(range_format, num_heads, num_heads_k, head_dim);
    fn(p, stream);
    after_rc = (after && cudaPeekAtLastError() == cudaSuccess) ? after() : 0;
  }
  cudaError_t launch = cudaGetLastError();
  cudaError_t err = cudaFreeAsync(ws, stream);
  if (launch != cudaSuccess) return fail(what + " launch failed: " + cudaGetErrorString(launch));
  if (after_rc != 0) return fail(what + ": combining the key chunks failed (" + std::to_string(after_rc) + ")");
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fail(std::string("cudaFreeAsync: ") + cudaGetErrorString(err));
  }
  return 0;
}

// Split-KV decode of our own (batch 1, grouped query rows swapped into the sequence axis): the keys
// cut into n chunks of whole kBlockN tiles, one FA2 call of the split family with num_splits = 1 over
// the chunks as a batch (q batch stride 0; K/V batch stride = one chunk; non-cumulative cu_seqlens_k
// holding each chunk's length), writing each chunk's output and LSE, then mqa_byoc_combine_chunks
// (split_kv_combine.cu). Off with the library's split_combine option set to FA2 (FA2's own split-KV and combine).
bool own_combine_enabled() { return library_options().split_combine == 0; }

int chunked_decode(Params& p, EntryFn fn, int splits, int block_n, int64_t seqlen_k, int64_t num_heads,
                   int64_t num_heads_k, int64_t head_dim, int64_t out_head_stride, int is_bf16, int device_id,
                   cudaStream_t stream, void* out, const std::string& what) {
  int64_t chunk = (seqlen_k + splits - 1) / splits;
  chunk = (chunk + block_n - 1) / block_n * block_n;
  const int n = int((seqlen_k + chunk - 1) / chunk);
  const int64_t g = num_heads / num_heads_k;
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t len_bytes = align(size_t(n) * 4), o_bytes = align(size_t(n) * num_heads * head_dim * 2),
               lse_bytes = align(size_t(n) * num_heads * sizeof(float));
  void* ws = nullptr;
  if (int rc = alloc_workspace(&ws, len_bytes + o_bytes + lse_bytes, device_id, stream)) return rc;
  char* base = static_cast<char*>(ws);
  int32_t* lens = reinterpret_cast<int32_t*>(base);
  void* o_part = base + len_bytes;
  float* lse = reinterpret_cast<float*>(base + len_bytes + o_bytes);
  if (mqa_byoc_chunk_lengths(lens, n, chunk, seqlen_k, stream) != 0) {
    cudaFreeAsync(ws, stream);
    return fail("chunk lengths kernel launch failed: " + std::string(cudaGetErrorString(cudaGetLastError())));
  }
  p.b = n;
  p.seqlen_k = int(chunk);
  p.seqlen_k_rounded = int(round_up(chunk, 128));
  p.q_batch_stride = 0;  // every chunk reads the same query rows
  p.k_batch_stride = chunk * p.k_row_stride;
  p.v_batch_stride = chunk * p.v_row_stride;
  p.cu_seqlens_k = lens;
  p.is_seqlens_k_cumulative = false;
  // o_part (n, H, D): the g rows of K/V head j are query heads j*g .. j*g+g-1; lse (n, H_kv, g) = (n, H)
  p.o_ptr = o_part;
  p.o_batch_stride = num_heads * head_dim;
  p.o_row_stride = head_dim;
  p.o_head_stride = g * head_dim;
  p.softmax_lse_ptr = lse;
  p.unpadded_lse = false;
  p.num_splits = 1;
  return launch_and_free(fn, &p, stream, ws, "flash_attn[h=%lld,kv=%lld,d=%lld]", num_heads, num_heads_k, head_dim,
                         what, [&] {
                           return mqa_byoc_combine_chunks(o_part, lse, out, out_head_stride, n, int(num_heads),
                                                          int(head_dim), is_bf16, stream);
                         });
}

// Decode (one query row per sequence) on our grouped-query kernel (gqa_decode.cu): split-KV and the
// combine in one launch, K/V read once per 16 query heads of a group (Falcon's 71: five CTAs per split
// read its K/V head, from L2 after the first). It serves head dims 64 and 128; the library's decode_kernel option
// set to FA2 turns it off (the FA2 paths below).
bool own_decode_enabled() { return library_options().decode_kernel == 0; }

// The decode kernel's plans take what Hopper has (thread-block clusters, up to 227 KB of shared memory a
// block): on an older GPU (compute capability below 9) decode runs on FA2's split-KV.
std::vector<int> g_cc_major;  // per device, 0 = unknown

bool device_runs_own_decode() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) {
    cudaGetLastError();
    return false;
  }
  return cached_device_attribute(g_cc_major, cudaDevAttrComputeCapabilityMajor, device) >= 9;
}

bool own_decode_fits(int64_t head_dim, int64_t num_heads, int64_t num_heads_k, int64_t batch) {
  if (!own_decode_enabled() || !mqa_byoc_decode_supported(head_dim, num_heads, num_heads_k) ||
      !device_runs_own_decode()) {
    return false;
  }
  const int64_t row_groups = (num_heads / num_heads_k + mqa_byoc_decode_rows_per_cta(head_dim) - 1) /
                             mqa_byoc_decode_rows_per_cta(head_dim);
  return batch <= 65535 && num_heads_k * row_groups <= 65535;  // the grid's z and y
}

// How its splits merge: the library's decode_merge option (global: through the workspace; cluster: only
// in a thread-block cluster, a launch that cannot fails), else the plan's choice (AUTO).
int own_decode_merge() {
  const int m = library_options().decode_merge;
  return m == MQA_BYOC_DECODE_MERGE_GLOBAL || m == MQA_BYOC_DECODE_MERGE_CLUSTER ? m : int(MQA_BYOC_DECODE_MERGE_AUTO);
}

int own_decode(const mqa_byoc_decode_args& a, int device_id, cudaStream_t stream) {
  mqa_byoc_decode_plan plan{};
  int capacity[16];
  const bool clusters = mqa_byoc_decode_cluster_capacity(&a, 0, device_id, capacity) == 0;
  if (!clusters) cudaGetLastError();
  if (mqa_byoc_decode_make_plan(&a, 0, num_sms(device_id), clusters ? capacity : nullptr, &plan) != 0) {
    return fail("the grouped-query decode kernel does not serve head dim " + std::to_string(a.head_dim) + " with " +
                std::to_string(a.num_heads) + " / " + std::to_string(a.num_heads_k) + " heads");
  }
  plan.merge = own_decode_merge();
  plan.overlap = library_options().launch_overlap != 0;
  void* ws = nullptr;
  if (plan.workspace_bytes > 0) {
    if (int rc = alloc_workspace(&ws, plan.workspace_bytes, device_id, stream)) return rc;
  }
  int rc = 0;
  {
    MqaByocNvtxRange range("flash_attn[h=%lld,kv=%lld,d=%lld]", a.num_heads, a.num_heads_k, a.head_dim);
    rc = mqa_byoc_decode_launch(&a, &plan, ws, device_id, stream);
  }
  const cudaError_t launch = cudaGetLastError();
  const cudaError_t freed = ws != nullptr ? cudaFreeAsync(ws, stream) : cudaSuccess;
  if (rc != 0 || launch != cudaSuccess) {
    return fail("grouped-query decode kernel launch failed (" + std::to_string(rc) + "): " + cudaGetErrorString(launch));
  }
  if (freed != cudaSuccess) {
    cudaGetLastError();
    return fail(std::string("cudaFreeAsync: ") + cudaGetErrorString(freed));
  }
  return 0;
}

}  // namespace

extern "C" const char* mqa_byoc_fa2_last_error(void) { return g_last_error.c_str(); }

extern "C" const mqa_byoc_kernel_options* mqa_byoc_fa2_kernel_options(void) { return &library_options(); }

// For fa4_decode.cu (hopper provider): the same workspace pool, SM count and error message.
extern "C" int mqa_byoc_fa2_alloc_workspace(void** ws, size_t bytes, int device_id, void* stream) {
  return alloc_workspace(ws, bytes, device_id, static_cast<cudaStream_t>(stream));
}
extern "C" int mqa_byoc_fa2_fail(const char* message) { return fail(message); }
extern "C" int mqa_byoc_fa2_num_sms(int device_id) { return num_sms(device_id); }
extern "C" int mqa_byoc_fa2_num_splits(int64_t work, int num_sms, int num_n_blocks) {
  return num_splits_heuristic(int(std::min<int64_t>(work, INT_MAX)), num_sms, num_n_blocks, 128);
}
extern "C" int mqa_byoc_fa2_kernel_hdim(int64_t head_dim) { return kernel_hdim(head_dim); }
extern "C" mqa_byoc_fa2_entry_fn mqa_byoc_fa2_entry(int hdim, int is_bf16, int causal, int split) {
  const Entry* e = find_entry(hdim, is_bf16, causal != 0);
  if (e == nullptr) return nullptr;
  return reinterpret_cast<mqa_byoc_fa2_entry_fn>(split ? e->split : e->fwd);
}

extern "C" int mqa_byoc_fa2_own_decode_fits(int64_t head_dim, int64_t num_heads, int64_t num_heads_k,
                                            int64_t batch) {
  return own_decode_fits(head_dim, num_heads, num_heads_k, batch) ? 1 : 0;
}
extern "C" int mqa_byoc_fa2_own_decode(const mqa_byoc_decode_args* args, int device_id, void* stream) {
  g_last_error.clear();
  return own_decode(*args, device_id, static_cast<cudaStream_t>(stream));
}

extern "C" int mqa_byoc_fa2_kernel_available(int hdim, int is_bf16, int causal, int split) {
  const Entry* e = find_entry(hdim, is_bf16, causal);
  if (e == nullptr) return 0;
  return (split ? e->split : e->fwd) != nullptr ? 1 : 0;
}

namespace {

// The sinks operand of attention with sinks (mqa_byoc_fa2_forward_sink); dtype 0 float32, 1 float16, 2 bfloat16.
struct Sinks {
  const void* data;
  int dtype;
};

// Runs the sink epilogue on out (B, S_q, H, D) from the row LSEs lse (B, H, S_q). 0 on success.
int apply_sinks(const Sinks& sinks, void* out, const float* lse, int64_t batch, int64_t seqlen_q, int64_t num_heads,
                int64_t head_dim, const int64_t* o_stride, int is_bf16, bool lse_base2, cudaStream_t stream) {
  return mqa_byoc_apply_sinks(out, lse, sinks.data, sinks.dtype, batch, seqlen_q, num_heads, head_dim, o_stride,
                              is_bf16, lse_base2 ? 1 : 0, stream);
}

int forward(const void* q, const void* k, const void* v, void* out, int64_t batch, int64_t seqlen_q,
            int64_t seqlen_k, int64_t num_heads, int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
            const int64_t* k_stride, const int64_t* v_stride, const int64_t* o_stride, int is_bf16,
            float softmax_scale, int causal, int window_left, int window_right, int device_id, void* stream_handle,
            const Sinks* sinks, float softcap = 0.f) {
  g_last_error.clear();
  // ---- checks (the wrapper checks shapes against the compiled spec; these guard the C API) ----
  if (!fits_int(batch) || !fits_int(seqlen_q) || !fits_int(seqlen_k) || num_heads <= 0 ||
      num_heads_k <= 0 || !fits_int(num_heads) || !fits_int(num_heads_k)) {
    return fail("bad sizes: B=" + std::to_string(batch) + " S_q=" + std::to_string(seqlen_q) +
                " S_kv=" + std::to_string(seqlen_k) + " H=" + std::to_string(num_heads) +
                " H_kv=" + std::to_string(num_heads_k));
  }
  if (int rc = check_heads_and_strides(num_heads, num_heads_k, head_dim, q_stride, k_stride, v_stride,
                                       o_stride, 3)) {
    return rc;
  }
  if (batch == 0 || seqlen_q == 0) return 0;
  if (q == nullptr || k == nullptr || v == nullptr || out == nullptr) return fail("null data pointer");
  if (!mqa_byoc_scale_ok(softmax_scale)) return fail(MQA_BYOC_SCALE_ERROR);
  if (!(softcap >= 0.f) || !std::isfinite(softcap)) return fail("soft-cap is not a finite value >= 0");
  const bool softcapped = softcap > 0.f;

  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard;
  if (int rc = select_device(guard, device_id)) return rc;

  if (seqlen_k == 0) {  // no keys: FA2 defines the output as zeros
    const int64_t compact[4] = {seqlen_q * num_heads * head_dim, num_heads * head_dim, head_dim, 1};
    if (std::memcmp(o_stride, compact, sizeof(compact)) != 0) return fail("S_kv == 0 needs a compact out");
    cudaError_t err = cudaMemsetAsync(out, 0, size_t(batch * seqlen_q * num_heads * head_dim) * 2, stream);
    return err == cudaSuccess ? 0 : fail(std::string("cudaMemsetAsync: ") + cudaGetErrorString(err));
  }

  // ---- the same normalisation flash-attn's mha_fwd applies ----
  int wl = window_left, wr = window_right;
  if (wl >= seqlen_k) wl = -1;
  if (wr >= seqlen_k) wr = -1;
  bool is_causal = causal != 0;
  if (seqlen_q == 1) is_causal = false;  // one query row: causal == full
  if (is_causal) wr = 0;
  // our decode kernel does not soft-cap: soft-capped decode runs FA2's split-KV (soft-capping family)
  if (seqlen_q == 1 && !softcapped && own_decode_fits(head_dim, num_heads, num_heads_k, batch)) {
    mqa_byoc_decode_args a{};
    a.q = q, a.k = k, a.v = v, a.out = out, a.lse = nullptr;
    a.q_stride[0] = q_stride[0], a.q_stride[1] = q_stride[2];
    a.o_stride[0] = o_stride[0], a.o_stride[1] = o_stride[2];
    for (int i = 0; i < 3; ++i) a.k_stride[i] = k_stride[i], a.v_stride[i] = v_stride[i];
    a.seqlen_k = seqlen_k, a.batch = batch, a.num_heads = num_heads, a.num_heads_k = num_heads_k;
    a.head_dim = head_dim, a.is_bf16 = is_bf16, a.softmax_scale = softmax_scale;
    a.window_left = wl, a.lse_empty = -INFINITY;
    if (sinks == nullptr) return own_decode(a, device_id, stream);
    // with sinks: the kernel's LSEs (B, H), base 2, then the epilogue
    void* lse = nullptr;
    if (int rc = alloc_workspace(&lse, size_t(batch * num_heads) * sizeof(float), device_id, stream)) return rc;
    a.lse = static_cast<float*>(lse);
    int rc = own_decode(a, device_id, stream);
    if (rc == 0 && apply_sinks(*sinks, out, a.lse, batch, 1, num_heads, head_dim, o_stride, is_bf16, true, stream)) {
      rc = fail(std::string("sink epilogue launch failed: ") + cudaGetErrorString(cudaGetLastError()));
    }
    cudaFreeAsync(lse, stream);
    return rc;
  }
  // decode with grouped K/V: view q (B, 1, H, D) as (B, g, H_kv, D), i.e. g query rows per K/V head
  const bool swap = seqlen_q == 1 && num_heads > num_heads_k && wl < 0 && wr < 0;

  int64_t sq = seqlen_q, h = num_heads;
  int64_t q_b = q_stride[0], q_r = q_stride[1], q_h = q_stride[2];
  int64_t o_b = o_stride[0], o_r = o_stride[1], o_h = o_stride[2];
  if (swap) {
    const int64_t g = num_heads / num_heads_k;
    sq = g;
    h = num_heads_k;
    q_r = q_stride[2];
    q_h = q_stride[2] * g;
    o_r = o_stride[2];
    o_h = o_stride[2] * g;
  }

  const int hdim = kernel_hdim(head_dim);

  Params p{};
  fill_shared_params(p, q, k, v, out, is_bf16, batch, h, num_heads_k, sq, seqlen_k, head_dim,
                     softmax_scale, wl, wr);
  if (softcapped) {
    // flash-attn's mha_fwd: scores become softcap * tanh(qk * scale / softcap), softmax over them
    p.softcap = softmax_scale / softcap;
    p.scale_softmax = softcap;
    p.scale_softmax_log2 = float(double(softcap) * 1.4426950408889634);  // log2(e)
    p.scale_softmax_rp_dropout = softcap;
  }
  p.q_batch_stride = q_b;
  p.q_row_stride = q_r;
  p.q_head_stride = q_h;
  p.k_batch_stride = k_stride[0];
  p.k_row_stride = k_stride[1];
  p.k_head_stride = k_stride[2];
  p.v_batch_stride = v_stride[0];
  p.v_row_stride = v_stride[1];
  p.v_head_stride = v_stride[2];
  p.o_batch_stride = o_b;
  p.o_row_stride = o_r;
  p.o_head_stride = o_h;
  p.alibi_slopes_ptr = nullptr;
  p.rng_state = nullptr;
  p.unpadded_lse = false;

  // ---- split-KV decision (must match run_mha_fwd_splitkv_dispatch's kBlockN) ----
  const int block_n = head_dim <= 64 ? 256 : (head_dim <= 128 ? 128 : 64);
  const int n_blocks = int((seqlen_k + block_n - 1) / block_n);
  const int m_blocks = int((sq + 64 - 1) / 64);
  const int sms = num_sms(device_id);
  int splits = 1;
  if (sms > 0) {
    const int64_t work = int64_t(batch) * h * m_blocks;
    splits = num_splits_heuristic(int(std::min<int64_t>(work, INT_MAX)), sms * 2, n_blocks, 128);
  }

  const Entry* e = find_entry(hdim, is_bf16, p.is_causal, softcapped);
  EntryFn fn = nullptr;
  if (e != nullptr) {
    if (splits > 1 && e->split != nullptr) {
      fn = e->split;
    } else if (e->fwd != nullptr) {
      fn = e->fwd;
      splits = 1;
    } else if (e->split != nullptr) {  // the split kernel with one split is a plain forward
      fn = e->split;
      splits = 1;
    }
  }
  if (fn == nullptr) return fail_not_built(hdim, is_bf16, p.is_causal, device_id, softcapped);
  if (splits > 1 && swap && batch == 1 && own_combine_enabled() && sinks == nullptr) {
    return chunked_decode(p, fn, splits, block_n, seqlen_k, num_heads, num_heads_k, head_dim, o_stride[2], is_bf16,
                          device_id, stream, out, std::string("FA2 ") + kernel_name(hdim, is_bf16, p.is_causal, softcapped) +
                                                      " split (chunked)");
  }
  p.num_splits = splits;

  // ---- workspaces: softmax LSE (always written) and the split accumulators ----
  const size_t rows = size_t(batch) * size_t(h) * size_t(sq);
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t lse_bytes = align(rows * sizeof(float));
  const size_t lse_acc_bytes = splits > 1 ? align(size_t(splits) * rows * sizeof(float)) : 0;
  const size_t o_acc_bytes =
      splits > 1 ? align(size_t(splits) * rows * size_t(p.d_rounded) * sizeof(float)) : 0;
  const size_t total = lse_bytes + lse_acc_bytes + o_acc_bytes;
  void* ws = nullptr;
  if (int rc = alloc_workspace(&ws, total, device_id, stream)) return rc;
  char* base = static_cast<char*>(ws);
  p.softmax_lse_ptr = base;
  if (splits > 1) {
    p.softmax_lseaccum_ptr = base + lse_bytes;
    p.oaccum_ptr = base + lse_bytes + lse_acc_bytes;
  }

  std::function<int()> epilogue = nullptr;
  if (sinks != nullptr) {
    // FA2's LSE is (B, H, S_q) (with the grouped-decode swap (B, H_kv, g) = (B, H) for one row); natural log
    epilogue = [&] {
      return apply_sinks(*sinks, out, static_cast<const float*>(p.softmax_lse_ptr), batch, seqlen_q, num_heads,
                         head_dim, o_stride, is_bf16, false, stream);
    };
  }
  return launch_and_free(fn, &p, stream, ws, "flash_attn[h=%lld,kv=%lld,d=%lld]", num_heads, num_heads_k, head_dim,
                         std::string("FA2 ") + kernel_name(hdim, is_bf16, p.is_causal, softcapped) +
                             (splits > 1 ? " split" : ""), epilogue);
}

}  // namespace

extern "C" int mqa_byoc_fa2_forward(const void* q, const void* k, const void* v, void* out,
                                    int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                    int64_t num_heads, int64_t num_heads_k, int64_t head_dim,
                                    const int64_t* q_stride, const int64_t* k_stride,
                                    const int64_t* v_stride, const int64_t* o_stride, int is_bf16,
                                    float softmax_scale, int causal, int window_left,
                                    int window_right, int device_id, void* stream_handle) {
  return forward(q, k, v, out, batch, seqlen_q, seqlen_k, num_heads, num_heads_k, head_dim, q_stride, k_stride,
                 v_stride, o_stride, is_bf16, softmax_scale, causal, window_left, window_right, device_id,
                 stream_handle, nullptr);
}

extern "C" int mqa_byoc_fa2_forward_sink(const void* q, const void* k, const void* v, const void* sinks,
                                         int sinks_dtype, void* out, int64_t batch, int64_t seqlen_q,
                                         int64_t seqlen_k, int64_t num_heads, int64_t num_heads_k, int64_t head_dim,
                                         const int64_t* q_stride, const int64_t* k_stride, const int64_t* v_stride,
                                         const int64_t* o_stride, int is_bf16, float softmax_scale, int causal,
                                         int window_left, int window_right, int device_id, void* stream_handle) {
  if (sinks == nullptr || sinks_dtype < 0 || sinks_dtype > 2) {
    g_last_error.clear();
    return fail("sinks: a null pointer or an unknown dtype code " + std::to_string(sinks_dtype));
  }
  const Sinks s{sinks, sinks_dtype};
  return forward(q, k, v, out, batch, seqlen_q, seqlen_k, num_heads, num_heads_k, head_dim, q_stride, k_stride,
                 v_stride, o_stride, is_bf16, softmax_scale, causal, window_left, window_right, device_id,
                 stream_handle, &s);
}

extern "C" int mqa_byoc_fa2_forward_softcap(const void* q, const void* k, const void* v, float softcap, void* out,
                                            int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads,
                                            int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                                            const int64_t* k_stride, const int64_t* v_stride,
                                            const int64_t* o_stride, int is_bf16, float softmax_scale, int causal,
                                            int window_left, int window_right, int device_id, void* stream_handle) {
  if (!(softcap > 0.f)) {
    g_last_error.clear();
    return fail("soft-capped attention needs a soft-cap > 0, got " + std::to_string(softcap));
  }
  return forward(q, k, v, out, batch, seqlen_q, seqlen_k, num_heads, num_heads_k, head_dim, q_stride, k_stride,
                 v_stride, o_stride, is_bf16, softmax_scale, causal, window_left, window_right, device_id,
                 stream_handle, nullptr, softcap);
}

// ---- var-len forward (R.nn.attention_var_len) ------------------------------------------------
// The same kernel families as above: FA2 switches to variable lengths at run time when
// cu_seqlens_q / cu_seqlens_k are set (BlockInfo reads each sequence's offset and length). Params
// are filled the way flash-attn 2.8.3's mha_varlen_fwd fills them without a paged KV cache: row and
// head strides only (no batch stride), the max lengths as seqlen_q / seqlen_k (grid size and window
// clamp), LSE unpadded as (H, total_q). No split-KV: mha_varlen_fwd splits only on its grouped
// decode path (max_seqlen_q == 1), where it drops cu_seqlens_q; var-len prefill runs the plain
// kernel, and so do we (the split kernel with one split when only that one is linked).
extern "C" int mqa_byoc_fa2_varlen_forward(const void* q, const void* k, const void* v, void* out,
                                           const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                           int64_t batch, int64_t total_q, int64_t total_k,
                                           int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t num_heads,
                                           int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
                                           const int64_t* k_stride, const int64_t* v_stride,
                                           const int64_t* o_stride, int is_bf16, float softmax_scale,
                                           int causal, int window_left, int window_right, int device_id,
                                           void* stream_handle) {
  g_last_error.clear();
  if (!fits_int(batch) || !fits_int(total_q) || !fits_int(total_k) || !fits_int(max_seqlen_q) ||
      !fits_int(max_seqlen_k) || num_heads <= 0 || num_heads_k <= 0 || !fits_int(num_heads) ||
      !fits_int(num_heads_k)) {
    return fail("bad sizes: batch=" + std::to_string(batch) + " total_q=" + std::to_string(total_q) +
                " total_k=" + std::to_string(total_k) + " max_seqlen_q=" + std::to_string(max_seqlen_q) +
                " max_seqlen_k=" + std::to_string(max_seqlen_k) + " H=" + std::to_string(num_heads) +
                " H_kv=" + std::to_string(num_heads_k));
  }
  if (int rc = check_heads_and_strides(num_heads, num_heads_k, head_dim, q_stride, k_stride, v_stride,
                                       o_stride, 2)) {
    return rc;
  }
  if (batch == 0 || total_q == 0 || max_seqlen_q == 0) return 0;
  if (q == nullptr || k == nullptr || v == nullptr || out == nullptr || cu_seqlens_q == nullptr ||
      cu_seqlens_k == nullptr) {
    return fail("null data pointer");
  }
  if (!mqa_byoc_scale_ok(softmax_scale)) return fail(MQA_BYOC_SCALE_ERROR);

  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard;
  if (int rc = select_device(guard, device_id)) return rc;

  if (max_seqlen_k == 0 || total_k == 0) {  // no keys anywhere: FA2 defines the output as zeros
    if (o_stride[0] != num_heads * head_dim || o_stride[1] != head_dim) return fail("no keys needs a compact out");
    cudaError_t err = cudaMemsetAsync(out, 0, size_t(total_q * num_heads * head_dim) * 2, stream);
    return err == cudaSuccess ? 0 : fail(std::string("cudaMemsetAsync: ") + cudaGetErrorString(err));
  }

  // ---- mha_varlen_fwd's normalisation ----
  int wl = window_left, wr = window_right;
  bool is_causal = causal != 0;
  if (max_seqlen_q == 1) is_causal = false;  // one query row per sequence: causal == full
  if (is_causal) wr = 0;
  if (wl >= max_seqlen_k) wl = -1;
  if (wr >= max_seqlen_k) wr = -1;

  const int hdim = kernel_hdim(head_dim);

  Params p{};
  fill_shared_params(p, q, k, v, out, is_bf16, batch, num_heads, num_heads_k, max_seqlen_q,
                     max_seqlen_k, head_dim, softmax_scale, wl, wr);
  p.q_row_stride = q_stride[0];
  p.q_head_stride = q_stride[1];
  p.k_row_stride = k_stride[0];
  p.k_head_stride = k_stride[1];
  p.v_row_stride = v_stride[0];
  p.v_head_stride = v_stride[1];
  p.o_row_stride = o_stride[0];
  p.o_head_stride = o_stride[1];
  p.cu_seqlens_q = const_cast<int*>(reinterpret_cast<const int*>(cu_seqlens_q));
  p.cu_seqlens_k = const_cast<int*>(reinterpret_cast<const int*>(cu_seqlens_k));
  p.seqused_k = nullptr;
  p.total_q = int(total_q);
  p.unpadded_lse = true;  // LSE as (H, total_q)
  p.num_splits = 1;

  const Entry* e = find_entry(hdim, is_bf16, p.is_causal);
  EntryFn fn = e == nullptr ? nullptr : (e->fwd != nullptr ? e->fwd : e->split);
  if (fn == nullptr) return fail_not_built(hdim, is_bf16, p.is_causal, device_id);

  const size_t lse_bytes = (size_t(num_heads) * size_t(total_q) * sizeof(float) + 255) / 256 * 256;
  void* ws = nullptr;
  if (int rc = alloc_workspace(&ws, lse_bytes, device_id, stream)) return rc;
  p.softmax_lse_ptr = ws;

  return launch_and_free(fn, &p, stream, ws, "flash_attn_varlen[h=%lld,kv=%lld,d=%lld]", num_heads, num_heads_k, head_dim,
                         std::string("FA2 var-len ") + kernel_name(hdim, is_bf16, p.is_causal));
}
