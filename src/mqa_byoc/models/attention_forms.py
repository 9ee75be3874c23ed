"""The K/V expansion forms of one attention, emitted on nn.Tensors inside an nn.Module method.

``attention(q, k, v, kv_expand=...)`` writes the graph each form of :mod:`.llama`'s docstring shows
(``repeat``, ``native``, ``repeat-chain``, ``hf-broadcast``); :func:`build_mask` the explicit mask the
chain forms use. The small helpers here are shared by the decoder and the caches.
"""

from __future__ import annotations

import math

KV_EXPAND_FORMS = ("repeat", "repeat-chain", "hf-broadcast", "native")
_MASK_FORMS = ("repeat-chain", "hf-broadcast")


def nn_frontend():
    """TVM's ``nn`` frontend and its ``op`` module (imported at the first use)."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    return nn, op


def _min_value(dtype: str) -> float:
    import tvm

    return float(tvm.tirx.min_value(dtype).value)


def _max_value(dtype: str) -> float:
    import tvm

    return float(tvm.tirx.max_value(dtype).value)


def simplify_index(x):
    """Fold ``(s + 0) - s`` style index arithmetic so printed shapes stay readable."""
    if isinstance(x, int):
        return x
    import tvm

    from tvm.sym import Analyzer

    y = Analyzer().simplify(x)
    return int(y) if isinstance(y, tvm.tirx.IntImm) else y


def emit_expr(expr, name):
    """Wrap a Relax expression as an ``nn`` tensor named ``name``."""
    from tvm.relax.frontend.nn.core import wrap_nested

    return wrap_nested(expr, name)


def _float32_softmax(op, scores, dtype: str):
    """Softmax over the keys in float32, cast back to ``dtype`` (what both chain forms emit)."""
    if dtype != "float32":
        scores = op.astype(scores, "float32")
    probs = op.softmax(scores, axis=-1)
    return probs if dtype == "float32" else op.astype(probs, dtype)


def build_mask(kv_expand: str, batch, seq_len, kv_len, dtype: str, causal_mask, window):
    """The explicit mask the ``repeat-chain`` / ``hf-broadcast`` forms use (None for the others).

    ``causal_mask``: "BottomRight" (query i is position kv_len - seq_len + i), "TopLeft"
    (query i is position i) or None (no causal mask; then a window is not allowed).
    """
    if kv_expand not in _MASK_FORMS or (causal_mask is None and window is None):
        return None
    if causal_mask is None:
        raise ValueError("a sliding window needs a causal mask")
    nn, op = nn_frontend()
    from tvm import relax, te, tirx

    offset = simplify_index(kv_len - seq_len) if causal_mask == "BottomRight" else 0
    if kv_expand == "repeat-chain":
        lo, hi = _min_value(dtype), _max_value(dtype)

        def make_causal_mask():
            def body(i, j):
                masked = j > i + offset
                if window is not None:
                    masked = tirx.Or(masked, j <= i + offset - window)
                return tirx.Select(masked, tirx.const(lo, dtype), tirx.const(hi, dtype))

            return te.compute((seq_len, kv_len), body, name="make_causal_mask_te")

        m = op.tensor_expr_op(make_causal_mask, "make_causal_mask", args=[])
        m = op.reshape(m, (1, 1, seq_len, kv_len))
        return op.broadcast_to(m, (batch, 1, seq_len, kv_len))
    # hf-broadcast: positions -> bool -> where(ok, 0, min)
    qp = op.arange(offset, simplify_index(offset + seq_len), dtype="int64")
    kp = op.arange(0, kv_len, dtype="int64")
    qcol = op.reshape(qp, (seq_len, 1))
    krow = op.reshape(kp, (1, kv_len))
    ok = op.less_equal(krow, qcol)
    if window is not None:
        lower = op.subtract(qcol, nn.Tensor.from_scalar(window, "int64"))
        ok = emit_expr(relax.op.logical_and(ok._expr, op.greater(krow, lower)._expr), "and_window")
    ok = op.reshape(ok, (1, 1, seq_len, kv_len))
    zero = nn.Tensor.from_scalar(0.0, dtype)
    neg = nn.Tensor.from_scalar(_min_value(dtype), dtype)
    return op.where(ok, zero, neg)


def attention(q, k, v, *, kv_expand: str, mask=None, causal_mask="BottomRight", window=None):
    """Emit one attention in form ``kv_expand`` (see the module docstring).

    q ``(B, S, H, D)``, k/v ``(B, S_kv, H_kv, D)`` nn.Tensors; ``mask`` from :func:`build_mask`
    for the explicit-mask forms. Returns ``(B, S, H, D)``.
    """
    nn, op = nn_frontend()
    from tvm import relax

    if kv_expand not in KV_EXPAND_FORMS:
        raise ValueError(f"kv_expand must be one of {KV_EXPAND_FORMS}, got {kv_expand!r}")
    b, s, h, d = q.shape
    _, skv, hkv, _ = k.shape
    h, hkv, d = int(h), int(hkv), int(d)
    r = h // hkv
    dtype = q.dtype

    if kv_expand in ("repeat", "native"):
        if kv_expand == "repeat" and r > 1:
            k = op.repeat(k, r, axis=2)
            v = op.repeat(v, r, axis=2)
        call = relax.op.nn.attention(
            q._expr, k._expr, v._expr, causal_mask=causal_mask, window_size=window
        )
        return emit_expr(call, "attention")

    if mask is None and (causal_mask is not None or window is not None):
        raise ValueError(f"{kv_expand}: the mask from build_mask() is required")

    if kv_expand == "repeat-chain":
        if r > 1:
            k = op.repeat(k, r, axis=2)
            v = op.repeat(v, r, axis=2)
        q = op.permute_dims(q, [0, 2, 1, 3])
        k = op.permute_dims(k, [0, 2, 1, 3])
        v = op.permute_dims(v, [0, 2, 1, 3])
        scores = op.matmul(q, op.permute_dims(k, [0, 1, 3, 2]))
        scores = op.divide(scores, nn.Tensor.from_scalar(math.sqrt(d), dtype))
        if mask is not None:
            scores = op.maximum(scores, nn.Tensor.from_scalar(_min_value(dtype), dtype))
            scores = op.minimum(scores, mask)
        probs = _float32_softmax(op, scores, dtype)
        out = op.matmul(probs, v)
        return op.permute_dims(out, [0, 2, 1, 3])

    # hf-broadcast
    q = op.permute_dims(q, [0, 2, 1, 3])
    k = op.permute_dims(k, [0, 2, 1, 3])
    v = op.permute_dims(v, [0, 2, 1, 3])
    if r > 1:
        k = op.reshape(op.broadcast_to(op.unsqueeze(k, 2), (b, hkv, r, skv, d)), (b, h, skv, d))
        v = op.reshape(op.broadcast_to(op.unsqueeze(v, 2), (b, hkv, r, skv, d)), (b, h, skv, d))
    kt = op.permute_dims(k, [0, 1, 3, 2])

    def bmm(x, y, xs, ys, out):
        x3 = op.reshape(op.broadcast_to(x, xs), (b * h, xs[2], xs[3]))
        y3 = op.reshape(op.broadcast_to(y, ys), (b * h, ys[2], ys[3]))
        return op.reshape(op.matmul(x3, y3), out)

    scores = bmm(q, kt, (b, h, s, d), (b, h, d, skv), (b, h, s, skv))
    scores = op.multiply(scores, nn.Tensor.from_scalar(d**-0.5, dtype))
    if mask is not None:
        scores = op.add(scores, mask)
    probs = _float32_softmax(op, scores, dtype)
    out = bmm(probs, v, (b, h, s, skv), (b, h, skv, d), (b, h, s, d))
    return op.permute_dims(out, [0, 2, 1, 3])
