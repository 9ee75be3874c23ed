"""A softmax scale the kernels cannot take: FA2, FA4 and our decode kernel take the running max of the
unscaled scores, the max of the scaled ones only for a positive scale. A negative, zero or non-finite
scale (an attention attribute, a constant multiplied into the scores or into the query) stays on TVM
with the reason in ``offload_report``; the same graphs with a positive scale are offloaded."""

from __future__ import annotations

import numpy as np
import pytest

import mqa_byoc
from mqa_byoc.testing import graphs as G

BAD = [-0.125, 0.0, float("inf")]


def _assert_kept(mod, scale):
    (site,) = mqa_byoc.offload_report(mod)
    assert not site.offloaded and f"softmax scale {scale!r}" in site.reason, site.reason
    assert G.composites(mqa_byoc.partition_for_cutlass(mod)) == []


@pytest.mark.parametrize("scale", BAD)
def test_attention_attribute(scale):
    _assert_kept(G.attention_repeat_bsnh(h=8, hkv=2, s=16, scale=scale), scale)


@pytest.mark.parametrize("scale", [-0.125, -1.0])
def test_constant_in_the_scores(scale):
    _assert_kept(G.upstream_3d_chain(h=8, hkv=2, scale=scale), scale)
    _assert_kept(G.bsh_chain(scale=scale), scale)


@pytest.mark.parametrize("make", [lambda s: G.attention_repeat_bsnh(h=8, hkv=2, s=16, scale=s),
                                  lambda s: G.upstream_3d_chain(h=8, hkv=2, scale=s),
                                  lambda s: G.bsh_chain(scale=s)])
def test_positive_scale_still_offloaded(make):
    (site,) = mqa_byoc.offload_report(make(0.1))
    assert site.offloaded, site.reason
    assert site.scale == pytest.approx(0.1, rel=1e-2)


@pytest.mark.parametrize("factor", [-1.0, 0.5])
def test_constant_multiplied_into_a_query_operand(factor):
    """``R.nn.attention(q * c, ...)``: a positive constant is folded into the kernel's scale, a negative one
    stays in the graph (the kernel's scale the attribute's); both offloaded, the rewrite checked on the CPU."""
    from tvm import relax
    from tvm.relax import op as R

    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 16, 8, 64], "float16"))
    k = relax.Var("k", relax.TensorType([1, 16, 2, 64], "float16"))
    v = relax.Var("v", relax.TensorType([1, 16, 2, 64], "float16"))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            qs = bb.emit(R.multiply(q, relax.const(factor, "float16")))
            kk, vv = bb.emit(R.repeat(k, 4, axis=2)), bb.emit(R.repeat(v, 4, axis=2))
            o = bb.emit_output(R.nn.attention(qs, kk, vv, causal_mask="BottomRight"))
        bb.emit_func_output(o)
    mod = bb.get()
    (site,) = mqa_byoc.offload_report(mod)
    part = mqa_byoc.partition_for_cutlass(mod)
    assert site.offloaded and G.composites(part) == ["flash_attn.attention_mqa"], site.reason
    if factor > 0:  # folded into the kernel's scale
        assert site.scale == pytest.approx(factor / 8) and G.count_ops(part, "relax.multiply") == 0
    else:  # kept in the graph: the kernel's scale stays 1 / sqrt(D)
        assert site.scale == pytest.approx(1 / 8) and G.count_ops(part, "relax.multiply") == 1
    args = [np.random.default_rng(i).standard_normal(shape).astype("float16")
            for i, shape in enumerate(([1, 16, 8, 64], [1, 16, 2, 64], [1, 16, 2, 64]))]
    G.rewritten_on_cpu(mod, args)
