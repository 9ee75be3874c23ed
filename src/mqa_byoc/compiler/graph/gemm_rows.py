"""GEMMs on rows flattened from a tensor's leading axes, written on those axes again.

``torch.export`` writes ``nn.Linear`` (and HF's ``Conv1D``, ``torch.addmm`` on ``x.view(-1, K)``) of a
(B, S, K) input as a 2-D product: ``x`` reshaped to (B*S, K), the matmul, the bias added, and the result
reshaped back to (B, S, N), so the op after the linear (an activation, the residual add) reads the
reshape, not the GEMM's result, and no epilogue pattern sees it: the activation and the residual add
stay TVM kernels of their own, after a GEMM that could have computed them. The GEMM sites take an
``x`` of any leading axes (every axis but the last is M), so :class:`UnflattenGemmRows` writes such a
site as the matmul of ``x`` itself: ``reshape(f(R.matmul(reshape(x, (M, K)), w)), (d..., N))``
becomes ``f(R.matmul(x, w))`` when ``x`` is (d..., K) with the same leading axes ``d`` (their product
provably M, static or symbolic), ``w`` is 2-D, and ``f`` is the bias add (an operand that is one row,
broadcast the same way on either shape) and ``astype`` casts (``ToMixedPrecision``'s) of values read
only by the next step. A cast of the flattened ``x`` before the matmul is applied to ``x``. The
elements and their order are the same: a reshape of leading axes moves no data.

The matmul keeps its variable's name, so that the report names the site as the user's graph does.
Every other graph is left as it is.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import mutator

from mqa_byoc.compiler.graph.exprs import binding_readers, binding_values, op_name, tensor_dims
from mqa_byoc.compiler.graph.planned import PlannedMutator, rewrite_planned
from mqa_byoc.compiler.graph.trace import dims_equal, prove_equal

__all__ = ["UnflattenGemmRows", "flattened_gemm_plans"]


def _one_row(expr, n) -> bool:
    """``expr`` is a row of ``n`` (rank 1, or every axis but the last of size 1): a bias broadcast alike over
    (M, N) and (d..., N)."""
    dims = tensor_dims(expr)
    return bool(dims) and prove_equal(dims[-1], n) and all(isinstance(d, tirx.IntImm) and int(d) == 1
                                                            for d in dims[:-1])


def _product(dims):
    out = dims[0]
    for d in dims[1:]:
        out = out * d
    return out


def _epilogue_step(var, value, n, values):
    """(the operand that continues the walk back to the matmul, how to write the step again) for an
    ``astype`` or a bias add after the flattened GEMM (``var`` bound to ``value``), else None."""
    name = op_name(value)
    if name == "relax.astype":
        return value.args[0], ("astype", value.attrs.dtype)
    if name == "relax.add":
        a, b = value.args
        for i, (inner, other) in enumerate(((a, b), (b, a))):
            # the add keeps the (M, N) shape: a row of more axes than that broadcasts the result to more
            if isinstance(inner, relax.Var) and inner in values and _one_row(other, n) and \
                    dims_equal(tensor_dims(var), tensor_dims(inner)) and \
                    op_name(values[inner]) in ("relax.matmul", "relax.astype", "relax.add"):
                return inner, ("add", other, i)
    return None


def flattened_gemm_plans(func: relax.Function) -> dict:
    """``{the reshape back's var: (x, casts of x, the matmul's var, its call, the steps after it)}`` for every
    site of ``func`` that :class:`UnflattenGemmRows` rewrites (module doc)."""
    values, readers = binding_values(func), binding_readers(func)
    plans = {}
    for var, value in values.items():
        if op_name(value) != "relax.reshape":
            continue
        out = tensor_dims(var)
        if not out or len(out) < 3:
            continue
        steps, reader, cur = [], var, value.args[0]
        while isinstance(cur, relax.Var) and cur in values and readers.get(cur) == [reader]:
            if op_name(values[cur]) == "relax.matmul":
                break
            step = _epilogue_step(cur, values[cur], out[-1], values)
            if step is None:
                cur = None
                break
            steps.append((cur, step[1]))
            reader, cur = cur, step[0]
        else:
            continue
        if cur is None:
            continue
        call = values[cur]
        lhs, rhs = call.args
        lhs_dims, rhs_dims, mm_dims = tensor_dims(lhs), tensor_dims(rhs), tensor_dims(cur)
        if not (lhs_dims and rhs_dims and mm_dims) or len(lhs_dims) != 2 or len(rhs_dims) != 2:
            continue
        casts, src = [], lhs
        while isinstance(src, relax.Var) and op_name(values.get(src)) == "relax.astype":
            casts.append(values[src].attrs.dtype)
            src = values[src].args[0]
        if not (isinstance(src, relax.Var) and op_name(values.get(src)) == "relax.reshape"):
            continue
        x = values[src].args[0]
        x_dims = tensor_dims(x)
        if not x_dims or len(x_dims) != len(out) or not prove_equal(x_dims[-1], lhs_dims[1]):
            continue
        if not (dims_equal(x_dims[:-1], out[:-1]) and prove_equal(_product(x_dims[:-1]), lhs_dims[0])
                and prove_equal(out[-1], mm_dims[1])):
            continue
        plans[var] = (x, list(reversed(casts)), cur, call, list(reversed(steps)))
    return plans


@mutator
class _Unflatten(PlannedMutator):
    def rebind(self, binding, plan):
        x, casts, mm_var, call, steps = plan
        y = self.visit_expr(x)
        for dtype in casts:
            y = self.builder_.emit(relax.op.astype(y, dtype))
        expr = relax.op.matmul(y, self.visit_expr(call.args[1]), out_dtype=call.attrs.out_dtype)
        name = mm_var.name
        for var, (kind, *args) in steps:
            y = self.builder_.emit(expr, name_hint=name)
            if kind == "astype":
                expr = relax.op.astype(y, args[0])
            else:
                other, position = self.visit_expr(args[0]), args[1]
                expr = relax.op.add(y, other) if position == 0 else relax.op.add(other, y)
            name = var.name
        if steps or not isinstance(binding.var, relax.DataflowVar):
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(expr)))
        else:
            # the matmul is the reshape's value: bound under the matmul's name, which the reshape's readers
            # then read (no alias binding between, which the epilogue patterns would not see through)
            self.set_var_remap(binding.var, self.builder_.emit(expr, name_hint=name))


@tvm.transform.module_pass(opt_level=0, name="UnflattenGemmRows")
class UnflattenGemmRows:
    """Module pass: a GEMM on rows flattened from ``x``'s leading axes and reshaped back to them becomes
    the GEMM on ``x`` (module doc); the module unchanged when there is none."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        def plans_of(func):
            if func.attrs is not None and ("Codegen" in func.attrs or "Composite" in func.attrs):
                return {}
            return flattened_gemm_plans(func)

        return rewrite_planned(mod, plans_of, _Unflatten)
