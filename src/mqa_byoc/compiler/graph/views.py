"""Chains of view ops around attention matmuls, collapsed to the transpose and reshape they amount to.

``torch.einsum`` reaches Relax as torch's decomposition: every operand of its batched matmul gets
``expand_dims`` / ``permute_dims`` / ``reshape`` steps that move size-1 axes about (``einsum("bhqd,bhkd->bhqk",
q, k)`` at batch 1: q (B, H, S, D) -> (B, H, S, D, 1) -> (B, H, S, 1, D) -> (H, S, D, B, 1) -> (B*H, S, D)),
and its result takes as many back. Each chain only moves data; what it moves is a plain reshape, or a
transpose and a reshape, of its source. :class:`CollapseViewChains` finds that equivalent by following
which source axes each axis holds (:func:`collapsed_view`) and binds it in the chain's place, so that the
analysis meets the forms it reads (:mod:`.trace`). Only chains that start at or feed a matmul or a
softmax and move size-1 axes about (an ``expand_dims`` or ``squeeze`` in them, or more size-1 axes on
the way than at their ends) are touched (the chains of
upstream's and HF's forms are left as the analysis and the output folding read them), only when the
result has fewer ops, and only with an exact match.

Einsums that share K/V between query heads without a head axis of their own (PaLM-style multi-query
``"bhid,bjd->bhij"``, grouped ``"bkgqd,bksd->bkgqs"``) fold the heads (or groups) into the rows of a 3-D
matmul: Q (B, H, S, D) read as (B, H*S, D) against K (B, D, S_kv), the scores unfolded to (B, H, S, S_kv)
right after. :class:`UnfoldMatmulRows` writes such a matmul as the broadcast matmul it is (Q against K
with a unit head axis: the K/V sharing the analysis reads in R.nn.attention's terms).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from mqa_byoc.compiler.graph.exprs import binding_readers, binding_values, op_name, tensor_dims
from mqa_byoc.compiler.graph.planned import PlannedMutator, rewrite_planned
from mqa_byoc.compiler.graph.trace import dims_equal

__all__ = ["CollapseViewChains", "UnfoldMatmulRows", "collapsed_view"]

VIEW_OPS = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze"})
# where a chain has to start or end to be collapsed: the ops of attention and GEMM sites
_ANCHORS = frozenset({"relax.matmul", "relax.nn.softmax"})
# K/V expansions: a chain feeding one is the head split the expansion analysis reads, left alone
_EXPANSIONS = frozenset({"relax.broadcast_to", "relax.repeat", "relax.tile"})


def _is_unit(dim) -> bool:
    return isinstance(dim, tirx.IntImm) and int(dim) == 1


def _quotient(a, b):
    """``a / b`` when ``b`` provably divides ``a``, else None."""
    from tvm.sym import Analyzer

    from mqa_byoc.compiler.graph.trace import prove_equal

    q = Analyzer().simplify(tirx.floordiv(a, b))
    return q if prove_equal(q * b, a) else None


def _regroup(axes, dims):
    """The axes (lists of atoms ``(source axis, size, part)``) after a reshape to ``dims``; an atom a
    new axis takes only the outer part of is split in two (``part`` + (0,) and + (1,)); None when
    the sizes do not divide."""
    from mqa_byoc.compiler.graph.trace import prove_equal

    atoms = [a for axis in axes for a in axis]
    out = []
    for dim in dims:
        group, size = [], 1
        while not _is_unit(dim) and not (group and prove_equal(size, dim)):
            need = _quotient(dim, size)
            if not atoms or need is None:
                return None
            axis, n, part = atoms.pop(0)
            rest = None if prove_equal(n, need) else _quotient(n, need)
            if rest is not None:  # the new axis takes the outer ``need`` of this atom
                atoms.insert(0, (axis, rest, part + (1,)))
                n, part = need, part + (0,)
            group.append((axis, n, part))
            size = size * n
        out.append(group)
    return out if not atoms else None


def collapsed_view(source, steps):
    """The plain equivalent of the view ``steps`` (calls, innermost first) applied to ``source``: the
    ``axes`` with which the chain equals ``reshape(permute_dims(source, axes), out_shape)`` (None: the
    identity), or ``False`` when the chain splits an axis of ``source`` or is no view we follow.

    Each axis is followed as the list of atoms (source axes, or parts of one a reshape split) it holds,
    in row-major order; size-1 axes hold none. The elements end in the order of the atoms: when the
    parts of each source axis stay together and in order, that is a permutation of the source's axes
    (its size-1 axes kept where they were)."""
    src = tensor_dims(source)
    if src is None:
        return False
    axes = [[] if _is_unit(d) else [(i, d, ())] for i, d in enumerate(src)]
    for call in steps:
        name = op_name(call)
        if name == "relax.permute_dims":
            order = range(len(axes))[::-1] if call.attrs.axes is None else [int(a) for a in call.attrs.axes]
            axes = [axes[a] for a in order]
        elif name == "relax.expand_dims":
            ndim = len(axes) + len(call.attrs.axis)
            for a in sorted(int(a) % ndim for a in call.attrs.axis):
                axes.insert(a, [])
        elif name == "relax.squeeze":
            drop = ({i for i, axis in enumerate(axes) if not axis} if call.attrs.axis is None
                    else {int(a) % len(axes) for a in call.attrs.axis})
            if any(axes[i] for i in drop):
                return False
            axes = [axis for i, axis in enumerate(axes) if i not in drop]
        elif name == "relax.reshape" and tensor_dims(call) is not None:
            axes = _regroup(axes, tensor_dims(call))
            if axes is None:
                return False
        else:
            return False
    atoms = [(i, part) for axis in axes for i, _, part in axis]
    order = [i for n, (i, _) in enumerate(atoms) if n == 0 or atoms[n - 1][0] != i]
    if len(order) != len(set(order)) or any(
            [p for j, p in atoms if j == i] != sorted(p for j, p in atoms if j == i) for i in order):
        return False  # the parts of a source axis were separated or reordered: no transpose of the source
    order = iter(order)
    perm = [i if _is_unit(d) else next(order) for i, d in enumerate(src)]
    return None if perm == list(range(len(src))) else perm


def _chains(func):
    """{last var of a view chain: (source, [calls innermost first], [vars])} for the chains that start
    at or feed a matmul or a softmax."""
    values, users = binding_values(func), binding_readers(func)

    def user_ops(var):  # the ops reading ``var``, through casts (ToMixedPrecision's astype)
        out = []
        for user in users.get(var, []):
            name = op_name(values.get(user)) if user is not None else None
            out += user_ops(user) if name == "relax.astype" else [name]
        return out

    def producer_op(expr):
        while op_name(values.get(expr)) == "relax.astype":
            expr = values[expr].args[0]
        return op_name(values.get(expr))
    chains = {}
    for var, value in values.items():
        if op_name(value) not in VIEW_OPS:
            continue
        if any(op_name(values.get(u)) in VIEW_OPS for u in users.get(var, []) if u is not None):
            continue  # not the end of its chain
        steps, names = [], []
        expr = var
        while op_name(values.get(expr)) in VIEW_OPS:
            steps.append(values[expr])
            names.append(expr)
            expr = values[expr].args[0]
        if op_name(steps[-1]) == "relax.reshape" and len(steps) > 1 and producer_op(expr) not in _ANCHORS:
            # a chain's first reshape is kept: it is the graph's own (HF's repeat_kv merge, a head split),
            # which the analysis reads as it is; only the data movement after it is collapsed
            expr = names.pop()
            steps.pop()
        starts = producer_op(expr) in _ANCHORS
        feeds = any(u in _ANCHORS for u in user_ops(var))
        if any(u in _EXPANSIONS for u in user_ops(var)):
            continue  # K/V's head split before an expansion (HF's repeat_kv): the analysis reads it as it is
        if len(steps) >= 2 and (starts or feeds):
            chains[var] = (expr, steps[::-1], names[::-1])
    return chains


@mutator
class _Collapse(PlannedMutator):
    def rebind(self, binding, plan):
        source, axes = plan
        x = self.visit_expr(source)
        out = tensor_dims(binding.var)
        if axes is not None:
            x = relax.op.permute_dims(x, axes)
            if not dims_equal(tensor_dims(self.builder_.normalize(x)), out):
                x = relax.op.reshape(self.builder_.emit(x), out)
        else:
            x = relax.op.reshape(x, out)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(x)))


def _units(expr) -> int:
    return sum(_is_unit(d) for d in (tensor_dims(expr) or []))


def _plan(source, steps):
    """(source, axes) the chain ``steps`` from ``source`` collapses to, or None (:func:`_plans`)."""
    inserts = any(op_name(step) in ("relax.expand_dims", "relax.squeeze") for step in steps)
    if not inserts and max(_units(step) for step in steps[:-1]) <= max(_units(source), _units(steps[-1])):
        return None  # no size-1 axes moved about: a chain the analysis reads as it is (a head merge, a transpose)
    axes = collapsed_view(source, steps)
    if axes is False or (axes is not None) + 1 >= len(steps):
        return None  # not a plain view, or no shorter
    return source, axes


def _plans(func) -> dict:
    plans = {}
    for var, (source, steps, names) in _chains(func).items():
        # the whole chain, else its longest part that collapses: without the graph's own leading steps (a
        # projection's output split into heads by a reshape and a transpose, then moved about by an einsum:
        # no single transpose of the projection's output, but one of its head split) or trailing ones (the
        # heads merged back after the einsum's own steps)
        for n, start in ((n, start) for n in range(len(steps), 1, -1) for start in range(len(steps) - n + 1)):
            plan = _plan(source if start == 0 else names[start - 1], steps[start:start + n])
            if plan is not None:
                plans[names[start + n - 1]] = plan
                break
    return plans


@tvm.transform.module_pass(opt_level=0, name="CollapseViewChains")
class CollapseViewChains:
    """Module pass: each chain of view ops (reshape, permute_dims, expand_dims, squeeze) that starts at or
    feeds a matmul or a softmax becomes the reshape / transpose-reshape it is equal to, when
    that is shorter (module doc); the module unchanged when there is none."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_planned(mod, _plans, _Collapse)


def _row_split(x_dims, a_dims):
    """(dims, k): ``x_dims`` reshaped to ``a_dims`` (N, M, D) merges dims[:k] into N and dims[k:-1] into M
    (the rows dims[-2] and at least one other axis not of size 1 folded into them), keeping the last
    axis. ``dims`` is ``x_dims``, or ``x_dims`` with the one axis split that N and M share (the heads of
    a head split when N holds the K/V heads and M the groups); None when there is none."""
    from mqa_byoc.compiler.graph.trace import product, prove_equal

    if x_dims is None or a_dims is None or len(a_dims) != 3 or len(x_dims) < 3:
        return None
    if not prove_equal(x_dims[-1], a_dims[2]):
        return None
    candidates = []
    for k in range(len(x_dims) - 1):
        if k >= 1:
            candidates.append((list(x_dims), k))
        outer = _quotient(a_dims[0], product(x_dims[:k]))  # the part of axis k that N takes
        inner = None if outer is None else _quotient(x_dims[k], outer)
        if inner is not None and not _is_unit(outer) and not _is_unit(inner):
            candidates.append((list(x_dims[:k]) + [outer, inner] + list(x_dims[k + 1:]), k + 1))
    for dims, k in candidates:
        if len(dims) < 4 or all(_is_unit(d) for d in dims[k:-2]):
            continue  # size-1 axes before the rows: nothing folded into them
        if prove_equal(product(dims[:k]), a_dims[0]) and prove_equal(product(dims[k:-1]), a_dims[1]):
            return dims, k
    return None


def _unfold_plans(func) -> dict:
    """{var of the reshape unfolding a folded matmul's result: (X, X's dims as unfolded, the cast of the
    folded operand, B, k, out_dtype)} (module doc)."""
    from mqa_byoc.compiler.graph.trace import prove_equal

    values, users = binding_values(func), binding_readers(func)
    plans = {}
    for var, value in values.items():
        if op_name(value) != "relax.matmul":
            continue
        a, b = value.args
        a_cast, a = _through_cast(a, values)
        if op_name(values.get(a)) != "relax.reshape" or len(tensor_dims(b) or []) != 3:
            continue
        x = values[a].args[0]
        x_dims, a_dims, b_dims = tensor_dims(x), tensor_dims(a), tensor_dims(b)
        split = _row_split(x_dims, a_dims)
        if split is None or not prove_equal(b_dims[0], a_dims[0]) or not prove_equal(b_dims[1], a_dims[2]):
            continue
        x_dims, k = split
        readers = users.get(var, [])
        if not readers or any(u is None or op_name(values.get(u)) != "relax.reshape"
                              or len(tensor_dims(u) or []) < 4 for u in readers):
            continue  # the folded result is read as it is somewhere: left alone
        if not (_softmax_near(x, values, users, back=True)
                or any(_softmax_near(u, values, users, back=False) for u in readers)):
            continue  # not an attention matmul (its scores or probabilities): GEMMs are left as they are
        for u in readers:
            plans[u] = (x, x_dims, a_cast, b, k, value.attrs.out_dtype)
    return plans


def _through_cast(expr, values):
    """(the dtype ``expr`` is cast to or None, what is cast): ToMixedPrecision's astype before a matmul."""
    value = values.get(expr)
    if op_name(value) == "relax.astype":
        return value.attrs.dtype, value.args[0]
    return None, expr


def _softmax_near(var, values, users, back, steps=8):
    """Is a softmax within ``steps`` single-input ops before (``back``) or after ``var``: the scores an
    attention's mask, scale and casts lead to a softmax, its probabilities come from one."""
    frontier = [var]
    for _ in range(steps):
        nxt = []
        for v in frontier:
            if back:
                value = values.get(v)
                if op_name(value) == "relax.nn.softmax":
                    return True
                if value is not None and isinstance(value, relax.Call) and value.args:
                    nxt.append(value.args[0])
            else:
                for u in users.get(v, []):
                    if u is None:
                        continue
                    if op_name(values.get(u)) == "relax.nn.softmax":
                        return True
                    nxt.append(u)
        frontier = nxt
    return False


@mutator
class _Unfold(PlannedMutator):
    def __init__(self, mod, plans, values):
        super().__init__(mod, plans)
        self.values = values

    def _shared(self, b, lead, rows):
        """B (N, D, C) as lead + [1] * (rows - 1) + [D, C]: the unit axes broadcast over the folded rows
        (a cast of B stays last). Reshapes, which the VM makes views (expand_dims would copy), of what B
        was reshaped from, and under the transpose where B is K^T."""
        cast, inner = _through_cast(b, self.values)
        if cast is not None:
            return relax.op.astype(self.builder_.emit(self._shared(inner, lead, rows)), cast)
        d, c = tensor_dims(b)[1:]
        while op_name(self.values.get(b)) == "relax.reshape":
            b = self.values[b].args[0]
        src = self.values.get(b)
        n = len(tensor_dims(b) or [])
        if op_name(src) == "relax.permute_dims" and n >= 3 and \
                [int(a) for a in src.attrs.axes] == list(range(n - 2)) + [n - 1, n - 2]:
            # K^T: the unit axes go onto K, then the transpose (K read as (lead..., 1, S, D))
            kv = relax.op.reshape(self.visit_expr(src.args[0]), lead + [1] * (rows - 1) + [c, d])
            m = len(lead) + rows + 1
            return relax.op.permute_dims(self.builder_.emit(kv), list(range(m - 2)) + [m - 1, m - 2])
        return relax.op.reshape(self.visit_expr(b), lead + [1] * (rows - 1) + [d, c])

    def rebind(self, binding, plan):
        x, x_dims, cast, b, k, out_dtype = plan
        shared = self.builder_.emit(self._shared(b, x_dims[:k], len(x_dims) - 1 - k))
        lhs = self.visit_expr(x)
        if not dims_equal(tensor_dims(x), x_dims):  # an axis N and M share, split
            lhs = self.builder_.emit(relax.op.reshape(lhs, x_dims))
        if cast is not None:
            lhs = self.builder_.emit(relax.op.astype(lhs, cast))
        y = relax.op.matmul(lhs, shared, out_dtype=out_dtype)
        out = tensor_dims(binding.var)  # the reader's reshape: of the unfolded result as of the folded one
        if not dims_equal(x_dims[:-1] + [tensor_dims(b)[2]], out):
            y = relax.op.reshape(self.builder_.emit(y), out)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(y)))


@tvm.transform.module_pass(opt_level=0, name="UnfoldMatmulRows")
class UnfoldMatmulRows:
    """Module pass: a 3-D matmul whose left operand folds several axes of a tensor X (heads and queries)
    into its rows, against a right operand (N, D, C) with one matrix per leading index, whose result
    is only read unfolded to X's axes, becomes the broadcast matmul of X against the right operand with
    unit axes over the folded ones (module doc); the module unchanged when there is none."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        values = {}  # the bindings of the functions with a plan: B's reshapes and transpose are read through

        def plans_of(func):
            found = _unfold_plans(func)
            if found:
                values.update(binding_values(func))
            return found

        return rewrite_planned(mod, plans_of, lambda m, plans: _Unfold(m, plans, values))
