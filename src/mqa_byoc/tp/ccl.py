"""NCCL for TVM's disco on the stock apache-tvm wheel: build and load ``native/disco_nccl.cc``.

The wheel ships disco (``libtvm_runtime_extra.so``: sessions, ``runtime.disco.allreduce`` and the other
builtins) but no NCCL library, so ``sess.init_ccl("nccl", ...)`` fails with "cannot find function:
runtime.disco.nccl.init_ccl". :func:`build_disco_nccl` compiles our own library of those functions with
the host C++ compiler against the wheel's headers, the CUDA toolkit's ``cuda_runtime.h`` and the NCCL of
the ``nvidia-nccl-cu13`` wheel (``pip install "mqa-byoc[tp]"``); :func:`load_disco_nccl` loads it into
this process. One load serves the controller and every worker thread of the process
(``disco.ThreadedSession``); worker processes (``disco.ProcessSession``) load it themselves when started
with ``entrypoint="mqa_byoc.tp.disco_worker"`` (:func:`process_session`).

Loading never replaces a CCL the TVM build already has: when ``runtime.disco.nccl.init_ccl`` is
registered by someone else, :func:`load_disco_nccl` returns None and leaves it.

Nothing here imports ``tvm.relax``: it works with the runtime-only TVM package.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from ..kernels.paths import NATIVE_DIR, NVTX_HEADER, cache_root

#: our source, and the stand-ins for the two TVM headers the wheel's ``tvm/runtime/tensor.h`` includes
#: without shipping them
SOURCE = NATIVE_DIR / "disco_nccl.cc"
TVM_SHIM_DIR = NATIVE_DIR / "tvm_shim"
LIBRARY_NAME = "libmqa_byoc_disco_nccl.so"
#: environment variable naming the built library; set by :func:`load_disco_nccl` so that the worker
#: processes it starts load the same file
LIBRARY_ENV = "MQA_BYOC_DISCO_NCCL"
#: the global functions TVM's disco resolves as ``runtime.disco.<ccl>.<name>``, all registered by us
CCL_FUNCTIONS = (
    "init_ccl", "init_ccl_per_worker", "allreduce", "allgather", "broadcast_from_worker0",
    "scatter_from_worker0", "gather_to_worker0", "recv_from_worker0", "send_to_next_group",
    "recv_from_prev_group", "send_to_worker", "recv_from_worker", "sync_worker",
)
#: a function only our library registers (the NCCL version it runs on, ``ncclGetVersion``)
VERSION_FUNCTION = "mqa_byoc.disco_nccl.nccl_version"

_INSTALL_HINT = 'pip install "mqa-byoc[tp]" (or: pip install nvidia-nccl-cu13)'
_handles: list[ctypes.CDLL] = []  # keeps the loaded libraries alive


class DiscoNcclUnavailable(RuntimeError):
    """The NCCL library for disco cannot be built or loaded here; the message names what is missing."""


def nccl_dirs() -> tuple[Path, Path]:
    """``(include dir, lib dir)`` of the ``nvidia-nccl-cu13`` wheel (``nccl.h``, ``libnccl.so.2``).

    Raises
    ------
    DiscoNcclUnavailable
        The wheel is not installed.
    """
    try:
        import nvidia.nccl as nccl_pkg
    except ImportError:
        raise DiscoNcclUnavailable(f"NCCL is not installed: {_INSTALL_HINT}") from None
    for root in map(Path, nccl_pkg.__path__):
        if (root / "include" / "nccl.h").is_file() and (root / "lib" / "libnccl.so.2").is_file():
            return root / "include", root / "lib"
    raise DiscoNcclUnavailable(f"the nvidia.nccl package has no include/nccl.h + lib/libnccl.so.2: {_INSTALL_HINT}")


def nccl_library() -> str:
    """``libnccl.so.2`` to load: the ``nvidia-nccl-cu13`` wheel's if installed, else the soname (the
    dynamic linker's search path: a system NCCL)."""
    try:
        return str(nccl_dirs()[1] / "libnccl.so.2")
    except DiscoNcclUnavailable:
        return "libnccl.so.2"


def _tvm_dirs() -> dict[str, Path]:
    import tvm
    import tvm_ffi.libinfo

    root = Path(tvm.__file__).resolve().parent
    return {"include": root / "include", "lib": root / "lib",
            "ffi_include": Path(tvm_ffi.libinfo.find_include_path()),
            "ffi_lib": Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent}


def _cxx() -> str:
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if not found:
        raise DiscoNcclUnavailable(f"no C++ compiler {cxx!r} (set CXX to one)")
    return found


def build_command(out: Path) -> list[str]:
    """The compile-and-link command of the library (host code only: no nvcc needed, just its headers).

    Raises
    ------
    DiscoNcclUnavailable
        No NCCL wheel, no C++ compiler, no CUDA toolkit or a TVM package without its headers.
    """
    from ..kernels.errors import NativeKernelsUnavailable
    from ..kernels.toolchain import cuda_home

    t = _tvm_dirs()
    if not (t["include"] / "tvm" / "runtime" / "disco" / "disco_worker.h").is_file():
        raise DiscoNcclUnavailable(f"the TVM package at {t['include'].parent} has no C++ headers; build on a "
                                   "machine with the full apache-tvm wheel and copy the library")
    nccl_inc, nccl_lib = nccl_dirs()
    try:
        cuda = cuda_home()
    except NativeKernelsUnavailable as e:
        raise DiscoNcclUnavailable(f"the CUDA toolkit (cuda_runtime.h, libcudart) is needed: {e}") from None
    cuda_lib = next((cuda / d for d in ("lib64", "lib", "targets/x86_64-linux/lib")
                     if (cuda / d / "libcudart.so").exists()), cuda / "lib64")
    rpaths = [t["lib"], t["ffi_lib"], nccl_lib]
    return ([_cxx(), "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-o", str(out), str(SOURCE),
             f"-I{TVM_SHIM_DIR}", f"-I{t['include']}", f"-I{t['ffi_include']}", f"-I{nccl_inc}",
             f"-I{cuda / 'include'}",
             f"-L{t['lib']}", f"-L{t['ffi_lib']}", f"-L{nccl_lib}", f"-L{cuda_lib}",
             "-ltvm_runtime_extra", "-ltvm_runtime", "-ltvm_ffi", "-l:libnccl.so.2", "-lcudart",
             "-Wl,--no-undefined"]
            + [f"-Wl,-rpath,{p}" for p in rpaths])


def _tag(cmd: list[str]) -> str:
    import tvm

    h = hashlib.sha256()
    for f in (SOURCE, NVTX_HEADER, *sorted(TVM_SHIM_DIR.rglob("*.h"))):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    nccl_inc, _ = nccl_dirs()
    h.update((nccl_inc / "nccl.h").read_bytes())
    h.update(json.dumps({"tvm": tvm.__version__, "cmd": [c for c in cmd if not c.startswith("-o")]}).encode())
    return h.hexdigest()[:12]


def build_disco_nccl(out_dir: str | os.PathLike | None = None, *, force: bool = False, progress=print) -> Path:
    """Compile ``native/disco_nccl.cc`` into ``libmqa_byoc_disco_nccl.so``; returns its path.

    Parameters
    ----------
    out_dir
        Where the library goes; default the kernel cache (``$MQA_BYOC_CACHE`` or ``~/.cache/mqa_byoc``)
        under ``disco_nccl/<tag>``, the tag hashing the source, the NCCL header, TVM's version and the
        command. A library already there is reused unless ``force``.

    Raises
    ------
    DiscoNcclUnavailable
        A missing dependency (see :func:`build_command`), or the compile failed (its output in the message).
    """
    progress = progress or (lambda _m: None)
    probe = build_command(Path("lib.so"))
    if out_dir is None:
        out_dir = cache_root() / "disco_nccl" / _tag(probe)
    out_dir = Path(out_dir)
    out = out_dir / LIBRARY_NAME
    if out.is_file() and not force:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{LIBRARY_NAME}.{os.getpid()}"
    cmd = build_command(tmp)
    progress(f"building {out} ({Path(cmd[0]).name}, NCCL from {nccl_dirs()[1]})")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise DiscoNcclUnavailable(f"compiling {SOURCE.name} failed:\n{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    os.replace(tmp, out)
    return out


def _load(path, global_: bool = True) -> None:
    _handles.append(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL if global_ else ctypes.RTLD_LOCAL))


def _registered(name: str) -> bool:
    import tvm_ffi

    return tvm_ffi.get_global_func(name, allow_missing=True) is not None


def load_disco_nccl(path: str | os.PathLike | None = None, *, build: bool = True) -> Path | None:
    """Load our NCCL library into this process, so that ``runtime.disco.nccl.*`` exist.

    Loads first what it needs and a runtime-only TVM does not load by itself: disco
    (``libtvm_runtime_extra.so``), TVM's CUDA runtime (``libtvm_runtime_cuda.so``, where the CUDA driver
    is) and ``libnccl.so.2`` (:func:`nccl_library`). Sets ``$MQA_BYOC_DISCO_NCCL`` to the library, for worker processes.

    Parameters
    ----------
    path
        The library; default ``$MQA_BYOC_DISCO_NCCL``, else :func:`build_disco_nccl`'s (built if missing
        and ``build``).

    Returns
    -------
    Path or None
        The loaded library, or None when this TVM already has an NCCL CCL of its own (left in place).

    Raises
    ------
    DiscoNcclUnavailable
        No library and none can be built, or a load failed.
    """
    import tvm

    if _registered("runtime.disco.nccl.init_ccl"):
        if _registered(VERSION_FUNCTION):
            return Path(os.environ.get(LIBRARY_ENV, "")) if os.environ.get(LIBRARY_ENV) else None
        return None  # the TVM build's own NCCL
    if path is None and os.environ.get(LIBRARY_ENV):
        path = os.environ[LIBRARY_ENV]
    if path is None:
        if not build:
            raise DiscoNcclUnavailable("no NCCL library for disco given; build one with build_disco_nccl()")
        path = build_disco_nccl(progress=None)
    path = Path(path).resolve()
    if not path.is_file():
        raise DiscoNcclUnavailable(f"{path} does not exist; build it with mqa_byoc.tp.build_disco_nccl()")
    lib = Path(tvm.__file__).resolve().parent / "lib"
    try:
        if (lib / "libtvm_runtime_extra.so").is_file():
            _load(lib / "libtvm_runtime_extra.so")
        try:  # TVM's CUDA device API: loads only where the CUDA driver is (not needed to register)
            if (lib / "libtvm_runtime_cuda.so").is_file():
                _load(lib / "libtvm_runtime_cuda.so")
        except OSError:
            pass
        _load(nccl_library())
        _load(path)
    except OSError as e:
        raise DiscoNcclUnavailable(f"loading {path} failed: {e}") from None
    missing = [f for f in CCL_FUNCTIONS if not _registered(f"runtime.disco.nccl.{f}")]
    if missing:
        raise DiscoNcclUnavailable(f"{path} loaded but does not register runtime.disco.nccl.{missing}")
    os.environ[LIBRARY_ENV] = str(path)
    return path


def disco():
    """TVM's ``tvm.runtime.disco`` module, importable once disco's library is loaded (a runtime-only TVM
    leaves ``tvm.runtime.disco`` None at import)."""
    import importlib
    import sys

    import tvm.runtime

    load_disco_nccl()
    ffi_api = sys.modules.get("tvm.runtime.disco._ffi_api")
    if "tvm.runtime.disco" in sys.modules and hasattr(ffi_api, "SessionThreaded"):
        tvm.runtime.disco = sys.modules["tvm.runtime.disco"]
    else:
        # the import at `import tvm` failed half-way (no disco library then): it left submodules behind,
        # their FFI table made before disco's functions existed, and registered some of its Python
        # global functions. Remove both, then import again.
        import re

        import tvm_ffi

        pkg = Path(tvm.runtime.__file__).resolve().parent / "disco"
        for src in pkg.glob("*.py"):
            for fn in re.findall(r'register_global_func\(\s*"([^"]+)"', src.read_text()):
                if sys.modules.get(f"tvm.runtime.disco.{src.stem}") is not None and _registered(fn):
                    tvm_ffi.remove_global_func(fn)
        for name in [m for m in sys.modules if m == "tvm.runtime.disco" or m.startswith("tvm.runtime.disco.")]:
            del sys.modules[name]
        tvm.runtime.disco = importlib.import_module("tvm.runtime.disco")
    return tvm.runtime.disco


def threaded_session(num_workers: int, *device_ids: int, num_groups: int = 1):
    """A ``disco.ThreadedSession`` with NCCL initialized on ``device_ids`` (default 0 .. n-1)."""
    d = disco()
    sess = d.ThreadedSession(num_workers, num_groups)
    sess.init_ccl("nccl", *(device_ids or range(num_workers)))
    return sess


def process_session(num_workers: int, *device_ids: int, num_groups: int = 1,
                    entrypoint: str = "mqa_byoc.tp.disco_worker"):
    """A ``disco.ProcessSession`` whose worker processes load our NCCL library (the entry point
    :mod:`mqa_byoc.tp.disco_worker`), with NCCL initialized on ``device_ids`` (default 0 .. n-1)."""
    d = disco()
    sess = d.ProcessSession(num_workers, num_groups, entrypoint=entrypoint)
    sess.init_ccl("nccl", *(device_ids or range(num_workers)))
    return sess
