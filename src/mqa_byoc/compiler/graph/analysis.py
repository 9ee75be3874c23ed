"""Find every attention in a Relax function and decide whether FA2 computes it exactly.

Two kinds of roots are recognized:
- ``R.nn.attention`` / ``R.nn.attention_bias`` calls (BSNH operands);
- explicit chains ``matmul(softmax(mask/scale(matmul(Q, K^T))), V)`` in 4-D (B, N, S, D) or in
  3-D batched-matmul form (B*N, S, D), as emitted by TVM's own rewrite, mlc-llm and TVM's PyTorch
  frontend; a 3-D chain whose operands were never (B, N, ...) is single-head attention on (B, S, D).
Operands are traced back with :mod:`.trace` to their pre-expansion sources; everything FA2 would
compute differently becomes a readable ``reason``.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.ir.expr import Constant

from mqa_byoc.compiler.graph import masks
from mqa_byoc.compiler.graph import sinks as sink_forms
from mqa_byoc.compiler.graph.site import AttentionSite, common_checks, seq_len, trace_fused_operands
from mqa_byoc.compiler.graph.trace import (REPEAT, SINGLE_HEAD, TILE, Bindings, Traced, as_int, dims_equal, op_name,
                                          product, prove_equal, shape_of, trace)
from mqa_byoc.compiler.graph.varlen import var_len_site

_ELEMENTWISE_BETWEEN = (
    "relax.astype", "relax.multiply", "relax.divide", "relax.add", "relax.maximum", "relax.minimum",
    "relax.where", "relax.reshape", "relax.broadcast_to", "relax.tanh",
)


def find_sites(func_name: str, func: relax.Function, evaluator: masks.MaskEvaluator,
               allow_kv_expansion: bool = True, bindings: Bindings | None = None) -> list[AttentionSite]:
    """Every attention root in ``func``; with ``allow_kv_expansion`` K/V are traced through
    expansions to their pre-expansion sources, else an expansion is where the trace stops."""
    bindings = bindings or Bindings(func)
    sites = []
    for var, value in bindings.value.items():
        name = op_name(value)
        if name in ("relax.nn.attention", "relax.nn.attention_bias"):
            build = _attention_call_site
        elif name == "relax.nn.attention_var_len":
            sites.append(var_len_site(func_name, var, value, bindings, allow_kv_expansion))
            continue
        elif name == "relax.matmul":
            build = _chain_site
        else:
            continue
        site = build(func_name, var, value, bindings, evaluator, allow_kv_expansion)
        if site is not None and site.reason and site.expansion_problem and allow_kv_expansion:
            # The expansion is not FA2's, and the site is rejected: the reason that counts is why it
            # cannot be offloaded on the expanded K/V either; K/V heads as the graph's attention sees them.
            # Unless the expanded K/V are no operand at all (their trace stops inside the expansion, e.g.
            # in a grouped view's 3-D batched matmul): then the expansion is the reason
            plain = build(func_name, var, value, bindings, evaluator, False)
            if plain.reason and plain.expansion_problem == site.expansion_problem:
                pass  # the consumer expands K/V itself (a matmul's broadcasting): nothing to keep
            elif plain.reason and _stops_in_expansion(plain):
                site.note = f"with the K/V expansion kept: {plain.reason}"
            elif plain.reason:
                plain.note = f"K/V expansion kept: {site.expansion_problem}"
                site = plain
        elif site is not None and site.reason and not allow_kv_expansion and _stops_in_expansion(site):
            # the graph's expanded K/V are no operand the kernels take (a grouped view's 3-D batched
            # matmul): the un-expanded K/V, repeated by the rewrite, are the same heads
            full = build(func_name, var, value, bindings, evaluator, True)
            if full.reason is None:
                full.note = ("K/V repeated by the rewrite (the graph's expansion ends in a layout the kernels do "
                             "not take)")
                site = full
            elif full.expansion_problem:  # not FA2's grouping either: that is the reason
                full.note = f"with the K/V expansion kept: {site.reason}"
                site = full
        if site is not None:
            sites.append(site)
    known = {s.root for s in sites}
    _sinks_after_attention(sites, bindings)
    # nothing unseen: a matmul-softmax-matmul chain none of the forms above explains is reported too
    for root, reason in sink_forms.unexplained_chains(bindings, known):
        sites.append(AttentionSite(func_name, root, "matmul-softmax chain").reject(reason))
    return sites


def _sinks_after_attention(sites, bindings):
    """A sink applied to the output of an offloaded chain, ``O * sigmoid(lse(T) - sink)`` with T the scores
    the chain's softmax reads (:class:`.sinks.SinkScaling`), makes the site a sink site rooted at the
    multiply: the rewrite replaces the scaling too, and the scores and their log-sum-exp are no longer
    computed. Anything else about it leaves the site as it is (the scaling then stays in the graph)."""
    by_root = {s.root: s for s in sites}
    for scaling in sink_forms.sink_scalings(bindings):
        site = by_root.get(scaling.output)
        if (site is None or site.reason or site.form != "matmul-softmax chain" or site.sinks is not None
                or site.softcap is not None or site.mask.chunk or scaling.sinks.num_heads != site.num_q_heads
                or any(t.layout() not in ("BNSH", "BSNH") for t in (site.q, site.k, site.v))):
            continue
        softmax = bindings.get(_strip_probs(bindings.get(site.root).args[0], bindings)[0])
        scores = softmax.args[0]
        if not any(sink_forms.same_value(scaling.scores, x, bindings)
                   for x in (scores, sink_forms.strip_row_shift(scores, bindings))):
            continue
        dtype = getattr(scaling.sinks.source.ty, "dtype", None)
        if str(dtype) not in ("float32", "float16", "bfloat16"):
            continue
        site.chain_root, site.root = site.root, scaling.root
        site.sinks, site.out_labels = scaling.sinks, ["B", "H", "S", "D"]


def _stops_in_expansion(site) -> bool:
    """Whether K or V of ``site`` (traced without passing expansions) stop inside one, where they have
    no layout the kernels take."""
    return any(t is not None and t.kept_expansion and t.layout() is None for t in (site.k, site.v))


# ----------------------------------------------------------------------------- R.nn.attention roots
def _attention_call_site(func_name, var, call, bindings, evaluator, allow_kv_expansion=True):
    site = AttentionSite(func_name, var, "R.nn.attention", out_labels=["B", "S", "H", "D"])
    if not trace_fused_operands(site, call, bindings, allow_kv_expansion):
        return site
    attrs = call.attrs
    if len(call.args) > 3 and call.args[3] is not None:
        if attrs.causal_mask is not None or attrs.window_size is not None:
            return site.reject("a bias together with a causal mask or window")
        site.mask_ops = [("add", call.args[3])]
        _prove_masks(site, bindings, evaluator, post_scale=1.0)
        return site
    return _attention_attr_checks(site, attrs, bindings.length_facts)


def _attention_attr_checks(site, attrs, facts=None):
    s_q, s_kv = seq_len(site.q), seq_len(site.k)
    window = int(attrs.window_size) if attrs.window_size is not None else None
    if attrs.causal_mask == "TopLeft" and not prove_equal(s_q, s_kv):
        return site.reject("TopLeft causal mask with S_q != S_kv (FA2's causal is bottom-right aligned): query row "
                           "i sees keys 0..i, e.g. relax.frontend.nn's scaled_dot_product_attention(is_causal=True) "
                           "in decode, where is_causal=False is what a cache needs")
    # FA2's window is bottom-right aligned like its causal mask: the same rule applies to both
    bottom_right = attrs.causal_mask == "BottomRight" or (window is not None and attrs.causal_mask is None)
    if bottom_right and not (prove_equal(s_q, s_kv) or _analyzer_le(s_q, s_kv, facts)):
        what = "BottomRight causal mask" if attrs.causal_mask else "sliding window (bottom-right aligned)"
        return site.reject(f"{what} where S_q <= S_kv is not provable")
    if window is not None and window < 1:
        return site.reject(f"window_size {window} < 1")
    site.mask = masks.MaskKind(attrs.causal_mask is not None or window is not None, window)
    return site


def check_attention_call(call, operand_values, length_facts=None) -> AttentionSite:
    """The partition's verdict on an ``R.nn.attention`` call whose operands are either plain
    tensors or ``permute_dims(x, [0, 2, 1, 3])`` of BNSH tensors (``operand_values`` maps an
    operand var to its bound value; ``length_facts`` are the match_cast facts of its function,
    see ``Bindings.length_facts``). Used as the pattern check, so that it agrees with the
    analysis on every call the canonicalization did not touch."""
    site = AttentionSite("", None, "R.nn.attention", out_labels=["B", "S", "H", "D"])
    traced = []
    for arg in call.args[:3]:
        value = operand_values.get(arg)
        if op_name(value) == "relax.permute_dims" and [int(a) for a in value.attrs.axes] == [0, 2, 1, 3]:
            traced.append(Traced(value.args[0], ["B", "H", "S", "D"]))
        else:
            traced.append(Traced(arg, ["B", "S", "H", "D"]))
    site.q, site.k, site.v = traced
    site.scale = float(call.attrs.scale.value) if call.attrs.scale is not None else None
    site.causal_attr = call.attrs.causal_mask
    if op_name(call) != "relax.nn.attention":
        return site.reject("attention with a bias")
    common_checks(site)
    if site.reason:
        return site
    if site.pads_value:  # the canonicalization pads V first: a composite has one head dim
        return site.reject(f"V's head dim {site.head_dim_v} differs from Q's and K's {site.head_dim} in the composite")
    return _attention_attr_checks(site, call.attrs, length_facts)


def _analyzer_le(a, b, facts=None):
    """a <= b, knowing that shape variables (sequence lengths, batch) are at least 1 and the
    ``facts`` {var: expression} of the function's match_casts."""
    import tvm
    from tvm.sym import Analyzer

    if facts:
        sub = Analyzer()
        for var, expr in facts.items():
            sub.bind(var, expr)
        a, b = sub.simplify(a), sub.simplify(b)
    ana = Analyzer()
    for var in tirx.analysis.undefined_vars(a - b, []):
        ana.bind(var, tvm.ir.Range.from_min_extent(1, 1 << 40))  # lengths >= 1
    return ana.can_prove(tirx.LE(a, b))


# ----------------------------------------------------------------------------- explicit chains
def _is_batch_view(value) -> bool:
    """astype, a no-op broadcast_to, or a reshape that only merges/splits the leading (batch, head)
    axes: the frontend's 3-D batched-matmul plumbing around attention probabilities and scores."""
    name = op_name(value)
    if name == "relax.astype":
        return True
    if name not in ("relax.reshape", "relax.broadcast_to"):
        return False
    a, b = shape_of(value.args[0]), shape_of(value)
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return False
    if name == "relax.broadcast_to":
        return dims_equal(a, b)
    return prove_equal(a[-1], b[-1]) and prove_equal(a[-2], b[-2]) and prove_equal(
        product(a[:-2]), product(b[:-2]))


def _strip_views(expr, bindings):
    while _is_batch_view(bindings.get(expr)):
        expr = bindings.get(expr).args[0]
    return expr


def _is_zero(expr, bindings) -> bool:
    value = bindings.get(expr)
    if op_name(value) == "relax.full_like":
        return bindings.resolve_scalar(value.args[1]) == 0.0
    return bindings.resolve_scalar(expr) == 0.0


def _strip_probs(expr, bindings):
    """Walk from the P operand of P@V to the softmax; returns (softmax var, dead-row conditions, the
    number of trailing key columns a slice drops: a sink's, see :mod:`.sinks`).

    torch's SDPA decomposition zeroes rows whose scores are all -inf:
    ``where(not(any(scores != -inf)), 0, softmax(scores))``. The kernels do the same (a row without
    a visible key is zero), and a proven causal/window mask never hides a whole row anyway;
    :func:`_is_dead_row_condition` checks that the condition is that one."""
    conds, dropped = [], 0
    while True:
        expr = _strip_views(expr, bindings)
        value = bindings.get(expr)
        if op_name(value) == "relax.where" and _is_zero(value.args[1], bindings):
            conds.append(value.args[0])
            expr = value.args[2]
            continue
        if not dropped:
            inner, dropped = sink_forms.strip_sink_slice(expr, bindings)
            if dropped:
                expr = inner
                continue
        return expr, conds, dropped


_TRUTH_DTYPES = ("bool", "int8", "uint8", "int32", "int64")


def _strip_truth_casts(expr, bindings):
    """Through ``astype`` between bool and integer dtypes (how TVM's frontend spells ``any``/``all``:
    a max/min over int8): the truth of a 0/1 value is kept."""
    while True:
        value = bindings.get(expr)
        if op_name(value) != "relax.astype":
            return expr
        src = getattr(value.args[0].ty, "dtype", None)
        if str(src) not in _TRUTH_DTYPES or str(value.attrs.dtype) not in _TRUTH_DTYPES:
            return expr
        expr = value.args[0]


def _strip_not(expr, bindings):
    """(expr under any logical_not / truth casts, whether an odd number of logical_not was crossed)."""
    negated = False
    while True:
        expr = _strip_truth_casts(expr, bindings)
        value = bindings.get(expr)
        if op_name(value) != "relax.logical_not":
            return expr, negated
        negated, expr = not negated, value.args[0]


def _is_dead_row_condition(cond, scores, bindings) -> bool:
    """True when ``cond`` is, row by row, "every score is -inf": torch's safe softmax
    (``not(any(not(scores == -inf)))``) or ``all(scores == -inf)``, with ``!=`` for ``not ==``.
    ``scores``: the softmax input with its views and casts stripped; the comparison must be made on
    the same tensor (the masked scores, not the raw ones) and reduce over its last (key) axis."""
    expr, outer_not = _strip_not(cond, bindings)
    reduce = bindings.get(expr)
    name = op_name(reduce)
    if name not in ("relax.max", "relax.min") or not bool(reduce.attrs.keepdims):
        return False
    ndim = len(shape_of(reduce.args[0]) or [])
    axes = [int(a) for a in (reduce.attrs.axis or [])]
    if ndim == 0 or [a % ndim for a in axes] != [ndim - 1]:
        return False
    elem, inner_not = _strip_not(reduce.args[0], bindings)
    cmp = bindings.get(elem)
    if op_name(cmp) not in ("relax.equal", "relax.not_equal"):
        return False
    inner_not ^= op_name(cmp) == "relax.not_equal"
    a, b = cmp.args
    if bindings.resolve_scalar(b) is None:
        a, b = b, a
    if bindings.resolve_scalar(b) != float("-inf") or not _strip_views(a, bindings).same_as(scores):
        return False
    # all(x) == not(any(not x)); a max over 0/1 values is any, a min all
    return (name == "relax.min" and not outer_not and not inner_not) or (
        name == "relax.max" and outer_not and inner_not)


def _computed_from_matmul(expr, bindings, limit=64) -> bool:
    """True when a matmul is among ``expr``'s producers (any ops; masks and biases have none)."""
    stack, seen = [expr], set()
    while stack and len(seen) <= limit:
        e = stack.pop()
        value = bindings.get(e) if isinstance(e, relax.Var) else None
        if value is None or e in seen:
            continue
        seen.add(e)
        if op_name(value) == "relax.matmul":
            return True
        stack.extend(x for x in getattr(value, "args", []) if isinstance(x, relax.Var))
    return False


def _scores_operand(a, b, bindings) -> bool:
    """Whether ``a`` (not ``b``) carries the scores into an elementwise op: the operand that reaches
    Q@K^T through the ops the walk understands, else the one computed from a matmul at all (so that
    the walk stops at the op it does not understand, e.g. a soft-capping tanh, not inside the mask);
    ``b`` where that does not tell them apart."""
    if _reaches_matmul(a, bindings):
        return True
    if _reaches_matmul(b, bindings):
        return False
    return _computed_from_matmul(a, bindings) and not _computed_from_matmul(b, bindings)


def _reaches_matmul(expr, bindings, depth=8):
    for _ in range(depth):
        value = bindings.get(expr)
        name = op_name(value)
        if name == "relax.matmul":
            return True
        if name not in _ELEMENTWISE_BETWEEN:
            return False
        # follow the operand that is not a constant
        nxt = [a for a in value.args if isinstance(a, relax.Var) and bindings.resolve_scalar(a) is None]
        if name == "relax.where":
            nxt = [a for a in value.args[1:] if isinstance(a, relax.Var)]
        if not nxt:
            return False
        if len(nxt) > 1:
            return any(_reaches_matmul(n, bindings, depth - 1) for n in nxt)
        expr = nxt[0]
    return False


def _dim_text(dim) -> str:
    """A length as the user wrote it: ``16`` for a static one, the expression for a symbolic one."""
    static = as_int(dim)
    return str(static) if static is not None else str(dim)


def _from_constants(expr, bindings, depth: int = 8) -> bool:
    """Whether ``expr`` is a constant, or computed from constants only (casts, reshapes, products of them)."""
    if isinstance(expr, Constant):
        return True
    value = bindings.get(expr)
    if depth == 0 or not isinstance(value, (relax.Call, Constant)):
        return False
    if isinstance(value, Constant):
        return True
    args = [a for a in value.args if isinstance(a, (relax.Var, Constant))]
    return bool(args) and all(_from_constants(a, bindings, depth - 1) for a in args)


def _scale_problem(name, call, bindings) -> str:
    """Why a multiply / divide of the scores is no scale the kernels take."""
    op = name.split(".")[-1]
    if any(_from_constants(a, bindings) for a in call.args):
        return (f"scores are scaled ({op}) by a constant tensor whose values differ (a per-head or per-position "
                "scale, or a 0/1 mask multiplied in as GPT-1's `w * b + -1e4 * (1 - b)`): the kernels take one "
                "softmax scale, and a mask as a -inf (or large negative) fill of the masked scores")
    weight_names = {w.name for w in bindings.weights}
    weights = next((names for names in (_params_behind(a, bindings) for a in call.args)
                    if names and set(names) <= weight_names), None)
    if weights is not None:  # the model's weights as parameters (the frontends' keep_params_as_input)
        named = ", ".join(f"`{n}`" for n in weights)
        return (f"scores are scaled ({op}) by a value computed at run time from the weight(s) {named}: "
                "the kernels take one softmax scale known when the graph is compiled; bind the weights "
                "(relax.transform.BindParams) so that a scalar scale becomes a constant")
    return f"scores are scaled by a non-constant ({op})"


def _params_behind(expr, bindings, depth: int = 8) -> list[str] | None:
    """The names of the function parameters ``expr`` is computed from (with constants, through any ops),
    or None when it depends on something else (the scores themselves, an op without operands)."""
    if isinstance(expr, Constant):
        return []
    if isinstance(expr, relax.Var) and expr in bindings.params:
        return [expr.name]
    value = bindings.get(expr)
    if isinstance(value, Constant):
        return []
    if depth == 0 or not isinstance(value, relax.Call):
        return None
    args = [a for a in value.args if isinstance(a, (relax.Var, Constant))]
    names = []
    for a in args:
        got = _params_behind(a, bindings, depth - 1)
        if got is None:
            return None
        names += [n for n in got if n not in names]
    return names if args else None


def _chain_site(func_name, var, value, bindings, evaluator, allow_kv_expansion=True):
    probs, dead_row_conds, dropped = _strip_probs(value.args[0], bindings)
    softmax = bindings.get(probs)
    if op_name(softmax) != "relax.nn.softmax":
        return None
    ndim = len(shape_of(softmax) or [])
    if int(softmax.attrs.axis) not in (-1, ndim - 1):
        return None
    x = sink_forms.strip_row_shift(softmax.args[0], bindings)
    sink = None
    if dropped:
        x, sink = sink_forms.split_sink_concat(_strip_views(x, bindings), dropped, bindings)
        if x is None or sink is None:
            why = sink if x is None else "softmax probabilities sliced on the key axis without a concatenated column"
            return AttentionSite(func_name, var, "matmul-softmax chain").reject(why)
    post_scale = 1.0
    mask_ops = []
    problem = None
    qk = None
    # logit soft-capping: softmax(mask(c * tanh(B * Q K^T))); c is the scale met between the tanh and the
    # softmax, B the one inside (no mask or bias may be inside: tanh would turn its -inf into -c)
    softcap = None
    for _ in range(24):
        xv = bindings.get(x)
        name = op_name(xv)
        if name == "relax.matmul":
            qk = xv
            break
        if softcap is not None and not (_is_batch_view(xv) or name in ("relax.multiply", "relax.divide")):
            problem = (f"'{name or type(xv).__name__}' inside the soft-capping tanh (only constant scales of the "
                       "scores: the kernels soft-cap before the mask)")
            break
        if _is_batch_view(xv):
            x = xv.args[0]
        elif name in ("relax.multiply", "relax.divide"):
            c = bindings.resolve_scalar(xv.args[1])
            other = xv.args[0]
            if c is None and name == "relax.multiply":
                c, other = bindings.resolve_scalar(xv.args[0]), xv.args[1]
            if c is None:
                problem = _scale_problem(name, xv, bindings)
                break
            if name == "relax.divide":
                if c == 0:
                    problem = "scores divided by zero"
                    break
                c = 1.0 / c
            post_scale *= c
            x = other
        elif name in ("relax.add", "relax.minimum", "relax.maximum"):
            a, b = xv.args
            scores, mask = (a, b) if _scores_operand(a, b, bindings) else (b, a)
            if name == "relax.maximum":
                c = bindings.resolve_scalar(mask)
                if c is None or c * post_scale > masks.MASKED_LOGIT_BOUND or post_scale <= 0:
                    problem = "scores clamped by maximum() with something other than a large negative constant"
                    break
            else:
                if name == "relax.minimum" and post_scale <= 0:
                    problem = "a minimum() mask followed by a negative scale"
                    break
                mask_ops.append(("add" if name == "relax.add" else "min", mask, post_scale))
            x = scores
        elif name == "relax.where":
            cond, a, b = xv.args
            if _scores_operand(a, b, bindings):
                kind, fill, scores = "where-keep", b, a
            else:
                kind, fill, scores = "where-drop", a, b
            c = bindings.resolve_scalar(fill)
            if c is None:
                problem = "where() fills masked scores with something other than a large negative constant"
                break
            if c * post_scale > masks.MASKED_LOGIT_BOUND:
                problem = (f"where() fills masked scores with {c:g} ({c * post_scale:g} after the scale that "
                           "follows), not a large negative constant: a masked logit must stay <= "
                           f"{masks.MASKED_LOGIT_BOUND:g} (fill with -inf or the dtype's lowest value)")
                break
            mask_ops.append((kind, cond, post_scale))
            x = scores
        elif name == "relax.tanh":
            if not post_scale > 0:
                problem = (f"soft-capping tanh scaled by {post_scale!r} (the kernels soft-cap as c * tanh(s / c) "
                           "with c > 0)")
                break
            softcap = post_scale
            x = xv.args[0]
        else:
            problem = f"unsupported op '{name or type(xv).__name__}' between Q@K^T and softmax"
            break
    if qk is None and problem is None:
        return None
    site = AttentionSite(func_name, var, "matmul-softmax chain", sinks=sink, softcap=softcap)
    if problem:
        return site.reject(problem)
    if softcap is not None and sink is not None:
        return site.reject("attention sinks together with logit soft-capping (no kernel computes both)")
    scores = _strip_views(softmax.args[0], bindings)
    if any(not _is_dead_row_condition(c, scores, bindings) for c in dead_row_conds):
        return site.reject("softmax probabilities zeroed where a condition holds that is not \"every score of the "
                           "row is -inf\" (torch's safe softmax)")
    q_expr, kt_expr, v_expr = qk.args[0], qk.args[1], value.args[1]
    nd = len(shape_of(q_expr) or [])
    implicit_k = implicit_v = None
    if nd == 4:
        q_lab, kt_lab, v_lab = ["B", "H", "S", "D"], ["B", "H", "D", "S"], ["B", "H", "S", "D"]
    elif nd == 3:
        q_lab, kt_lab, v_lab = ["BH", "S", "D"], ["BH", "D", "S"], ["BH", "S", "D"]
    elif nd == 5:
        q_lab = ["B", "H0", "H1", "S", "D"]
        q_shape = shape_of(q_expr)
        try:
            kt_lab, implicit_k = _grouped_operand("K", shape_of(kt_expr), q_shape, ["D", "S"])
            v_lab, implicit_v = _grouped_operand("V", shape_of(v_expr), q_shape, ["S", "D"])
        except ValueError as err:
            return site.reject(str(err))
    else:
        return site.reject(f"{nd}-D attention matmuls")
    site.out_labels = list(q_lab)
    site.q = trace(q_expr, q_lab, bindings, allow_expansion=False, fold_scale=True, query=True)
    site.k = trace(kt_expr, kt_lab, bindings, allow_expansion=allow_kv_expansion, fold_scale=True,
                   implicit=implicit_k)
    site.v = trace(v_expr, v_lab, bindings, allow_expansion=allow_kv_expansion, implicit=implicit_v)
    site.scale = post_scale * site.q.scale * site.k.scale
    site.mask_ops = [(kind, m) for kind, m, _ in mask_ops]
    if site.q.layout() == "BSH":
        site.out_labels = list(SINGLE_HEAD)  # the output is (B, S, D) as well
    common_checks(site)
    if site.reason:
        return site
    if site.sinks is not None and site.sinks.num_heads != site.num_q_heads:
        return site.reject(f"{site.sinks.num_heads} sink logits for {site.num_q_heads} query heads")
    _prove_masks(site, bindings, evaluator, scales=[s for *_, s in mask_ops])
    return site


def _grouped_operand(name, shape, q_shape, tail):
    """Start labels of a 5-D K^T / V operand of a grouped-query chain, against the query's (B, X, Y, S, D)
    (query head h = x * Y + y), and the expansion the matmul's broadcasting makes of it (None: none).

    An operand (B, X, 1, ..) gives query head h the K/V head h // Y: FA2's grouping, ``repeat`` x Y; one of
    (B, 1, Y, ..) the K/V head h % Y: ``tile`` x X; (B, 1, 1, ..) is one K/V head for all.

    Raises
    ------
    ValueError
        When the operand's head axes are none of these (the reason, in words)."""
    if shape is None or q_shape is None or len(shape) != 5:
        raise ValueError(f"{name} of the 5-D attention matmuls has an unknown shape or is not 5-D")
    (x, y), (qx, qy) = shape[1:3], q_shape[1:3]
    if prove_equal(x, qx) and prove_equal(y, qy):
        return ["B", "H0", "H1"] + tail, None
    inner_unit = as_int(y) == 1 and (prove_equal(x, qx) or as_int(x) == 1)
    outer_unit = as_int(x) == 1 and (prove_equal(y, qy) or as_int(y) == 1)
    if inner_unit and not (outer_unit and as_int(qy) == 1):
        factor = as_int(qy) if prove_equal(x, qx) else _product_int(qx, qy)
        return ["B", "Hkv", "R"] + tail, (REPEAT, factor)
    if outer_unit:  # with one K/V head (both axes of size 1) the groupings are the same
        return ["B", "R", "Hkv"] + tail, (REPEAT if as_int(y) == 1 else TILE, as_int(qx))
    raise ValueError(f"the 5-D attention matmuls broadcast the query's head axes ({_dim_text(qx)}, "
                     f"{_dim_text(qy)}) against {name}'s ({_dim_text(x)}, {_dim_text(y)}): only a K/V axis of "
                     "size 1 may be broadcast over the query's")


def _product_int(a, b):
    a, b = as_int(a), as_int(b)
    return None if None in (a, b) else a * b


# ----------------------------------------------------------------------------- masks
def _prove_masks(site, bindings, evaluator, post_scale=None, scales=None):
    if not site.mask_ops:
        site.mask = masks.NO_MASK
        return
    scales = scales or [post_scale] * len(site.mask_ops)
    s_q, s_kv = seq_len(site.q), seq_len(site.k)
    sym = set()
    for e in (s_q, s_kv):
        if not isinstance(e, tirx.IntImm):
            sym.update(tirx.analysis.undefined_vars(e, []))
    samples = []
    try:
        thresholds = set()
        others = set()
        for kind, mask_expr in site.mask_ops:
            evaluator.subgraph(mask_expr, bindings)  # a runtime input (bias, padding) is the reason
            thresholds |= evaluator.thresholds(mask_expr, bindings)
            others.update(evaluator.other_vars(mask_expr, bindings, sym))
        # the other variables (a batch, a past the positions come from) at the small lengths and their lower
        # bound, not around the thresholds: a batch of 4098 would make the mask a batch too large to evaluate
        for values in masks.combine_samples(masks.sample_bindings(sym, thresholds, bindings.lower_bounds),
                                            masks.sample_bindings(others, (), bindings.lower_bounds)):
            sq, skv = (_substitute(e, values) for e in (s_q, s_kv))
            if sq is None or skv is None:
                continue
            if sq * skv > masks.MAX_SAMPLE_ELEMENTS:
                raise masks.MaskError(
                    f"checking the mask needs it at {sq} x {skv} positions (around a constant of its "
                    f"sub-graph), more than {masks.MAX_SAMPLE_ELEMENTS} elements")
            allowed = None
            for (kind, mask_expr), scale in zip(site.mask_ops, scales):
                value = evaluator.evaluate(mask_expr, bindings, values)
                a = masks.allowed_from_mask(kind, value, sq, skv, scale)
                allowed = a if allowed is None else allowed & a
            if sq > skv:
                continue  # its values are checked (a bias is named), but not its shape: lengths a
                # decode/prefill graph never has (more queries than keys)
            samples.append(allowed)
        if not samples:
            raise masks.MaskError(f"no sample sequence lengths with S_q <= S_kv to check the mask at "
                                  f"(S_q {_dim_text(s_q)}, S_kv {_dim_text(s_kv)}): more queries than keys")
        site.mask = masks.classify_samples(samples)
    except masks.MaskError as err:
        site.reject(str(err))
        return
    # the samples skip S_q > S_kv; there a causal mask hides every key from the first rows, which the
    # graph and FA2 fill differently: the same rule as for R.nn.attention
    if site.mask.causal and not (prove_equal(s_q, s_kv) or _analyzer_le(s_q, s_kv, bindings.length_facts)):
        site.reject("BottomRight causal mask where S_q <= S_kv is not provable")
    if site.mask.chunk is not None:
        _check_chunked(site, s_q, s_kv)


def _check_chunked(site, s_q, s_kv):
    """A chunked mask runs as causal attention on its blocks (the rewrite slices and reshapes Q, K and V): the
    blocks must be known when compiling, and no kernel applies sinks or a soft-cap block by block."""
    what = f"a chunked attention mask (each query sees the earlier keys of its own block of {site.mask.chunk} positions)"
    if as_int(s_q) is None or as_int(s_kv) is None:
        site.reject(f"{what} with symbolic lengths (S_q {_dim_text(s_q)}, S_kv {_dim_text(s_kv)}): the rewrite "
                    "runs causal attention on the blocks, so they must be known when compiling; export "
                    "the graph with static sequence lengths")
    elif site.sinks is not None or site.softcap is not None:
        site.reject(f"{what} together with {'attention sinks' if site.sinks is not None else 'logit soft-capping'}")


def _substitute(expr, values):
    from tvm.sym import Analyzer

    ana = Analyzer()
    for var, value in values.items():
        ana.bind(var, value)
    out = ana.simplify(expr)
    return int(out) if isinstance(out, tirx.IntImm) else None
