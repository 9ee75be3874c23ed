"""The object of ``native/fa2_paged.cu`` (FA2 over TVM's KV pages): compiled once per arch, cached.

It holds device code (the block-table and LSE kernels), so unlike the dispatcher it is compiled for
the target arch; it takes seconds. :func:`paged_object` is what ``export_library`` links when a
paged-attention wrapper (marker :data:`PAGED_MARKER`) is in the executable. Nothing here imports TVM.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from mqa_byoc import kernels as _kernels
from mqa_byoc.kernels import paths as _paths
from mqa_byoc.kernels.toolchain import FLASH_NAMESPACE

#: the line a paged wrapper's source carries so that export links :func:`paged_object`
PAGED_MARKER = "// mqa_byoc-paged: fa2_paged"
PAGED_SOURCE = _paths.NATIVE_DIR / "fa2_paged.cu"
PAGED_HEADER = _paths.NATIVE_DIR / "fa2_paged.h"


def paged_flags(arch: str) -> list[str]:
    """nvcc flags of the paged object (part of its cache name).

    Returns
    -------
    list of str
    """
    num = _kernels.normalize_arch(arch).removeprefix("sm_")
    return ["-O3", "-std=c++17", f"-gencode=arch=compute_{num},code=sm_{num}",
            "-Xcompiler=-fPIC,-fvisibility=hidden", f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}"]


def paged_object_name(arch: str) -> str:
    """``fa2_paged-<arch>-<12 hex>.o``: changes with the source, header, shim and flags."""
    h = hashlib.sha256()
    for p in (PAGED_SOURCE, PAGED_HEADER):
        h.update(p.read_bytes())
    for p in sorted(_paths.SHIM_DIR.rglob("*")):
        if p.is_file():
            h.update(p.read_bytes())
    h.update(json.dumps(paged_flags(arch)).encode())
    return f"fa2_paged-{_kernels.normalize_arch(arch)}-{h.hexdigest()[:12]}.o"


def paged_object(arch: str, *, fa_src=None, build: bool = True,
                 progress: Callable[[str], None] | None = print) -> Path:
    """The compiled ``fa2_paged.cu`` for ``arch``: a prebuilt dir's copy, else the cache, else compile.

    Raises
    ------
    NativeKernelsUnavailable
        No nvcc or no flash-attn sources (for ``flash.h``), or ``build=False`` and not compiled yet.
    RuntimeError
        The compile failed (with its output).
    """
    arch = _kernels.normalize_arch(arch)
    name = paged_object_name(arch)
    for d in _kernels.prebuilt_dirs(arch):
        if (d / name).is_file():
            return d / name
    out = _kernels.cache_root() / "fa2" / "paged" / name
    if out.is_file():
        return out
    nvcc = _kernels.find_nvcc()
    fa_root = _kernels.flash_attn_source(fa_src, download=build, progress=progress or (lambda _m: None))
    cmd = [nvcc, "-c", *paged_flags(arch), f"-I{_paths.SHIM_DIR}", f"-I{fa_root / 'csrc/flash_attn/src'}",
           str(PAGED_SOURCE)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{name}.{os.getpid()}.tmp")
    res = subprocess.run(cmd + ["-o", str(tmp)], capture_output=True, text=True)
    if res.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {PAGED_SOURCE.name} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
    os.replace(tmp, out)
    if progress:
        progress(f"[mqa-byoc] paged attention object -> {out}")
    return out
