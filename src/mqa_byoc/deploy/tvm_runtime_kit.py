"""Prepare a runtime-only TVM (``TVM_USE_RUNTIME_LIB=1``) to load and run exported CUDA libraries.

This file is copied into the kit that ``mqa-byoc runtime-kit`` writes and stands alone there: it
imports nothing of ``mqa_byoc`` (the machine that runs a library needs neither the project nor torch).
Importing it

- loads ``tvm/lib/libtvm_runtime_cuda.so``: TVM's runtime-only mode does not load device backends by
  itself. Where the CUDA driver is missing the load fails; the reason is kept in :data:`CUDA_ERROR`
  and a warning says so (libraries built for the CPU still run);
- registers ``tvm_callback_cuda_compile``: always on a runtime-only TVM, whose Python package registers
  TVM's own hook too (``tvm.support.nvcc``), which needs the compiler library and fails there; on a
  full TVM only when none is registered. TVM 0.27 keeps the CUDA kernels it generates as source inside an exported library and
  compiles them when the library is loaded. The hook compiles with ``nvcc --fatbin`` for the
  architecture of the GPU it runs on (``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on ``PATH``).

Use: ``import tvm_runtime_kit`` before ``tvm.runtime.load_module``, or
``python3 -m tvm_runtime_kit script.py [args]`` to run a script after the set-up.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import tvm
import tvm_ffi

HOOK = "tvm_callback_cuda_compile"

#: why ``libtvm_runtime_cuda.so`` did not load (None: loaded, or not a runtime-only TVM)
CUDA_ERROR: str | None = None


def runtime_only() -> bool:
    """True when TVM runs from its runtime library alone (``TVM_USE_RUNTIME_LIB=1``)."""
    return os.environ.get("TVM_USE_RUNTIME_LIB") == "1"


def nvcc_path() -> str:
    """The nvcc the hook calls: ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else ``nvcc`` on ``PATH``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH): TVM compiles the CUDA kernels "
                           "kept as source in an exported library when it loads the library")
    return found


def gpu_arch(device: int = 0) -> str:
    """``sm_XY`` of CUDA device ``device``."""
    major, minor = tvm.cuda(device).compute_version.split(".")
    return f"sm_{major}{minor}"


def compile_cuda(code, *rest) -> bytearray:
    """``tvm_callback_cuda_compile``: CUDA C source -> fatbin for the local GPU. Its errors start with
    ``tvm_runtime_kit:`` so that a failing load says which hook ran."""
    try:
        return _compile_cuda(code)
    except Exception as err:
        raise RuntimeError(f"tvm_runtime_kit: compiling TVM's CUDA kernels failed: {err}") from err


def _compile_cuda(code) -> bytearray:
    with tempfile.TemporaryDirectory(prefix="tvm-cuda-") as d:
        src, out = os.path.join(d, "kernels.cu"), os.path.join(d, "kernels.fatbin")
        with open(src, "w") as f:
            f.write(str(code))
        cmd = [nvcc_path(), "--fatbin", "-O3", f"-arch={gpu_arch()}", "-w", "-o", out, src]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        with open(out, "rb") as f:
            return bytearray(f.read())


def setup() -> None:
    """Load the CUDA backend (runtime-only TVM) and register the nvcc hook; safe to call again."""
    global CUDA_ERROR
    if runtime_only() and CUDA_ERROR is None:
        lib = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            CUDA_ERROR = str(err)
            warnings.warn(f"TVM's CUDA runtime did not load ({err}): only CPU libraries can run", RuntimeWarning,
                          stacklevel=2)
    if runtime_only():
        try:  # TVM's own hook registers itself when this is imported; ours must come after it
            importlib.import_module("tvm.support.nvcc")
        except Exception:  # noqa: BLE001 - a runtime-only package may lack it: then there is nothing to replace
            pass
    if runtime_only() or tvm_ffi.get_global_func(HOOK, allow_missing=True) is None:
        tvm_ffi.register_global_func(HOOK, compile_cuda, override=True)


setup()


if __name__ == "__main__":
    import runpy

    if len(sys.argv) < 2:
        sys.exit("usage: python3 -m tvm_runtime_kit SCRIPT.py [ARGS...]")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
