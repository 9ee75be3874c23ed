"""Paged KV cache: TVM's ``PagedKVCache`` attention on FA2 kernels.

``transform`` (the pass :class:`UseFlashAttentionForPagedKVCache` and its report), ``codegen`` (the
TVM-FFI wrappers it attaches) and ``build`` (the object they link). The pass and its report are
importable from this package.
"""

_PUBLIC = ("UseFlashAttentionForPagedKVCache", "PagedAttentionDecision", "paged_kv_cache_report",
           "format_paged_report", "page_unit")

__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        from mqa_byoc.compiler.paged import transform

        return getattr(transform, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
