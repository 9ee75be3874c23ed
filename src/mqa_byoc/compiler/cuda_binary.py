"""TVM's generated CUDA kernels compiled ahead of time, so a library loads with TVM's C++ runtime alone.

Where the build runs without the CUDA driver (TVM's compiler here, the GPU elsewhere), TVM 0.27 keeps
the CUDA source of its kernels in the executable's ``cuda`` modules (format ``"cuda"``) and the
runtime that loads the exported library compiles them through the Python hook
``tvm_callback_cuda_compile`` (a process without Python, or without nvcc, cannot load it). Registering
the hook before ``relax.build`` does not change that: the codegen calls it only when TVM's CUDA runtime
is loaded in the building process. :func:`compile_cuda_modules` compiles each source module with nvcc
for the target arch (a fatbin) and puts a module holding the binary in its place in the import tree
(``native/cuda_binary_module.cc``, compiled with g++ once and cached: it keeps the module's saved
function table and replaces its format and code). The runtime loads ``"fatbin"`` code as it is.

``mqa_byoc.build(..., cuda_binary=True)`` runs it after ``relax.build``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from mqa_byoc.kernels import normalize_arch
from mqa_byoc.kernels.paths import NATIVE_DIR, cache_root

from mqa_byoc.compiler.link import iter_modules, root_module

HELPER_SOURCE = NATIVE_DIR / "cuda_binary_module.cc"
HELPER_FUNC = "mqa_byoc.binary_cuda_module"
FORMAT = "fatbin"

_loaded: list = []  # the helper library, kept loaded (its modules' code lives there)


def _helper_flags():
    import tvm_ffi.libinfo as ffi_info

    lib = Path(ffi_info.find_libtvm_ffi())
    return [f"-I{ffi_info.find_include_path()}", f"-I{ffi_info.find_dlpack_include_path()}"], lib


def _load_helper(progress: Callable[[str], None] | None = None):
    import tvm_ffi

    fn = tvm_ffi.get_global_func(HELPER_FUNC, allow_missing=True)
    if fn is not None:
        return fn
    includes, lib = _helper_flags()
    cmd = ["g++", "-std=c++17", "-O2", "-shared", "-fPIC", *includes, str(HELPER_SOURCE),
           f"-L{lib.parent}", "-ltvm_ffi", f"-Wl,-rpath,{lib.parent}"]
    tag = hashlib.sha256((HELPER_SOURCE.read_text() + " ".join(cmd)).encode()).hexdigest()[:16]
    out = cache_root() / "tvm" / f"cuda_binary_module-{tag}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run(cmd + ["-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"compiling {HELPER_SOURCE.name} failed:\n{r.stderr[-3000:]}\n{' '.join(cmd)}")
        tmp.replace(out)
        if progress:
            progress(f"[mqa-byoc] {HELPER_SOURCE.name} -> {out}")
    _loaded.append(ctypes.CDLL(str(out), mode=os.RTLD_LOCAL))
    return tvm_ffi.get_global_func(HELPER_FUNC)


def binary_format(m) -> str | None:
    """The format of the compiled device code a ``cuda`` module holds (``fatbin``, ``cubin``,
    ``ptx``), None when it holds none."""
    for fmt in ("fatbin", "cubin", "ptx"):
        try:
            if m.inspect_source(fmt):
                return fmt
        except UnicodeDecodeError:  # binary code comes back as a string that is not text
            return fmt
    return None


def is_cuda_source_module(m) -> bool:
    """A ``cuda`` module that holds CUDA source (compiled when loaded) rather than a binary."""
    return m.kind == "cuda" and binary_format(m) is None and bool(m.inspect_source("cuda"))


def cuda_source_modules(executable) -> list:
    """The ``cuda`` modules of ``executable`` that hold CUDA source."""
    return [m for m in iter_modules(executable) if is_cuda_source_module(m)]


def compile_cuda_source(code: str, arch: str) -> bytes:
    """``code`` compiled by nvcc into a fatbin for ``arch`` (TVM's ``tvm.support.nvcc``)."""
    import tvm
    from tvm.support import nvcc

    arch = normalize_arch(arch)
    with tvm.target.Target({"kind": "cuda", "arch": arch}):  # nvcc's flags read the current target
        return bytes(nvcc.compile_cuda(code, target_format=FORMAT, arch=arch, compiler="nvcc"))


def compile_cuda_modules(executable, arch: str, *, progress: Callable[[str], None] | None = None) -> int:
    """Replace every CUDA source module of ``executable`` by one holding its fatbin for ``arch``.

    Returns
    -------
    int
        How many modules were compiled (0: nothing held CUDA source).

    Raises
    ------
    RuntimeError
        nvcc or g++ failed (with their output).
    """
    root = root_module(executable)
    done = 0
    make = None
    for parent in list(iter_modules(executable)):
        children = list(parent.imports)
        if not any(is_cuda_source_module(c) for c in children):
            continue
        make = make or _load_helper(progress)
        replaced = []
        for c in children:
            if is_cuda_source_module(c):
                binary = compile_cuda_source(c.inspect_source("cuda"), arch)
                c = make(c, binary, FORMAT)
                done += 1
            replaced.append(c)
        parent.clear_imports()
        for c in replaced:
            parent.import_module(c)
    if progress and done:
        progress(f"[mqa-byoc] {done} CUDA module(s) of TVM compiled to {FORMAT} for {normalize_arch(arch)}")
    assert root is not None
    return done
