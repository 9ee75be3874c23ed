"""Relax graphs of K/V-expanded attention in the forms real compile scripts and frontends emit.

Each builder returns an IRModule with one function ``main``; shapes are small but head counts and
head dims are real. ``s`` / ``s_kv`` may be ints or names of symbolic variables.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import relax, tirx
from tvm.relax import op as R

F16 = "float16"


def _dim(x, cache):
    if isinstance(x, str):
        if x not in cache:
            cache[x] = tirx.Var(x, "int64")
        return cache[x]
    return x


def dim_maker():
    """``dim(x)``: ints pass through, a str names a symbolic int64 variable (one per name)."""
    cache = {}
    return lambda x: _dim(x, cache)


def _tensor(shape, dtype):
    return relax.TensorType(shape, dtype)


def _finish(bb):
    return bb.get()


def attention_repeat_bsnh(h=8, hkv=2, d=64, s="n", s_kv=None, b=1, dtype=F16, causal="BottomRight",
                          scale=None, window=None, expand="repeat", dv=None, q_view=None):
    """Form 1: ``R.nn.attention(q, R.repeat(k, r, axis=2), R.repeat(v, r, axis=2))`` in BSNH.
    ``expand`` = "repeat" | "tile" | "broadcast" (the last for h_kv == 1) | "none" (form 6) |
    "reshape_broadcast" (form 11: ``reshape`` adding a unit axis -> 5-D ``broadcast_to`` -> ``reshape``,
    as ``relax.frontend.nn`` code writes it). ``dv``: V's head dim when it differs from ``d``
    ("repeat" and "none" only). ``q_view="heads_innermost"``: the query reaches attention through a
    projection laid out heads-innermost, (B, S, D*H) viewed as (B, S, D, H) and permuted to (B, S, H, D)
    (the same values as ``q``)."""
    syms = {}
    s_, skv_ = _dim(s, syms), _dim(s_kv if s_kv is not None else s, syms)
    b_ = _dim(b, syms)
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b_, s_, h, d], dtype))
    k = relax.Var("k", _tensor([b_, skv_, hkv, d], dtype))
    v = relax.Var("v", _tensor([b_, skv_, hkv, d if dv is None else dv], dtype))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = k, v
            r = h // hkv
            if expand == "repeat":
                kk = bb.emit(R.repeat(k, r, axis=2))
                vv = bb.emit(R.repeat(v, r, axis=2))
            elif expand == "tile":
                kk = bb.emit(R.tile(k, [1, 1, r, 1]))
                vv = bb.emit(R.tile(v, [1, 1, r, 1]))
            elif expand == "broadcast":
                kk = bb.emit(R.broadcast_to(k, [b_, skv_, h, d]))
                vv = bb.emit(R.broadcast_to(v, [b_, skv_, h, d]))
            elif expand == "reshape_broadcast":
                kk, vv = (bb.emit(R.reshape(bb.emit(R.broadcast_to(bb.emit(R.reshape(x, [b_, skv_, hkv, 1, d])),
                                                                   [b_, skv_, hkv, r, d])), [b_, skv_, h, d]))
                          for x in (k, v))
            qq = q
            if q_view == "heads_innermost":
                proj = bb.emit(R.reshape(bb.emit(R.permute_dims(q, [0, 1, 3, 2])), [b_, s_, d * h]))
                qq = bb.emit(R.permute_dims(bb.emit(R.reshape(proj, [b_, s_, d, h])), [0, 1, 3, 2]))
            elif q_view is not None:
                raise ValueError(f"q_view: None or 'heads_innermost', got {q_view!r}")
            o = bb.emit_output(R.nn.attention(qq, kk, vv, scale=scale, causal_mask=causal, window_size=window))
        bb.emit_func_output(o)
    return _finish(bb)


def attention_repeat_bnsh(h=8, hkv=2, d=64, s="n", b=1, dtype=F16, causal="BottomRight"):
    """Form 5: ``relax.repeat`` on axis 1 in BNSH, permuted to BSNH for ``R.nn.attention``."""
    syms = {}
    s_ = _dim(s, syms)
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, h, s_, d], dtype))
    k = relax.Var("k", _tensor([b, hkv, s_, d], dtype))
    v = relax.Var("v", _tensor([b, hkv, s_, d], dtype))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            r = h // hkv
            kk = bb.emit(R.repeat(k, r, axis=1))
            vv = bb.emit(R.repeat(v, r, axis=1))
            qt, kt, vt = (bb.emit(R.permute_dims(x, [0, 2, 1, 3])) for x in (q, kk, vv))
            o = bb.emit(R.nn.attention(qt, kt, vt, causal_mask=causal))
            o = bb.emit_output(R.permute_dims(o, [0, 2, 1, 3]))
        bb.emit_func_output(o)
    return _finish(bb)


def upstream_3d_chain(h=8, hkv=2, d=64, s=16, b=1, dtype=F16, scale=None, cast_scale=True):
    """Form 2: TVM upstream's explicit chain (``make_attention_rewrite_pattern(with_kv_repeat=True)``):
    repeat -> permute [0,2,1,3] -> reshape (B*N, S, D); K also permuted [0,2,1]; matmul; multiply by
    a constant (astype'd); astype float32; softmax; astype; matmul; reshape 4-D; permute back."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, s, h, d], dtype))
    k = relax.Var("k", _tensor([b, s, hkv, d], dtype))
    v = relax.Var("v", _tensor([b, s, hkv, d], dtype))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            r = h // hkv
            q3 = bb.emit(R.reshape(bb.emit(R.permute_dims(q, [0, 2, 1, 3])), [b * h, s, d]))
            k3 = bb.emit(R.reshape(bb.emit(R.permute_dims(bb.emit(R.repeat(k, r, axis=2)), [0, 2, 1, 3])), [b * h, s, d]))
            v3 = bb.emit(R.reshape(bb.emit(R.permute_dims(bb.emit(R.repeat(v, r, axis=2)), [0, 2, 1, 3])), [b * h, s, d]))
            kt = bb.emit(R.permute_dims(k3, [0, 2, 1]))
            sc = bb.emit(R.matmul(q3, kt))
            c = relax.const(scale, "float32")
            c = bb.emit(R.astype(c, dtype)) if cast_scale else relax.const(scale, dtype)
            sc = bb.emit(R.multiply(sc, c))
            p = bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(sc, "float32")), axis=-1), dtype))
            o = bb.emit(R.matmul(p, v3))
            o = bb.emit(R.reshape(o, [b, h, s, d]))
            o = bb.emit_output(R.permute_dims(o, [0, 2, 1, 3]))
        bb.emit_func_output(o)
    return _finish(bb)


def causal_mask_np(s_q, s_kv, visible, hidden, dtype):
    i = np.arange(s_q)[:, None]
    j = np.arange(s_kv)[None, :]
    return np.where(j <= i + s_kv - s_q, visible, hidden).astype(dtype)[None, None]


def mlc_4d_chain(h=8, hkv=2, d=64, s=16, s_kv=None, b=1, dtype=F16, divide=True, mask="minimum",
                 mask_const=None, chunk=None):
    """Form 3: mlc-llm 2023 Llama: repeat axis 2 (BSNH), permute to BNSH, matmul with K permuted
    [0,1,3,2], divide (or multiply) by a constant sqrt(d), mask (maximum/minimum, add or where),
    astype float32 around softmax, matmul, permute back, reshape (B, S, H*D).
    ``mask``: "minimum" | "add" | "where" | "none" | "runtime" (a mask function parameter).
    ``mask_const``: override the mask constant (numpy) to build a non-causal bias. ``chunk`` c: the mask
    is chunked (Llama 4's chunked layers: causal within blocks of c key positions, :func:`mask_allowed`)."""
    s_kv = s if s_kv is None else s_kv
    if chunk is not None:
        allowed = mask_allowed(s, s_kv, "BottomRight", chunk=chunk)[None, None]
        fmin16, fmax16 = float(np.finfo(np.float16).min), float(np.finfo(np.float16).max)
        mask_const = {"minimum": np.where(allowed, fmax16, fmin16), "add": np.where(allowed, 0, fmin16),
                      "where": allowed}[mask].astype("bool" if mask == "where" else dtype)
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, s, h, d], dtype))
    k = relax.Var("k", _tensor([b, s_kv, hkv, d], dtype))
    v = relax.Var("v", _tensor([b, s_kv, hkv, d], dtype))
    params = [q, k, v]
    m_param = None
    if mask == "runtime":
        m_param = relax.Var("mask", _tensor([b, 1, s, s_kv], dtype))
        params.append(m_param)
    fmin = float(np.finfo(np.float16).min)
    fmax = float(np.finfo(np.float16).max)
    with bb.function("main", params):
        with bb.dataflow():
            r = h // hkv
            kk = bb.emit(R.repeat(k, r, axis=2))
            vv = bb.emit(R.repeat(v, r, axis=2))
            qt, kt, vt = (bb.emit(R.permute_dims(x, [0, 2, 1, 3])) for x in (q, kk, vv))
            sc = bb.emit(R.matmul(qt, bb.emit(R.permute_dims(kt, [0, 1, 3, 2]))))
            if divide:
                sc = bb.emit(R.divide(sc, relax.const(math.sqrt(d), dtype)))
            else:
                sc = bb.emit(R.multiply(sc, relax.const(1.0 / math.sqrt(d), dtype)))
            if mask == "minimum":
                sc = bb.emit(R.maximum(sc, relax.const(fmin, dtype)))
                m = mask_const if mask_const is not None else causal_mask_np(s, s_kv, fmax, fmin, dtype)
                sc = bb.emit(R.minimum(sc, relax.const(m)))
            elif mask == "add":
                m = mask_const if mask_const is not None else causal_mask_np(s, s_kv, 0, fmin, dtype)
                sc = bb.emit(R.add(sc, relax.const(m)))
            elif mask == "where":
                m = mask_const if mask_const is not None else causal_mask_np(s, s_kv, True, False, "bool")
                sc = bb.emit(R.where(relax.const(m), sc, relax.const(fmin, dtype)))
            elif mask == "runtime":
                sc = bb.emit(R.add(sc, m_param))
            p = bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(sc, "float32")), axis=-1), dtype))
            o = bb.emit(R.matmul(p, vt))
            o = bb.emit(R.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit_output(R.reshape(o, [b, s, h * d]))
        bb.emit_func_output(o)
    return _finish(bb)


def symbolic_mask_chain(hidden, h=8, hkv=2, d=64):
    """A chain over a symbolic length n (B = 1, BSNH in and out, K/V repeated) whose mask is a TE compute:
    ``hidden(i, j, n)`` (a TIR bool) hides key j from query i; the mask is applied as ``minimum`` with the
    dtype's extremes."""
    from tvm import te, tirx

    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, n, h, d], "float16"))
    k = relax.Var("k", relax.TensorType([1, n, hkv, d], "float16"))
    v = relax.Var("v", relax.TensorType([1, n, hkv, d], "float16"))
    lo, hi = float(np.finfo(np.float16).min), float(np.finfo(np.float16).max)

    def mask_te():
        return te.compute((n, n), lambda i, j: tirx.Select(hidden(i, j, n), tirx.const(lo, "float16"),
                                                           tirx.const(hi, "float16")), name="mask")

    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = (bb.emit(R.repeat(x, h // hkv, axis=2)) for x in (k, v))
            qt, kt, vt = (bb.emit(R.permute_dims(x, [0, 2, 1, 3])) for x in (q, kk, vv))
            sc = bb.emit(R.matmul(qt, bb.emit(R.permute_dims(kt, [0, 1, 3, 2]))))
            sc = bb.emit(R.multiply(sc, relax.const(d ** -0.5, "float16")))
            sc = bb.emit(R.minimum(sc, bb.emit_te(mask_te)))
            p = bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(sc, "float32")), axis=-1), "float16"))
            o = bb.emit_output(R.permute_dims(bb.emit(R.matmul(p, vt)), [0, 2, 1, 3]))
        bb.emit_func_output(o)
    return bb.get()


def hf_repeat_kv(bb, x, b, hkv, r, s, d):
    """HF's ``repeat_kv`` on a BNSH (b, hkv, s, d) tensor as TVM's torch frontend emits it:
    ``expand_dims(axis=2)`` -> 5-D ``broadcast_to`` (b, hkv, r, s, d) -> ``reshape`` (b, hkv * r, s, d)."""
    e = bb.emit(R.broadcast_to(bb.emit(R.expand_dims(x, axis=[2])), [b, hkv, r, s, d]))
    return bb.emit(R.reshape(e, [b, hkv * r, s, d]))


def hf_repeat_kv_chain(h=8, hkv=2, d=64, s=16, b=1, dtype=F16, compute_dtype="float32", outer=False,
                       mqa_broadcast=False, dv=None):
    """Form 4 (as TVM's PyTorch frontend emits HF ``repeat_kv`` + eager attention, after
    ToMixedPrecision keeps softmax in float32): BNSH; ``expand_dims(axis=2)`` -> 5-D
    ``broadcast_to`` (B, H_kv, r, S, D) -> ``reshape`` (B, H, S, D); 3-D batched matmuls with no-op
    broadcast_to / reshape around them; multiply by the scale; add a causal mask built from arange
    and comparisons; softmax; astype; matmul. ``outer``: expand on axis 1 instead (h % H_kv).
    ``dv``: V's head dim when it differs from Q's and K's ``d`` (multi-head latent attention)."""
    dv = d if dv is None else dv
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, h, s, d], dtype))
    k = relax.Var("k", _tensor([b, hkv, s, d], dtype))
    v = relax.Var("v", _tensor([b, hkv, s, dv], dtype))
    r = h // hkv
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            def repeat_kv(x, d):
                if mqa_broadcast:
                    return bb.emit(R.broadcast_to(x, [b, h, s, d]))
                if not outer:
                    return hf_repeat_kv(bb, x, b, hkv, r, s, d)
                e = bb.emit(R.broadcast_to(bb.emit(R.expand_dims(x, axis=[1])), [b, r, hkv, s, d]))
                return bb.emit(R.reshape(e, [b, h, s, d]))

            kk, vv = repeat_kv(k, d), repeat_kv(v, dv)
            kt = bb.emit(R.permute_dims(kk, [0, 1, 3, 2]))
            q_b = bb.emit(R.broadcast_to(q, [b, h, s, d]))  # the frontend's no-op broadcast
            q3 = bb.emit(R.reshape(q_b, [b * h, s, d]))
            k3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(kt, [b, h, d, s])), [b * h, d, s]))
            sc = bb.emit(R.reshape(bb.emit(R.matmul(q3, k3)), [b, h, s, s]))
            sc = bb.emit(R.multiply(sc, relax.const(1.0 / math.sqrt(d), dtype)))
            # HF's causal mask, from positions: min where key > query, else 0
            pos = bb.emit(R.arange(0, s, 1, "int64"))
            rows = bb.emit(R.reshape(pos, [s, 1]))
            future = bb.emit(R.greater(pos, rows))
            fmin = float(np.finfo(np.float16).min)
            mask = bb.emit(R.where(future, relax.const(fmin, dtype), relax.const(0.0, dtype)))
            mask = bb.emit(R.reshape(mask, [1, 1, s, s]))
            sc = bb.emit(R.add(sc, mask))
            p = bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(sc, compute_dtype)), axis=-1), dtype))
            p3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(p, [b, h, s, s])), [b * h, s, s]))
            v3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(vv, [b, h, s, dv])), [b * h, s, dv]))
            o = bb.emit(R.reshape(bb.emit(R.matmul(p3, v3)), [b, h, s, dv]))
            o = bb.emit(R.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit_output(R.reshape(o, [b, s, h * dv]))
        bb.emit_func_output(o)
    return _finish(bb)


def _causal_softmax(bb, scores, s, dtype, causal):
    """Softmax in float32 over ``scores`` (S x S on the last axes), a causal mask added first as an (S, S)
    constant from ``arange`` (the float16 minimum on future keys) when ``causal``; cast back to ``dtype``."""
    if causal:
        pos = bb.emit(R.arange(0, s, 1, "int64"))
        future = bb.emit(R.greater(pos, bb.emit(R.reshape(pos, [s, 1]))))
        fmin = float(np.finfo(np.float16).min)
        scores = bb.emit(R.add(scores, bb.emit(R.where(future, relax.const(fmin, dtype), relax.const(0.0, dtype)))))
    return bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(scores, "float32")), axis=-1), dtype))


def grouped_5d_chain(h=8, hkv=2, d=64, s=16, b=1, dtype=F16, outer=False, inputs="4d", causal=True):
    """Grouped-query attention written on 5-D tensors, with Relax's matmul broadcasting K/V over the
    query's groups (MLX-LM style, no K/V expansion op): Q (B, H, S, D) viewed as (B, H_kv, G, S, D), K and V
    (B, H_kv, S, D) given a unit group axis (B, H_kv, 1, S, D); scale, a causal mask added as a (S, S)
    constant, softmax, ``@ V``, the result viewed as (B, H, S, D) again. ``outer``: the query viewed as
    (B, G, H_kv, S, D) and the unit axis in front of the K/V heads (query head h uses K/V head h % H_kv).
    ``inputs="5d"``: the parameters are the 5-D views themselves (the output stays 5-D)."""
    dim = dim_maker()
    b, s = dim(b), dim(s)
    g = h // hkv
    q_view = [b, g, hkv, s, d] if outer else [b, hkv, g, s, d]
    kv_view = [b, 1, hkv, s, d] if outer else [b, hkv, 1, s, d]
    bb = relax.BlockBuilder()
    if inputs == "5d":
        params = [relax.Var(n, _tensor(shape, dtype)) for n, shape in (("q", q_view), ("k", kv_view),
                                                                        ("v", kv_view))]
    else:
        params = [relax.Var("q", _tensor([b, h, s, d], dtype))] + [
            relax.Var(n, _tensor([b, hkv, s, d], dtype)) for n in "kv"]
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v = params
            if inputs != "5d":
                q = bb.emit(R.reshape(q, q_view))
                k, v = (bb.emit(R.expand_dims(x, axis=[1 if outer else 2])) for x in (k, v))
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 2, 4, 3]))))
            sc = bb.emit(R.multiply(sc, relax.const(1.0 / math.sqrt(d), dtype)))
            p = _causal_softmax(bb, sc, s, dtype, causal)
            o = bb.emit(R.matmul(p, v))
            if inputs != "5d":
                o = bb.emit(R.reshape(o, [b, h, s, d]))
            o = bb.emit_output(o)
        bb.emit_func_output(o)
    return _finish(bb)


def import_torch(module, args, dynamic_shapes=None, fp16_inputs=()):
    """``module`` as a compile script imports it: ``torch.export`` (float32), plain ``from_exported_program``
    (a single result unwrapped), ``ToMixedPrecision(out_dtype="float16")`` (``fp16_inputs``: parameters it
    makes float16 too). Needs torch."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    ep = torch.export.export(module.eval(), tuple(args), dynamic_shapes=dynamic_shapes)
    mod = from_exported_program(ep, unwrap_unit_return_tuple=True)
    return relax.transform.ToMixedPrecision(out_dtype="float16", fp16_input_names=list(fp16_inputs) or None)(mod)


def einsum_chain(h=8, hkv=2, d=64, s=16, s_kv=None, b=1, dtype=F16, layout="bhsd", causal=True):
    """Attention a user writes with ``torch.einsum`` in a module of their own, exported with
    ``torch.export`` (float32), imported with plain ``from_exported_program`` and cast by
    ``ToMixedPrecision`` (float16 only; the inputs float16 too): K/V
    repeated to the query heads (``repeat_interleave``), ``einsum`` scores scaled by ``d ** -0.5``, a
    bottom-right causal mask filled with -inf, softmax, ``einsum`` with V. ``layout`` "bhsd": Q/K/V and the
    output (B, H, S, D); "bshd": (B, S, H, D) (``"bqhd,bkhd->bhqk"``, output ``"bqhd"``); "palm": PaLM-style
    multi-query, Q (B, H, S, D) against K/V (B, S, D) with no head axis (``"bhqd,bkd->bhqk"``, hkv 1; the
    heads fold into the matmul's rows). Needs torch."""
    import torch

    s_kv = s if s_kv is None else s_kv
    r, bshd, palm = h // hkv, layout == "bshd", layout == "palm"
    if layout not in ("bhsd", "bshd", "palm") or (palm and hkv != 1):
        raise ValueError(f"layout {layout!r}: 'bhsd', 'bshd' or 'palm' (hkv 1)")
    score_eq = {"bshd": "bqhd,bkhd->bhqk", "bhsd": "bhqd,bhkd->bhqk", "palm": "bhqd,bkd->bhqk"}[layout]
    out_eq = {"bshd": "bhqk,bkhd->bqhd", "bhsd": "bhqk,bhkd->bhqd", "palm": "bhqk,bkd->bhqd"}[layout]

    class EinsumAttention(torch.nn.Module):
        def forward(self, q, k, v):
            if not palm:
                k, v = (x.repeat_interleave(r, dim=2 if bshd else 1) for x in (k, v))
            scores = torch.einsum(score_eq, q, k) * d ** -0.5
            if causal:
                keep = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool).tril(
                    scores.shape[-1] - scores.shape[-2])
                scores = scores.masked_fill(~keep, float("-inf"))
            return torch.einsum(out_eq, scores.softmax(-1), v)

    if dtype != "float16":
        raise ValueError(f"dtype {dtype!r}: the module is imported in float32 and cast by ToMixedPrecision, "
                         "which makes float16")
    shape = (lambda n, heads: (b, n, heads, d)) if bshd else (lambda n, heads: (b, heads, n, d))
    kv_shape = (b, s_kv, d) if palm else shape(s_kv, hkv)
    args = (torch.zeros(shape(s, h)), torch.zeros(kv_shape), torch.zeros(kv_shape))
    # float16 inputs here too; the result is cast back to float32
    return import_torch(EinsumAttention(), args, fp16_inputs=("q", "k", "v"))


def multihead_seq_first_chain(h=8, d=64, s=16, s_kv=None, b=1, dtype=F16, causal=False):
    """``torch.nn.MultiheadAttention``'s attention after its projections (its functional form, with
    ``need_weights=False``): Q (S, B, E) and K/V (S_kv, B, E), E = h * d, each viewed as (S, B*H, D),
    transposed to (B*H, S, D) and viewed as (B, H, S, D); SDPA (``is_causal`` when ``causal``); the result
    permuted to (S, B, H, D) and viewed as (S, B, E). Exported with ``torch.export`` (float32), imported
    with plain ``from_exported_program`` and cast by ``ToMixedPrecision`` (float16 only). Needs torch."""
    import torch

    s_kv = s if s_kv is None else s_kv

    class SeqFirstAttention(torch.nn.Module):
        def forward(self, q, k, v):
            n, batch, e = q.shape
            q, k, v = (x.view(x.shape[0], batch * h, d).transpose(0, 1).view(batch, h, x.shape[0], d)
                       for x in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return o.permute(2, 0, 1, 3).contiguous().view(n * batch, e).view(n, batch, e)

    if dtype != "float16":
        raise ValueError(f"dtype {dtype!r}: the module is imported in float32 and cast by ToMixedPrecision, "
                         "which makes float16")
    args = (torch.zeros(s, b, h * d), torch.zeros(s_kv, b, h * d), torch.zeros(s_kv, b, h * d))
    return import_torch(SeqFirstAttention(), args, fp16_inputs=("q", "k", "v"))


def mla_chain(h=8, d=128, dv=64, s=16, b=1, dtype=F16, scale=None, causal=True):
    """Multi-head latent attention's eager chain (DeepSeek-V3, MiniCPM3) after its K/V up-projection: Q and K
    (B, H, S, d), V (B, H, S, dv) with dv < d, scores times ``scale`` (default ``d ** -0.5``), a causal mask
    added as an (S, S) constant from ``arange``, softmax in float32, ``@ V``, the output (B, S, H * dv)."""
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dim = dim_maker()
    b, s = dim(b), dim(s)
    params = [relax.Var("q", _tensor([b, h, s, d], dtype)), relax.Var("k", _tensor([b, h, s, d], dtype)),
              relax.Var("v", _tensor([b, h, s, dv], dtype))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v = params
            sc = bb.emit(R.multiply(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 3, 2]))),
                                    relax.const(scale, dtype)))
            p = _causal_softmax(bb, sc, s, dtype, causal)
            o = bb.emit(R.permute_dims(bb.emit(R.matmul(p, v)), [0, 2, 1, 3]))
            o = bb.emit_output(R.reshape(o, [b, s, h * dv]))
        bb.emit_func_output(o)
    return _finish(bb)


def onnx_gqa_chain(h=8, hkv=2, d=32, b=1, s=16, s_kv=None, dtype=F16, causal=True, unsqueeze=True):
    """Form 12: an exported decoder's attention with static shapes, built with ``onnx.helper`` and imported
    with TVM's ONNX frontend: q (b, h, s, d), k/v (b, hkv, s_kv, d) in (BNSH), out (b, h, s, d).
    ``Unsqueeze`` -> ``Expand`` -> ``Reshape`` (HF ``repeat_kv`` as exported), ``Transpose``, ``MatMul``,
    ``Div`` by sqrt(d), an additive bottom-right causal mask (``causal``), ``Softmax``, ``MatMul``.
    ``unsqueeze=False`` with hkv == 1: one ``Expand`` of the size-1 head axis (MQA)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from tvm.relax.frontend.onnx import from_onnx

    s_q, s_kv = s, s if s_kv is None else s_kv
    et = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[dtype]
    io = [helper.make_tensor_value_info(name, et, [b, heads, n, d])
          for name, heads, n in (("q", h, s_q), ("k", hkv, s_kv), ("v", hkv, s_kv))]
    inits = [numpy_helper.from_array(np.array(a, np.int64), name) for name, a in (
        ("axis2", [2]), ("shape5", [b, hkv, h // hkv, s_kv, d]), ("shape4", [b, h, s_kv, d]))]
    inits.append(numpy_helper.from_array(np.array(np.sqrt(d), dtype), "sqrt_d"))
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
    out = helper.make_tensor_value_info("out", et, [b, h, s_q, d])
    model = helper.make_model(helper.make_graph(nodes, "gqa_attention", io, [out], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return from_onnx(model, keep_params_in_input=False)


def run_llvm(mod, args, function="main"):
    """``function`` of ``mod`` built for llvm and run on the numpy ``args``: its (first) output, as float32."""
    import tvm

    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out = vm[function](*[tvm.runtime.tensor(a) for a in args])
    return (out[0] if not hasattr(out, "numpy") else out).numpy().astype("float32")


def assert_as_accurate_as(got, graph, exact, margin=1.25):
    """``got`` (the rewritten graph's output in half precision) lies no further from ``exact`` (the
    float32 graph's) than ``graph`` (the unrewritten graph's, in the same half precision) does, give or
    take ``margin``: two half-precision lowerings of one function differ by their rounding, which a fixed
    tolerance between them cannot tell from a wrong rewrite."""
    exact = np.asarray(exact, "float32")
    err = float(np.abs(np.asarray(got, "float32") - exact).max())
    base = float(np.abs(np.asarray(graph, "float32") - exact).max())
    floor = 1e-6 * float(np.abs(exact).max())
    assert err <= margin * base + floor, (
        f"the rewrite is {err:.3g} from float32, the unrewritten graph {base:.3g} (margin {margin})")


def rewritten_on_cpu(mod, args, rtol=2e-2, atol=2e-2, function="main", reference=None):
    """``mod`` rewritten as the partition does (attention on the un-expanded K/V, TVM's lowering with the
    h // r grouping) returns on the CPU what ``mod`` returns (or ``reference``, the model's own output,
    where TVM cannot build ``mod`` for the CPU); the rewritten graph's output. Fails when the partition
    rewrites nothing in ``mod`` (the comparison would then check nothing)."""
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention

    rewritten = canonicalize_attention(mod)
    text = rewritten[function].script(show_meta=False)
    assert any(call in text for call in ("R.nn.attention", "attention_sinks", "attention_softcap")), \
        "the partition rewrote no attention: the comparison would check nothing"
    got = run_llvm(LegalizeGroupedAttention()(rewritten), args, function)
    want = run_llvm(mod, args, function) if reference is None else reference
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return got


def count_ops(mod, name, function="main"):
    """Number of calls to the op ``name`` in ``function`` (not counting composite bodies)."""
    func = mod[function]
    n = 0

    def visit(e):
        nonlocal n
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == name:
            n += 1

    relax.analysis.post_order_visit(func.body, visit)
    return n


def _codegen_is(f, codegen):
    return (isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs
            and (codegen is None or str(f.attrs["Codegen"]) == codegen))


def composites(mod, codegen="flash_attn"):
    """Composite names of the offloaded calls, one entry per call site (FuseOpsByPattern shares one
    function between structurally equal sites); of the attention codegen by default (``codegen=None``:
    every codegen, the GEMMs' ``cublaslt`` too)."""
    names = {}
    for gv, f in mod.functions.items():
        if _codegen_is(f, codegen):
            found = []

            def visit(e, found=found):
                if isinstance(e, relax.Function) and e.attrs is not None and "Composite" in e.attrs:
                    found.append(str(e.attrs["Composite"]))
            relax.analysis.post_order_visit(f.body, visit)
            names[gv] = found[0]
    out = []
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function) and gv not in names:
            def visit(e):
                if isinstance(e, relax.Call) and e.op in names:
                    out.append(names[e.op])
            relax.analysis.post_order_visit(f.body, visit)
    return sorted(out)


def attention_mixed_layouts(h=8, hkv=2, d=64, s=16, s_kv=None, b=1, dtype=F16, layouts="BSNH,BNSH,BNSH",
                            out_layout="BSNH", causal="BottomRight", expand="repeat"):
    """``R.nn.attention`` whose q, k, v each arrive in their own layout ("BSNH" or "BNSH", comma
    separated in ``layouts``; a BNSH operand enters through ``permute_dims``), K/V expanded by
    ``R.repeat`` on their head axis (``expand="repeat"``) or not (``"none"``); ``out_layout="BNSH"``
    permutes the result back."""
    syms = {}
    s_, skv_ = _dim(s, syms), _dim(s_kv if s_kv is not None else s, syms)
    lay = layouts.split(",")
    bb = relax.BlockBuilder()

    def param(name, seq, heads, layout):
        shape = [b, seq, heads, d] if layout == "BSNH" else [b, heads, seq, d]
        return relax.Var(name, _tensor(shape, dtype))

    q = param("q", s_, h, lay[0])
    k = param("k", skv_, hkv, lay[1])
    v = param("v", skv_, hkv, lay[2])
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            ops = []
            for x, layout, is_kv in ((q, lay[0], False), (k, lay[1], True), (v, lay[2], True)):
                head_axis = 2 if layout == "BSNH" else 1
                if is_kv and expand == "repeat":
                    x = bb.emit(R.repeat(x, h // hkv, axis=head_axis))
                if layout == "BNSH":
                    x = bb.emit(R.permute_dims(x, [0, 2, 1, 3]))
                ops.append(x)
            o = bb.emit(R.nn.attention(*ops, causal_mask=causal))
            if out_layout == "BNSH":
                o = bb.emit(R.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit_output(o)
        bb.emit_func_output(o)
    return _finish(bb)


def hf_chains_shared_kv(sites=2, h=8, hkv=2, d=64, s=16, b=1, dtype=F16, share_expansion=False):
    """``sites`` HF-style 3-D chains (BNSH in, (B, S, H*D) out, causal mask from positions) whose
    queries differ and that read the same BNSH K/V; ``share_expansion``: one ``repeat_kv`` feeds
    every chain, else each chain expands K/V itself (as two layers reading one cache would)."""
    bb = relax.BlockBuilder()
    qs = [relax.Var(f"q{i}", _tensor([b, h, s, d], dtype)) for i in range(sites)]
    k = relax.Var("k", _tensor([b, hkv, s, d], dtype))
    v = relax.Var("v", _tensor([b, hkv, s, d], dtype))
    r = h // hkv
    fmin = float(np.finfo(np.float16).min)
    with bb.function("main", qs + [k, v]):
        with bb.dataflow():
            def repeat_kv(x):
                return hf_repeat_kv(bb, x, b, hkv, r, s, d)

            shared = (repeat_kv(k), repeat_kv(v)) if share_expansion else None
            outs = []
            for q in qs:
                kk, vv = shared or (repeat_kv(k), repeat_kv(v))
                q3 = bb.emit(R.reshape(q, [b * h, s, d]))
                k3 = bb.emit(R.reshape(bb.emit(R.permute_dims(kk, [0, 1, 3, 2])), [b * h, d, s]))
                sc = bb.emit(R.reshape(bb.emit(R.matmul(q3, k3)), [b, h, s, s]))
                sc = bb.emit(R.multiply(sc, relax.const(1.0 / math.sqrt(d), dtype)))
                pos = bb.emit(R.arange(0, s, 1, "int64"))
                future = bb.emit(R.greater(pos, bb.emit(R.reshape(pos, [s, 1]))))
                mask = bb.emit(R.where(future, relax.const(fmin, dtype), relax.const(0.0, dtype)))
                sc = bb.emit(R.add(sc, bb.emit(R.reshape(mask, [1, 1, s, s]))))
                p = bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(sc, "float32")), axis=-1), dtype))
                p3 = bb.emit(R.reshape(p, [b * h, s, s]))
                o = bb.emit(R.reshape(bb.emit(R.matmul(p3, bb.emit(R.reshape(vv, [b * h, s, d])))), [b, h, s, d]))
                outs.append(bb.emit(R.reshape(bb.emit(R.permute_dims(o, [0, 2, 1, 3])), [b, s, h * d])))
            o = bb.emit_output(R.concat(outs, axis=-1))
        bb.emit_func_output(o)
    return _finish(bb)


def composite_calls_per_function(mod, codegen_name="flash_attn"):
    """``{function name: sorted composite names of the offloaded calls it makes}`` (attention's by default)."""
    codegen = {}
    for gv, f in mod.functions.items():
        if _codegen_is(f, codegen_name):
            found = []
            relax.analysis.post_order_visit(f.body, lambda e, found=found: found.append(str(e.attrs["Composite"]))
                                            if isinstance(e, relax.Function) and e.attrs is not None
                                            and "Composite" in e.attrs else None)
            codegen[gv] = found[0]
    out = {}
    for gv, f in mod.functions.items():
        if not isinstance(f, relax.Function) or gv in codegen:
            continue
        calls = []
        for block in f.body.blocks:  # bindings, not nodes: one entry per call site
            for b in block.bindings:
                if isinstance(b.value, relax.Call) and b.value.op in codegen:
                    calls.append(codegen[b.value.op])
        if calls:
            out[gv.name_hint] = sorted(calls)
    return out


def report_partition_disagreement(mod, mqa=True, **partition_kwargs):
    """What ``offload_report`` says and ``partition_for_cutlass`` does differently, as readable lines.

    Per function: the composites of the sites reported offloaded must be exactly the composite calls
    left by the partition, and every rejected site must keep its attention outside any composite.
    An empty list means they agree."""
    from mqa_byoc import offload_report, partition_for_cutlass

    report = offload_report(mod, mqa=mqa)
    part = partition_for_cutlass(mod, mqa=mqa, **partition_kwargs)
    reported = {}
    for s in report:
        if s.offloaded:  # a chunked mask's site: one composite per call (site.composite_calls)
            reported.setdefault(s.function, []).extend([s.composite] * s.composite_calls)
    reported = {f: sorted(c) for f, c in reported.items()}
    made = composite_calls_per_function(part)
    problems = [f"{f}: report offloads {reported.get(f, [])}, partition made {made.get(f, [])}"
                for f in sorted(set(reported) | set(made)) if reported.get(f, []) != made.get(f, [])]
    for s in report:
        if not s.offloaded:
            # its R.nn.attention, or its chain: the softmax stays (its matmuls may be GEMMs on cuBLASLt)
            left = sum(count_ops(part, op, s.function) for op in (
                "relax.nn.attention", "relax.nn.attention_bias", "relax.matmul", "relax.nn.softmax"))
            if left == 0:
                problems.append(f"{s.function}: site {s.output} rejected ({s.reason}) but no attention is left")
    return problems


def to_bsnh(x, layout):
    """A 4-D array in ``layout`` ("BSNH" or "BNSH") as BSNH."""
    return x if layout == "BSNH" else x.transpose(0, 2, 1, 3)


def mask_allowed(s_q, s_kv, causal=None, window=None, chunk=None):
    """(S_q, S_kv) bool: which keys each query sees. ``causal`` "BottomRight" / "TopLeft" / None;
    ``window`` w: the w keys up to the diagonal, bottom-right aligned like FA2 (also without causal);
    ``chunk`` c: only the keys of the query's own block of c positions (Llama 4's chunked layers)."""
    i = np.arange(s_q)[:, None] + (0 if causal == "TopLeft" else s_kv - s_q)
    j = np.arange(s_kv)[None, :]
    allowed = np.ones((s_q, s_kv), bool)
    if causal is not None or window is not None or chunk is not None:
        allowed &= j <= i
    if window is not None:
        allowed &= j > i - window
    if chunk is not None:
        allowed &= j // chunk == i // chunk
    return allowed


def reference_attention(q, k, v, layouts=("BSNH", "BSNH", "BSNH"), out_layout="BSNH", scale=None, causal=None,
                        window=None, grouping="repeat", chunk=None):
    """float32 NumPy attention: what each graph of this module computes.

    Query head h reads K/V head ``h // (H / H_kv)`` (``grouping="repeat"``: R.repeat, broadcast,
    HF repeat_kv, FA2) or ``h % H_kv`` (``"tile"``). ``out_layout``: "BSNH", "BNSH" or "merged"
    ((B, S, H*D)). ``causal``, ``window``, ``chunk``: as :func:`mask_allowed`. Rows that see no key are 0."""
    q, k, v = (to_bsnh(x.astype("float32"), lay) for x, lay in zip((q, k, v), layouts))
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    heads = np.arange(h) // (h // hkv) if grouping == "repeat" else np.arange(h) % hkv
    k, v = k[:, :, heads], v[:, :, heads]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(d) if scale is None else scale)
    allowed = mask_allowed(s.shape[2], s.shape[3], causal, window, chunk)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    if out_layout == "BNSH":
        return o.transpose(0, 2, 1, 3)
    if out_layout == "merged":
        return o.reshape(o.shape[0], o.shape[1], -1)
    return o
def bsh_chain(d=64, s=16, s_kv=None, b=1, dtype=F16, scale=None, divide=False, cast_scale=True,
              mask="none", softmax_dtype="float32"):
    """The 3-D single-head chain (upstream ``test_attention_rewrite_offload``'s BSH form): Q, K, V of
    shape (B, S, D) with no head axis; ``matmul(q, permute_dims(k, [0, 2, 1]))``; multiply by the scale
    (``divide``: divide by its inverse), a float32 constant astype'd to ``dtype`` when ``cast_scale``;
    an optional causal mask; softmax (in ``softmax_dtype`` with astype around it; None: in ``dtype``);
    ``matmul(probs, v)`` -> (B, S, D).
    ``mask``: "none" | "add" | "where" (constant (1, S, S_kv) causal masks, static lengths) |
    "positions" (an additive (S, S_kv) mask built from arange, any lengths) | "runtime" (a mask input).
    ``scale``: the scale the graph applies (default 1/sqrt(d))."""
    syms = {}
    s_kv = s if s_kv is None else s_kv
    s_, skv_, b_ = _dim(s, syms), _dim(s_kv, syms), _dim(b, syms)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b_, s_, d], dtype))
    k = relax.Var("k", _tensor([b_, skv_, d], dtype))
    v = relax.Var("v", _tensor([b_, skv_, d], dtype))
    params = [q, k, v]
    if mask == "runtime":
        params.append(relax.Var("mask", _tensor([b_, s_, skv_], dtype)))
    fmin = float(np.finfo(np.float16).min)
    with bb.function("main", params):
        with bb.dataflow():
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(k, [0, 2, 1]))))
            c = 1.0 / scale if divide else scale
            c = bb.emit(R.astype(relax.const(c, "float32"), dtype)) if cast_scale else relax.const(c, dtype)
            sc = bb.emit(R.divide(sc, c) if divide else R.multiply(sc, c))
            if mask == "add":
                sc = bb.emit(R.add(sc, relax.const(causal_mask_np(s, s_kv, 0, fmin, dtype)[0])))
            elif mask == "where":
                keep = relax.const(causal_mask_np(s, s_kv, True, False, "bool")[0])
                sc = bb.emit(R.where(keep, sc, relax.const(fmin, dtype)))
            elif mask == "positions":
                # key j is in the future of query i when j > i + S_kv - S_q (bottom-right aligned)
                rows = bb.emit(R.reshape(bb.emit(R.arange(skv_ - s_, skv_, 1, "int64")), [s_, 1]))
                future = bb.emit(R.greater(bb.emit(R.arange(0, skv_, 1, "int64")), rows))
                sc = bb.emit(R.add(sc, bb.emit(R.where(future, relax.const(fmin, dtype), relax.const(0.0, dtype)))))
            elif mask == "runtime":
                sc = bb.emit(R.add(sc, params[3]))
            if softmax_dtype is None:
                p = bb.emit(R.nn.softmax(sc, axis=-1))
            else:
                p = bb.emit(R.astype(R.nn.softmax(bb.emit(R.astype(sc, softmax_dtype)), axis=-1), dtype))
            o = bb.emit_output(R.matmul(p, v))
        bb.emit_func_output(o)
    return _finish(bb)


# ---- a graph that calls one offloaded site by name, for export tests of the native wrapper ----

def site_call_executable(symbol: str = "mqa_site0"):
    """``main(q (1, 4, 8, 64), k, v (1, 4, 2, 64))``, float16, calling the external ``symbol`` by
    ``call_dps_packed`` (as a partitioned graph calls its offloaded attention), compiled for llvm;
    with its inputs (zeros: the wrapper's checks reject them before any kernel runs)."""
    import tvm
    from tvm.script import relax as RS

    @tvm.script.ir_module
    class Mod:
        @RS.function
        def main(q: RS.Tensor((1, 4, 8, 64), "float16"), k: RS.Tensor((1, 4, 2, 64), "float16"),
                 v: RS.Tensor((1, 4, 2, 64), "float16")):
            out = RS.call_dps_packed(symbol, (q, k, v), out_ty=RS.Tensor((1, 4, 8, 64), "float16"))
            return out

    q = tvm.runtime.tensor(np.zeros((1, 4, 8, 64), "float16"))
    kv = tvm.runtime.tensor(np.zeros((1, 4, 2, 64), "float16"))
    return tvm.compile(Mod, target="llvm"), q, kv


def import_c_source(ex, code: str, symbols: list[str]) -> None:
    """Add C++ ``code`` exporting ``symbols`` to ``ex`` (compiled and linked at export)."""
    import tvm

    ex.mod.import_module(tvm.get_global_func("runtime.CSourceModuleCreate")(code, "cc", symbols, []))


def native_export_skip_reason() -> str | None:
    """Why a native export cannot run here (None when it can): it links FA2 kernel objects from a
    prebuilt ``MQA_BYOC_KERNEL_DIR`` (compiling one takes minutes), with g++, and compiles the
    dispatcher when that dir's is not this code's (seconds; nvcc and flash-attn's sources)."""
    import os
    import shutil

    from mqa_byoc import kernels as K

    if not os.environ.get("MQA_BYOC_KERNEL_DIR"):
        return "no prebuilt FA2 kernels: set MQA_BYOC_KERNEL_DIR (a `mqa-byoc build-kernels --out DIR` directory)"
    if shutil.which("g++") is None:
        return "g++ not found (export links the kernels)"
    try:
        K.find_nvcc()
        K.flash_attn_source(download=False, progress=lambda _m: None)
    except K.NativeKernelsUnavailable as err:
        return str(err)
    return None


def safe_softmax_chain(h=8, hkv=2, d=64, s=16, s_kv=None, b=1, dtype=F16, cond="torch", masked=False):
    """torch's SDPA decomposition as TVM's frontend imports it, after ToMixedPrecision: BNSH, K/V
    expanded by broadcasting, ``softmax`` in float32, then the safe softmax's dead-row guard
    ``where(cond, 0, probs)``. ``cond`` spells the guard:

    - "torch": ``not(any(not(scores == -inf)))`` (any as a max over int8, the frontend's spelling),
      compared on a second astype of the fp16 scores (what ToMixedPrecision leaves);
    - "all": ``all(scores == -inf)`` (a min); "ne": ``not(any(scores != -inf))``;
    - not the guard: "any" (``any(scores == -inf)``), "no-not" (``any(not(scores == -inf))``),
      "heads-axis" (reduced over the query axis), "threshold" (``all(scores < -1)``), "raw" (the raw
      scores compared while the softmax sees the masked ones; needs ``masked``).
    ``masked``: a causal mask (aligned to the last key) added to the scores before the softmax."""
    s_kv = s if s_kv is None else s_kv
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, h, s, d], dtype))
    k = relax.Var("k", _tensor([b, hkv, s_kv, d], dtype))
    v = relax.Var("v", _tensor([b, hkv, s_kv, d], dtype))
    r = h // hkv
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = (hf_repeat_kv(bb, x, b, hkv, r, s_kv, d) for x in (k, v))
            q = bb.emit(R.multiply(q, relax.const(1.0 / math.sqrt(d), dtype)))
            raw = bb.emit(R.matmul(q, bb.emit(R.permute_dims(kk, [0, 1, 3, 2]))))
            sc = raw
            if masked:
                keys = bb.emit(R.arange(0, s_kv, 1, "int64"))
                last = bb.emit(R.reshape(bb.emit(R.arange(s_kv - s, s_kv, 1, "int64")), [s, 1]))
                future = bb.emit(R.greater(keys, last))
                mask = bb.emit(R.where(future, relax.const(-np.inf, dtype), relax.const(0.0, dtype)))
                sc = bb.emit(R.add(sc, bb.emit(R.reshape(mask, [1, 1, s, s_kv]))))
            probs = bb.emit(R.nn.softmax(bb.emit(R.astype(sc, "float32")), axis=-1))
            seen = bb.emit(R.astype(raw if cond == "raw" else sc, "float32"))
            neg_inf = relax.const(-np.inf, "float32")

            def reduce(x, op, axis=-1):
                x8 = bb.emit(R.astype(x, "int8"))
                return bb.emit(R.astype(bb.emit(op(x8, axis=[axis], keepdims=True)), "bool"))

            eq = bb.emit(R.equal(seen, neg_inf))
            if cond in ("torch", "raw"):
                c = bb.emit(R.logical_not(reduce(bb.emit(R.logical_not(eq)), R.max)))
            elif cond == "all":
                c = reduce(eq, R.min)
            elif cond == "ne":
                c = bb.emit(R.logical_not(reduce(bb.emit(R.not_equal(seen, neg_inf)), R.max)))
            elif cond == "any":
                c = reduce(eq, R.max)
            elif cond == "no-not":
                c = reduce(bb.emit(R.logical_not(eq)), R.max)
            elif cond == "heads-axis":
                c = bb.emit(R.logical_not(reduce(bb.emit(R.logical_not(eq)), R.max, axis=-2)))
            elif cond == "threshold":
                c = reduce(bb.emit(R.less(seen, relax.const(-1.0, "float32"))), R.min)
            else:
                raise ValueError(cond)
            zero = bb.emit(R.full_like(probs, relax.const(0.0, "float32")))
            p = bb.emit(R.astype(bb.emit(R.where(c, zero, probs)), dtype))
            o = bb.emit_output(R.matmul(p, vv))
        bb.emit_func_output(o)
    return _finish(bb)


def sink_chain(h=8, hkv=2, d=64, s=16, s_kv=None, b=1, dtype=F16, window=None, causal=True, shift="topk",
               sinks_dtype="float32", score_mod=None, sink_at="logits", lse="torch", mismatch=None):
    """GPT-OSS's eager attention with sinks as TVM's PyTorch frontend emits it after ToMixedPrecision: BNSH,
    HF ``repeat_kv``, Q@K^T in ``dtype`` times the scale, cast to float32, an additive mask from positions
    (bottom-right causal, or a window of ``window`` keys), the per-head ``sinks`` (a parameter (H,)) reshaped
    to (1, H, 1, 1), broadcast over the rows and concatenated on the key axis, minus the row maximum
    (``shift``: "topk" as the frontend spells ``max(dim=-1)``, "max", or None), softmax, the sink column
    sliced off, cast, @ V. Inputs q, k, v, sinks; output (B, S, H*D).

    ``score_mod`` replaces the sinks with another score modification the kernels do not compute:
    "softcap" (``tanh(x / 50) * 50``, Gemma 2), "alibi" (a per-head linear bias on the key distance),
    "square" (``x * x``, something no form explains).

    ``sink_at="output"``: the sink applied after P @ V as GraniteSWA does, ``O * sigmoid(lse - sink)`` with
    ``lse`` the masked scores' log-sum-exp (``lse``: "torch", its decomposition: the row maximum, 0 where
    infinite, subtracted and added back; "plain": ``log(sum(exp(s)))``), O in float32, then cast. The
    same attention unless ``mismatch`` makes it another: "sign" (``sigmoid(sink - lse)``), "unmasked"
    (the log-sum-exp of the scores before the mask), "rows" (the sinks broadcast over the query rows, not
    the heads: needs S_q == H)."""
    syms = {}
    s_, skv_ = _dim(s, syms), _dim(s_kv if s_kv is not None else s, syms)
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, h, s_, d], dtype))
    k = relax.Var("k", _tensor([b, hkv, skv_, d], dtype))
    v = relax.Var("v", _tensor([b, hkv, skv_, d], dtype))
    sinks = relax.Var("sinks", _tensor([h], sinks_dtype))
    r = h // hkv
    f32 = "float32"
    with bb.function("main", [q, k, v, sinks]):
        with bb.dataflow():
            kk, vv = hf_repeat_kv(bb, k, b, hkv, r, skv_, d), hf_repeat_kv(bb, v, b, hkv, r, skv_, d)
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(kk, [0, 1, 3, 2]))))
            sc = bb.emit(R.multiply(sc, relax.const(1.0 / math.sqrt(d), dtype)))
            sc = bb.emit(R.astype(sc, f32))
            if score_mod == "softcap":
                sc = bb.emit(R.multiply(R.tanh(bb.emit(R.divide(sc, relax.const(50.0, f32)))), relax.const(50.0, f32)))
            elif score_mod == "square":
                sc = bb.emit(R.multiply(sc, sc))
            cols = bb.emit(R.reshape(R.arange(0, skv_, 1, "int64"), [1, skv_]))
            rows = bb.emit(R.reshape(R.arange(skv_ - s_, skv_, 1, "int64"), [s_, 1]))
            if score_mod == "alibi":
                dist = bb.emit(R.astype(R.subtract(cols, rows), f32))
                slopes = relax.const((2.0 ** -np.arange(1, h + 1)).astype("float32").reshape(1, h, 1, 1))
                sc = bb.emit(R.add(sc, R.multiply(slopes, R.reshape(dist, [1, 1, s_, skv_]))))
            unmasked = sc
            if causal or window:
                hidden = bb.emit(R.greater(cols, rows))
                if window:
                    hidden = bb.emit(R.logical_or(hidden, R.less_equal(cols, R.subtract(rows, relax.const(window, "int64")))))
                fmin = float(np.finfo(np.float32).min)
                mask = bb.emit(R.where(hidden, relax.const(fmin, f32), relax.const(0.0, f32)))
                sc = bb.emit(R.add(sc, R.reshape(mask, [1, 1, s_, skv_])))
            if sink_at == "output":
                scale = sink_output_scale(bb, sc if mismatch != "unmasked" else unmasked, sinks, h, lse, mismatch)
            elif score_mod is None:
                col = bb.emit(R.broadcast_to(R.reshape(sinks, [1, h, 1, 1]), [b, h, s_, 1]))
                if sinks_dtype != f32:
                    col = bb.emit(R.astype(col, f32))
                sc = bb.emit(R.concat([sc, col], axis=-1))
            if shift == "topk":
                top = bb.emit(R.topk(sc, k=1, axis=-1, ret_type="both", largest=True, dtype="int64"))
                sc = bb.emit(R.subtract(sc, bb.emit(relax.TupleGetItem(top, 0))))
            elif shift == "max":
                sc = bb.emit(R.subtract(sc, R.max(sc, axis=-1, keepdims=True)))
            p = bb.emit(R.nn.softmax(sc, axis=-1))
            if score_mod is None and sink_at == "logits":
                p = bb.emit(R.strided_slice(p, axes=[3], begin=[0], end=[-1]))
            p = bb.emit(R.astype(p, dtype))
            o = bb.emit(R.matmul(p, vv))
            if sink_at == "output":
                o = bb.emit(R.astype(R.multiply(bb.emit(R.astype(o, f32)), scale), dtype))
            o = bb.emit(R.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit_output(R.reshape(o, [b, s_, h * d]))
        bb.emit_func_output(o)
    return _finish(bb)


def sink_output_scale(bb, logits, sinks, h, lse="torch", mismatch=None):
    """``sigmoid(logsumexp(logits, -1) - sinks_h)[..., None]`` (B, H, S_q, 1), float32, as GraniteSWA's eager
    code exports it (``sink_chain``'s ``sink_at="output"``, the fuzzer's ``Site.sink_at``): the log-sum-exp
    in the logits' dtype ("torch": torch's decomposition; "plain": ``log(sum(exp))``), then float32;
    ``mismatch`` as ``sink_chain`` says."""
    f32, dt = "float32", str(logits.ty.dtype)
    if lse == "torch":
        m = bb.emit(R.max(logits, axis=-1, keepdims=True))
        m = bb.emit(R.where(R.equal(R.abs(m), relax.const(float("inf"), dt)), relax.const(0.0, dt), m))
        total = bb.emit(R.sum(R.exp(bb.emit(R.subtract(logits, m))), axis=-1))
        out = bb.emit(R.add(R.log(total), R.squeeze(m, axis=[-1])))
    else:
        out = bb.emit(R.log(R.sum(R.exp(logits), axis=-1)))
    if dt != f32:
        out = bb.emit(R.astype(out, f32))
    if mismatch == "rows":
        per_head = bb.emit(R.reshape(R.astype(sinks, f32), [1, 1, h]))
    else:
        per_head = bb.emit(R.reshape(R.astype(sinks, f32), [1, h, 1]))
    z = R.subtract(per_head, out) if mismatch == "sign" else R.subtract(out, per_head)
    return bb.emit(R.expand_dims(R.sigmoid(bb.emit(z)), axis=[-1]))


def reference_sink_attention(q, k, v, sinks, window=None, causal=True):
    """float32 NumPy attention with sinks: ``sink_chain``'s inputs (BNSH) and output (B, S, H*D)."""
    q, k, v = (to_bsnh(x.astype("float32"), "BNSH") for x in (q, k, v))
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    heads = np.arange(h) // (h // hkv)
    k, v = k[:, :, heads], v[:, :, heads]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    s = np.where(mask_allowed(s.shape[2], s.shape[3], "BottomRight" if (causal or window) else None, window), s, -np.inf)
    col = np.broadcast_to(sinks.astype("float32")[None, :, None, None], s.shape[:3] + (1,))
    logits = np.concatenate([s, col], axis=-1)
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    return o.reshape(o.shape[0], o.shape[1], h * d)


def softcap_chain(h=8, hkv=4, d=64, s=16, s_kv=None, b=1, dtype=F16, window=None, causal=True, cap=50.0,
                  scale=None, form="gemma", dv=None):
    """Gemma 2's eager attention with logit soft-capping as TVM's PyTorch frontend emits it after
    ToMixedPrecision: BNSH, HF ``repeat_kv``, ``Q@K^T * scale`` (Gemma's ``query_pre_attn_scalar ** -0.5``;
    default ``1/sqrt(d)``) cast to float32, ``/ cap``, ``tanh``, ``* cap``, an additive mask from positions
    (bottom-right causal, or a window of ``window`` keys), softmax, cast, @ V. Inputs q, k, v; output
    (B, S, H*D).

    ``form`` spells the soft-cap: "gemma" (as above), "reciprocal" (``tanh(x * (1/cap)) * cap``, the cap
    constant on the left), and, not what the kernels compute: "mask-inside" (the mask added before the tanh),
    "negative" (``tanh(x / cap) * -cap``), "two-caps" (a second tanh). ``dv``: V's head dim when it differs
    from ``d``."""
    syms = {}
    s_, skv_ = _dim(s, syms), _dim(s_kv if s_kv is not None else s, syms)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dv = d if dv is None else dv
    bb = relax.BlockBuilder()
    q = relax.Var("q", _tensor([b, h, s_, d], dtype))
    k = relax.Var("k", _tensor([b, hkv, skv_, d], dtype))
    v = relax.Var("v", _tensor([b, hkv, skv_, dv], dtype))
    r = h // hkv
    f32 = "float32"
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = hf_repeat_kv(bb, k, b, hkv, r, skv_, d), hf_repeat_kv(bb, v, b, hkv, r, skv_, dv)
            sc = bb.emit(R.matmul(q, bb.emit(R.permute_dims(kk, [0, 1, 3, 2]))))
            sc = bb.emit(R.astype(R.multiply(sc, relax.const(scale, dtype)), f32))
            cols = bb.emit(R.reshape(R.arange(0, skv_, 1, "int64"), [1, skv_]))
            rows = bb.emit(R.reshape(R.arange(skv_ - s_, skv_, 1, "int64"), [s_, 1]))
            mask = None
            if causal or window:
                hidden = bb.emit(R.greater(cols, rows))
                if window:
                    hidden = bb.emit(R.logical_or(hidden, R.less_equal(cols, R.subtract(rows, relax.const(window, "int64")))))
                fmin = float(np.finfo(np.float32).min)
                mask = bb.emit(R.reshape(R.where(hidden, relax.const(fmin, f32), relax.const(0.0, f32)),
                                         [1, 1, s_, skv_]))
            if form == "mask-inside" and mask is not None:
                sc = bb.emit(R.add(sc, mask))
            c = relax.const(cap, f32)
            if form == "reciprocal":
                sc = bb.emit(R.multiply(c, R.tanh(bb.emit(R.multiply(sc, relax.const(1.0 / cap, f32))))))
            else:
                sc = bb.emit(R.multiply(R.tanh(bb.emit(R.divide(sc, c))),
                                        relax.const(-cap, f32) if form == "negative" else c))
            if form == "two-caps":
                sc = bb.emit(R.multiply(R.tanh(bb.emit(R.divide(sc, c))), c))
            if mask is not None and form != "mask-inside":
                sc = bb.emit(R.add(sc, mask))
            p = bb.emit(R.astype(R.nn.softmax(sc, axis=-1), dtype))
            o = bb.emit(R.matmul(p, vv))
            o = bb.emit(R.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit_output(R.reshape(o, [b, s_, h * dv]))
        bb.emit_func_output(o)
    return _finish(bb)


def reference_softcap_attention(q, k, v, cap=50.0, scale=None, window=None, causal=True):
    """float32 NumPy soft-capped attention: ``softcap_chain``'s inputs (BNSH) and output (B, S, H*D)."""
    q, k, v = (to_bsnh(x.astype("float32"), "BNSH") for x in (q, k, v))
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    heads = np.arange(h) // (h // hkv)
    k, v = k[:, :, heads], v[:, :, heads]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(d) if scale is None else scale)
    s = np.tanh(s / cap) * cap
    allowed = mask_allowed(s.shape[2], s.shape[3], "BottomRight" if (causal or window) else None, window)
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    return o.reshape(o.shape[0], o.shape[1], h * v.shape[3])
