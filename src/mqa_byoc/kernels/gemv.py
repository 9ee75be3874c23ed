"""CUTLASS's GEMV for GEMMs of one row: ``native/cutlass_gemv.cu`` compiled to a fatbin (nvcc, CUTLASS's
headers: :func:`cutlass_include_dir`), cached, and written as a C initializer list that the cuBLASLt
dispatcher (``native/cublaslt_gemm.cc``) includes. The dispatcher loads it with the CUDA driver and
launches it itself, so a library with it still needs no CUDA runtime and no file beside it.

The fatbin holds sm_80 and sm_90 code and compute_90 PTX (later GPUs compile that at load): the
dispatcher object is the same for every arch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path

from . import paths
from .build import run_compile
from .errors import NativeKernelsUnavailable
from .toolchain import find_nvcc

#: the wheel with CUTLASS's headers that is used first when installed; otherwise the copy of CUTLASS's
#: headers the apache-tvm wheel ships (``tvm/3rdparty/cutlass``, 4.1.0: the same ``gemv.h`` as 4.2.0)
CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"
#: where the fatbin runs natively; PTX of the last for the GPUs after it
GENCODES = ("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90")
FLAGS = ("-O3", "-DNDEBUG", "-std=c++17", "-fatbin", *GENCODES)


def _has_gemv(inc: Path) -> bool:
    return (inc / "cutlass" / "gemm" / "kernel" / "gemv.h").is_file()


def cutlass_include_dir() -> Path:
    """CUTLASS's C++ headers: the nvidia-cutlass wheel's ``cutlass_library/source/include`` when it is
    installed, else those the apache-tvm wheel ships (``tvm/3rdparty/cutlass/include``).

    Raises
    ------
    NativeKernelsUnavailable
        Neither has them (with the install command).
    """
    spec = importlib.util.find_spec("cutlass_library")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if _has_gemv(Path(root) / "source" / "include"):
            return Path(root) / "source" / "include"
    tvm_spec = importlib.util.find_spec("tvm")
    for root in (tvm_spec.submodule_search_locations or []) if tvm_spec else []:
        if _has_gemv(Path(root) / "3rdparty" / "cutlass" / "include"):
            return Path(root) / "3rdparty" / "cutlass" / "include"
    raise NativeKernelsUnavailable(f"CUTLASS's headers not found (neither the nvidia-cutlass wheel nor apache-tvm's "
                                   f"3rdparty/cutlass): pip install \"{CUTLASS_REQUIREMENT}\" for CUTLASS's GEMV at "
                                   f"one row; GEMMs run on cuBLASLt alone")


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    """nvcc's version line (asked once per process and nvcc: each export looks the fatbin up)."""
    lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return lines[-1] if lines else ""


def fatbin_include(progress: Callable[[str], None] | None = None) -> Path:
    """``<cache>/gemm/gemv/cutlass_gemv-<12 hex>.inc``: the fatbin's bytes as ``0x..,`` text (compiled
    when missing, seconds). The name hashes the source, its header, the flags, nvcc's version and
    CUTLASS's include path.

    Raises
    ------
    NativeKernelsUnavailable
        No nvcc or no CUTLASS headers.
    RuntimeError
        The compile failed (with its log).
    """
    nvcc = find_nvcc()
    include = cutlass_include_dir()
    h = hashlib.sha256()
    for src in (paths.GEMV_SOURCE, paths.GEMV_HEADER):
        h.update(src.read_bytes())
    h.update(repr((FLAGS, str(include), _nvcc_version(nvcc))).encode())
    out = paths.cache_root() / "gemm" / "gemv" / f"cutlass_gemv-{h.hexdigest()[:12]}.inc"
    if out.is_file():
        return out
    fatbin = out.with_suffix(".fatbin")
    if not fatbin.is_file():
        dt = run_compile([nvcc, *FLAGS, f"-I{include}", f"-I{paths.NATIVE_DIR}", str(paths.GEMV_SOURCE)], fatbin,
                      fatbin.with_suffix(".log"))
        (progress or (lambda _m: None))(f"[mqa-byoc] {paths.GEMV_SOURCE.name}: {dt:.0f}s -> {fatbin}")
    data = fatbin.read_bytes()
    lines = (",".join(f"0x{b:02x}" for b in data[i:i + 32]) for i in range(0, len(data), 32))
    tmp = out.with_suffix(".inc.tmp")
    tmp.write_text(",\n".join(lines) + "\n")
    tmp.replace(out)
    return out
