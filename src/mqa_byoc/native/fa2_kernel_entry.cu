// One FA2 forward kernel family, wrapped behind a plain C entry point.
//
// mqa_byoc.kernels (kernels/build.py) compiles this file once per (arch, head dim, dtype, causal, split) with
//   -DMQA_BYOC_FA_FILE="flash_fwd[_split]_hdim<D>_<fp16|bf16>[_causal]_sm80.cu"   (from flash-attn's sources)
//   -DMQA_BYOC_ENTRY=mqa_byoc_fa2_fwd[_split]_hdim<D>_<fp16|bf16>[_causal]
//   -DMQA_BYOC_ELEM=cutlass::half_t | cutlass::bfloat16_t
//   -DMQA_BYOC_HDIM=<D>  -DMQA_BYOC_CAUSAL=true|false  -DMQA_BYOC_SPLIT=0|1
// The flash-attn file instantiates the kernel templates (run_mha_fwd_ / run_mha_fwd_splitkv_dispatch);
// the entry below is what fa2_dispatch.cc references (weakly), so the dispatcher links with any subset.

#if !defined(MQA_BYOC_FA_FILE) || !defined(MQA_BYOC_ENTRY) || !defined(MQA_BYOC_ELEM) || \
    !defined(MQA_BYOC_HDIM) || !defined(MQA_BYOC_CAUSAL) || !defined(MQA_BYOC_SPLIT)
#error "fa2_kernel_entry.cu is compiled by mqa_byoc.kernels, which defines MQA_BYOC_*"
#endif

#include MQA_BYOC_FA_FILE

extern "C" void MQA_BYOC_ENTRY(FLASH_NAMESPACE::Flash_fwd_params* params, cudaStream_t stream) {
#if MQA_BYOC_SPLIT
  FLASH_NAMESPACE::run_mha_fwd_splitkv_dispatch<MQA_BYOC_ELEM, MQA_BYOC_HDIM, MQA_BYOC_CAUSAL>(*params, stream);
#else
  FLASH_NAMESPACE::run_mha_fwd_<MQA_BYOC_ELEM, MQA_BYOC_HDIM, MQA_BYOC_CAUSAL>(*params, stream);
#endif
}
