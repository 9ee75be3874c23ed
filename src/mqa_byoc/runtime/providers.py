"""Python FA2 kernel providers, called by libraries built with the ``python`` provider.

Importing this module registers the global function ``mqa_byoc.flash_attn_forward`` (see
:func:`flash_attn_forward` for the contract), which the C++ forwarders emitted by
``mqa_byoc.compiler.codegen.python`` look up and call. It needs only ``tvm_ffi`` (a runtime-only TVM is
enough; ``tvm.relax`` is never imported); torch and flash-attn are imported at the first call.

Backend, chosen at the first call and then kept for the process:

- ``MQA_BYOC_PY_PROVIDER=flash_attn``: the ``flash-attn`` package's CUDA extension
  (``flash_attn_2_cuda.fwd``), which writes straight into ``out``;
- ``MQA_BYOC_PY_PROVIDER=torch``: PyTorch's own FA2, ``torch.ops.aten._flash_attention_forward``
  (native GQA). ATen has no ``out=`` overload of it (only ``default`` and ``quantized``), so its
  result is copied into ``out``: one extra device copy of the *output*, never of K/V;
- unset or ``auto``: ``flash_attn`` when the package is installed, else ``torch``.

Nothing falls back silently: a requested backend that cannot run (package missing or broken,
torch without CUDA, tensors not on a CUDA device) raises :class:`ProviderUnavailableError` naming
what is missing and how to install it (``pip install "mqa-byoc[gpu]"``); registration itself
always succeeds.

Streams: the kernels run on the stream TVM uses for the device, i.e. the TVM-FFI environment
stream (``TVMFFIEnvGetStream``, read with ``tvm_ffi.get_raw_stream``; NULL means the legacy
default stream), wrapped for torch with ``torch.cuda.ExternalStream``.

NVTX: with ``MQA_BYOC_NVTX=1`` each call is wrapped in an NVTX range ``flash_attn[h=H,kv=H_kv,d=D]``
(``torch.cuda.nvtx``), so an ``nsys profile`` timeline shows which kernels an offloaded attention
launched; the native provider's dispatcher names its ranges the same way. Off by default, like the
native one: the switch is read once (at the first call, again after :func:`reset`).
"""

from __future__ import annotations

import tvm_ffi

from mqa_byoc.contract import PY_FORWARD_FUNC, PY_SINK_FORWARD_FUNC, PY_SOFTCAP_FORWARD_FUNC

from .backends import (BACKENDS, ENV_VAR, INSTALL_HINT, NVTX_ENV_VAR, ProviderUnavailableError, active_backend,
                       as_torch, nvtx_enabled, nvtx_range_name, nvtx_requested, requested_backend, reset,
                       select_backend)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "FORWARD_FUNC",
    "INSTALL_HINT",
    "NVTX_ENV_VAR",
    "ProviderUnavailableError",
    "active_backend",
    "flash_attn_forward",
    "nvtx_range_name",
    "nvtx_requested",
    "requested_backend",
    "reset",
    "select_backend",
]

FORWARD_FUNC = PY_FORWARD_FUNC  # the name the codegen's forwarders call (mqa_byoc.contract)


def _check(torch, q, k, v, out):
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.device.type != "cuda":
            raise ProviderUnavailableError(
                f"mqa_byoc.flash_attn_forward: {name} is on {t.device}; FA2 needs CUDA tensors "
                "(build the model for a CUDA target and run it on a GPU)"
            )
        if t.dim() != 4:
            raise ValueError(f"mqa_byoc.flash_attn_forward: {name} must be 4-D BSNH, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16) or t.dtype != q.dtype:
            raise TypeError(
                f"mqa_byoc.flash_attn_forward: {name} has dtype {t.dtype}; q, k, v, out must all be "
                "float16 or all bfloat16"
            )
        if t.device != q.device:
            raise ValueError(f"mqa_byoc.flash_attn_forward: {name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"mqa_byoc.flash_attn_forward: {name} needs a contiguous last (head) dimension")
    b, sq, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"mqa_byoc.flash_attn_forward: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "do not fit (B, S_q, H, D) / (B, S_kv, H_kv, D)"
        )
    if h % k.shape[2] != 0:
        raise ValueError(f"mqa_byoc.flash_attn_forward: {h} query heads cannot share {k.shape[2]} K/V heads")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"mqa_byoc.flash_attn_forward: out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")


def _operands(q, k, v, out):
    """The active backend, its torch, q/k/v/out as checked torch tensors, the device index and TVM's
    stream for it: what every forward below starts with."""
    backend = active_backend()
    torch = backend.torch
    qt, kt, vt, ot = (as_torch(torch, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
    _check(torch, qt, kt, vt, ot)
    device_index = qt.device.index if qt.device.index is not None else torch.cuda.current_device()
    return backend, torch, (qt, kt, vt, ot), device_index, backend.stream_for(device_index)


def flash_attn_forward(q, k, v, out, scale: float, causal: bool, window_left: int, window_right: int) -> None:
    """FA2 forward into ``out``; the function behind the global ``mqa_byoc.flash_attn_forward``.

    Contract:

    - ``q`` ``(B, S_q, H, D)``, ``k`` and ``v`` ``(B, S_kv, H_kv, D)``, ``out`` ``(B, S_q, H, D)``:
      logical BSNH, any strides with a contiguous last dimension (a BNSH buffer arrives as a
      transposed view), DLPack-capable (TVM tensors or torch tensors), on one CUDA device, all
      float16 or all bfloat16; ``H % H_kv == 0`` and query head ``h`` uses K/V head ``h // (H / H_kv)``.
    - ``scale``: softmax scale (already resolved, e.g. ``1/sqrt(D)``).
    - ``causal``: FA2 causal, bottom-right aligned (query ``i`` sees keys ``j <= i + S_kv - S_q``).
    - ``window_left`` / ``window_right``: FA2 sliding window, ``-1`` for unbounded.
    - Runs on TVM's current stream for the device; returns nothing, writes ``out``.
    """
    backend, torch, (qt, kt, vt, ot), device_index, stream = _operands(q, k, v, out)
    args = (qt, kt, vt, ot, float(scale), bool(causal), int(window_left), int(window_right))
    nvtx = nvtx_enabled()
    if nvtx:
        torch.cuda.nvtx.range_push(nvtx_range_name(qt.shape[2], kt.shape[2], qt.shape[3]))
    try:
        if torch.cuda.current_stream(device_index) == stream:
            backend.run(*args)
        else:
            with torch.cuda.stream(stream):
                backend.run(*args)
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


tvm_ffi.register_global_func(FORWARD_FUNC, flash_attn_forward, override=True)


def flash_attn_sink_forward(q, k, v, sinks, out, scale: float, causal: bool, window_left: int,
                            window_right: int) -> None:
    """Attention with sinks into ``out``; the function behind the global ``mqa_byoc.flash_attn_sink_forward``.

    Contract: as :func:`flash_attn_forward`, plus ``sinks`` ``(H,)`` (float32 or the model's dtype, on the
    device): one logit per query head in every row's softmax, with a value of zero. Computed exactly
    from FA2's output and its row log-sum-exp: ``out = o * sigmoid(lse - sinks[h])``.
    """
    backend, torch, (qt, kt, vt, ot), _, stream = _operands(q, k, v, out)
    st = as_torch(torch, sinks, "sinks")
    if tuple(st.shape) != (qt.shape[2],) or st.device != qt.device:
        raise ValueError(f"mqa_byoc.flash_attn_sink_forward: sinks has shape {tuple(st.shape)} on {st.device}, "
                         f"expected ({qt.shape[2]},) on {qt.device}")
    args = (qt, kt, vt, ot, float(scale), bool(causal), int(window_left), int(window_right))
    with torch.cuda.stream(stream):
        lse = backend.run(*args)
        factor = torch.sigmoid(lse.float() - st.float()[None, :, None])  # (B, H, S_q)
        ot.copy_((ot.float() * factor.permute(0, 2, 1).unsqueeze(-1)).to(ot.dtype))


tvm_ffi.register_global_func(PY_SINK_FORWARD_FUNC, flash_attn_sink_forward, override=True)


def flash_attn_softcap_forward(q, k, v, out, scale: float, softcap: float, causal: bool, window_left: int,
                               window_right: int) -> None:
    """Soft-capped attention into ``out``; the function behind the global ``mqa_byoc.flash_attn_softcap_forward``.

    Contract: as :func:`flash_attn_forward`, the scores ``softcap * tanh(q k^T * scale / softcap)`` before the
    mask and the softmax (``softcap > 0``). The flash_attn backend runs flash-attn's FA2 with its ``softcap``;
    the torch backend computes it with plain PyTorch ops in float32 (PyTorch's FA2 has no soft-capping;
    memory B * H * S_q * S_kv floats).
    """
    if not float(softcap) > 0:
        raise ValueError(f"mqa_byoc.flash_attn_softcap_forward: softcap must be > 0, got {softcap}")
    backend, torch, (qt, kt, vt, ot), _, stream = _operands(q, k, v, out)
    with torch.cuda.stream(stream):
        backend.run_softcap(qt, kt, vt, ot, float(scale), float(softcap), bool(causal), int(window_left),
                            int(window_right))


tvm_ffi.register_global_func(PY_SOFTCAP_FORWARD_FUNC, flash_attn_softcap_forward, override=True)

from . import varlen_provider  # noqa: E402,F401 - registers mqa_byoc.flash_attn_varlen_forward (R.nn.attention_var_len)
