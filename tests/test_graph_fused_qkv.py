"""K/V that reach their expansion through an op the trace does not pass, with the unit axis the
broadcast grows already in place: Falcon's fused ``qkv`` viewed as (B, S, H_kv, r + 2, D) and indexed
with a list (``qkv[:, :, :, [-2]]``, a ``take``: (B, S, H_kv, 1, D)), then ``broadcast_to`` (B, S, H_kv, r,
D) and ``reshape`` to the query heads. The partition uses that view without its unit axis as the K/V
(a ``reshape``), so the expansion goes; the h // r grouping is the kernels'."""

import numpy as np
import pytest
from tvm import relax
from tvm.relax import op as R

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass

HKV, R_, D = 2, 4, 32
H = HKV * R_


def falcon_fused_qkv(b=1, s=16, causal="BottomRight", k_via="take"):
    """q, k, v from one (B, S, H_kv, r + 2, D) tensor; ``k_via``: "take" (list index, as torch exports
    ``qkv[..., [-2], :]``) or "strided_slice" (``qkv[..., -2:-1, :]``)."""
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType([b, s, HKV, R_ + 2, D], "float16"))
    with bb.function("main", [qkv]):
        with bb.dataflow():
            q = bb.emit(R.reshape(bb.emit(R.strided_slice(qkv, axes=[3], begin=[0], end=[R_])), [b, s, H, D]))

            def kv(pos):
                if k_via == "take":
                    x = bb.emit(R.take(qkv, relax.const(np.array([pos], "int64")), axis=3))
                else:
                    x = bb.emit(R.strided_slice(qkv, axes=[3], begin=[pos], end=[pos + 1]))
                x = bb.emit(R.broadcast_to(x, [b, s, HKV, R_, D]))
                return bb.emit(R.reshape(x, [b, s, H, D]))

            out = bb.emit_output(R.nn.attention(q, kv(R_), kv(R_ + 1), causal_mask=causal))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("k_via", ["take", "strided_slice"])
@pytest.mark.parametrize("causal", ["BottomRight", None])
def test_unit_axis_view_is_the_kv(k_via, causal):
    mod = falcon_fused_qkv(b=2, s=12, causal=causal, k_via=k_via)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.expansion) == (H, HKV, "repeat")
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"] and G.count_ops(out, "relax.broadcast_to") == 0
    rng = np.random.default_rng(0)
    G.rewritten_on_cpu(mod, [rng.standard_normal((2, 12, HKV, R_ + 2, D)).astype("float16")])


def test_builds_for_sm90():
    """The rewritten site builds for CUDA (the python provider: no kernel objects needed here), its FA2
    call on H_kv heads: the reshape of the view is part of the graph TVM compiles."""
    import mqa_byoc

    text = mqa_byoc.build(falcon_fused_qkv(b=1, s=64), {"kind": "cuda", "arch": "sm_90"},
                          provider="python").as_text()
    assert "flash_attn" in text and "broadcast_to" not in text
