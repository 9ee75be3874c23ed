// GEMMs of offloaded Relax matmuls on cuBLASLt: D = epilogue(X @ W (+ bias)) (+ residual).
//
// Row-major X (M, K), W (K, N) or W^T given as (N, K), D (M, N). cuBLASLt is column-major, so the call
// computes D^T (N x M) = op(W)^T-view (N x K) @ X^T-view (K x M): the row-major buffers read as their
// transposes, no copy. The bias (N) is a vector over cuBLASLt's rows; the residual is C with beta = 1.
// Batched: `batch` such products of consecutive matrices (strided batches of M x K, K x N, M x N), the
// bias shared by all (cuBLASLt's bias batch stride is 0).
//
// libcublasLt.so.13 is opened at the first call (dlopen), so that the exported library loads without it
// and says what to install when it is missing. Search order: the loader's path (LD_LIBRARY_PATH, rpath,
// ld.so cache, a libcublasLt already loaded in the process), the directory of this library, and the
// nvidia-cublas wheel directory seen when this file was compiled (MQA_BYOC_CUBLASLT_HINT).
//
// One handle per device, one descriptor set + algorithm cached per (device, shape, type, epilogue,
// alignment); a 32 MiB workspace per device from TVM's workspace pool, used on TVM's stream.
//
// Algorithm: cuBLASLt's heuristic ranks its algorithms by a model. A plan of at most kMeasureMaxM rows (not batched)
// (decode: the weight is read once, and the heuristic's first choice is often a split-K algorithm with a
// reduction kernel after it) times up to kCandidates of the heuristic's algorithms, and each split-K one
// of them again with its split count set to 1 (the same kernel reading all of K: the heuristic often
// offers only the split form of the tile shape that streams a decode weight fastest), and for a GEMM of
// one row that it can compute the configurations of CUTLASS's GEMV (cutlass_gemv.cu, a fatbin in this
// object, launched through the driver), on the call's own operands, on its stream (CUDA driver events,
// libcuda.so.1 opened the same way), each call after reading twice the L2 (pick_fastest, L2Flush), and
// keeps the fastest; the measurement runs at most kTimed x (1 + kMeasureRounds)
// calls, once per shape (tens of ms for a weight of several hundred MB). Measured on the H200
// (CodeLlama-34B shapes, the paged decoder): 1.5-4% less time per decode step at batch 1-32 than the
// heuristic's first choice (benchmarks/results/2026-12-01-decoders.md); the split-count-1 forms and the
// cold L2 took another 0.5-2.6% off a step at batch 1-32 (2026-12-03-decoders-gemm-measure.md). Larger M
// keeps the heuristic's choice (prefill GEMMs run at or above torch.matmul's rate with it, and a new
// prompt length would measure again). The build option kernel_options gemm_algorithm=heuristic
// (compiled into the library, mqa_byoc/compiler/kernel_options.py; no environment variable) keeps the
// heuristic's first choice everywhere. A plan made while the
// stream is being captured into a CUDA graph keeps it too: nothing may synchronize there. TVM's
// relax.backend.use_cuda_graph runs each captured region once outside the capture first, so its GEMMs are
// measured in that call and the graph replays the measured algorithm.
#include <cublasLt.h>
#include <dlfcn.h>
#include <tvm/runtime/c_backend_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cutlass_gemv.h"  // CUTLASS's GEMV configurations (the fatbin below, when the build has it)
#include "fa2_dispatch.h"  // mqa_byoc_kernel_options (the struct only; no FA2 code is needed here)

// Defined (hidden) by the library's options module when the build gives one; null otherwise.
extern "C" __attribute__((weak, visibility("hidden"))) const mqa_byoc_kernel_options mqa_byoc_library_kernel_options;

#ifndef MQA_BYOC_CUBLASLT_HINT
#define MQA_BYOC_CUBLASLT_HINT ""
#endif

// cutlass_gemv.cu compiled to a fatbin (nvcc -fatbin), its bytes as a C initializer list, when the build
// had nvcc and CUTLASS's headers (mqa_byoc/compiler/cublaslt_build.py); without it GEMMs run on cuBLASLt only.
#ifdef MQA_BYOC_GEMV_FATBIN
namespace {
alignas(8) const unsigned char kGemvFatbin[] = {
#include MQA_BYOC_GEMV_FATBIN
};
}  // namespace
#endif

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what NVIDIA recommends for Hopper
constexpr int kCandidates = 16;                 // heuristic results timed for a small-M plan
constexpr int kTimed = 2 * kCandidates;         // with the split-count-1 form of each split-K one
constexpr int64_t kMeasureMaxM = 64;            // rows up to which a plan is measured
constexpr int kMeasureRounds = 5;               // timed calls per candidate (after one untimed), in turns
#define MQA_BYOC_GEMV_ONE(I, TH, PR) +1
constexpr int kGemvConfigs = 0 MQA_BYOC_GEMV_CONFIGS(MQA_BYOC_GEMV_ONE);
#undef MQA_BYOC_GEMV_ONE
#define MQA_BYOC_GEMV_FIELD(I, TH, PR) {TH, PR},
constexpr int kGemvShape[kGemvConfigs][2] = {MQA_BYOC_GEMV_CONFIGS(MQA_BYOC_GEMV_FIELD)};
#undef MQA_BYOC_GEMV_FIELD
#ifdef MQA_BYOC_GEMV_FATBIN
constexpr bool kGemvBuilt = true;
#else
constexpr bool kGemvBuilt = false;
#endif

// The CUDA driver's event calls, opened from libcuda.so.1 (already loaded by any CUDA process).
// The driver's CUlaunchAttribute and CUlaunchConfig (cuda.h, CUDA 12+; this file includes no driver
// header), for cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6).
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    unsigned char programmatic_stream_serialization;
  } value;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute");
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
constexpr int kProgrammaticStreamSerialization = 6;

struct Driver {
  bool ok = false;
  int (*event_create)(void**, unsigned) = nullptr;
  int (*event_record)(void*, void*) = nullptr;
  int (*event_sync)(void*) = nullptr;
  int (*event_elapsed)(float*, void*, void*) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*stream_is_capturing)(void*, int*) = nullptr;
  // For the cold-L2 measurement (optional: without them the candidates are timed back to back).
  int (*device_get)(int*, int) = nullptr;
  int (*device_attribute)(int*, int, int) = nullptr;
  int (*mem_alloc)(unsigned long long*, size_t) = nullptr;
  int (*mem_free)(unsigned long long) = nullptr;
  int (*memset_async)(unsigned long long, unsigned char, size_t, void*) = nullptr;
  // For CUTLASS's GEMV (optional: without them GEMMs run on cuBLASLt only).
  int (*module_load)(void**, const void*) = nullptr;
  int (*module_function)(void**, void*, const char*) = nullptr;
  int (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                void**) = nullptr;
  int (*ctx_get_device)(int*) = nullptr;
  int (*launch_ex)(const struct LaunchConfig*, void*, void**, void**) = nullptr;  // CUDA 12+ drivers
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    d.event_create = reinterpret_cast<int (*)(void**, unsigned)>(dlsym(lib, "cuEventCreate"));
    d.event_record = reinterpret_cast<int (*)(void*, void*)>(dlsym(lib, "cuEventRecord"));
    d.event_sync = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cuEventSynchronize"));
    d.event_elapsed = reinterpret_cast<int (*)(float*, void*, void*)>(dlsym(lib, "cuEventElapsedTime"));
    d.event_destroy = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cuEventDestroy_v2"));
    d.stream_is_capturing = reinterpret_cast<int (*)(void*, int*)>(dlsym(lib, "cuStreamIsCapturing"));
    d.ok = d.event_create && d.event_record && d.event_sync && d.event_elapsed && d.event_destroy &&
           d.stream_is_capturing;
    d.device_get = reinterpret_cast<int (*)(int*, int)>(dlsym(lib, "cuDeviceGet"));
    d.device_attribute = reinterpret_cast<int (*)(int*, int, int)>(dlsym(lib, "cuDeviceGetAttribute"));
    d.mem_alloc = reinterpret_cast<int (*)(unsigned long long*, size_t)>(dlsym(lib, "cuMemAlloc_v2"));
    d.mem_free = reinterpret_cast<int (*)(unsigned long long)>(dlsym(lib, "cuMemFree_v2"));
    d.memset_async =
        reinterpret_cast<int (*)(unsigned long long, unsigned char, size_t, void*)>(dlsym(lib, "cuMemsetD8Async"));
    d.module_load = reinterpret_cast<int (*)(void**, const void*)>(dlsym(lib, "cuModuleLoadData"));
    d.module_function = reinterpret_cast<int (*)(void**, void*, const char*)>(dlsym(lib, "cuModuleGetFunction"));
    d.launch = reinterpret_cast<decltype(d.launch)>(dlsym(lib, "cuLaunchKernel"));
    d.ctx_get_device = reinterpret_cast<int (*)(int*)>(dlsym(lib, "cuCtxGetDevice"));
    d.launch_ex = reinterpret_cast<decltype(d.launch_ex)>(dlsym(lib, "cuLaunchKernelEx"));
  });
  return d;
}

// The library's kernel option gemm_algorithm: 0 (the default, also without an options module) measures
// the heuristic's candidates for small M; 1 keeps its first choice.
bool measure_requested() {
  return &mqa_byoc_library_kernel_options == nullptr || mqa_byoc_library_kernel_options.gemm_algorithm == 0;
}

// The library's kernel option gemm_gemv: 0 (the default) times CUTLASS's GEMV with cuBLASLt's candidates
// for a GEMM of one row, 1 never runs it, 2 runs it wherever it can (its fastest configuration).
int gemv_option() {
  return &mqa_byoc_library_kernel_options == nullptr ? 0 : mqa_byoc_library_kernel_options.gemm_gemv;
}

// The library's kernel option launch_overlap: 0 (the default) plain launches; on sm_90+, 1 launches
// CUTLASS's GEMV as a programmatic dependent, 2 the same with each block prefetching its first rows of W
// into L2 before it waits.
int launch_overlap_option() {
  return &mqa_byoc_library_kernel_options == nullptr ? 0 : mqa_byoc_library_kernel_options.launch_overlap;
}

struct Api {
  void* lib = nullptr;
  std::string error;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;
  // Optional (no split-K variants without them).
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) config_get = nullptr;
  decltype(&cublasLtMatmulAlgoConfigSetAttribute) config_set = nullptr;
  decltype(&cublasLtMatmulAlgoCheck) algo_check = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
};

std::string self_dir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&self_dir), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string path(info.dli_fname);
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

void* open_cublaslt(std::string* tried) {
  const char* name = "libcublasLt.so.13";
  std::string candidates[3] = {name, "", ""};
  std::string dir = self_dir();
  if (!dir.empty()) candidates[1] = dir + "/" + name;
  if (MQA_BYOC_CUBLASLT_HINT[0] != '\0') candidates[2] = std::string(MQA_BYOC_CUBLASLT_HINT) + "/" + name;
  for (const std::string& c : candidates) {
    if (c.empty()) continue;
    if (void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    *tried += "\n  " + c + ": " + dlerror();
  }
  return nullptr;
}

template <typename F>
bool bind(Api* api, F* slot, const char* symbol) {
  *slot = reinterpret_cast<F>(dlsym(api->lib, symbol));
  if (*slot == nullptr) api->error = std::string("libcublasLt.so.13 has no symbol ") + symbol;
  return *slot != nullptr;
}

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    a.lib = open_cublaslt(&tried);
    if (a.lib == nullptr) {
      a.error = "cannot load libcublasLt.so.13 (cuBLASLt, for the offloaded GEMMs). Install it with "
                "`pip install nvidia-cublas` and put its nvidia/cu13/lib on LD_LIBRARY_PATH, or copy "
                "libcublasLt.so.13 next to this library. Tried:" +
                tried;
      return;
    }
    bind(&a, &a.create, "cublasLtCreate") && bind(&a, &a.desc_create, "cublasLtMatmulDescCreate") &&
        bind(&a, &a.desc_set, "cublasLtMatmulDescSetAttribute") &&
        bind(&a, &a.layout_create, "cublasLtMatrixLayoutCreate") &&
        bind(&a, &a.layout_set, "cublasLtMatrixLayoutSetAttribute") &&
        bind(&a, &a.pref_create, "cublasLtMatmulPreferenceCreate") &&
        bind(&a, &a.pref_set, "cublasLtMatmulPreferenceSetAttribute") &&
        bind(&a, &a.pref_destroy, "cublasLtMatmulPreferenceDestroy") &&
        bind(&a, &a.heuristic, "cublasLtMatmulAlgoGetHeuristic") && bind(&a, &a.matmul, "cublasLtMatmul") &&
        bind(&a, &a.status_string, "cublasLtGetStatusString");
    a.config_get = reinterpret_cast<decltype(a.config_get)>(dlsym(a.lib, "cublasLtMatmulAlgoConfigGetAttribute"));
    a.config_set = reinterpret_cast<decltype(a.config_set)>(dlsym(a.lib, "cublasLtMatmulAlgoConfigSetAttribute"));
    a.algo_check = reinterpret_cast<decltype(a.algo_check)>(dlsym(a.lib, "cublasLtMatmulAlgoCheck"));
    a.desc_destroy = reinterpret_cast<decltype(a.desc_destroy)>(dlsym(a.lib, "cublasLtMatmulDescDestroy"));
    a.layout_destroy = reinterpret_cast<decltype(a.layout_destroy)>(dlsym(a.lib, "cublasLtMatrixLayoutDestroy"));
  });
  return a;
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  int gemv = -1;  // >= 0: the call runs CUTLASS's GEMV configuration `gemv` instead of cuBLASLt
};

struct Device {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  // CUTLASS's GEMV entries in this device's context, [bf16][config] (loaded at the first GEMM of one row)
  bool gemv_loaded = false;
  void* gemv_module = nullptr;
  void* gemv[2][kGemvConfigs] = {};
  // For the GEMV's programmatic dependent launch (read when the module loads): sm_90 or later, and the L2
  // bytes and the threads that can be resident at once, which bound the blocks' prefetch.
  bool pdl = false;
  int64_t l2_bytes = 0, resident_threads = 0;
};

// (device, dtype, transposed, epilogue, residual, m, n, k, alignment, batch)
using Key = std::tuple<int, int, int, int, int, int64_t, int64_t, int64_t, int, int64_t>;

std::mutex g_mutex;
std::map<int, Device> g_devices;
std::map<Key, Plan> g_plans;
thread_local std::string g_error;

int fail(const std::string& msg) {
  g_error = msg;
  return -1;
}

std::string status(const Api& a, cublasStatus_t s) {
  return std::string(a.status_string ? a.status_string(s) : "?") + " (" + std::to_string(static_cast<int>(s)) + ")";
}

#define MQA_BYOC_LT(call, what)                                                            \
  do {                                                                                     \
    cublasStatus_t s_ = (call);                                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) return fail(std::string(what) + ": " + status(a, s_)); \
  } while (0)

int alignment_of(const void* p) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && (v % align) != 0) align /= 2;
  return align;
}

cublasLtEpilogue_t epilogue_of(int epilogue) {
  switch (epilogue) {
    case 1: return CUBLASLT_EPILOGUE_BIAS;
    case 2: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case 3: return CUBLASLT_EPILOGUE_GELU_BIAS;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// Whether CUTLASS's GEMV can compute this call (cutlass_gemv.h): the library carries it, the option
// allows it, one row of fp16/bf16 out of (N, K) weights, no batch, a bias or a residual but not both, no
// activation, 16-byte aligned operands, K a multiple of 8.
bool gemv_fits(int dtype, int transposed, int epilogue, int64_t batch, int64_t m, int64_t n, int64_t k, int align,
               bool bias, bool residual) {
  const Driver& d = driver();
  return kGemvBuilt && gemv_option() != 1 && d.module_load && d.module_function && d.launch && d.ctx_get_device &&
         d.device_get && (dtype == 0 || dtype == 1) &&
         transposed == 1 && batch == 1 && m == 1 && (epilogue == 0 || epilogue == 1) && !(bias && residual) &&
         align >= 16 && k % MQA_BYOC_GEMV_VECTOR == 0 && n <= INT32_MAX && k <= INT32_MAX;
}

// Loads the GEMV fatbin into the current context once, when that context is on `device_id` (TVM's: it
// makes the device's context current before a call); false when it cannot. Not while the stream is being
// captured (loading a module is no stream work; the caller checks).
bool gemv_load(Device* dev, int device_id) {
#ifdef MQA_BYOC_GEMV_FATBIN
  if (!dev->gemv_loaded) {
    const Driver& d = driver();
    int current = -1, wanted = -2;
    if (d.ctx_get_device(&current) != 0 || d.device_get(&wanted, device_id) != 0 || current != wanted) return false;
    dev->gemv_loaded = true;
    if (d.module_load(&dev->gemv_module, kGemvFatbin) != 0) {
      dev->gemv_module = nullptr;
      return false;
    }
#define MQA_BYOC_GEMV_GET(I, TH, PR)                                                       \
    d.module_function(&dev->gemv[0][I], dev->gemv_module, "mqa_byoc_gemv_f16_" #I);        \
    d.module_function(&dev->gemv[1][I], dev->gemv_module, "mqa_byoc_gemv_bf16_" #I);
    MQA_BYOC_GEMV_CONFIGS(MQA_BYOC_GEMV_GET)
#undef MQA_BYOC_GEMV_GET
    int major = 0, sms = 0, per_sm = 0, l2 = 0;
    if (d.device_attribute && d.device_attribute(&major, 75, wanted) == 0 &&  // COMPUTE_CAPABILITY_MAJOR
        d.device_attribute(&sms, 16, wanted) == 0 && d.device_attribute(&per_sm, 39, wanted) == 0 &&
        d.device_attribute(&l2, 38, wanted) == 0) {  // MULTIPROCESSOR_COUNT, MAX_THREADS_PER_MULTIPROCESSOR, L2
      dev->pdl = major >= 9 && d.launch_ex != nullptr;
      dev->l2_bytes = l2, dev->resident_threads = int64_t(sms) * per_sm;
    }
  }
  return dev->gemv_module != nullptr;
#else
  (void)dev;
  (void)device_id;
  return false;
#endif
}

// D = X W^T + beta C on CUTLASS's GEMV configuration `config`; 0 on success.
int gemv_run(const Device& dev, int config, int dtype, int64_t n, int64_t k, const void* x, const void* w,
             const void* c, float beta, void* out, void* stream) {
  void* fn = dev.gemv[dtype][config];
  if (fn == nullptr) return -1;
  const unsigned threads = kGemvShape[config][0], per_row = kGemvShape[config][1], rows = threads / per_row;
  const unsigned blocks = static_cast<unsigned>((n + rows - 1) / rows);
  const int overlap = launch_overlap_option();
  mqa_byoc_gemv_args args{n, k, x, w, c, out, beta, 0};
  void* params[] = {&args};
  if (!dev.pdl || overlap == 0) return driver().launch(fn, blocks, 1, 1, per_row, rows, 1, 0, stream, params, nullptr);
  // The blocks that can be resident at once prefetch a third of the L2 together at most.
  if (overlap == 2 && dev.resident_threads > 0) {
    const int64_t resident = std::min<int64_t>(blocks, dev.resident_threads / threads);
    args.prefetch_bytes = resident > 0 ? (dev.l2_bytes / 3 / resident) & ~int64_t(15) : 0;
  }
  LaunchAttribute attr = {};
  attr.id = kProgrammaticStreamSerialization;
  attr.value.programmatic_stream_serialization = 1;
  const LaunchConfig cfg{blocks, 1, 1, per_row, rows, 1, 0, stream, &attr, 1};
  return driver().launch_ex(&cfg, fn, params, nullptr);
}

// Appends, for each split-K candidate (split count > 1), the same algorithm with a split count of 1 when
// cuBLASLt accepts it for this problem within the workspace; returns the new count (at most kTimed).
int add_unsplit(const Api& a, cublasLtHandle_t handle, const Plan& plan, cublasLtMatmulHeuristicResult_t* candidates,
                int found) {
  if (a.config_get == nullptr || a.config_set == nullptr || a.algo_check == nullptr) return found;
  int count = found;
  for (int i = 0; i < found && count < kTimed; ++i) {
    if (candidates[i].state != CUBLAS_STATUS_SUCCESS) continue;
    int splits = 1;
    size_t written = 0;
    if (a.config_get(&candidates[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits), &written) !=
            CUBLAS_STATUS_SUCCESS || splits <= 1) {
      continue;
    }
    cublasLtMatmulAlgo_t unsplit = candidates[i].algo;
    const int one = 1;
    if (a.config_set(&unsplit, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) != CUBLAS_STATUS_SUCCESS) continue;
    cublasLtMatmulHeuristicResult_t checked;
    if (a.algo_check(handle, plan.desc, plan.a, plan.b, plan.c, plan.d, &unsplit, &checked) !=
            CUBLAS_STATUS_SUCCESS || checked.workspaceSize > kWorkspaceBytes) {
      continue;
    }
    checked.algo = unsplit;
    checked.state = CUBLAS_STATUS_SUCCESS;
    candidates[count++] = checked;
  }
  return count;
}

int make_plan(const Api& a, cublasLtHandle_t handle, const Key& key, Plan* plan,
              cublasLtMatmulHeuristicResult_t* candidates, int* n_candidates) {
  const int dtype = std::get<1>(key), transposed = std::get<2>(key), epilogue = std::get<3>(key);
  const int residual = std::get<4>(key), align = std::get<8>(key);
  const int64_t m = std::get<5>(key), n = std::get<6>(key), k = std::get<7>(key), batch = std::get<9>(key);
  const int is_bf16 = dtype & 1, out_f32 = dtype & 2;
  const cudaDataType_t type = is_bf16 ? CUDA_R_16BF : CUDA_R_16F;
  // C, D (and the bias, whose type cuBLASLt takes from D's) in the operands' type or in float32
  const cudaDataType_t out_type = out_f32 ? CUDA_R_32F : type;
  MQA_BYOC_LT(a.desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // cuBLASLt's A is W: (N x K) col-major. Row-major (K, N) W is that with op N; row-major (N, K) W^T
  // reads as (K x N) col-major, so op T.
  cublasOperation_t op_a = transposed ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  MQA_BYOC_LT(a.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)), "set TRANSA");
  MQA_BYOC_LT(a.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)), "set TRANSB");
  cublasLtEpilogue_t epi = epilogue_of(epilogue);
  MQA_BYOC_LT(a.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "set EPILOGUE");
  if (transposed) {
    MQA_BYOC_LT(a.layout_create(&plan->a, type, k, n, k), "layout W^T");
  } else {
    MQA_BYOC_LT(a.layout_create(&plan->a, type, n, k, n), "layout W");
  }
  MQA_BYOC_LT(a.layout_create(&plan->b, type, k, m, k), "layout X");
  MQA_BYOC_LT(a.layout_create(&plan->c, out_type, n, m, n), "layout C");
  MQA_BYOC_LT(a.layout_create(&plan->d, out_type, n, m, n), "layout D");
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    const int64_t strides[4] = {n * k, m * k, m * n, m * n};
    cublasLtMatrixLayout_t layouts[4] = {plan->a, plan->b, plan->c, plan->d};
    for (int i = 0; i < 4; ++i) {
      MQA_BYOC_LT(a.layout_set(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
                  "set BATCH_COUNT");
      MQA_BYOC_LT(a.layout_set(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                               sizeof(strides[i])),
                  "set STRIDED_BATCH_OFFSET");
    }
  }

  cublasLtMatmulPreference_t pref = nullptr;
  MQA_BYOC_LT(a.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  size_t ws = kWorkspaceBytes;
  uint32_t al = static_cast<uint32_t>(align);
  a.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  a.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof(al));
  a.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof(al));
  a.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al));
  a.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof(al));
  int found = 0;
  // Batched products keep the heuristic's choice: their batch follows the tokens (a new plan each prompt
  // length), and measuring was set up for the weight-streaming decode GEMMs.
  const int wanted = (measure_requested() && m <= kMeasureMaxM && batch == 1 && driver().ok) ? kCandidates : 1;
  cublasStatus_t s = a.heuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->d, pref, wanted,
                                 candidates, &found);
  a.pref_destroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
    return fail("cuBLASLt has no algorithm for batch=" + std::to_string(batch) + " M=" + std::to_string(m) +
                " N=" + std::to_string(n) +
                " K=" + std::to_string(k) + (is_bf16 ? " bf16" : " fp16") + (out_f32 ? " -> fp32" : "") +
                " epilogue " + std::to_string(epilogue) + (residual ? " + residual" : "") + ": " + status(a, s));
  }
  plan->algo = candidates[0].algo;
  *n_candidates = found;
  if (wanted > 1) *n_candidates = add_unsplit(a, handle, *plan, candidates, found);
  return 0;
}

// A scratch buffer of twice the device's L2, read before each timed call (by a cuBLASLt GEMM of one row
// over it, the heuristic's algorithm), so that the call finds its operands in HBM and L2 full of clean
// lines of other data, as inside a model, where the step's other weights passed through L2 in between.
// The buffer is written once, when it is made. Written before each call instead (a memset, as this did
// before), L2 is left full of dirty lines whose write-back runs during the timed call: on the H100 and
// the H200 that made the decode GEMVs up to a third slower than inside a decoder, and the decoders landed
// on different kernels from one process to the next (docs/gemm.md). Where the reading GEMM cannot be set up, the buffer is written before each call;
// without the driver calls or the allocation, the calls are timed back to back.
struct L2Flush {
  static constexpr int64_t kCols = 4096;  // K of the reading GEMM: the buffer is (rows, kCols) fp16
  const Driver& d;
  const Api& a;
  const Device& dev;
  unsigned long long ptr = 0, x = 0, y = 0;
  size_t bytes = 0;
  int64_t rows = 0;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lx = nullptr, ly = nullptr;
  bool reads = false;
  L2Flush(const Driver& drv, const Api& api, const Device& device, int device_id, void* stream)
      : d(drv), a(api), dev(device) {
    int ordinal = 0, l2 = 0;
    if (!d.device_get || !d.device_attribute || !d.mem_alloc || !d.mem_free || !d.memset_async) return;
    const int l2_size = 38;  // CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
    if (d.device_get(&ordinal, device_id) != 0 || d.device_attribute(&l2, l2_size, ordinal) != 0 || l2 <= 0) return;
    rows = (2 * static_cast<int64_t>(l2) + 2 * kCols - 1) / (2 * kCols);
    bytes = static_cast<size_t>(rows * kCols * 2);
    if (d.mem_alloc(&ptr, bytes) != 0) {
      ptr = 0;
      return;
    }
    d.memset_async(ptr, 0, bytes, stream);
    if (d.mem_alloc(&x, kCols * 2) != 0 || d.mem_alloc(&y, static_cast<size_t>(rows) * 2) != 0) return;
    d.memset_async(x, 0, kCols * 2, stream);
    const cublasOperation_t op_t = CUBLAS_OP_T;
    reads = a.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
            a.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)) == CUBLAS_STATUS_SUCCESS &&
            a.layout_create(&la, CUDA_R_16F, kCols, rows, kCols) == CUBLAS_STATUS_SUCCESS &&
            a.layout_create(&lx, CUDA_R_16F, kCols, 1, kCols) == CUBLAS_STATUS_SUCCESS &&
            a.layout_create(&ly, CUDA_R_16F, rows, 1, rows) == CUBLAS_STATUS_SUCCESS && read(stream);
  }
  ~L2Flush() {
    if (a.layout_destroy) {
      for (cublasLtMatrixLayout_t l : {la, lx, ly}) {
        if (l != nullptr) a.layout_destroy(l);
      }
    }
    if (a.desc_destroy && desc != nullptr) a.desc_destroy(desc);
    for (unsigned long long p : {ptr, x, y}) {
      if (p != 0) d.mem_free(p);
    }
  }
  bool read(void* stream) const {
    const float one = 1.0f, zero = 0.0f;
    void* buf = reinterpret_cast<void*>(ptr);
    void* in = reinterpret_cast<void*>(x);
    void* out = reinterpret_cast<void*>(y);
    return a.matmul(dev.handle, desc, &one, buf, la, in, lx, &zero, out, ly, out, ly, nullptr, dev.workspace,
                    kWorkspaceBytes, static_cast<cudaStream_t>(stream)) == CUBLAS_STATUS_SUCCESS;
  }
  void operator()(void* stream) const {
    if (ptr == 0) return;
    if (!reads || !read(stream)) d.memset_async(ptr, 0, bytes, stream);
  }
};

// One GEMM of one row on CUTLASS's GEMV, as the measurement times it (`gemv` configurations after
// cuBLASLt's candidates): the problem and what C and beta are.
struct GemvCall {
  int configs = 0;  // 0: not timed
  int dtype = 0;
  int64_t n = 0, k = 0;
  const void* c = nullptr;
  float beta = 0.0f;
};

// The fastest of `found` cuBLASLt candidates and `gemv.configs` GEMV configurations on the call's operands
// (D is written; the call after this writes it again). Each candidate runs once untimed (a first call may
// load its kernel), then kMeasureRounds times, in turns over all candidates, each call after an L2 flush
// and timed alone; a candidate counts its median. (Timed back to back on the same weight, part of it can
// still be in L2 from the call before, and the ranking differed from the kernels' speed in a model,
// docs/gemm.md; turns spread clock drift over all candidates.) A candidate that fails to run is skipped;
// if every one fails the heuristic's first stays. `cublaslt` false: only the GEMV configurations are timed.
void pick_fastest(const Api& a, const Device& dev, int device_id, Plan* plan,
                  const cublasLtMatmulHeuristicResult_t* candidates, int found, bool cublaslt, const GemvCall& gemv,
                  const void* alpha, const void* beta, const void* x, const void* w, const void* c, void* out,
                  cudaStream_t stream) {
  const Driver& d = driver();
  void *start = nullptr, *stop = nullptr;
  if (d.event_create(&start, 0) != 0 || d.event_create(&stop, 0) != 0) return;
  const L2Flush flush(d, a, dev, device_id, stream);
  const int total = found + gemv.configs;
  float times[kTimed + kGemvConfigs][kMeasureRounds];
  bool usable[kTimed + kGemvConfigs];
  for (int i = 0; i < found; ++i) usable[i] = cublaslt && candidates[i].state == CUBLAS_STATUS_SUCCESS;
  for (int i = found; i < total; ++i) usable[i] = true;
  auto run = [&](int i) {
    if (i >= found) {
      return gemv_run(dev, i - found, gemv.dtype, gemv.n, gemv.k, x, w, gemv.c, gemv.beta, out, stream) == 0;
    }
    return a.matmul(dev.handle, plan->desc, alpha, w, plan->a, x, plan->b, beta, c, plan->c, out, plan->d,
                    &candidates[i].algo, dev.workspace, kWorkspaceBytes, stream) == CUBLAS_STATUS_SUCCESS;
  };
  for (int i = 0; i < total; ++i) {
    if (usable[i] && !run(i)) usable[i] = false;
  }
  for (int round = 0; round < kMeasureRounds; ++round) {
    for (int i = 0; i < total; ++i) {
      if (!usable[i]) continue;
      flush(stream);
      d.event_record(start, stream);
      const bool ok = run(i);
      d.event_record(stop, stream);
      float ms = 0.0f;
      if (!ok || d.event_sync(stop) != 0 || d.event_elapsed(&ms, start, stop) != 0) {
        usable[i] = false;
        continue;
      }
      times[i][round] = ms;
    }
  }
  float best = -1.0f;
  for (int i = 0; i < total; ++i) {
    if (!usable[i]) continue;
    std::sort(times[i], times[i] + kMeasureRounds);
    const float median = times[i][kMeasureRounds / 2];
    if (best < 0.0f || median < best) {
      best = median;
      if (i >= found) {
        plan->gemv = i - found;
      } else {
        plan->gemv = -1;
        plan->algo = candidates[i].algo;
      }
    }
  }
  d.event_destroy(start);
  d.event_destroy(stop);
}

}  // namespace

extern "C" {

// The message of the last failed call on this thread.
const char* mqa_byoc_cublaslt_last_error(void) { return g_error.c_str(); }

// D = epilogue(X @ op(W) + bias) + residual, all row-major and contiguous, on `stream` (a cudaStream_t),
// for each of `batch` consecutive (X, W, residual, D) matrices (1: one GEMM; the bias is shared).
// dtype: 0 fp16, 1 bf16; plus 2 for a float32 output (then bias and residual are float32 too). epilogue:
// 0 none, 1 bias, 2 relu(bias), 3 gelu_tanh(bias). bias: N elements or null; residual: (M, N) or null
// (not with an activation). Returns 0, or -1 with the message in
// mqa_byoc_cublaslt_last_error().
int mqa_byoc_cublaslt_gemm(int device_id, void* stream, int dtype, int transposed, int epilogue, int64_t batch,
                           int64_t m, int64_t n, int64_t k, const void* x, const void* w, const void* bias,
                           const void* residual, void* out) {
  const Api& a = api();
  if (a.lib == nullptr || !a.error.empty()) return fail(a.error);
  if (m == 0 || batch == 0) return 0;
  if (m < 0 || n <= 0 || k <= 0 || batch < 0) return fail("invalid GEMM sizes");
  if (batch > INT32_MAX) return fail("batch " + std::to_string(batch) + " exceeds cuBLASLt's int32 batch count");
  if (dtype < 0 || dtype > 3) return fail("unknown GEMM type code " + std::to_string(dtype));
  if ((epilogue != 0) != (bias != nullptr)) return fail("a bias epilogue needs a bias pointer and vice versa");
  int align = alignment_of(x);
  for (const void* p : {w, residual, static_cast<const void*>(out), bias}) {
    if (p != nullptr && alignment_of(p) < align) align = alignment_of(p);
  }
  if (align > 16) align = 16;
  std::lock_guard<std::mutex> lock(g_mutex);
  Device& dev = g_devices[device_id];
  if (dev.handle == nullptr) {
    MQA_BYOC_LT(a.create(&dev.handle), "cublasLtCreate");
    dev.workspace = TVMBackendAllocWorkspace(kDLCUDA, device_id, kWorkspaceBytes, kDLUInt, 8);
    if (dev.workspace == nullptr) return fail("cannot allocate the cuBLASLt workspace on device " + std::to_string(device_id));
  }
  Key key{device_id, dtype, transposed, epilogue, residual != nullptr, m, n, k, align, batch};
  const float alpha = 1.0f, beta = residual != nullptr ? 1.0f : 0.0f;
  const void* c = residual != nullptr ? residual : out;
  auto it = g_plans.find(key);
  bool fresh = false;
  cublasLtMatmulHeuristicResult_t candidates[kTimed];
  int found = 0;
  if (it == g_plans.end()) {
    Plan plan;
    if (make_plan(a, dev.handle, key, &plan, candidates, &found) != 0) return -1;
    it = g_plans.emplace(key, plan).first;
    fresh = true;
  }
  Plan& plan = it->second;
  if (bias != nullptr) {
    MQA_BYOC_LT(a.desc_set(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), "set BIAS_POINTER");
  }
  // CUTLASS's GEMV at one row: C is the bias or the residual (one row of N either way), beta 1 with one.
  const void* gemv_c = bias != nullptr ? bias : residual;
  const float gemv_beta = gemv_c != nullptr ? 1.0f : 0.0f;
  // Whether nothing is being captured on the stream: only then may a new plan time its candidates or
  // load the GEMV's module (a first call inside a CUDA graph capture keeps the heuristic's choice). Asked
  // of the driver for a new plan only: the calls after it take no host time for it.
  int capturing = 0;
  const bool quiet = fresh && driver().stream_is_capturing != nullptr &&
                     driver().stream_is_capturing(stream, &capturing) == 0 && capturing == 0;
  GemvCall gemv;
  if (fresh && gemv_fits(dtype, transposed, epilogue, batch, m, n, k, align, bias != nullptr, residual != nullptr) &&
      (dev.gemv_module != nullptr || (quiet && gemv_load(&dev, device_id)))) {
    gemv = GemvCall{kGemvConfigs, dtype, n, k, gemv_c, gemv_beta};
  }
  const bool can_time = fresh && driver().ok && quiet;
  const bool gemv_only = gemv.configs > 0 && gemv_option() == 2;
  if (can_time && (gemv_only || (measure_requested() && (found > 1 || gemv.configs > 0)))) {
    pick_fastest(a, dev, device_id, &plan, candidates, found, !gemv_only, gemv, &alpha, &beta, x, w, c, out,
                 static_cast<cudaStream_t>(stream));
  } else if (gemv_only) {
    plan.gemv = 0;  // not timed (a first call inside a CUDA graph capture): the first configuration
  }
  if (plan.gemv >= 0) {
    if (gemv_run(dev, plan.gemv, dtype, n, k, x, w, gemv_c, gemv_beta, out, stream) != 0) {
      return fail("CUTLASS's GEMV (configuration " + std::to_string(plan.gemv) + ") failed to launch for N=" +
                  std::to_string(n) + " K=" + std::to_string(k));
    }
    return 0;
  }
  MQA_BYOC_LT(a.matmul(dev.handle, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, c, plan.c, out, plan.d,
                       &plan.algo, dev.workspace, kWorkspaceBytes, static_cast<cudaStream_t>(stream)),
              "cublasLtMatmul");
  return 0;
}

}  // extern "C"
