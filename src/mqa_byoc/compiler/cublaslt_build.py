"""The object of ``native/cublaslt_gemm.cc`` (the cuBLASLt dispatcher): compiled once with the host
C++ compiler, cached, linked by :func:`mqa_byoc.export_library` when a GEMM wrapper is in the executable.

Host code (g++), with CUTLASS's GEMV for GEMMs of one row embedded as a fatbin when nvcc and CUTLASS's
headers (the nvidia-cutlass wheel, else apache-tvm's copy) are here (:mod:`mqa_byoc.kernels.gemv`; the dispatcher launches it through the CUDA
driver, so nothing more is linked; without them GEMMs run on cuBLASLt alone). It needs cuBLASLt's headers (``pip install nvidia-cublas``:
``nvidia/cu13/include``), the CUDA runtime headers they include (``$CUDA_HOME/include``, else
``/usr/local/cuda/include``, else the ``nvidia-cuda-runtime`` wheel) and TVM's ``c_backend_api.h``.
The library itself is opened at run time (``dlopen``), so nothing is linked but ``-ldl``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from mqa_byoc.kernels import gemv as _gemv
from mqa_byoc.kernels import paths as _paths
from mqa_byoc.kernels import toolchain as _toolchain
from mqa_byoc.kernels.errors import NativeKernelsUnavailable

SOURCE = _paths.NATIVE_DIR / "cublaslt_gemm.cc"
#: the line every generated GEMM wrapper source carries so that export links the dispatcher
GEMM_MARKER = "// mqa_byoc-gemm: cublaslt"
#: what a link with the dispatcher appends after the objects
LINK_LIBS = ("-ldl",)


class CublasLtUnavailable(RuntimeError):
    """cuBLASLt's headers (or a C++ compiler) are missing at export time."""


def _nvidia_dir(sub: str) -> Path | None:
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in (Path(root) / "cu13" / sub, Path(root) / "cuda_runtime" / sub):
            if cand.is_dir():
                return cand
    return None


def cublaslt_include_dir() -> Path:
    """``nvidia/cu13/include`` of the nvidia-cublas wheel (holding ``cublasLt.h``).

    Raises
    ------
    CublasLtUnavailable
        With the install command, when the wheel is not installed.
    """
    d = _nvidia_dir("include")
    if d is None or not (d / "cublasLt.h").is_file():
        raise CublasLtUnavailable("cuBLASLt headers not found: pip install nvidia-cublas (or \"mqa-byoc[gemm]\") "
                                  "to export GEMMs offloaded to cuBLASLt, or partition with gemm=False")
    return d


def cublaslt_lib_dir() -> Path | None:
    """``nvidia/cu13/lib`` of the wheel, where ``libcublasLt.so.13`` is (None when not installed)."""
    d = _nvidia_dir("lib")
    return d if d is not None and (d / "libcublasLt.so.13").is_file() else None


def _cuda_include() -> Path:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (Path(cand) / "include" / "cuda_runtime_api.h").is_file():
            return Path(cand) / "include"
    d = _nvidia_dir("include")
    if d is not None and (d / "cuda_runtime_api.h").is_file():
        return d
    raise CublasLtUnavailable("CUDA runtime headers (cuda_runtime_api.h) not found: set CUDA_HOME or "
                              "pip install nvidia-cuda-runtime")


def _tvm_includes() -> list[Path]:
    import tvm
    import tvm_ffi

    ffi = Path(tvm_ffi.__file__).parent / "include"
    return [Path(tvm.__file__).parent / "include", ffi, ffi / "dlpack" / "include" if (ffi / "dlpack" / "include").is_dir() else ffi]


def compile_flags() -> list[str]:
    """Flags of the dispatcher's compile (part of its cache name)."""
    hint = cublaslt_lib_dir()
    return ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden",
            *([f'-DMQA_BYOC_CUBLASLT_HINT="{hint}"'] if hint else [])]


def gemv_flags(progress=None) -> list[str]:
    """``-DMQA_BYOC_GEMV_FATBIN="<inc>"`` when CUTLASS's GEMV can be built here (nvcc and CUTLASS's
    headers: :func:`mqa_byoc.kernels.gemv.fatbin_include`), else none (the dispatcher runs cuBLASLt alone,
    and :func:`gemv_unavailable` says why)."""
    try:
        return [f'-DMQA_BYOC_GEMV_FATBIN="{_gemv.fatbin_include(progress)}"']
    except NativeKernelsUnavailable:
        return []


def headers_unavailable() -> str | None:
    """Why the dispatcher cannot be compiled here (cuBLASLt's or the CUDA runtime's headers missing, with
    the install command), or None."""
    try:
        include_flags()
    except CublasLtUnavailable as err:
        return str(err)
    return None


def gemv_unavailable() -> str | None:
    """Why the dispatcher compiled here has no CUTLASS GEMV (None when it has one)."""
    try:
        _gemv.cutlass_include_dir()
        _toolchain.find_nvcc()
    except NativeKernelsUnavailable as err:
        return str(err)
    return None


def include_flags() -> list[str]:
    """``-I`` flags: cuBLASLt, the CUDA runtime headers, TVM's runtime headers."""
    return [f"-I{p}" for p in (cublaslt_include_dir(), _cuda_include(), *_tvm_includes())]


def dispatcher_object(progress=print) -> Path:
    """The compiled dispatcher, ``<cache>/cublaslt/cublaslt_gemm-<12 hex>.o`` (compiled when missing).

    Raises
    ------
    CublasLtUnavailable
        No headers or no C++ compiler.
    RuntimeError
        The compile failed (with its output).
    """
    flags = compile_flags() + gemv_flags(progress)
    includes = include_flags()
    h = hashlib.sha256(SOURCE.read_bytes())
    for header in (_paths.GEMV_HEADER, _paths.DISPATCH_HEADER):
        h.update(header.read_bytes())
    h.update(repr(flags).encode())
    h.update(repr(includes).encode())
    out = _paths.cache_root() / "cublaslt" / f"cublaslt_gemm-{h.hexdigest()[:12]}.o"
    if out.is_file():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise CublasLtUnavailable("no C++ compiler (g++) to compile the cuBLASLt dispatcher")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.o")
    cmd = [cxx, *flags, *includes, "-c", str(SOURCE), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
    os.replace(tmp, out)
    (progress or (lambda _m: None))(f"[mqa-byoc] {SOURCE.name} -> {out}")
    return out
