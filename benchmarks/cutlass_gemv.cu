// Would a CUTLASS kernel read the decode weights faster than cuBLASLt does? The decode GEMVs (M = 1,
// fp16, weights (N, K) as our plans read them, CodeLlama-34B shapes) timed in one process:
//   - read floor: a kernel that only reads the weight (src/mqa_byoc/testing/read_floor.cu), fastest launch shape;
//   - cuBLASLt: our plans' rule (native/cublaslt_gemm.cc: the heuristic's first 16, each split-K one also
//     with a split count of 1, the fastest kept);
//   - CUTLASS's GEMV (cutlass::gemm::device::Gemv over kernel::Gemv, row-major A: a row per kThreadsPerRow
//     threads, 16-byte loads): thread counts x threads per row;
// at M = 1 (and at M = 8 the sm90 GEMMs against cuBLASLt);
//   - CUTLASS 3 sm90 GEMMs with the operands swapped (D^T = W X^T: the weight's N rows on the MMA's M side,
//     the one token on an N tile of 8 or 16), TMA warp-specialized, persistent or stream-K tile scheduler.
// Every call after a pass over a buffer of twice the L2 (the weight is read from HBM, as in a decoder whose
// layers each read their own), CUDA events around the one call, the median of 7. The pass reads the buffer
// (`./cutlass_gemv read`, the default: L2 then holds clean lines, as after the decoder's previous GEMM) or
// writes it (`./cutlass_gemv write`: L2 holds dirty lines whose write-back runs during the timed call).
// Each CUTLASS output is checked against cuBLASLt's (random weights, fp32 accumulation on both).
//
//   nvcc -O3 -DNDEBUG -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I<cutlass include> \
//        -o cutlass_gemv benchmarks/cutlass_gemv.cu -lcublasLt && ./cutlass_gemv read && ./cutlass_gemv write
// <cutlass include>: CUTLASS's headers, e.g. the nvidia-cutlass wheel's cutlass_library/source/include or
// apache-tvm's tvm/3rdparty/cutlass/include (python -c "from mqa_byoc.kernels import gemv;
// print(gemv.cutlass_include_dir())").
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemv.h"
#include "cutlass/gemm/kernel/gemv.h"

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "../src/mqa_byoc/testing/read_floor.cu"
#include "cold_median.h"

#define CK(x) do { auto _s = (x); if ((int)_s != 0) { printf("ERR %s:%d %d\n", __FILE__, __LINE__, (int)_s); exit(1);} } while (0)

static void* g_flush; static size_t g_flush_bytes;
static uint32_t* g_sink;
static bool g_read_flush = true;
static int g_sms = 0;
static cudaEvent_t e0, e1;

static void flush_l2(int round) {
  if (g_read_flush) {
    mqa_byoc_read_floor_launch(g_flush, g_flush_bytes, g_sink, g_sms * 4, 512, 0);
  } else {
    cudaMemsetAsync(g_flush, round, g_flush_bytes, 0);
  }
}
static const int kReps = 7;

// Median GPU time (µs) of `call`, each after reading twice the L2 (flush_l2); -1 when a call fails.
static float time_cold(const std::function<int()>& call) { return median_cold_us(call, flush_l2, kReps, e0, e1); }

struct Weight { const char* name; int n, k; bool resid; };
struct Buffers { cutlass::half_t *w, *x, *res, *out, *ref; int n, k, m; bool resid; };

// ---- CUTLASS's GEMV ----
template <int Threads, int PerRow>
struct CutlassGemv {
  using Epilogue = cutlass::epilogue::thread::LinearCombination<cutlass::half_t, 1, float, float>;
  using Kernel = cutlass::gemm::kernel::Gemv<cutlass::half_t, cutlass::layout::RowMajor, cutlass::half_t,
                                             cutlass::half_t, float, Epilogue, 8, Threads, PerRow>;
  using Op = cutlass::gemm::device::Gemv<Kernel>;
  static std::string name() { return "cutlass Gemv threads=" + std::to_string(Threads) + " per_row=" + std::to_string(PerRow); }
  static int run(Buffers& b) {
    if (b.m != 1) return 5;
    typename Op::Arguments args({b.n, b.k}, {1.f, b.resid ? 1.f : 0.f},
                                {b.w, b.k}, b.x, b.resid ? b.res : b.out, b.out);
    Op op;
    if (op.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (op.initialize(args, nullptr, 0) != cutlass::Status::kSuccess) return 2;
    return op.run(0) == cutlass::Status::kSuccess ? 0 : 3;
  }
};

// ---- CUTLASS 3 sm90, operands swapped: D^T (N x 1, column-major) = W (N x K, row-major) X^T (K x 1) ----
template <int TM, int TN, int TK, class KernelSchedule, class EpilogueSchedule, class Scheduler>
struct Sm90Swapped {
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, cutlass::half_t, cutlass::layout::ColumnMajor, 8,
      cutlass::half_t, cutlass::layout::ColumnMajor, 8, EpilogueSchedule>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::half_t, cutlass::layout::RowMajor, 8,
      cutlass::half_t, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, Scheduler>;
  using Op = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static inline void* workspace = nullptr;
  static inline size_t workspace_bytes = 0;
  static std::string name(const char* what) {
    return std::string("cutlass sm90 swapped ") + what + " tile=" + std::to_string(TM) + "x" + std::to_string(TN) +
           "x" + std::to_string(TK);
  }
  static int run(Buffers& b) {
    using StrideA = typename Op::GemmKernel::StrideA;
    using StrideB = typename Op::GemmKernel::StrideB;
    using StrideC = typename Op::GemmKernel::StrideC;
    using StrideD = typename Op::GemmKernel::StrideD;
    // packed strides: A (N x K) K-major, B (M x K) K-major, C and D (N x M) N-major; one batch
    StrideA sa = cute::make_stride(int64_t(b.k), cute::Int<1>{}, int64_t(b.n) * b.k);
    StrideB sb = cute::make_stride(int64_t(b.k), cute::Int<1>{}, int64_t(b.m) * b.k);
    StrideC sc = cute::make_stride(cute::Int<1>{}, int64_t(b.n), int64_t(b.n) * b.m);
    StrideD sd = cute::make_stride(cute::Int<1>{}, int64_t(b.n), int64_t(b.n) * b.m);
    typename Op::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {b.n, b.m, b.k, 1},
                                {b.w, sa, b.x, sb},
                                {{1.f, b.resid ? 1.f : 0.f}, b.resid ? b.res : b.out, sc, b.out, sd}};
    Op op;
    if (op.can_implement(args) != cutlass::Status::kSuccess) return 1;
    size_t need = Op::get_workspace_size(args);
    if (need > workspace_bytes) {
      if (workspace) cudaFree(workspace);
      if (cudaMalloc(&workspace, need) != cudaSuccess) return 4;
      workspace_bytes = need;
    }
    if (op.initialize(args, workspace, 0) != cutlass::Status::kSuccess) return 2;
    return op.run(0) == cutlass::Status::kSuccess ? 0 : 3;
  }
};

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingEpi = cutlass::epilogue::TmaWarpSpecialized;
using StreamK = cutlass::gemm::StreamKScheduler;
using Persistent = cutlass::gemm::PersistentScheduler;

// ---- cuBLASLt, our plans' rule ----
struct Lt {
  cublasLtHandle_t h; void* ws; static const size_t WS = 32u << 20;
  cublasLtMatmulDesc_t desc; cublasLtMatrixLayout_t a, b, c, d;
  cublasLtMatmulAlgo_t best;
  int call(Buffers& p, const cublasLtMatmulAlgo_t& algo) {
    float alpha = 1.f, beta = p.resid ? 1.f : 0.f;
    return (int)cublasLtMatmul(h, desc, &alpha, p.w, a, p.x, b, &beta, p.resid ? p.res : p.out, c, p.out, d, &algo,
                               ws, WS, 0);
  }
  float plan(Buffers& p) {
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    CK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16F, p.k, p.n, p.k));
    CK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16F, p.k, p.m, p.k));
    CK(cublasLtMatrixLayoutCreate(&c, CUDA_R_16F, p.n, p.m, p.n));
    CK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16F, p.n, p.m, p.n));
    cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
    size_t wsz = WS; cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz);
    cublasLtMatmulHeuristicResult_t res[16]; int found = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, c, d, pref, 16, res, &found));
    float t_best = 1e30f;
    auto consider = [&](const cublasLtMatmulAlgo_t& algo) {
      float t = time_cold([&] { return call(p, algo); });
      if (t > 0 && t < t_best) { t_best = t; best = algo; }
    };
    for (int i = 0; i < found; ++i) {
      consider(res[i].algo);
      int split; size_t w;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split, &w);
      if (split > 1) {
        auto one_split = res[i].algo; int one = 1;
        cublasLtMatmulAlgoConfigSetAttribute(&one_split, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one);
        cublasLtMatmulHeuristicResult_t r;
        if (cublasLtMatmulAlgoCheck(h, desc, a, b, c, d, &one_split, &r) == 0 && r.workspaceSize <= WS) consider(one_split);
      }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return t_best;
  }
  void release() {
    cublasLtMatrixLayoutDestroy(a); cublasLtMatrixLayoutDestroy(b); cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(d); cublasLtMatmulDescDestroy(desc);
  }
};

__global__ void fill_random(cutlass::half_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t v = (uint32_t)(i * 2654435761u) ^ seed; v ^= v >> 13; v *= 0x5bd1e995u; v ^= v >> 15;
    p[i] = cutlass::half_t(((v & 0xffff) / 65535.f - 0.5f) * scale);
  }
}

// Largest |out - ref| over |ref| + 1 (the output as fp16 from fp32 accumulation on both sides).
static float max_err(Buffers& b) {
  size_t n = (size_t)b.n * b.m;
  std::vector<cutlass::half_t> o(n), r(n);
  cudaMemcpy(o.data(), b.out, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(r.data(), b.ref, n * 2, cudaMemcpyDeviceToHost);
  float e = 0;
  for (size_t i = 0; i < n; ++i) e = std::max(e, std::fabs(float(o[i]) - float(r[i])) / (std::fabs(float(r[i])) + 1.f));
  return e;
}

int main(int argc, char** argv) {
  g_read_flush = !(argc > 1 && std::string(argv[1]) == "write");
  int dev_l2; CK(cudaDeviceGetAttribute(&dev_l2, cudaDevAttrL2CacheSize, 0));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  g_sms = sms;
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs, L2 %d MB; L2 flush before each call: %s\n", prop.name, sms, dev_l2 >> 20,
         g_read_flush ? "read twice the L2" : "write twice the L2");
  g_flush_bytes = 2 * (size_t)dev_l2; CK(cudaMalloc(&g_flush, g_flush_bytes));
  CK(cudaMemset(g_flush, 0, g_flush_bytes));
  CK(cudaMalloc(&g_sink, 64));
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  Lt lt; CK(cublasLtCreate(&lt.h)); CK(cudaMalloc(&lt.ws, Lt::WS));
  uint32_t* sink; CK(cudaMalloc(&sink, 64));
  std::vector<Weight> weights = {{"qkv_proj", 10240, 8192, false}, {"o_proj+residual", 8192, 8192, true},
                                 {"o_proj", 8192, 8192, false}, {"gate_up_proj", 44032, 8192, false},
                                 {"down_proj+residual", 8192, 22016, true}, {"lm_head", 32000, 8192, false}};
  for (int m : {1, 8}) for (auto& wt : weights) {
    Buffers b{}; b.n = wt.n; b.k = wt.k; b.m = m; b.resid = wt.resid;
    size_t wn = (size_t)wt.n * wt.k, on = (size_t)wt.n * m;
    CK(cudaMalloc(&b.w, wn * 2)); CK(cudaMalloc(&b.x, (size_t)wt.k * m * 2)); CK(cudaMalloc(&b.res, on * 2));
    CK(cudaMalloc(&b.out, on * 2)); CK(cudaMalloc(&b.ref, on * 2));
    fill_random<<<1024, 256>>>(b.w, wn, 1u, 0.2f); fill_random<<<64, 256>>>(b.x, (size_t)wt.k * m, 2u, 1.f);
    fill_random<<<64, 256>>>(b.res, on, 3u, 4.f);
    CK(cudaDeviceSynchronize());
    double mb = wn * 2 / 1e6;
    printf("\n== %s M=%d N=%d K=%d (%.0f MB; bytes limit at 4.8 TB/s %.1f us)\n", wt.name, m, wt.n, wt.k, mb, mb / 4.8e6 * 1e6);
    // read floor
    float floor_us = 1e30f; int fb = 0, ft = 0;
    for (int mult : {1, 2, 4, 8, 16}) for (int threads : {256, 512, 1024}) {
      float t = time_cold([&] { return mqa_byoc_read_floor_launch(b.w, wn * 2, sink, sms * mult, threads, 0); });
      if (t > 0 && t < floor_us) { floor_us = t; fb = sms * mult; ft = threads; }
    }
    printf("read floor: %.1f us (%d x %d)\n", floor_us, fb, ft);
    float lt_us = lt.plan(b);
    CK(lt.call(b, lt.best)); CK(cudaMemcpy(b.ref, b.out, on * 2, cudaMemcpyDeviceToDevice));
    printf("cublasLt (our rule): %.1f us (%.3fx floor)\n", lt_us, lt_us / floor_us);
    auto report = [&](const std::string& name, const std::function<int(Buffers&)>& run) {
      cudaMemset(b.out, 0, on * 2);
      int rc = run(b);
      if (rc != 0) { printf("%s: not run (%d)\n", name.c_str(), rc); cudaGetLastError(); return; }
      CK(cudaDeviceSynchronize());
      float err = max_err(b);
      float t = time_cold([&] { return run(b); });
      printf("%s: %.1f us (%.3fx floor, %.3fx cublasLt) err %.2e%s\n", name.c_str(), t, t / floor_us, t / lt_us, err,
             err > 2e-2f ? " WRONG" : "");
    };
    if (m == 1) {
    report(CutlassGemv<128, 8>::name(), CutlassGemv<128, 8>::run);
    report(CutlassGemv<128, 16>::name(), CutlassGemv<128, 16>::run);
    report(CutlassGemv<128, 32>::name(), CutlassGemv<128, 32>::run);
    report(CutlassGemv<256, 16>::name(), CutlassGemv<256, 16>::run);
    report(CutlassGemv<256, 32>::name(), CutlassGemv<256, 32>::run);
    report(CutlassGemv<512, 32>::name(), CutlassGemv<512, 32>::run);
    }
    using S1 = Sm90Swapped<128, 16, 128, Coop, CoopEpi, StreamK>;
    using S2 = Sm90Swapped<128, 8, 128, Coop, CoopEpi, StreamK>;
    using S3 = Sm90Swapped<64, 16, 128, Ping, PingEpi, Persistent>;
    using S4 = Sm90Swapped<64, 8, 256, Ping, PingEpi, Persistent>;
    using S5 = Sm90Swapped<128, 16, 256, Coop, CoopEpi, StreamK>;
    report(S1::name("cooperative stream-K"), S1::run);
    report(S2::name("cooperative stream-K"), S2::run);
    report(S3::name("pingpong persistent"), S3::run);
    report(S4::name("pingpong persistent"), S4::run);
    report(S5::name("cooperative stream-K"), S5::run);
    fflush(stdout);
    lt.release();
    cudaFree(b.w); cudaFree(b.x); cudaFree(b.res); cudaFree(b.out); cudaFree(b.ref);
  }
  return 0;
}
