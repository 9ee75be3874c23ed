"""Native FA2 forward kernels, built apart from their use: keys, toolchain, sources, cache, build.

Nothing here imports TVM. The modules, in dependency order:

- :mod:`~mqa_byoc.kernels.keys`: :class:`KernelKey` (one compiled kernel family), :func:`plan_kernels`
  (the keys one attention needs), the marker lines the codegen writes and export reads back.
- :mod:`~mqa_byoc.kernels.toolchain`: the one nvcc lookup (:func:`find_nvcc`), the CUDA toolkit,
  the GPU's arch, nvcc flags.
- :mod:`~mqa_byoc.kernels.sources`: flash-attn's pinned source tree (fetched with pip, sha256 checked).
- :mod:`~mqa_byoc.kernels.cache`: cache layout, the manifest (file-locked), prebuilt dirs
  (``MQA_BYOC_KERNEL_DIR``).
- :mod:`~mqa_byoc.kernels.build`: compile and link (:func:`link_inputs` is what export links).
- :mod:`~mqa_byoc.kernels.command`: ``mqa-byoc build-kernels`` (parsed by :mod:`mqa_byoc.cli`).
"""

from __future__ import annotations

from .build import (
    build_dispatcher,
    build_kernels,
    copy_artifacts,
    default_jobs,
    link_check,
    link_inputs,
    static_cudart,
)
from .cache import BuildConfig, build_config, find_kernels, prebuilt_dirs, read_manifest, update_manifest
from .command import BuildRequest, plan_lines, run_build_kernels
from .errors import FlashAttnSourceUnavailable, NativeKernelsUnavailable
from .keys import (
    DEFAULT_ARCH,
    DTYPES,
    KERNEL_HEAD_DIMS,
    MARKER,
    KernelKey,
    build_command_hint,
    kernel_head_dim,
    keys_for,
    marker_line,
    normalize_arch,
    normalize_dtype,
    parse_markers,
    plan_kernels,
)
from .paths import NATIVE_DIR, cache_root
from .sources import FLASH_ATTN_SHA256, FLASH_ATTN_VERSION, fetch_sdist, flash_attn_source, pip_download_command
from .toolchain import cuda_home, detect_arch, find_nvcc, nvcc_available

__all__ = [
    "DEFAULT_ARCH",
    "DTYPES",
    "FLASH_ATTN_SHA256",
    "FLASH_ATTN_VERSION",
    "KERNEL_HEAD_DIMS",
    "MARKER",
    "NATIVE_DIR",
    "BuildConfig",
    "BuildRequest",
    "FlashAttnSourceUnavailable",
    "KernelKey",
    "NativeKernelsUnavailable",
    "build_command_hint",
    "build_config",
    "build_dispatcher",
    "build_kernels",
    "cache_root",
    "copy_artifacts",
    "cuda_home",
    "default_jobs",
    "detect_arch",
    "fetch_sdist",
    "find_kernels",
    "find_nvcc",
    "flash_attn_source",
    "kernel_head_dim",
    "keys_for",
    "link_check",
    "link_inputs",
    "marker_line",
    "normalize_arch",
    "normalize_dtype",
    "nvcc_available",
    "parse_markers",
    "pip_download_command",
    "plan_kernels",
    "plan_lines",
    "prebuilt_dirs",
    "read_manifest",
    "run_build_kernels",
    "static_cudart",
    "update_manifest",
]


def __dir__() -> list[str]:
    return sorted(__all__)
