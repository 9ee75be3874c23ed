"""``mqa_byoc.export_library``: TVM's ``export_library``, building and linking kernel objects the
executable does not carry yet.

:func:`mqa_byoc.build` attaches the kernel objects its native wrappers need as static-library modules
(:mod:`mqa_byoc.compiler.link`), so a plain ``ex.export_library("m.so")`` links them. What this
function adds: the kernel objects that were not there at build time (FA2 families compiled now,
minutes each, unless ``build=False``), for executables built with ``mqa_byoc.build`` before the
kernels were, or by ``RunCodegen`` + ``relax.build`` by hand (the wrappers' marker lines name their
kernel families: ``// mqa_byoc-kernels: hdim128 fp16; ...``); it then links them with the static CUDA
runtime (``-std=c++17``, the archives after all objects). The result needs only TVM's runtime and the
NVIDIA driver: no mqa_byoc, no torch, no CUDA toolkit; with GEMMs offloaded, also
``libcublasLt.so.13`` (the ``nvidia-cublas`` wheel), which the cuBLASLt dispatcher opens at its first
call. Executables without native wrappers export unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from mqa_byoc import kernels as _kernels
from mqa_byoc.compiler import link as _link
from mqa_byoc.compiler.cuda_binary import compile_cuda_modules, cuda_source_modules
from mqa_byoc.compiler.paged.build import paged_object
from mqa_byoc.kernels import KernelKey, NativeKernelsUnavailable  # noqa: F401 (re-export)
from mqa_byoc.kernels import hopper as _hopper

_FCOMPILE_ATTRS = ("object_format", "output_format", "need_system_lib", "get_target_triple")

# the import-tree walker lives with the linking
native_sources = _link.native_sources


def collect_hopper_keys(executable) -> tuple:
    """FA4 objects (:class:`~mqa_byoc.kernels.hopper.HopperKernelKey`) named by the hopper wrappers."""
    return _link.Needs.of(executable).fa4


def collect_kernel_keys(executable) -> tuple[KernelKey, ...]:
    """Kernel families named by the markers of all native wrappers in ``executable``."""
    return _link.Needs.of(executable).fa2


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
    cuda_binary: bool = False,
    progress: Callable[[str], None] | None = print,
    **kwargs,
):
    """Export ``executable`` to the shared library ``path``, linking the native kernels it needs.

    What :func:`mqa_byoc.build` attached links as it is; the rest is built here and linked.

    arch: CUDA arch of the kernels (``sm_90``); default ``$MQA_BYOC_ARCH``, the local GPU, else sm_90.
    build: compile missing kernel objects (minutes each); with False, raise
        :class:`NativeKernelsUnavailable` naming the ``mqa-byoc build-kernels`` command instead.
    allow_missing: link whatever kernels exist; a call needing a missing one fails at run time
        with the same hint (the dispatcher references kernels weakly).
    cuda_binary: compile TVM's own CUDA kernels still kept as source to fatbins for ``arch`` first
        (:func:`mqa_byoc.compiler.cuda_binary.compile_cuda_modules`, as ``mqa_byoc.build(cuda_binary=True)``
        does), so the library loads with TVM's C++ runtime alone: no nvcc and no Python compile hook
        where it runs, no compile at each load. Needs nvcc; the fatbins are for ``arch``, which must be
        the arch the executable was built for (an executable does not record it). Off by default
        (docs/deployment.md says why).
    kwargs: passed to ``executable.export_library`` (``fcompile``, ``addons``, ``options``, ...).
    """
    if not callable(getattr(executable, "export_library", None)):
        raise TypeError(f"mqa_byoc.export_library: expected the executable mqa_byoc.build (or relax.build) returns, "
                        f"got {type(executable).__name__}")
    path = os.fspath(path)
    if cuda_binary and cuda_source_modules(executable):
        compile_cuda_modules(executable, _kernels.normalize_arch(arch or _kernels.detect_arch()), progress=progress)
    needs = _link.Needs.of(executable)
    if not needs:
        return executable.export_library(path, **kwargs)
    if path.endswith((".tar", ".wasm")):
        raise ValueError(f"{path}: native kernels can only be linked into a shared library (.so)")
    arch = _kernels.normalize_arch(arch or _kernels.detect_arch())
    attached = _link.attached_names(executable, needs.names())
    options = kwargs.pop("options", None) or []
    options = [options] if isinstance(options, str) else list(options)
    if not any(str(o).startswith("-std=") for o in options):
        options.append("-std=c++17")
    if attached == needs.names():
        return executable.export_library(path, options=options, **kwargs)

    gemm = [_link.gemm_input(progress).path] if needs.gemm and _link.GEMM_SYMBOL not in attached else []
    if not needs.attention:  # GEMMs only: the cuBLASLt dispatcher, no FA2 objects
        addons = gemm + list(kwargs.pop("addons", None) or [])
        return executable.export_library(path, addons=addons, options=options, **kwargs)
    if _link.DISPATCHER_SYMBOL in attached:  # built by mqa_byoc.build: add the objects it could not have
        missing = tuple(k for k in needs.fa2 if k.entry_symbol not in attached)
        extra = []
        if missing:
            fa2 = _link.fa2_inputs(missing, arch, build=build, jobs=jobs, allow_missing=allow_missing,
                                   progress=progress)
            extra += [i.path for i in fa2[2:]]  # the dispatcher and its support object are attached
        if needs.paged and _link.PAGED_SYMBOL not in attached:
            extra.append(str(paged_object(arch, build=build, progress=progress)))
        fa4 = tuple(k for k in needs.fa4 if f"__tvm_ffi_{k.symbol}" not in attached)
        if fa4:
            with_support = len(fa4) == len(needs.fa4)  # none attached: their glue and archive neither
            extra += [i.path for i in _link.fa4_inputs(fa4, arch, with_support=with_support, progress=progress)]
        addons = extra + gemm + list(kwargs.pop("addons", None) or [])
        return executable.export_library(path, addons=addons, options=options, **kwargs)

    inputs = _link.fa2_inputs(needs.fa2, arch, build=build, jobs=jobs, allow_missing=allow_missing, progress=progress)
    objects = [i.path for i in inputs] + gemm
    libs = _kernels.static_cudart(arch)
    if needs.fa4:
        # FA4 objects, our glue, then the DSL's static shim archive: before the static cudart in libs
        # compiled even with build=False when flash-attn-4 is installed: seconds each, like the dispatcher
        libs = _hopper.link_inputs(needs.fa4, arch, build=True, progress=progress) + libs
    if needs.paged:  # FA2 over TVM's KV pages
        objects.append(str(paged_object(arch, build=build, progress=progress)))

    from tvm.support import cc as _cc  # compile time only

    addons = list(kwargs.pop("addons", None) or []) + objects
    base = kwargs.pop("fcompile", None) or _cc.create_shared
    return executable.export_library(
        path, fcompile=_with_libs(base, libs), addons=addons, options=options, **kwargs
    )
