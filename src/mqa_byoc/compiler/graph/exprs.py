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


def binding_values(func: relax.Function) -> dict:
    """``{var: bound value}`` of every ``VarBinding`` in ``func``'s body (top-level blocks)."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b, relax.VarBinding)}


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
