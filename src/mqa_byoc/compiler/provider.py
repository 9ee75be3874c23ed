"""The provider rule: which kernels an offloaded attention calls. Every other module asks here.

The three providers (:data:`mqa_byoc.contract.PROVIDERS`):

``"native"``
    C++ launching FA2 forward kernels compiled from flash-attn's sources, linked into the library
    by :func:`mqa_byoc.export_library` (:mod:`mqa_byoc.compiler.codegen.native`).
``"hopper"``
    the native wrapper with FA4's sm90 kernel (flash-attn-4, compiled ahead of time by
    :mod:`mqa_byoc.kernels.hopper`) for calls with enough query rows (prefill) and for var-len
    attention, FA2 for the others (split-KV decode); sm_90 only, exported the same way
    (:mod:`mqa_byoc.compiler.codegen.hopper`).
``"python"``
    a forwarder calling the global function ``mqa_byoc.flash_attn_forward`` that
    ``import mqa_byoc.runtime.providers`` registers (flash-attn or PyTorch's FA2); any C++ compiler
    builds it (:mod:`mqa_byoc.compiler.codegen.python`).

The rule, for one ``Codegen="flash_attn"`` function, first match wins:

1. its function attribute :data:`~mqa_byoc.contract.PROVIDER_ATTR` (``mqa_byoc.provider``, set by
   ``partition_for_cutlass(..., provider=...)``);
2. the codegen option ``provider``: ``relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})``
   (what ``mqa_byoc.build(..., provider=...)`` passes);
3. the default rule (:func:`default_provider`): ``"native"`` when ``nvcc`` is found at compile time
   and the target is CUDA (the codegen option ``target``, else ``Target.current()``; no target
   known counts as CUDA since every provider runs only there), else ``"python"``; ``"hopper"``
   instead of ``"native"`` when the target's arch is sm_90 and FA4 objects can be had (prebuilt
   under ``MQA_BYOC_KERNEL_DIR`` or flash-attn-4 installed to compile them).

``"auto"`` at any level means "the default rule". ``tvm.transform.PassContext`` config keys cannot
be registered from Python in TVM 0.27 (unknown keys are rejected), so the codegen option plays
that role.
"""

from __future__ import annotations

import logging

import tvm

from mqa_byoc.contract import PROVIDER_ATTR, check_provider
from mqa_byoc.kernels.toolchain import nvcc_available

from mqa_byoc.compiler.graph.exprs import get_attr

__all__ = ["PROVIDER_OPTION", "build_provider", "cuda_target", "default_provider", "hopper_unavailable", "resolve_provider",
           "target_arch"]

logger = logging.getLogger(__name__)

#: The codegen option naming the provider: ``RunCodegen({"flash_attn": {PROVIDER_OPTION: ...}})``.
PROVIDER_OPTION = "provider"


def _native_codegen_available() -> bool:
    try:
        from mqa_byoc.compiler.codegen import native  # noqa: F401
    except ImportError:
        return False
    return True


def _target_kind(target) -> str | None:
    if target is None:
        return None
    if isinstance(target, (dict, str)):
        target = tvm.target.Target(target)
    return str(target.kind.name)


def cuda_target(target, what: str, hint: str = "") -> tvm.target.Target:
    """``target`` (a Target, dict or string) as a Target; a ValueError naming ``what`` and the fix when it
    is not a CUDA target (every kernel the offload calls runs on NVIDIA GPUs). ``hint`` ends the message."""
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    if target.kind.name != "cuda":
        raise ValueError(f"{what}: the target is {target.kind.name!r}; the offloaded kernels run on NVIDIA GPUs, so "
                         "give a CUDA target, e.g. {'kind': 'cuda', 'arch': 'sm_90'}" + (f" ({hint})" if hint else ""))
    return target


def target_arch(target) -> str | None:
    """The ``arch`` attribute of a CUDA target (``sm_90``), None when it has none."""
    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    if target is None:
        return None
    if isinstance(target, (dict, str)):
        target = tvm.target.Target(target)
    arch = target.attrs.get("arch") if str(target.kind.name) == "cuda" else None
    return None if arch is None else str(arch)


def hopper_unavailable(target) -> str | None:
    """Why the default rule does not pick the hopper provider for ``target`` (None: it does)."""
    from mqa_byoc.kernels import hopper

    return hopper.available(target_arch(target))


def default_provider(target=None, *, nvcc: bool | None = None, native: bool | None = None,
                     hopper: bool | None = None) -> str:
    """The default rule: ``"native"`` when nvcc is found and the target is CUDA, else ``"python"``;
    ``"hopper"`` for native on an sm_90 target when FA4 objects can be had (:func:`hopper_unavailable`).

    ``target``: a Target (or its dict/str form); None means ``Target.current()``, and no target at
    all counts as CUDA. ``nvcc`` / ``native`` / ``hopper`` override the detection of nvcc, of
    ``mqa_byoc.compiler.codegen.native`` and of FA4 (for tests). While the native codegen is missing
    the rule gives ``"python"`` and logs a warning.
    """
    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    kind = _target_kind(target)
    if kind not in (None, "cuda"):
        return "python"
    if not (nvcc_available() if nvcc is None else nvcc):
        return "python"
    if not (_native_codegen_available() if native is None else native):
        logger.warning(
            "nvcc found but mqa_byoc.compiler.codegen.native is not importable; using the python provider"
        )
        return "python"
    if hopper is None:
        hopper = hopper_unavailable(target) is None
    else:
        hopper = hopper and _is_sm90(target_arch(target))
    return "hopper" if hopper else "native"


def _is_sm90(arch) -> bool:
    from mqa_byoc.kernels import normalize_arch

    try:
        return arch is not None and normalize_arch(arch) == "sm_90"
    except ValueError:
        return False


def resolve_provider(func=None, options=None) -> str:
    """The provider for one ``Codegen`` function ``func`` (None: a build-wide choice) under the
    codegen ``options`` (``provider``, ``target``); the rule is the module docstring's.

    Returns
    -------
    str
        ``"native"``, ``"hopper"`` or ``"python"``.

    Raises
    ------
    ValueError
        For an unknown provider name, naming where it was set.
    """
    choices = (
        (get_attr(func.attrs if func is not None else None, PROVIDER_ATTR), f"function attribute {PROVIDER_ATTR!r}"),
        (get_attr(options, PROVIDER_OPTION), f"codegen option {PROVIDER_OPTION!r}"),
    )
    for value, where in choices:
        if value is None:
            continue
        provider = check_provider(value, where, allow_auto=True)
        if provider != "auto":
            return provider
        break
    return default_provider(get_attr(options, "target"))


def build_provider(provider: str | None, target) -> str:
    """The provider a whole build uses: ``provider`` ("native" / "hopper" / "python"), or the
    default rule for ``target`` when it is None or ``"auto"``."""
    return resolve_provider(None, {PROVIDER_OPTION: provider, "target": target})
