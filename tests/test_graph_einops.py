"""Attention written with einops (``rearrange`` / ``repeat``, as many research codebases write it) in a user's
module, exported with ``torch.export``, imported with plain ``from_exported_program`` and cast by
``ToMixedPrecision``: the head split of a projection's output by ``rearrange``, K/V repeated by
``repeat(t, "b h s d -> b (h g) s d")`` before SDPA or an einsum, and grouped-query attention that never
expands K/V (the query rearranged to (B, H_kv, G, S, D), ``"bhgid,bhjd->bhgij"``). Every form is offloaded
with the native K/V heads and gives the module's output."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
einops = pytest.importorskip("einops")

from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

H, HKV, D = 8, 2, 32


class EinopsAttention(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.wq = torch.nn.Linear(H * D, H * D, bias=False)
        self.wkv = torch.nn.Linear(H * D, 2 * HKV * D, bias=False)

    def forward(self, x):
        from einops import rearrange, repeat

        q = rearrange(self.wq(x), "b s (h d) -> b h s d", h=H)
        k, v = rearrange(self.wkv(x), "b s (two h d) -> two b h s d", two=2, h=HKV)
        if self.form == "grouped":  # K/V never expanded: the query's heads grouped under theirs
            q = rearrange(q, "b (h g) s d -> b h g s d", g=H // HKV)
            s = torch.einsum("bhgid,bhjd->bhgij", q, k) * D ** -0.5
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            o = rearrange(torch.einsum("bhgij,bhjd->bhgid", s.softmax(-1), v), "b h g s d -> b (h g) s d")
        else:
            k, v = (repeat(t, "b h s d -> b (h g) s d", g=H // HKV) for t in (k, v))
            if self.form == "sdpa":
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = torch.einsum("bhid,bhjd->bhij", q, k) * D ** -0.5
                s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
                o = torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)
        return rearrange(o, "b h s d -> b s (h d)")


@pytest.mark.parametrize("form", ["sdpa", "einsum", "grouped"])
def test_einops_attention_is_offloaded_with_native_kv_heads(form):
    torch.manual_seed(0)
    model = EinopsAttention(form).eval()
    x = torch.randn(2, 12, H * D)
    mod = G.import_torch(model, (x,))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.causal) == (H, HKV, D, "BottomRight")
    assert site.scale == pytest.approx(D ** -0.5, rel=1e-3)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    assert [G.count_ops(out, op) for op in ("relax.repeat", "relax.broadcast_to", "relax.expand_dims")] == [0, 0, 0]
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(G.rewritten_on_cpu(mod, [x.numpy()]), want, rtol=2e-2, atol=2e-2)
