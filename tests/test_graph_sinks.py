"""Attention with sinks (GPT-OSS) and chains nothing else explains.

GPT-OSS's eager chain (scores, mask, the per-head sink logits concatenated on the key axis, the row
maximum subtracted, softmax, the sink column dropped, @ V) is offloaded with native K/V heads as
``flash_attn.attention_mqa_sink``; the rewritten graph (the composite's reference body, on llvm) gives the
original's results. Every matmul-softmax-matmul chain appears in the report: ALiBi and
score modifications the analysis cannot prove are rejected saying so, never absent."""

import re
import shutil
import subprocess

import numpy as np
import pytest

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.codegen import dispatch as codegen
from mqa_byoc.compiler.codegen.native import emit_native_source
from mqa_byoc.contract import COMPOSITE_MHA_SINK, COMPOSITE_MQA, COMPOSITE_MQA_SINK

RNG = np.random.default_rng(0)


def _inputs(h=8, hkv=2, d=64, s=16, s_kv=None, sinks_dtype="float32", sink_std=2.0):
    s_kv = s if s_kv is None else s_kv
    q = RNG.standard_normal((1, h, s, d)).astype("float16")
    k = RNG.standard_normal((1, hkv, s_kv, d)).astype("float16")
    v = RNG.standard_normal((1, hkv, s_kv, d)).astype("float16")
    return q, k, v, (RNG.standard_normal(h) * sink_std).astype(sinks_dtype)


@pytest.mark.parametrize("kw", [
    dict(),                                           # prefill, causal, the frontend's topk row max
    dict(window=4),                                   # a sliding layer
    dict(s=1, s_kv=9),                                # decode
    dict(s=5, s_kv=12, window=3),                     # chunked prefill with a window
    dict(shift="max", sinks_dtype="float16"),         # max(dim=-1) and sinks in the model's dtype
    dict(shift=None),                                 # no row maximum subtracted
    dict(hkv=8),                                      # as many K/V heads as query heads
    dict(hkv=1, h=4),                                 # multi-query
])
def test_sink_chain_offloaded_and_exact_on_cpu(kw):
    mod = G.sink_chain(**kw)
    (site,) = offload_report(mod)
    h, hkv = kw.get("h", 8), kw.get("hkv", 2)
    assert site.offloaded, site.reason
    assert site.composite == (COMPOSITE_MQA_SINK if hkv != h else COMPOSITE_MHA_SINK)
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (h, hkv, 64)
    decode = kw.get("s", 16) == 1
    assert site.causal == (None if decode else "BottomRight")
    assert site.window == (None if decode else kw.get("window"))
    assert "sink" in site.kernel
    args = _inputs(h, hkv, s=kw.get("s", 16), s_kv=kw.get("s_kv"), sinks_dtype=kw.get("sinks_dtype", "float32"))
    got = G.rewritten_on_cpu(mod, list(args))
    want = G.reference_sink_attention(*args, window=kw.get("window"))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    # the sinks matter: without them the result is another one
    no_sinks = G.reference_sink_attention(*args[:3], np.full(h, -1e4, "float32"), window=kw.get("window"))
    assert np.abs(want - no_sinks).max() > 0.05
    part = partition_for_cutlass(mod)
    assert G.composites(part) == [site.composite]
    assert G.count_ops(part, "relax.concat") == 0 and G.count_ops(part, "relax.nn.softmax") == 0


@pytest.mark.parametrize("kw", [
    dict(),                                           # prefill, causal, torch's log-sum-exp decomposition
    dict(lse="plain"),                                # log(sum(exp(s)))
    dict(window=4, shift="max"),                      # a sliding layer; the softmax reads s - max(s)
    dict(s=1, s_kv=9),                                # decode
    dict(hkv=1, h=4, sinks_dtype="float16"),          # multi-query; sinks in the model's dtype
])
def test_sink_applied_after_attention_offloaded_as_a_sink_site(kw):
    """GraniteSWA's form, ``O * sigmoid(logsumexp(s) - sink)`` after P @ V, is a sink site rooted at the
    multiply: the scores, their log-sum-exp and the K/V expansion leave the graph, and the rewrite gives
    the graph's (and the reference's) numbers."""
    mod = G.sink_chain(sink_at="output", **kw)
    (site,) = offload_report(mod)
    h, hkv = kw.get("h", 8), kw.get("hkv", 2)
    assert site.offloaded and site.composite == COMPOSITE_MQA_SINK and site.note is None, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.window) == (h, hkv, None if kw.get("s") == 1 else kw.get("window"))
    args = _inputs(h, hkv, s=kw.get("s", 16), s_kv=kw.get("s_kv"), sinks_dtype=kw.get("sinks_dtype", "float32"))
    got = G.rewritten_on_cpu(mod, list(args))
    np.testing.assert_allclose(got, G.reference_sink_attention(*args, window=kw.get("window")), rtol=2e-2, atol=2e-2)
    part = partition_for_cutlass(mod)
    assert G.composites(part) == [COMPOSITE_MQA_SINK]
    assert [G.count_ops(part, op) for op in ("relax.nn.softmax", "relax.log", "relax.sigmoid", "relax.repeat",
                                              "relax.broadcast_to")] == [0] * 5
    # mqa=False: the same site on K/V repeated to the query heads
    assert G.composites(partition_for_cutlass(mod, mqa=False)) == [COMPOSITE_MHA_SINK]


@pytest.mark.parametrize("mismatch", ["sign", "unmasked", "rows"])
def test_output_scaling_that_is_not_the_sink_stays_in_the_graph(mismatch):
    """A scaling of the same shape that is not the sink (``sigmoid(sink - lse)``, the log-sum-exp of the
    scores before their mask, the logits broadcast over the rows instead of the heads) is not taken for
    one: the softmax chain is offloaded as plain attention, the scaling stays, and the rewrite keeps the
    graph's numbers."""
    mod = G.sink_chain(sink_at="output", mismatch=mismatch, s=8)
    (site,) = offload_report(mod)
    assert site.offloaded and site.composite == COMPOSITE_MQA, site.reason
    assert site.note.startswith("the graph still computes the K/V expansion")
    G.rewritten_on_cpu(mod, list(_inputs(s=8)))
    assert G.count_ops(partition_for_cutlass(mod), "relax.sigmoid") == 1


def test_sink_chain_symbolic_lengths():
    mod = G.sink_chain(s="n", s_kv="n")
    (site,) = offload_report(mod)
    assert site.offloaded and site.causal == "BottomRight", site.reason
    # S_q and S_kv unrelated: a causal mask is not provably bottom-right aligned
    (site,) = offload_report(G.sink_chain(s="n", s_kv="m"))
    assert not site.offloaded and "S_q <= S_kv" in site.reason


def test_sink_composite_read_by_the_codegen():
    part = partition_for_cutlass(G.sink_chain(window=4, sinks_dtype="bfloat16", dtype="bfloat16"), provider="python")
    (func,) = [f for f in part.functions.values() if f.attrs is not None and "Codegen" in f.attrs]
    site = codegen.find_site(func)
    spec = site.spec
    assert site.composite_name == COMPOSITE_MQA_SINK and site.arg_map == (0, 1, 2, 3)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype) == (8, 2, 64, "bfloat16")
    assert (spec.causal, spec.window_left, spec.window_right, spec.sinks_dtype) == (True, 3, 0, "bfloat16")
    assert (spec.q_layout, spec.k_layout, spec.v_layout, spec.out_layout) == ("BNSH",) * 3 + ("BSNH",)
    assert spec.scale == pytest.approx(0.125)
    python_cc = codegen.flash_attn_codegen([func], {"provider": "python"})[0].inspect_source()
    assert "mqa_byoc.flash_attn_sink_forward" in python_cc and "sinks must be (8,) bfloat16" in python_cc
    native = emit_native_source(site.symbol, spec, arg_map=site.arg_map, num_inputs=4)
    assert "mqa_byoc_fa2_forward_sink" in native.code and "sinks=bfloat16" in native.code
    hopper = emit_native_source(site.symbol, spec, arg_map=site.arg_map, num_inputs=4, hopper=True)
    assert "__tvm_ffi_fa4" not in hopper.code  # no FA4 sink path: FA2 and the epilogue
    with pytest.raises(ValueError, match="takes q, k, v and sinks"):
        emit_native_source(site.symbol, spec)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_sink_wrappers_compile(tmp_path):
    import tvm
    import tvm_ffi.libinfo as ffi_info

    flags = ["-I" + p for p in (tvm.libinfo.find_include_path(), ffi_info.find_include_path(),
                                ffi_info.find_dlpack_include_path())]
    part = partition_for_cutlass(G.sink_chain(), provider="python")
    (func,) = [f for f in part.functions.values() if f.attrs is not None and "Codegen" in f.attrs]
    site = codegen.find_site(func)
    sources = {"python": codegen.flash_attn_codegen([func], {"provider": "python"})[0].inspect_source(),
               "native": emit_native_source(site.symbol, site.spec, arg_map=site.arg_map, num_inputs=4).code}
    for name, code in sources.items():
        cc = tmp_path / f"{name}.cc"
        cc.write_text(code)
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-Wall", "-Werror", "-c", str(cc), "-o",
                            str(tmp_path / f"{name}.o")] + flags, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        syms = subprocess.run(["nm", str(tmp_path / f"{name}.o")], capture_output=True, text=True).stdout
        assert f"T __tvm_ffi_{site.symbol}" in syms
        if name == "native":
            assert re.search(r"w mqa_byoc_fa2_forward_sink", syms)


# ----------------------------------------------------------------------------- nothing unseen
@pytest.mark.parametrize("score_mod, words", [
    ("alibi", "ALiBi"),
    ("square", "non-constant"),
])
def test_score_modifications_are_reported_not_absent(score_mod, words):
    (site,) = offload_report(G.sink_chain(score_mod=score_mod))
    assert not site.offloaded and words in site.reason, site.reason


def test_soft_capped_chain_is_offloaded_as_soft_capping():
    """The sink chain with Gemma 2's soft-cap instead of the sinks: offloaded as soft-capped attention
    (tests/test_graph_softcap.py covers the form)."""
    (site,) = offload_report(G.sink_chain(score_mod="softcap"))
    assert site.offloaded and site.composite == "flash_attn.attention_mqa_softcap" and site.softcap == 50.0


def test_unknown_op_on_the_scores_is_reported():
    """A chain with an op no form knows between the matmuls is in the report with that op named."""
    from tvm import relax
    from tvm.relax import op as R

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 4, 8, 64], "float16"))
    k = relax.Var("k", relax.TensorType([1, 4, 8, 64], "float16"))
    with bb.function("main", [q, k]):
        with bb.dataflow():
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 3, 2]))))
            sc = bb.emit(R.sort(bb.emit(R.astype(sc, "float32")), axis=-1))  # nothing an attention does
            p = bb.emit(R.astype(R.nn.softmax(sc, axis=-1), "float16"))
            out = bb.emit_output(R.matmul(p, k))
        bb.emit_func_output(out)
    (site,) = offload_report(bb.get())
    assert not site.offloaded and "sort" in site.reason, site.reason


def test_sink_column_not_one_logit_per_head_is_rejected():
    """Two columns concatenated and sliced off: reported, with what the analysis expected."""
    from tvm import relax
    from tvm.relax import op as R

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 4, 8, 64], "float16"))
    k = relax.Var("k", relax.TensorType([1, 4, 8, 64], "float16"))
    extra = relax.Var("extra", relax.TensorType([1, 4, 8, 2], "float32"))
    with bb.function("main", [q, k, extra]):
        with bb.dataflow():
            sc = bb.emit(R.astype(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 3, 2]))), "float32"))
            p = bb.emit(R.nn.softmax(bb.emit(R.concat([sc, extra], axis=-1)), axis=-1))
            p = bb.emit(R.astype(R.strided_slice(p, axes=[3], begin=[0], end=[8]), "float16"))
            out = bb.emit_output(R.matmul(p, k))
        bb.emit_func_output(out)
    (site,) = offload_report(bb.get())
    assert not site.offloaded and "one sink logit per query head" in site.reason, site.reason


# ----------------------------------------------------------------------------- GPT-OSS through the HF path
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 2, 8, 2, 32, 8


def _gpt_oss(impl="eager"):
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no GptOssConfig")
    cfg = transformers.GptOssConfig(
        hidden_size=256, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=256, vocab_size=128, num_hidden_layers=LAYERS, max_position_embeddings=256,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        # TVM's frontend has no converter for transformers' default grouped_mm experts
        experts_implementation="batched_mm")
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random sinks large enough to matter (a fresh model's are zeros)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_gpt_oss_offloaded_with_sinks_and_windows(mode):
    from mqa_byoc.models import hf

    model = _gpt_oss()
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="standard", mixed_precision=True)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    windows = (WINDOW, None) if mode == "prefill" else (None, None)  # decode: 7 keys fit the window
    for site, window in zip(report, windows):
        assert site.offloaded, site.reason
        assert site.composite == COMPOSITE_MQA_SINK
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (HEADS, KV_HEADS, HEAD_DIM,
                                                                                   "float16")
        assert site.causal == ("BottomRight" if mode == "prefill" else None) and site.window == window
    part = partition_for_cutlass(imp.mod)
    assert hf.kv_expansions_left(imp.mod) and not hf.kv_expansions_left(part)
    assert G.composites(part) == [COMPOSITE_MQA_SINK] * LAYERS
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args)
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


def test_sink_composite_without_codegen_annotation():
    """``annotate_codegen=False``: the sink function itself becomes the composite, as FuseOpsByPattern
    leaves the other composites as global functions."""
    part = partition_for_cutlass(G.sink_chain(), annotate_codegen=False)
    funcs = [f for f in part.functions.values() if f.attrs is not None and "Composite" in f.attrs]
    assert [str(f.attrs["Composite"]) for f in funcs] == [COMPOSITE_MQA_SINK]
    assert not any("Codegen" in f.attrs for f in part.functions.values() if f.attrs is not None)


def test_gpt_oss_decode_after_a_prompt_longer_than_the_window():
    """GPT-OSS's hybrid cache after a 12-token prompt: the sliding layer keeps the last w - 1 = 7 positions,
    the full one all 12. The decode step takes those per-layer pasts, numbers the new token 12 and gives the
    logits of a 13-token prefill's last position; every site is offloaded over all its keys."""
    from mqa_byoc.models import hf

    model = _gpt_oss()
    seen = 12
    lens = hf.decode_past_lengths(model.config, seen)
    assert lens == [WINDOW - 1, seen]
    ids = torch.randint(0, 128, (1, seen + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf.export_wrapper(model, "prefill", LAYERS, True)(ids[:, :seen])
        past = out[1:]
        assert [p.shape[2] for p in past[::2]] == lens
        step = hf.export_wrapper(model, "decode", LAYERS, True)(ids[:, seen:], *past)[0]
        longer = hf.export_wrapper(model, "prefill", LAYERS, True)(ids)[0][:, -1:]
    np.testing.assert_allclose(step.numpy(), longer.numpy(), rtol=1e-5, atol=1e-5)

    imp = hf.import_hf(model, mode="decode", batch=1, past_len=lens, convert="standard", mixed_precision=True)
    report = offload_report(imp.mod)
    assert [(s.offloaded, s.composite, s.window, s.causal) for s in report] == \
           [(True, COMPOSITE_MQA_SINK, None, None)] * LAYERS, [s.reason for s in report]
    inputs = [ids[:, seen:].numpy(), *[p.numpy() for p in past]]
    got = G.rewritten_on_cpu(imp.mod, [*inputs, *imp.params])
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)
    with pytest.raises(ValueError, match="2 layers"):
        hf.import_hf(model, mode="decode", past_len=[7], convert="standard")


def test_gpt_oss_dynamic_decode_with_per_layer_pasts():
    """One decode graph of symbolic past lengths (exported at a past of 12, beyond the window; the fixes map
    converts the sliding cache's ``sym_max``): each layer's K and V share one length, the layers keep their own.
    Both layers offloaded with their sinks and native K/V heads; the rewrite at the pasts a serving loop hands
    it (the sliding layer's w - 1 = 7 positions, the full layer's 12, then 20) gives the unrewritten graph's
    and HF's logits."""
    from mqa_byoc.models import hf

    model = _gpt_oss()
    imp = hf.import_hf(model, mode="decode", batch=2, seq_len=1, past_len=12, dynamic=True, convert="fixes",
                       mixed_precision=True)
    report = offload_report(imp.mod)
    assert [(s.offloaded, s.composite, s.num_kv_heads, s.window, s.causal) for s in report] == \
           [(True, COMPOSITE_MQA_SINK, KV_HEADS, None, None)] * LAYERS, [s.reason for s in report]
    pasts = [p.ty.shape.values[2] for p in imp.mod["main"].params[1:1 + 2 * LAYERS]]
    assert pasts[0].same_as(pasts[1]) and pasts[2].same_as(pasts[3]) and not pasts[0].same_as(pasts[2])
    rng = np.random.default_rng(5)
    for full in (12, 20):
        ids = rng.integers(0, 128, (3, 1)).astype("int64")
        past = [rng.standard_normal((3, KV_HEADS, n, HEAD_DIM)).astype("float32")
                for n in (WINDOW - 1, full) for _ in ("k", "v")]
        got = G.rewritten_on_cpu(imp.mod, [ids, *past, *imp.params])
        np.testing.assert_allclose(got, imp.reference(ids, *past), rtol=5e-2, atol=5e-2)
