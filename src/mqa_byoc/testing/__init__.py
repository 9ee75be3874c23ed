"""Measurement utilities shared by the GPU tests, the benchmarks and ``mqa-byoc profile`` (like
``tvm.testing`` / ``flashinfer.testing``).

Run time only: importable with a runtime-only TVM (never imports ``tvm.relax``); torch and
``tvm_ffi`` are imported by the functions that need them.

- :mod:`.timing`: CUDA-event timing of back-to-back calls;
- :mod:`.cupti`: GPU kernels launched by a block of code (CUPTI through ``torch.profiler``);
- :mod:`.header`: the header of a run's JSON record (command, date, GPU, torch, CUDA);
- :mod:`.cuda_compile`: a ``tvm_callback_cuda_compile`` hook that restores the previous one;
- :mod:`.setup`: the run path's set-up hook (modules that prepare a runtime-only TVM).

Compile time (they need the full TVM, ``tvm.relax``; not exported by name, import the module): the
graph builders the CPU tests and the GPU artifact builders share (:mod:`.graphs`, :mod:`.varlen_graphs`)
and the graph fuzzer (:mod:`.fuzz`: the CI profile ``tests/test_graph_fuzz.py``, the long run
``tools/fuzz.py``).
"""

from __future__ import annotations

_EXPORTS = {
    "cuda_time_us": "timing",
    "time_call_us": "timing",
    "KernelStat": "cupti",
    "KernelCapture": "cupti",
    "capture_kernels": "cupti",
    "collect_kernels": "cupti",
    "run_header": "header",
    "gpu_info": "header",
    "cuda_compile_hook": "cuda_compile",
    "memoized_cuda_compile": "cuda_compile",
    "fatbin_cache_key": "cuda_compile",
    "import_setup": "setup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
