"""``export_library`` that links the native FA2 objects the offloaded attentions need (and the cuBLASLt
dispatcher of offloaded GEMMs).

The codegen's native wrappers carry a marker line naming their kernel families
(``// mqa_byoc-kernels: hdim128 fp16; hdim128 fp16 causal; ...``). :func:`export_library` reads the
markers from the executable's imported C source modules, gets the dispatcher and kernel objects from
:mod:`mqa_byoc.kernels` (building missing ones unless ``build=False``) and links them, with the
static CUDA runtime, into the exported shared library (plus ``native/fa2_paged.cu`` when the paged-KV
wrappers of :mod:`mqa_byoc.compiler.paged` are there). The result needs only TVM's runtime and the
NVIDIA driver: no mqa_byoc, no torch, no CUDA toolkit. Executables without markers export unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from mqa_byoc import kernels as _kernels
from mqa_byoc.compiler import cublaslt_build
from mqa_byoc.compiler.cublaslt_build import GEMM_MARKER
from mqa_byoc.compiler.paged_build import PAGED_MARKER, paged_object
from mqa_byoc.kernels import KernelKey, NativeKernelsUnavailable  # noqa: F401 (re-export)
from mqa_byoc.kernels import hopper as _hopper

_FCOMPILE_ATTRS = ("object_format", "output_format", "need_system_lib", "get_target_triple")


def _root_module(obj):
    """The runtime module of a ``tvm.runtime.Executable`` / ``relax.VMExecutable`` or a module."""
    mod = getattr(obj, "mod", None)
    return mod if mod is not None and hasattr(mod, "imports") else obj


def _iter_modules(mod) -> Iterable:
    seen, stack = set(), [mod]
    while stack:
        m = stack.pop()
        key = m.__hash__() if hasattr(m, "__hash__") else id(m)
        if key in seen:
            continue
        seen.add(key)
        yield m
        stack.extend(m.imports)


def native_sources(executable, marker: str | None = None) -> list[str]:
    """Sources of the imported modules that carry an mqa_byoc kernel marker (or ``marker``)."""
    marker = marker or _kernels.MARKER
    out = []
    for m in _iter_modules(_root_module(executable)):
        if m.kind not in ("c", "source"):  # CSourceModule reports "c"
            continue
        try:
            src = m.inspect_source()
        except Exception:  # noqa: BLE001 - a module without source is simply not ours
            continue
        if marker in src:
            out.append(src)
    return out


def collect_hopper_keys(executable) -> tuple:
    """FA4 objects (:class:`~mqa_byoc.kernels.hopper.HopperKernelKey`) named by the hopper wrappers."""
    keys = set()
    for src in native_sources(executable):
        keys.update(_hopper.parse_markers(src))
    return tuple(sorted(keys))


def collect_kernel_keys(executable) -> tuple[KernelKey, ...]:
    """Kernel families named by the markers of all native wrappers in ``executable``."""
    keys = set()
    for src in native_sources(executable):
        keys.update(_kernels.parse_markers(src))
    return tuple(sorted(keys))


def _with_libs(base: Callable, libs: list[str]) -> Callable:
    """``base`` (e.g. tvm.support.cc.create_shared) with ``libs`` appended after all objects."""

    def fcompile(output, objects, options=None, **kwargs):
        objs = [objects] if isinstance(objects, str) else list(objects)
        return base(output, objs + list(libs), options=options, **kwargs)

    for attr in _FCOMPILE_ATTRS:
        if hasattr(base, attr):
            setattr(fcompile, attr, getattr(base, attr))
    return fcompile


def export_library(
    executable,
    path: str | os.PathLike,
    arch: str | None = None,
    build: bool = True,
    *,
    jobs: int | None = None,
    allow_missing: bool = False,
    progress: Callable[[str], None] | None = print,
    **kwargs,
):
    """Export ``executable`` to the shared library ``path``, linking native FA2 kernels if needed.

    arch: CUDA arch of the kernels (``sm_90``); default ``$MQA_BYOC_ARCH``, the local GPU, else sm_90.
    build: compile missing kernel objects (minutes each); with False, raise
        :class:`NativeKernelsUnavailable` naming the ``mqa-byoc build-kernels`` command instead.
    allow_missing: link whatever kernels exist; a call needing a missing one fails at run time
        with the same hint (the dispatcher references kernels weakly).
    kwargs: passed to ``executable.export_library`` (``fcompile``, ``addons``, ``options``, ...).
    """
    path = os.fspath(path)
    keys = collect_kernel_keys(executable)
    gemm = bool(native_sources(executable, GEMM_MARKER))
    if not keys and not gemm:
        return executable.export_library(path, **kwargs)
    if path.endswith((".tar", ".wasm")):
        raise ValueError(f"{path}: native kernels can only be linked into a shared library (.so)")
    if not keys:  # GEMMs only: the cuBLASLt dispatcher, no FA2 objects
        return _export_linked(executable, path, [str(cublaslt_build.dispatcher_object(progress))],
                              list(cublaslt_build.LINK_LIBS), kwargs)

    arch = _kernels.normalize_arch(arch or _kernels.detect_arch())
    if allow_missing:
        found = _kernels.find_kernels(keys, arch, _safe_config(arch))
        if not build:
            keys = tuple(k for k in keys if k in found)
    objects, libs = _kernels.link_inputs(keys, arch, build=build, jobs=jobs, progress=progress)
    hopper_keys = collect_hopper_keys(executable)
    if hopper_keys:
        # FA4 objects, our glue, then the DSL's static shim archive: before the static cudart in libs
        # compiled even with build=False when flash-attn-4 is installed: seconds each, like the dispatcher
        libs = _hopper.link_inputs(hopper_keys, arch, build=True, progress=progress) + libs
    if any(PAGED_MARKER in src for src in native_sources(executable)):  # FA2 over TVM's KV pages
        objects.append(str(paged_object(arch, build=build, progress=progress)))
    if gemm:  # the cuBLASLt dispatcher of the offloaded GEMMs (host code; cuBLASLt opened at run time)
        objects.append(str(cublaslt_build.dispatcher_object(progress)))
        libs = libs + list(cublaslt_build.LINK_LIBS)
    return _export_linked(executable, path, objects, libs, kwargs)


def _export_linked(executable, path, objects, libs, kwargs):
    from tvm.support import cc as _cc  # compile time only

    addons = list(kwargs.pop("addons", None) or []) + objects
    base = kwargs.pop("fcompile", None) or _cc.create_shared
    options = kwargs.pop("options", None) or []
    options = [options] if isinstance(options, str) else list(options)
    if not any(str(o).startswith("-std=") for o in options):
        options.append("-std=c++17")
    return executable.export_library(
        path, fcompile=_with_libs(base, libs), addons=addons, options=options, **kwargs
    )


def _safe_config(arch):
    try:
        return _kernels.build_config(arch, download=False, progress=lambda _m: None)
    except NativeKernelsUnavailable:
        return None
