"""Compiling and linking: kernel and dispatcher objects into the cache, link inputs, prebuilt copies.

:func:`build_kernels` / :func:`build_dispatcher` compile what is not found (prebuilt dirs first, then
the cache), :func:`link_inputs` returns everything ``export_library`` must link (dispatcher, kernels,
static cudart), :func:`copy_artifacts` writes a directory for ``MQA_BYOC_KERNEL_DIR`` on another
machine, :func:`link_check` links a small test program against the objects.
"""

from __future__ import annotations

import concurrent.futures as _futures
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from . import paths
from .cache import (
    MANIFEST,
    BuildConfig,
    build_config,
    config_header,
    dispatcher_cache_path,
    dispatcher_name,
    find_kernels,
    prebuilt_dirs,
    read_manifest,
    update_manifest,
)
from .errors import NativeKernelsUnavailable
from .keys import DTYPES, SOFTCAP_NAMESPACE, KernelKey, build_command_hint, normalize_arch, plan_kernels
from .sources import FLASH_ATTN_VERSION, flash_attn_source
from .toolchain import FLASH_NAMESPACE, cuda_lib_dir, detect_arch, dispatcher_flags, find_nvcc, kernel_flags


class _Killed(RuntimeError):
    """A compiler process was killed (usually by the OOM killer)."""


def run_compile(cmd: list[str], out: Path, log: Path, niceness: int = 0) -> float:
    """Run one compile to a temp name, then rename; returns seconds. Raises with the log tail."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    full = cmd + ["-o", str(tmp)]
    if niceness > 0 and shutil.which("nice"):
        full = ["nice", "-n", str(niceness)] + full
    t0 = time.monotonic()
    with open(log, "w") as lf:
        lf.write(" ".join(full) + "\n\n")
        lf.flush()
        rc = subprocess.run(full, stdout=lf, stderr=subprocess.STDOUT).returncode
    dt = time.monotonic() - t0
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        if rc in (137, -9):
            raise _Killed(f"compiling {out.name} was killed (exit {rc}; out of memory? use fewer --jobs); log {log}")
        raise RuntimeError(f"compiling {out.name} failed (exit {rc}); log {log}:\n{tail}")
    os.replace(tmp, out)
    return dt


def key_flags(arch: str, key: KernelKey) -> list[str]:
    """:func:`~.toolchain.kernel_flags` for ``key``: a soft-capping family drops
    ``FLASHATTENTION_DISABLE_SOFTCAP`` and compiles into :data:`~.keys.SOFTCAP_NAMESPACE` (the same
    template names as the other families', kept apart at link time).

    Returns
    -------
    list of str
    """
    flags = kernel_flags(arch)
    if not key.softcap:
        return flags
    return [f"-DFLASH_NAMESPACE={SOFTCAP_NAMESPACE}" if f == f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}" else f
            for f in flags if f != "-DFLASHATTENTION_DISABLE_SOFTCAP"]


def kernel_command(cfg: BuildConfig, key: KernelKey) -> list[str]:
    """The nvcc command (without ``-o``) that compiles ``key``'s object under ``cfg``.

    Returns
    -------
    list of str
    """
    return (
        [cfg.nvcc, "-c"]
        + key_flags(cfg.arch, key)
        + cfg.include_flags
        + [
            f'-DMQA_BYOC_FA_FILE="{key.flash_attn_file}"',
            f"-DMQA_BYOC_ENTRY={key.entry_symbol}",
            f"-DMQA_BYOC_ELEM={DTYPES[key.dtype]}",
            f"-DMQA_BYOC_HDIM={key.head_dim}",
            f"-DMQA_BYOC_CAUSAL={'true' if key.causal else 'false'}",
            f"-DMQA_BYOC_SPLIT={int(key.split)}",
            "-x",
            "cu",
            str(paths.ENTRY_SOURCE),
        ]
    )


def dispatcher_command(nvcc: str, fa_root: Path | None) -> list[str]:
    """The nvcc command (without ``-o``) that compiles the dispatcher.

    Returns
    -------
    list of str
    """
    root = fa_root if fa_root is not None else Path(f"<flash_attn-{FLASH_ATTN_VERSION}>")
    return (
        [nvcc, "-c"]
        + dispatcher_flags()
        + [f"-I{paths.SHIM_DIR}", f"-I{root / 'csrc/flash_attn/src'}", str(paths.DISPATCH_SOURCE)]
    )


def default_jobs() -> int:
    """Parallel nvcc processes: one per CPU, at most one per 3 GiB of memory, at most 32.

    Returns
    -------
    int
    """
    cpus = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gb = 8
    return max(1, min(cpus, int(mem_gb // 3), 32))


def build_kernels(
    keys: Iterable[KernelKey],
    arch: str | None = None,
    *,
    jobs: int | None = None,
    niceness: int = 0,
    build: bool = True,
    fa_src=None,
    progress: Callable[[str], None] | None = print,
) -> dict[KernelKey, Path]:
    """Objects for ``keys`` on ``arch``, compiling those not found (in parallel, one line per file).

    Returns
    -------
    dict
        ``{key: object path}`` for every key.

    Raises
    ------
    NativeKernelsUnavailable
        No toolchain or sources, or (with ``build=False``) a key not built; names the command.
    RuntimeError
        A compile failed (with the tail of its log).
    """
    progress = progress or (lambda _msg: None)
    keys = list(dict.fromkeys(keys))  # keep the caller's order: it is the build order
    arch = normalize_arch(arch or detect_arch())
    found = find_kernels(keys, arch)  # prebuilt dirs need no toolchain and no sources
    if len(found) == len(keys):
        return found
    cfg = build_config(arch, fa_src=fa_src, download=build, progress=progress)
    found = find_kernels(keys, arch, cfg)
    missing = [k for k in keys if k not in found]
    if not missing:
        return found
    if not build:
        labels = ", ".join(k.label for k in missing)
        raise NativeKernelsUnavailable(
            f"FA2 kernels not built for {arch}: {labels}; run `{build_command_hint(missing, arch)}`"
        )
    cfg.dir.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(jobs or default_jobs(), len(missing)))
    progress(
        f"[mqa-byoc] compiling {len(missing)} FA2 kernel file(s) for {arch} with {jobs} job(s) "
        f"into {cfg.dir} (a few minutes each)"
    )
    done = 0
    lock = threading.Lock()
    errors = []

    def one(key: KernelKey):
        nonlocal done
        out = cfg.dir / f"{key.stem}.o"
        try:
            try:
                dt = run_compile(kernel_command(cfg, key), out, cfg.dir / f"{key.stem}.log", niceness)
            except _Killed as e:  # one retry: memory pressure is often transient
                progress(f"[mqa-byoc] {arch} {key.label}: {e}; retrying once")
                time.sleep(30)
                dt = run_compile(kernel_command(cfg, key), out, cfg.dir / f"{key.stem}.log", niceness)
        except Exception as e:  # noqa: BLE001 - reported below
            with lock:
                done += 1
                errors.append(e)
                progress(f"[mqa-byoc] [{done}/{len(missing)}] {arch} {key.label}: FAILED")
            return
        entry = {"file": out.name, "seconds": round(dt, 1), "bytes": out.stat().st_size}
        update_manifest(cfg.dir, config_header(cfg), {"kernels": {key.label: entry}})
        with lock:
            done += 1
            found[key] = out
            progress(f"[mqa-byoc] [{done}/{len(missing)}] {arch} {key.label}: {dt:.0f}s -> {out.name}")

    with _futures.ThreadPoolExecutor(jobs) as ex:
        list(ex.map(one, missing))
    if errors:
        raise RuntimeError(f"{len(errors)} FA2 kernel compile(s) failed; first:\n{errors[0]}")
    return found


def build_dispatcher(
    *, build: bool = True, fa_src=None, progress: Callable[[str], None] | None = print, arch: str | None = None
) -> Path:
    """The dispatcher object (host code, arch independent), compiling it if needed.

    Returns
    -------
    Path
        From a prebuilt dir of ``arch`` if there is one, else the cache.

    Raises
    ------
    NativeKernelsUnavailable
        No toolchain, or no flash-attn sources (fetched only with ``build=True``).
    """
    progress = progress or (lambda _msg: None)
    name = dispatcher_name()
    for d in prebuilt_dirs(normalize_arch(arch or detect_arch())):
        if (d / name).is_file():
            return d / name
    nvcc = find_nvcc()
    fa_root = flash_attn_source(fa_src, download=build, progress=progress)
    out = dispatcher_cache_path()
    if out.is_file():
        return out
    # compiled even with build=False: it takes seconds (``build`` guards the kernels, minutes each), and
    # a prebuilt kernel dir stays usable after a change of our dispatcher source
    dt = run_compile(dispatcher_command(nvcc, fa_root), out, out.with_suffix(".log"))
    progress(f"[mqa-byoc] dispatcher: {dt:.0f}s -> {out}")
    return out


def source_object(
    source: Path,
    arch: str,
    flags: Sequence[str],
    *,
    subdir: str,
    inputs: Iterable[Path] = (),
    includes: Callable[[], list[str]] | None = None,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """One of our native sources compiled with nvcc for ``arch`` (seconds), named by what it is made of.

    The name, ``<stem>-<arch>-<12 hex>.o``, hashes ``source``, ``inputs`` (headers; directories are
    read file by file) and ``flags``; the object comes from a prebuilt dir of ``arch`` when one holds it,
    else from ``<cache>/<subdir>``, compiled there when missing. ``includes`` gives ``-I`` flags that are
    needed only to compile (e.g. fetched sources), not part of the name.

    Returns
    -------
    Path
    """
    import hashlib

    arch = normalize_arch(arch)
    h = hashlib.sha256(source.read_bytes())
    for p in inputs:
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(f.read_bytes())
    h.update(json.dumps(list(flags)).encode())
    name = f"{source.stem}-{arch}-{h.hexdigest()[:12]}.o"
    for d in prebuilt_dirs(arch):
        if (d / name).is_file():
            return d / name
    out = paths.cache_root() / subdir / name
    if not out.is_file():
        cmd = [find_nvcc(), *flags, *(includes() if includes else []), "-c", str(source)]
        dt = run_compile(cmd, out, out.with_suffix(".log"))
        (progress or (lambda _m: None))(f"[mqa-byoc] {source.name}: {dt:.0f}s -> {out}")
    return out


def gencode_flags(arch: str) -> list[str]:
    """nvcc flags of our device-code sources: optimised, position independent, hidden, for ``arch``."""
    num = normalize_arch(arch)[3:]
    return ["-O3", "-std=c++17", "-Xcompiler=-fPIC,-fvisibility=hidden", f"-gencode=arch=compute_{num},code=sm_{num}"]


def support_object(arch: str, progress: Callable[[str], None] | None = print) -> Path:
    """``native/decode_support.cu`` for ``arch``: the decode kernels the dispatcher calls, ours
    (``gqa_decode.cu``) and the chunk lengths + combine of the FA2 chunked decode (``split_kv_combine.cu``)
    (:func:`source_object`; needs nvcc, not flash-attn's sources).

    Returns
    -------
    Path
    """
    return source_object(paths.SUPPORT_SOURCE, arch, gencode_flags(arch), subdir="fa2/support",
                         inputs=(paths.COMBINE_SOURCE, paths.GQA_DECODE_SOURCE, paths.GQA_DECODE_HEADER,
                                 paths.SINK_EPILOGUE_SOURCE), progress=progress)


def static_cudart(arch: str | None = None) -> list[str]:
    """Linker inputs for the static CUDA runtime; put them after every object.

    A ``libcudart_static.a`` in a prebuilt dir (MQA_BYOC_KERNEL_DIR) wins, so a machine with only
    the driver can export; otherwise the one of the local CUDA toolkit.

    Returns
    -------
    list of str
    """
    lib = None
    if arch is not None:
        lib = next((d / "libcudart_static.a" for d in prebuilt_dirs(normalize_arch(arch))
                    if (d / "libcudart_static.a").is_file()), None)
    if lib is None:
        lib = cuda_lib_dir() / "libcudart_static.a"
    return [str(lib), "-ldl", "-lpthread", "-lrt"]


def link_inputs(
    specs_or_keys: Iterable,
    arch: str | None = None,
    *,
    build: bool = True,
    jobs: int | None = None,
    niceness: int = 0,
    fa_src=None,
    progress: Callable[[str], None] | None = print,
) -> tuple[list[str], list[str]]:
    """``(objects, libs)`` to link for these attention specs (or kernel keys).

    ``objects``: dispatcher + kernel objects (link them as files, not through an archive: the
    dispatcher only references kernels weakly). ``libs``: static cudart and friends, to be placed
    after all objects on the link line.

    Returns
    -------
    tuple of (list of str, list of str)
        ``(objects, libs)``.
    """
    keys = set()
    for s in specs_or_keys:
        keys.update([s] if isinstance(s, KernelKey) else plan_kernels(s))
    arch = normalize_arch(arch or detect_arch())
    kernels = build_kernels(keys, arch, jobs=jobs, niceness=niceness, build=build, fa_src=fa_src, progress=progress)
    disp = build_dispatcher(build=build, fa_src=fa_src, progress=progress, arch=arch)
    objects = [str(disp), str(support_object(arch, progress))] + [str(kernels[k]) for k in sorted(keys)]
    return objects, static_cudart(arch)


def copy_artifacts(
    dest: str | os.PathLike, keys: Iterable[KernelKey], arch: str, *, link_check_binary: bool = False, progress=print
) -> Path:
    """Copy dispatcher + kernel objects + static cudart + manifest to ``dest/<arch>-<tag>/``.

    Point ``MQA_BYOC_KERNEL_DIR`` at ``dest`` on another machine: export then needs neither nvcc nor
    flash-attn's sources there. With ``link_check_binary``, also ``fa2_link_check`` (static, needs only
    the driver; ``fa2_link_check --run`` checks the kernels on GPU 0 against a CPU reference).

    Returns
    -------
    Path
        The directory written.
    """
    keys = list(keys)
    arch = normalize_arch(arch)
    cfg = build_config(arch, download=False, progress=progress)
    kernels = find_kernels(keys, arch, cfg)
    missing = [k.label for k in keys if k not in kernels]
    if missing:
        raise NativeKernelsUnavailable(f"not built: {', '.join(missing)}")
    out = Path(dest).expanduser() / f"{arch}-{cfg.tag}"
    out.mkdir(parents=True, exist_ok=True)
    disp = build_dispatcher(build=False, arch=arch, progress=progress)
    support = support_object(arch, progress)
    cudart = cuda_lib_dir(cfg.nvcc) / "libcudart_static.a"
    for p in [disp, support, *kernels.values(), cudart]:
        shutil.copy2(p, out / p.name)
    manifest = read_manifest(cfg.dir)
    manifest.update({"arch": arch, "tag": cfg.tag, "flash_attn": cfg.fa_version, "dispatcher": disp.name,
                     "support": support.name, "cudart": cudart.name})
    manifest["kernels"] = {k: v for k, v in manifest.get("kernels", {}).items() if KernelKey.parse(k) in kernels}
    if link_check_binary:
        link_check([str(out / disp.name), str(out / support.name)] + [str(out / p.name) for p in kernels.values()],
                   out=out / "fa2_link_check", progress=progress)
        manifest["link_check"] = "fa2_link_check"
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    progress(f"[mqa-byoc] copied {len(kernels) + 1} object(s) and libcudart_static.a to {out}")
    return out


def link_check(objects: Sequence[str], *, out: str | os.PathLike | None = None, progress=print) -> Path:
    """Link a tiny C++ program (not run) against ``objects`` + static cudart: proves the symbols resolve.

    Returns
    -------
    Path
        The linked ``fa2_link_check`` program.
    """
    nvcc = find_nvcc()
    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="mqa_byoc_link_")) / "fa2_link_check"
    cmd = (
        [nvcc, "-std=c++17", "-O2", f"-I{paths.NATIVE_DIR}", "-o", str(out), str(paths.LINK_CHECK_SOURCE)]
        + list(objects)
        + ["-cudart=static", "-ldl", "-lpthread", "-lrt"]
    )
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"link check failed:\n{r.stdout}\n{r.stderr}\n{' '.join(cmd)}")
    progress(f"[mqa-byoc] link check ok: {out}")
    return out
