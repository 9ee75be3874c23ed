"""Attention imported with TVM's ONNX frontend (``relax.frontend.onnx.from_onnx``): the op sequence an
exporter writes for a decoder's grouped-query attention with static shapes — ``Unsqueeze`` → ``Expand``
(5-D) → ``Reshape`` for HF's ``repeat_kv`` (or one ``Expand`` of a single K/V head), ``Transpose`` of K,
``MatMul``, ``Div`` by √d, an additive causal mask, ``Softmax``, ``MatMul`` — built here with
``onnx.helper`` (no exporter needed). The frontend turns them into form 4's ops (expand_dims,
broadcast_to, reshape, 4-D matmuls), which the partition traces back to the un-expanded K/V.

Dynamic axes are not covered: TVM 0.27's ONNX importer itself fails on the ``Reshape`` whose shape an
exporter computes from ``Shape``/``Gather``/``Concat`` (it needs a shape, gets a tensor)."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend.onnx import from_onnx  # noqa: E402

import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402

H, D = 8, 32


def gqa_model(hkv=2, b=1, s_q=16, s_kv=16, dtype="float16", causal=True, unsqueeze=True):
    """q (b, H, s_q, D), k/v (b, hkv, s_kv, D) in, attention out (b, H, s_q, D), as an exporter writes it.
    ``unsqueeze=False`` with hkv == 1: one ``Expand`` of the size-1 head axis (MQA)."""
    et = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[dtype]
    r = H // hkv
    io = [helper.make_tensor_value_info(n, et, [b, h, s, D]) for n, h, s in (("q", H, s_q), ("k", hkv, s_kv),
                                                                              ("v", hkv, s_kv))]
    inits = [numpy_helper.from_array(np.array(a, np.int64), n) for n, a in (
        ("axis2", [2]), ("shape5", [b, hkv, r, s_kv, D]), ("shape4", [b, H, s_kv, D]))]
    inits.append(numpy_helper.from_array(np.array(np.sqrt(D), dtype), "sqrt_d"))
    nodes = []
    for x in ("k", "v"):
        if unsqueeze:
            nodes += [helper.make_node("Unsqueeze", [x, "axis2"], [x + "5"]),
                      helper.make_node("Expand", [x + "5", "shape5"], [x + "e"]),
                      helper.make_node("Reshape", [x + "e", "shape4"], [x + "h"])]
        else:
            nodes.append(helper.make_node("Expand", [x, "shape4"], [x + "h"]))
    nodes += [helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["scores"]),
              helper.make_node("Div", ["scores", "sqrt_d"], ["scaled"])]
    logits = "scaled"
    if causal:  # bottom-right: query i is position s_kv - s_q + i
        lowest = np.finfo(np.float16).min
        mask = np.where(np.arange(s_kv)[None, :] > np.arange(s_q)[:, None] + s_kv - s_q, lowest, 0)
        inits.append(numpy_helper.from_array(mask.astype(dtype).reshape(1, 1, s_q, s_kv), "mask"))
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
        logits = "masked"
    nodes += [helper.make_node("Softmax", [logits], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "vh"], ["out"])]
    graph = helper.make_graph(nodes, "gqa_attention", io, [helper.make_tensor_value_info("out", et, [b, H, s_q, D])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return from_onnx(model, keep_params_in_input=False)


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
