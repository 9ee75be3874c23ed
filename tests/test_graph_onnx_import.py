"""Attention imported with TVM's ONNX frontend (``relax.frontend.onnx.from_onnx``): the op sequence an
exporter writes for a decoder's grouped-query attention with static shapes — ``Unsqueeze`` → ``Expand``
(5-D) → ``Reshape`` for HF's ``repeat_kv`` (or one ``Expand`` of a single K/V head), ``Transpose`` of K,
``MatMul``, ``Div`` by √d, an additive causal mask, ``Softmax``, ``MatMul`` — built with ``onnx.helper``
(``graphs.onnx_gqa_chain``; no exporter needed). The frontend turns them into form 4's ops (expand_dims,
broadcast_to, reshape, 4-D matmuls), which the partition traces back to the un-expanded K/V.

Dynamic axes are not covered: TVM 0.27's ONNX importer itself fails on the ``Reshape`` whose shape an
exporter computes from ``Shape``/``Gather``/``Concat`` (it needs a shape, gets a tensor)."""

import numpy as np
import pytest

pytest.importorskip("onnx")

from tvm import relax  # noqa: E402

from mqa_byoc.testing import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402

H, D = 8, 32


def gqa_model(hkv=2, b=1, s_q=16, s_kv=16, dtype="float16", causal=True, unsqueeze=True):
    return G.onnx_gqa_chain(H, hkv, D, b, s_q, s_kv, dtype=dtype, causal=causal, unsqueeze=unsqueeze)


def _args(hkv, b, s_q, s_kv, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, h, n, D)).astype("float16") for h, n in ((H, s_q), (hkv, s_kv), (hkv, s_kv))]


@pytest.mark.parametrize("hkv,b,s_q,s_kv,causal,unsqueeze", [
    (2, 1, 16, 16, True, True),   # prefill
    (4, 2, 8, 24, True, True),    # a chunk after a cache (bottom-right mask)
    (2, 2, 1, 40, False, True),   # decode
    (1, 1, 16, 16, True, False),  # MQA: one Expand of the size-1 head axis
])
def test_exported_gqa_offloaded_with_native_kv_heads(hkv, b, s_q, s_kv, causal, unsqueeze):
    mod = gqa_model(hkv, b, s_q, s_kv, causal=causal, unsqueeze=unsqueeze)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads) == (H, hkv)
    assert site.causal == ("BottomRight" if causal else None)
    assert site.scale == pytest.approx(1 / np.sqrt(D), rel=1e-3)
    out = partition_for_cutlass(mod, mqa=True)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    for op in ("relax.broadcast_to", "relax.softmax"):
        assert G.count_ops(out, op) == 0, op
    G.rewritten_on_cpu(mod, _args(hkv, b, s_q, s_kv))


def test_float32_export_is_rejected_until_mixed_precision():
    """An fp32 export stays in the graph with the reason naming the fix; after ToMixedPrecision it is
    offloaded."""
    mod = gqa_model(dtype="float32")
    (site,) = offload_report(mod)
    assert not site.offloaded and "ToMixedPrecision" in site.reason
    (site,) = offload_report(relax.transform.ToMixedPrecision(out_dtype="float16")(mod))
    assert site.offloaded and site.num_kv_heads == 2
