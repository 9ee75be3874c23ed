"""Sites written outside ``R.dataflow()`` blocks: moved into them, so that the partition sees them.

TVM's ``FuseOpsByPattern`` groups only bindings of dataflow blocks. A Relax function written without
``R.dataflow()`` (valid TVMScript, and what hand-written modules often are) would have its attention and
its matmuls analysed and reported as offloaded while the partition left them in the graph.
:class:`EnterDataflow` runs TVM's ``ConvertToDataflow`` (every pure binding into a dataflow block, single
bindings too) on a module where a function has such a site outside one, ``R.If`` branches included; any
other module is returned unchanged.
"""

from __future__ import annotations

import tvm
from tvm import relax

from mqa_byoc.compiler.graph.exprs import block_bindings, op_name

__all__ = ["EnterDataflow", "sites_outside_dataflow"]

#: the ops a partition site starts from: attention calls, the matmuls of chains and GEMMs, the softmax
SITE_OPS = frozenset({"relax.matmul", "relax.nn.softmax", "relax.nn.attention", "relax.nn.attention_bias",
                      "relax.nn.attention_var_len"})


def sites_outside_dataflow(func) -> list:
    """The variables of ``func`` bound to a :data:`SITE_OPS` call in a block that is no dataflow block."""
    return [b.var for block, b in block_bindings(func)
            if not isinstance(block, relax.DataflowBlock) and op_name(getattr(b, "value", None)) in SITE_OPS]


@tvm.transform.module_pass(opt_level=0, name="EnterDataflow")
class EnterDataflow:
    """Module pass: ``relax.transform.ConvertToDataflow(min_size=1)`` when a function has a site outside a
    dataflow block (:func:`sites_outside_dataflow`), else the module unchanged."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(sites_outside_dataflow(f) for f in mod.functions.values()):
            return mod
        return relax.transform.ConvertToDataflow(min_size=1)(mod)
