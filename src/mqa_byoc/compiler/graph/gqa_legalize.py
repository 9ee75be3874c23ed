"""Make TVM's stock lowering of grouped-query attention correct.

``R.nn.attention`` accepts K/V with fewer heads than Q (its type inference allows it), but the
stock legalization (``relax/transform/legalize_ops/nn.py::_te_attention``) reshapes K/V from
``(B, H_kv, S_kv, D)`` to ``(B * H, S_kv, D)`` as if they had ``H`` heads. The reshape's index
arithmetic wraps around, so query head ``h`` of batch ``b`` reads K/V head ``(b * H + h) % H_kv``
(``h % H_kv`` for B = 1) instead of the grouping every framework uses (FA2, PyTorch, HF,
``R.repeat``): ``h // (H / H_kv)``. The result is silently wrong.

:class:`LegalizeGroupedAttention` rewrites each such call that TVM itself would lower into

    R.nn.attention(q, R.repeat(k, r, axis=2), R.repeat(v, r, axis=2), <same attributes>)

with ``r = H / H_kv``; repeating along the head axis of BSNH gives K/V head ``h // r`` to query
head ``h``, so the stock legalization then computes the right thing. Calls inside functions that
are offloaded (attribute ``Codegen``) or that are composites (attribute ``Composite``) are left
alone: the FA2 codegen consumes K/V with their native head count.

Run it before ``relax.build`` / ``LegalizeOps`` on any module that may still contain grouped
``R.nn.attention`` calls. The pass is idempotent and returns functions without grouped
attention unchanged (the same objects).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor

from mqa_byoc.compiler.graph.exprs import is_offloaded, op_name

__all__ = ["LegalizeGroupedAttention", "legalize_grouped_attention", "GroupedAttentionError"]

# ``R.nn.attention`` with a bias argument is a separate op in TVM 0.27 (same attributes, the bias
# is the 4th argument, broadcastable to (B, H, S_q, S_kv): it does not depend on the K/V heads).
_ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias")
# the fill of masked scores in a window bias: the float16 minimum, representable in every float type
_MASKED_FILL = -65504.0


class GroupedAttentionError(ValueError):
    """A grouped attention whose head counts cannot be grouped (H % H_kv != 0, or not static)."""


def _attention_op_name(call) -> str | None:
    name = op_name(call)
    return name if name in _ATTENTION_OPS else None


def _heads(expr, what: str):
    """The head axis (axis 2 of BSNH) of a 4-D tensor argument, as a PrimExpr."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
        raise GroupedAttentionError(
            f"R.nn.attention: the {what} argument has no known 4-D shape ({ty}); "
            "LegalizeGroupedAttention needs static head counts to tell grouped attention apart"
        )
    values = list(ty.shape.values)
    if len(values) != 4:
        raise GroupedAttentionError(f"R.nn.attention: {what} must be 4-D BSNH, got shape {values}")
    return values[2]


def _provably_equal(a, b) -> bool:
    if a.same_as(b):
        return True
    from tvm.sym import Analyzer

    return bool(Analyzer().can_prove_equal(a, b))


def _group_size(call) -> int:
    """``H / H_kv`` of an attention call: 1 for plain multi-head attention."""
    q, k, v = call.args[:3]
    hq, hk, hv = _heads(q, "query"), _heads(k, "key"), _heads(v, "value")
    if _provably_equal(hq, hk) and _provably_equal(hq, hv):
        return 1
    static = [isinstance(x, tvm.tirx.IntImm) for x in (hq, hk, hv)]
    if not all(static):
        raise GroupedAttentionError(
            f"R.nn.attention: query/key/value heads {hq}/{hk}/{hv} differ and are not all static; "
            "cannot tell how query heads group onto K/V heads"
        )
    hq, hk, hv = int(hq), int(hk), int(hv)
    if hk != hv:
        raise GroupedAttentionError(f"R.nn.attention: key has {hk} heads but value has {hv}")
    if hk <= 0 or hq % hk != 0:
        raise GroupedAttentionError(
            f"R.nn.attention: {hq} query heads cannot be grouped onto {hk} K/V heads "
            f"(H % H_kv = {hq % hk if hk > 0 else 'undefined'}, must be 0)"
        )
    if hk > hq:
        raise GroupedAttentionError(f"R.nn.attention: K/V have more heads ({hk}) than the query ({hq})")
    return hq // hk


@visitor
class _FindGrouped(PyExprVisitor):
    """Is there a grouped attention outside offloaded/composite functions?"""

    def __init__(self):
        self.found = False

    def visit_function_(self, op: relax.Function) -> None:
        if not is_offloaded(op):
            super().visit_function_(op)

    def visit_call_(self, op: relax.Call) -> None:
        if _attention_op_name(op) is not None and (_group_size(op) > 1 or _half_with_scale(op)
                                                     or op.attrs.window_size is not None):
            self.found = True
        super().visit_call_(op)


def _half_with_scale(call) -> bool:
    """TVM 0.27 lowers a float16/bfloat16 attention with an explicit scale through a float32
    multiply: the result is float32 where the graph declares half, and type checking then fails
    downstream. Folding the scale into the query keeps the lowering in half precision."""
    return call.attrs.scale is not None and str(call.args[0].ty.dtype) in ("float16", "bfloat16")


@mutator
class _RepeatKV(PyExprMutator):
    def visit_function_(self, op: relax.Function) -> relax.Expr:
        if is_offloaded(op):
            return op
        return super().visit_function_(op)

    def visit_call_(self, op: relax.Call) -> relax.Expr:
        call = super().visit_call_(op)
        name = _attention_op_name(call)
        if name is None:
            return call
        r = _group_size(call)
        window = None if call.attrs.window_size is None else int(call.attrs.window_size)
        if r == 1 and not _half_with_scale(call) and window is None:
            return call  # multi-head, causal or not: TVM's to lower, as the user wrote it
        q, k, v = call.args[:3]
        if r > 1:
            k = self.builder_.emit(relax.op.repeat(k, r, axis=2), name_hint="k_grouped")
            v = self.builder_.emit(relax.op.repeat(v, r, axis=2), name_hint="v_grouped")
        attrs = call.attrs
        scale = attrs.scale
        if _half_with_scale(call):
            # softmax(q k^T * s) == softmax((q * s * sqrt(D)) k^T / sqrt(D)), TVM's default scale
            d = int(q.ty.shape.values[3])
            factor = relax.const(float(scale.value) * d ** 0.5, str(q.ty.dtype))
            q = self.builder_.emit(relax.op.multiply(q, factor), name_hint="q_scaled")
            scale = None
        bias = call.args[3] if name == "relax.nn.attention_bias" else None
        causal = attrs.causal_mask
        if window is not None or causal is not None:
            # TVM 0.27 cannot lower a window; its causal lowering zeroes the masked scores and takes the
            # row max over those zeros, so a row whose visible scores all lie far below 0 underflows
            # (exp in half precision) to 0 / 0 = NaN: a call rewritten here spells both as a bias
            # and lowers a plain softmax
            window_bias = self._window_bias(q, k, window, causal)
            bias = window_bias if bias is None else self.builder_.emit(relax.op.add(bias, window_bias))
            causal = None
        return relax.op.nn.attention(q, k, v, bias=bias, scale=scale, causal_mask=causal)

    def _window_bias(self, q, k, window: int | None, causal) -> relax.Expr:
        """(1, 1, S_q, S_kv) bias: 0 where query i sees key j, a large negative value elsewhere.

        Bottom-right aligned like FA2 (``TopLeft`` aligns at 0): with ``i' = i + S_kv - S_q`` the
        key j is visible when ``0 <= i' - j < window`` (``window`` None: ``0 <= i' - j``, causal)."""
        emit = self.builder_.emit
        s_q, s_kv = q.ty.shape.values[1], k.ty.shape.values[1]
        first = 0 if causal == "TopLeft" else s_kv - s_q
        rows = emit(relax.op.reshape(relax.op.arange(first, first + s_q, 1, "int64"), [s_q, 1]))
        cols = emit(relax.op.reshape(relax.op.arange(0, s_kv, 1, "int64"), [1, s_kv]))
        dist = emit(relax.op.subtract(rows, cols))
        visible = relax.op.greater_equal(dist, relax.const(0, "int64"))
        if window is not None:
            visible = relax.op.logical_and(visible, relax.op.less(dist, relax.const(window, "int64")))
        visible = emit(visible)
        fill = relax.op.where(visible, relax.const(0.0, "float32"), relax.const(_MASKED_FILL, "float32"))
        bias = emit(relax.op.astype(fill, str(q.ty.dtype)))
        return emit(relax.op.reshape(bias, [1, 1, s_q, s_kv]))


def _rewrite_function(func: relax.Function, mod: tvm.IRModule | None) -> relax.Function:
    if is_offloaded(func):
        return func
    finder = _FindGrouped()
    finder.visit_expr(func)
    if not finder.found:
        return func
    new_func = _RepeatKV(mod).visit_expr(func)
    return new_func


@tvm.transform.module_pass(opt_level=0, name="LegalizeGroupedAttention")
class LegalizeGroupedAttention:
    """Module pass: give grouped ``R.nn.attention`` calls explicitly repeated K/V heads.

    Half-precision calls with an explicit scale get the scale folded into the query (TVM 0.27's
    lowering of those produces float32 where the graph says half; see ``_half_with_scale``). The causal
    masks and windows of the calls it rewrites become a bias (TVM 0.27 lowers no window, and its causal
    lowering divides 0 by 0 on a row whose visible scores all lie far below 0; see ``_window_bias``).
    Multi-head calls without a window or a half-precision scale are left as written, causal or not:
    a site the partition does not offload keeps the user's graph.

    Every ``R.nn.attention`` / ``attention_bias`` call whose K/V have fewer heads than Q, and that is
    not inside a ``Codegen`` or ``Composite`` function, becomes
    ``R.nn.attention(q, R.repeat(k, r, axis=2), R.repeat(v, r, axis=2), <same attributes>)`` with
    ``r = H / H_kv``. Raises :class:`GroupedAttentionError` when ``H % H_kv != 0`` or the head counts
    differ and are not static. Idempotent; functions without grouped attention are kept as they are.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            new_func = _rewrite_function(func, mod)
            if not new_func.same_as(func):
                updates[gvar] = new_func
        if not updates:
            return mod
        new_mod = mod.clone()
        for gvar, func in updates.items():
            new_mod[gvar] = func
        return new_mod


def legalize_grouped_attention(obj):
    """Function form of :class:`LegalizeGroupedAttention`.

    Accepts an ``IRModule`` (returns the rewritten module) or a single ``relax.Function``
    (returns the rewritten function).
    """
    if isinstance(obj, tvm.IRModule):
        return LegalizeGroupedAttention()(obj)
    if isinstance(obj, relax.Function):
        return _rewrite_function(obj, None)
    raise TypeError(f"legalize_grouped_attention expects an IRModule or relax.Function, got {type(obj)}")
