"""Explicit attention chains whose mask is built in the graph from symbolic lengths (decode loops,
``torch.export`` with dynamic shapes): proven causal / windowed and offloaded, or rejected."""

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.graph import masks
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
from mqa_byoc.compiler.partition import canonicalize_attention
from mqa_byoc.models.llama import build_attention_block, build_decoder, random_params
from mqa_byoc.models.presets import scaled

MASK_FORMS = ("repeat-chain", "hf-broadcast")


def _tiny(name, **kw):
    return scaled(name, num_layers=1, vocab_size=64, hidden_size=64, intermediate_size=64, **kw)


# ------------------------------------------------------------------------------------------
# sampling and classification
# ------------------------------------------------------------------------------------------


def test_samples_straddle_every_threshold():
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    values = [s[n] for s in masks.sample_bindings([n], {4096})]
    assert 4095 in values and 4098 in values and 1 in values
    pairs = {(s[m], s[n]) for s in masks.sample_bindings([n, m], {100})}
    assert (99, 1) in pairs and (1, 102) in pairs and (102, 102) in pairs


def test_samples_start_at_the_functions_lower_bounds():
    """Values below a variable's lower bound (torch.export's range, in ``tir_var_lower_bound``) are not
    sampled: the graph is exported for lengths from there on; the bound itself is."""
    n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
    samples = masks.sample_bindings([n, m], {8}, {"n": 8})
    assert min(s[n] for s in samples) == 8 and {8, 10, 37} <= {s[n] for s in samples}
    assert min(s[m] for s in samples) == 1  # no bound
    assert min(s[n] for s in masks.sample_bindings([n], {8})) == 1
    joined = masks.combine_samples([{n: 1}, {n: 2}, {n: 3}], [{m: 9}])
    assert joined == [{n: 1, m: 9}, {n: 2, m: 9}, {n: 3, m: 9}]


def test_classify_samples_prefers_the_kind_every_sample_fits():
    causal = masks.MaskKind(True, None)
    # a 1x1 causal mask hides nothing; with S_q = 1 causal hides nothing either
    samples = [masks.mask_allows(causal, 1, 1), masks.mask_allows(causal, 5, 5)]
    assert masks.classify_samples(samples) == causal
    assert masks.classify_samples([masks.mask_allows(causal, 1, 9)]) == masks.NO_MASK
    # below its width a window looks causal: the wide sample decides
    win = masks.MaskKind(True, 6)
    assert masks.classify_samples([masks.mask_allows(win, 4, 4), masks.mask_allows(win, 9, 9)]) == win
    with pytest.raises(masks.MaskError, match="same causal/window mask"):
        masks.classify_samples([masks.mask_allows(causal, 4, 4), np.ones((9, 9), dtype=bool)])
    with pytest.raises(masks.MaskError, match="no sample"):
        masks.classify_samples([])


def test_classify_allowed_finds_the_window_width():
    for w in (1, 3, 40):
        allowed = masks.mask_allows(masks.MaskKind(True, w), 50, 64)
        assert masks.classify_allowed(allowed) == masks.MaskKind(True, w)


# ------------------------------------------------------------------------------------------
# attention blocks with symbolic lengths (the mask is built inside the graph)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("mode", ["prefill", "decode", "extend"])
@pytest.mark.parametrize("window", [None, 40])
def test_symbolic_mask_offloaded_with_the_right_kind(form, mode, window):
    # window 40 > the small sample lengths (up to 37): without samples past the graph's own
    # constant, the window would pass for plain causal and FA2 would attend to every key
    mod = build_attention_block(8, 2, 64, kv_expand=form, mode=mode, sliding_window=window)
    (site,) = offload_report(mod)
    if mode == "extend":
        # independent seq_len and kv_len: where S_q > S_kv the first rows see no key at all, and
        # the graph's softmax and FA2 disagree there (the same rule as for R.nn.attention)
        assert not site.offloaded and "S_q <= S_kv is not provable" in site.reason
        assert G.composites(partition_for_cutlass(mod)) == []
        return
    assert site.offloaded, site.reason
    assert site.num_kv_heads == 2 and site.composite == "flash_attn.attention_mqa"
    assert site.window == window
    if mode == "decode" and window is None:
        assert site.causal is None  # one query row sees every key: no mask at all
    else:
        assert site.causal == "BottomRight"
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    assert G.count_ops(out, "relax.nn.softmax") == 0


def _threshold_mask_chain(limit):
    """A chain whose mask is causal while S <= limit and hides nothing beyond: not an FA2 mask."""
    return G.symbolic_mask_chain(lambda i, j, n: tirx.And(j > i, n <= limit))


def test_mask_that_changes_past_a_length_is_rejected():
    mod = _threshold_mask_chain(50)
    (site,) = offload_report(mod)
    assert not site.offloaded
    assert "same causal/window mask" in site.reason
    out = partition_for_cutlass(mod)
    assert G.composites(out) == []
    assert G.count_ops(out, "relax.repeat") == 2  # left to TVM untouched


def test_mask_too_large_to_check_is_rejected_with_reason():
    mod = build_attention_block(8, 2, 64, kv_expand="hf-broadcast", mode="prefill", sliding_window=1 << 14)
    (site,) = offload_report(mod)
    assert not site.offloaded and "elements" in site.reason and "constant" in site.reason


# ------------------------------------------------------------------------------------------
# whole decoders: prefill / decode / extend with symbolic batch and lengths
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("preset,window", [("llama3-8b", None), ("mistral-7b", 4096), ("mistral-7b", 24)])
def test_decoder_masks_offloaded(form, preset, window):
    cfg = _tiny(preset, sliding_window=window if window is not None else False)
    mod, _ = build_decoder(cfg, kv_expand=form, functions=("prefill", "decode", "extend"))
    report = offload_report(mod)
    assert len(report) == 3 * cfg.num_layers
    for site in report:
        assert site.offloaded, (site.function, site.reason)
        assert (site.num_q_heads, site.num_kv_heads) == (cfg.num_heads, cfg.num_kv_heads)
        assert site.window == window
        expect_causal = None if site.function == "decode" and window is None else "BottomRight"
        assert site.causal == expect_causal
    out = partition_for_cutlass(mod)
    for fname in ("prefill", "decode", "extend"):
        assert G.count_ops(out, "relax.nn.softmax", function=fname) == 0
        assert G.count_ops(out, "relax.repeat", function=fname) == 0
        assert G.count_ops(out, "relax.broadcast_to", function=fname) == 0


def _run(mod, fname, args):
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm[fname](*args)
    return out[0].numpy(), out[1]


@pytest.mark.slow
@pytest.mark.parametrize("form", MASK_FORMS)
def test_decoder_prefill_rewrite_numerics_cpu(form):
    """The canonicalized fp16 decoder (attention on the native K/V heads, TVM's lowering with the
    h // r fix) gives the original graph's logits. Prefill only: TVM's CPU lowering of
    R.nn.attention fails on S_kv = past_len + 1 (decode is checked on the GPU, tests/gpu)."""
    cfg = scaled("llama3-8b", num_layers=1, vocab_size=64, hidden_size=64, intermediate_size=64)
    mod, spec = build_decoder(cfg, kv_expand=form, logits="all", functions=("prefill",))
    rewritten = LegalizeGroupedAttention()(canonicalize_attention(mod))
    assert G.count_ops(rewritten, "relax.nn.softmax", function="prefill") == 0
    params = [tvm.runtime.tensor(p) for p in random_params(spec, seed=3, std=0.05)]
    ids = tvm.runtime.tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)).astype("int32"))
    want, _ = _run(mod, "prefill", [ids, *params])
    got, _ = _run(rewritten, "prefill", [ids, *params])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", MASK_FORMS)
def test_decode_block_rewrite_numerics_cpu(form):
    """One decode attention (S_q = 1, symbolic S_kv, mask from the positions) after the rewrite."""
    mod = build_attention_block(8, 2, 64, kv_expand=form, mode="decode")
    rewritten = LegalizeGroupedAttention()(canonicalize_attention(mod))
    assert G.count_ops(rewritten, "relax.nn.softmax") == 0
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(shape).astype("float16") for shape in ((2, 1, 8, 64), (2, 11, 2, 64), (2, 11, 2, 64))]
    want = _run_single(mod, args)
    got = _run_single(rewritten, args)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def _run_single(mod, args):
    ex = relax.build(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


# ------------------------------------------------------------------------------------------
# Hugging Face exports with dynamic shapes
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind,mode", [("llama", "prefill"), ("llama", "decode"), ("mistral", "prefill")])
def test_hf_dynamic_export_offloaded(impl, kind, mode):
    pytest.importorskip("transformers")
    from mqa_byoc.models import hf

    # Mistral's own window (4096); torch.export cannot export smaller windows with a dynamic
    # length (its guards pin the length against the window)
    window = 4096 if kind == "mistral" else None
    cfg = hf.make_hf_config(kind, hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=32,
                            intermediate_size=128, vocab_size=64, num_layers=1, sliding_window=window,
                            attn_implementation=impl)
    imp = hf.import_hf(hf.build_hf_model(cfg, dtype="float16"), mode=mode, dynamic=True)
    (site,) = offload_report(imp.mod)
    assert site.offloaded, site.reason
    assert site.composite == "flash_attn.attention_mqa"
    assert site.window == window
    assert site.causal == ("BottomRight" if mode == "prefill" else None)
    out = partition_for_cutlass(imp.mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]


# ------------------------------------------------------------------------------------------
# S_q <= S_kv through a KV-cache view: match_cast(concat(past, new), (B, kv_len, H_kv, D))
# ------------------------------------------------------------------------------------------


def test_match_cast_kv_len_proves_chunked_prefill_causal():
    """extend (a chunk after a cache) with the cache bound to a fresh kv_len: the match_cast says
    kv_len == past_len + seq_len, so the BottomRight mask is FA2's; report and partition agree."""
    cfg = _tiny("llama3-8b")
    mod, _ = build_decoder(cfg, kv_expand="repeat", functions=("extend",), fresh_kv_len=True)
    assert "relax.match_cast" in str(mod["extend"]) or "R.match_cast" in mod["extend"].script()
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert site.causal == "BottomRight"
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    assert G.count_ops(out, "relax.repeat", function="extend") == 0


def test_offload_report_and_partition_agree_on_every_decoder_site():
    cfg = _tiny("llama3-8b")
    for form in ("repeat", "native", "hf-broadcast"):
        mod, _ = build_decoder(cfg, kv_expand=form, functions=("prefill", "decode", "extend"))
        report = offload_report(mod)
        assert all(s.offloaded for s in report), [(s.function, s.reason) for s in report]
        assert len(G.composites(partition_for_cutlass(mod))) == len(report), form
