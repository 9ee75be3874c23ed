// How close is the cuBLASLt algorithm our GEMM plans measure (the heuristic's first 16, each split-K one also
// with a split count of 1, every call from a cold L2: native/cublaslt_gemm.cc) to the fastest configuration
// cuBLASLt has, for the decode GEMVs (M = 1, fp16, weights (N, K) as our plans read them)? Per weight:
//   - the heuristic's first algorithm;
//   - our rule: the best of those candidates;
//   - the heuristic's 64 results x split counts 1, 2, 3, 4, 5, 6, 8, 12, 16;
//   - every algorithm id cuBLASLt lists x its tiles x stages x cluster shapes {auto, 1x1, 2x1} x split counts
//     {1, 2, 4, 8} x swizzle (at most 3,000 configurations a weight).
// Each time: the median of 5 calls (3 in the enumeration), each after writing a buffer of twice the L2,
// CUDA events. Shapes: CodeLlama-34B's qkv_proj, o_proj (with and without the residual as C), gate_up_proj,
// down_proj (with the residual), lm_head. No TVM, no mqa_byoc: cuBLASLt from the CUDA toolkit.
//
//   nvcc -O2 -arch=sm_90a -o cublaslt_search benchmarks/cublaslt_search.cu -lcublasLt && ./cublaslt_search
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <string>
#include <set>
#include <tuple>

#include "cold_median.h"

#define CK(x) do { auto _s = (x); if (_s != 0) { printf("ERR %s:%d %d\n", __FILE__, __LINE__, (int)_s); exit(1);} } while (0)

static void* g_flush; static size_t g_flush_bytes;
static cudaEvent_t e0, e1;
static cublasLtHandle_t h;
static void* ws; static const size_t WS = 32u << 20;

struct Prob { cublasLtMatmulDesc_t desc; cublasLtMatrixLayout_t a, b, c, d; void *w, *x, *out, *res; int n, k; bool resid; };

float time_algo(Prob& p, const cublasLtMatmulAlgo_t& algo, int reps) {
  float alpha = 1.f, beta = p.resid ? 1.f : 0.f;
  const void* c = p.resid ? p.res : p.out;
  auto call = [&] {
    return int(cublasLtMatmul(h, p.desc, &alpha, p.w, p.a, p.x, p.b, &beta, c, p.c, p.out, p.d, &algo, ws, WS, 0));
  };
  return median_cold_us(call, [](int r) { cudaMemsetAsync(g_flush, r, g_flush_bytes, 0); }, reps, e0, e1);
}

std::string describe(const cublasLtMatmulAlgo_t& algo) {
  int id = 0, tile = 0, stages = 0, split = 0, swz = 0, red = 0, cluster = 0, custom = 0; size_t w;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &w);
  char buf[160];
  snprintf(buf, sizeof buf, "id=%d tile=%d stages=%d split=%d swz=%d red=%d cluster=%d custom=%d", id, tile, stages,
           split, swz, red, cluster, custom);
  return buf;
}

bool check(Prob& p, cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t r;
  if (cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.c, p.d, &algo, &r) != 0) return false;
  return r.workspaceSize <= WS;
}

int main(int argc, char** argv) {
  int reps = 5;
  CK(cublasLtCreate(&h));
  CK(cudaMalloc(&ws, WS));
  int l2; cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0);
  g_flush_bytes = 2 * (size_t)l2; CK(cudaMalloc(&g_flush, g_flush_bytes));
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  struct S { const char* name; int n, k; bool resid; };
  std::vector<S> shapes = {{"qkv_proj", 10240, 8192, false}, {"o_proj+res", 8192, 8192, true},
                           {"o_proj", 8192, 8192, false}, {"gate_up", 44032, 8192, false},
                           {"down+res", 8192, 22016, true}, {"lm_head", 32000, 8192, false}};
  int full = argc > 1 ? atoi(argv[1]) : 1;
  for (auto& s : shapes) {
    Prob p; p.n = s.n; p.k = s.k; p.resid = s.resid;
    size_t wb = (size_t)s.n * s.k * 2;
    CK(cudaMalloc(&p.w, wb)); CK(cudaMalloc(&p.x, s.k * 2)); CK(cudaMalloc(&p.out, s.n * 2)); CK(cudaMalloc(&p.res, s.n * 2));
    cudaMemset(p.w, 0x11, wb); cudaMemset(p.x, 0x11, s.k * 2); cudaMemset(p.res, 0, s.n * 2);
    CK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    CK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16F, s.k, s.n, s.k));
    CK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16F, s.k, 1, s.k));
    CK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16F, s.n, 1, s.n));
    CK(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_16F, s.n, 1, s.n));
    cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
    size_t wsz = WS; cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz);
    cublasLtMatmulHeuristicResult_t res[64]; int found = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.a, p.b, p.c, p.d, pref, 64, res, &found));
    // our rule: first 16 + unsplit forms
    std::vector<std::pair<float, std::string>> ours, ext;
    float first = time_algo(p, res[0].algo, reps);
    std::set<std::string> seen;
    auto consider = [&](cublasLtMatmulAlgo_t algo, std::vector<std::pair<float, std::string>>& into) {
      std::string d = describe(algo);
      if (!seen.insert(d).second) return;
      float t = time_algo(p, algo, reps);
      if (t > 0) into.push_back({t, d});
    };
    for (int i = 0; i < std::min(found, 16); ++i) {
      consider(res[i].algo, ours);
      int split; size_t w; cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split, &w);
      if (split > 1) { auto a = res[i].algo; int one = 1; cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one); if (check(p, a)) consider(a, ours); }
    }
    ext = ours;
    for (int i = 0; i < found; ++i) {
      for (int sp : {1, 2, 3, 4, 5, 6, 8, 12, 16}) {
        auto a = res[i].algo;
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sp, sizeof sp);
        if (check(p, a)) consider(a, ext);
      }
    }
    std::sort(ours.begin(), ours.end()); std::sort(ext.begin(), ext.end());
    printf("\n== %s N=%d K=%d heuristic found %d\n", s.name, s.n, s.k, found);
    printf("heuristic first: %.1f us %s\n", first, describe(res[0].algo).c_str());
    printf("our rule best of %zu: %.1f us %s\n", ours.size(), ours[0].first, ours[0].second.c_str());
    printf("heuristic64 x splits best of %zu: %.1f us %s\n", ext.size(), ext[0].first, ext[0].second.c_str());
    for (int i = 1; i < std::min<int>(6, ext.size()); ++i) printf("   %.1f %s\n", ext[i].first, ext[i].second.c_str());
    if (full) {
      int ids[256], nids = 0;
      CK(cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16F, CUDA_R_16F, CUDA_R_16F, 256, ids, &nids));
      std::vector<std::pair<float, std::string>> all;
      int tried = 0;
      for (int ii = 0; ii < nids; ++ii) {
        cublasLtMatmulAlgo_t base;
        if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16F, CUDA_R_16F, CUDA_R_16F, ids[ii], &base) != 0) continue;
        size_t w = 0;
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, nullptr, 0, &w);
        std::vector<int> tiles(w / sizeof(int)); if (tiles.empty()) tiles.push_back(0);
        else cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(), w, &w);
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_STAGES_IDS, nullptr, 0, &w);
        std::vector<int> stages(w / sizeof(int)); if (stages.empty()) stages.push_back(0);
        else cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_STAGES_IDS, stages.data(), w, &w);
        std::vector<int> clusters = {0, 2, 3};
        int splitk_support = 0, swz_support = 0;
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk_support, sizeof(int), &w);
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swz_support, sizeof(int), &w);
        printf("  algo id %d: %zu tiles %zu stages %zu clusters splitk=%d swz=%d\n", ids[ii], tiles.size(), stages.size(), clusters.size(), splitk_support, swz_support);
        for (int t : tiles) for (int st : stages) for (int cl : clusters) for (int sp : {1, 2, 4, 8}) for (int sw = 0; sw <= swz_support; ++sw) {
          if (sp > 1 && !splitk_support) continue;
          cublasLtMatmulAlgo_t a = base;
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof t);
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &st, sizeof st);
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, sizeof cl);
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sp, sizeof sp);
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &sw, sizeof sw);
          if (!check(p, a)) continue;
          if (++tried > 3000) break;
          float tm = time_algo(p, a, 3);
          if (tm > 0) all.push_back({tm, describe(a)});
        }
      }
      std::sort(all.begin(), all.end());
      printf("enumerated %d configs (%zu ran): best %.1f us %s\n", tried, all.size(),
             all.empty() ? -1.f : all[0].first, all.empty() ? "" : all[0].second.c_str());
      for (int i = 1; i < std::min<int>(4, all.size()); ++i) printf("   %.1f %s\n", all[i].first, all[i].second.c_str());
    }
    fflush(stdout);
    cudaFree(p.w); cudaFree(p.x); cudaFree(p.out); cudaFree(p.res);
  }
  return 0;
}
