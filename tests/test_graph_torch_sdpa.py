"""``torch.nn.functional.scaled_dot_product_attention`` in a user's own module, exported with
``torch.export`` and imported with plain ``from_exported_program``, then ``ToMixedPrecision``: the form
of gpt-fast-style decoders and of transformers' sdpa attention when no mask is materialized.

TVM's frontend sees torch's math decomposition: the K/V expansion of ``enable_gqa=True`` (or the
user's own ``repeat_interleave``), batched matmuls, and the safe softmax, which zeroes the rows whose
scores are all -inf (``where(not(any(scores != -inf)), 0, softmax)``). That guard is what the kernels do
too; a ``where`` on any other condition is not, and keeps the site in the graph (the synthetic cases)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tvm import relax  # noqa: E402

from mqa_byoc.testing import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402

H, HKV, D = 8, 2, 32
F = torch.nn.functional


class Attention(torch.nn.Module):
    """The attention of a decoder layer as users write it: SDPA on BNSH tensors."""

    def __init__(self, expand="enable_gqa", causal=False, mask=False, scale=None):
        super().__init__()
        self.expand, self.causal, self.mask, self.scale = expand, causal, mask, scale

    def forward(self, q, k, v):
        kw = {}
        if self.expand == "enable_gqa":
            kw["enable_gqa"] = True
        elif self.expand == "repeat_interleave":
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        if self.mask:  # a boolean causal mask aligned to the end of the cache (decode with a past)
            s_q, s_kv = q.shape[2], k.shape[2]
            rows = torch.arange(s_q).reshape(s_q, 1) + (s_kv - s_q)
            kw["attn_mask"] = torch.arange(s_kv) <= rows
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale, **kw)


def _import(module, s_q, s_kv, dynamic=None):
    from tvm.relax.frontend.torch import from_exported_program

    gen = torch.Generator().manual_seed(0)
    b = 2 if dynamic == "prefill" else 1  # torch.export specializes an example size of 1
    args = (torch.randn(b, H, s_q, D, generator=gen), torch.randn(b, HKV, s_kv, D, generator=gen),
            torch.randn(b, HKV, s_kv, D, generator=gen))
    dyn = None
    if dynamic == "decode":  # the cache length symbolic, as in a decode loop
        past = torch.export.Dim("kv_len", min=2, max=64)
        dyn = ({}, {2: past}, {2: past})
    elif dynamic == "prefill":  # batch and prompt length symbolic
        b, s = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=2, max=64)
        dyn = ({0: b, 2: s}, {0: b, 2: s}, {0: b, 2: s})
    ep = torch.export.export(module.eval(), args, dynamic_shapes=dyn)
    mod = relax.transform.ToMixedPrecision(out_dtype="float16")(from_exported_program(ep))
    return mod, [a.numpy() for a in args]




CASES = [  # (expand, causal, bool mask, S_q, S_kv)
    ("enable_gqa", False, False, 1, 12),  # decode: one query, every cached key, no mask
    ("enable_gqa", True, False, 12, 12),  # prefill
    ("enable_gqa", False, True, 3, 12),  # a chunk of 3 new tokens after 9 cached, boolean mask
    ("repeat_interleave", False, False, 1, 12),  # K/V expanded by the user, then plain SDPA
    ("repeat_interleave", True, False, 12, 12),
]


@pytest.mark.parametrize("expand, causal, mask, s_q, s_kv", CASES)
def test_exported_sdpa_offloaded_and_rewrite_numerics(expand, causal, mask, s_q, s_kv):
    mod, args = _import(Attention(expand, causal, mask), s_q, s_kv)
    assert "R.where" in mod.script(show_meta=False)  # the safe softmax's guard is in the graph
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (H, HKV, D, "float16")
    assert site.expansion == "repeat" and site.composite == "flash_attn.attention_mqa"
    assert site.causal == ("BottomRight" if causal or mask else None)
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    assert G.count_ops(out, "relax.where") == 0 or mask  # the guard went with the softmax
    # the rewritten graph (attention on the un-expanded K/V) computes what the graph does
    got = G.rewritten_on_cpu(mod, args)
    q, k, v = (torch.from_numpy(a) for a in args)
    ref = Attention(expand, causal, mask)(q, k, v).numpy()
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)


def test_exported_sdpa_with_its_own_scale():
    """torch's decomposition multiplies Q and K^T by sqrt(scale) each: FA2 gets their product."""
    mod, args = _import(Attention("enable_gqa", causal=True, scale=0.05), 12, 12)
    (site,) = offload_report(mod)
    assert site.offloaded and site.scale == pytest.approx(0.05, rel=1e-3)
    G.rewritten_on_cpu(mod, args)


@pytest.mark.parametrize("dynamic, causal, mask, s_q, causal_kind", [
    ("decode", False, False, 1, None),  # a symbolic cache length
    ("prefill", True, False, 12, "BottomRight"),  # symbolic batch and prompt length, is_causal
    ("prefill", False, True, 12, "BottomRight"),  # the same with a boolean causal mask
])
def test_exported_sdpa_with_symbolic_shapes(dynamic, causal, mask, s_q, causal_kind):
    mod, _ = _import(Attention("enable_gqa", causal, mask), s_q, 12, dynamic=dynamic)
    assert relax.analysis.free_symbolic_vars(mod["main"]) or relax.analysis.defined_symbolic_vars(mod["main"])
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_kv_heads, site.causal) == (HKV, causal_kind)


@pytest.mark.parametrize("cond", ["torch", "all", "ne"])
@pytest.mark.parametrize("masked, s, s_kv", [(False, 16, 16), (False, 1, 24), (True, 16, 16), (True, 4, 24)])
def test_dead_row_guard_spellings_are_offloaded(cond, masked, s, s_kv):
    mod = G.safe_softmax_chain(cond=cond, masked=masked, s=s, s_kv=s_kv)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert site.causal == ("BottomRight" if masked else None)
    assert G.composites(partition_for_cutlass(mod)) == ["flash_attn.attention_mqa"]
    if cond == "torch":
        rng = np.random.default_rng(0)
        args = [rng.standard_normal(shape).astype("float16") for shape in ((1, 8, s, 64), (1, 2, s_kv, 64),
                                                                            (1, 2, s_kv, 64))]
        G.rewritten_on_cpu(mod, args)


@pytest.mark.parametrize("cond, masked", [("any", False), ("no-not", False), ("heads-axis", False),
                                          ("threshold", False), ("raw", True)])
def test_other_zeroing_conditions_stay_in_the_graph(cond, masked):
    """A where() that zeroes rows on anything but "all scores -inf" (of the scores the softmax sees,
    over the key axis) changes the result: not offloaded, and the reason says what was expected."""
    mod = G.safe_softmax_chain(cond=cond, masked=masked)
    (site,) = offload_report(mod)
    assert not site.offloaded
    assert "every score of the row is -inf" in site.reason
    assert G.composites(partition_for_cutlass(mod)) == []


class HandWritten(torch.nn.Module):
    """Attention written out by hand, nanoGPT-style: the causal mask applied with ``masked_fill`` or
    ``torch.where`` and a Python number as the fill (TVM's frontend binds it to a variable of its own)."""

    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        s_q, s_kv = q.shape[2], k.shape[2]
        scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
        keep = torch.ones(s_q, s_kv, dtype=torch.bool).tril(s_kv - s_q)
        if self.fill == "masked_fill -inf":
            scores = scores.masked_fill(~keep, float("-inf"))
        elif self.fill == "masked_fill finfo.min":
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        else:
            scores = torch.where(keep, scores, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("fill", ["masked_fill -inf", "masked_fill finfo.min", "where -inf"])
@pytest.mark.parametrize("s_q, s_kv", [(16, 16), (4, 16)])
def test_hand_written_causal_mask_with_a_number_as_the_fill_is_offloaded(fill, s_q, s_kv):
    mod, args = _import(HandWritten(fill), s_q, s_kv)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.causal, site.window) == (H, HKV, "BottomRight", None)
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    G.rewritten_on_cpu(mod, args)


class SoftmaxOverQueries(torch.nn.Module):
    """A softmax over the query axis (dim=-2) between Q K^T and V: not attention as the kernels compute it."""

    def forward(self, q, k, v):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return torch.softmax(q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5), dim=-2) @ v


def test_a_softmax_over_another_axis_is_reported_not_absent():
    mod, _ = _import(SoftmaxOverQueries(), 16, 16)
    (site,) = offload_report(mod)
    assert not site.offloaded and "softmax is over axis 2 of the 4-D scores" in site.reason, site.reason
    assert G.count_ops(partition_for_cutlass(mod), "relax.nn.softmax") == 1


class MaskAfterSoftmax(torch.nn.Module):
    """A causal mask applied to the probabilities (after the softmax), not to the scores."""

    def forward(self, q, k, v):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        p = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return torch.where(keep, p, 0.0) @ v


def test_a_mask_applied_after_the_softmax_is_reported_not_absent():
    mod, _ = _import(MaskAfterSoftmax(), 16, 16)
    (site,) = offload_report(mod)
    assert not site.offloaded and "probabilities are masked after the softmax" in site.reason, site.reason
    assert G.count_ops(partition_for_cutlass(mod), "relax.nn.softmax") == 1


def test_a_mask_applied_after_the_softmax_in_tvmscript_is_reported():
    from tvm.script import ir as I, relax as R

    @I.ir_module
    class PostMask:
        @R.function
        def main(q: R.Tensor((1, 8, 16, 32), "float16"), k: R.Tensor((1, 8, 16, 32), "float16"),
                 v: R.Tensor((1, 8, 16, 32), "float16")):
            with R.dataflow():
                m = R.tril(R.ones(R.shape([16, 16]), "bool"), 0)
                s = R.multiply(R.matmul(q, R.permute_dims(k, [0, 1, 3, 2])), R.const(0.17677669529, "float16"))
                p = R.where(m, R.nn.softmax(s, axis=-1), R.const(0.0, "float16"))
                o = R.matmul(p, v)
                R.output(o)
            return o

    (site,) = offload_report(PostMask)
    assert not site.offloaded and "masked after the softmax" in site.reason, site.reason


class ScoreScales(torch.nn.Module):
    """Scores scaled or filled in ways the kernels do not take, each with its own reason."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.t = torch.nn.Parameter(torch.linspace(0.5, 1.5, H))  # a learned per-head temperature

    def forward(self, q, k, v):
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        scores = q @ k.transpose(-2, -1)
        if self.form == "per-head scale":
            scores = scores * 0.125 * self.t.view(1, H, 1, 1)
        else:  # a -1e4 fill before the 1/sqrt(d) scale: -1768, not masked enough for the kernels
            keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
            scores = torch.where(keep, scores, torch.tensor(-1e4)) / (q.shape[-1] ** 0.5)
        return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("form, words", [
    ("per-head scale", "by a constant tensor whose values differ (a per-head or per-position scale"),
    ("fill before the scale", "fills masked scores with -10000 (-1767.77 after the scale that follows)"),
])
def test_scales_and_fills_the_kernels_do_not_take_are_named(form, words):
    mod, _ = _import(ScoreScales(form), 16, 16)
    (site,) = offload_report(mod)
    assert not site.offloaded and words in site.reason, site.reason


def test_more_queries_than_keys_names_the_lengths_as_numbers():
    mod, _ = _import(Attention(causal=True), 16, 8)
    (site,) = offload_report(mod)
    assert not site.offloaded and "(S_q 16, S_kv 8): more queries than keys" in site.reason, site.reason


class FullInfMask(torch.nn.Module):
    """SDPA with a float causal mask made as ``torch.full((s, s), -inf).triu(1)`` (TVM 0.27 cannot lower
    ``full`` with an infinite fill, so the original graph does not build on the CPU)."""

    def forward(self, q, k, v):
        s = q.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((s, s), float("-inf")).triu(1),
                                              enable_gqa=True)


def test_a_float_causal_mask_filled_with_minus_infinity_is_offloaded():
    mod, args = _import(FullInfMask(), 16, 16)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_kv_heads, site.causal, site.window) == (HKV, "BottomRight", None)
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention

    rewritten = relax.transform.DeadCodeElimination()(LegalizeGroupedAttention()(canonicalize_attention(mod)))
    got = G.run_llvm(rewritten, args)
    want = FullInfMask()(*(torch.from_numpy(a) for a in args)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


class MixedExpansions(torch.nn.Module):
    """K expanded by ``repeat_interleave`` (head h reads K/V head h // r), V by ``repeat`` (h % H_kv)."""

    def __init__(self, swap=False):
        super().__init__()
        self.swap = swap

    def forward(self, q, k, v):
        r = q.shape[1] // k.shape[1]
        by_group, tiled = k.repeat_interleave(r, dim=1), v.repeat(1, r, 1, 1)
        if self.swap:
            by_group, tiled = k.repeat(1, r, 1, 1), v.repeat_interleave(r, dim=1)
        return torch.softmax(q @ by_group.transpose(-2, -1) / (q.shape[-1] ** 0.5), dim=-1) @ tiled


@pytest.mark.parametrize("swap", [False, True])
def test_k_and_v_expanded_differently_run_as_attention_over_the_expanded_heads(swap):
    mod, args = _import(MixedExpansions(swap), 16, 16)
    (site,) = offload_report(mod)
    assert site.offloaded and site.num_kv_heads == H, site.reason
    assert "expanded differently" in site.note
    got = G.rewritten_on_cpu(mod, args)
    want = MixedExpansions(swap)(*(torch.from_numpy(a) for a in args)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


class GroupedQuery(torch.nn.Module):
    """Grouped-query attention written without expanding K/V (MLX-LM style): the query viewed as
    (B, H_kv, G, S, D), K and V given a unit group axis that the matmuls broadcast. ``mask``: None,
    ``"masked_fill"`` (a boolean causal mask filled with -inf) or ``"additive"`` (a float causal mask of
    5 dimensions added to the scores); ``outer``: the query viewed as (B, G, H_kv, S, D) and the unit axis
    in front of the K/V heads, which gives query head h the K/V head h % H_kv."""

    def __init__(self, mask=None, outer=False):
        super().__init__()
        self.mask, self.outer = mask, outer

    def forward(self, q, k, v):
        b, h, s_q, d = q.shape
        hkv, s_kv = k.shape[1], k.shape[2]
        if self.outer:
            qg, k, v = q.view(b, h // hkv, hkv, s_q, d), k.unsqueeze(1), v.unsqueeze(1)
        else:
            qg, k, v = q.view(b, hkv, h // hkv, s_q, d), k.unsqueeze(2), v.unsqueeze(2)
        scores = qg @ k.transpose(-1, -2) * d ** -0.5
        keep = torch.ones(s_q, s_kv, dtype=torch.bool).tril(s_kv - s_q)
        if self.mask == "masked_fill":
            scores = scores.masked_fill(~keep, float("-inf"))
        elif self.mask == "additive":
            scores = scores + torch.zeros(s_q, s_kv).masked_fill(~keep, float("-inf")).view(1, 1, 1, s_q, s_kv)
        return (scores.softmax(-1) @ v).reshape(b, h, s_q, d)


def _import_grouped(module, s_q, s_kv, hkv=HKV, dynamic=False):
    from tvm.relax.frontend.torch import from_exported_program

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(1, H, s_q, D, generator=gen), torch.randn(1, hkv, s_kv, D, generator=gen),
            torch.randn(1, hkv, s_kv, D, generator=gen))
    dyn = None
    if dynamic:  # the sequence length symbolic (a prefill of any length)
        seq = torch.export.Dim("seq", min=2, max=64)
        dyn = ({2: seq}, {2: seq}, {2: seq})
    ep = torch.export.export(module.eval(), args, dynamic_shapes=dyn)
    mod = relax.transform.ToMixedPrecision(out_dtype="float16")(from_exported_program(ep))
    return mod, [a.numpy() for a in args]


@pytest.mark.parametrize("hkv", [HKV, 1])
@pytest.mark.parametrize("mask, s_q, s_kv", [(None, 1, 12), (None, 16, 16), ("masked_fill", 16, 16),
                                             ("masked_fill", 4, 16), ("additive", 16, 16)])
def test_grouped_query_view_is_offloaded_with_native_kv_heads(hkv, mask, s_q, s_kv):
    """The frontend turns the 5-D matmuls into broadcast_to + 3-D batched matmuls over (B * H_kv * G): the
    query's grouping is FA2's (query head h uses K/V head h // G), so K/V reach FA2 as they are."""
    module = GroupedQuery(mask)
    mod, args = _import_grouped(module, s_q, s_kv, hkv)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (H, hkv, D, "float16")
    assert (site.expansion, site.composite) == ("repeat", "flash_attn.attention_mqa")
    assert site.causal == ("BottomRight" if mask else None)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    for op in ("relax.broadcast_to", "relax.expand_dims", "relax.repeat", "relax.matmul"):
        assert G.count_ops(out, op) == 0, op  # no copy of K/V is left, nor the chain
    got = G.rewritten_on_cpu(mod, args)
    want = module(*(torch.from_numpy(a) for a in args)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_grouped_query_view_with_a_symbolic_sequence_length():
    module = GroupedQuery("masked_fill")
    mod, args = _import_grouped(module, 16, 16, dynamic=True)
    assert relax.analysis.defined_symbolic_vars(mod["main"])
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_kv_heads, site.causal) == (HKV, "BottomRight")
    got = G.rewritten_on_cpu(mod, args)
    np.testing.assert_allclose(got, module(*(torch.from_numpy(a) for a in args)).numpy(), rtol=2e-2, atol=2e-2)


def test_grouped_query_view_baseline_repeats_kv():
    """``mqa=False``: the graph's expanded K/V are 3-D batched-matmul operands the kernels cannot read, so
    the rewrite repeats the un-expanded K/V to the query heads (plain MHA)."""
    mod, args = _import_grouped(GroupedQuery("masked_fill"), 16, 16)
    (site,) = offload_report(mod, mqa=False)
    assert site.offloaded and site.composite == "flash_attn.attention", site.reason
    assert "repeated by the rewrite" in site.note
    assert G.composites(partition_for_cutlass(mod, mqa=False)) == ["flash_attn.attention"]
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention

    got = G.run_llvm(LegalizeGroupedAttention()(canonicalize_attention(mod, mqa=False)), args)
    np.testing.assert_allclose(got, G.run_llvm(mod, args), rtol=2e-2, atol=2e-2)


def test_outer_grouped_query_view_is_not_fa2s_grouping():
    """q.view(b, G, H_kv, s, d) with k.unsqueeze(1): query head h uses K/V head h % H_kv. Not FA2's
    grouping, and the graph's expanded K/V are no operand the kernels take: left in the graph, the reason
    naming the grouping and the note why the expansion cannot be kept."""
    mod, _ = _import_grouped(GroupedQuery("masked_fill", outer=True), 16, 16)
    for mqa in (True, False):
        (site,) = offload_report(mod, mqa=mqa)
        assert not site.offloaded
        assert "outer factor of the heads" in site.reason and "h % H_kv" in site.reason, site.reason
        assert "K reaches attention with axes (batch*heads, head dim, sequence)" in site.note, site.note
        assert "R.reshape of a (1, 4, 2, 32, 16) tensor to (8, 32, 16)" in site.note, site.note
        assert G.composites(partition_for_cutlass(mod, mqa=mqa)) == []


def test_outer_grouped_query_view_with_one_kv_head_is_offloaded():
    """With one K/V head both groupings are the same."""
    module = GroupedQuery("masked_fill", outer=True)
    mod, args = _import_grouped(module, 16, 16, hkv=1)
    (site,) = offload_report(mod)
    assert site.offloaded and site.num_kv_heads == 1, site.reason
    got = G.rewritten_on_cpu(mod, args)
    np.testing.assert_allclose(got, module(*(torch.from_numpy(a) for a in args)).numpy(), rtol=2e-2, atol=2e-2)
