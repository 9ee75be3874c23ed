"""The standard HF path. A Llama (GQA) / Mistral (MQA) decoder exported with
``torch.export`` and imported with plain ``from_exported_program`` (no custom convert map), then
``ToMixedPrecision(out_dtype="float16")``: every layer's attention is offloaded as one composite with
the K/V expansion removed, and the rewrite computes what the graph does.

The frontend's own limits (see ``mqa_byoc.models.hf.import_hf(convert="standard")``) are pinned
here too, so that a TVM upgrade that lifts one shows up."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from mqa_byoc.testing import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention  # noqa: E402
from mqa_byoc.compiler.partition import canonicalize_attention  # noqa: E402
from mqa_byoc.models import hf  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 2, 8, 32
KV_HEADS = {"llama": 2, "mistral": 1}  # Llama GQA, Mistral MQA


def _model(kind, impl, dtype="float32", window=8):
    cfg = hf.make_hf_config(kind, hidden_size=256, num_heads=HEADS, num_kv_heads=KV_HEADS[kind],
                            head_dim=HEAD_DIM, intermediate_size=256, vocab_size=128, num_layers=LAYERS,
                            attn_implementation=impl, sliding_window=window if kind == "mistral" else None)
    return hf.build_hf_model(cfg, dtype=dtype)


def _standard(model, mode, dynamic=False, use_cache=True):
    return hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, dynamic=dynamic,
                        use_cache=use_cache, convert="standard", mixed_precision=True)


def _check_offloaded(mod, kind, mode, window):
    report = offload_report(mod)
    assert len(report) == LAYERS
    for site in report:
        assert site.offloaded, site.reason
        assert site.composite == "flash_attn.attention_mqa"
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (
            HEADS, KV_HEADS[kind], HEAD_DIM, "float16")
        assert site.expansion == "repeat" and site.expansion_ops_removed == 6  # HF repeat_kv on K and V
        if mode == "prefill":
            assert site.causal == "BottomRight"
            assert site.window == (window if kind == "mistral" else None)
        else:  # one query sees every cached key (the sliding cache holds fewer than w)
            assert (site.causal, site.window) == (None, None)
        assert site.scale == pytest.approx(HEAD_DIM ** -0.5, rel=1e-3)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"] * LAYERS
    assert hf.kv_expansions_left(mod)  # HF's repeat_kv, before
    assert not hf.kv_expansions_left(out), hf.kv_expansions_left(out)
    assert G.count_ops(out, "relax.repeat") == G.count_ops(out, "relax.tile") == 0
    assert G.count_ops(out, "relax.nn.softmax") == 0
    return out


_run = G.run_llvm


# ----------------------------------------------------------------------------- fp32 model + ToMixedPrecision
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_standard_fp32_mixed_precision_offloaded(impl, kind, mode):
    imp = _standard(_model(kind, impl), mode)
    _check_offloaded(imp.mod, kind, mode, 8)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind, mode, window", [
    ("llama", "prefill", None), ("llama", "decode", None),
    # torch.export pins a dynamic prompt length against a window shorter than its range: Mistral's own
    # 4096 (above max_seq_len) for prefill; decode with a small window (batch dynamic, the past length
    # pinned by torch.export, which TVM's frontend turns into a variable named "6": import_hf binds it)
    ("mistral", "prefill", 4096), ("mistral", "decode", 8),
])
def test_standard_dynamic_offloaded(impl, kind, mode, window):
    imp = _standard(_model(kind, impl, window=window or 8), mode, dynamic=True)
    assert relax.analysis.free_symbolic_vars(imp.mod["main"]) or relax.analysis.defined_symbolic_vars(imp.mod["main"])
    _check_offloaded(imp.mod, kind, mode, window)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_dynamic_sliding_window_decode_offloaded(impl):
    """A sliding-window decode exported with a past of at least the window keeps its past length symbolic,
    bounded below by torch.export (HF's sliding cache keeps the last window - 1 keys, from
    ``max(past - window + 1, 0)``: a ``torch.sym_max``, which TVM's frontend does not convert). Imported with
    the fixes map: every layer offloaded (one query over the cache's keys, no mask, after proving the mask at
    past lengths inside the function's range), and one graph's rewrite at three past lengths gives the
    unrewritten graph's and HF's logits."""
    model = _model("mistral", impl)
    kw = dict(mode="decode", batch=2, seq_len=1, past_len=12, dynamic=True, mixed_precision=True)
    with pytest.raises(AssertionError, match="sym_max"):  # the frontend alone
        hf.import_hf(model, convert="standard", **kw)
    imp = hf.import_hf(model, convert="fixes", **kw)
    lower = imp.mod["main"].attrs["tir_var_lower_bound"]
    assert max(int(v) for v in lower.values()) >= 7, lower  # the past's range starts at the window
    _check_offloaded(imp.mod, "mistral", "decode", 8)
    for past in (8, 12, 21):
        inputs = hf.example_inputs(model, mode="decode", batch=3, past_len=past, seed=past)
        args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
        got = G.rewritten_on_cpu(imp.mod, args)
        np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)
    if impl == "sdpa":  # what is reported offloaded builds for the GPU, its past length symbolic
        import mqa_byoc
        from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline

        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
        ex = mqa_byoc.build(imp.mod, target, provider="python", gemm=False, link_kernels=False,
                            pipeline=cuda_decoder_pipeline(target))
        assert ex is not None
    # without the range the mask is sampled at pasts this graph was not exported for (fewer keys than the
    # mask's 8): no site is offloaded, the mask named as the reason
    unbounded = tvm.IRModule(dict(imp.mod.functions.items()))
    unbounded["main"] = unbounded["main"].without_attr("tir_var_lower_bound")
    for site in offload_report(unbounded):
        assert not site.offloaded and "mask" in site.reason, site.reason


@pytest.mark.slow
@pytest.mark.parametrize("impl, kind, mode", [("eager", "llama", "prefill"), ("sdpa", "llama", "prefill"),
                                              ("sdpa", "mistral", "decode")])
def test_standard_rewrite_numerics_cpu(impl, kind, mode):
    """The rewritten graph (attention on the un-expanded K/V, TVM's lowering with the h // r
    grouping) gives the original graph's logits; both are close to float32 eager. (TVM cannot lower
    a windowed R.nn.attention on the CPU, so Mistral's prefill is checked on the GPU only.)"""
    model = _model(kind, impl)
    imp = _standard(model, mode)
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args)
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


# ----------------------------------------------------------------------------- fp16 model as is
@pytest.mark.slow
@pytest.mark.parametrize("impl, kind, dynamic", [("eager", "llama", False), ("sdpa", "llama", False),
                                                 ("eager", "mistral", False), ("sdpa", "llama", True)])
def test_standard_fp16_model_offloaded(impl, kind, dynamic):
    """An fp16 model exported as is, cache-less (what a prefill without generation looks like). Its
    mask then holds HF's packed-sequence check, a cumsum of bools that TVM types bool and LLVM
    cannot compile; the mask evaluator computes it (its input is all False). The original graph
    cannot be built, the partitioned one can (the mask is gone): compared with fp16 eager."""
    model = _model(kind, impl, dtype="float16", window=4096 if dynamic else 8)
    imp = _standard(model, "prefill", dynamic=dynamic, use_cache=False)
    assert "R.cumsum" in imp.mod.script(show_meta=False)
    out = _check_offloaded(imp.mod, kind, "prefill", 4096 if dynamic else 8)
    if not dynamic and kind == "llama":  # TVM cannot lower a windowed R.nn.attention on the CPU
        ids = hf.example_inputs(model, mode="prefill", seq_len=12, seed=2)[0]
        got = _run(LegalizeGroupedAttention()(canonicalize_attention(imp.mod)), [ids, *imp.params])
        assert "R.cumsum" not in canonicalize_attention(imp.mod).script(show_meta=False)
        np.testing.assert_allclose(got, imp.reference(ids), rtol=5e-2, atol=5e-2)
        assert out is not None


def test_standard_fp16_model_without_mixed_precision_names_it():
    """TVM's frontend gives an fp16 model float32 matmuls, so the attention is float32: rejected,
    naming the pass that makes it fp16 (FA2 would round Q/K/V the graph keeps in float32)."""
    imp = hf.import_hf(_model("llama", "eager", dtype="float16"), mode="prefill", seq_len=12,
                       use_cache=False, convert="standard")
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    assert all(not s.offloaded and "ToMixedPrecision" in s.reason for s in report)


def test_standard_fp16_cached_prefill_offloaded():
    """An fp16 model's prefill through a fresh cache (whose first update stores K/V without a concat)."""
    _check_offloaded(_standard(_model("mistral", "sdpa", dtype="float16"), "prefill").mod, "mistral", "prefill", 8)


def test_frontend_cannot_import_fp16_decode():
    """Frontend limit (not ours): its float32 matmuls make the new K/V float32, and concatenating them
    onto the fp16 past fails at import. The fp32 export + ToMixedPrecision is the standard path."""
    with pytest.raises(TypeError, match="Concat expects all input tensors to have the same dtype"):
        _standard(_model("llama", "eager", dtype="float16"), "decode")


def test_frontend_cannot_import_hf_lazy_cache():
    """Frontend limit (not ours): HF's DynamicCache starts each layer from a 1-D ``torch.tensor([])``
    that torch.cat skips and TVM's concat rejects; import_hf(convert="standard") stores each layer's
    first K/V without that concat instead (``hf._seed_cache``)."""
    from tvm.relax.frontend.torch import from_exported_program

    model = _model("llama", "eager")
    wrapper = hf.export_wrapper(model, "prefill", LAYERS, use_cache=True, seed_cache=False).eval()
    with torch.no_grad():
        ep = torch.export.export(wrapper, (torch.zeros(1, 4, dtype=torch.long),))
    with pytest.raises(ValueError, match="Concat expects all input tensors to have same ndim"):
        from_exported_program(ep)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_standard_default_mixed_precision_offloads_attention_and_every_gemm(mode):
    """TVM's ``ToMixedPrecision()`` with its default ``out_dtype="float32"``: every matmul is fp16 x fp16 ->
    fp32. Attention is offloaded as with ``out_dtype="float16"``, and every nn.Linear GEMM too (cuBLASLt
    writes the float32 output); the GEMM rewrite computes what the graph does, on the CPU."""
    from mqa_byoc.compiler.graph import gemm

    model = _model("llama", "eager")
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="standard")
    mod = relax.transform.ToMixedPrecision()(imp.mod)
    _check_offloaded(mod, "llama", mode, None)
    sites = [s for s in offload_report(mod, gemm=True) if isinstance(s, gemm.GemmSite)]  # attention's offloaded
    assert len(sites) == 7 * LAYERS + 1  # q, k, v, o, gate, up, down a layer; lm_head
    # each matmul's float32 result is cast to fp16 at once: cuBLASLt writes the fp16 result (the cast fused)
    assert all(s.offloaded and s.composite == "cublaslt.matmul_cast" and (s.dtype, s.out_dtype) == ("float16", "float16")
               for s in sites), gemm.format_gemm_report(sites)
    # ToMixedPrecision casts the unbound float32 weights in the graph, on every call: the report says so
    assert all("computed on every call" in (s.note or "") for s in sites), gemm.format_gemm_report(sites)
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.run_llvm(gemm.inline_gemm_composites(gemm.PartitionGemm()(mod)), args)
    np.testing.assert_allclose(got, G.run_llvm(mod, args), rtol=1e-3, atol=1e-3)
    # the advice works: bound and folded, the weights are fp16 constants and every GEMM is still offloaded
    names = [p.name for p in mod["main"].params[len(inputs):]]
    bound = relax.transform.FoldConstant()(relax.transform.BindParams(
        "main", {n: tvm.runtime.tensor(p) for n, p in zip(names, imp.params)})(mod))
    folded = [s for s in offload_report(bound, gemm=True) if isinstance(s, gemm.GemmSite)]
    assert len(folded) == len(sites) and all(s.offloaded and s.note is None for s in folded), \
        gemm.format_gemm_report(folded)
