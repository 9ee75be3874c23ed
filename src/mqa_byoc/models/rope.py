"""Split of the fused qkv projection and RoPE on q and k, as one TIR kernel.

The decoder's attention with fused projections starts from ``qkv = x @ qkv_proj.weight.T``
``(B, S, (H + 2 H_kv) * D)``. Written with Relax ops (:func:`rope_ops`: ``R.split``, reshapes, and
HF's ``x * cos + rotate_half(x) * sin`` on q and k with cos / sin tables computed per call), TVM
builds it for CUDA as five kernels a layer (three for the split, whose outputs are separate blocks,
and one for each RoPE) plus three a call for the tables: a decode step of batch 1 spends more time
in launches and gaps than in these kernels' work. :func:`split_rope` computes the same values in one
kernel a layer: one spatial block over ``(B * S rows, H + 2 H_kv heads, D)`` (dlight's fallback
schedule on CUDA) that writes q and k rotated and v as it is, with the angles computed in the kernel.

Numerics are those of :func:`rope_ops`, element by element: the angle is
``float32(position) * inv_freq[d % (D / 2)]`` (``inv_freq`` the same float32 constant), cos and sin
are rounded to the model's dtype, and ``x * cos + rotate_half(x) * sin`` is computed in that dtype.

TVM ships a kernel of this shape (``tvm.relax.frontend.nn.llm.position_embedding.llama_rope``), but in
0.27 it cannot be called with Llama's plain RoPE: without a ``rope_type`` its kernel reads
``rope_scaling["rope_type"]`` and fails, and with ``"default"`` it is refused as unsupported.
"""

from __future__ import annotations

import numpy as np


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's inverse frequencies ``(D / 2,)`` float32: ``theta ** -(2 i / D)``, computed in float64."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))).astype("float32")


def rope_tables(positions_start, seq_len, head_dim: int, theta: float, dtype: str):
    """cos / sin tables ``(1, S, 1, D)`` in ``dtype`` for positions start .. start + S - 1."""
    from tvm import relax

    from .attention_forms import emit_expr, nn_frontend, simplify_index

    nn, op = nn_frontend()
    pos = op.arange(positions_start, simplify_index(positions_start + seq_len), dtype="float32")
    freqs = op.multiply(
        op.reshape(pos, (seq_len, 1)),
        nn.Tensor.from_const(inv_freq(head_dim, theta).reshape(1, head_dim // 2)),
    )
    emb = op.concat([freqs, freqs], dim=-1)  # (S, D), HF's non-interleaved layout
    cos = emit_expr(relax.op.cos(emb._expr), "rope_cos")
    sin = emit_expr(relax.op.sin(emb._expr), "rope_sin")
    if dtype != "float32":
        cos, sin = op.astype(cos, dtype), op.astype(sin, dtype)
    return op.reshape(cos, (1, seq_len, 1, head_dim)), op.reshape(sin, (1, seq_len, 1, head_dim))


def apply_rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin on ``(B, S, N, D)``; rotate_half = concat(-x2, x1)."""
    from .attention_forms import nn_frontend

    _, op = nn_frontend()
    x1, x2 = op.split(x, 2, axis=-1)
    rot = op.concat([op.negative(x2), x1], dim=-1)
    return op.add(op.multiply(x, cos), op.multiply(rot, sin))


def heads_with_rope(q, k, v, tables, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v ``(B, S, N * D)`` (the projections' outputs) as ``(B, S, N, D)``, q and k rotated with
    ``tables`` (cos, sin from :func:`rope_tables`), with Relax ops."""
    from .attention_forms import nn_frontend

    _, op = nn_frontend()
    b, s, _ = q.shape
    q = op.reshape(q, (b, s, num_heads, head_dim))
    k = op.reshape(k, (b, s, num_kv_heads, head_dim))
    v = op.reshape(v, (b, s, num_kv_heads, head_dim))
    cos, sin = tables
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def rope_ops(qkv, tables, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v ``(B, S, N, D)`` from the fused ``qkv`` with Relax ops: ``R.split``, then
    :func:`heads_with_rope`."""
    from .attention_forms import nn_frontend

    _, op = nn_frontend()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = op.split(qkv, [q_size, q_size + kv_size], axis=-1)
    return heads_with_rope(q, k, v, tables, num_heads, num_kv_heads, head_dim)


def split_rope_func(num_heads: int, num_kv_heads: int, head_dim: int, dtype: str):
    """The TIR kernel: ``(qkv (B, S, (H + 2 H_kv) D), inv_freq (D / 2,) float32, offset, q, k, v)``,
    writing q ``(B, S, H, D)`` and k ``(B, S, H_kv, D)`` rotated for positions ``offset + s`` and v
    ``(B, S, H_kv, D)``."""
    from tvm.script import tirx as T

    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    n_q, n_qk = num_heads, num_heads + num_kv_heads
    heads = num_heads + 2 * num_kv_heads
    d_all, half = head_dim, head_dim // 2

    from tvm import tirx

    def rotated(qkv, freq, b, s, h, d, offset):
        """x * cos + rotate_half(x) * sin of element (b, s, h, d), in ``dtype`` as rope_ops computes it."""
        angle = tirx.Cast("float32", offset + s) * freq[d % half]
        x = qkv[b, s, h * d_all + d]
        rot = tirx.if_then_else(d < half, tirx.const(0, dtype) - qkv[b, s, h * d_all + d + half],
                                qkv[b, s, h * d_all + d - half])
        return x * tirx.Cast(dtype, tirx.cos(angle)) + rot * tirx.Cast(dtype, tirx.sin(angle))

    def b_of(r, seq_len):
        """b of row r of the B * S rows, in 32-bit arithmetic (a division by a symbolic size)."""
        return tirx.Cast("int64", tirx.floordiv(tirx.Cast("int32", r), tirx.Cast("int32", seq_len)))

    def s_of(r, seq_len):
        """s of row r of the B * S rows."""
        return tirx.Cast("int64", tirx.floormod(tirx.Cast("int32", r), tirx.Cast("int32", seq_len)))

    # One block over (row, head, d), rows = B * S: the fused loop's index splits by constants (heads, D)
    # but for the row's (b, s).
    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def split_rope(var_qkv: T.handle, var_inv_freq: T.handle, offset: T.int64, var_q: T.handle,
                   var_k: T.handle, var_v: T.handle):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        batch = T.int64()
        seq_len = T.int64()
        qkv = T.match_buffer(var_qkv, (batch, seq_len, T.int64(heads * d_all)), dtype)
        freq = T.match_buffer(var_inv_freq, (T.int64(half),), "float32")
        q = T.match_buffer(var_q, (batch, seq_len, T.int64(n_q), T.int64(d_all)), dtype)
        k = T.match_buffer(var_k, (batch, seq_len, T.int64(num_kv_heads), T.int64(d_all)), dtype)
        v = T.match_buffer(var_v, (batch, seq_len, T.int64(num_kv_heads), T.int64(d_all)), dtype)
        for r_, h_, d_ in T.grid(batch * seq_len, T.int64(heads), T.int64(d_all)):
            with T.sblock("split_rope"):
                r, h, d = T.axis.remap("SSS", [r_, h_, d_])
                if h < T.int64(n_q):
                    q[b_of(r, seq_len), s_of(r, seq_len), h, d] = rotated(
                        qkv, freq, b_of(r, seq_len), s_of(r, seq_len), h, d, offset)
                elif h < T.int64(n_qk):
                    k[b_of(r, seq_len), s_of(r, seq_len), h - T.int64(n_q), d] = rotated(
                        qkv, freq, b_of(r, seq_len), s_of(r, seq_len), h, d, offset)
                else:
                    v[b_of(r, seq_len), s_of(r, seq_len), h - T.int64(n_qk), d] = qkv[
                        b_of(r, seq_len), s_of(r, seq_len), h * d_all + d]
    # fmt: on
    return split_rope


def split_rope(qkv, offset, num_heads: int, num_kv_heads: int, head_dim: int, theta: float):
    """q, k, v ``(B, S, N, D)`` from the fused ``qkv`` ``(B, S, (H + 2 H_kv) D)`` in one kernel (see the
    module docstring); ``offset``: the position of the first row (0, or the cached length)."""
    from .attention_forms import nn_frontend

    nn, op = nn_frontend()
    b, s, _ = qkv.shape
    func = split_rope_func(num_heads, num_kv_heads, head_dim, qkv.dtype)
    freqs = nn.Tensor.from_const(inv_freq(head_dim, theta))
    out = [nn.Tensor.placeholder((b, s, n, head_dim), qkv.dtype) for n in (num_heads, num_kv_heads, num_kv_heads)]
    if isinstance(offset, int):
        from tvm import tirx

        offset = tirx.IntImm("int64", offset)
    q, k, v = op.tensor_ir_op(func, "split_rope", args=[qkv, freqs, offset], out=out)
    return q, k, v
