"""A TVM FFI global function replaced for a block and put back after it (TVM's runtime looks up hooks
such as ``tvm_callback_cuda_compile`` and disco's ``runtime.disco.allreduce`` by name)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable


@contextlib.contextmanager
def replaced_global_func(name: str, make: Callable):
    """Register ``make(previous)`` as the global function ``name`` for the block.

    ``previous`` is the function registered before (None if none). On exit ``previous`` is registered
    again, or ``name`` removed when there was none.

    Returns
    -------
    Callable
        As the ``with`` target: the registered function.
    """
    import tvm_ffi

    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    fn = make(previous)
    tvm_ffi.register_global_func(name, fn, override=True)
    try:
        yield fn
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)
