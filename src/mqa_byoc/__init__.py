"""mqa-byoc: offload grouped-query / multi-query attention in TVM Relax graphs to Flash Attention v2.

Compile-time entry points (need the full apache-tvm wheel) are resolved lazily, so that
``mqa_byoc.runtime`` stays importable where only TVM's runtime is installed.
"""

__version__ = "0.1.0"

_LAZY = {
    "partition_for_cutlass": "mqa_byoc.compiler.partition",
    "offload_report": "mqa_byoc.compiler.partition",
    "OffloadSite": "mqa_byoc.compiler.partition",
    "LegalizeGroupedAttention": "mqa_byoc.compiler.gqa_legalize",
    "build": "mqa_byoc.compiler.build",
    "export_library": "mqa_byoc.compiler.export",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mqa_byoc' has no attribute {name!r}")


__all__ = sorted(_LAZY)
