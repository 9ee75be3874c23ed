"""The CUDA toolchain: the one nvcc lookup of the project, the toolkit root, the GPU's arch.

Everything that needs nvcc (kernel builds, the codegen's default provider) asks :func:`find_nvcc`
or :func:`nvcc_available`, so ``MQA_BYOC_NVCC`` means the same thing everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from .errors import NativeKernelsUnavailable
from .keys import DEFAULT_ARCH, normalize_arch

#: where nvcc is looked for after PATH, $CUDA_HOME/bin and $CUDA_PATH/bin
_NVCC_CANDIDATES = ("/usr/local/cuda/bin/nvcc",)

#: namespace flash-attn's templates are compiled into (keeps them apart from a flash_attn wheel's)
FLASH_NAMESPACE = "mqa_byoc_flash"

_NVCC_HINT = 'nvcc not found; install the CUDA toolkit (or set MQA_BYOC_NVCC) or use provider="python"'


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_nvcc() -> str:
    """Path of nvcc.

    ``MQA_BYOC_NVCC`` (if set, even empty) is authoritative; otherwise ``PATH``, ``$CUDA_HOME/bin``,
    ``$CUDA_PATH/bin`` and ``/usr/local/cuda/bin``.

    Returns
    -------
    str
        An executable nvcc (possibly a wrapper script).

    Raises
    ------
    NativeKernelsUnavailable
        No nvcc, or ``MQA_BYOC_NVCC`` does not name an executable.
    """
    if "MQA_BYOC_NVCC" in os.environ:
        p = os.environ["MQA_BYOC_NVCC"]
        if p and _executable(p):
            return p
        raise NativeKernelsUnavailable(f"{_NVCC_HINT} (MQA_BYOC_NVCC={p!r} is not an executable)")
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = [
        os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)
    ] + list(_NVCC_CANDIDATES)
    for c in candidates:
        if _executable(c):
            return c
    raise NativeKernelsUnavailable(_NVCC_HINT)


def nvcc_available() -> bool:
    """Whether :func:`find_nvcc` finds nvcc.

    Returns
    -------
    bool
    """
    try:
        find_nvcc()
    except NativeKernelsUnavailable:
        return False
    return True


def run_version(cmd: Sequence[str]) -> str:
    """Output of a version query; never raises.

    Returns
    -------
    str
        stdout (plus stderr when useful), stripped; ``unknown (<error>)`` when the command cannot run.
    """
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        out = r.stdout + (r.stderr if r.returncode == 0 or not r.stdout else "")
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return out.strip()


def cuda_home(nvcc: str | None = None) -> Path:
    """The CUDA toolkit root of ``nvcc`` (which may be a wrapper script).

    Returns
    -------
    Path
        A directory holding ``include/cuda_runtime.h``.

    Raises
    ------
    NativeKernelsUnavailable
        No such directory found.
    """
    nvcc = nvcc or find_nvcc()
    cands = [Path(os.path.realpath(nvcc)).parent.parent]
    out = run_version([nvcc, "--dryrun", "--version"]) + "\n" + run_version(
        [nvcc, "--dryrun", "-E", "-x", "cu", os.devnull]
    )
    m = re.search(r"^#\$ TOP=(.+)$", out, re.M)
    if m:
        cands.insert(0, Path(os.path.realpath(m.group(1).strip())))
    cands += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands.append(Path("/usr/local/cuda"))
    for c in cands:
        if (c / "include" / "cuda_runtime.h").is_file():
            return c
    raise NativeKernelsUnavailable(f"cannot locate the CUDA toolkit of {nvcc}")


def cuda_lib_dir(nvcc: str | None = None) -> Path:
    """The toolkit directory holding ``libcudart_static.a``.

    Returns
    -------
    Path

    Raises
    ------
    NativeKernelsUnavailable
        The toolkit has no static CUDA runtime.
    """
    home = cuda_home(nvcc)
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        if (home / sub / "libcudart_static.a").exists():
            return home / sub
    raise NativeKernelsUnavailable(f"libcudart_static.a not found under {home}")


_version_cache: dict[str, str] = {}


def toolchain_versions(nvcc: str) -> dict[str, str]:
    """nvcc's release line and the host compiler's version (both part of the cache key).

    Returns
    -------
    dict
        ``{"nvcc": "Cuda compilation tools, release 13.0, ...", "host": "13.3.0"}``.
    """
    if nvcc not in _version_cache:
        nv = run_version([nvcc, "--version"]).splitlines()
        release = next((ln for ln in nv if "release" in ln), nv[-1] if nv else "unknown")
        host = os.environ.get("NVCC_CCBIN") or "g++"
        _version_cache[nvcc] = json.dumps({"nvcc": release.strip(), "host": run_version([host, "-dumpfullversion"])})
    return json.loads(_version_cache[nvcc])


def detect_arch() -> str:
    """The arch to build for: ``$MQA_BYOC_ARCH``, else GPU 0's compute capability, else sm_90.

    Returns
    -------
    str
        A normalized arch (``sm_90``).
    """
    env = os.environ.get("MQA_BYOC_ARCH")
    if env:
        return normalize_arch(env)
    smi = shutil.which("nvidia-smi")
    if smi:
        out = run_version([smi, "--query-gpu=compute_cap", "--format=csv,noheader"])
        first = out.splitlines()[0].strip() if out else ""
        if re.fullmatch(r"\d+\.\d", first):
            return normalize_arch(first)
    return DEFAULT_ARCH


def kernel_flags(arch: str) -> list[str]:
    """nvcc flags of kernel objects (without ``-I``, the key's ``-D`` and ``-o``); part of the cache key.

    Returns
    -------
    list of str
    """
    num = normalize_arch(arch)[3:]
    return [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        f"-gencode=arch=compute_{num},code=sm_{num}",
        "-Xcompiler=-fPIC,-fvisibility=hidden",
        "-Wno-deprecated-gpu-targets",
        f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}",
        "-DFLASHATTENTION_DISABLE_BACKWARD",
        "-DFLASHATTENTION_DISABLE_DROPOUT",
        "-DFLASHATTENTION_DISABLE_ALIBI",
        "-DFLASHATTENTION_DISABLE_SOFTCAP",
    ]


def dispatcher_flags() -> list[str]:
    """nvcc flags of the dispatcher object (host code, arch independent); part of its name.

    Returns
    -------
    list of str
    """
    return [
        "-O2",
        "-std=c++17",
        "-Xcompiler=-fPIC,-fvisibility=hidden",
        f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}",
    ]
