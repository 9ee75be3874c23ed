"""Python FA2 kernel providers, called by libraries built with the ``python`` provider.

Importing this module registers the global function ``mqa_byoc.flash_attn_forward`` (see
:func:`flash_attn_forward` for the contract), which the C++ forwarders emitted by
``mqa_byoc.compiler.codegen.dispatch`` look up and call. It needs only ``tvm_ffi`` (a runtime-only TVM is
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

import importlib
import importlib.util
import os
import threading

import tvm_ffi

from mqa_byoc.contract import PY_FORWARD_FUNC

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
ENV_VAR = "MQA_BYOC_PY_PROVIDER"
BACKENDS = ("flash_attn", "torch")
INSTALL_HINT = 'pip install "mqa-byoc[gpu]"'
NVTX_ENV_VAR = "MQA_BYOC_NVTX"


class ProviderUnavailableError(RuntimeError):
    """The selected Python FA2 backend cannot run here (and no other is substituted)."""


# --------------------------------------------------------------------------- selection


def requested_backend(env: str | None = None) -> str:
    """``"auto"``, ``"flash_attn"`` or ``"torch"``, from ``env`` or ``$MQA_BYOC_PY_PROVIDER``."""
    value = os.environ.get(ENV_VAR, "") if env is None else env
    value = value.strip().lower().replace("-", "_") or "auto"
    if value not in BACKENDS + ("auto",):
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(BACKENDS)} or auto")
    return value


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_backend(env: str | None = None, *, flash_attn_installed: bool | None = None) -> str:
    """The backend name the rule picks (does not import or check it): explicit wins, else
    ``flash_attn`` when the package is installed, else ``torch``."""
    choice = requested_backend(env)
    if choice != "auto":
        return choice
    installed = _flash_attn_installed() if flash_attn_installed is None else flash_attn_installed
    return "flash_attn" if installed else "torch"


def nvtx_requested(env: str | None = None) -> bool:
    """Whether ``$MQA_BYOC_NVTX`` (or ``env``) asks for NVTX ranges: set, non-empty and not
    ``0``/``false``/``off``/``no`` (the rule fa2_dispatch.cc applies too)."""
    value = os.environ.get(NVTX_ENV_VAR, "") if env is None else env
    return value.strip().lower() not in ("", "0", "false", "off", "no")


def nvtx_range_name(num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """``flash_attn[h=64,kv=8,d=128]``: the NVTX range around one offloaded attention."""
    return f"flash_attn[h={num_heads},kv={num_kv_heads},d={head_dim}]"


# --------------------------------------------------------------------------- backends


class _Backend:
    name = ""

    def __init__(self, torch):
        self.torch = torch
        self._streams = {}

    def stream_for(self, device_index: int):
        """The torch stream object for TVM's current stream on ``cuda:device_index``."""
        ptr = int(tvm_ffi.get_raw_stream(tvm_ffi.device("cuda", device_index)))
        key = (ptr, device_index)
        stream = self._streams.get(key)
        if stream is None:
            cuda = self.torch.cuda
            if ptr == 0:
                stream = cuda.default_stream(device_index)
            else:
                stream = cuda.ExternalStream(ptr, device=self.torch.device("cuda", device_index))
            self._streams[key] = stream
        return stream

    def run(self, q, k, v, out, scale, causal, window_left, window_right):  # pragma: no cover
        raise NotImplementedError


class _FlashAttnBackend(_Backend):
    name = "flash_attn"

    def __init__(self, torch, ext):
        super().__init__(torch)
        self.ext = ext

    def run(self, q, k, v, out, scale, causal, window_left, window_right):
        # flash-attn >= 2.6: fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal,
        #                        window_size_left, window_size_right, softcap, return_softmax, gen)
        try:
            res = self.ext.fwd(q, k, v, out, None, 0.0, scale, causal, window_left, window_right, 0.0, False, None)
        except TypeError as err:
            raise ProviderUnavailableError(
                f"flash-attn's fwd() does not take the flash-attn >= 2.6 arguments ({err}); "
                f"install flash-attn >= 2.6 ({INSTALL_HINT}) or set {ENV_VAR}=torch"
            ) from err
        result = res[0]
        if result.data_ptr() != out.data_ptr():  # it writes into `out`; keep this as a safety net
            out.copy_(result)


class _TorchBackend(_Backend):
    name = "torch"

    def run(self, q, k, v, out, scale, causal, window_left, window_right):
        kwargs = {"scale": scale}
        if window_left != -1 or window_right != -1:  # torch < 2.5 lacks these; pass them only when used
            kwargs.update(window_size_left=window_left, window_size_right=window_right)
        res = self.torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, **kwargs
        )
        # No out= overload exists for this op: copy the result (the output only) into `out`.
        out.copy_(res[0])


_lock = threading.Lock()
_backend: _Backend | None = None
_nvtx: bool | None = None  # $MQA_BYOC_NVTX, read at the first call


def _import_torch_with_cuda():
    try:
        torch = importlib.import_module("torch")
    except ImportError as err:
        raise ProviderUnavailableError(
            f"mqa_byoc python provider: PyTorch is not installed ({err}). "
            f"Install the GPU extras: {INSTALL_HINT}"
        ) from err
    if not torch.cuda.is_available():
        raise ProviderUnavailableError(
            f"mqa_byoc python provider: torch {torch.__version__} has no usable CUDA "
            f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda}). FA2 runs only on "
            f"NVIDIA GPUs: install a CUDA build of torch ({INSTALL_HINT}) and run on a GPU machine."
        )
    return torch


def _make_backend(name: str) -> _Backend:
    torch = _import_torch_with_cuda()
    if name == "flash_attn":
        try:
            importlib.import_module("flash_attn")
            ext = importlib.import_module("flash_attn_2_cuda")
        except ImportError as err:
            raise ProviderUnavailableError(
                f"mqa_byoc python provider: backend flash_attn selected "
                f"({ENV_VAR}={os.environ.get(ENV_VAR, 'auto')!r}) but the flash-attn package does not import "
                f"({err}). Install it ({INSTALL_HINT}) or set {ENV_VAR}=torch to use PyTorch's FA2."
            ) from err
        return _FlashAttnBackend(torch, ext)
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        raise ProviderUnavailableError(
            f"mqa_byoc python provider: torch {torch.__version__} has no aten::_flash_attention_forward; "
            f"install torch >= 2.5 with CUDA ({INSTALL_HINT})"
        )
    return _TorchBackend(torch)


def active_backend() -> _Backend:
    """Resolve, check and cache the backend (raises :class:`ProviderUnavailableError`)."""
    global _backend
    if _backend is None:
        with _lock:
            if _backend is None:
                _backend = _make_backend(select_backend())
    return _backend


def reset() -> None:
    """Forget the cached backend and NVTX switch (the next call resolves them again)."""
    global _backend, _nvtx
    with _lock:
        _backend = None
        _nvtx = None


# --------------------------------------------------------------------------- the entry point


def _as_torch(torch, x, what: str):
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.from_dlpack(x)  # zero-copy
    except Exception as err:  # noqa: BLE001
        raise TypeError(f"mqa_byoc.flash_attn_forward: {what} is not a DLPack tensor ({type(x).__name__}): {err}") from err


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
    backend = active_backend()
    torch = backend.torch
    qt, kt, vt, ot = (_as_torch(torch, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
    _check(torch, qt, kt, vt, ot)
    device_index = qt.device.index if qt.device.index is not None else torch.cuda.current_device()
    stream = backend.stream_for(device_index)
    args = (qt, kt, vt, ot, float(scale), bool(causal), int(window_left), int(window_right))
    global _nvtx
    if _nvtx is None:
        _nvtx = nvtx_requested()
    if _nvtx:
        torch.cuda.nvtx.range_push(nvtx_range_name(qt.shape[2], kt.shape[2], qt.shape[3]))
    try:
        if torch.cuda.current_stream(device_index) == stream:
            backend.run(*args)
        else:
            with torch.cuda.stream(stream):
                backend.run(*args)
    finally:
        if _nvtx:
            torch.cuda.nvtx.range_pop()


tvm_ffi.register_global_func(FORWARD_FUNC, flash_attn_forward, override=True)

from . import varlen_provider  # noqa: E402,F401 - registers mqa_byoc.flash_attn_varlen_forward (R.nn.attention_var_len)
