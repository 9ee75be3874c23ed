"""Relax graphs of ``R.nn.attention_var_len`` (upstream's CUTLASS var-len tests, with K/V expanded or not)
and a NumPy reference for var-len attention (per sequence, query head h uses K/V head h // (H / H_kv)).

Shared by tests/test_graph_varlen.py and tools/gpu/build_varlen.py.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx
from tvm.relax import op as R

F16 = "float16"


def var_len_attention(h=8, hkv=2, d=64, dtype=F16, causal="BottomRight", window=None, scale=None,
                      expand="repeat", same_seqstart=False, merged=False, total_q="tq", total_k="tk",
                      seqstart_dtype="int32", max_dtype="int32", batch=1, same_max=None, dv=None):
    """``main(q, k, v, seqstart_q[, seqstart_k], max_seqlen_q, max_seqlen_k)`` with
    ``R.nn.attention_var_len(q, expand(k), expand(v), ...)``.

    ``expand``: "repeat" (R.repeat on the head axis), "broadcast" (hkv == 1), "hf" (expand_dims +
    broadcast_to + reshape: HF repeat_kv in BSNH), "tile", or "none" (K/V with hkv heads).
    ``same_seqstart``: one seqstart for Q and K/V (TVM's default); ``same_max`` (default: as
    ``same_seqstart``): one max_seqlen for both. ``merged``: Q/K/V come in as
    (total, heads * d) and are reshaped (upstream's tests); the output is reshaped back.
    ``total_q``/``total_k``/``batch``: ints or names of symbolic lengths (the same name: one variable).
    ``dv``: V's head dim when it differs from Q's and K's ``d`` ("repeat" and "none" only).
    """
    syms = {}

    def dim(x):
        if isinstance(x, str):
            syms.setdefault(x, tirx.Var(x, "int64"))
            return syms[x]
        return x

    tq, tk = dim(total_q), dim(total_k)
    dv = d if dv is None else dv
    nseq = tirx.Var("nseq", "int64")
    bb = relax.BlockBuilder()
    if merged:
        q = relax.Var("q", relax.TensorType([tq, h * d], dtype))
        k = relax.Var("k", relax.TensorType([tk, hkv * d], dtype))
        v = relax.Var("v", relax.TensorType([tk, hkv * d], dtype))
    else:
        q = relax.Var("q", relax.TensorType([dim(batch), tq, h, d], dtype))
        k = relax.Var("k", relax.TensorType([dim(batch), tk, hkv, d], dtype))
        v = relax.Var("v", relax.TensorType([dim(batch), tk, hkv, dv], dtype))
    sq = relax.Var("seqstart_q", relax.TensorType([nseq], seqstart_dtype))
    sk = sq if same_seqstart else relax.Var("seqstart_k", relax.TensorType([nseq], seqstart_dtype))
    mq = relax.Var("max_seqlen_q", relax.TensorType([], max_dtype))
    same_max = same_seqstart if same_max is None else same_max
    mk = mq if same_max else relax.Var("max_seqlen_k", relax.TensorType([], max_dtype))
    params = [q, k, v, sq] + ([] if same_seqstart else [sk]) + [mq] + ([] if same_max else [mk])
    r = h // hkv
    with bb.function("main", params):
        with bb.dataflow():
            qq, kk, vv = q, k, v
            if merged:
                qq = bb.emit(R.reshape(q, [1, tq, h, d]))
                kk = bb.emit(R.reshape(k, [1, tk, hkv, d]))
                vv = bb.emit(R.reshape(v, [1, tk, hkv, d]))
            if expand == "repeat":
                kk, vv = bb.emit(R.repeat(kk, r, axis=2)), bb.emit(R.repeat(vv, r, axis=2))
            elif expand == "tile":
                kk, vv = bb.emit(R.tile(kk, [1, 1, r, 1])), bb.emit(R.tile(vv, [1, 1, r, 1]))
            elif expand == "broadcast":
                kk = bb.emit(R.broadcast_to(kk, [dim(batch), tk, h, d]))
                vv = bb.emit(R.broadcast_to(vv, [dim(batch), tk, h, d]))
            elif expand == "hf":
                def repeat_kv(x):
                    x = bb.emit(R.expand_dims(x, [3]))
                    x = bb.emit(R.broadcast_to(x, [dim(batch), tk, hkv, r, d]))
                    return bb.emit(R.reshape(x, [dim(batch), tk, h, d]))
                kk, vv = repeat_kv(kk), repeat_kv(vv)
            elif expand != "none":
                raise ValueError(expand)
            o = bb.emit(R.nn.attention_var_len(qq, kk, vv, sq, mq, sk, mk, scale=scale, causal_mask=causal,
                                               window_size=window))
            if merged:
                o = bb.emit(R.reshape(o, [tq, h * d]))
            o = bb.emit_output(o)
        bb.emit_func_output(o)
    return bb.get()


def seqstarts(lengths) -> np.ndarray:
    """int32 cumulative lengths with a leading 0 (FA2's cu_seqlens)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype("int32")


def var_len_reference(q, k, v, lens_q, lens_k, causal=None, window=None, scale=None):
    """float64 var-len attention: q (1, total_q, H, D), k/v (1, total_k, H_kv, D), per sequence i the rows
    of length lens_q[i] / lens_k[i]. Query head h reads K/V head h // (H / H_kv). BottomRight causal:
    query i sees key j <= i + S_kv - S_q; TopLeft: j <= i; window w: the w keys ending at the causal
    diagonal. A row that sees no key is 0 (FA2's output there)."""
    q, k, v = (np.asarray(x, dtype=np.float64)[0] for x in (q, k, v))
    h, d, hkv = q.shape[1], q.shape[2], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    heads = np.arange(h) // (h // hkv)
    out = np.zeros(q.shape[:2] + v.shape[2:])
    cq, ck = seqstarts(lens_q), seqstarts(lens_k)
    for i, (sq_, sk_) in enumerate(zip(lens_q, lens_k)):
        qs = q[cq[i]:cq[i + 1]]
        ks, vs = k[ck[i]:ck[i + 1]][:, heads], v[ck[i]:ck[i + 1]][:, heads]
        s = np.einsum("qhd,khd->hqk", qs, ks) * scale
        row = np.arange(sq_)[:, None]
        col = np.arange(sk_)[None, :]
        diag = row + (sk_ - sq_) if causal != "TopLeft" else row
        keep = np.ones((sq_, sk_), dtype=bool)
        if causal is not None:
            keep &= col <= diag
        if window is not None:
            keep &= col > diag - window
        s = np.where(keep[None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.where(keep[None], np.exp(s - m), 0.0)
        denom = p.sum(-1, keepdims=True)
        p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
        out[cq[i]:cq[i + 1]] = np.einsum("hqk,khd->qhd", p, vs)
    return out[None]
