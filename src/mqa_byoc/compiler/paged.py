"""TVM's PagedKVCache attention on FA2: rewrite the ``("tirx", <PrimFunc>)`` entries of the cache.

A ``relax.frontend.nn`` LLM makes its KV cache with ``TIRPagedKVCache``, i.e. one
``R.call_pure_packed("vm.builtin.paged_attention_kv_cache_create", ...)`` whose arguments include
its attention kernels as ``(R.str("tirx"), <GlobalVar of a TIR PrimFunc>)`` tuples. The runtime calls
each one with the PrimFunc's parameter list. :class:`UseFlashAttentionForPagedKVCache` replaces the
GlobalVar of each entry it can serve by ``R.ExternFunc(<symbol>)``: a TVM-FFI function with the same
parameter list (:mod:`~mqa_byoc.compiler.paged_codegen`) that runs FA2 with native K/V heads on the
cache's own pages. It keeps on TIR, with a reason (:func:`paged_kv_cache_report`):

- the sliding-window entries (their ``length_info`` is (3, batch) with window offsets and attention
  sinks, which FA2's paged kernel does not take), tree attention, MLA;
- caches with RoPE inline mode (RoPE inside the attention kernel; FA2 has none on paged K);
- dtypes other than float16 / bfloat16, head dims FA2 has no kernel for, H not a multiple of H_kv;
- a constant page size that is not a multiple of FA2's split-KV tile (below).

Page size: FA2's split-KV kernel (the one that reads a block table) loads K/V tiles of kBlockN rows
from one page, so the page size must be a multiple of kBlockN: 256 for head dim <= 64, 128 for
<= 128, 64 for <= 256 (flash-attn's Python API asks for 256 for all). The cache's page size is
normally a run-time value; a served entry called with another page size fails with a ValueError
naming this rule. TVM's own TIR paged kernels are generated for page size 16 only (``page_size=16``
in ``_attention_prefill`` / ``_attention_decode``), so a cache whose attention runs on FA2 uses a
larger page size, and the entries kept on TIR (sliding window, tree attention) cannot run with it.

The pass attaches the wrappers' C++ to the module (``external_mods``); the exported library must be
linked by :func:`mqa_byoc.export_library`, which adds the FA2 objects and ``native/fa2_paged.cu``.
PrimFuncs no longer referenced are removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from mqa_byoc.compiler import analysis
from mqa_byoc.compiler.paged_codegen import KINDS, PagedConfig, emit_paged_source
from mqa_byoc.kernels import KERNEL_HEAD_DIMS

CREATE = "vm.builtin.paged_attention_kv_cache_create"
# positions in the create call (after the callee) of TVM 0.27's TIRPagedKVCache for GPU targets
_ARG_SHAPES, _ARG_H, _ARG_HKV, _ARG_DQK, _ARG_DV, _ARG_KIND, _ARG_ROPE, _ARG_DTYPE = 0, 2, 3, 4, 5, 6, 8, 12
_PAGE_SIZE = 3  # in the first ShapeExpr
_ROPE_INLINE = 2  # RopeMode.INLINE
_ATTN_MHA, _ATTN_MHA_SLIDING = 0, 3
_KEPT = {
    "batch_prefill_paged_kv_sliding_window": "sliding-window prefill: its length_info (3, batch) carries window "
    "offsets and attention sinks, which FA2's paged kernel does not take",
    "batch_decode_paged_kv_sliding_window": "sliding-window decode: its length_info (3, batch) carries window "
    "offsets and attention sinks, which FA2's paged kernel does not take",
    "tree_attn_paged_kv": "tree attention (speculative decoding masks) has no FA2 kernel",
    "batch_tree_attn": "tree attention (speculative decoding masks) has no FA2 kernel",
}


class PagedKVCacheError(ValueError):
    """A paged-KV-cache create call the pass cannot read (its layout is not TVM 0.27's)."""


@dataclass(frozen=True)
class PagedAttentionDecision:
    """What the pass does with one attention entry of one ``paged_attention_kv_cache_create`` call."""

    function: str  # the Relax function holding the create call
    kernel: str  # global_symbol of TVM's TIR kernel
    offloaded: bool
    symbol: str | None  # the FA2 extern function, when offloaded
    reason: str | None  # why not, otherwise
    note: str | None = None  # run-time conditions of an offloaded entry


def page_unit(head_dim: int) -> int:
    """The page-size unit of FA2's paged kernel: kBlockN of its split-KV kernel for ``head_dim``
    (one fact with ``mqa_byoc_fa2_paged_page_unit`` in native/fa2_paged.cu)."""
    hd = min(d for d in (32, 64, 96, 128, 192, 256) if d >= head_dim)
    return 256 if hd <= 64 else (128 if hd <= 128 else 64)


def _int(expr):
    """The Python int of a PrimValue / IntImm argument, else None."""
    value = getattr(expr, "value", expr)
    return int(value.value) if isinstance(value, tvm.tirx.IntImm) else (int(value) if isinstance(value, int) else None)


def _is_create_call(expr) -> bool:
    return (isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.call_pure_packed")
            and isinstance(expr.args[0], relax.ExternFunc) and expr.args[0].global_symbol == CREATE)


def _kernel_name(mod: tvm.IRModule, gv: relax.GlobalVar) -> str:
    func = mod[gv] if gv in mod.get_global_vars() else None
    sym = func.attrs.get("global_symbol") if func is not None and func.attrs is not None else None
    return str(sym) if sym is not None else gv.name_hint


def _cache_reason(args) -> tuple[PagedConfig | None, str | None]:
    """The cache's geometry, or why none of its entries can run on FA2."""
    if len(args) < 25:
        return None, f"create call has {len(args)} arguments, not the layout of TVM 0.27's TIRPagedKVCache"
    h, hkv, dqk, dv = (_int(args[i]) for i in (_ARG_H, _ARG_HKV, _ARG_DQK, _ARG_DV))
    if None in (h, hkv, dqk, dv):
        return None, "heads / head dims are not constants"
    kinds = [_int(x) for x in getattr(args[_ARG_KIND], "values", [])]
    if any(k not in (_ATTN_MHA, _ATTN_MHA_SLIDING) for k in kinds):
        return None, "MLA layers (attn_kind) have no FA2 kernel here"
    if _int(args[_ARG_ROPE]) == _ROPE_INLINE:
        return None, "RoPE inline mode applies RoPE inside the attention kernel; FA2 has none for paged K"
    dtype = str(getattr(getattr(args[_ARG_DTYPE], "ty", None), "dtype", ""))
    if dtype not in ("float16", "bfloat16"):
        return None, f"dtype {dtype or '?'}: FA2 runs float16 and bfloat16"
    if dqk != dv:
        return None, f"qk head dim {dqk} != v head dim {dv}: FA2 needs them equal"
    if dqk % 8 or dqk <= 0 or dqk > max(KERNEL_HEAD_DIMS):
        return None, f"head dim {dqk}: FA2 needs a multiple of 8 up to {max(KERNEL_HEAD_DIMS)}"
    if hkv <= 0 or h % hkv:
        return None, f"H={h} is not a multiple of H_kv={hkv}"
    page = _int(args[_ARG_SHAPES].values[_PAGE_SIZE]) if isinstance(args[_ARG_SHAPES], relax.ShapeExpr) else None
    if page is not None and page % page_unit(dqk):
        return None, (f"page size {page} is not a multiple of {page_unit(dqk)} (FA2's split-KV tile for head dim "
                      f"{dqk} must lie in one page)")
    return PagedConfig(h, hkv, dqk, dtype), None


def _decide(mod, fname, call) -> list[tuple[int, PagedAttentionDecision]]:
    """``(argument index, decision)`` for each ``("tirx", GlobalVar)`` attention entry of ``call``."""
    args = list(call.args[1:])
    cfg, cache_reason = _cache_reason(args)
    out = []
    for i, arg in enumerate(args):
        if not (isinstance(arg, relax.Tuple) and len(arg.fields) == 2):
            continue
        fn = arg.fields[1]
        if isinstance(fn, relax.ExternFunc) and str(fn.global_symbol).startswith("mqa_byoc_paged_"):
            kernel = {v: k for k, v in KINDS.items()}[str(fn.global_symbol).split("_")[3]]  # mqa_byoc_paged_<kind>_...
            out.append((i, PagedAttentionDecision(fname, kernel, True, str(fn.global_symbol), None, "already rewritten")))
            continue
        if not isinstance(fn, relax.GlobalVar):
            continue
        kernel = _kernel_name(mod, arg.fields[1])
        kind = KINDS.get(kernel)
        if kind is None:
            reason = _KEPT.get(kernel, f"{kernel} is not an attention kernel FA2 serves")
            out.append((i, PagedAttentionDecision(fname, kernel, False, None, reason)))
        elif cache_reason is not None:
            out.append((i, PagedAttentionDecision(fname, kernel, False, None, cache_reason)))
        else:
            note = None if kind == "ragged" else f"page size must be a multiple of {page_unit(cfg.head_dim)} at run time"
            out.append((i, PagedAttentionDecision(fname, kernel, True, cfg.symbol(kind), None, note)))
    return out


def _create_calls(mod: tvm.IRModule):
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            found = []
            relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if _is_create_call(e) else None)
            for call in found:
                yield gv.name_hint, call


def paged_kv_cache_report(mod: tvm.IRModule) -> list[PagedAttentionDecision]:
    """What :class:`UseFlashAttentionForPagedKVCache` does with every paged-cache attention entry.

    Returns
    -------
    list of PagedAttentionDecision
        One per ``("tirx", PrimFunc)`` entry of every ``paged_attention_kv_cache_create`` call.

    Raises
    ------
    TypeError
        When ``mod`` is not an IRModule.
    """
    analysis.require_module(mod, "paged_kv_cache_report")
    return [d for fname, call in _create_calls(mod) for _, d in _decide(mod, fname, call)]


def format_paged_report(decisions) -> str:
    """One line per decision, for people."""
    lines = []
    for d in decisions:
        if d.offloaded:
            lines.append(f"{d.function}: {d.kernel} -> FA2 {d.symbol}" + (f" ({d.note})" if d.note else ""))
        else:
            lines.append(f"{d.function}: {d.kernel} stays on TVM's TIR kernel: {d.reason}")
    return "\n".join(lines)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, fname):
        super().__init__(mod)
        self.mod_ = mod
        self.fname = fname
        self.served: dict[PagedConfig, set[str]] = {}

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not _is_create_call(call):
            return call
        args = list(call.args)
        for i, d in _decide(self.mod_, self.fname, call):
            if d.offloaded:
                cfg, _ = _cache_reason(args[1:])
                self.served.setdefault(cfg, set()).add(KINDS[d.kernel])
                tag = args[i + 1].fields[0]
                args[i + 1] = relax.Tuple([tag, relax.ExternFunc(d.symbol)])
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


def _used_global_vars(mod: tvm.IRModule) -> set:
    used = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: used.add(e) if isinstance(e, relax.GlobalVar) else None)
    return used


@tvm.transform.module_pass(opt_level=0, name="UseFlashAttentionForPagedKVCache")
class UseFlashAttentionForPagedKVCache:
    """Run the attention of TVM's PagedKVCache (prefill, decode, ragged prefill) on FA2.

    See the module docstring for what is served and what stays on TIR;
    :func:`paged_kv_cache_report` says it per entry. Export the built module with
    :func:`mqa_byoc.export_library`.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        analysis.require_module(mod, "UseFlashAttentionForPagedKVCache")
        served: dict[PagedConfig, set[str]] = {}
        replaced = set()
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            calls = []
            relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if _is_create_call(e) else None)
            if not calls:
                continue
            for call in calls:
                for i, d in _decide(mod, gv.name_hint, call):
                    if d.offloaded:
                        replaced.add(call.args[i + 1].fields[1])
            rw = _Rewriter(mod, gv.name_hint)
            mod[gv] = rw.visit_expr(func)
            for cfg, kinds in rw.served.items():
                served.setdefault(cfg, set()).update(kinds)
        if not served:
            return mod
        used = _used_global_vars(mod)
        for gv in replaced - used:
            del mod[gv]
        ext = list((mod.attrs or {}).get("external_mods", []))
        create = tvm.get_global_func("runtime.CSourceModuleCreate")
        for cfg, kinds in sorted(served.items(), key=lambda kv: kv[0].tag):
            code = emit_paged_source(cfg, kinds)
            ext.append(create(code, "cc", [cfg.symbol(k) for k in sorted(kinds)], []))
        return mod.with_attr("external_mods", ext)
