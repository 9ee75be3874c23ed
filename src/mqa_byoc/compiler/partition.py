"""``partition_for_cutlass(mod, mqa=True)``: offload attention to FA2 with native K/V heads.

Three steps, each a plain Relax pass:
1. canonicalize: every attention site that FA2 computes exactly (see :mod:`.analysis`) is rewritten
   to ``R.nn.attention`` on the pre-expansion K/V (with ``mqa=True``), with BNSH operands entering
   through ``permute_dims`` so the codegen can pass them as strides; rejected sites are left alone;
2. ``FuseOpsByPattern`` with the pattern table of :mod:`.patterns` groups each into a composite
   (``flash_attn.attention_mqa`` or ``flash_attn.attention``) and annotates ``Codegen="flash_attn"``;
3. ``LegalizeGroupedAttention`` makes any attention left with fewer K/V heads correct for TVM's own
   lowering.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import analysis, masks, varlen
from .patterns import flash_attn_patterns
from .trace import op_name

PROVIDERS = ("native", "python")


@dataclass
class OffloadSite:
    """One attention found in the module, as reported to the user."""

    function: str
    output: str  # name of the variable the attention result is bound to
    form: str
    offloaded: bool
    num_q_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    dtype: str | None
    causal: str | None  # "BottomRight" / "TopLeft" / None
    window: int | None
    scale: float | None
    expansion: str | None  # how K/V were expanded in the graph: repeat / broadcast / tile / None
    expansion_ops_removed: int
    composite: str | None
    reason: str | None  # why not offloaded; None when offloaded
    note: str | None = None  # e.g. why an expansion was kept although the site is offloaded

    def as_dict(self):
        return asdict(self)


def _analyze(mod: tvm.IRModule, mqa: bool):
    """Sites per function; with ``mqa`` K/V are traced through expansions, else not."""
    evaluator = masks.MaskEvaluator(mod)
    result = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or _is_offloaded(func):
            continue
        bindings = analysis.Bindings(func)
        sites = analysis.find_sites(gv.name_hint, func, evaluator, mqa, bindings)
        if mqa and any(s.reason for s in sites):
            retry = {s.root: s for s in analysis.find_sites(gv.name_hint, func, evaluator, False, bindings)}
            for i, s in enumerate(sites):
                alt = retry.get(s.root)
                if s.reason and alt is not None and alt.reason is None:
                    # the expansion is not one FA2 reproduces, but plain MHA on the expanded K/V is exact
                    alt.note = f"K/V expansion kept: {s.reason}"
                    sites[i] = alt
        if sites:
            result[gv] = sites
    return result


def _is_offloaded(func):
    attrs = func.attrs
    return attrs is not None and ("Codegen" in attrs or "Composite" in attrs)


def _causal_name(site):
    if site.form in analysis.FUSED_FORMS and site.causal_attr is not None:
        return str(site.causal_attr)
    return "BottomRight" if site.mask.causal else None


def offload_report(mod: tvm.IRModule, mqa: bool = True) -> list[OffloadSite]:
    """What :func:`partition_for_cutlass` would do with every attention in ``mod``.

    The result is computed by the same analysis the partition uses; ``offloaded`` sites become
    ``composite`` functions, the others keep their original graph and say why in ``reason``.
    """
    analysis.require_module(mod, "offload_report")
    report = []
    for sites in _analyze(mod, mqa).values():
        for s in sites:
            ok = s.reason is None
            removes = mqa and ok and s.k is not None and s.k.expansion is not None
            composite = None
            if ok:
                mqa_shaped = mqa and s.num_kv_heads != s.num_q_heads
                composite = "flash_attn.attention_mqa" if mqa_shaped else "flash_attn.attention"
                composite = varlen.COMPOSITE if s.form == varlen.FORM else composite
            report.append(OffloadSite(
                function=s.function, output=s.root.name, form=s.form, offloaded=ok,
                num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                dtype=s.dtype, causal=_causal_name(s), window=s.mask.window,
                scale=_resolved_scale(s), expansion=s.k.expansion if s.k is not None else None,
                expansion_ops_removed=len(set(s.expansion_ops)) if removes else 0,
                composite=composite, reason=s.reason, note=getattr(s, "note", None),
            ))
    return varlen.explain_unlowerable(report)


def _resolved_scale(site):
    if site.scale is None and site.head_dim:
        return 1.0 / math.sqrt(site.head_dim)
    return site.scale


# ----------------------------------------------------------------------------- step 1: canonicalize
@mutator
class _Canonicalize(PyExprMutator):
    def __init__(self, mod, sites, mqa):
        super().__init__(mod)
        self.mod_ = mod
        self.sites = {s.root: s for s in sites if s.reason is None}
        self.mqa = mqa
        self.attention_vars = set()  # the R.nn.attention results we emitted

    def transform(self, functions):
        for gv in functions:
            self.builder_.update_func(gv, self.visit_expr(self.mod_[gv]))
        return self.builder_.get()

    def visit_var_binding_(self, binding):
        site = self.sites.get(binding.var)
        if site is None:
            return super().visit_var_binding_(binding)
        if site.form == varlen.FORM:
            return varlen.emit_canonical(self, binding.var, site, self.mqa)
        self._emit_site(binding.var, site)

    def _operand(self, traced, dtype, heads_target=None):
        x = self.visit_expr(traced.source)
        if str(traced.source.ty.dtype) != dtype:
            # the graph cast the expanded tensor; casting the un-expanded one gives the same values
            x = self.builder_.emit(relax.op.astype(x, dtype))
        if traced.layout() == "BNSH":
            x = self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
        elif traced.layout() == "BSH":  # one head: a (B, S, 1, D) view
            b, s, d = traced.source.ty.shape.values
            x = self.builder_.emit(relax.op.reshape(x, [b, s, 1, d]))
        if heads_target is not None:
            # the mqa=False baseline keeps an expansion: K/V repeated to the query heads
            x = self.builder_.emit(relax.op.repeat(x, heads_target, axis=2))
        return x

    def _emit_site(self, var, site):
        rep = None
        if not self.mqa and site.num_kv_heads != site.num_q_heads:
            rep = site.num_q_heads // site.num_kv_heads
        q = self._operand(site.q, site.dtype)
        k = self._operand(site.k, site.dtype, rep)
        v = self._operand(site.v, site.dtype, rep)
        causal = None
        if site.form == "R.nn.attention" and site.causal_attr is not None:
            causal = str(site.causal_attr)
        elif site.mask.causal:
            causal = "BottomRight"
        att = relax.op.nn.attention(q, k, v, scale=site.scale, causal_mask=causal, window_size=site.mask.window)
        labels = site.out_labels
        root_ty = var.ty
        steps = []
        if labels[:2] in (["B", "H"], ["BH", "S"]):
            steps.append(lambda x: relax.op.permute_dims(x, [0, 2, 1, 3]))
        if len(labels) == 3:  # (B*H, S, D), or (B, S, D) of one head
            steps.append(lambda x: relax.op.reshape(x, root_ty.shape))
        if str(root_ty.dtype) != site.dtype:
            steps.append(lambda x: relax.op.astype(x, root_ty.dtype))
        expr = att
        for step in steps:
            x = self.builder_.emit(expr)
            if expr is att:
                self.attention_vars.add(x)
            expr = step(x)
        self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(expr)))
        if expr is att:
            self.attention_vars.add(var)


@mutator
class _FoldOutputLayout(PyExprMutator):
    """Cancel the caller's permute back to BSNH against our BNSH view of an attention output.

    After RemoveRedundantReshape the 3-D reshapes around batched matmuls are gone, leaving
    ``permute_dims(permute_dims(att, p1), p2)`` on the attention results we emitted."""

    def __init__(self, mod, attention_vars):
        super().__init__(mod)
        self.mod_ = mod
        self.attention_vars = attention_vars
        self.value = {}

    def transform(self, functions):
        for gv in functions:
            func = self.mod_[gv]
            self.value = analysis.Bindings(func).value
            self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_var_binding_(self, binding):
        v = binding.value
        inner = self.value.get(v.args[0]) if op_name(v) == "relax.permute_dims" else None
        if op_name(inner) == "relax.permute_dims" and inner.args[0] in self.attention_vars:
            a = [int(x) for x in inner.attrs.axes]
            b = [int(x) for x in v.attrs.axes]
            axes = [a[i] for i in b]
            src = self.visit_expr(inner.args[0])
            new = src if axes == list(range(len(axes))) else relax.op.permute_dims(src, axes)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(new)))
            return
        super().visit_var_binding_(binding)


def canonicalize_attention(mod: tvm.IRModule, mqa: bool = True, sites=None) -> tvm.IRModule:
    """Step 1 alone: rewrite offloadable attention sites to ``R.nn.attention`` (see module doc)."""
    by_func = _analyze(mod, mqa) if sites is None else sites
    functions = [gv for gv, ss in by_func.items() if any(s.reason is None for s in ss)]
    if not functions:
        return mod
    canon = _Canonicalize(mod, [s for gv in functions for s in by_func[gv]], mqa)
    mod = canon.transform(functions)
    if any(s.out_labels != ["B", "S", "H", "D"] for gv in functions for s in by_func[gv]):
        # chains produced BNSH or 3-D outputs: fold our layout changes into the caller's
        mod = relax.transform.RemoveRedundantReshape()(mod)
        mod = relax.transform.CanonicalizeBindings()(mod)
        mod = _FoldOutputLayout(mod, set(canon.attention_vars)).transform(functions)
        mod = relax.transform.CanonicalizeBindings()(mod)
    return _remove_unused(mod, functions)


def _remove_unused(mod, functions):
    for gv in functions:
        mod[gv] = relax.analysis.remove_all_unused(mod[gv])
    return mod


# ----------------------------------------------------------------------------- the public entry
def partition_for_cutlass(
    mod: tvm.IRModule,
    mqa: bool = True,
    annotate_codegen: bool = True,
    provider: str | None = None,
    bind_constants: bool = False,
) -> tvm.IRModule:
    """Partition ``mod`` so that attention runs in Flash Attention v2.

    Parameters
    ----------
    mod : IRModule
        Any Relax module; attention may be ``R.nn.attention`` or an explicit matmul/softmax chain,
        with K/V expanded by repeat / broadcast_to / expand_dims+broadcast_to+reshape, or not.
    mqa : bool
        True: K/V expansions are removed and FA2 gets the K/V heads natively
        (``flash_attn.attention_mqa``). False (the A/B baseline): expansions stay in the graph and
        attention is offloaded on the expanded K/V as plain MHA (``flash_attn.attention``).
    annotate_codegen : bool
        Wrap each composite in a function with ``Codegen="flash_attn"`` for ``RunCodegen``.
    provider : "native" | "python" | None
        Kernel provider recorded on each offloaded function (see ``mqa_byoc.compiler.codegen``);
        None leaves the choice to the codegen's default rule.

    Sites FA2 would compute differently are left unchanged; :func:`offload_report` says why.
    Attention left with fewer K/V heads than query heads is made correct for TVM's own lowering.
    """
    from . import codegen  # noqa: F401 - registers relax.ext.flash_attn
    from .gqa_legalize import LegalizeGroupedAttention

    analysis.require_module(mod, "partition_for_cutlass")
    if provider is not None and provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {PROVIDERS} or None, got {provider!r}")
    sites = _analyze(mod, mqa)
    mod = canonicalize_attention(mod, mqa, sites)
    accepted = [s for ss in sites.values() for s in ss if s.reason is None]
    if accepted:
        # Only the patterns this module can match: matching cost grows with the table.
        want_mqa = {mqa and s.num_kv_heads != s.num_q_heads for s in accepted}
        out_permute = any(s.out_labels != ["B", "S", "H", "D"] for s in accepted)
        facts = {}
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                facts.update(analysis.Bindings(func).length_facts)
        token = analysis.LENGTH_FACTS.set(facts)
        try:
            mod = relax.transform.FuseOpsByPattern(
                flash_attn_patterns(mqa=want_mqa, output_permute=out_permute),
                bind_constants=bind_constants, annotate_codegen=annotate_codegen,
            )(mod)
        finally:
            analysis.LENGTH_FACTS.reset(token)
    if provider is not None and annotate_codegen:
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function) and func.attrs is not None and \
                    func.attrs.get("Codegen") == "flash_attn":
                mod[gv] = func.with_attr("mqa_byoc.provider", provider)
    return LegalizeGroupedAttention()(mod)
