"""The kernel objects of the native wrappers, imported into the executable as static-library modules.

TVM's own BYOC backends link prebuilt objects this way (its FlashInfer backend wraps each object with
``tvm.runtime.load_static_library``): a ``static_library`` module is written out as an object file by
``export_library`` and linked with everything else, so a plain ``ex.export_library("m.so")`` (or
``ex.jit()``) links the kernels. :class:`AttachKernelLibraries` runs after ``RunCodegen`` in
:func:`mqa_byoc.build` and adds, to the module's ``external_mods``:

1. the library's kernel options (:mod:`.kernel_options`): a constant the dispatcher and the hopper
   wrappers read, and the exported query function ``mqa_byoc_kernel_options``;
2. for native / hopper wrappers (the marker lines of their sources name what they need): one object,
   ``ld -r`` of the FA2 dispatcher and its decode-support object, the FA2 kernel objects,
   ``fa2_paged.cu``'s object when paged-KV wrappers are there, the FA4 objects with their glue and the
   members of the DSL's runtime archive they call, and the whole static CUDA runtime. One relocatable
   object, because ``export_library`` writes the modules in an order of its own and an archive is only
   searched for what the objects before it need.

Only objects that exist (cache, ``MQA_BYOC_KERNEL_DIR``) or compile in seconds (the dispatcher and our
support objects) are attached; FA2 kernel families not built yet are left out, and the dispatcher's
error names the ``mqa-byoc build-kernels`` command that builds them. :func:`mqa_byoc.export_library`
builds and links what is missing. Each attached module names the symbols it defines
(``implements_function``), so export can tell what is already there.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import tvm

from mqa_byoc import kernels as _kernels
from mqa_byoc.kernels import KernelKey, NativeKernelsUnavailable
from mqa_byoc.kernels import hopper as _hopper

from mqa_byoc.compiler import cublaslt_build as _cublaslt
from mqa_byoc.compiler import kernel_options as _options
from mqa_byoc.compiler.paged.build import PAGED_MARKER, paged_object

logger = logging.getLogger(__name__)

#: The symbol the attached dispatcher module names (the FA2 entry point the wrappers call).
DISPATCHER_SYMBOL = "mqa_byoc_fa2_forward"
#: The symbol the attached ``fa2_paged.cu`` module names.
PAGED_SYMBOL = "mqa_byoc_fa2_paged_forward"
#: The symbol of the cuBLASLt dispatcher (``native/cublaslt_gemm.cc``) the GEMM wrappers call.
GEMM_SYMBOL = "mqa_byoc_cublaslt_gemm"


@dataclass(frozen=True)
class LinkInput:
    """One file to link and the symbols it is known by (empty: support objects and archives)."""

    path: str
    names: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- what the wrappers need


def root_module(obj):
    """The runtime module of a ``tvm.runtime.Executable`` / ``relax.VMExecutable`` or a module."""
    mod = getattr(obj, "mod", None)
    return mod if mod is not None and hasattr(mod, "imports") else obj


def iter_modules(mods) -> Iterable:
    """Every module of the import trees of ``mods`` (a module, an executable or a list), once each."""
    seen, stack = set(), list(mods) if isinstance(mods, list | tuple) else [root_module(mods)]
    while stack:
        m = stack.pop()
        key = m.__hash__() if hasattr(m, "__hash__") else id(m)
        if key in seen:
            continue
        seen.add(key)
        yield m
        stack.extend(m.imports)


def native_sources(mods, marker: str | None = None) -> list[str]:
    """Sources of the C source modules in ``mods`` that carry an mqa_byoc kernel marker (or ``marker``)."""
    marker = marker or _kernels.MARKER
    out = []
    for m in iter_modules(mods):
        if m.kind not in ("c", "source"):  # CSourceModule reports "c"
            continue
        try:
            src = m.inspect_source()
        except Exception:  # noqa: BLE001 - a module without source is simply not ours
            continue
        if marker in src:
            out.append(src)
    return out


@dataclass(frozen=True)
class Needs:
    """What the native wrappers of an executable link: FA2 families, FA4 objects, the paged object, the
    cuBLASLt dispatcher."""

    fa2: tuple[KernelKey, ...]
    fa4: tuple
    paged: bool
    gemm: bool = False

    @classmethod
    def of(cls, mods) -> Needs:
        sources = native_sources(mods)
        fa2, fa4 = set(), set()
        for src in sources:
            fa2.update(_kernels.parse_markers(src))
            fa4.update(_hopper.parse_markers(src))
        gemm = bool(native_sources(mods, _cublaslt.GEMM_MARKER))
        return cls(tuple(sorted(fa2)), tuple(sorted(fa4)), any(PAGED_MARKER in s for s in sources), gemm)

    @property
    def attention(self) -> bool:
        """Whether any attention wrapper needs the FA2 dispatcher."""
        return bool(self.fa2 or self.fa4 or self.paged)

    def __bool__(self) -> bool:
        return self.attention or self.gemm

    def names(self) -> set[str]:
        """The symbols the attached modules of these needs are known by."""
        out = {GEMM_SYMBOL} if self.gemm else set()
        if not self.attention:
            return out
        out |= {DISPATCHER_SYMBOL} | {k.entry_symbol for k in self.fa2} | {f"__tvm_ffi_{k.symbol}" for k in self.fa4}
        return out | ({PAGED_SYMBOL} if self.paged else set())


def attached_names(executable, names: Iterable[str]) -> set[str]:
    """Those of ``names`` a ``static_library`` module of ``executable`` implements."""
    libs = [m for m in iter_modules(executable) if m.kind == "static_library"]
    return {n for n in names if any(m.implements_function(n) for m in libs)}


# ---------------------------------------------------------------------------- the files


def fa2_inputs(keys, arch: str, *, build: bool, jobs=None, allow_missing: bool = False,
               progress: Callable[[str], None] | None = None) -> list[LinkInput]:
    """Dispatcher, decode-support object and kernel objects of ``keys``. ``allow_missing``: only the
    kernel objects that exist (with ``build``: after building the rest)."""
    if allow_missing and not build:
        found = _kernels.find_kernels(keys, arch, installed_kernel_config(arch))
        keys = tuple(k for k in keys if k in found)
    objects, _libs = _kernels.link_inputs(keys, arch, build=build, jobs=jobs, progress=progress)
    disp, support, kernel_objs = objects[0], objects[1], objects[2:]
    return ([LinkInput(disp, (DISPATCHER_SYMBOL,)), LinkInput(support)]
            + [LinkInput(p, (k.entry_symbol,)) for k, p in zip(sorted(keys), kernel_objs)])


def fa4_inputs(keys, arch: str, *, with_support: bool = True, progress=None) -> list[LinkInput]:
    """FA4 objects of ``keys`` (compiled when flash-attn-4 is installed: seconds each) and, with
    ``with_support``, our glue objects and the DSL's runtime archive."""
    if not with_support:
        objs = _hopper.build_objects(keys, arch, build=True, progress=progress)
        return [LinkInput(str(p), (f"__tvm_ffi_{k.symbol}",)) for k, p in sorted(objs.items())]
    paths = _hopper.link_inputs(keys, arch, build=True, progress=progress)
    named = [LinkInput(p, (f"__tvm_ffi_{k.symbol}",)) for k, p in zip(sorted(set(keys)), paths)]
    return named + [LinkInput(p) for p in paths[len(named):]]


def gemm_input(progress=None) -> LinkInput:
    """The cuBLASLt dispatcher object (compiled with the host compiler once, cached; it opens
    ``libcublasLt.so.13`` at its first call, so nothing else is linked)."""
    return LinkInput(str(_cublaslt.dispatcher_object(progress or (lambda _m: None))), (GEMM_SYMBOL,))


def cudart_input(arch: str) -> LinkInput:
    """The static CUDA runtime archive (``-ldl -lpthread -lrt`` it also needs are in glibc >= 2.34)."""
    return LinkInput(_kernels.static_cudart(arch)[0])


def installed_kernel_config(arch):
    try:
        return _kernels.build_config(arch, download=False, progress=lambda _m: None)
    except NativeKernelsUnavailable:
        return None


def attach_inputs(needs: Needs, arch: str, *, progress=None) -> list[LinkInput]:
    """The files :class:`AttachKernelLibraries` attaches for ``needs`` (in link order); FA2 kernel
    families not built yet and FA4 objects that cannot be had are left out.

    Raises
    ------
    NativeKernelsUnavailable
        No dispatcher (no nvcc or no flash-attn sources here): nothing can be attached.
    """
    if not needs.attention:  # GEMMs only: the cuBLASLt dispatcher (host code, no CUDA runtime)
        return [gemm_input(progress)]
    inputs = fa2_inputs(needs.fa2, arch, build=False, allow_missing=True, progress=progress)
    if needs.gemm:
        inputs.append(gemm_input(progress))
    if needs.paged:
        inputs.append(LinkInput(str(paged_object(arch, build=False, progress=progress)), (PAGED_SYMBOL,)))
    if needs.fa4:
        try:
            inputs += fa4_inputs(needs.fa4, arch, progress=progress)
        except NativeKernelsUnavailable as err:
            logger.info("FA4 objects not attached (mqa_byoc.export_library links them): %s", err)
    return inputs + [cudart_input(arch)]


def static_library(item: LinkInput):
    """``item`` as a ``static_library`` module (``tvm.runtime.load_static_library``)."""
    return tvm.runtime.load_static_library(item.path, list(item.names))


def combined_library(inputs: list[LinkInput]):
    """One ``static_library`` module of ``inputs``: ``ld -r`` of the objects, the members of the
    archives that they call, and the whole static CUDA runtime (last of ``inputs``), known by every
    name of ``inputs``. The module holds the object's bytes; the file is not kept.

    Raises
    ------
    RuntimeError
        ``ld`` failed (with its output).
    """
    names = sorted({n for i in inputs for n in i.names})
    if len(inputs) == 1 and inputs[0].names == (GEMM_SYMBOL,):  # GEMMs only: one host object
        return tvm.runtime.load_static_library(inputs[0].path, names)
    ld = shutil.which("ld")
    if ld is None:
        raise NativeKernelsUnavailable("ld not found (binutils): the kernel objects cannot be combined")
    *rest, cudart = inputs
    with tempfile.TemporaryDirectory(prefix="mqa_byoc_link_") as d:
        out = Path(d) / "mqa_byoc_kernels.o"
        cmd = [ld, "-r", "-o", str(out), *(i.path for i in rest), "--whole-archive", cudart.path,
               "--no-whole-archive"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"combining the kernel objects failed:\n{r.stderr[-3000:]}\n{' '.join(cmd)}")
        return tvm.runtime.load_static_library(str(out), names)


# ---------------------------------------------------------------------------- the pass


@tvm.transform.module_pass(opt_level=0, name="AttachKernelLibraries")
class AttachKernelLibraries:
    """Module pass, after ``RunCodegen``: add the kernel options module and the kernel objects the
    native wrappers in ``external_mods`` link, as static-library modules (see the module docstring).

    Parameters
    ----------
    arch : str
        CUDA arch of the objects (``sm_90``).
    kernel_options : KernelOptions | dict | str | None
        The library's kernel choices (:class:`~.kernel_options.KernelOptions`); None: the defaults.
    progress : callable | None
        Reports compiles (the dispatcher, support objects, FA4 objects: seconds each).
    """

    def __init__(self, arch: str, kernel_options=None, progress: Callable[[str], None] | None = None):
        self.arch = _kernels.normalize_arch(arch)
        self.options = _options.KernelOptions.of(kernel_options)
        self.progress = progress
        self.attached: list[LinkInput] = []
        self.skipped: str | None = None

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        ext = list((mod.attrs or {}).get("external_mods", []))
        needs = Needs.of(ext)
        if not needs:
            return mod
        extra = [_csource(_options.c_source(self.options), [_options.QUERY_FUNCTION])]
        try:
            self.attached = attach_inputs(needs, self.arch, progress=self.progress)
        except (NativeKernelsUnavailable, _cublaslt.CublasLtUnavailable) as err:
            self.skipped = str(err)
            logger.info("kernel objects not attached (mqa_byoc.export_library builds and links them): %s", err)
        if self.attached:
            extra.append(combined_library(self.attached))
        return mod.with_attr("external_mods", ext + extra)


def _csource(code: str, symbols: list[str]):
    return tvm.get_global_func("runtime.CSourceModuleCreate")(code, "cc", symbols, [])
