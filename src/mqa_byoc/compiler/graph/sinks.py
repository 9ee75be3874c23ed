"""Attention sinks (GPT-OSS) on the softmax side of an explicit chain, and chains nothing else explains.

GPT-OSS appends one learned logit per query head to every score row, normalizes over keys and sink,
and drops the sink's column before the product with V::

    logits = concat([scores, broadcast_to(reshape(sinks, (1, H, 1, 1)), (B, H, S_q, 1))], axis=-1)
    probs = softmax(logits - max(logits, axis=-1, keepdims=True))[..., :S_kv]
    out = probs @ V

which is ``softmax(scores) @ V`` scaled per row by ``1 - p_sink = sigmoid(lse(scores) - sink_h)``: FA2's
output and its log-sum-exp give it exactly. Subtracting a row's own maximum before softmax does not
change softmax (it is invariant to a per-row shift), with or without sinks.

:func:`unexplained_chains` finds every ``matmul(softmax(f(matmul(...))), V)`` whatever ``f`` is, so that
a chain the analysis does not understand is reported with the ops it met instead of being absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax

from mqa_byoc.compiler.graph.exprs import op_name
from mqa_byoc.compiler.graph.trace import as_int, dims_equal, prove_equal, shape_of

# ops a softmax's probabilities may pass on their way to P@V without being a new computation
_PROB_PLUMBING = ("relax.astype", "relax.reshape", "relax.broadcast_to", "relax.permute_dims",
                  "relax.strided_slice", "relax.where", "relax.multiply", "relax.nn.dropout")


@dataclass
class SinkLogits:
    """The sink column of a chain: ``source`` holds one logit per query head (H elements)."""

    source: relax.Expr
    num_heads: int


def _slice_args(call):
    """(axes, begin, end, strides) of a strided_slice as int lists, None when not constant."""
    try:
        out = [[int(x) for x in arg] for arg in call.args[1:5]]
    except (TypeError, ValueError):
        return None
    if len(out) == 3:  # no strides: 1
        out.append([1] * len(out[0]))
    return out if len(out) == 4 else None


def strip_sink_slice(expr, bindings):
    """``(inner, dropped)``: when ``expr`` is ``strided_slice(p, last axis, 0 .. n)`` of a tensor with
    ``n + dropped`` entries on its last axis, the slice's input and ``dropped``; else ``(expr, 0)``."""
    value = bindings.get(expr)
    if op_name(value) != "relax.strided_slice":
        return expr, 0
    args = _slice_args(value)
    src, out = shape_of(value.args[0]), shape_of(value)
    if args is None or src is None or out is None or len(src) != len(out):
        return expr, 0
    axes, begin, end, strides = args
    last = len(src) - 1
    if [a % len(src) for a in axes] != [last] or begin != [0] or strides != [1]:
        return expr, 0
    n_in, n_out = as_int(src[last]), as_int(out[last])
    if n_in is None or n_out is None or n_out >= n_in:
        # symbolic: n_in is S_kv + k and the slice ends k before it (end -k)
        if end and end[0] < 0 and all(prove_equal(a, b) for a, b in zip(src[:-1], out[:-1])):
            return value.args[0], -end[0]
        return expr, 0
    if end[0] not in (n_out, n_out - n_in):
        return expr, 0
    return value.args[0], n_in - n_out


def same_value(a, b, bindings) -> bool:
    """``a`` and ``b`` are the same tensor, or casts of the same tensor to the same type (ToMixedPrecision
    binds one cast per reader)."""
    if a.same_as(b):
        return True
    va, vb = bindings.get(a), bindings.get(b)
    return (op_name(va) == op_name(vb) == "relax.astype" and va.args[0].same_as(vb.args[0])
            and str(va.attrs.dtype) == str(vb.attrs.dtype))


def _row_max_of(expr, x, bindings) -> bool:
    """Whether ``expr`` is the row maximum of ``x`` over its last axis (``max(x, -1, keepdims)`` or the
    values of ``topk(x, 1, -1)``, through tuple re-packing)."""
    for _ in range(4):
        if isinstance(expr, relax.TupleGetItem):
            tup = expr.tuple_value
            tup_value = bindings.get(tup) if isinstance(tup, relax.Var) else tup
            if isinstance(tup_value, relax.Tuple):  # re-packed: (values, indices)
                expr = tup_value.fields[expr.index]
                continue
            if expr.index != 0 or op_name(tup_value) != "relax.topk":
                return False
            attrs = tup_value.attrs
            nd = len(shape_of(x) or [])
            return (same_value(tup_value.args[0], x, bindings) and int(attrs.k) == 1 and bool(attrs.largest)
                    and int(attrs.axis) % max(nd, 1) == nd - 1)
        value = bindings.get(expr)
        if value is None:
            return False
        if isinstance(value, (relax.TupleGetItem, relax.Var)):
            expr = value
            continue
        if op_name(value) == "relax.max":
            nd = len(shape_of(x) or [])
            axes = [int(a) % nd for a in (value.attrs.axis or [])]
            return same_value(value.args[0], x, bindings) and axes == [nd - 1] and bool(value.attrs.keepdims)
        return False
    return False


def strip_row_shift(expr, bindings):
    """``x`` when ``expr`` is ``x - rowmax(x)`` (softmax does not see the shift), else ``expr``."""
    value = bindings.get(expr)
    if op_name(value) == "relax.subtract" and _row_max_of(value.args[1], value.args[0], bindings):
        return value.args[0]
    return expr


def split_sink_concat(expr, dropped, bindings):
    """``(scores, SinkLogits)`` when ``expr`` is ``concat([scores, sink column], axis=-1)`` whose last
    ``dropped`` columns are one sink logit per query head; ``(None, reason)`` for a concat on the key
    axis that is not that; ``(expr, None)`` when ``expr`` is no concat."""
    value = bindings.get(expr)
    if op_name(value) != "relax.concat":
        return expr, None
    shape = shape_of(value)
    nd = len(shape or [])
    if value.attrs.axis is None or int(value.attrs.axis) % max(nd, 1) != nd - 1:
        return expr, None
    parts = list(value.args[0].fields) if isinstance(value.args[0], relax.Tuple) else None
    if parts is None:
        tup = bindings.get(value.args[0])
        parts = list(tup.fields) if isinstance(tup, relax.Tuple) else None
    why = "logits concatenated on the key axis with something other than one sink logit per query head"
    if parts is None or len(parts) != 2 or dropped != 1 or nd != 4:
        return None, why
    scores, column = parts
    cshape = shape_of(column)
    if cshape is None or as_int(cshape[-1]) != 1:
        return None, why
    heads = as_int(shape[1])
    source = _per_head_source(column, heads, bindings)
    if source is None:
        return None, why + " (the appended column does not come from an (H,) tensor broadcast over the rows)"
    return scores, SinkLogits(source, heads)


def _per_head_source(expr, heads, bindings):
    """The tensor of ``heads`` elements that ``expr`` (B, H, S_q, 1) broadcasts, head h at axis 1: traced
    back through casts, broadcasts and the reshape of an (H,) tensor to (1, H, 1, 1)."""
    if heads is None:
        return None
    for _ in range(8):
        shape = shape_of(expr)
        if shape is None:
            return None
        dims = [as_int(x) for x in shape]
        if dims == [heads]:
            return expr
        value = bindings.get(expr)
        name = op_name(value)
        src = shape_of(value.args[0]) if name else None
        src_dims = [as_int(x) for x in src] if src is not None else None
        if name == "relax.astype":
            expr = value.args[0]
        elif name == "relax.broadcast_to" and src_dims == [1, heads, 1, 1]:
            expr = value.args[0]
        elif name == "relax.reshape" and src_dims == [heads] and dims == [1, heads, 1, 1]:
            expr = value.args[0]
        else:
            return expr if dims == [1, heads, 1, 1] else None
    return None


# ----------------------------------------------------------------------------- nothing unseen
def _producers(expr, bindings, limit):
    """Vars ``expr`` is computed from, nearest first, not crossing a matmul (yielded, not followed)."""
    out, stack, seen = [], [expr], set()
    while stack and len(seen) < limit:
        e = stack.pop(0)
        if not isinstance(e, relax.Var) or e in seen:
            continue
        seen.add(e)
        value = bindings.get(e)
        if value is None:
            continue
        out.append((e, value))
        if op_name(value) == "relax.matmul":
            continue
        args = value.fields if isinstance(value, relax.Tuple) else (
            [value.tuple_value] if isinstance(value, relax.TupleGetItem) else getattr(value, "args", []))
        for a in args:
            if isinstance(a, relax.Tuple):
                stack.extend(a.fields)
            else:
                stack.append(a)
    return out


def unexplained_chains(bindings, known_roots, limit=48):
    """``[(root var, reason)]`` for every ``P @ V`` matmul whose P comes from a softmax over a row of
    Q@K^T-like scores (a matmul's output reaching the softmax through any ops) that is not among
    ``known_roots``: each is an attention the analysis met without understanding it."""
    found = []
    for var, value in bindings.value.items():
        if op_name(value) != "relax.matmul" or var in known_roots:
            continue
        softmax, path = _path_to_softmax(value.args[0], bindings, 10)
        if softmax is None:
            continue
        ops = _ops_between(softmax.args[0], bindings, limit)
        if ops is None:
            continue
        if _masks_probabilities(path):
            found.append((var, "softmax(Q K^T) V-shaped chain whose probabilities are masked after the softmax "
                               "(where(mask, P, ...) between the softmax and P @ V): the kernels mask the scores "
                               "before it; mask the scores (fill -inf) instead"))
            continue
        nd = len(shape_of(softmax) or [])
        axis = int(softmax.attrs.axis) % nd
        if axis != nd - 1:
            found.append((var, f"softmax(Q K^T) V-shaped chain whose softmax is over axis {axis} of the {nd}-D scores, "
                               "not their last (key) axis: not the attention the kernels compute"))
            continue
        found.append((var, explain_ops(ops)))
    return found


def _path_to_softmax(expr, bindings, depth):
    """``(softmax, plumbing)``: the softmax (over any axis of 3-D or larger scores) P comes from through
    probability plumbing (views, slices, casts, a ``where`` on either branch: torch's safe softmax or a
    mask applied to the probabilities), None if none; the plumbing from P back to it as ``(op name, value,
    the argument followed)``."""
    if depth == 0:
        return None, []
    value = bindings.get(expr)
    name = op_name(value)
    if name == "relax.nn.softmax":
        return (value if len(shape_of(value) or []) >= 3 else None), []
    if name not in _PROB_PLUMBING:
        return None, []
    if name == "relax.where":
        branches = (value.args[2], value.args[1])
    elif name == "relax.multiply" and bindings.get(value.args[0]) is None:
        branches = (value.args[1],)
    else:
        branches = (value.args[0],)
    for branch in branches:
        softmax, path = _path_to_softmax(branch, bindings, depth - 1)
        if softmax is not None:
            return softmax, [(name, value, branch)] + path
    return None, []


def _masks_probabilities(path) -> bool:
    """A ``where`` on the path keeps the probabilities where its condition holds (``where(c, P, x)``): a mask
    applied after the softmax, which the kernels do not compute (they mask the scores before it)."""
    return any(name == "relax.where" and branch.same_as(value.args[1]) for name, value, branch in path)


def _ops_between(expr, bindings, limit):
    """The op names from a softmax's input back to the score matmul (a 3-D/4-D matmul among its
    producers), None when no matmul computes it (a softmax over something else)."""
    ops, reached = [], False
    for _var, value in _producers(expr, bindings, limit):
        name = op_name(value) or type(value).__name__
        if name == "relax.matmul":
            if len(shape_of(value) or []) >= 3:
                reached = True
            continue
        ops.append(name)
    return ops if reached else None


_EXPLAINED = (
    ("relax.tanh", "logit soft-capping (tanh of the scores, as in Gemma 2)"),
    ("relax.concat", "logits concatenated on the key axis (attention sinks?) in a form not recognized"),
    ("relax.topk", "a top-k of the logits"),
    ("relax.sort", "a sort of the logits"),
    ("relax.exp", "an exponential of the scores"),
    ("relax.log", "a logarithm of the scores"),
    ("relax.sigmoid", "a sigmoid of the scores"),
)


def explain_ops(ops) -> str:
    """The reason for a matmul-softmax-matmul chain the analysis does not prove, naming what it met."""
    names = sorted({o.split(".")[-1] for o in ops if o not in ("relax.astype", "relax.reshape")})
    for op, what in _EXPLAINED:
        if op in ops:
            return (f"softmax(Q K^T) V-shaped chain with {what}: not a score modification the kernels "
                    f"compute (ops between the matmuls: {', '.join(names)})")
    return ("softmax(Q K^T) V-shaped chain with a score modification the analysis cannot prove equal to "
            f"what the kernels compute (ops between the matmuls: {', '.join(names) or 'none'})")


# ----------------------------------------------------------------------------- the sink applied after P @ V
@dataclass
class SinkScaling:
    """A sink applied to attention's output instead of appended to its logits (GraniteSWA)::

        out = O * sigmoid(logsumexp(T, axis=-1) - sink_h)[..., None]

    where ``O`` is ``softmax(T) @ V`` (B, H, S_q, D): ``1 - p_sink`` of the extra logit, so exactly the
    sink form of the module doc. ``root`` is the multiply, ``output`` the P @ V matmul O comes from
    (through casts and the reshape of (B*H, S_q, D) to (B, H, S_q, D)), ``scores`` T (B, H, S_q, S_kv)."""

    root: relax.Var
    output: relax.Var
    scores: relax.Expr
    sinks: SinkLogits


def _unit_view(value) -> bool:
    """A reshape / squeeze / expand_dims that only adds or drops axes of size 1 (the other axes keep
    their order), or a cast between float dtypes: the values stay where they were."""
    name = op_name(value)
    if name == "relax.astype":
        return str(value.attrs.dtype).startswith(("float", "bfloat"))
    if name not in ("relax.reshape", "relax.squeeze", "relax.expand_dims"):
        return False
    src, out = shape_of(value.args[0]), shape_of(value)
    if src is None or out is None:
        return False
    return dims_equal([d for d in src if as_int(d) != 1], [d for d in out if as_int(d) != 1])


def _strip_unit_views(expr, bindings):
    for _ in range(8):
        value = bindings.get(expr)
        if not _unit_view(value):
            return expr
        expr = value.args[0]
    return expr


def _last_axis_sum(value) -> bool:
    nd = len(shape_of(value.args[0]) or [])
    axes = [int(a) % nd for a in (value.attrs.axis or [])] if nd else []
    return op_name(value) == "relax.sum" and axes == [nd - 1]


def _log_sum_exp_input(expr, bindings):
    """T when ``expr`` is T's log-sum-exp over its last axis: ``log(sum(exp(T - c), -1)) + c`` with one
    per-row ``c`` (torch's decomposition: the row maximum, 0 where it is infinite), or ``log(sum(exp(T),
    -1))``; else None."""
    expr = _strip_unit_views(expr, bindings)
    value = bindings.get(expr)
    candidates = []
    if op_name(value) == "relax.add":
        candidates = [(value.args[0], value.args[1]), (value.args[1], value.args[0])]
    elif op_name(value) == "relax.log":
        candidates = [(expr, None)]
    for log_side, shift in candidates:
        log = bindings.get(_strip_unit_views(log_side, bindings))
        if op_name(log) != "relax.log":
            continue
        total = bindings.get(_strip_unit_views(log.args[0], bindings))
        if op_name(total) != "relax.sum" or not _last_axis_sum(total):
            continue
        exp = bindings.get(total.args[0])
        if op_name(exp) != "relax.exp":
            continue
        if shift is None:
            return exp.args[0]
        diff = bindings.get(exp.args[0])
        if op_name(diff) != "relax.subtract":
            continue
        scores, c = diff.args
        c_shape, s_shape = shape_of(c), shape_of(scores)
        if (c_shape is None or s_shape is None or len(c_shape) != len(s_shape) or as_int(c_shape[-1]) != 1
                or not dims_equal(c_shape[:-1], s_shape[:-1])):
            continue  # not one shift per row
        if _strip_unit_views(shift, bindings).same_as(_strip_unit_views(c, bindings)):
            return scores
    return None


def _head_logits(expr, heads, rank, bindings):
    """The tensor of ``heads`` logits ``expr`` holds when, broadcast against a (B, H, S_q[, 1]) tensor of
    ``rank`` axes, it gives head h the same logit on every row (shape (1, H, 1) or (H, 1) and the like);
    else None."""
    shape = shape_of(expr)
    if shape is None or len(shape) > rank or heads is None:
        return None
    dims = [1] * (rank - len(shape)) + [as_int(d) for d in shape]
    if dims[1] != heads or any(d != 1 for i, d in enumerate(dims) if i != 1):
        return None
    return _strip_unit_views(expr, bindings)


def sink_scaling(var, value, bindings):
    """The :class:`SinkScaling` ``var = value`` is (a multiply of O by the sink's sigmoid), else None."""
    if op_name(value) != "relax.multiply":
        return None
    for o_side, s_side in ((value.args[0], value.args[1]), (value.args[1], value.args[0])):
        sig = bindings.get(_strip_unit_views(s_side, bindings))
        if op_name(sig) != "relax.sigmoid":
            continue
        diff = bindings.get(_strip_unit_views(sig.args[0], bindings))
        if op_name(diff) != "relax.subtract":
            continue
        scores = _log_sum_exp_input(diff.args[0], bindings)
        t_shape = shape_of(scores) if scores is not None else None
        if t_shape is None or len(t_shape) != 4:
            continue
        rank = len(shape_of(diff) or [])
        source = _head_logits(diff.args[1], as_int(t_shape[1]), rank, bindings) if rank in (3, 4) else None
        if source is None:
            continue
        out = _attention_output(o_side, t_shape[:3], bindings)
        scale_shape, out_shape = shape_of(s_side), shape_of(var)
        if out is None or scale_shape is None or out_shape is None:
            continue
        # the scale is one value per (batch, head, row), broadcast over the head dim, nothing else
        if not (dims_equal(scale_shape, [*t_shape[:3], 1]) and dims_equal(out_shape, shape_of(o_side))):
            continue
        return SinkScaling(var, out, scores, SinkLogits(source, as_int(t_shape[1])))
    return None


def _attention_output(expr, rows, bindings):
    """The matmul var ``expr`` (B, H, S_q, D) comes from through casts and the reshape of (B*H, S_q, D) with
    ``rows`` = (B, H, S_q); else None."""
    shape = shape_of(expr)
    if shape is None or len(shape) != 4 or not dims_equal(shape[:3], rows):
        return None
    for _ in range(6):
        value = bindings.get(expr)
        name = op_name(value)
        if name == "relax.matmul":
            return expr
        if name == "relax.astype":
            expr = value.args[0]
        elif name == "relax.reshape":
            src = shape_of(value.args[0])
            if src is None or len(src) != 3 or not dims_equal(src, [rows[0] * rows[1], rows[2], shape[3]]):
                return None
            expr = value.args[0]
        else:
            return None
    return None


def sink_scalings(bindings):
    """Every :class:`SinkScaling` of a function."""
    found = []
    for var, value in bindings.value.items():
        s = sink_scaling(var, value, bindings)
        if s is not None:
            found.append(s)
    return found
