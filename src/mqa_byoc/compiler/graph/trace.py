"""Trace an attention operand back through layout and K/V-expansion ops to its source tensor.

Real graphs reach attention through many equivalent op sequences (permute, 3-D batched-matmul
reshapes, no-op broadcast_to/astype, repeat, HF's expand_dims -> broadcast_to -> reshape, the same with
a reshape adding the unit axis, tile).
Instead of one dataflow pattern per sequence, we walk backwards and keep a *label* per axis:
"B" batch, "H" query-head count, "Hkv" K/V heads, "R" the repeat factor axis, "S"/"D" sequence and
head dim, "BH" a merged batch*head axis. Any sequence of ops whose labels end as a permutation of
(B, S, Hkv|H, D) on a source tensor is a K/V expansion we can remove, whatever its spelling.
A 3-D operand whose merged axis is never split has no head axis: its labels end as (B, S, D), one head
(upstream's BSH form).
A head axis split in two ("H0" the outer factor, "H1" the inner one) is the grouped view of the query,
(B, Hkv, G, S, D): it merges back into "H" (a reshape, or the source read as (B, H, S, D)), and on K/V the
inner factor broadcast from 1 is the repeat factor of FA2's grouping (query head h uses K/V head h // G).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from tvm import relax, tirx
from tvm.ir.expr import Constant
from tvm.sym import Analyzer

from mqa_byoc.compiler.graph.exprs import function_bindings, op_name  # noqa: F401 - op_name re-exported for the analysis

_ANALYZER = Analyzer()

# Expansion kinds. "repeat" and "broadcast" give query head h the K/V head h // r (what FA2 computes);
# "tile" gives h % H_kv, which is only the same when H_kv == 1.
REPEAT, BROADCAST, TILE = "repeat", "broadcast", "tile"

# labels of a (B, S, D) operand: no head axis, one head
SINGLE_HEAD = ["B", "S", "D"]


def shape_of(expr):
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    shape = ty.shape
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def product(dims):
    """The product of ``dims`` (ints or PrimExprs); 1 for none."""
    out = 1
    for d in dims:
        out = out * d
    return out


def prove_equal(a, b) -> bool:
    return _ANALYZER.can_prove_equal(tirx.const(a, "int64") if isinstance(a, int) else a,
                                     tirx.const(b, "int64") if isinstance(b, int) else b)


def constant_dim(expr):
    """``expr`` (a size) as an ``IntImm`` where the shared analyzer proves it constant (with the lower bounds
    :class:`Bindings` told it), else None."""
    if isinstance(expr, tirx.IntImm):
        return expr
    if isinstance(expr, tirx.Var):
        return None
    simplified = _ANALYZER.simplify(expr)
    return simplified if isinstance(simplified, tirx.IntImm) else None


def dims_equal(a, b) -> bool:
    """Two shapes (lists of dims) provably equal; False when either is None."""
    return a is not None and b is not None and len(a) == len(b) and all(prove_equal(x, y) for x, y in zip(a, b))


def as_int(x):
    return int(x) if isinstance(x, (int, tirx.IntImm)) else None


@dataclass
class Traced:
    """Result of tracing one operand."""

    source: relax.Expr  # the tensor before any layout/expansion op
    labels: list  # labels of the source axes
    expansion: str | None = None  # REPEAT / BROADCAST / TILE / None
    how: str | None = None  # the expansion in the graph's words, for reasons (None: its kind)
    factor: int = 1  # heads after expansion / heads before
    expansion_ops: list = field(default_factory=list)  # bound vars of the expansion ops passed
    ops: list = field(default_factory=list)  # every bound var passed (layout ops included)
    entry_dtype: str | None = None  # dtype of the operand as attention consumes it
    scale: float = 1.0  # constant factors multiplied into the operand (query side)
    problem: str | None = None  # why the trace is unusable
    unit_axis: int | None = None  # a size-1 source axis the expansion broadcast from, dropped from labels
    # two adjacent source axes (after unit_axis is dropped) read as one head axis: a grouped (.., G, ..) view
    merged_axis: int | None = None
    # a source axis holding (heads, head dim) in that order, read as two axes of ``split_heads`` and the
    # rest: nn.MultiheadAttention's (S, B, E) projection reshaped to (S, B*H, D)
    split_axis: int | None = None
    split_heads: int | None = None
    kept_expansion: bool = False  # the trace stopped before a K/V expansion it was told not to pass
    stop_op: relax.Expr | None = None  # the value bound to the source (where the trace stopped), if any
    from_param: bool = False  # the source is a parameter of the function

    def __post_init__(self):
        if self.entry_dtype is None and isinstance(self.source.ty, relax.TensorType):
            self.entry_dtype = str(self.source.ty.dtype)

    def kernel_dtype(self) -> str | None:
        """The half-precision type FA2 runs in for this operand: the type attention consumes, or,
        when that is float32, the half type it was exactly up-cast from; None when neither."""
        half = ("float16", "bfloat16")
        if self.entry_dtype in half:
            return self.entry_dtype
        src = str(self.source.ty.dtype)
        if self.entry_dtype == "float32" and src in half:
            return src  # an exact up-cast: FA2 accumulates in float32 anyway
        return None

    def shape(self):
        """The source's shape as :attr:`labels` describe it (without :attr:`unit_axis`, with the axes at
        :attr:`merged_axis` as one), or None."""
        shape = shape_of(self.source)
        if shape is None:
            return None
        if self.unit_axis is not None:
            shape = shape[:self.unit_axis] + shape[self.unit_axis + 1:]
        if self.merged_axis is not None:
            m = self.merged_axis
            shape = shape[:m] + [_ANALYZER.simplify(shape[m] * shape[m + 1])] + shape[m + 2:]
        if self.split_axis is not None:
            a, h = self.split_axis, self.split_heads
            shape = shape[:a] + [tirx.const(h, shape[a].ty), _ANALYZER.simplify(tirx.floordiv(shape[a], h))] + \
                shape[a + 1:]
        return shape

    def is_view(self) -> bool:
        """Whether the kernels read the source through a reshape to :meth:`shape` (a dropped unit axis
        or merged head axes, or the heads split off the head dim), which the rewrite emits."""
        return self.unit_axis is not None or self.merged_axis is not None or self.split_axis is not None

    def layout(self) -> str | None:
        core = [lab for lab in self.labels]
        head = "Hkv" if "Hkv" in core else "H"
        if core == ["B", "S", head, "D"]:
            return "BSNH"
        if core == ["B", head, "S", "D"]:
            return "BNSH"
        if core == ["S", "B", head, "D"]:
            return "SBNH"  # sequence first (nn.MultiheadAttention); the rewrite transposes it to BSNH
        if core == SINGLE_HEAD:
            return "BSH"
        return None


def _match_cast_lengths(func) -> dict:
    """{shape var: expression} from ``R.match_cast``s that bind a fresh variable to a dimension whose
    value is known (a KV cache view: ``match_cast(concat(past, new), (B, kv_len, ...))`` means
    kv_len == past_len + seq_len at run time, checked by the VM)."""
    facts = {}
    for b in function_bindings(func):
        if not isinstance(b, relax.MatchCast):
            continue
        pattern, value = b.ty, b.value.ty
        if not (isinstance(pattern, relax.TensorType) and isinstance(value, relax.TensorType)):
            continue
        if pattern.shape is None or value.shape is None:
            continue
        p_dims, v_dims = getattr(pattern.shape, "values", None), getattr(value.shape, "values", None)
        if p_dims is None or v_dims is None or len(p_dims) != len(v_dims):
            continue
        for p, v in zip(p_dims, v_dims):
            if isinstance(p, tirx.Var) and not p.same_as(v) and p not in facts:
                facts[p] = v
    return facts


def _lower_bounds(func) -> dict:
    """{symbolic variable name: lower bound} from the function's ``tir_var_lower_bound`` attribute (what TVM's
    PyTorch frontend records of torch.export's ranges: a graph exported for lengths from there on). The upper
    bounds (``tir_var_upper_bound``) are memory-planning limits and are not used."""
    attrs = func.attrs if func.attrs is not None else {}
    lower = attrs.get("tir_var_lower_bound") or {}
    return {str(name): int(value) for name, value in lower.items()}


def _bound_vars(func, lower: dict) -> None:
    """Tells the shared analyzer the lower bound of each of ``func``'s symbolic variables that has one
    (:func:`_lower_bounds`): a length torch.export bounds below (a sliding-window decode's past of at least the
    window) makes sizes such as ``min(2^63 - 1, past) - min(max(past - 7, 0), past) + 1`` provably 8. The
    variables are the function's own objects, so no other function's analysis sees these bounds."""
    from tvm.sym import ConstIntBound

    if not lower:
        return
    for var in [*relax.analysis.free_symbolic_vars(func), *relax.analysis.defined_symbolic_vars(func)]:
        if var.name in lower:
            # below int64's largest value above (the analyzer's +inf would keep min(2^63 - 1, past))
            _ANALYZER.update(var, ConstIntBound(lower[var.name], ConstIntBound.POS_INF - 1), override=True)


class Bindings:
    """Var -> bound value for a whole function, plus use counts."""

    def __init__(self, func: relax.Function):
        self.value = {}
        self.binding = {}  # var -> its binding (VarBinding, or MatchCast, which defines shape vars)
        for b in function_bindings(func):  # R.If branches' bindings too
            self.binding[b.var] = b
            if isinstance(b, relax.VarBinding):
                self.value[b.var] = b.value
        self.params = set(func.params)
        # the model's weights when they are parameters (``num_input``: the frontends' keep_params_as_input)
        num_input = func.attrs.get("num_input") if func.attrs is not None else None
        self.weights = set(func.params[int(num_input):]) if num_input is not None else set()
        self.length_facts = _match_cast_lengths(func)
        self.lower_bounds = _lower_bounds(func)
        _bound_vars(func, self.lower_bounds)

    def get(self, expr):
        return self.value.get(expr) if isinstance(expr, relax.Var) else None

    def resolve_scalar(self, expr):
        """A constant scalar (possibly astype'd / reshaped / broadcast, or filling ``full``), as a Python
        float, else None. Casts are applied: ``astype(const(0.1, "float32"), "float16")`` is the float16
        value the graph uses."""
        casts = []
        while True:
            if isinstance(expr, Constant):
                arr = expr.value.numpy()
                if arr.size == 0:
                    return None
                flat = arr.reshape(-1)
                if not (flat == flat[0]).all():
                    return None
                x = flat[:1]
                for dtype in reversed(casts):
                    x = x.astype(_np_dtype(dtype))
                return float(x.astype("float64")[0])
            v = self.get(expr)
            if isinstance(v, Constant):  # a constant bound to a variable (TVM's torch frontend: masked_fill's fill)
                expr = v
                continue
            if op_name(v) in ("relax.full", "relax.full_like"):
                # full(shape, c) / full_like(x, c): c in the tensor's type (HF XGLM's clamp at the type's
                # minimum, torch.full((), finfo.min))
                dtype = getattr(getattr(expr, "ty", None), "dtype", None)
                if dtype is not None:
                    casts.append(str(dtype))
                expr = v.args[1]
                continue
            if v is None or op_name(v) not in ("relax.astype", "relax.reshape", "relax.broadcast_to"):
                return None
            if op_name(v) == "relax.astype":
                casts.append(str(v.attrs.dtype))
            expr = v.args[0]


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


def trace(expr, labels, bindings: Bindings, allow_expansion: bool, fold_scale: bool = False,
          query: bool = False, implicit: tuple | None = None) -> Traced:
    """Walk back from ``expr`` whose axes carry ``labels`` (see module docstring).

    ``allow_expansion``: pass through K/V head expansions (else stop before them);
    ``fold_scale``: pass through multiplication by a constant (the query side), kept in ``scale``;
    ``query``: the operand is the query, whose head axis may be split into groups (a layout op, never
    an expansion);
    ``implicit``: (kind, factor) of an expansion the consumer does itself (a matmul broadcasting a
    size-1 "R" axis of ``labels``), whether or not ``allow_expansion``.
    """
    t = Traced(source=expr, labels=list(labels), entry_dtype=str(expr.ty.dtype))
    before_split = None  # the query's trace before it split the head axis
    before_merge = None  # the trace at a (B, H, ..) view of a (B*H, ..) tensor, before passing it
    if implicit is not None:
        t.expansion, t.factor = implicit
        t.how = "the matmul broadcasting them over the query's outer head factor" if t.expansion == TILE else None
    last_layout = _snapshot(t) if t.layout() is not None else None  # the last point whose axes are a layout
    while True:
        value = bindings.get(expr)
        name = op_name(value)
        out_shape = shape_of(expr)
        if value is None or out_shape is None:
            break
        arg = value.args[0] if name else None
        in_shape = shape_of(arg) if arg is not None else None
        labels = t.labels
        new_labels = None
        expansion, factor = None, 1

        if name == "relax.astype":
            # Casts between float types commute with the layout/expansion ops we pass; kernel_dtype()
            # decides which precision FA2 runs in and the rewrite casts the source if needed.
            if str(arg.ty.dtype).startswith(("float", "bfloat")) and str(expr.ty.dtype).startswith(("float", "bfloat")):
                new_labels = labels
        elif name == "relax.permute_dims":
            axes = value.attrs.axes
            axes = list(range(len(labels)))[::-1] if axes is None else [int(a) for a in axes]
            new_labels = [None] * len(labels)
            for i, a in enumerate(axes):
                new_labels[a] = labels[i]
        elif name in ("relax.reshape", "relax.broadcast_to") and in_shape is not None and \
                len(in_shape) == len(out_shape) and all(prove_equal(a, b) for a, b in zip(in_shape, out_shape)):
            new_labels = labels  # a no-op
        elif name == "relax.reshape" and in_shape is not None and _inserts_unit_r_axes(labels, in_shape, out_shape):
            # expand_dims spelled as a reshape (``nn.op.reshape(k, [b, s, hkv, 1, d])``, ONNX's Unsqueeze)
            new_labels = [lab for lab, n in zip(labels, out_shape) if not (lab == "R" and as_int(n) == 1)]
            expansion = "expand_dims"
        elif name == "relax.reshape" and in_shape is not None and (
                heads := _batch_heads_split(labels, in_shape, out_shape)):
            # (.., B, H*D) -> (.., B*H, D): the heads of a sequence-first projection folded into its batch
            p = labels.index("BH")
            new_labels = list(labels[:p]) + ["B", "HD"] + list(labels[p + 2:])
            t.split_heads = heads
        elif name == "relax.reshape" and in_shape is not None:
            new_labels = _unreshape(labels, in_shape, out_shape)
            if new_labels is not None and "H0" in new_labels and "H0" not in labels and not query:
                expansion = "split"
        elif name == "relax.broadcast_to" and in_shape is not None and len(in_shape) == len(out_shape):
            new_labels, expansion = _unbroadcast(labels, in_shape, out_shape)
        elif name == "relax.expand_dims" and in_shape is not None:
            axes = [int(a) % len(out_shape) for a in value.attrs.axis]
            if all(labels[a] == "R" and as_int(out_shape[a]) == 1 for a in axes):
                new_labels = [lab for i, lab in enumerate(labels) if i not in axes]
                expansion = "expand_dims"
            elif len(axes) == 1 and labels[axes[0]] in ("H0", "H1") and as_int(out_shape[axes[0]]) == 1:
                # a unit head factor (groups of one head): the other factor is all the heads
                new_labels = ["H" if lab in ("H0", "H1") else lab for i, lab in enumerate(labels) if i != axes[0]]
        elif name == "relax.repeat":
            axis = int(value.attrs.axis) % len(labels) if value.attrs.axis is not None else None
            if axis is not None and labels[axis] == "H":
                new_labels = list(labels)
                new_labels[axis] = "Hkv"
                expansion = REPEAT
                factor = int(value.attrs.repeats)
        elif name == "relax.tile":
            reps = [int(r) for r in value.attrs.repeats]
            reps = [1] * (len(labels) - len(reps)) + reps
            moved = [i for i, r in enumerate(reps) if r != 1]
            if len(moved) == 1 and labels[moved[0]] == "H":
                new_labels = list(labels)
                new_labels[moved[0]] = "Hkv"
                expansion = TILE
                factor = reps[moved[0]]
        elif name in ("relax.multiply", "relax.divide") and fold_scale:
            # a constant scale folded into Q or K (torch's SDPA decomposition scales both by sqrt; users
            # write q / sqrt(d) or k / sqrt(d))
            pairs = [(value.args[0], value.args[1])]
            if name == "relax.multiply":
                pairs.append((value.args[1], value.args[0]))
            for a, b in pairs:
                c = bindings.resolve_scalar(b)
                if name == "relax.divide" and c is not None:
                    c = 1.0 / c if c != 0 else None
                if c is not None and shape_of(a) is not None and len(shape_of(a)) == len(out_shape):
                    t.scale *= c
                    arg = a
                    new_labels = labels
                    break

        if new_labels is None or any(lab is None for lab in new_labels):
            break
        if expansion is not None:
            if not allow_expansion:
                t.kept_expansion = True
                break
            t.expansion_ops.append(expr)
            if expansion in (REPEAT, TILE, BROADCAST):
                if t.expansion is not None:
                    t.problem = "K/V heads expanded twice"
                t.expansion = expansion
                # the factor is set only once the expansion is passed (a trace without expansions stops here)
                t.factor = as_int(out_shape[labels.index("H")]) if expansion == BROADCAST else factor
            elif expansion in ("broadcast-r", "broadcast-r-outer"):
                # HF repeat_kv: (B, Hkv, 1, S, D) -> (B, Hkv, r, S, D) -> (B, Hkv*r, S, D) groups
                # query head h with K/V head h // r; broadcasting the outer factor groups h % Hkv.
                if t.expansion is not None:
                    t.problem = "K/V heads expanded twice"
                t.expansion = REPEAT if expansion == "broadcast-r" else TILE
                if t.expansion == TILE:
                    t.how = "a broadcast over the outer factor of the heads"
                t.factor = as_int(out_shape[new_labels.index("R")])
        if query and before_split is None and "H0" in new_labels and "H0" not in labels:
            before_split = replace(t, labels=list(t.labels), ops=list(t.ops))
        if before_merge is None and "BH" in new_labels and "BH" not in labels and not t.expansion_ops:
            before_merge = replace(t, labels=list(t.labels), ops=list(t.ops))
        t.ops.append(expr)
        t.labels = new_labels
        expr = arg
        t.source = expr
        if t.layout() is not None:
            last_layout = _snapshot(t)

    if before_merge is not None and "BH" in t.labels:
        # the merged (B*H, ..) tensor is never split back into batch and heads where the trace stops (a key
        # row concatenated to it, nn.MultiheadAttention's add_zero_attn): its (B, H, ..) view is the operand
        t = before_merge
    settled = _settle(t, bindings)
    if before_split is not None and any(lab in ("H0", "H1") for lab in settled.labels):
        # the query's split heads do not merge back (e.g. permuted apart): it is the tensor before the split
        settled = _settle(before_split, bindings)
    if settled.layout() is None and not settled.problem and last_layout is not None:
        # the trace went on through views into axes that are no layout (a projection reshaped heads-innermost
        # and permuted back): the operand is the tensor at the last point whose axes were one
        settled = _settle(last_layout, bindings)
    return settled


def _snapshot(t: Traced) -> Traced:
    """A copy of ``t`` that the trace's later steps leave alone."""
    return replace(t, labels=list(t.labels), ops=list(t.ops), expansion_ops=list(t.expansion_ops))


def _settle(t: Traced, bindings: Bindings) -> Traced:
    """Finish a trace that stopped at ``t.source``: drop a unit axis an expansion grew, read adjacent
    split head axes as one, split a (heads, head dim) axis in two, and name what stays unexplained in
    ``t.problem``."""
    t.stop_op, t.from_param = bindings.get(t.source), t.source in bindings.params
    if "HD" in t.labels:
        if t.labels.count("HD") == 1 and t.split_heads and t.expansion is None and "R" not in t.labels and not any(
                lab in ("H0", "H1") for lab in t.labels):
            t.split_axis = t.labels.index("HD")
            t.labels = t.labels[:t.split_axis] + ["H", "D"] + t.labels[t.split_axis + 1:]
            return t
        t.problem = "heads folded into the batch of a projection together with a K/V expansion or a head split"
        return t
    if t.expansion in (REPEAT, TILE) and "R" in t.labels and not t.problem:
        # the broadcast's input came from an op we do not pass with its unit axis in place: Falcon's
        # fused qkv indexed with a list (``qkv[:, :, :, [-2]]``: (B, S, Hkv, 1, D)), a 5-D K/V that a
        # matmul broadcasts over the query's groups; K/V are that view
        axis = t.labels.index("R")
        shape = shape_of(t.source)
        if shape is not None and as_int(shape[axis]) == 1:
            t.unit_axis = axis
            t.labels = t.labels[:axis] + t.labels[axis + 1:]
    if "H0" in t.labels and t.labels.index("H0") + 1 < len(t.labels) and \
            t.labels[t.labels.index("H0") + 1] == "H1" and t.unit_axis is None:
        # a grouped view (B, Hkv, G, ..) of all the heads, in the order of the merged head axis
        t.merged_axis = t.labels.index("H0")
        t.labels = t.labels[:t.merged_axis] + ["H"] + t.labels[t.merged_axis + 2:]
    if any(lab in ("H0", "H1", "R") for lab in t.labels):
        t.problem = "head axis reshaped without a recognized expansion (" + describe_axes(t.labels) + ")"
    if t.labels == ["BH", "S", "D"]:
        # the merged axis was never split into (batch, heads): a batched matmul over it is attention
        # with one head per batch entry, whatever the tensor was before
        t.labels = list(SINGLE_HEAD)
    return t


def _batch_heads_split(labels, in_shape, out_shape) -> int | None:
    """The head count H when a reshape (.., B, H*D, ..) -> (.., B*H, D, ..) of the same rank folds the heads,
    split off the inner axis, into the batch before it (labels "BH", "D" on the output's two axes, every
    other axis kept); None when it does not."""
    if len(in_shape) != len(out_shape) or "BH" not in labels:
        return None
    p = labels.index("BH")
    if p + 1 >= len(labels) or labels[p + 1] != "D" or "HD" in labels:
        return None
    if not all(prove_equal(a, b) for i, (a, b) in enumerate(zip(in_shape, out_shape)) if i not in (p, p + 1)):
        return None
    b, hd, bh, d = in_shape[p], in_shape[p + 1], out_shape[p], out_shape[p + 1]
    h = as_int(_ANALYZER.simplify(tirx.floordiv(bh, b)))
    if h is None or h <= 1 or as_int(d) is None:
        return None
    return h if prove_equal(b * h, bh) and prove_equal(hd, d * h) else None


def _inserts_unit_r_axes(labels, in_shape, out_shape) -> bool:
    """Whether a reshape only inserts the size-1 axes that a broadcast then grows into the repeat
    factor (labelled "R"): the input is the output without them."""
    kept = [n for lab, n in zip(labels, out_shape) if not (lab == "R" and as_int(n) == 1)]
    return len(kept) == len(in_shape) < len(out_shape) and all(prove_equal(a, b) for a, b in zip(kept, in_shape))


def _unreshape(labels, in_shape, out_shape):
    """Labels of a reshape's input, when it only splits/merges labelled axes we understand."""
    # merge: (B, H, a, b) -> (B*H, a, b)
    if len(in_shape) == len(out_shape) + 1 and labels[0] == "BH":
        if prove_equal(in_shape[0] * in_shape[1], out_shape[0]) and all(
            prove_equal(x, y) for x, y in zip(in_shape[2:], out_shape[1:])
        ):
            return ["B", "H"] + list(labels[1:])
    # merge of a grouped view: (B, H0, H1, a, b) -> (B*H0*H1, a, b), heads h = h0 * H1 + h1
    if len(in_shape) == len(out_shape) + 2 and labels[0] == "BH":
        if prove_equal(in_shape[0] * in_shape[1] * in_shape[2], out_shape[0]) and all(
            prove_equal(x, y) for x, y in zip(in_shape[3:], out_shape[1:])
        ):
            return ["B", "H0", "H1"] + list(labels[1:])
    # the grouped view itself: (.., H0, H1, ..) <- (.., H, ..), the query's (B, H, S, D) -> (B, Hkv, G, S, D)
    if len(in_shape) + 1 == len(out_shape) and "H0" in labels:
        p = labels.index("H0")
        if p + 1 < len(labels) and labels[p + 1] == "H1" and all(
            prove_equal(x, y) for x, y in zip(in_shape[:p], out_shape[:p])
        ) and all(prove_equal(x, y) for x, y in zip(in_shape[p + 1:], out_shape[p + 2:])) and prove_equal(
            out_shape[p] * out_shape[p + 1], in_shape[p]
        ):
            return list(labels[:p]) + ["H"] + list(labels[p + 2:])
    # split of the head axis: (.., H, ..) <- (.., Hkv, R, ..)  (HF repeat_kv)
    if len(in_shape) == len(out_shape) + 1 and "H" in labels:
        p = labels.index("H")
        if all(prove_equal(x, y) for x, y in zip(in_shape[:p], out_shape[:p])) and all(
            prove_equal(x, y) for x, y in zip(in_shape[p + 2:], out_shape[p + 1:])
        ) and prove_equal(in_shape[p] * in_shape[p + 1], out_shape[p]):
            return list(labels[:p]) + ["H0", "H1"] + list(labels[p + 1:])
    # merged batch*head on the output side: (B*H, a, b) <- (B, H, a, b) handled above; the reverse
    # (a 4-D view of a 3-D batched matmul): (B, H, a, b) <- (B*H, a, b)
    if len(in_shape) + 1 == len(out_shape) and labels[:2] == ["B", "H"]:
        if prove_equal(out_shape[0] * out_shape[1], in_shape[0]) and all(
            prove_equal(x, y) for x, y in zip(in_shape[1:], out_shape[2:])
        ):
            return ["BH"] + list(labels[2:])
    return _merge_with_unit_axes(labels, in_shape, out_shape)


def _merge_with_unit_axes(labels, in_shape, out_shape):
    """Labels of a 4-D input merged to a (B*H, x, y) output when size-1 axes stand between the merged
    ones: a decode query (B, 1, H, D) of a BSNH graph reshaped to (B*H, 1, D) by torch's einsum. Each
    order of (B, H, x, y) on the input is tried, the plain (B, H, x, y) first; one fits when the sizes
    agree and the axes longer than 1 keep their order, so that the reshape moves no element."""
    if len(in_shape) != len(out_shape) + 1 or labels[0] != "BH" or len(labels) != 3:
        return None
    wanted = ["B", "H"] + list(labels[1:])
    for order in itertools.permutations(wanted):
        size = dict(zip(order, in_shape))
        if not (prove_equal(size["B"] * size["H"], out_shape[0])
                and all(prove_equal(size[lab], n) for lab, n in zip(labels[1:], out_shape[1:]))):
            continue
        long = [lab for lab in wanted if as_int(size[lab]) != 1]
        if [lab for lab in order if as_int(size[lab]) != 1] == long:
            return list(order)
    return None


def _unbroadcast(labels, in_shape, out_shape):
    grown = [i for i, (a, b) in enumerate(zip(in_shape, out_shape)) if not prove_equal(a, b)]
    if len(grown) != 1 or as_int(in_shape[grown[0]]) != 1:
        return None, None
    axis = grown[0]
    if labels[axis] in ("H0", "H1"):  # the broadcast half of a split head axis is the repeat factor
        inner = labels[axis] == "H1"
        renamed = {"H0": "Hkv", "H1": "R"} if inner else {"H0": "R", "H1": "Hkv"}
        return [renamed.get(lab, lab) for lab in labels], "broadcast-r" if inner else "broadcast-r-outer"
    if labels[axis] == "H":  # MQA: a single K/V head broadcast to all query heads
        new = list(labels)
        new[axis] = "Hkv"
        return new, BROADCAST
    return None, None


# what each label means, for the reasons the user reads
_AXIS_NAMES = {"B": "batch", "H": "heads", "Hkv": "K/V heads", "S": "sequence", "D": "head dim",
               "BH": "batch*heads", "HD": "heads*head dim", "H0": "heads' outer factor", "H1": "heads' inner factor",
               "R": "repeat factor"}


def describe_axes(labels) -> str:
    """``labels`` in words: ``(batch*heads, head dim, sequence)``."""
    return "(" + ", ".join(_AXIS_NAMES.get(lab, str(lab)) for lab in labels) + ")"


def describe_stop(t: Traced) -> str:
    """Where the trace of ``t`` stopped, in words: the op that made its source (``R.reshape of a (1, 2, 4,
    32, 16) tensor to (8, 32, 16)``), or that the source is a parameter / a value the analysis does not pass."""
    name = op_name(t.stop_op)
    if not name:
        return "a parameter of the function" if t.from_param else "a value the analysis does not look into"
    text = name.replace("relax.", "R.")
    arg = t.stop_op.args[0] if len(t.stop_op.args) else None
    src = shape_of(arg) if isinstance(getattr(arg, "ty", None), relax.TensorType) else None
    out = shape_of(t.source)
    if src is not None and out is not None:
        text += f" of a {_shape_text(src)} tensor to {_shape_text(out)}"
    if t.kept_expansion:
        text += ", part of a K/V expansion that stays in the graph here"
    return text


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(as_int(n)) if as_int(n) is not None else str(n) for n in shape) + ")"
