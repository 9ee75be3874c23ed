"""``exp(log_softmax(x))`` read as the softmax it equals.

Attention code written for numerical care sometimes takes the probabilities as ``torch.exp(F.log_softmax(s,
-1))``: the same values as ``softmax(s, -1)``, which is what the analysis looks for. :class:`ExpOfLogSoftmax`
binds ``R.nn.softmax(x, axis)`` in place of each such ``exp`` whose result reaches a matmul (the
probabilities of an attention); the log-probabilities stay where anything else reads them.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from mqa_byoc.compiler.graph.exprs import binding_readers, binding_values, op_name
from mqa_byoc.compiler.graph.planned import PlannedMutator, rewrite_planned

__all__ = ["ExpOfLogSoftmax"]

#: ops the probabilities may pass on their way to the matmul
_PASSING = frozenset({"relax.astype", "relax.reshape", "relax.broadcast_to", "relax.permute_dims",
                      "relax.expand_dims", "relax.squeeze"})


def _plans(func) -> dict:
    """{var bound to exp(log_softmax(x, axis)) feeding a matmul: the log_softmax call}."""
    values, readers = binding_values(func), binding_readers(func)

    def reaches_matmul(var, depth=8):
        for user in readers.get(var, []):
            name = op_name(values.get(user))
            if name == "relax.matmul" or (depth and name in _PASSING and reaches_matmul(user, depth - 1)):
                return True
        return False

    plans = {}
    for var, value in values.items():
        if op_name(value) != "relax.exp":
            continue
        inner = values.get(value.args[0])
        if op_name(inner) == "relax.nn.log_softmax" and reaches_matmul(var):
            plans[var] = inner
    return plans


@mutator
class _Rewrite(PlannedMutator):
    def rebind(self, binding, call):
        softmax = relax.op.nn.softmax(self.visit_expr(call.args[0]), axis=int(call.attrs.axis))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(softmax)))


@tvm.transform.module_pass(opt_level=0, name="ExpOfLogSoftmax")
class ExpOfLogSoftmax:
    """Module pass: ``exp(log_softmax(x, axis))`` whose result reaches a matmul becomes ``softmax(x, axis)``
    (module doc); the module unchanged when there is none."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_planned(mod, _plans, _Rewrite)
