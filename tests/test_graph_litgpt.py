"""litgpt's causal self-attention in a user's module (torch.export, plain ``from_exported_program``,
``ToMixedPrecision``): one fused projection viewed as (B, T, groups, q_per_kv + 2, hs), the query heads and
their K and V split per group, K/V ``expand``-ed over the group's query heads and reshaped to (B, H, T, hs),
then SDPA (``is_causal``) or the manual chain. GQA and MQA are offloaded with the native K/V heads and give
the module's output."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

HEADS, HEAD_SIZE = 8, 32


class LitGPTAttention(torch.nn.Module):
    def __init__(self, groups, manual):
        super().__init__()
        self.groups, self.manual = groups, manual
        self.attn = torch.nn.Linear(HEADS * HEAD_SIZE, (HEADS + 2 * groups) * HEAD_SIZE, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q_per_kv = HEADS // self.groups
        qkv = self.attn(x).view(b, t, self.groups, q_per_kv + 2, HEAD_SIZE).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        if self.groups != HEADS:
            k = k.expand(b, self.groups, q_per_kv, t, HEAD_SIZE)
            v = v.expand(b, self.groups, q_per_kv, t, HEAD_SIZE)
        q, k, v = (y.reshape(b, -1, t, HEAD_SIZE) for y in (q, k, v))
        if self.manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HEAD_SIZE))
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).tril().logical_not(), float("-inf"))
            y = att.softmax(-1) @ v
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, c)


@pytest.mark.parametrize("groups, manual", [(2, False), (1, False), (2, True)])
def test_litgpt_attention_is_offloaded_with_native_kv_heads(groups, manual):
    torch.manual_seed(0)
    model = LitGPTAttention(groups, manual).eval()
    x = torch.randn(2, 12, HEADS * HEAD_SIZE)
    mod = G.import_torch(model, (x,))
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.causal) == (HEADS, groups, HEAD_SIZE, "BottomRight")
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    assert G.count_ops(out, "relax.broadcast_to") == 0
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(G.rewritten_on_cpu(mod, [x.numpy()]), want, rtol=2e-2, atol=2e-2)
