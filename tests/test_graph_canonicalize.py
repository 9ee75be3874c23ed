"""CanonicalizeAttention on the main graph forms: Before -> Expected, like TVM's own transform tests.

Shapes are tiny (H = 4 query heads over H_kv = 2 K/V heads, S = 4, D = 64); the numerics of the
same rewrites are checked in test_graph_rewrite_numerics.py."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from mqa_byoc import CanonicalizeAttention

F16 = "float16"


def _check(before, expected, mqa=True):
    after = CanonicalizeAttention(mqa=mqa)(before)
    tvm.ir.assert_structural_equal(after, expected)
    # idempotent: nothing left to rewrite
    tvm.ir.assert_structural_equal(CanonicalizeAttention(mqa=mqa)(after), expected)


def test_attention_on_repeat_bsnh():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 4, 2, 64), F16), v: R.Tensor((1, 4, 2, 64), F16)):
            with R.dataflow():
                kk = R.repeat(k, repeats=2, axis=2)
                vv = R.repeat(v, repeats=2, axis=2)
                o = R.nn.attention(q, kk, vv, causal_mask="BottomRight")
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 4, 2, 64), F16), v: R.Tensor((1, 4, 2, 64), F16)):
            with R.dataflow():
                o = R.nn.attention(q, k, v, causal_mask="BottomRight")
                R.output(o)
            return o

    _check(Before, Expected)


def test_attention_on_repeat_bsnh_baseline_keeps_expansion():
    """mqa=False: the site is offloadable as plain MHA, K/V stay repeated to the query heads."""

    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 4, 2, 64), F16), v: R.Tensor((1, 4, 2, 64), F16)):
            with R.dataflow():
                o = R.nn.attention(q, k, v)
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 4, 2, 64), F16), v: R.Tensor((1, 4, 2, 64), F16)):
            with R.dataflow():
                kk = R.repeat(k, repeats=2, axis=2)
                vv = R.repeat(v, repeats=2, axis=2)
                o = R.nn.attention(q, kk, vv)
                R.output(o)
            return o

    _check(Before, Expected, mqa=False)


def test_attention_on_repeat_bnsh():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 2, 4, 64), F16), v: R.Tensor((1, 2, 4, 64), F16)):
            with R.dataflow():
                kk = R.repeat(k, repeats=2, axis=1)
                vv = R.repeat(v, repeats=2, axis=1)
                qt = R.permute_dims(q, axes=[0, 2, 1, 3])
                kt = R.permute_dims(kk, axes=[0, 2, 1, 3])
                vt = R.permute_dims(vv, axes=[0, 2, 1, 3])
                o = R.nn.attention(qt, kt, vt, causal_mask="BottomRight")
                ot = R.permute_dims(o, axes=[0, 2, 1, 3])
                R.output(ot)
            return ot

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 2, 4, 64), F16), v: R.Tensor((1, 2, 4, 64), F16)):
            with R.dataflow():
                qt = R.permute_dims(q, axes=[0, 2, 1, 3])
                kt = R.permute_dims(k, axes=[0, 2, 1, 3])
                vt = R.permute_dims(v, axes=[0, 2, 1, 3])
                o = R.nn.attention(qt, kt, vt, causal_mask="BottomRight")
                ot = R.permute_dims(o, axes=[0, 2, 1, 3])
                R.output(ot)
            return ot

    _check(Before, Expected)


def test_upstream_3d_chain():
    """TVM's own attention rewrite pattern with K/V repeat: 3-D batched matmuls, scale astype'd."""

    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 4, 2, 64), F16), v: R.Tensor((1, 4, 2, 64), F16)):
            with R.dataflow():
                q3 = R.reshape(R.permute_dims(q, axes=[0, 2, 1, 3]), R.shape([4, 4, 64]))
                k3 = R.reshape(R.permute_dims(R.repeat(k, repeats=2, axis=2), axes=[0, 2, 1, 3]), R.shape([4, 4, 64]))
                v3 = R.reshape(R.permute_dims(R.repeat(v, repeats=2, axis=2), axes=[0, 2, 1, 3]), R.shape([4, 4, 64]))
                s = R.matmul(q3, R.permute_dims(k3, axes=[0, 2, 1]))
                s = R.multiply(s, R.astype(R.const(0.125, "float32"), F16))
                p = R.astype(R.nn.softmax(R.astype(s, "float32"), axis=-1), F16)
                o = R.reshape(R.matmul(p, v3), R.shape([1, 4, 4, 64]))
                ot = R.permute_dims(o, axes=[0, 2, 1, 3])
                R.output(ot)
            return ot

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 4, 2, 64), F16), v: R.Tensor((1, 4, 2, 64), F16)):
            with R.dataflow():
                o = R.nn.attention(q, k, v, scale=T.float32(0.125))
                R.output(o)
            return o

    _check(Before, Expected)


def test_hf_repeat_kv_chain():
    """TVM's PyTorch frontend on HF repeat_kv + eager attention: BNSH in, (B, S, H*D) out, a causal
    mask built from positions, softmax in float32."""

    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 2, 4, 64), F16), v: R.Tensor((1, 2, 4, 64), F16)):
            with R.dataflow():
                kk = R.reshape(R.broadcast_to(R.expand_dims(k, axis=[2]), R.shape([1, 2, 2, 4, 64])),
                               R.shape([1, 4, 4, 64]))
                vv = R.reshape(R.broadcast_to(R.expand_dims(v, axis=[2]), R.shape([1, 2, 2, 4, 64])),
                               R.shape([1, 4, 4, 64]))
                kt = R.permute_dims(kk, axes=[0, 1, 3, 2])
                q3 = R.reshape(R.broadcast_to(q, R.shape([1, 4, 4, 64])), R.shape([4, 4, 64]))
                k3 = R.reshape(R.broadcast_to(kt, R.shape([1, 4, 64, 4])), R.shape([4, 64, 4]))
                s = R.reshape(R.matmul(q3, k3), R.shape([1, 4, 4, 4]))
                s = R.multiply(s, R.const(0.125, F16))
                pos = R.arange(0, 4, 1, dtype="int64")
                future = R.greater(pos, R.reshape(pos, R.shape([4, 1])))
                mask = R.where(future, R.const(-65504.0, F16), R.const(0.0, F16))
                s = R.add(s, R.reshape(mask, R.shape([1, 1, 4, 4])))
                p = R.astype(R.nn.softmax(R.astype(s, "float32"), axis=-1), F16)
                p3 = R.reshape(R.broadcast_to(p, R.shape([1, 4, 4, 4])), R.shape([4, 4, 4]))
                v3 = R.reshape(R.broadcast_to(vv, R.shape([1, 4, 4, 64])), R.shape([4, 4, 64]))
                o = R.reshape(R.matmul(p3, v3), R.shape([1, 4, 4, 64]))
                o = R.reshape(R.permute_dims(o, axes=[0, 2, 1, 3]), R.shape([1, 4, 256]))
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), F16), k: R.Tensor((1, 2, 4, 64), F16), v: R.Tensor((1, 2, 4, 64), F16)):
            with R.dataflow():
                qt = R.permute_dims(q, axes=[0, 2, 1, 3])
                kt = R.permute_dims(k, axes=[0, 2, 1, 3])
                vt = R.permute_dims(v, axes=[0, 2, 1, 3])
                o = R.nn.attention(qt, kt, vt, scale=T.float32(0.125), causal_mask="BottomRight")
                o = R.reshape(o, R.shape([1, 4, 256]))
                R.output(o)
            return o

    _check(Before, Expected)


def test_rejected_site_is_left_unchanged():
    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((1, 4, 4, 64), "float32"), k: R.Tensor((1, 4, 2, 64), "float32"),
                 v: R.Tensor((1, 4, 2, 64), "float32")):
            with R.dataflow():
                kk = R.repeat(k, repeats=2, axis=2)
                vv = R.repeat(v, repeats=2, axis=2)
                o = R.nn.attention(q, kk, vv)
                R.output(o)
            return o

    _check(Before, Before)
