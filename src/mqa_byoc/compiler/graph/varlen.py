"""``R.nn.attention_var_len``: batched sequences of different lengths, offloaded to FA2's var-len forward.

The op takes Q ``(1, total_q, H, D)``, K/V ``(1, total_kv, H_kv, D)`` (sequences concatenated along
axis 1), ``seqstart_q`` / ``seqstart_k`` (int32 cumulative lengths with a leading 0: FA2's
``cu_seqlens``) and ``max_seqlen_q`` / ``max_seqlen_k`` (int32 tensors). Stock TVM 0.27 cannot lower
it (``LegalizeOps``: "Legalization of attention_var_len op is not supported yet"), so a site we do
not offload leaves a module that does not build: the report says so.

Here: the site analysis (K/V traced back through repeat / broadcast_to / HF repeat_kv with
:func:`.trace.trace`, the checks shared with ``R.nn.attention`` plus the var-len ones), the
canonical form the partition emits (the call on the un-expanded K/V) and the pattern check. The
composite is ``flash_attn.attention_var_len``; its body is one ``R.nn.attention_var_len`` on BSNH
parameters (see docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import Constant

from mqa_byoc.contract import COMPOSITE_VAR_LEN

from mqa_byoc.compiler.graph.masks import MaskKind
from mqa_byoc.compiler.graph.site import AttentionSite, common_checks, trace_fused_operands
from mqa_byoc.compiler.graph.trace import Traced, as_int, shape_of

VAR_LEN_OP = "relax.nn.attention_var_len"
FORM = "R.nn.attention_var_len"
COMPOSITE = COMPOSITE_VAR_LEN
_BSNH = ["B", "S", "H", "D"]
# appended to the reason of every var-len site left in the graph (offload_report)
NOT_LOWERABLE = ("; TVM cannot lower R.nn.attention_var_len itself (LegalizeOps: not supported yet), "
                 "so the module will not build with this attention left in it")


@dataclass
class VarLenSite(AttentionSite):
    """An :class:`~.site.AttentionSite` with the var-len operands (Relax expressions)."""

    seqstart_q: relax.Expr | None = None
    seqstart_k: relax.Expr | None = None
    max_seqlen_q: relax.Expr | None = None
    max_seqlen_k: relax.Expr | None = None


def var_len_site(func_name, var, call, bindings, allow_kv_expansion=True) -> VarLenSite:
    """The analysis of one ``R.nn.attention_var_len`` binding (``var = call``)."""
    site = VarLenSite(func_name, var, FORM, out_labels=list(_BSNH))
    site.seqstart_q, site.seqstart_k, site.max_seqlen_q, site.max_seqlen_k = call.args[3:7]
    if not trace_fused_operands(site, call, bindings, allow_kv_expansion):
        return site
    return _var_len_checks(site, call.attrs)


def check_var_len_call(call, operand_values) -> VarLenSite:
    """The pattern check's verdict on a canonical call (plain BSNH operands, K/V not traced), so
    that the partition and :func:`mqa_byoc.offload_report` agree."""
    site = VarLenSite("", None, FORM, out_labels=list(_BSNH))
    site.q, site.k, site.v = (Traced(a, list(_BSNH)) for a in call.args[:3])
    site.seqstart_q, site.seqstart_k, site.max_seqlen_q, site.max_seqlen_k = call.args[3:7]
    site.scale = float(call.attrs.scale.value) if call.attrs.scale is not None else None
    site.causal_attr = call.attrs.causal_mask
    common_checks(site)
    if site.reason:
        return site
    if site.pads_value:  # the canonicalization pads V first: a composite has one head dim
        return site.reject(f"V's head dim {site.head_dim_v} differs from Q's and K's {site.head_dim} in the composite")
    return _var_len_checks(site, call.attrs)


def _tensor_type(expr):
    ty = expr.ty
    return ty if isinstance(ty, relax.TensorType) else None


def _var_len_checks(site: VarLenSite, attrs) -> VarLenSite:
    batch = site.q.shape()[site.q.labels.index("B")]
    if as_int(batch) != 1:
        return site.reject(f"queries must be (1, total_q, H, D) (sequences concatenated), batch axis is {batch}")
    lengths = []
    for name in ("seqstart_q", "seqstart_k"):
        ty = _tensor_type(getattr(site, name))
        if ty is None or ty.ndim != 1 or str(ty.dtype) != "int32":
            what = f"{ty.dtype} with {ty.ndim} dims" if ty is not None else type(getattr(site, name).ty).__name__
            return site.reject(f"{name} must be a 1-D int32 tensor (FA2's cu_seqlens), got {what}")
        lengths.append(shape_of(getattr(site, name)))
    if lengths[0] and lengths[1] and _provably_differ(lengths[0][0], lengths[1][0]):
        return site.reject(f"seqstart_q has {lengths[0][0]} entries but seqstart_k has {lengths[1][0]}")
    for name in ("max_seqlen_q", "max_seqlen_k"):
        ty = _tensor_type(getattr(site, name))
        shape = shape_of(getattr(site, name)) if ty is not None else None
        one_element = shape is not None and all(as_int(x) == 1 for x in shape)
        if ty is None or str(ty.dtype) != "int32" or not one_element:
            what = f"{ty.dtype} of shape {shape}" if ty is not None else type(getattr(site, name).ty).__name__
            return site.reject(f"{name} must be an int32 tensor with one element, got {what}")
    window = int(attrs.window_size) if attrs.window_size is not None else None
    causal = attrs.causal_mask
    if causal == "TopLeft" and not same_sequences(site.seqstart_q, site.seqstart_k):
        return site.reject("TopLeft causal mask with seqstart_q and seqstart_k that are not the same tensor: "
                           "per sequence S_q == S_kv is not provable and FA2's causal is bottom-right aligned")
    if window is not None:
        if window < 1:
            return site.reject(f"window_size {window} < 1")
        if causal is None:
            return site.reject("window_size without a causal mask (TVM defines the var-len sliding window "
                               "only with causal_mask='BottomRight')")
    # BottomRight is FA2's causal per sequence (rows with no visible key come out as zeros). The lengths
    # are run-time values, so S_q <= S_kv per sequence cannot be proven; where S_q > S_kv TVM's docstring
    # says tril(k=|S_q - S_kv|), but TVM has no lowering and upstream's CUTLASS offload is FA2's too.
    site.mask = MaskKind(causal is not None, window)
    return site


def _provably_differ(a, b) -> bool:
    from tvm.sym import Analyzer

    return Analyzer().can_prove(tirx.NE(a, b))


def same_sequences(seqstart_q, seqstart_k) -> bool:
    """Do both cumulative-length operands hold the same values? Proven only when they are the same
    Relax variable or equal constants (TVM's Python API passes seqstart_q for an omitted seqstart_k)."""
    if seqstart_q.same_as(seqstart_k):
        return True
    if isinstance(seqstart_q, Constant) and isinstance(seqstart_k, Constant):
        return tvm_ffi.structural_equal(seqstart_q, seqstart_k)
    return False


# ----------------------------------------------------------------------------- canonicalization
def emit_canonical(mutator, var, site: VarLenSite, mqa: bool) -> None:
    """Bind ``var`` to ``R.nn.attention_var_len`` on the traced (un-expanded with ``mqa``) operands;
    ``mutator`` is the partition's ``_Canonicalize`` (its ``_operand`` casts and permutes)."""
    bb = mutator.builder_
    rep = None
    if not mqa and site.num_kv_heads != site.num_q_heads:
        rep = site.num_q_heads // site.num_kv_heads  # the mqa=False baseline keeps K/V expanded
    # a BNSH source is transposed in the graph: the composite takes BSNH operands only
    q = mutator._operand(site.q, site.dtype)
    k = mutator._operand(site.k, site.dtype, rep)
    v = mutator._operand(site.v, site.dtype, rep, pad_to=site.head_dim)
    extra = [mutator.visit_expr(e) for e in (site.seqstart_q, site.seqstart_k, site.max_seqlen_q, site.max_seqlen_k)]
    att = relax.op.nn.attention_var_len(
        q, k, v, extra[0], extra[2], extra[1], extra[3], scale=site.scale, causal_mask=site.causal_attr,
        window_size=site.mask.window)
    att = mutator.slice_value_dims(att, site)
    if str(var.ty.dtype) != site.dtype:  # the graph attended in float32 on up-cast half tensors
        att = relax.op.astype(bb.emit(att), var.ty.dtype)
    bb.emit_normalized(relax.VarBinding(var, bb.normalize(att)))


# ----------------------------------------------------------------------------- the pattern
def make_var_len_pattern():
    """``R.nn.attention_var_len`` on any seven operands; returns (pattern, annotations)."""
    from tvm.relax.dpl import is_op, wildcard

    operands = [wildcard() for _ in range(7)]
    call = is_op(VAR_LEN_OP)(*operands)
    return call, {"attention": call, "root": call}


def check_var_len_pattern(context) -> bool:
    from tvm.relax.backend.utils import has_leaking_intermediate_variables

    if has_leaking_intermediate_variables(context):
        return False
    call = context.annotated_expr["attention"]
    return check_var_len_call(call, dict(context.matched_bindings)).reason is None


def var_len_fusion_pattern():
    from tvm.relax.transform import FusionPattern

    pattern, annotations = make_var_len_pattern()
    return FusionPattern(COMPOSITE, pattern, annotations, check_var_len_pattern)


def explain_unlowerable(report) -> list:
    """Append :data:`NOT_LOWERABLE` to the reason of every var-len site left in the graph."""
    for s in report:
        if s.form == FORM and not s.offloaded and s.reason and NOT_LOWERABLE not in s.reason:
            s.reason += NOT_LOWERABLE
    return report
