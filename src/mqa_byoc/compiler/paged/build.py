"""The object of ``native/fa2_paged.cu`` (FA2 over TVM's KV pages): compiled once per arch, cached.

It holds device code (the block-table and LSE kernels), so unlike the dispatcher it is compiled for
the target arch; it takes seconds. :func:`paged_object` is what ``export_library`` links when a
paged-attention wrapper (marker :data:`PAGED_MARKER`) is in the executable. Nothing here imports TVM.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mqa_byoc import kernels as _kernels
from mqa_byoc.kernels import paths as _paths
from mqa_byoc.kernels.toolchain import FLASH_NAMESPACE

#: the line a paged wrapper's source carries so that export links :func:`paged_object`
PAGED_MARKER = "// mqa_byoc-paged: fa2_paged"
PAGED_SOURCE = _paths.NATIVE_DIR / "fa2_paged.cu"
PAGED_HEADER = _paths.PAGED_HEADER


def paged_flags(arch: str) -> list[str]:
    """nvcc flags of the paged object (part of its cache name).

    Returns
    -------
    list of str
    """
    from mqa_byoc.kernels.build import gencode_flags

    return gencode_flags(arch) + [f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}"]


def paged_object(arch: str, *, fa_src=None, build: bool = True,
                 progress: Callable[[str], None] | None = print) -> Path:
    """The compiled ``fa2_paged.cu`` for ``arch``: a prebuilt dir's copy, else the cache, else compile
    (:func:`mqa_byoc.kernels.build.source_object`; named by the source, its header, the shim and flags).

    Raises
    ------
    NativeKernelsUnavailable
        No nvcc or no flash-attn sources (for ``flash.h``), or ``build=False`` and not fetched yet.
    RuntimeError
        The compile failed (with its output).
    """
    from mqa_byoc.kernels.build import source_object

    def includes():
        fa_root = _kernels.flash_attn_source(fa_src, download=build, progress=progress or (lambda _m: None))
        return [f"-I{_paths.SHIM_DIR}", f"-I{fa_root / 'csrc/flash_attn/src'}"]

    return source_object(PAGED_SOURCE, arch, paged_flags(arch), subdir="fa2/paged",
                         inputs=(PAGED_HEADER, _paths.LSE_RULE_HEADER, _paths.DISPATCH_HEADER, _paths.GQA_DECODE_HEADER,
                                 _paths.SHIM_DIR),
                         includes=includes, progress=progress)
