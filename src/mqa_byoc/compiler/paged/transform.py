"""TVM's PagedKVCache attention on FA2: rewrite the ``("tirx", <PrimFunc>)`` entries of the cache.

A ``relax.frontend.nn`` LLM makes its KV cache with ``TIRPagedKVCache``, i.e. one
``R.call_pure_packed("vm.builtin.paged_attention_kv_cache_create", ...)`` whose arguments include
its attention kernels as ``(R.str("tirx"), <GlobalVar of a TIR PrimFunc>)`` tuples. The runtime calls
each one with the PrimFunc's parameter list. :class:`UseFlashAttentionForPagedKVCache` replaces the
GlobalVar of each entry it can serve by ``R.ExternFunc(<symbol>)``: a TVM-FFI function with the same
parameter list (:mod:`~mqa_byoc.compiler.paged.codegen`) that runs FA2 with native K/V heads on the
cache's own pages. With them it replaces TVM's merge of attention states (``tir_attention_merge_state``,
passed bare in the attn-merge tuple), whose grid leaves the last H mod (heads per block) heads unmerged
(:func:`tir_merge_heads`; H=71, D=64: head 70), by our kernel. It keeps on TIR, with a reason
(:func:`paged_kv_cache_report`):

- the sliding-window entries (their ``length_info`` is (3, batch) with window offsets and attention
  sinks, which FA2's paged kernel does not take), tree attention, MLA;
- caches with RoPE inline mode (RoPE inside the attention kernel; FA2 has none on paged K);
- dtypes other than float16 / bfloat16, head dims FA2 has no kernel for, H not a multiple of H_kv;
- a constant page size that is not a multiple of FA2's split-KV tile (below).

Page size: FA2's split-KV kernel (the one that reads a block table) loads K/V tiles of kBlockN rows
from one page, so the page size must be a multiple of kBlockN: 256 for head dim <= 64, 128 for
<= 128, 64 for <= 256 (flash-attn's Python API asks for 256 for all; :func:`page_unit`). TVM 0.27
generates its TIR cache kernels for page size 16 only (``page_size=16`` defaults of
``_kv_cache_transpose_append``, ``_compact_kv_copy``, ``_attention_prefill`` / ``_decode``; the
cache's run-time ``page_size`` must match them). So the pass also regenerates the append and the
compaction kernels, with TVM's own generators, for the page size ``page_size`` (default: the unit
of the cache's head dim), and the cache must then be created with that page size (a served entry
called with a page size that is not a multiple of the unit fails with a ValueError naming the
rule). The entries that stay on TIR (sliding window, tree attention) are generated for 16 and so
cannot run in such a cache; the report says so.

The pass attaches the wrappers' C++ to the module (``external_mods``); the exported library must be
linked by :func:`mqa_byoc.export_library`, which adds the FA2 objects and ``native/fa2_paged.cu``.
PrimFuncs no longer referenced are removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from mqa_byoc.compiler.graph.site import require_module
from mqa_byoc.compiler.paged.codegen import KINDS, PagedConfig, emit_paged_source, fa4_ragged_keys
from mqa_byoc.compiler.provider import cuda_target, target_arch
from mqa_byoc.contract import check_provider
from mqa_byoc.kernels import KERNEL_HEAD_DIMS, kernel_head_dim
from mqa_byoc.kernels import hopper as _hopper

CREATE = "vm.builtin.paged_attention_kv_cache_create"
# positions in the create call (after the callee) of TVM 0.27's TIRPagedKVCache for GPU targets
_ARG_SHAPES, _ARG_H, _ARG_HKV, _ARG_DQK, _ARG_DV, _ARG_KIND, _ARG_ROPE, _ARG_DTYPE = 0, 2, 3, 4, 5, 6, 8, 12
_PAGE_SIZE, _SLIDING = 3, 4  # in the first ShapeExpr: page_size, support_sliding_window
_NUM_ARGS = 28  # of the GPU form of the create call
_ARG_APPEND, _ARG_COMPACT = 13, 27  # kv_cache_transpose_append, compact_kv_copy (page size 16 in TVM)
_ARG_MERGE = 23  # the attn-merge tuple (tir_attention_merge_state[, tir_attention_merge_state_mla]): no "tirx" tag
_TVM_PAGE = 16  # the page size TVM 0.27's TIR cache kernels are generated for
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
    (``run_mha_fwd_splitkv_dispatch``; the same rule as ``mqa_byoc_fa2_paged_page_unit`` in
    native/fa2_paged.cu, which checks it at run time)."""
    hd = kernel_head_dim(head_dim)
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


def _cache_reason(args, page_size=None) -> tuple[PagedConfig | None, str | None]:
    """The cache's geometry, or why none of its entries can run on FA2 with pages of ``page_size``."""
    if len(args) != _NUM_ARGS:
        return None, f"create call has {len(args)} arguments, not the {_NUM_ARGS} of TVM 0.27's TIRPagedKVCache"
    h, hkv, dqk, dv = (_int(args[i]) for i in (_ARG_H, _ARG_HKV, _ARG_DQK, _ARG_DV))
    if None in (h, hkv, dqk, dv):
        return None, "heads / head dims are not constants"
    kinds = [_int(x) for x in getattr(args[_ARG_KIND], "values", [])]
    if any(k != _ATTN_MHA for k in kinds):
        if _ATTN_MHA_SLIDING in kinds:
            return None, ("layers with sliding-window attention (mha_sliding) run TVM's sliding-window kernels, "
                          f"which are generated for page size {_TVM_PAGE} only")
        return None, "MLA layers (attn_kind) have no FA2 kernel here"
    shapes = args[_ARG_SHAPES].values if isinstance(args[_ARG_SHAPES], relax.ShapeExpr) else None
    if shapes is not None and _int(shapes[_SLIDING]) == 1:
        return None, ("the cache supports sliding windows (support_sliding_window=1): TVM then runs its "
                      f"sliding-window kernels, generated for page size {_TVM_PAGE} only")
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
    if not all(isinstance(args[i], relax.GlobalVar) for i in (_ARG_APPEND, _ARG_COMPACT)):
        return None, "the append / compaction kernels are not PrimFuncs of this module (cannot change the page size)"
    fixed = _int(shapes[_PAGE_SIZE]) if shapes is not None else None
    if fixed is not None and page_size is not None and fixed != page_size:
        return None, f"the create call fixes page size {fixed}, the pass was asked for {page_size}"
    page = page_size if page_size is not None else fixed
    if page is not None and page % page_unit(dqk):
        return None, (f"page size {page} is not a multiple of {page_unit(dqk)} (FA2's split-KV tile for head dim "
                      f"{dqk} must lie in one page)")
    return PagedConfig(h, hkv, dqk, dtype, page or page_unit(dqk)), None


def tir_merge_heads(num_heads: int, head_dim: int, max_threads: int = 1024) -> int:
    """How many of ``num_heads`` TVM 0.27's TIR ``_merge_state_inplace`` merges: its block has
    head_dim / VEC threads in x and num_heads halved until the block fits in y, its grid
    num_heads // (heads per block) blocks in y, so the last num_heads % (heads per block) are left out."""
    bdx = head_dim // min(max(4, head_dim // 32), 4)
    bdy = num_heads
    while bdx * bdy > max_threads and bdy > 1:
        bdy //= 2
    return num_heads // bdy * bdy


def fa4_ragged_reason(cfg: PagedConfig, provider: str, arch: str | None) -> str | None:
    """None when the ragged entry of ``cfg`` runs on FA4 with ``provider``; else why it stays on FA2.
    ``"auto"`` (the default): FA4 where the hopper provider can have its objects, else FA2."""
    if provider == "auto":
        provider = "hopper"
    if provider != "hopper":
        return f"the {provider} provider runs FA2"
    keys = fa4_ragged_keys(cfg)
    if not keys:
        return f"head dim {cfg.head_dim} has no FA4 object (FA4 objects are built for {_hopper.HEAD_DIMS})"
    return _hopper.available(arch, keys)


def _ragged_note(cfg: PagedConfig, provider: str, arch: str | None) -> str:
    why = fa4_ragged_reason(cfg, provider, arch)
    if why is None:
        return (f"FA4 sm90 var-len forward (flash-attn-4 {_hopper.FA4_VERSION}, group "
                f"{cfg.num_q_heads // cfg.num_kv_heads}), its tiles mapped to sequences on the GPU; FA2 var-len "
                "when an operand is not 16-byte aligned")
    if provider == "native":
        return "FA2 var-len forward"
    return f"FA2 var-len forward ({'hopper provider' if provider == 'hopper' else 'provider auto, FA4 not used'}: {why})"


def _entry(mod, fname, fn, cfg, cache_reason, provider="native", arch="sm_90"):
    """The decision for one attention entry ``fn`` (GlobalVar or our ExternFunc), or None if not one."""
    if isinstance(fn, relax.ExternFunc) and str(fn.global_symbol).startswith("mqa_byoc_paged_"):
        kernel = {v: k for k, v in KINDS.items()}[str(fn.global_symbol).split("_")[3]]  # mqa_byoc_paged_<kind>_...
        return PagedAttentionDecision(fname, kernel, True, str(fn.global_symbol), None, "already rewritten")
    if not isinstance(fn, relax.GlobalVar):
        return None
    kernel = _kernel_name(mod, fn)
    kind = KINDS.get(kernel)
    if kind is None:
        reason = _KEPT.get(kernel, f"{kernel} is not an attention kernel FA2 serves")
        if cfg is not None and cfg.page_size != _TVM_PAGE:
            reason += f"; TVM generates it for page size {_TVM_PAGE}, so it cannot run with pages of {cfg.page_size}"
        return PagedAttentionDecision(fname, kernel, False, None, reason)
    if cache_reason is not None:
        return PagedAttentionDecision(fname, kernel, False, None, cache_reason)
    if kind == "merge":
        merged = tir_merge_heads(cfg.num_q_heads, cfg.head_dim)
        note = (f"replaces TVM's TIR merge_state, whose grid leaves heads out when H is not a multiple of its "
                f"block's heads (for H={cfg.num_q_heads}, D={cfg.head_dim} it merges {merged} of {cfg.num_q_heads}); "
                "ours merges every (row, head)")
        return PagedAttentionDecision(fname, kernel, True, cfg.symbol(kind), None, note)
    note = f"create the cache with page_size={cfg.page_size}, support_sliding_window=0"
    if kind == "ragged":
        note = f"{_ragged_note(cfg, provider, arch)}; {note}"
    return PagedAttentionDecision(fname, kernel, True, cfg.symbol(kind), None, note)


def _decide(mod, fname, call, page_size=None, provider="native",
            arch="sm_90") -> list[tuple[int, int, PagedAttentionDecision]]:
    """``(argument index, tuple field, decision)`` for each attention entry of ``call``: the
    ``("tirx", GlobalVar)`` tuples (field 1) and the MHA merge of the attn-merge tuple (field 0; an
    MLA cache's second merge stays, with the whole cache)."""
    args = list(call.args[1:])
    cfg, cache_reason = _cache_reason(args, page_size)
    cpu = sorted({_kernel_name(mod, f) for a in args if isinstance(a, relax.Tuple) for f in a.fields
                  if isinstance(f, relax.GlobalVar) and _kernel_name(mod, f).endswith("_cpu")})
    if cpu:
        cfg, cache_reason = None, (f"the cache was created for a CPU target (its kernels are TVM's CPU ones: "
                                   f"{', '.join(cpu)}); ours run on CUDA GPUs: export the model for a CUDA target")
    out = []
    for i, arg in enumerate(args):
        if not isinstance(arg, relax.Tuple):
            continue
        if i == _ARG_MERGE and len(args) == _NUM_ARGS:
            fields = range(len(arg.fields))
        elif len(arg.fields) == 2:
            fields = (1,)
        else:
            continue
        for j in fields:
            d = _entry(mod, fname, arg.fields[j], cfg, cache_reason, provider, arch)
            if d is not None:
                out.append((i, j, d))
    return out


def _create_calls(mod: tvm.IRModule):
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            found = []
            relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if _is_create_call(e) else None)
            for call in found:
                yield gv.name_hint, call


def paged_kv_cache_report(mod: tvm.IRModule, page_size: int | None = None, provider: str = "auto",
                          arch: str = "sm_90") -> list[PagedAttentionDecision]:
    """What ``UseFlashAttentionForPagedKVCache(page_size, provider=provider)`` does with every
    paged-cache attention entry (for a target of ``arch``).

    Returns
    -------
    list of PagedAttentionDecision
        One per ``("tirx", PrimFunc)`` entry of every ``paged_attention_kv_cache_create`` call.

    Raises
    ------
    TypeError
        When ``mod`` is not an IRModule.
    """
    require_module(mod, "paged_kv_cache_report")
    _check_page_size(page_size, "paged_kv_cache_report")
    provider = _paged_provider(provider, "paged_kv_cache_report(provider=)")
    return [d for fname, call in _create_calls(mod) for _, _, d in _decide(mod, fname, call, page_size, provider, arch)]


def _check_page_size(page_size, where: str):
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0):
        raise ValueError(f"{where}: page_size must be a positive int (tokens per page), got {page_size!r}")


def _paged_provider(provider, where: str) -> str:
    name = check_provider(provider, where, allow_auto=True)
    if name == "python":
        raise ValueError(f"{where}: the python provider has no PagedKVCache attention; use 'native' or 'hopper'")
    return name


def format_paged_report(decisions) -> str:
    """One line per decision, for people."""
    lines = []
    for d in decisions:
        if d.offloaded:
            lines.append(f"{d.function}: {d.kernel} -> {d.symbol}" + (f" ({d.note})" if d.note else ""))
        else:
            lines.append(f"{d.function}: {d.kernel} stays on TVM's TIR kernel: {d.reason}")
    return "\n".join(lines)


def _page_kernels(cfg: PagedConfig, target):
    """TVM's append and compaction PrimFuncs regenerated for ``cfg.page_size`` (TVM's own generators)."""
    from tvm.relax.frontend.nn.llm.kv_cache import _compact_kv_copy, _kv_cache_transpose_append

    append = _kv_cache_transpose_append(cfg.num_kv_heads, cfg.head_dim, cfg.dtype, page_size=cfg.page_size)
    compact = _compact_kv_copy(cfg.num_kv_heads, cfg.head_dim, cfg.dtype, target, page_size=cfg.page_size)
    return append, compact


@mutator
class _Rewriter(PyExprMutator):
    """Swaps the served entries of each create call for ExternFuncs and its page-size kernels for
    ``page_gvs[cfg]``; records what it served in ``served``."""

    def __init__(self, mod, fname, page_size, page_gvs, provider="native", arch="sm_90"):
        super().__init__(mod)
        self.mod_, self.fname, self.page_size, self.page_gvs = mod, fname, page_size, page_gvs
        self.provider, self.arch = provider, arch
        self.served: dict[PagedConfig, set[str]] = {}

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not _is_create_call(call):
            return call
        args = list(call.args)
        cfg, _ = _cache_reason(args[1:], self.page_size)
        for i, j, d in _decide(self.mod_, self.fname, call, self.page_size, self.provider, self.arch):
            if d.offloaded and d.note != "already rewritten":
                self.served.setdefault(cfg, set()).add(KINDS[d.kernel])
                fields = list(args[i + 1].fields)
                fields[j] = relax.ExternFunc(d.symbol)
                args[i + 1] = relax.Tuple(fields)
        if cfg in self.served:
            args[_ARG_APPEND + 1], args[_ARG_COMPACT + 1] = self.page_gvs[cfg]
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

    Parameters
    ----------
    page_size : int, optional
        Page size of the caches (a multiple of :func:`page_unit` of the head dim); default: the
        create call's constant, else the unit. Create the cache with this page size at run time.
    target : Target, optional
        For the regenerated compaction kernel; default the current target, else cuda sm_90.
    provider : str
        ``"native"``: FA2 and our decode kernel. ``"hopper"``: the same, with the ragged prefill on
        FA4's sm90 var-len forward (flash-attn-4 objects compiled ahead of time, linked by
        :func:`mqa_byoc.export_library`); FA2 where FA4 has no object (the report says why).
        ``"auto"`` (default): ``"hopper"`` where its FA4 objects can be had for the target (sm_90,
        flash-attn-4 installed or the objects prebuilt), else ``"native"``: the rule of
        :mod:`mqa_byoc.compiler.provider`.

    See the module docstring for what is served and what stays on TIR;
    :func:`paged_kv_cache_report` says it per entry. Export the built module with
    :func:`mqa_byoc.export_library`.
    """

    def __init__(self, page_size: int | None = None, target=None, provider: str = "auto"):
        _check_page_size(page_size, "UseFlashAttentionForPagedKVCache")
        self.page_size = page_size
        self.target = target
        self.provider = _paged_provider(provider, "UseFlashAttentionForPagedKVCache(provider=)")

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        require_module(mod, "UseFlashAttentionForPagedKVCache")
        mod = mod.clone()  # the edits below are in place; the caller's module stays as it was
        target = (self.target or tvm.target.Target.current(allow_none=True)
                  or tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
        target = cuda_target(target, "UseFlashAttentionForPagedKVCache")
        arch = target_arch(target)
        page_gvs: dict[PagedConfig, tuple] = {}
        replaced = set()
        for fname, call in list(_create_calls(mod)):
            for i, j, d in _decide(mod, fname, call, self.page_size, self.provider, arch):
                if d.offloaded and d.note != "already rewritten":
                    cfg, _ = _cache_reason(list(call.args[1:]), self.page_size)
                    replaced.update([call.args[i + 1].fields[j], call.args[_ARG_APPEND + 1], call.args[_ARG_COMPACT + 1]])
                    if cfg not in page_gvs:
                        bb = relax.BlockBuilder(mod)  # add_func gives the GlobalVars their types
                        page_gvs[cfg] = tuple(
                            bb.add_func(func.with_attr("global_symbol", f"{name}_{cfg.tag}"), f"{name}_{cfg.tag}")
                            for name, func in zip(("kv_cache_transpose_append", "kv_cache_compact_kv_copy"),
                                                  _page_kernels(cfg, target)))
                        mod = bb.get()
        served: dict[PagedConfig, set[str]] = {}
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rw = _Rewriter(mod, gv.name_hint, self.page_size, page_gvs, self.provider, arch)
                new = rw.visit_expr(func)
                if rw.served:
                    mod[gv] = new
                for cfg, kinds in rw.served.items():
                    served.setdefault(cfg, set()).update(kinds)
        if not served:
            return mod
        for gv in replaced - _used_global_vars(mod):
            del mod[gv]
        ext = list((mod.attrs or {}).get("external_mods", []))
        create = tvm.get_global_func("runtime.CSourceModuleCreate")
        for cfg, kinds in sorted(served.items(), key=lambda kv: kv[0].tag):
            fa4 = "ragged" in kinds and fa4_ragged_reason(cfg, self.provider, arch) is None
            ext.append(create(emit_paged_source(cfg, kinds, fa4_ragged=fa4), "cc", [cfg.symbol(k) for k in sorted(kinds)],
                              []))
        return mod.with_attr("external_mods", ext)
