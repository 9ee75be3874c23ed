"""Logit soft-capping (Gemma 2): ``softmax(mask(c * tanh(scale * Q K^T / c))) V``.

The chain is offloaded with native K/V heads as ``flash_attn.attention_mqa_softcap`` (the cap in the
report, the spec and the kernel call); the rewritten graph (the composite's reference body, on llvm)
gives the original's results, and both match a float32 NumPy reference. Forms the kernels do not
compute (a mask inside the tanh, a negative cap, two tanh, sinks together with a cap) stay in the graph
with their reason. Gemma 2 through the standard HF path: every layer offloaded with its heads,
``query_pre_attn_scalar`` scale, window and cap, the logits as the unrewritten graph's."""

import numpy as np
import pytest

from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.codegen import dispatch as codegen
from mqa_byoc.compiler.codegen.hopper import describe_kernel, fa4_rejection, kernel_key
from mqa_byoc.compiler.codegen.native import emit_native_source
from mqa_byoc.compiler.codegen.sinks import emit_python_forwarder
from mqa_byoc.contract import COMPOSITE_MHA_SOFTCAP, COMPOSITE_MQA_SOFTCAP, SOFTCAP_ATTR, composite_name
from mqa_byoc.demo import format_report
from mqa_byoc.kernels import KernelKey, parse_markers, plan_kernels
from mqa_byoc.kernels.keys import build_command_hint, keys_for
from mqa_byoc.testing import graphs as G

RNG = np.random.default_rng(0)


def _inputs(h=8, hkv=4, d=64, s=16, s_kv=None, std=2.0):
    """Inputs large enough that the cap matters (scores well beyond the linear range of tanh)."""
    s_kv = s if s_kv is None else s_kv
    q = (RNG.standard_normal((1, h, s, d)) * std).astype("float16")
    k = (RNG.standard_normal((1, hkv, s_kv, d)) * std).astype("float16")
    v = RNG.standard_normal((1, hkv, s_kv, d)).astype("float16")
    return q, k, v


@pytest.mark.parametrize("kw", [
    dict(),                                        # prefill, causal
    dict(window=4),                                # a sliding layer
    dict(s=1, s_kv=9),                             # decode
    dict(s=5, s_kv=12, window=3),                  # chunked prefill with a window
    dict(scale=24 ** -0.5, cap=3.0),               # Gemma's query_pre_attn_scalar scale, another cap
    dict(form="reciprocal"),                       # tanh(x * (1/c)) * c, the constant on the left
    dict(hkv=8),                                   # as many K/V heads as query heads
    dict(hkv=1, h=4),                              # multi-query
    dict(causal=False),                            # no mask
])
def test_softcap_chain_offloaded_and_exact_on_cpu(kw):
    kw = {"cap": 5.0, **kw}  # a cap that bends these inputs' scores (Gemma's 50 needs larger ones)
    mod = G.softcap_chain(**kw)
    (site,) = offload_report(mod)
    h, hkv = kw.get("h", 8), kw.get("hkv", 4)
    cap = kw["cap"]
    assert site.offloaded, site.reason
    assert site.composite == (COMPOSITE_MQA_SOFTCAP if hkv != h else COMPOSITE_MHA_SOFTCAP)
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (h, hkv, 64)
    assert site.softcap == pytest.approx(cap, rel=1e-3)
    assert site.scale == pytest.approx(kw.get("scale", 64 ** -0.5), rel=1e-3)
    decode = kw.get("s", 16) == 1
    masked = kw.get("causal", True) or kw.get("window")
    assert site.causal == (None if decode or not masked else "BottomRight")
    assert site.window == (None if decode else kw.get("window"))
    assert "soft-capping" in site.kernel and "decode kernel does not soft-cap" in site.kernel
    args = _inputs(h, hkv, s=kw.get("s", 16), s_kv=kw.get("s_kv"))
    got = G.rewritten_on_cpu(mod, list(args))
    want = G.reference_softcap_attention(*args, cap=cap, scale=kw.get("scale"), window=kw.get("window"),
                                         causal=kw.get("causal", True))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    # the cap matters at these inputs: without it the result is another one
    uncapped = G.reference_softcap_attention(*args, cap=1e9, scale=kw.get("scale"), window=kw.get("window"),
                                             causal=kw.get("causal", True))
    assert np.abs(want - uncapped).max() > 0.05
    part = partition_for_cutlass(mod)
    assert G.composites(part) == [site.composite]
    assert G.count_ops(part, "relax.tanh") == 0 and G.count_ops(part, "relax.nn.softmax") == 0
    assert "softcap=" in format_report([site])


@pytest.mark.parametrize("form, why", [
    ("mask-inside", "inside the soft-capping tanh"),
    ("negative", "soft-capping tanh scaled by"),
    ("two-caps", "inside the soft-capping tanh"),
])
def test_softcap_forms_the_kernels_do_not_compute_stay_with_a_reason(form, why):
    mod = G.softcap_chain(form=form)
    (site,) = offload_report(mod)
    assert not site.offloaded and why in site.reason, site.reason
    assert G.composites(partition_for_cutlass(mod)) == []


def test_softcap_with_sinks_is_rejected():
    with pytest.raises(ValueError, match="sinks together with soft-capping"):
        composite_name(8, 2, sinks=True, softcap=True)


def test_softcap_read_by_the_codegen_and_passed_to_the_kernels():
    mod = G.softcap_chain(window=4, dtype="bfloat16", d=256, h=8, hkv=4, cap=50.0, scale=256 ** -0.5)
    part = partition_for_cutlass(mod, provider="native")
    (func,) = [f for f in part.functions.values() if f.attrs is not None and "Codegen" in f.attrs]
    site = codegen.find_site(func)
    spec = site.spec
    assert site.composite_name == COMPOSITE_MQA_SOFTCAP and site.arg_map == (0, 1, 2)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (8, 4, 256, "bfloat16")
    assert spec.softcap == 50.0 and spec.sinks_dtype is None
    assert spec.scale == pytest.approx(256 ** -0.5)
    assert (spec.causal, spec.window_left, spec.window_right) == (True, 3, 0)
    composite = site.composite
    assert float(composite.attrs[SOFTCAP_ATTR]) == 50.0
    # the native wrapper calls the soft-capping entry with the cap; it needs the soft-capping families
    src = emit_native_source(site.symbol, spec, arg_map=site.arg_map, num_inputs=site.num_inputs)
    assert "mqa_byoc_fa2_forward_softcap(data_of(q), data_of(k), data_of(v), static_cast<float>(50.0)," in src.code
    assert "softcap=50.0" in src.code
    keys = set(parse_markers(src.code))
    assert keys == set(plan_kernels(spec)) and all(k.softcap and k.head_dim == 256 for k in keys)
    assert keys == set(keys_for([256], ["bf16"], softcap=[True]))
    # the hopper provider runs it on FA2, saying why
    assert kernel_key(spec) is None and "soft-capping on FA2" in fa4_rejection(spec)
    hopper_src = emit_native_source(site.symbol, spec, arg_map=site.arg_map, num_inputs=site.num_inputs, hopper=True)
    assert "mqa_byoc_fa2_forward_softcap" in hopper_src.code and "__tvm_ffi_mqa_byoc_fa4" not in hopper_src.code
    kernel = describe_kernel("hopper", dtype="bfloat16", head_dim=256, num_q_heads=8, num_kv_heads=4, causal=True,
                             window=4, softcap=True)
    assert "soft-capping on FA2" in kernel
    # the python provider's forwarder passes the cap
    py = emit_python_forwarder(site.symbol, spec, site.arg_map, site.num_inputs)
    assert "mqa_byoc.flash_attn_softcap_forward" in py and "constexpr double kSoftcap = 50.0;" in py


def test_softcap_kernel_keys_are_their_own_family():
    key = KernelKey(256, "bf16", True, True, softcap=True)
    assert key.label == "hdim256 bf16 causal split softcap" and KernelKey.parse(key.label) == key
    assert key.stem == "fwd_split_hdim256_bf16_causal_softcap"
    assert key.entry_symbol == "mqa_byoc_fa2_fwd_split_hdim256_bf16_causal_softcap"
    # the same flash-attn translation unit, compiled with soft-capping on, into its own namespace
    plain = KernelKey(256, "bf16", True, True)
    assert key.flash_attn_file == plain.flash_attn_file == "flash_fwd_split_hdim256_bf16_causal_sm80.cu"
    from mqa_byoc.kernels.build import key_flags

    flags, plain_flags = key_flags("sm_90", key), key_flags("sm_90", plain)
    assert "-DFLASHATTENTION_DISABLE_SOFTCAP" in plain_flags and "-DFLASHATTENTION_DISABLE_SOFTCAP" not in flags
    assert "-DFLASH_NAMESPACE=mqa_byoc_flash_softcap" in flags and "-DFLASH_NAMESPACE=mqa_byoc_flash" in plain_flags
    assert build_command_hint([key]).endswith("--head-dims 256 --dtypes bf16 --softcap")
    # a plain build asks for no soft-capping family
    assert not any(k.softcap for k in keys_for([64, 128], ["fp16", "bf16"]))


def test_build_kernels_softcap_option():
    from mqa_byoc.cli import build_kernels_request, build_parser

    args = build_parser().parse_args(["build-kernels", "--head-dims", "256", "--dtypes", "bf16", "--softcap"])
    keys = build_kernels_request(args).keys()
    assert len(keys) == 4 and all(k.softcap and k.head_dim == 256 for k in keys)
    args = build_parser().parse_args(["build-kernels", "--head-dims", "256", "--dtypes", "bf16"])
    assert not any(k.softcap for k in build_kernels_request(args).keys())


LAYERS, HEADS, KV_HEADS, HEAD_DIM, WINDOW, PRE_ATTN = 2, 8, 4, 32, 8, 24


def _gemma2():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = transformers.Gemma2Config(
        hidden_size=256, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=256, vocab_size=128, num_hidden_layers=LAYERS, max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=PRE_ATTN, attn_logit_softcapping=50.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_gemma2_standard_path_offloaded_with_softcap(mode):
    """Gemma 2 (alternating sliding and global layers, query_pre_attn_scalar, attention soft-cap 50) through
    torch.export + from_exported_program + ToMixedPrecision: every attention offloaded with its heads, scale,
    window and cap; the rewritten graph gives the graph's logits."""
    from mqa_byoc.models import hf

    model = _gemma2()
    layer_types = model.config.layer_types
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="standard", mixed_precision=True)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for site, kind in zip(report, layer_types):
        assert site.offloaded, site.reason
        assert site.composite == COMPOSITE_MQA_SOFTCAP
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (HEADS, KV_HEADS, HEAD_DIM,
                                                                                   "float16")
        assert site.softcap == pytest.approx(50.0)
        assert site.scale == pytest.approx(PRE_ATTN ** -0.5, rel=1e-3)  # not 1/sqrt(head dim)
        window = WINDOW if mode == "prefill" and kind == "sliding_attention" else None  # decode: 7 keys fit
        assert site.causal == ("BottomRight" if mode == "prefill" else None) and site.window == window
    part = partition_for_cutlass(imp.mod)
    assert G.composites(part) == [COMPOSITE_MQA_SOFTCAP] * LAYERS
    assert hf.kv_expansions_left(imp.mod) and not hf.kv_expansions_left(part)
    if mode == "prefill":  # the numerics of one mode (the CPU build of the reference is slow)
        inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
        args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
        got = G.rewritten_on_cpu(imp.mod, args)
        np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)
