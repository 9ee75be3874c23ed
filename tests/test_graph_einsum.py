"""Attention written with ``torch.einsum``, exported with ``torch.export`` and imported with plain
``from_exported_program``, then ``ToMixedPrecision``.

torch decomposes each einsum into a batched matmul whose operands and result pass through chains of
``expand_dims`` / ``permute_dims`` / ``reshape`` moving size-1 axes about. The partition collapses each
chain to the reshape (or transpose and reshape) it amounts to (``graph/views.py``), so these sites are
offloaded like the matmul forms; the chains that move elements otherwise are left as they are."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tvm  # noqa: E402
from tvm.script import ir as I, relax as R  # noqa: E402

from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.compiler.graph.views import CollapseViewChains, collapsed_view  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

H, HKV, D = 8, 2, 32


class EinsumAttention(torch.nn.Module):
    """``layout`` "bhsd": Q/K/V (B, H, S, D), "bshd": (B, S, H, D), "ellipsis": (B, H, S, D) with ``...``;
    K/V repeated to the query heads by the user; an optional causal mask filled with -inf."""

    def __init__(self, layout, causal):
        super().__init__()
        self.layout, self.causal = layout, causal

    def forward(self, q, k, v):
        head_axis = 2 if self.layout == "bshd" else 1
        k, v = (x.repeat_interleave(H // HKV, dim=head_axis) for x in (k, v))
        scores = torch.einsum({"bhsd": "bhqd,bhkd->bhqk", "ellipsis": "...qd,...kd->...qk",
                               "bshd": "bqhd,bkhd->bhqk"}[self.layout], q, k) * D ** -0.5
        if self.causal:
            s_q, s_kv = scores.shape[-2], scores.shape[-1]
            keep = torch.ones(s_q, s_kv, dtype=torch.bool).tril(s_kv - s_q)
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = scores.softmax(-1)
        return torch.einsum({"bhsd": "bhqk,bhkd->bhqd", "ellipsis": "...qk,...kd->...qd",
                             "bshd": "bhqk,bkhd->bqhd"}[self.layout], probs, v)


def _args(layout, b, s_q, s_kv):
    gen = torch.Generator().manual_seed(0)
    shape = (lambda s, h: (b, s, h, D)) if layout == "bshd" else (lambda s, h: (b, h, s, D))
    return (torch.randn(*shape(s_q, H), generator=gen), torch.randn(*shape(s_kv, HKV), generator=gen),
            torch.randn(*shape(s_kv, HKV), generator=gen))


def _import(module, args, dynamic_shapes=None):
    return G.import_torch(module, args, dynamic_shapes=dynamic_shapes)


@pytest.mark.parametrize("layout", ["bhsd", "ellipsis", "bshd"])
@pytest.mark.parametrize("causal, b, s_q, s_kv", [
    (False, 1, 1, 12),  # decode: batch 1 and one query, both size-1 axes torch's decomposition moves about
    (True, 2, 12, 12),  # prefill
    (True, 2, 4, 12),  # a chunk after a cached prefix, the mask aligned to the end
])
def test_einsum_attention_is_offloaded_with_native_kv_heads(layout, causal, b, s_q, s_kv):
    args = _args(layout, b, s_q, s_kv)
    mod = _import(EinsumAttention(layout, causal), args)
    assert G.count_ops(mod, "relax.expand_dims") > 2  # the decomposition's plumbing is in the graph
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (H, HKV, D, "float16")
    assert site.expansion == "repeat" and site.causal == ("BottomRight" if causal else None)
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    assert G.composites(partition_for_cutlass(mod)) == ["flash_attn.attention_mqa"]
    got = G.rewritten_on_cpu(mod, [a.numpy() for a in args])
    np.testing.assert_allclose(got, EinsumAttention(layout, causal)(*args).numpy(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_einsum_attention_with_symbolic_batch_and_length(layout):
    batch, seq = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=2, max=64)
    seq_axis = 1 if layout == "bshd" else 2
    mod = _import(EinsumAttention(layout, True), _args(layout, 2, 12, 12),
                  dynamic_shapes=tuple({0: batch, seq_axis: seq} for _ in range(3)))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_kv_heads, site.causal) == (HKV, "BottomRight")
    assert G.composites(partition_for_cutlass(mod)) == ["flash_attn.attention_mqa"]


def test_a_chain_that_moves_size_one_axes_is_a_transpose():
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 8, 4, 32), "float16")):
            with R.dataflow():
                a = R.expand_dims(x, axis=[4])  # (2, 8, 4, 32, 1)
                b = R.permute_dims(a, axes=[1, 4, 0, 2, 3])  # (8, 1, 2, 4, 32)
                c = R.permute_dims(b, axes=[2, 0, 1, 4, 3])  # (2, 8, 1, 32, 4)
                y = R.reshape(c, R.shape([16, 32, 4]))
                R.output(y)
            return y

    source = Mod["main"].params[0]
    steps = [b.value for b in Mod["main"].body.blocks[0].bindings]
    assert collapsed_view(source, steps) == [0, 1, 3, 2]
    # the chain only feeds the function's result (no matmul or softmax): it is left alone
    tvm.ir.assert_structural_equal(CollapseViewChains()(Mod), Mod)


def test_a_chain_that_reorders_the_parts_of_an_axis_is_no_view():
    """(16, 4) -> (2, 8, 4) -> (8, 2, 4) -> (16, 4) shuffles the rows: not a transpose of the source."""
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((16, 4), "float16"), w: R.Tensor((4, 4), "float16")):
            with R.dataflow():
                a = R.reshape(x, R.shape([2, 8, 4]))
                b = R.permute_dims(a, axes=[1, 0, 2])
                c = R.reshape(b, R.shape([16, 4]))
                y = R.matmul(c, w)
                R.output(y)
            return y

    func = Mod["main"]
    steps = [b.value for b in func.body.blocks[0].bindings][:3]
    assert collapsed_view(func.params[0], steps) is False
    tvm.ir.assert_structural_equal(CollapseViewChains()(Mod), Mod)


def test_collapsed_chains_compute_what_the_chains_do():
    """An einsum's operand chains collapsed on the CPU: the same values as before."""
    args = _args("bshd", 2, 4, 12)
    mod = _import(EinsumAttention("bshd", True), args)
    collapsed = CollapseViewChains()(mod)
    assert G.count_ops(collapsed, "relax.expand_dims") < G.count_ops(mod, "relax.expand_dims")
    ins = [a.numpy() for a in args]
    np.testing.assert_allclose(G.run_llvm(collapsed, ins), G.run_llvm(mod, ins), rtol=1e-3, atol=1e-3)


class FoldedHeadsAttention(torch.nn.Module):
    """K/V shared by query heads without a head axis of their own, the heads folded into the einsum's rows:
    "mqa": PaLM-style multi-query, Q (B, H, S, D) against K/V (B, S, D) (``"bhid,bjd->bhij"``); "grouped": Q
    (B, H_kv, G, S, D) against K/V (B, H_kv, S, D) (``"bkgqd,bksd->bkgqs"``, the output kept 5-D)."""

    def __init__(self, form, causal):
        super().__init__()
        self.form, self.causal = form, causal

    def forward(self, q, k, v):
        mqa = self.form == "mqa"
        scores = torch.einsum("bhid,bjd->bhij" if mqa else "bkgqd,bksd->bkgqs", q, k) * D ** -0.5
        if self.causal:
            s_q, s_kv = scores.shape[-2], scores.shape[-1]
            keep = torch.ones(s_q, s_kv, dtype=torch.bool).tril(s_kv - s_q)
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.einsum("bhij,bjd->bhid" if mqa else "bkgqs,bksd->bkgqd", scores.softmax(-1), v)


def _folded_args(form, b, s_q, s_kv):
    gen = torch.Generator().manual_seed(0)
    if form == "mqa":
        shapes = [(b, H, s_q, D), (b, s_kv, D), (b, s_kv, D)]
    else:
        shapes = [(b, HKV, H // HKV, s_q, D), (b, HKV, s_kv, D), (b, HKV, s_kv, D)]
    return tuple(torch.randn(*shape, generator=gen) for shape in shapes)


@pytest.mark.parametrize("form, kv_heads", [("mqa", 1), ("grouped", HKV)])
@pytest.mark.parametrize("causal, b, s_q, s_kv", [(True, 2, 12, 12), (True, 1, 4, 12), (False, 1, 1, 12)])
def test_heads_folded_into_the_rows_are_offloaded_with_native_kv_heads(form, kv_heads, causal, b, s_q, s_kv):
    """The einsum reads Q as (B, H*S, D) (or (B*H_kv, G*S, D)) against one K per batch (and K/V head); the
    partition unfolds the rows to Q's axes against K with a unit head (group) axis: no K/V expansion at all."""
    args = _folded_args(form, b, s_q, s_kv)
    mod = _import(FoldedHeadsAttention(form, causal), args)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (H, kv_heads, D)
    assert site.causal == ("BottomRight" if causal else None)
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    # K/V reach the kernel through reshapes (views in the VM): no copy of them is left outside it
    assert [G.count_ops(out, op) for op in ("relax.expand_dims", "relax.repeat", "relax.broadcast_to")] == [0, 0, 0]
    got = G.rewritten_on_cpu(mod, [a.numpy() for a in args])
    np.testing.assert_allclose(got, FoldedHeadsAttention(form, causal)(*args).numpy(), rtol=2e-2, atol=2e-2)


def test_folded_heads_with_mqa_false_run_on_expanded_kv():
    args = _folded_args("mqa", 2, 12, 12)
    mod = _import(FoldedHeadsAttention("mqa", True), args)
    (site,) = offload_report(mod, mqa=False)
    assert site.offloaded, site.reason
    out = partition_for_cutlass(mod, mqa=False)
    assert G.composites(out) == ["flash_attn.attention"]


def test_unfolding_computes_what_the_folded_matmuls_do():
    from mqa_byoc.compiler.graph.views import UnfoldMatmulRows

    for form in ("mqa", "grouped"):
        args = _folded_args(form, 2, 12, 12)
        mod = _import(FoldedHeadsAttention(form, True), args)
        collapsed = CollapseViewChains()(mod)
        unfolded = UnfoldMatmulRows()(collapsed)
        assert G.count_ops(unfolded, "relax.reshape") < G.count_ops(collapsed, "relax.reshape"), form
        ins = [a.numpy() for a in args]
        np.testing.assert_allclose(G.run_llvm(unfolded, ins), G.run_llvm(mod, ins), rtol=1e-4, atol=1e-4)


def test_a_folded_batched_gemm_is_left_alone():
    """The same folded shape with no softmax before or after it (a batched GEMM): not touched."""
    from mqa_byoc.compiler.graph.views import UnfoldMatmulRows

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 8, 16, 32), "float16"), w: R.Tensor((2, 32, 64), "float16")):
            with R.dataflow():
                a = R.reshape(x, R.shape([2, 128, 32]))
                y = R.matmul(a, w)
                z = R.reshape(y, R.shape([2, 8, 16, 64]))
                R.output(z)
            return z

    tvm.ir.assert_structural_equal(UnfoldMatmulRows()(Mod), Mod)
