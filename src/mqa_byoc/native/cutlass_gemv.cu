// CUTLASS's GEMV for the offloaded GEMMs of one row (cutlass_gemv.h has the contract): the kernel is
// CUTLASS's own (cutlass::gemm::kernel::Gemv with a row-major A: kThreadsPerRow threads share a row of W,
// 16-byte loads, fp32 accumulation, a shuffle reduction, LinearCombination's D = acc + beta C; headers
// from the nvidia-cutlass wheel). This file instantiates the configurations of cutlass_gemv.h as extern
// "C" entries that take plain arguments and set CUTLASS's parameters up on the device, so that it compiles
// to a fatbin alone (nvcc -fatbin, mqa_byoc/compiler/cublaslt_build.py) and the library needs no CUDA
// runtime for it: the dispatcher loads the fatbin with the CUDA driver and launches the entries on TVM's
// stream. Why these kernels: at one row the GEMM only streams W, and for some decode weights CUTLASS's GEMV
// streams faster than cuBLASLt's fastest configuration (benchmarks/cutlass_gemv.cu); the dispatcher measures
// both and keeps the faster.

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/kernel/gemv.h"
#include "cutlass/numeric_types.h"

#include "cutlass_gemv.h"

namespace {

template <typename T, int Threads, int PerRow>
using GemvOf = cutlass::gemm::kernel::Gemv<T, cutlass::layout::RowMajor, T, T, float,
                                           cutlass::epilogue::thread::LinearCombination<T, 1, float, float>,
                                           MQA_BYOC_GEMV_VECTOR, Threads, PerRow>;

// CUTLASS's Params (its Arguments) has host-only constructors; it is trivially copyable with a trivial
// destructor, so it is set up member by member in raw storage, each member with its own device constructor.
template <typename T, int Threads, int PerRow>
__device__ __forceinline__ void run(const mqa_byoc_gemv_args& a) {
  using K = GemvOf<T, Threads, PerRow>;
  using Params = typename K::Params;
  static_assert(K::kThreadsPerRow == PerRow && K::kThreadCount == Threads, "launch shape of cutlass_gemv.h");
  alignas(Params) unsigned char storage[sizeof(Params)];
  Params* p = reinterpret_cast<Params*>(storage);
  p->problem_size = cutlass::MatrixCoord(static_cast<int>(a.n), static_cast<int>(a.k));
  p->batch_count = 1;
  p->output_op = typename K::EpilogueOutputOp::Params(1.0f, a.beta);
  p->ref_A = typename K::TensorRefA(static_cast<T*>(const_cast<void*>(a.w)), typename K::LayoutA(static_cast<int>(a.k)));
  p->ptr_B = static_cast<const T*>(a.x);
  p->ptr_C = static_cast<const T*>(a.beta != 0.0f ? a.c : a.out);
  p->ptr_D = static_cast<T*>(a.out);
  p->batch_stride_A = p->batch_stride_B = p->batch_stride_C = p->batch_stride_D = 0;
  __shared__ typename K::SharedStorage shared;
  K op;
  op(*p, shared);
}

// Before CUTLASS's kernel: on sm_90+, one thread of the block asks the L2 for the first prefetch_bytes of
// the block's rows of W (they do not depend on the previous kernel; CUTLASS's GEMV gives block b the rows
// b * rows .. b * rows + rows - 1, contiguous in W), then the block waits until the previous kernel on the
// stream has ended and its writes are visible (a programmatic dependent launch starts the block earlier;
// in a plain launch the wait returns at once), then lets a dependent kernel start.
template <int Threads, int PerRow>
__device__ __forceinline__ void enter(const mqa_byoc_gemv_args& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int64_t kRows = Threads / PerRow;
  if (a.prefetch_bytes > 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    const int64_t row0 = int64_t(blockIdx.x) * kRows, row_bytes = a.k * 2;  // 16-bit types
    const int64_t rows = a.n - row0 < kRows ? a.n - row0 : kRows;
    int64_t bytes = rows * row_bytes < a.prefetch_bytes ? rows * row_bytes : a.prefetch_bytes;
    bytes &= ~int64_t(15);
    if (bytes > 0) {
      const size_t at = __cvta_generic_to_global(static_cast<const char*>(a.w) + row0 * row_bytes);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(unsigned(bytes)) : "memory");
    }
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
  (void)a;
#endif
}

}  // namespace

#define MQA_BYOC_GEMV_ENTRY(I, TH, PR)                                                              \
  extern "C" __global__ void __launch_bounds__(TH) mqa_byoc_gemv_f16_##I(mqa_byoc_gemv_args a) {  \
    enter<TH, PR>(a);                                                                               \
    run<cutlass::half_t, TH, PR>(a);                                                                \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(TH) mqa_byoc_gemv_bf16_##I(mqa_byoc_gemv_args a) { \
    enter<TH, PR>(a);                                                                               \
    run<cutlass::bfloat16_t, TH, PR>(a);                                                            \
  }
MQA_BYOC_GEMV_CONFIGS(MQA_BYOC_GEMV_ENTRY)
