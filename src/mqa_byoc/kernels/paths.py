"""Where the build's inputs and outputs live: our native sources and the kernel cache."""

from __future__ import annotations

import os
from pathlib import Path

#: our C++/CUDA sources (package data of ``mqa_byoc``)
NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"
ENTRY_SOURCE = NATIVE_DIR / "fa2_kernel_entry.cu"
DISPATCH_SOURCE = NATIVE_DIR / "fa2_dispatch.cc"
DISPATCH_HEADER = NATIVE_DIR / "fa2_dispatch.h"
LINK_CHECK_SOURCE = NATIVE_DIR / "fa2_link_check.cc"
#: our split-KV decode kernels (chunk lengths, combine): device code, compiled per arch
COMBINE_SOURCE = NATIVE_DIR / "split_kv_combine.cu"
#: stand-ins for the three torch headers flash-attn's forward kernels include
SHIM_DIR = NATIVE_DIR / "shim"


def cache_root() -> Path:
    """Root of the kernel cache: ``$MQA_BYOC_CACHE``, else ``~/.cache/mqa_byoc``.

    Returns
    -------
    Path
        Not necessarily existing yet.
    """
    env = os.environ.get("MQA_BYOC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mqa_byoc"
