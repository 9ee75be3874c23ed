"""Step 1 of the partition: rewrite every offloadable attention to ``R.nn.attention``.

View chains around matmuls are collapsed first and heads folded into a matmul's rows unfolded (:mod:`.views`:
torch.einsum's plumbing); ``exp(log_softmax(x))`` is read as ``softmax(x)`` (:mod:`.log_softmax`).

Every site that FA2 computes exactly (see :mod:`.analysis`) becomes ``R.nn.attention`` on the
pre-expansion K/V (with ``mqa=True``), with BNSH operands entering through ``permute_dims`` so the
codegen can pass them as strides; rejected sites are left alone. The result is what the pattern
table of :mod:`.patterns` matches.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from mqa_byoc.compiler.graph import analysis, masks, sink_attention, varlen
from mqa_byoc.compiler.graph.exprs import (binding_values, function_bindings, function_results, is_offloaded,
                                           op_name)
from mqa_byoc.compiler.graph.site import chunk_calls, output_steps, seq_len
from mqa_byoc.compiler.graph.trace import Bindings, as_int, constant_dim
from mqa_byoc.compiler.graph.log_softmax import ExpOfLogSoftmax
from mqa_byoc.compiler.graph.views import CollapseViewChains, UnfoldMatmulRows


def analyze_module(mod: tvm.IRModule, mqa: bool) -> dict:
    """Every attention site of every Relax function not yet offloaded, with the verdict on it.

    Returns
    -------
    dict
        ``{GlobalVar: [AttentionSite]}``; with ``mqa`` K/V are traced through their
        expansions (a site FA2 cannot take with native K/V heads falls back to the expanded K/V,
        with a ``note``), else the expansion is where the trace stops.
    """
    evaluator = masks.MaskEvaluator(mod)
    result = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or is_offloaded(func):
            continue
        bindings = Bindings(func)
        sites = analysis.find_sites(gv.name_hint, func, evaluator, mqa, bindings)
        if mqa and any(s.reason for s in sites):
            retry = {}
            for s in analysis.find_sites(gv.name_hint, func, evaluator, False, bindings):
                retry[s.root] = s
                if s.chain_root is not None:  # a sink after attention: found at its P @ V the first time
                    retry[s.chain_root] = s
            for i, s in enumerate(sites):
                alt = retry.get(s.root)
                if s.reason and alt is not None and alt.reason is None:
                    # the expansion is not one FA2 reproduces, but plain MHA on the expanded K/V is exact
                    alt.note = f"K/V expansion kept: {s.reason}"
                    sites[i] = alt
        if sites:
            result[gv] = sites
    return result


@mutator
class _Canonicalize(PyExprMutator):
    def __init__(self, mod, sites, mqa):
        super().__init__(mod)
        self.mod_ = mod
        self.sites = {s.root: s for s in sites if s.reason is None}
        self.mqa = mqa
        self.attention_vars = set()  # the attention results we emitted, BSNH (sliced to V's head dim)

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
        if site.sinks is not None or site.softcap is not None:
            return sink_attention.emit_canonical(self, binding.var, site, self.mqa)
        self._emit_site(binding.var, site)

    def _operand(self, traced, dtype, heads_target=None, pad_to=None):
        x = self.visit_expr(traced.source)
        if traced.is_view():  # K/V without the unit axis the expansion grew, grouped heads as one axis
            x = self.builder_.emit(relax.op.reshape(x, traced.shape()))
        if str(traced.source.ty.dtype) != dtype:
            # the graph cast the expanded tensor; casting the un-expanded one gives the same values
            x = self.builder_.emit(relax.op.astype(x, dtype))
        if pad_to is not None:
            x = self.pad_head_dim(x, pad_to)
        if traced.layout() == "BNSH":
            x = self.builder_.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
        elif traced.layout() == "SBNH":  # sequence first: a transpose the kernels cannot read through strides
            x = self.builder_.emit(relax.op.permute_dims(x, [1, 0, 2, 3]))
        elif traced.layout() == "BSH":  # one head: a (B, S, 1, D) view
            b, s, d = traced.shape()
            x = self.builder_.emit(relax.op.reshape(x, [b, s, 1, d]))
        x = self._constant_dims(x)
        if heads_target is not None:
            # the mqa=False baseline keeps an expansion: K/V repeated to the query heads
            x = self.builder_.emit(relax.op.repeat(x, heads_target, axis=2))
        return x

    def _constant_dims(self, x):
        """``x`` match-cast to constant sizes where a size is an expression the function's lower bounds make
        constant (HF's sliding-window cache: ``min(2^63 - 1, past) - min(max(past - 7, 0), past) + 1`` is 8
        for a past of at least 7). K and V each carry their own copy of such an expression, and TVM's
        attention lowering compares K's length with V's by identity ("shapes of x and y are inconsistent");
        the VM checks the cast at run time."""
        dims = list(x.ty.shape.values)
        new = [c if (c := constant_dim(d)) is not None else d for d in dims]
        if all(a.same_as(b) for a, b in zip(dims, new)):
            return x
        return self.builder_.match_cast(x, relax.TensorType(new, x.ty.dtype))

    def pad_head_dim(self, x, head_dim):
        """``x`` padded with zeros on its last (head dim) axis to ``head_dim``; ``x`` when it has that already.
        A zero column of V adds a zero column to the output and changes nothing else."""
        dims = x.ty.shape.values
        width = head_dim - int(dims[-1])
        if width == 0:
            return x
        return self.builder_.emit(relax.op.nn.pad(x, [0, 0] * (len(dims) - 1) + [0, width]))

    def slice_value_dims(self, attention, site):
        """The output of ``attention`` (an unbound call) with V's head dim: sliced back on the last axis
        when the site's V was padded (:meth:`pad_head_dim`), else ``attention`` itself."""
        if not site.pads_value:
            return attention
        x = self.builder_.emit(attention)
        rank = len(x.ty.shape.values)
        return relax.op.strided_slice(x, axes=[rank - 1], begin=[0], end=[site.head_dim_v])

    def _emit_site(self, var, site):
        rep = None
        if not self.mqa and site.num_kv_heads != site.num_q_heads:
            rep = site.num_q_heads // site.num_kv_heads
        q = self._operand(site.q, site.dtype)
        k = self._operand(site.k, site.dtype, rep)
        v = self._operand(site.v, site.dtype, rep, pad_to=site.head_dim)
        causal = None
        if site.form == "R.nn.attention" and site.causal_attr is not None:
            causal = str(site.causal_attr)
        elif site.mask.causal:
            causal = "BottomRight"
        if site.mask.chunk is not None:
            att = self._chunked_attention(q, k, v, site)
        else:
            att = relax.op.nn.attention(q, k, v, scale=site.scale, causal_mask=causal, window_size=site.mask.window)
        labels = site.out_labels
        root_ty = var.ty
        steps = []
        heads_first, reshape = output_steps(labels)
        if heads_first:
            steps.append(lambda x: relax.op.permute_dims(x, [0, 2, 1, 3]))
        if reshape:  # (B*H, S, D), (B, S, D) of one head, or grouped (B, Hkv, G, S, D)
            steps.append(lambda x: relax.op.reshape(x, root_ty.shape))
        if str(root_ty.dtype) != site.dtype:
            steps.append(lambda x: relax.op.astype(x, root_ty.dtype))
        expr = out = self.slice_value_dims(att, site)  # (B, S, H, D_v), D_v < D when V was padded
        for step in steps:
            x = self.builder_.emit(expr)
            if expr is out:
                self.attention_vars.add(x)
            expr = step(x)
        self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(expr)))
        if expr is out:
            self.attention_vars.add(var)


    def _chunked_attention(self, q, k, v, site):
        """A chunked mask's attention on BSNH operands as causal attentions on blocks of ``site.mask.chunk``
        positions (the analysis proved the lengths static; :func:`chunk_calls`): the whole blocks in one call,
        their rows and keys reshaped from (B, n c, H, D) to a batch of blocks (B n, c, H, D), a partial block
        at either end in one call of its own; bottom-right aligned as FA2's causal mask is; the calls' outputs
        concatenated on the sequence axis (an unbound expression)."""
        s_q, s_kv = as_int(seq_len(site.q)), as_int(seq_len(site.k))
        parts = []

        def rows(x, begin, end, length, blocks):
            if (begin, end) != (0, length):
                x = self.builder_.emit(relax.op.strided_slice(x, axes=[1], begin=[begin], end=[end]))
            if blocks == 1:
                return x
            b, _s, heads, dim = x.ty.shape.values
            return self.builder_.emit(relax.op.reshape(x, [b * blocks, (end - begin) // blocks, heads, dim]))

        for q0, q1, k0, k1, blocks in chunk_calls(site):
            att = relax.op.nn.attention(rows(q, q0, q1, s_q, blocks), rows(k, k0, k1, s_kv, blocks),
                                        rows(v, k0, k1, s_kv, blocks), scale=site.scale, causal_mask="BottomRight")
            if blocks > 1:
                att = self.builder_.emit(att)
                b = q.ty.shape.values[0]
                _bn, _c, heads, dim_v = att.ty.shape.values
                att = relax.op.reshape(att, [b, q1 - q0, heads, dim_v])
            parts.append(att)
        if len(parts) == 1:  # unbound, as the caller's other attentions: its output permutes then fold
            return parts[0]
        return relax.op.concat([self.builder_.emit(p) for p in parts], axis=1)


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
            self.value = binding_values(func)
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


@tvm.transform.module_pass(opt_level=0, name="CanonicalizeAttention")
class CanonicalizeAttention:
    """Module pass: rewrite each offloadable attention site to ``R.nn.attention`` (module doc).

    Parameters
    ----------
    mqa : bool
        True: K/V expansions are removed, so the attention gets the native K/V heads. False (the
        A/B baseline): K/V stay expanded to the query heads.

    Sites FA2 would compute differently are left unchanged; ``offload_report`` says why.
    """

    def __init__(self, mqa: bool = True):
        self.mqa = mqa

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # the forms the analysis reads (what offload_report analyses too)
        mod = UnfoldMatmulRows()(CollapseViewChains()(ExpOfLogSoftmax()(mod)))
        return _canonicalize(mod, self.mqa, analyze_module(mod, self.mqa))


def canonicalize_attention(mod: tvm.IRModule, mqa: bool = True) -> tvm.IRModule:
    """Function form of :class:`CanonicalizeAttention`.

    Returns
    -------
    IRModule
        ``mod`` with its offloadable sites rewritten (``mod`` itself when there are none).
    """
    return CanonicalizeAttention(mqa=mqa)(mod)


def _canonicalize(mod, mqa, by_func):
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
        mod = _PrivateOperandPermutes(mod).transform(functions)
    for gv in functions:
        mod[gv] = relax.analysis.remove_all_unused(mod[gv])
    return mod


@mutator
class _PrivateOperandPermutes(PyExprMutator):
    """Give each ``R.nn.attention`` its own copy of an operand permute that other bindings share.

    The clean-up passes after a 3-D chain rewrite merge equal bindings, so two chains reading the
    same BNSH K/V end up sharing one ``permute_dims(k)``; a composite cannot take a value that is
    also used outside it, so the pattern would refuse both sites."""

    def __init__(self, mod):
        super().__init__(mod)
        self.mod_ = mod
        self.values, self.uses = {}, {}

    def transform(self, functions):
        for gv in functions:
            func = self.mod_[gv]
            self.values = binding_values(func)
            self.uses = _use_counts(func)
            self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_var_binding_(self, binding):
        call = binding.value
        if op_name(call) != "relax.nn.attention":
            return super().visit_var_binding_(binding)
        args = [self.visit_expr(a) for a in call.args]
        for i, arg in enumerate(call.args[:3]):
            permute = self.values.get(arg)
            if op_name(permute) == "relax.permute_dims" and self.uses.get(arg, 0) > 1:
                args[i] = self.builder_.emit(relax.op.permute_dims(self.visit_expr(permute.args[0]),
                                                                   permute.attrs.axes))
        new = relax.Call(call.op, args, call.attrs, call.ty_args)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(new)))


def _use_counts(func):
    """How many bindings (and the function result) read each var."""
    counts = {}
    values = [b.value for b in function_bindings(func) if not isinstance(b.value, relax.If)] + function_results(func)
    for value in values:
        for var in relax.analysis.free_vars(value):
            counts[var] = counts.get(var, 0) + 1
    return counts
