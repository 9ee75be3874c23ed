"""Reading an offloaded attention off its ``Codegen="flash_attn"`` function.

:func:`find_site` reads the one ``flash_attn.*`` composite call of a function into a
:class:`CodegenSite` (symbol, :class:`~mqa_byoc.compiler.graph.spec.AttentionSpec`, the operand to
parameter map); :func:`composite_call` is the structural check both forms share (the var-len
reader, :mod:`.varlen`, uses it too); :func:`composite_name_of` names the composite without checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tvm import relax

from mqa_byoc.contract import COMPOSITES, FUNCTION_COMPOSITES, composite_name

from mqa_byoc.compiler.graph.exprs import get_attr
from mqa_byoc.compiler.graph.sink_attention import read_sink_composite
from mqa_byoc.compiler.graph.spec import AttentionSpec, read_composite

__all__ = ["CodegenError", "CodegenSite", "composite_call", "composite_name_of", "find_site", "read_spec"]


class CodegenError(ValueError):
    """A ``flash_attn`` function the codegen cannot turn into a kernel call."""



def composite_name_of(func) -> str | None:
    """The ``Composite`` name of ``func`` itself, or of the first local composite it calls; None
    when it has none (no structural checks: :func:`composite_call` makes them)."""
    if not isinstance(func, relax.Function):
        return None
    if get_attr(func.attrs, "Composite") is not None:
        return str(func.attrs["Composite"])
    bindings = [b for block in func.body.blocks for b in block.bindings]
    local = {b.var: b.value for b in bindings if isinstance(b.value, relax.Function)}
    for b in bindings:
        if isinstance(b.value, relax.Call):
            callee = local.get(b.value.op, b.value.op)
            if isinstance(callee, relax.Function) and get_attr(callee.attrs, "Composite") is not None:
                return str(callee.attrs["Composite"])
    return None


@dataclass(frozen=True)
class CodegenSite:
    """One offloaded attention, read once off its ``Codegen`` function and composite."""

    symbol: str
    composite: relax.Function
    composite_name: str
    spec: AttentionSpec
    # attention operand i (q, k, v) is the Codegen function's parameter arg_map[i]
    arg_map: tuple[int, ...]
    num_inputs: int
    # parameters of type R.Shape: FuseOpsByPattern adds ``tir_vars`` when a length is an expression
    # (S_kv = past_len + 1) so that the function can define past_len; the kernels read lengths from
    # the tensors and ignore it
    shape_params: tuple[int, ...] = ()


def find_site(func: relax.Function) -> CodegenSite:
    """Read the single ``flash_attn.*`` composite call inside a ``Codegen`` function.

    Returns
    -------
    CodegenSite
        The exported symbol, the composite and its :class:`AttentionSpec`, and how the function's
        parameters map to q, k, v.

    Raises
    ------
    CodegenError
        When the function is not one composite call on its parameters that FA2 can compute.
    """
    if not isinstance(func, relax.Function):
        raise CodegenError(f"flash_attn codegen: expected a relax.Function, got {type(func).__name__}")
    attrs = func.attrs
    symbol = get_attr(attrs, "global_symbol")
    if symbol is None:
        raise CodegenError(f"flash_attn codegen: function has no global_symbol attribute:\n{func}")
    symbol = str(symbol)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", symbol):
        raise CodegenError(f"flash_attn codegen: global_symbol {symbol!r} is not a C identifier")
    if get_attr(attrs, "Composite") is not None:
        # a Codegen function that is itself the composite (no wrapper)
        name, composite, outer = str(attrs["Composite"]), func, list(range(len(func.params)))
    else:
        name, composite, outer = composite_call(func, symbol)
    if name not in COMPOSITES:
        raise CodegenError(f"flash_attn codegen ({symbol}): unknown composite {name!r}; expected one of {COMPOSITES}")
    if name in FUNCTION_COMPOSITES:
        try:
            spec, operand_params = read_sink_composite(composite)
        except (ValueError, TypeError, AttributeError) as err:
            raise CodegenError(f"flash_attn codegen ({symbol}): cannot read the attention parameters: {err}") from err
    else:
        spec, operand_params = read_spec(composite, symbol)
    want = composite_name(spec.num_q_heads, spec.num_kv_heads, sinks=spec.sinks_dtype is not None,
                          softcap=spec.softcap > 0)
    if name != want:
        raise CodegenError(
            f"flash_attn codegen ({symbol}): composite {name} but the heads are "
            f"{spec.num_q_heads} (q) / {spec.num_kv_heads} (k/v); expected {want}"
        )
    arg_map = tuple(outer[j] for j in operand_params)
    shape_params = tuple(i for i, p in enumerate(func.params) if isinstance(p.ty, relax.ShapeType))
    return CodegenSite(symbol, composite, name, spec, arg_map, len(func.params), shape_params)


def composite_call(func: relax.Function, symbol: str, error: type[CodegenError] = CodegenError):
    """(composite name, composite, outer) of the one local composite call that is the whole body of
    the ``Codegen`` function ``func``: composite parameter j is function parameter outer[j]. Anything
    else raises ``error`` naming ``symbol``."""
    body = func.body
    bindings = [b for block in body.blocks for b in block.bindings]
    local_funcs = {b.var: b.value for b in bindings if isinstance(b.value, relax.Function)}
    calls = []
    for b in bindings:
        value = b.value
        if isinstance(value, relax.Function):
            continue
        if isinstance(value, relax.Call):
            callee = local_funcs.get(value.op, value.op)
            if isinstance(callee, relax.Function) and get_attr(callee.attrs, "Composite") is not None:
                calls.append((b.var, value, callee))
                continue
            if isinstance(value.op, relax.GlobalVar):
                raise error(
                    f"flash_attn codegen ({symbol}): the composite is a global function "
                    f"({value.op.name_hint}); partition with annotate_codegen=True so it is local"
                )
        raise error(
            f"flash_attn codegen ({symbol}): the function must hold exactly one composite call "
            f"and nothing else; found the binding `{b.var.name_hint} = {value}`"
        )
    if len(calls) != 1:
        raise error(
            f"flash_attn codegen ({symbol}): expected one flash_attn.* composite call, found {len(calls)}"
        )
    var, call, composite = calls[0]
    if not (isinstance(body.body, relax.Var) and body.body.same_as(var)):
        raise error(f"flash_attn codegen ({symbol}): the function must return the composite's result")
    params = list(func.params)
    outer = []
    for j, arg in enumerate(call.args):
        idx = next((i for i, p in enumerate(params) if p.same_as(arg)), None)
        if idx is None:
            raise error(
                f"flash_attn codegen ({symbol}): composite argument {j} is `{arg}`, not a parameter of "
                "the function (constants and computed operands are not supported)"
            )
        outer.append(idx)
    return str(composite.attrs["Composite"]), composite, outer


def read_spec(composite: relax.Function, where: str):
    try:
        return read_composite(composite)
    except (ValueError, TypeError, AttributeError) as err:
        raise CodegenError(f"flash_attn codegen ({where}): cannot read the attention parameters: {err}") from err
