import os
import sys

# test modules share fixtures and helpers (test_runtime_profile_paged imports test_runtime_profile)
sys.path.insert(0, os.path.dirname(__file__))


def pytest_unconfigure(config):
    """Remove the package's global functions from TVM's registry before the interpreter goes.

    They are Python callables (the codegen ``relax.ext.flash_attn``, the python provider's
    ``mqa_byoc.flash_attn_forward``, its var-len and sink twins); left in the registry they would be destroyed after the
    interpreter, during TVM's own teardown, and crash the process at exit."""
    if "tvm_ffi" not in sys.modules:
        return
    import tvm_ffi

    from mqa_byoc.contract import (CODEGEN, PY_FORWARD_FUNC, PY_SINK_FORWARD_FUNC, PY_SOFTCAP_FORWARD_FUNC,
                                   PY_VAR_LEN_FORWARD_FUNC)

    for name in ("relax.ext." + CODEGEN, PY_FORWARD_FUNC, PY_VAR_LEN_FORWARD_FUNC, PY_SINK_FORWARD_FUNC,
                 PY_SOFTCAP_FORWARD_FUNC):
        if tvm_ffi.get_global_func(name, allow_missing=True) is not None:
            tvm_ffi.remove_global_func(name)
