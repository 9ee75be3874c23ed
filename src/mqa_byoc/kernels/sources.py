"""flash-attn's source tree: a given tree or sdist, the cached one, or the pinned sdist fetched with pip.

pip fetches the sdist (so the user's index, mirror and proxy settings apply); its sha256 is checked
against :data:`FLASH_ATTN_SHA256` before it is extracted into ``<cache>/src``. On an offline machine
``MQA_BYOC_FLASH_ATTN_SRC`` names an extracted tree or the sdist instead.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import FlashAttnSourceUnavailable, NativeKernelsUnavailable
from .paths import cache_root

FLASH_ATTN_VERSION = "2.8.3"
FLASH_ATTN_SHA256 = "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d"
#: flash-attn's setup.py compiles CUDA unless told not to; pip runs it for the sdist's metadata
PIP_ENV = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}

#: ``runner(cmd, env)``: runs a command, returns a CompletedProcess with text stdout/stderr
Runner = Callable[[Sequence[str], dict], subprocess.CompletedProcess]


def _run(cmd: Sequence[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True)


def sdist_name() -> str:
    """File name of the pinned sdist.

    Returns
    -------
    str
        ``flash_attn-2.8.3.tar.gz``.
    """
    return f"flash_attn-{FLASH_ATTN_VERSION}.tar.gz"


def pip_download_command(dest: str | os.PathLike, python: str | None = None) -> list[str]:
    """The pip command that saves the pinned flash-attn sdist into ``dest`` (run it with :data:`PIP_ENV`).

    ``--no-build-isolation``: pip prepares the sdist's metadata by running flash-attn's setup.py,
    which imports torch; in an isolated build environment torch is missing and that step fails.

    Returns
    -------
    list of str
    """
    return [
        python or sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", f"flash-attn=={FLASH_ATTN_VERSION}", "-d", os.fspath(dest),
    ]  # fmt: skip


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file.

    Returns
    -------
    str
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(tarball: Path) -> None:
    """Raise :class:`FlashAttnSourceUnavailable` unless ``tarball`` is the pinned sdist."""
    digest = sha256_of(tarball)
    if digest != FLASH_ATTN_SHA256:
        raise FlashAttnSourceUnavailable(
            f"{tarball}: sha256 {digest} != expected {FLASH_ATTN_SHA256} (flash-attn {FLASH_ATTN_VERSION})"
        )


def fetch_sdist(dest_dir: str | os.PathLike, *, runner: Runner | None = None, progress=print) -> Path:
    """Download the pinned flash-attn sdist into ``dest_dir`` with pip; sha256 checked.

    Parameters
    ----------
    dest_dir : path
        Where the tarball is put (created if needed).
    runner : callable, optional
        ``runner(cmd, env) -> CompletedProcess`` (tests inject a fake pip); default: subprocess.
    progress : callable or None
        Receives one line before pip starts.

    Returns
    -------
    Path
        ``dest_dir/flash_attn-2.8.3.tar.gz``.

    Raises
    ------
    FlashAttnSourceUnavailable
        pip failed or saved no sdist (the message names both fixes: install torch for pip's metadata
        step, or set ``MQA_BYOC_FLASH_ATTN_SRC``), or the sha256 does not match.
    """
    runner = runner or _run
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / sdist_name()
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest_dir) as tmp:
        cmd = pip_download_command(tmp)
        if progress:
            progress(f"[mqa-byoc] fetching flash-attn {FLASH_ATTN_VERSION} sources: {' '.join(cmd)}")
        r = runner(cmd, dict(os.environ, **PIP_ENV))
        saved = sorted(Path(tmp).glob("flash_attn-*.tar.gz")) + sorted(Path(tmp).glob("flash-attn-*.tar.gz"))
        if r.returncode != 0 or not saved:
            tail = "\n".join(((r.stdout or "") + (r.stderr or "")).strip().splitlines()[-15:])
            raise FlashAttnSourceUnavailable(
                f"pip could not fetch flash-attn {FLASH_ATTN_VERSION}'s sdist (exit {r.returncode}"
                f"{'' if saved else ', no sdist saved'}). Either install torch (pip runs flash-attn's "
                "setup.py, which imports torch, to read the sdist's metadata) and retry, or, offline, set "
                f"MQA_BYOC_FLASH_ATTN_SRC to an extracted flash_attn-{FLASH_ATTN_VERSION} tree or its sdist.\n"
                f"command: {' '.join(cmd)}\n{tail}"
            )
        check_sha256(saved[0])
        os.replace(saved[0], final)
    return final


def is_flash_attn_tree(root: Path) -> bool:
    """Whether ``root`` holds flash-attn's forward sources and its CUTLASS.

    Returns
    -------
    bool
    """
    return (root / "csrc/flash_attn/src/flash.h").is_file() and (
        root / "csrc/cutlass/include/cutlass/cutlass.h"
    ).is_file()


def flash_attn_tree_version(root: Path) -> str | None:
    """The version a flash-attn tree declares (PKG-INFO, else ``flash_attn/__init__.py``).

    Returns
    -------
    str or None
    """
    pkg = root / "PKG-INFO"
    if pkg.is_file():
        m = re.search(r"^Version:\s*(\S+)", pkg.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    init = root / "flash_attn/__init__.py"
    if init.is_file():
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", init.read_text(errors="replace"))
        if m:
            return m.group(1)
    return None


def _extract(tarball: Path, dest_parent: Path) -> Path:
    check_sha256(tarball)
    dest_parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest_parent))
    try:
        with tarfile.open(tarball) as tf:
            if sys.version_info >= (3, 12) or hasattr(tarfile, "data_filter"):
                tf.extractall(tmp, filter="data")
            else:  # pragma: no cover - old Pythons without extraction filters
                for m in tf.getmembers():
                    if m.name.startswith("/") or ".." in Path(m.name).parts:
                        raise NativeKernelsUnavailable(f"unsafe path in {tarball}: {m.name}")
                tf.extractall(tmp)
        inner = tmp / f"flash_attn-{FLASH_ATTN_VERSION}"
        if not is_flash_attn_tree(inner):
            raise NativeKernelsUnavailable(f"{tarball} does not hold a flash-attn source tree")
        final = dest_parent / f"flash_attn-{FLASH_ATTN_VERSION}"
        if not is_flash_attn_tree(final):
            if final.exists():
                shutil.rmtree(final)
            os.replace(inner, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_cache() -> Path:
    """Directory of the cached sdist and its extracted tree.

    Returns
    -------
    Path
        ``<cache root>/src``.
    """
    return cache_root() / "src"


def flash_attn_source(
    src: str | os.PathLike | None = None, *, download: bool = True, progress=print, runner: Runner | None = None
) -> Path:
    """Root of a flash-attn source tree (the directory holding ``csrc/``).

    Parameters
    ----------
    src : path, optional
        An extracted tree or the sdist; default ``$MQA_BYOC_FLASH_ATTN_SRC``, else the cache.
    download : bool
        Fetch the pinned sdist with pip when the cache has none.
    runner : callable, optional
        Passed to :func:`fetch_sdist`.

    Returns
    -------
    Path

    Raises
    ------
    NativeKernelsUnavailable
        ``src`` is not a tree or sdist, or the cache has none and ``download`` is False.
    FlashAttnSourceUnavailable
        The fetch failed or the sdist's sha256 does not match.
    """
    src = src or os.environ.get("MQA_BYOC_FLASH_ATTN_SRC")
    src_cache = source_cache()
    cached = src_cache / f"flash_attn-{FLASH_ATTN_VERSION}"
    if src:
        p = Path(src).expanduser()
        if p.is_dir():
            for cand in (p, p / f"flash_attn-{FLASH_ATTN_VERSION}"):
                if is_flash_attn_tree(cand):
                    return cand.resolve()
            raise NativeKernelsUnavailable(f"{p} is not a flash-attn source tree (no csrc/flash_attn/src/flash.h)")
        if p.is_file():
            return cached if is_flash_attn_tree(cached) else _extract(p, src_cache)
        raise NativeKernelsUnavailable(f"flash-attn source {p} does not exist")
    if is_flash_attn_tree(cached):
        return cached
    tarball = src_cache / sdist_name()
    if not tarball.is_file():
        if not download:
            raise NativeKernelsUnavailable(
                f"flash-attn {FLASH_ATTN_VERSION} sources are not in {src_cache}; set "
                "MQA_BYOC_FLASH_ATTN_SRC to an extracted tree or the sdist, or allow the download"
            )
        tarball = fetch_sdist(src_cache, runner=runner, progress=progress)
    return _extract(tarball, src_cache)
