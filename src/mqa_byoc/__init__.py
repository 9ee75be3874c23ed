"""mqa-byoc: offload grouped-query / multi-query attention in TVM Relax graphs to Flash Attention v2.

Compile-time entry points (they need the full apache-tvm wheel) are resolved lazily, so that
``mqa_byoc.runtime`` and the kernel build stay importable where only TVM's runtime is installed.

Public names
------------
partition_for_cutlass
    Partition a Relax module so that attention runs in FA2 (a ``Sequential`` of the passes below).
offload_report, OffloadSite
    What the partition does with each attention, and why.
gemm_report, GemmSite, PartitionGemm
    What the partition does with each GEMM (cuBLASLt or TVM), and why; the GEMM partition pass alone.
CanonicalizeAttention, AnnotateProvider, LegalizeGroupedAttention
    The partition's module passes, for users who compose their own ``Sequential``.
export_library
    Export a built executable, linking the native FA2 kernels it needs.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it; add an entry to export a new name
_LAZY = {
    "partition_for_cutlass": "mqa_byoc.compiler.partition",
    "offload_report": "mqa_byoc.compiler.partition",
    "OffloadSite": "mqa_byoc.compiler.partition",
    "AnnotateProvider": "mqa_byoc.compiler.partition",
    "CanonicalizeAttention": "mqa_byoc.compiler.graph.canonicalize",
    "LegalizeGroupedAttention": "mqa_byoc.compiler.graph.gqa_legalize",
    "build": "mqa_byoc.compiler.build",
    "gemm_report": "mqa_byoc.compiler.graph.gemm",
    "GemmSite": "mqa_byoc.compiler.graph.gemm",
    "PartitionGemm": "mqa_byoc.compiler.graph.gemm",
    "RestoreLoweredMatmul": "mqa_byoc.compiler.graph.lowered_matmul",
    "export_library": "mqa_byoc.compiler.export",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from mqa_byoc.compiler.graph.canonicalize import CanonicalizeAttention
    from mqa_byoc.compiler.export import export_library
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.graph.gemm import GemmSite, PartitionGemm, gemm_report
    from mqa_byoc.compiler.graph.lowered_matmul import RestoreLoweredMatmul
    from mqa_byoc.compiler.partition import AnnotateProvider, OffloadSite, offload_report, partition_for_cutlass


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'mqa_byoc' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
