"""Attention written with TVM's own ``relax.frontend.nn`` (``nn.Module`` + ``export_tvm``), the way
mlc-llm-style model code and TVM's tutorials write it: ``nn.op.scaled_dot_product_attention`` (which emits
``R.nn.attention`` with a ``TopLeft`` causal mask) on K/V with fewer heads, or on K/V the user expanded with
``op.repeat`` or with ``op.reshape`` (a unit axis) -> ``op.broadcast_to`` -> ``op.reshape``."""

import numpy as np
import pytest

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op, spec

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass

H, HKV, D = 8, 2, 32
R = H // HKV


def _expand(x, how):
    """K/V of shape (b, s, HKV, D) expanded to H heads; ``how`` picks the spelling and the grouping."""
    b, s = x.shape[0], x.shape[1]
    if how == "none":
        return x
    if how == "repeat":  # repeat_interleave: query head h reads K/V head h // R
        return op.repeat(x, R, axis=2)
    if how == "reshape-broadcast":  # the same grouping, the unit axis added by a reshape
        x = op.broadcast_to(op.reshape(x, [b, s, HKV, 1, D]), [b, s, HKV, R, D])
    elif how == "reshape-broadcast-outer":  # the unit axis before the heads: h % HKV (torch's .repeat)
        x = op.broadcast_to(op.reshape(x, [b, s, 1, HKV, D]), [b, s, R, HKV, D])
    return op.reshape(x, [b, s, H, D])


class Attention(nn.Module):
    def __init__(self, how, causal):
        self.how, self.causal = how, causal

    def forward(self, q, k, v):
        return op.scaled_dot_product_attention(q, _expand(k, self.how), _expand(v, self.how), is_causal=self.causal)


def _export(how, causal, s_q="s", s_kv="s"):
    mod, _ = Attention(how, causal).export_tvm(spec={"forward": {
        "q": spec.Tensor(["b", s_q, H, D], "float16"),
        "k": spec.Tensor(["b", s_kv, HKV, D], "float16"),
        "v": spec.Tensor(["b", s_kv, HKV, D], "float16")}})
    return mod


def _args(b, s_q, s_kv, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, n, h, D)).astype("float16") for n, h in ((s_q, H), (s_kv, HKV), (s_kv, HKV))]


@pytest.mark.parametrize("how", ["none", "repeat", "reshape-broadcast"])
@pytest.mark.parametrize("causal", [False, True])
def test_offloaded_with_native_kv_heads(how, causal):
    mod = _export(how, causal)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.causal) == (H, HKV, "TopLeft" if causal else None)
    assert site.expansion == (None if how == "none" else "repeat")
    out = partition_for_cutlass(mod, mqa=True)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    for name in ("relax.repeat", "relax.broadcast_to"):
        assert G.count_ops(out, name, "forward") == 0, name
    # the rewrite (un-expanded K/V, h // R grouping) computes what attention over K/V expanded by
    # op.repeat computes (TVM's own lowering of R.nn.attention with fewer K/V heads groups them wrongly,
    # so the unexpanded graph is not its own reference)
    args = _args(2, 7, 7)
    want = G.run_llvm(_export("repeat", causal), args, "forward")
    if how == "none":
        from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
        from mqa_byoc.compiler.partition import canonicalize_attention

        got = G.run_llvm(LegalizeGroupedAttention()(canonicalize_attention(mod)), args, "forward")
    else:
        got = G.rewritten_on_cpu(mod, args, function="forward")
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_outer_broadcast_is_the_tile_grouping():
    """A unit axis in front of the heads groups query head h with K/V head h % HKV, not the kernels'
    h // R: the site is offloaded as attention over the expanded heads, the expansion kept and the note
    saying why, never with the wrong grouping."""
    mod = _export("reshape-broadcast-outer", causal=True)
    (site,) = offload_report(mod)
    assert site.offloaded and site.num_kv_heads == H and site.expansion is None
    assert "h % H_kv" in site.note
    out = partition_for_cutlass(mod, mqa=True)
    assert G.composites(out) == ["flash_attn.attention"]
    assert G.count_ops(out, "relax.broadcast_to", "forward") == 2
    G.rewritten_on_cpu(mod, _args(1, 5, 5), function="forward")


def test_decode_with_top_left_causal_mask_stays_in_the_graph():
    """``is_causal=True`` emits a top-left mask: with one query row it lets the row see key 0 only,
    which the kernels (bottom-right) do not compute; the site says so. Without the mask: offloaded."""
    (site,) = offload_report(_export("repeat", causal=True, s_q=1, s_kv="n"))
    assert not site.offloaded and "TopLeft" in site.reason and "is_causal=False" in site.reason
    (site,) = offload_report(_export("repeat", causal=False, s_q=1, s_kv="n"))
    assert site.offloaded and site.num_kv_heads == HKV
    G.rewritten_on_cpu(_export("repeat", causal=False, s_q=1, s_kv="n"), _args(2, 1, 9), function="forward")
