"""Small readers of Relax expressions shared by the analysis, the partition and the codegen."""

from __future__ import annotations

from collections.abc import Mapping

import tvm
from tvm import relax

from mqa_byoc.contract import CODEGEN, SINK_ATTR


def op_name(expr) -> str:
    """The name of the operator ``expr`` calls (``"relax.permute_dims"``), or ``""``.

    Returns
    -------
    str
        The op name for a call of a ``tvm.ir.Op``; ``""`` for anything else.
    """
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else ""


def block_bindings(func: relax.Function):
    """``(block, binding)`` of every binding of ``func``'s body in program order, the bindings of ``R.If``
    branches (nested to any depth) included, before the binding of the ``If`` itself."""

    def walk(seq):
        if not isinstance(seq, relax.SeqExpr):
            return
        for block in seq.blocks:
            for b in block.bindings:
                if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.If):
                    yield from walk(b.value.true_branch)
                    yield from walk(b.value.false_branch)
                yield block, b

    if isinstance(func, relax.Function):
        yield from walk(func.body)


def function_bindings(func: relax.Function) -> list:
    """Every binding of ``func`` (:func:`block_bindings`): a site inside an ``R.If`` branch is analysed and
    partitioned like one at the top level."""
    return [b for _, b in block_bindings(func)]


def function_results(func: relax.Function) -> list:
    """The expressions ``func`` reads besides its bindings' values: the body's result, and each ``R.If``'s
    condition and branch results."""
    out = [func.body.body] if isinstance(func.body, relax.SeqExpr) else [func.body]
    for b in function_bindings(func):
        if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.If):
            out += [b.value.cond] + [br.body for br in (b.value.true_branch, b.value.false_branch)
                                     if isinstance(br, relax.SeqExpr)]
    return out


def tensor_dims(expr):
    """``expr``'s shape as a list of dims when its type is a tensor of known rank, else None."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def binding_values(func: relax.Function) -> dict:
    """``{var: bound value}`` of every ``VarBinding`` in ``func``'s body (:func:`function_bindings`)."""
    return {b.var: b.value for b in function_bindings(func) if isinstance(b, relax.VarBinding)}


def binding_readers(func: relax.Function) -> dict:
    """``{var: the vars of the bindings reading it}`` over ``func``'s bindings (:func:`function_bindings`; an
    ``R.If`` reads through its branches), with None where the function's results read it
    (:func:`function_results`)."""
    readers = {}
    for b in function_bindings(func):
        if isinstance(b.value, relax.If):
            continue
        for var in relax.analysis.free_vars(b.value):
            readers.setdefault(var, []).append(b.var)
    for value in function_results(func):
        for var in relax.analysis.free_vars(value):
            readers.setdefault(var, []).append(None)
    return readers


def dead_once_rebound(func: relax.Function, roots) -> set:
    """The vars of ``func`` that nothing reads once each of ``roots`` is bound to a new value (a kernel's
    call on the operands' sources): the roots and every var all of whose readers are among them. What
    stays out is still computed by the rewritten graph (a function result, or read by something else)."""
    readers = binding_readers(func)
    dead = set(roots)
    for b in reversed(function_bindings(func)):
        users = readers.get(b.var)
        if b.var not in dead and users and all(u is not None and u in dead for u in users):
            dead.add(b.var)
    return dead


def value_of(expr, values: Mapping):
    """Follow ``expr`` through var-to-var bindings in ``values`` to the value it stands for.

    Returns
    -------
    relax.Expr
        The first expression on the chain that is not a var bound in ``values``.
    """
    while isinstance(expr, relax.Var) and expr in values:
        expr = values[expr]
    return expr


def is_offloaded(func) -> bool:
    """True for a function already handed to a backend: it has a ``Codegen`` or ``Composite`` attribute,
    or it is a sink attention's function the canonicalization made (its body is the reference)."""
    attrs = func.attrs
    return attrs is not None and ("Codegen" in attrs or "Composite" in attrs or SINK_ATTR in attrs)


def is_flash_attn_function(func) -> bool:
    """True for a function that ``RunCodegen`` hands to our codegen (``Codegen == CODEGEN``)."""
    attrs = getattr(func, "attrs", None)
    return isinstance(func, relax.Function) and attrs is not None and "Codegen" in attrs \
        and str(attrs["Codegen"]) == CODEGEN


def get_attr(mapping, key):
    """``mapping[key]`` of a function's attributes, a codegen option map or a dict; None when the
    key is missing or the mapping is None."""
    if mapping is None:
        return None
    try:
        return mapping[key] if key in mapping else None
    except Exception:  # noqa: BLE001 - tvm Map / DictAttrs / dict all work with `in`; be lenient
        return None
