"""Python provider of var-len attention: the global function ``mqa_byoc.flash_attn_varlen_forward``.

Registered when :mod:`mqa_byoc.runtime.providers` is imported; uses the same backend choice
(:mod:`.backends`: flash-attn's ``varlen_fwd`` when installed, else
``torch.ops.aten._flash_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``), streams and NVTX
switch. Runtime-only: no ``tvm.relax``.
"""

from __future__ import annotations

import tvm_ffi

from mqa_byoc.contract import PY_VAR_LEN_FORWARD_FUNC

from .backends import ProviderUnavailableError, active_backend, as_torch, nvtx_enabled, nvtx_range_name


def _max_length(torch, t, name: str, total: int) -> int:
    """A host tensor's value (clamped to ``total``); a device tensor is not read (that would
    synchronize the stream): ``total`` bounds every sequence."""
    if t.numel() != 1 or t.dtype != torch.int32:
        raise TypeError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} must be an int32 tensor with one element, "
                        f"got {t.dtype} of shape {tuple(t.shape)}")
    if t.device.type == "cuda":
        return total
    value = int(t.reshape(()).item())
    if value < 0 or (value == 0 and total > 0):
        raise ValueError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} is {value} but the sequences hold {total} rows")
    return min(value, total)


def _check(torch, q, k, v, out, cq, ck, heads, kv_heads, head_dim):
    for name, t, h in (("q", q, heads), ("k", k, kv_heads), ("v", v, kv_heads), ("out", out, heads)):
        if t.device.type != "cuda" or t.device != q.device:
            raise ProviderUnavailableError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} is on {t.device}; FA2 needs "
                                            f"every tensor on the CUDA device of q ({q.device})")
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != h or t.shape[3] != head_dim:
            raise ValueError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} has shape {tuple(t.shape)}, compiled for "
                             f"(1, total, {h}, {head_dim})")
        if t.dtype not in (torch.float16, torch.bfloat16) or t.dtype != q.dtype:
            raise TypeError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} has dtype {t.dtype}; q, k, v, out must all be "
                            "float16 or all bfloat16")
        if t.stride(-1) != 1:
            raise ValueError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} needs a contiguous last (head dim) axis")
    if k.shape != v.shape or out.shape != q.shape:
        raise ValueError(f"{PY_VAR_LEN_FORWARD_FUNC}: k {tuple(k.shape)} / v {tuple(v.shape)} or q {tuple(q.shape)} / "
                         f"out {tuple(out.shape)} differ")
    for name, t in (("seqstart_q", cq), ("seqstart_k", ck)):
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{PY_VAR_LEN_FORWARD_FUNC}: {name} must be a contiguous 1-D int32 tensor on {q.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if cq.shape != ck.shape or cq.shape[0] < 1:
        raise ValueError(f"{PY_VAR_LEN_FORWARD_FUNC}: seqstart_q has {cq.shape[0]} entries, seqstart_k "
                         f"{ck.shape[0]}; both need batch + 1")


def _run(backend, q, k, v, out, cq, ck, max_q, max_k, scale, causal, window_left, window_right):
    if backend.name == "flash_attn":
        # flash-attn >= 2.6: varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k,
        #   block_table, alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors,
        #   is_causal, window_size_left, window_size_right, softcap, return_softmax, gen)
        res = backend.ext.varlen_fwd(q, k, v, out, cq, ck, None, None, None, None, max_q, max_k, 0.0, scale,
                                     False, causal, window_left, window_right, 0.0, False, None)
    else:
        kwargs = {"scale": scale}
        if window_left != -1 or window_right != -1:
            kwargs.update(window_size_left=window_left, window_size_right=window_right)
        res = backend.torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, max_q, max_k, 0.0, causal, False,
                                                              **kwargs)
    if res[0].data_ptr() != out.data_ptr():  # torch has no out= variant: copy the output (never K/V)
        out.copy_(res[0].reshape(out.shape))


def flash_attn_varlen_forward(q, k, v, seqstart_q, seqstart_k, max_seqlen_q, max_seqlen_k, out, scale: float,
                              causal: bool, window_left: int, window_right: int, num_heads: int,
                              num_kv_heads: int, head_dim: int) -> None:
    """FA2 var-len forward into ``out``; the function behind ``mqa_byoc.flash_attn_varlen_forward``.

    - ``q`` ``(1, total_q, H, D)``, ``k``/``v`` ``(1, total_k, H_kv, D)``, ``out`` like ``q``: sequences
      concatenated along axis 1, one CUDA device, all float16 or all bfloat16; query head ``h`` uses
      K/V head ``h // (H / H_kv)``; ``H``, ``H_kv``, ``D`` as compiled (``num_heads`` ...).
    - ``seqstart_q`` / ``seqstart_k``: int32 ``(batch + 1,)`` cumulative lengths with a leading 0, on the
      device. ``max_seqlen_q`` / ``max_seqlen_k``: int32 tensors with one element; read only on the host
      (a device tensor would synchronize the stream: the total length is used as the bound instead).
    - ``causal``: bottom-right aligned per sequence; ``window_left``/``window_right``: -1 = unbounded.
    """
    backend = active_backend()
    torch = backend.torch
    qt, kt, vt, ot, cq, ck, mq, mk = (
        as_torch(torch, x, n) for x, n in (
            (q, "q"), (k, "k"), (v, "v"), (out, "out"), (seqstart_q, "seqstart_q"), (seqstart_k, "seqstart_k"),
            (max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")))
    _check(torch, qt, kt, vt, ot, cq, ck, int(num_heads), int(num_kv_heads), int(head_dim))
    total_q, total_k = qt.shape[1], kt.shape[1]
    max_q = _max_length(torch, mq, "max_seqlen_q", total_q)
    max_k = _max_length(torch, mk, "max_seqlen_k", total_k)
    if total_q == 0 or cq.shape[0] == 1:
        return
    device_index = qt.device.index if qt.device.index is not None else torch.cuda.current_device()
    stream = backend.stream_for(device_index)
    args = (backend, qt[0], kt[0], vt[0], ot[0], cq, ck, max_q, max_k, float(scale), bool(causal),
            int(window_left), int(window_right))
    nvtx = nvtx_enabled()
    if nvtx:
        torch.cuda.nvtx.range_push("flash_attn_varlen" + nvtx_range_name(num_heads, num_kv_heads, head_dim)[10:])
    try:
        if torch.cuda.current_stream(device_index) == stream:
            _run(*args)
        else:
            with torch.cuda.stream(stream):
                _run(*args)
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


tvm_ffi.register_global_func(PY_VAR_LEN_FORWARD_FUNC, flash_attn_varlen_forward, override=True)
