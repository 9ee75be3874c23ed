"""``mqa-byoc build-kernels``: what to build (:class:`BuildRequest`), its plan, and the build.

:mod:`mqa_byoc.cli` parses the command line into a :class:`BuildRequest`; :func:`run_build_kernels`
carries it out, or with ``dry_run`` prints the plan (keys, where each object comes from, the nvcc
commands) without compiling or fetching anything.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .build import copy_artifacts, dispatcher_command, kernel_command, link_check, link_inputs
from .cache import build_config, dispatcher_cache_path, dispatcher_name, find_kernels, prebuilt_dirs
from .errors import NativeKernelsUnavailable
from .keys import KernelKey, keys_for, normalize_arch
from .sources import FLASH_ATTN_VERSION, PIP_ENV, flash_attn_source, pip_download_command, source_cache
from .toolchain import detect_arch


@dataclasses.dataclass(frozen=True)
class BuildRequest:
    """What ``build-kernels`` builds: the cross product of head dims, dtypes, causal, split and softcap flags.

    ``arch`` None means :func:`~mqa_byoc.kernels.toolchain.detect_arch`; ``out`` also copies the
    objects to ``out/<arch>-<tag>/`` for ``MQA_BYOC_KERNEL_DIR``; ``dry_run`` prints the plan only.
    """

    arch: str | None = None
    head_dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("fp16", "bf16")
    causal: tuple[bool, ...] = (False, True)
    split: tuple[bool, ...] = (False, True)
    softcap: tuple[bool, ...] = (False,)  # (True,): the soft-capping families (``--softcap``)
    jobs: int | None = None
    nice: int = 0
    flash_attn_src: str | None = None
    out: str | None = None
    link_check: bool = False
    print_dir: bool = False
    dry_run: bool = False

    def keys(self) -> tuple[KernelKey, ...]:
        """The kernel keys requested.

        Returns
        -------
        tuple of KernelKey
        """
        return keys_for(self.head_dims, self.dtypes, self.causal, self.split, self.softcap)


def plan_lines(req: BuildRequest, arch: str) -> list[str]:
    """The build plan of ``req`` on ``arch``: where each object comes from, or the command making it.

    Nothing is compiled, fetched or written.

    Returns
    -------
    list of str
        Human-readable lines; problems that would stop the build start with ``blocked:``.
    """
    keys = req.keys()
    lines = [f"arch: {arch}", f"kernels ({len(keys)}): " + "; ".join(k.label for k in keys)]
    prebuilt = prebuilt_dirs(arch)
    lines.append("prebuilt dirs (MQA_BYOC_KERNEL_DIR): " + (", ".join(map(str, prebuilt)) or "none"))
    try:
        fa_root = flash_attn_source(req.flash_attn_src, download=False, progress=None)
        lines.append(f"flash-attn sources: {fa_root}")
    except NativeKernelsUnavailable as e:
        fa_root = None
        if req.flash_attn_src:
            lines.append(f"blocked: {e}")
        else:
            env = " ".join(f"{k}={v}" for k, v in PIP_ENV.items())
            lines.append(f"flash-attn sources: not cached; would fetch flash-attn {FLASH_ATTN_VERSION} with: "
                         f"{env} {' '.join(pip_download_command(source_cache()))}")
    try:
        cfg = build_config(arch, fa_src=req.flash_attn_src, download=False, progress=None, need_sources=False)
    except NativeKernelsUnavailable as e:
        cfg = None
        lines.append(f"blocked: {e}")
    found = find_kernels(keys, arch, cfg)
    if cfg is not None:
        lines += [f"nvcc: {cfg.nvcc}", f"cache dir: {cfg.dir}"]
    for k in keys:
        if k in found:
            lines.append(f"{k.label}: found {found[k]}")
        elif cfg is not None:
            lines.append(f"{k.label}: compile {' '.join(kernel_command(cfg, k))} -o {cfg.dir / (k.stem + '.o')}")
        else:
            lines.append(f"{k.label}: to compile (needs nvcc)")
    disp = next((d / dispatcher_name() for d in prebuilt if (d / dispatcher_name()).is_file()), None)
    disp = disp or (dispatcher_cache_path() if dispatcher_cache_path().is_file() else None)
    if disp is not None:
        lines.append(f"dispatcher: found {disp}")
    elif cfg is not None:
        lines.append(f"dispatcher: compile {' '.join(dispatcher_command(cfg.nvcc, fa_root))} -o {dispatcher_cache_path()}")
    else:
        lines.append("dispatcher: to compile (needs nvcc)")
    if req.out:
        where = f"{Path(req.out).expanduser()}/{arch}-{cfg.tag if cfg else '<tag>'}"
        lines.append(f"copy: objects, libcudart_static.a and manifest.json to {where}")
    if req.link_check:
        lines.append("link check: fa2_link_check" + (f" in {where}" if req.out else " (temporary directory)"))
    return lines


def run_build_kernels(req: BuildRequest, *, echo: Callable[[str], None] | None = None) -> int:
    """Carry out ``mqa-byoc build-kernels``.

    Parameters
    ----------
    req : BuildRequest
        Parsed by :mod:`mqa_byoc.cli`.
    echo : callable, optional
        Receives progress lines (default: print to stdout, flushed).

    Returns
    -------
    int
        Exit status: 0, or 1 after printing the error (no toolchain, no sources, a failed compile).
    """
    echo = echo or (lambda m: print(m, flush=True))
    try:
        arch = normalize_arch(req.arch or detect_arch())
        if req.print_dir:
            echo(str(build_config(arch, fa_src=req.flash_attn_src, download=False).dir))
            return 0
        if req.dry_run:
            echo("[mqa-byoc] dry run: nothing is compiled, fetched or written")
            for line in plan_lines(req, arch):
                echo("  " + line)
            return 0
        keys = req.keys()
        t0 = time.monotonic()
        echo(f"[mqa-byoc] {len(keys)} kernel(s) for {arch}: " + "; ".join(k.label for k in keys))
        objs, _libs = link_inputs(keys, arch, jobs=req.jobs, niceness=req.nice, fa_src=req.flash_attn_src,
                                  progress=echo)
        cfg = build_config(arch, fa_src=req.flash_attn_src, download=False)
        echo(f"[mqa-byoc] done in {time.monotonic() - t0:.0f}s; objects in {cfg.dir}")
        if req.out:
            copy_artifacts(req.out, keys, arch, link_check_binary=req.link_check, progress=echo)
        elif req.link_check:
            link_check(objs, progress=echo)
    except (NativeKernelsUnavailable, ValueError, RuntimeError) as e:
        print(f"mqa-byoc build-kernels: error: {e}", file=sys.stderr)
        return 1
    return 0
