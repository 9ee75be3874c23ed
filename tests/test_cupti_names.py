"""Which CUPTI kernel names count as our attention (mqa_byoc.testing.cupti): the decode kernel's classic
blocks, SharedTiles and the merge of SharedTiles' splits are attention; one forward a call is the classic
blocks' or SharedTiles' kernel, not the merge; GEMMs and TVM's kernels are not attention."""

from mqa_byoc.testing.cupti import ATTENTION_FORWARD, is_attention_kernel

CLASSIC = "void (anonymous namespace)::gqa_decode_kernel<__half, 128, true, true, true, 8, 1>(mqa_byoc_decode_args, int)"
SHARED = "void (anonymous namespace)::gqa_decode_shared_kernel<__half, 64, true, false, 1>(mqa_byoc_decode_args, int)"
MERGE = "void (anonymous namespace)::gqa_decode_split_merge_kernel<__half, 64, 8>(mqa_byoc_decode_args, int, int)"
FA2 = "void mqa_byoc_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>(Flash_fwd_params)"
OTHERS = ("nvjet_sm90_hsh_128x8_64x12_2x1_v_bz_splitK_TNT", "fused_rope_kernel", "rms_norm1_kernel",
          "kv_cache_transpose_append_h64kv8d128p128_fp16_kernel")


def test_attention_kernels():
    assert all(is_attention_kernel(n) for n in (CLASSIC, SHARED, MERGE, FA2))
    assert not any(is_attention_kernel(n) for n in OTHERS)


def test_one_forward_a_call():
    assert [bool(ATTENTION_FORWARD.search(n)) for n in (CLASSIC, SHARED, MERGE, FA2)] == [True, True, False, True]
