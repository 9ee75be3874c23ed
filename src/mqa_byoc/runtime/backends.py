"""The Python FA2 backends behind the python provider's global functions (:mod:`.providers`,
:mod:`.varlen_provider`): which one runs (``MQA_BYOC_PY_PROVIDER``), its streams, the NVTX switch.

Runtime-only: ``tvm_ffi`` at most, never ``tvm.relax``; torch and flash-attn are imported at the
first call. The rules are described in :mod:`mqa_byoc.runtime.providers`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading

import tvm_ffi

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "INSTALL_HINT",
    "NVTX_ENV_VAR",
    "ProviderUnavailableError",
    "active_backend",
    "as_torch",
    "nvtx_enabled",
    "nvtx_range_name",
    "nvtx_requested",
    "requested_backend",
    "reset",
    "select_backend",
]

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

    def run_softcap(self, q, k, v, out, scale, softcap, causal, window_left, window_right):
        """Soft-capped attention into ``out`` with plain PyTorch ops in float32 (the contract of
        ``mqa_byoc.flash_attn_softcap_forward``): aten's FA2 has no soft-capping."""
        torch = self.torch
        group = q.shape[2] // k.shape[2]
        qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))  # (B, H, S, D)
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        s_q, s_kv = q.shape[1], k.shape[1]
        if causal or window_left >= 0 or window_right >= 0:
            # bottom-right aligned: query row i sits at key position i + S_kv - S_q
            rows = torch.arange(s_q, device=q.device)[:, None] + (s_kv - s_q)
            cols = torch.arange(s_kv, device=q.device)[None, :]
            allowed = torch.ones(s_q, s_kv, dtype=torch.bool, device=q.device)
            if causal:
                allowed &= cols <= rows
            if window_left >= 0:
                allowed &= cols >= rows - window_left
            if window_right >= 0:
                allowed &= cols <= rows + window_right
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys is zero, as in FA2
        out.copy_(torch.matmul(probs, vh).transpose(1, 2).to(out.dtype))


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
        return res[1]  # the row log-sum-exp (B, H, S_q), float32

    def run_softcap(self, q, k, v, out, scale, softcap, causal, window_left, window_right):
        res = self.ext.fwd(q, k, v, out, None, 0.0, scale, causal, window_left, window_right, float(softcap),
                           False, None)
        if res[0].data_ptr() != out.data_ptr():
            out.copy_(res[0])


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
        return res[1]  # the row log-sum-exp (B, H, S_q), float32


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

def nvtx_enabled() -> bool:
    """The NVTX switch of this process: :func:`nvtx_requested`, read at the first call (again after
    :func:`reset`)."""
    global _nvtx
    if _nvtx is None:
        _nvtx = nvtx_requested()
    return _nvtx


def as_torch(torch, x, what: str):
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.from_dlpack(x)  # zero-copy
    except Exception as err:  # noqa: BLE001
        raise TypeError(f"mqa_byoc.flash_attn_forward: {what} is not a DLPack tensor ({type(x).__name__}): {err}") from err
