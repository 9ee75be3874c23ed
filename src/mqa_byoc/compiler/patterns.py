"""Pattern table for the ``flash_attn`` BYOC backend.

The canonicalization (:mod:`.partition`) leaves one form per offloadable site:
``R.nn.attention(q, k, v)`` whose operands are plain BSNH tensors or ``permute_dims`` of BNSH ones,
optionally followed by a permute of the result. One check decides both composites, so the pattern
table and :func:`mqa_byoc.offload_report` agree.
"""

from __future__ import annotations

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext

from .analysis import check_attention_call
from .varlen import var_len_fusion_pattern

COMPOSITE_MQA = "flash_attn.attention_mqa"
COMPOSITE_MHA = "flash_attn.attention"


def make_attention_pattern(with_output_permute: bool):
    """``R.nn.attention`` with each operand either a tensor or its [0, 2, 1, 3] permute.

    Returns (pattern, annotations) like ``tvm.relax.backend.patterns``.
    """
    annotations = {}
    operands = []
    for name in ("query", "key", "value"):
        x = wildcard()
        permuted = is_op("relax.permute_dims")(x)
        annotations[f"{name}_permute"] = permuted
        operands.append(permuted | wildcard())
    attention = is_op("relax.nn.attention")(*operands)
    annotations["attention"] = attention
    root = attention
    if with_output_permute:
        root = is_op("relax.permute_dims")(attention)
        annotations["output_permute"] = root
    annotations["root"] = root
    return root, annotations


def _check(context: PatternCheckContext, want_mqa: bool) -> bool:
    if has_leaking_intermediate_variables(context):
        return False
    call = context.annotated_expr["attention"]
    out_perm = context.annotated_expr.get("output_permute")
    if out_perm is not None and [int(a) for a in out_perm.attrs.axes] != [0, 2, 1, 3]:
        return False
    site = check_attention_call(call, dict(context.matched_bindings))
    if site.reason is not None:
        return False
    return (site.num_kv_heads != site.num_q_heads) == want_mqa


def _check_mqa(context: PatternCheckContext) -> bool:
    return _check(context, want_mqa=True)


def _check_mha(context: PatternCheckContext) -> bool:
    return _check(context, want_mqa=False)


def flash_attn_patterns(mqa=(True, False), output_permute: bool = True) -> list[FusionPattern]:
    """The pattern table; highest priority first: the larger pattern (with the output permute) wins.

    ``mqa``: which composites to include (True: ``attention_mqa``, False: ``attention``);
    ``output_permute``: include the variants that also take a permute of the result.
    """
    table = []
    for with_out in ((True, False) if output_permute else (False,)):
        pattern, annotations = make_attention_pattern(with_out)
        if True in mqa:
            table.append(FusionPattern(COMPOSITE_MQA, pattern, annotations, _check_mqa))
        if False in mqa:
            table.append(FusionPattern(COMPOSITE_MHA, pattern, annotations, _check_mha))
    table.append(var_len_fusion_pattern())  # matches R.nn.attention_var_len only: cheap
    return table
