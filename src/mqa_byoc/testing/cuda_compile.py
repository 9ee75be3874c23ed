"""TVM compiles the CUDA source kept in an exported library when the library is loaded, through the
global function ``tvm_callback_cuda_compile``. :func:`cuda_compile_hook` puts a function in front of
the one registered before (e.g. the runtime-only kit's nvcc hook) and puts that one back on exit."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from mqa_byoc.runtime.ffi_globals import replaced_global_func

HOOK = "tvm_callback_cuda_compile"


def fatbin_cache_key(code: str, arch: str) -> str:
    """File stem of a precompiled fatbin of ``code`` for ``arch``."""
    return f"{hashlib.sha256(code.encode()).hexdigest()[:32]}-{arch}"


def cuda_compile_hook(make: Callable):
    """Register ``make(previous)`` as ``tvm_callback_cuda_compile`` for the block.

    ``previous`` is the function registered before (None if none); the new one usually serves what
    it can and calls ``previous`` for the rest. On exit ``previous`` is registered again (or the
    hook removed when there was none).

    Returns
    -------
    Callable
        As the ``with`` target: the registered function.
    """
    return replaced_global_func(HOOK, make)


def memoized_cuda_compile(previous: Callable | None):
    """A compile function for :func:`cuda_compile_hook` that compiles each distinct source once
    (identical kernels in several libraries) with ``previous``."""
    if previous is None:
        raise RuntimeError(f"no {HOOK} registered to compile with (a runtime-only TVM needs its set-up module "
                           "imported first)")
    cache = {}

    def compile_cuda(code, *rest):
        key = hashlib.sha256(str(code).encode()).hexdigest()
        if key not in cache:
            cache[key] = bytes(previous(code, *rest))
        return bytearray(cache[key])

    return compile_cuda
