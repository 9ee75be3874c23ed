"""The kernel cache: its layout, its manifest, and directories of prebuilt objects.

Layout under :func:`~mqa_byoc.kernels.paths.cache_root`::

    src/flash_attn-2.8.3/                          flash-attn's extracted sdist
    fa2/dispatch/fa2_dispatch-<hash>.o             the dispatcher (named by its source, shim and flags)
    fa2/flash_attn-2.8.3/<arch>-<tag>/<stem>.o     kernel objects; <tag> hashes everything that changes them
    fa2/flash_attn-2.8.3/<arch>-<tag>/manifest.json

Several ``build-kernels`` processes may fill one directory at once: the manifest is only changed
under an exclusive ``flock`` on ``manifest.json.lock``. ``MQA_BYOC_KERNEL_DIR`` (``os.pathsep``
separated) names directories written by ``build-kernels --out``; they are searched before the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import paths
from .errors import NativeKernelsUnavailable
from .keys import KernelKey, normalize_arch
from .sources import FLASH_ATTN_VERSION, flash_attn_source, flash_attn_tree_version
from .toolchain import FLASH_NAMESPACE, detect_arch, dispatcher_flags, find_nvcc, kernel_flags, toolchain_versions

MANIFEST = "manifest.json"


def _tree_hash(items: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(items):
        if p.is_dir():
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                h.update(str(f.relative_to(p)).encode())
                h.update(f.read_bytes())
        else:
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Where and how the kernel objects of one arch are built.

    ``fa_root`` is None only in a plan made without sources (``build-kernels --dry-run``): the tag
    then assumes the pinned flash-attn version, which is what a fetch would bring.
    """

    arch: str
    nvcc: str
    fa_root: Path | None
    fa_version: str
    tag: str  # hash of everything that changes kernel objects
    dir: Path  # cache directory of this tag

    @property
    def include_flags(self) -> list[str]:
        """``-I`` flags of a kernel compile: the torch stand-ins, flash-attn's sources, its CUTLASS."""
        root = self.fa_root if self.fa_root is not None else Path(f"<flash_attn-{self.fa_version}>")
        return [
            f"-I{paths.SHIM_DIR}",
            f"-I{root / 'csrc/flash_attn/src'}",
            f"-I{root / 'csrc/cutlass/include'}",
        ]


def build_config(
    arch: str | None = None, *, fa_src=None, download: bool = True, progress=print, need_sources: bool = True
) -> BuildConfig:
    """The build configuration (and so the cache directory) of ``arch`` with the local toolchain.

    Parameters
    ----------
    need_sources : bool
        With False, a missing flash-attn tree gives ``fa_root=None`` instead of an error.

    Returns
    -------
    BuildConfig

    Raises
    ------
    NativeKernelsUnavailable
        No nvcc, or (with ``need_sources``) no flash-attn sources.
    """
    arch = normalize_arch(arch or detect_arch())
    nvcc = find_nvcc()
    try:
        fa_root = flash_attn_source(fa_src, download=download, progress=progress)
    except NativeKernelsUnavailable:
        if need_sources:
            raise
        fa_root = None
    fa_version = (flash_attn_tree_version(fa_root) if fa_root else None) or FLASH_ATTN_VERSION
    tv = toolchain_versions(nvcc)
    ident = {
        "flash_attn": fa_version,
        "arch": arch,
        "nvcc": tv["nvcc"],
        "host": tv["host"],
        "flags": kernel_flags(arch),
        "native": _tree_hash([paths.SHIM_DIR, paths.ENTRY_SOURCE]),
    }
    tag = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    d = paths.cache_root() / "fa2" / f"flash_attn-{fa_version}" / f"{arch}-{tag}"
    return BuildConfig(arch, nvcc, fa_root, fa_version, tag, d)


def dispatcher_name() -> str:
    """File name of the dispatcher object: changes with its source and headers, the shim and its flags.

    Returns
    -------
    str
        ``fa2_dispatch-<12 hex>.o``.
    """
    h = hashlib.sha256()
    for source in (paths.DISPATCH_SOURCE, paths.DISPATCH_HEADER, paths.GQA_DECODE_HEADER, paths.NVTX_HEADER):
        h.update(source.read_bytes())
    h.update(_tree_hash([paths.SHIM_DIR]).encode())
    h.update(json.dumps(dispatcher_flags()).encode())
    return f"fa2_dispatch-{h.hexdigest()[:12]}.o"


def dispatcher_cache_path() -> Path:
    """Where the dispatcher object is cached.

    Returns
    -------
    Path
    """
    return paths.cache_root() / "fa2" / "dispatch" / dispatcher_name()


def prebuilt_dirs(arch: str) -> list[Path]:
    """Directories under ``MQA_BYOC_KERNEL_DIR`` whose manifest names ``arch``.

    Each entry may be such a directory itself or hold them one or two levels down
    (``DIR/sm_90-<tag>`` as ``build-kernels --out DIR`` writes it).

    Returns
    -------
    list of Path
        In search order.
    """
    out = []
    for d in filter(None, os.environ.get("MQA_BYOC_KERNEL_DIR", "").split(os.pathsep)):
        p = Path(d).expanduser()
        for cand in [p] + sorted(p.glob(f"*/{arch}-*")) + sorted(p.glob(f"{arch}-*")):
            m = cand / MANIFEST
            if m.is_file():
                try:
                    if json.loads(m.read_text()).get("arch") == arch:
                        out.append(cand)
                except (OSError, ValueError):
                    pass
    return out


def find_kernels(keys: Iterable[KernelKey], arch: str, cfg: BuildConfig | None = None) -> dict[KernelKey, Path]:
    """Already-built objects for ``keys``: prebuilt dirs first, then the cache dir of ``cfg``.

    Returns
    -------
    dict
        ``{key: object path}`` for the keys found.
    """
    arch = normalize_arch(arch)
    dirs = prebuilt_dirs(arch) + ([cfg.dir] if cfg is not None else [])
    found = {}
    for k in keys:
        for d in dirs:
            p = d / f"{k.stem}.o"
            if p.is_file():
                found[k] = p
                break
    return found


@contextlib.contextmanager
def manifest_lock(directory: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``directory``'s manifest (``manifest.json.lock``, ``flock``).

    The lock belongs to the open file: each caller opens the lock file itself, so threads of one
    process exclude each other as processes do.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / (MANIFEST + ".lock"), "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read_manifest(directory: Path) -> dict:
    """The manifest of ``directory``.

    Returns
    -------
    dict
        Empty when there is none or it is unreadable.
    """
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def update_manifest(directory: Path, header: dict, entries: dict[str, dict]) -> dict:
    """Merge into ``directory``'s manifest under its lock; the file is replaced atomically.

    Parameters
    ----------
    header : dict
        Top-level fields, overwritten.
    entries : dict
        ``{section: {name: value}}``, merged into each section (existing names of other
        processes are kept).

    Returns
    -------
    dict
        The manifest as written.
    """
    directory = Path(directory)
    with manifest_lock(directory):
        data = read_manifest(directory)
        data.update(header)
        for section, items in entries.items():
            data.setdefault(section, {}).update(items)
        tmp = directory / f".{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, directory / MANIFEST)
    return data


def config_header(cfg: BuildConfig) -> dict:
    """Manifest fields that describe how the objects of ``cfg`` were built.

    Returns
    -------
    dict
    """
    tv = toolchain_versions(cfg.nvcc)
    return {
        "flash_attn": cfg.fa_version,
        "arch": cfg.arch,
        "tag": cfg.tag,
        "nvcc": tv["nvcc"],
        "host": tv["host"],
        "kernel_flags": kernel_flags(cfg.arch),
        "flash_namespace": FLASH_NAMESPACE,
    }
