"""The driver of the module passes that plan their rewrites first: each pass finds the bindings it rewrites
in a function (a plan per binding) and a :class:`PlannedMutator` of its own rebinds them;
:func:`rewrite_planned` runs it over the functions with a plan and drops what nothing reads any more."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator

__all__ = ["PlannedMutator", "rewrite_planned"]


def rewrite_planned(mod: tvm.IRModule, plans_of, make_mutator) -> tvm.IRModule:
    """``mod`` with the planned bindings rewritten.

    Parameters
    ----------
    plans_of : callable
        ``plans_of(func) -> dict``: the plans of one Relax function, keyed by the variables of the
        bindings to rewrite (empty: none).
    make_mutator : callable
        ``make_mutator(mod, plans) -> PyExprMutator`` with every function's plans merged; it is run over
        each function that has one.

    Returns
    -------
    IRModule
        ``mod`` itself when no function has a plan.
    """
    functions, plans = [], {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            found = plans_of(func)
            if found:
                plans.update(found)
                functions.append(gv)
    if not plans:
        return mod
    rewriter = make_mutator(mod, plans)
    for gv in functions:
        rewriter.builder_.update_func(gv, rewriter.visit_expr(mod[gv]))
    out = rewriter.builder_.get()
    for gv in functions:
        out[gv] = relax.analysis.remove_all_unused(out[gv])
    return out


class PlannedMutator(PyExprMutator):
    """The mutator of such a pass (decorate the subclass with ``tvm.relax.expr_functor.mutator``): every
    binding with a plan is rebound by :meth:`rebind`, every other one visited as it is."""

    def __init__(self, mod: tvm.IRModule, plans: dict):
        super().__init__(mod)
        self.plans = plans

    def visit_var_binding_(self, binding):
        plan = self.plans.get(binding.var)
        if plan is None:
            return super().visit_var_binding_(binding)
        return self.rebind(binding, plan)

    def rebind(self, binding, plan):
        """Emit what ``binding``'s variable is bound to instead, by ``plan``."""
        raise NotImplementedError
