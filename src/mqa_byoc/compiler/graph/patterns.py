"""Pattern table for the ``flash_attn`` BYOC backend.

The canonicalization (:mod:`.canonicalize`) leaves one form per offloadable site:
``R.nn.attention(q, k, v)`` whose operands are plain BSNH tensors or ``permute_dims`` of BNSH ones,
optionally followed by a permute of the result. One check decides every composite, so the pattern
table and :func:`mqa_byoc.offload_report` agree. The table is registered in TVM's pattern registry
under the prefix ``flash_attn`` (:func:`register_flash_attn_patterns`), as TVM's cuBLAS and CUTLASS
backends register theirs.
"""

from __future__ import annotations

from functools import partial

from tvm.relax.backend.pattern_registry import register_patterns
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext

from mqa_byoc.contract import ATTENTION_COMPOSITES, CODEGEN, composite_name

from mqa_byoc.compiler.graph.analysis import check_attention_call
from mqa_byoc.compiler.graph.varlen import var_len_fusion_pattern


def make_attention_pattern(with_output_permute: bool):
    """``R.nn.attention`` with each operand either a tensor or its [0, 2, 1, 3] permute.

    Returns
    -------
    pattern : DFPattern
        The root of the match (the output permute, when asked for, else the attention).
    annotations : dict
        Named sub-patterns (``query_permute`` ... ``attention``, ``output_permute``, ``root``),
        like ``tvm.relax.backend.patterns``.
    """
    annotations = {}
    operands = []
    for name in ("query", "key", "value"):
        x = wildcard()
        # only the BNSH swap is a layout the kernels read; another permute (a sequence-first operand's
        # transpose to BSNH) stays outside the composite, a copy TVM makes
        permuted = is_op("relax.permute_dims")(x).has_attr({"axes": [0, 2, 1, 3]})
        annotations[f"{name}_permute"] = permuted
        operands.append(permuted | wildcard())
    attention = is_op("relax.nn.attention")(*operands)
    annotations["attention"] = attention
    root = attention
    if with_output_permute:
        root = is_op("relax.permute_dims")(attention).has_attr({"axes": [0, 2, 1, 3]})
        annotations["output_permute"] = root
    annotations["root"] = root
    return root, annotations


def check_attention(composite: str, length_facts: dict, context: PatternCheckContext) -> bool:
    """The check of every ``flash_attn`` attention pattern: the analysis accepts the call and its
    head counts make it ``composite``. ``length_facts``: the module's match_cast facts."""
    if has_leaking_intermediate_variables(context):
        return False
    call = context.annotated_expr["attention"]
    out_perm = context.annotated_expr.get("output_permute")
    if out_perm is not None and [int(a) for a in out_perm.attrs.axes] != [0, 2, 1, 3]:
        return False
    site = check_attention_call(call, dict(context.matched_bindings), length_facts)
    return site.reason is None and composite_name(site.num_q_heads, site.num_kv_heads) == composite


def flash_attn_patterns(composites=ATTENTION_COMPOSITES, output_permute: bool = True,
                        length_facts: dict | None = None) -> list[FusionPattern]:
    """The pattern table; highest priority first: the larger pattern (with the output permute) wins.

    Parameters
    ----------
    composites : sequence of str
        Which composites to include.
    output_permute : bool
        Include the variants that also take a permute of the result.
    length_facts : dict, optional
        ``{shape var: expression}`` from the module's match_casts (``Bindings.length_facts``), so
        that the check proves S_q <= S_kv like the analysis does.

    Returns
    -------
    list of FusionPattern
        For ``relax.transform.FuseOpsByPattern``.
    """
    facts = dict(length_facts or {})
    table = []
    for with_out in ((True, False) if output_permute else (False,)):
        pattern, annotations = make_attention_pattern(with_out)
        for name in composites:
            table.append(FusionPattern(name, pattern, annotations, partial(check_attention, name, facts)))
    table.append(var_len_fusion_pattern())  # matches R.nn.attention_var_len only: cheap
    return table


#: The name prefix of every pattern this module registers in TVM's pattern registry: the codegen's name.
PATTERN_PREFIX = CODEGEN


def register_flash_attn_patterns() -> None:
    """Register :func:`flash_attn_patterns` in TVM's pattern registry (done at import), so that
    ``tvm.relax.backend.pattern_registry.get_patterns_with_prefix("flash_attn")`` returns them, highest
    priority first, for ``FuseOpsByPattern`` as with TVM's own backends.

    The registered checks know no module, so they prove ``S_q <= S_kv`` without the module's
    match_cast facts; :func:`mqa_byoc.partition_for_cutlass` builds the table with those facts and
    runs the canonicalization the patterns expect before them (the registered patterns match the
    canonical ``R.nn.attention`` / ``R.nn.attention_var_len`` calls only)."""
    # the registry gives later entries the higher priority; tuples get TVM's clean-up at exit
    register_patterns([(p.name, p.pattern, dict(p.annotation_patterns), p.check)
                       for p in reversed(flash_attn_patterns())])


register_flash_attn_patterns()
