"""GEMM sites for cuBLASLt: the pattern table, its checks and the report.

A GEMM site is ``R.matmul(x, w)`` or ``R.matmul(x, R.permute_dims(w))`` (nn.Linear's weight given as
(N, K)) with a 2-D weight ``w`` (constant or parameter), ``x`` of shape (..., K) whose leading axes
(batch x tokens, static or symbolic) are the GEMM's M; or a batched GEMM, ``w`` (..., K, N) (or its
last two axes swapped by the permute) with batch axes provably equal to those of ``x`` (..., M, K), one
strided-batched call. fp16 or bf16 operands, an output of their type or float32. Optionally followed by
what cuBLASLt computes in the same call:

- ``+ bias`` (a vector of N, or (1, ..., 1, N)): ``CUBLASLT_EPILOGUE_BIAS``;
- ``relu(+ bias)`` / ``gelu_tanh(+ bias)``: ``CUBLASLT_EPILOGUE_RELU_BIAS`` / ``GELU_BIAS`` (cuBLASLt's
  GELU is the tanh approximation, so ``R.nn.gelu``, the erf form, is not fused: its matmul (+ bias) is
  offloaded and the GELU stays on TVM);
- ``+ residual`` of the output's shape (after the bias, if any): ``D = A @ B + 1 * C`` with C the
  residual;
- ``astype`` of a float32 result to the operands' type right after the matmul (``ToMixedPrecision``'s
  default ``out_dtype`` casts every matmul so): cuBLASLt accumulates in float32 and writes the
  operands' type, rounded once as the cast rounds, so the float32 result is never stored.

``silu`` is no cuBLASLt epilogue: a SwiGLU's ``silu(gate) * up`` stays on TVM, which fuses it into one
elementwise kernel. The patterns are registered with TVM's pattern registry under the prefix
``cublaslt`` (:data:`mqa_byoc.contract.GEMM_COMPOSITES`), like TVM's own cuBLAS table.

Every check that keeps a site on TVM has a readable reason, and :func:`gemm_report` lists each matmul
of a module with what it runs on and why. The partition runs before the build pipeline's
``FuseTransposeMatmul`` (which would turn the transposed form into TVM's ``NT_matmul`` kernels), so the
patterns see ``permute_dims`` + ``matmul``; a module that has been through it (or ``LegalizeOps``) first
has its ``NT_matmul`` / ``matmul`` calls read back as matmuls (:mod:`.lowered_matmul`).
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from functools import partial, reduce

import tvm
from tvm import relax, tirx
from tvm.relax.backend.pattern_registry import get_patterns_with_prefix, register_patterns
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.transform import PatternCheckContext
from tvm.sym import Analyzer

from mqa_byoc.compiler.graph.dataflow import EnterDataflow
from mqa_byoc.compiler.graph.exprs import function_bindings
from mqa_byoc.compiler.graph.gemm_rows import UnflattenGemmRows
from mqa_byoc.compiler.graph.lowered_matmul import RestoreLoweredMatmul, lowered_matmul_reason, transpose_axes
from mqa_byoc.contract import (GEMM_ACTIVATIONS, GEMM_CODEGEN, GEMM_COMPOSITES, gemm_composite_name,
                               parse_gemm_composite)

__all__ = [
    "GemmSite",
    "PartitionGemm",
    "gemm_patterns",
    "gemm_reason",
    "gemm_report",
    "inline_gemm_composites",
    "make_gemm_pattern",
    "offload_gemms",
]

#: element types cuBLASLt runs here (fp32 accumulate, ``CUBLAS_COMPUTE_32F``)
SUPPORTED_DTYPES = ("float16", "bfloat16")
#: the output types it writes for each: the operands' own, or float32 (``R.matmul(..., out_dtype="float32")``,
#: what ``ToMixedPrecision``'s default ``out_dtype`` makes of every matmul); bias and residual are of the output's
OUTPUT_DTYPES = {dt: (dt, "float32") for dt in SUPPORTED_DTYPES}
#: operand and output rows must start on 16 bytes: K and N a multiple of this many 2-byte elements
ALIGN_ELEMENTS = 8
#: cuBLASLt takes int64 sizes but its leading dimensions and heuristics are int32 in practice
MAX_DIM = 2**31 - 1
# Every M goes to cuBLASLt, static decode rows too: with the measured algorithm choice
# (native/cublaslt_gemm.cc) cuBLASLt read the weights faster than dlight's GEMV at M = 1 on the H200
# (benchmarks/results/2026-12-03-decoders-gemm-measure.md, the in-place CodeLlama-34B decoder, kernel time
# per call: qkv 41.2 vs 42.0 us, o_proj 34.2 vs 37.3, gate_up 168.9 vs 170.6, down 87.3 vs 87.5, lm_head
# 123.9 vs 125.3; a decode step at 2k 1.638 vs 1.659 ms). Before that choice timed the split-count-1 forms
# and flushed L2, dlight's GEMV had been as fast and the sites of a static M = 1 stayed on TVM.


# ----------------------------------------------------------------------------- the patterns
def make_gemm_pattern(transposed: bool, bias: bool, activation: str | None = None, residual: bool = False,
                      cast: bool = False):
    """The pattern of one composite (:func:`mqa_byoc.contract.gemm_composite_name`).

    Returns
    -------
    pattern : DFPattern
        The root of the match (the last epilogue op, else the matmul).
    annotations : dict
        ``lhs``, ``weight`` (the 2-D operand before any permute), ``permute`` (transposed only),
        ``matmul``, ``bias`` / ``bias_add``, ``activation``, ``residual`` / ``residual_add``, ``cast``,
        ``root``.
    """
    lhs, weight = wildcard(), wildcard()
    ann = {"lhs": lhs, "weight": weight}
    rhs = weight
    if transposed:
        rhs = ann["permute"] = is_op("relax.permute_dims")(weight)
    out = ann["matmul"] = is_op("relax.matmul")(lhs, rhs)
    if bias:
        ann["bias"] = wildcard()
        out = ann["bias_add"] = is_op("relax.add")(out, ann["bias"])  # add is matched either way round
    if activation is not None:
        out = ann["activation"] = is_op(GEMM_ACTIVATIONS[activation])(out)
    if residual:
        ann["residual"] = wildcard()
        out = ann["residual_add"] = is_op("relax.add")(out, ann["residual"])
    if cast:
        out = ann["cast"] = is_op("relax.astype")(out)
    ann["root"] = out
    return out, ann


def _static(dim):
    if isinstance(dim, int):
        return dim
    if isinstance(dim, tirx.IntImm):
        return int(dim.value)
    return None


def _shape(ty):
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    return None if values is None else list(values)


def _fmt(shape):
    """A shape as the report writes it: ``(2, 64, 32)``, symbolic dims by name."""
    if shape is None:
        return "(unknown shape)"
    return "(" + ", ".join(str(d if _static(d) is None else _static(d)) for d in shape) + ")"


def rows_of(lhs_shape):
    """M of the GEMM: the product of every axis of ``x`` but the last (int when static, else a PrimExpr)."""
    m = reduce(operator.mul, lhs_shape[:-1], 1)
    static = _static(m) if not isinstance(m, int) else m
    if static is None:
        simplified = Analyzer().simplify(m)
        static = _static(simplified)
        m = simplified if static is None else static
    return static if static is not None else m


def batch_and_rows(lhs_shape, batch_axes: int):
    """(batch, M) of a GEMM: with a 2-D weight (``batch_axes`` 0) batch is 1 and M every axis of ``x`` but
    the last (:func:`rows_of`); with a batched one, batch is the product of the leading ``batch_axes``
    and M the axis before the last."""
    if not batch_axes:
        return 1, rows_of(lhs_shape)
    return rows_of([*lhs_shape[:batch_axes], 1]), rows_of(lhs_shape[batch_axes:])


def swaps_last_axes(permute_axes, ndim: int) -> bool:
    """Whether ``permute_dims(w, permute_axes)`` of an ``ndim``-D weight transposes its last two axes (and
    nothing else): a GEMM's transposed weight."""
    if permute_axes is None:
        return ndim == 2
    return [int(a) for a in permute_axes] == (transpose_axes(ndim) or [1, 0])


def _batch_reason(lhs, rhs):
    """Why a right-hand side with batch axes (a batched GEMM) is not one cuBLASLt strided-batched call."""
    if len(rhs) == 2:
        return None
    if len(lhs) != len(rhs):
        return (f"the right-hand side {_fmt(rhs)} has batch axes and x {_fmt(lhs)} another rank: a broadcast "
                "batch (cuBLASLt's batches here are both operands' own), left to TVM")
    analyzer = Analyzer()
    if not all(analyzer.can_prove_equal(a, b) for a, b in zip(lhs[:-2], rhs[:-2])):
        return (f"the batch axes of x {_fmt(lhs)} and of the right-hand side {_fmt(rhs)} are not provably equal "
                "(a broadcast batch), left to TVM")
    return None


def gemm_reason(lhs_ty, rhs_ty, out_ty, transposed: bool, permute_axes=None, bias_ty=None,
                residual_ty=None) -> str | None:
    """Why cuBLASLt must not compute this GEMM (None: it computes it exactly).

    ``lhs_ty`` / ``rhs_ty`` / ``out_ty``: the struct info of ``x``, of the weight as given (before the
    permute when ``transposed``) and of the matmul; ``bias_ty`` / ``residual_ty`` of the epilogue operands.
    """
    for name, ty in (("x", lhs_ty), ("weight", rhs_ty), ("output", out_ty)):
        if not isinstance(ty, relax.TensorType) or _shape(ty) is None:
            return f"the {name} has no known tensor shape"
    dtypes = (str(lhs_ty.dtype), str(rhs_ty.dtype), str(out_ty.dtype))
    if dtypes[0] != dtypes[1]:
        return f"mixed operand types {dtypes[0]} x {dtypes[1]}: cuBLASLt here takes one type for both"
    if dtypes[0] not in SUPPORTED_DTYPES:
        if dtypes[0].startswith(("int", "uint")):
            return (f"{dtypes[0]} GEMM: integer GEMMs are not offloaded (only fp16/bf16, fp32 accumulate); "
                    "a quantized weight dequantized to fp16 in the graph is")
        if dtypes[0] == "float32":
            return ("float32 GEMM: only fp16/bf16 (fp32 accumulate) are offloaded; cast the model to fp16 "
                    "(relax.transform.ToMixedPrecision) to offload it")
        return f"{dtypes[0]} GEMM: only {SUPPORTED_DTYPES} are offloaded"
    if dtypes[2] not in OUTPUT_DTYPES[dtypes[0]]:
        return (f"the output is {dtypes[2]} from {dtypes[0]} operands (out_dtype): cuBLASLt here writes "
                f"{' or '.join(OUTPUT_DTYPES[dtypes[0]])}")
    lhs, rhs = _shape(lhs_ty), _shape(rhs_ty)
    if len(lhs) < 2:
        return f"x is {len(lhs)}-D: a vector-matrix product (matmul drops the axis), left to TVM"
    if len(rhs) == 1:
        return f"the right-hand side is 1-D {_fmt(rhs)}: a matrix-vector product (matmul drops the axis), left to TVM"
    reason = _batch_reason(lhs, rhs)
    if reason:
        return reason
    if transposed and not swaps_last_axes(permute_axes, len(rhs)):
        axes = "None (all axes reversed)" if permute_axes is None else list(permute_axes)
        return f"the weight's permute_dims has axes {axes}, not a transpose of its last two axes"
    n_dim, k_dim = (rhs[-2], rhs[-1]) if transposed else (rhs[-1], rhs[-2])
    k, n = _static(k_dim), _static(n_dim)
    if k is None or n is None:
        return f"the weight {_fmt(rhs)} has a symbolic size: K and N must be static"
    if _static(lhs[-1]) != k:
        return f"x's last axis {lhs[-1]} is not the weight's K = {k}"
    if k <= 0 or n <= 0:
        return f"empty GEMM (K = {k}, N = {n})"
    for name, size in (("K", k), ("N", n)):
        if size % ALIGN_ELEMENTS:
            return (f"{name} = {size} is not a multiple of {ALIGN_ELEMENTS} elements: cuBLASLt's rows would not "
                    "start on 16 bytes (its fast kernels refuse them); left to TVM")
        if size > MAX_DIM:
            return f"{name} = {size} exceeds cuBLASLt's int32 leading dimension"
    batch, m = batch_and_rows(lhs, len(rhs) - 2)
    if isinstance(batch, int) and batch > MAX_DIM:
        return f"batch = {batch} exceeds cuBLASLt's int32 batch count"
    if isinstance(m, int) and m > MAX_DIM:
        return f"M = {m} exceeds cuBLASLt's int32 leading dimension"
    if isinstance(m, int) and m == 0:
        return "empty GEMM (M = 0)"
    if bias_ty is not None:
        reason = _bias_reason(bias_ty, n, dtypes[2])
        if reason:
            return reason
    if residual_ty is not None:
        reason = _residual_reason(residual_ty, out_ty)
        if reason:
            return reason
    return None


def _bias_reason(bias_ty, n, dtype):
    shape = _shape(bias_ty) if isinstance(bias_ty, relax.TensorType) else None
    if shape is None:
        return "the added operand has no known shape"
    if str(bias_ty.dtype) != dtype:
        return f"the bias is {bias_ty.dtype}, the GEMM's output {dtype}"
    if not shape or _static(shape[-1]) != n or any(_static(d) != 1 for d in shape[:-1]):
        return f"the added operand {_fmt(shape)} is not a bias vector of N = {n} (cuBLASLt's bias epilogue)"
    return None


def _residual_reason(res_ty, out_ty):
    shape = _shape(res_ty) if isinstance(res_ty, relax.TensorType) else None
    if shape is None:
        return "the residual has no known shape"
    if str(res_ty.dtype) != str(out_ty.dtype):
        return f"the residual is {res_ty.dtype}, the GEMM {out_ty.dtype}"
    out = _shape(out_ty)
    analyzer = Analyzer()
    if len(shape) != len(out) or not all(analyzer.can_prove_equal(a, b) for a, b in zip(shape, out)):
        return f"the added operand {_fmt(shape)} does not have the output's shape {_fmt(out)} (no broadcast in C)"
    return None


def _cast_reason(cast_ty, lhs_ty) -> str | None:
    """Why an ``astype`` after the matmul is not fused (None: cuBLASLt writes its type directly)."""
    target = str(getattr(cast_ty, "dtype", None))
    operands = str(getattr(lhs_ty, "dtype", None))
    if target != operands:
        return (f"the cast to {target} is not to the operands' type {operands}: cuBLASLt writes the matmul's "
                "type and the cast stays on TVM")
    return None


#: element types of quantized weights: integers (packed int4/int8 and the like) and 8-, 6- and 4-bit floats
_QUANTIZED_PREFIXES = ("int", "uint", "float8", "float6", "float4")


def _nbytes(ty):
    shape = _shape(ty) if isinstance(ty, relax.TensorType) else None
    if shape is None or any(_static(d) is None for d in shape):
        return None
    bits = tvm.runtime.DataType(str(ty.dtype)).bits
    return reduce(operator.mul, (_static(d) for d in shape), 1) * bits // 8


def dequantized_source(weight, bindings, limit: int = 24):
    """The quantized tensor a GEMM's weight is computed from in the graph (a dequantize), or None.

    Follows the weight's producers (ops and ``call_tir``s, at most ``limit`` bindings) to an integer or
    8-/6-/4-bit float tensor holding at least 1/16 of the weight's bytes (an index, as a gather of
    experts' weights takes, is far smaller)."""
    w_bytes = _nbytes(getattr(weight, "ty", None))
    if w_bytes is None:
        return None
    frontier, seen = [weight], set()
    while frontier and len(seen) < limit:
        e = frontier.pop()
        value = bindings.get(e) if isinstance(e, relax.Var) else None
        if value is None or e in seen:
            continue
        seen.add(e)
        args = list(value.args) if isinstance(value, relax.Call) else list(getattr(value, "fields", []))
        while args:
            a = args.pop()
            if isinstance(a, relax.Tuple):
                args.extend(a.fields)
                continue
            if _quantized(a, w_bytes):
                return _quantized_origin(a, bindings, limit)
            if isinstance(a, relax.Var):
                frontier.append(a)
    return None


def _quantized(e, w_bytes) -> bool:
    ty = getattr(e, "ty", None)
    if not (isinstance(ty, relax.TensorType) and str(ty.dtype).startswith(_QUANTIZED_PREFIXES)):
        return False
    nbytes = _nbytes(ty)
    return nbytes is not None and nbytes * 16 >= w_bytes


def _quantized_origin(e, bindings, limit):
    """The first quantized tensor ``e`` is computed from (unpacking shifts and masks of a packed weight
    lead back to the parameter or constant)."""
    for _ in range(limit):
        value = bindings.get(e) if isinstance(e, relax.Var) else None
        if not isinstance(value, relax.Call):
            break
        args = [f for a in value.args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
        nxt = next((a for a in args if _quantized(a, _nbytes(e.ty) or 0)), None)
        if nxt is None:
            break
        e = nxt
    return e


def _dequantize_note(weight, bindings) -> str | None:
    """A note on an offloaded site whose weight is dequantized in the graph (:func:`dequantized_source`)."""
    source = dequantized_source(weight, bindings)
    if source is None:
        return None
    name = f"`{source.name}`" if isinstance(source, relax.Var) else "a constant"
    shape = [_static(d) if _static(d) is not None else d for d in _shape(source.ty)]
    return (f"its weight is dequantized in the graph from {name} ({source.ty.dtype} {_fmt(shape)}) on every "
            "call, a kernel of its own in TVM's pipeline too; a pipeline that fuses the dequantize into TVM's "
            "matmul (mlc-llm's FuseDequantizeMatmulEwise) reads the quantized bytes instead: partition it with "
            "gemm=False")


def _epilogue_operand_reason(fields, context: PatternCheckContext) -> str | None:
    """Why an added operand (bias or residual) is not one cuBLASLt can read: a value the match itself
    computes (``h + h`` after ``h = x @ w``, or ``z + z`` after a bias; the pattern's wildcard then
    matches the matmul or the bias add a second time)."""
    ann = context.annotated_expr
    inner = [ann[k] for k in ("matmul", "bias_add", "activation") if k in ann]
    for key in ("bias", "residual"):
        operand = ann.get(key) if fields[key] else None
        if operand is not None and any(operand.same_as(e) for e in inner):
            return (f"the {key} add adds the GEMM's own result to itself (`h + h`): cuBLASLt reads its added "
                    "operand from memory, so the add stays on TVM")
    return None


def _site_reason(composite: str, context: PatternCheckContext) -> str | None:
    fields = parse_gemm_composite(composite)
    ann = context.annotated_expr
    if has_leaking_intermediate_variables(context):
        return "an intermediate value of the pattern is used elsewhere"
    reason = _epilogue_operand_reason(fields, context)
    if reason:
        return reason
    permute = ann.get("permute")
    if fields["cast"]:
        reason = _cast_reason(ann["cast"].ty, ann["lhs"].ty)
        if reason:
            return reason
    return gemm_reason(
        ann["lhs"].ty, ann["weight"].ty, ann["matmul"].ty, fields["transposed"],
        permute.attrs.axes if permute is not None and permute.attrs.axes is not None else None,
        ann["bias"].ty if fields["bias"] else None,
        ann["residual"].ty if fields["residual"] else None,
    )


def check_gemm(composite: str, context: PatternCheckContext) -> bool:
    """The check of every GEMM pattern: :func:`gemm_reason` and the dispatch rule accept the site."""
    return _site_reason(composite, context) is None


def _register():
    # TVM's registry: patterns later in the list have the higher priority, so the smallest go first
    register_patterns([
        (name, *make_gemm_pattern(**parse_gemm_composite(name)), partial(check_gemm, name))
        for name in reversed(GEMM_COMPOSITES)
    ])


_register()


def gemm_patterns() -> list:
    """The registered GEMM patterns (``cublaslt.*``), highest priority first, for ``FuseOpsByPattern``."""
    return get_patterns_with_prefix(GEMM_CODEGEN)


@tvm.transform.module_pass(opt_level=0, name="PartitionGemm")
class PartitionGemm:
    """Module pass: group every GEMM site cuBLASLt computes into a ``cublaslt.*`` composite with
    ``Codegen="cublaslt"`` (``FuseOpsByPattern`` with :func:`gemm_patterns`; GEMMs on flattened rows are
    written on their tensor's axes first, :class:`~.gemm_rows.UnflattenGemmRows`, and sites written outside
    ``R.dataflow()`` are moved into dataflow blocks, :class:`~.dataflow.EnterDataflow`)."""

    def __init__(self, bind_constants: bool = False, annotate_codegen: bool = True):
        self.bind_constants = bind_constants
        self.annotate_codegen = annotate_codegen

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return relax.transform.FuseOpsByPattern(gemm_patterns(), bind_constants=self.bind_constants,
                                                annotate_codegen=self.annotate_codegen)(
            EnterDataflow()(UnflattenGemmRows()(mod)))


# ----------------------------------------------------------------------------- the report
@dataclass
class GemmSite:
    """One matmul of the module, as reported to the user."""

    function: str
    output: str  # the variable the site's result is bound to
    offloaded: bool
    runs_on: str  # "cuBLASLt" or "TVM"
    composite: str | None
    m: str | None  # rows (batch x tokens): an int or a symbolic expression, as text
    n: int | None
    k: int | None
    dtype: str | None
    transposed: bool
    epilogue: str | None  # "bias", "bias+gelu_tanh", "residual", ... (offloaded sites)
    reason: str | None  # why the site stays on TVM; None when offloaded
    note: str | None = None
    out_dtype: str | None = None  # the output's type (``dtype`` is the operands')
    batch: str | None = None  # a batched GEMM's batch (the product of the axes x and the weight share)

    def as_dict(self) -> dict:
        """Returns
        -------
        dict
            The fields as a plain dict (JSON-ready).
        """
        return asdict(self)


def _epilogue(fields):
    parts = (["bias"] if fields["bias"] else []) + ([fields["activation"]] if fields["activation"] else [])
    parts += ["residual"] if fields["residual"] else []
    parts += ["cast"] if fields.get("cast") else []
    return "+".join(parts) or None


def _composite_of(func):
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Function) and b.value.attrs is not None and "Composite" in b.value.attrs:
                return str(b.value.attrs["Composite"]), b.value
    if func.attrs is not None and "Composite" in func.attrs:
        return str(func.attrs["Composite"]), func
    return None, None


def matmul_of(composite_func):
    """The ``relax.matmul`` call inside a GEMM composite (and the permute of its weight, if any)."""
    found = {}

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == "relax.matmul":
            found["matmul"] = e

    relax.analysis.post_order_visit(composite_func.body, visit)
    return found.get("matmul")


def _composite_output(composite_func):
    """The value a GEMM composite returns (its last epilogue op, else the matmul)."""
    body = composite_func.body
    return body.blocks[-1].bindings[-1].value if isinstance(body, relax.SeqExpr) and body.blocks else body


#: what the report says of a site whose calls of one row may run on CUTLASS's GEMV (native/cutlass_gemv.cu)
GEMV_NOTE = ("a call of one row (decode) also times CUTLASS's GEMV and runs on it when faster "
             "(kernel_options gemm_gemv; the library carries it when nvcc was at hand at build)")


def _gemv_note(fields, m: str, batched: bool, dtype: str, out_dtype: str) -> str | None:
    """:data:`GEMV_NOTE` when the site's calls of one row fit CUTLASS's GEMV (cutlass_gemv.h): an (N, K)
    weight, M of 1 or symbolic, no batch, no activation, not both bias and residual, the operands' type out."""
    one_row = m == "1" or m.isidentifier()  # a symbolic M of one variable can be 1; 2 * n cannot
    fits = (fields["transposed"] and not batched and not fields["activation"]
            and not (fields["bias"] and fields["residual"]) and (out_dtype == dtype or fields.get("cast")))
    return GEMV_NOTE if one_row and fits else None


def _join_notes(*notes):
    return "; ".join(n for n in notes if n) or None


def _composite_arguments(call, codegen_func):
    """(the composite, {composite parameter: the argument of ``call`` bound to it}) of a call of a GEMM
    codegen function; (None, {}) when it holds no composite."""
    _, comp = _composite_of(codegen_func)
    if comp is None:
        return None, {}
    if comp is codegen_func:
        return comp, dict(zip(comp.params, call.args))
    inner = next((b.value for block in codegen_func.body.blocks for b in block.bindings
                  if isinstance(b.value, relax.Call) and isinstance(b.value.op, relax.Var)), None)
    outer = {p: i for i, p in enumerate(codegen_func.params)}
    return comp, {param: call.args[outer[a]] for param, a in zip(comp.params, inner.args if inner is not None else ())
                  if a in outer}


def _matmul_operand(comp, e, arg_of):
    """(what a matmul operand ``e`` of ``comp`` reads through ``arg_of`` (composite parameter -> argument),
    whether through a ``permute_dims``); (None, False) when neither."""
    if e in arg_of:
        return arg_of[e], False
    v = next((b.value for block in comp.body.blocks for b in block.bindings if b.var.same_as(e)), None)
    if isinstance(v, relax.Call) and getattr(v.op, "name", None) == "relax.permute_dims" and v.args[0] in arg_of:
        return arg_of[v.args[0]], True
    return None, False


def _weight_argument(call, codegen_func):
    """The argument of ``call`` (a call of a GEMM codegen function) that its composite takes as the weight."""
    comp, arg_of = _composite_arguments(call, codegen_func)
    mm = matmul_of(comp) if comp is not None else None
    return _matmul_operand(comp, mm.args[1], arg_of)[0] if mm is not None else None


def _computed_weight_note(weight, bindings):
    """What the report says of a weight the graph computes on every call (None: a parameter or constant)."""
    return _dequantize_note(weight, bindings) or _weight_note(weight, bindings)


def _weight_note(weight, bindings):
    """A note when the weight is made from a parameter in the graph on every call (``permute_dims`` /
    ``astype`` of it: what ``ToMixedPrecision`` leaves of unbound parameters)."""
    ops = []
    while isinstance(weight, relax.Var) and weight in bindings:
        value = bindings[weight]
        op = getattr(value.op, "name", None) if isinstance(value, relax.Call) else None
        if op not in ("relax.permute_dims", "relax.astype") or len(ops) > 3:
            return None
        ops.append(op.split(".")[-1])
        weight = value.args[0]
    if not ops or not isinstance(weight, relax.Var):
        return None
    return (f"its weight is {' of '.join(ops)} of the parameter `{weight.name}`, computed on every call: bind the "
            "parameters (relax.transform.BindParams) and run FoldConstant to compute it once")


def _followed_by(users, var, bindings):
    """Notes on what follows the GEMM (through a split, as in a fused gate_up) that cuBLASLt cannot fuse."""
    notes, frontier, seen = [], [var], set()
    while frontier:
        v = frontier.pop()
        for user in users.get(v, ()):
            if user in seen:
                continue
            seen.add(user)
            value = bindings.get(user)
            if isinstance(value, relax.TupleGetItem):
                frontier.append(user)
                continue
            op = getattr(value.op, "name", None) if isinstance(value, relax.Call) else None
            if op == "relax.split":
                frontier.append(user)
            elif op == "relax.nn.silu":
                notes.append("its silu stays on TVM: cuBLASLt has no silu epilogue (TVM fuses it with the next "
                             "elementwise op)")
            elif op == "relax.nn.gelu":
                notes.append("its GELU (erf form) stays on TVM: cuBLASLt's GELU epilogue is the tanh approximation")
    return "; ".join(dict.fromkeys(notes)) or None


def gemm_report(mod: tvm.IRModule) -> list[GemmSite]:
    """What :class:`PartitionGemm` does with every matmul of ``mod``: one :class:`GemmSite` each.

    The module is partitioned and read back, so the report is the partition's own decision: offloaded
    sites name their composite and epilogue; every matmul left in the graph says why
    (:func:`gemm_reason`, the dispatch rule, or an intermediate used elsewhere).
    """
    mod = UnflattenGemmRows()(RestoreLoweredMatmul()(mod))  # the matmuls' names as the partition sees them
    part = PartitionGemm(annotate_codegen=True)(mod)
    codegen_funcs = {gv: f for gv, f in part.functions.items()
                     if isinstance(f, relax.Function) and f.attrs is not None
                     and str(f.attrs.get("Codegen", "")) == GEMM_CODEGEN}
    sites, lowered = [], {}
    for gv, func in part.functions.items():
        if not isinstance(func, relax.Function) or gv in codegen_funcs or (
                func.attrs is not None and ("Codegen" in func.attrs or "Composite" in func.attrs)):
            continue
        bindings, users = _bindings_and_users(func)
        names = _OriginalNames(next((f for g, f in mod.functions.items() if g.name_hint == gv.name_hint), None))
        for var, value in bindings.items():
            names.see(var, value, codegen_funcs)
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, relax.GlobalVar) and value.op in codegen_funcs:
                name, comp = _composite_of(codegen_funcs[value.op])
                fields = parse_gemm_composite(name)
                mm = matmul_of(comp)
                out_ty = _composite_output(comp).ty
                lhs, w = _shape(mm.args[0].ty), _shape(mm.args[1].ty)
                batch, m = batch_and_rows(lhs, len(w) - 2)
                sites.append(GemmSite(gv.name_hint, names.matmul_name(var), True, "cuBLASLt", name, str(m),
                                      int(w[-1]), int(lhs[-1]), str(mm.args[0].ty.dtype), fields["transposed"],
                                      _epilogue(fields), None,
                                      _join_notes(_followed_by(users, var, bindings),
                                                  _computed_weight_note(
                                                      _weight_argument(value, codegen_funcs[value.op]), bindings),
                                                  _gemv_note(fields, str(m), len(w) > 2, str(mm.args[0].ty.dtype),
                                                             str(out_ty.dtype))),
                                      str(out_ty.dtype),
                                      str(batch) if len(w) > 2 else None))
            elif getattr(value.op, "name", None) == "relax.matmul":
                sites.append(_tvm_site(gv.name_hint, var, value, bindings, users))
            else:
                form, reason = lowered_matmul_reason(mod, value, lowered)
                if form is None:
                    continue
                sites.append(_lowered_site(gv.name_hint, var, value, form, reason))
    return sites


def _report_sizes(lshape, wshape, transposed: bool):
    """(M, N, K, batch) of a site left on TVM as the report shows them (M and batch as text, batch None for
    a 2-D weight); all None when a shape is unknown or of fewer than two axes."""
    if not (lshape and wshape and len(lshape) >= 2 and len(wshape) >= 2):
        return None, None, None, None
    if len(wshape) > 2 and len(wshape) != len(lshape):  # batch axes broadcast between x and W: the result's
        b = rows_of([*wshape[:-2], 1]) if len(lshape) == 2 else "broadcast"
        rows = lshape[-2]
    else:
        b, rows = batch_and_rows(lshape, len(wshape) - 2 if len(wshape) == len(lshape) else 0)
    n, k = (_static(wshape[-2]), _static(wshape[-1])) if transposed else (_static(wshape[-1]), _static(wshape[-2]))
    return str(_static(rows) or rows), n, k, (str(b) if len(wshape) > 2 else None)


def _lowered_site(fname, var, call, form, reason):
    """The report's entry of a ``call_tir`` of a matmul PrimFunc left on TVM (:func:`lowered_matmul_reason`),
    its sizes read off the operands where they are known."""
    fields = list(call.args[1].fields)
    x_ty, w_ty = (fields[0].ty, fields[1].ty) if len(fields) >= 2 else (None, None)
    lshape = _shape(x_ty) if isinstance(x_ty, relax.TensorType) else None
    wshape = _shape(w_ty) if isinstance(w_ty, relax.TensorType) else None
    transposed = form == "NT_matmul"
    m, n, k, batch = _report_sizes(lshape, wshape, transposed)
    return GemmSite(fname, var.name, False, "TVM", None, m, n, k,
                    str(x_ty.dtype) if isinstance(x_ty, relax.TensorType) else None, transposed, None, reason, None,
                    str(call.ty.dtype) if isinstance(call.ty, relax.TensorType) else None, batch)


def _bindings_and_users(func):
    """``func``'s variable bindings {var: value} and their users {var: [vars whose call or tuple item reads it]}."""
    bindings, users = {}, {}
    for b in function_bindings(func):  # R.If branches' bindings too
        if not isinstance(b, relax.VarBinding):
            continue
        bindings[b.var] = b.value
        if isinstance(b.value, relax.Call):
            read = b.value.args
        elif isinstance(b.value, relax.TupleGetItem):
            read = [b.value.tuple_value]
        else:
            read = []
        for e in read:
            if isinstance(e, relax.Var):
                users.setdefault(e, []).append(b.var)
    return bindings, users


class _OriginalNames:
    """The names the partitioned module's GEMM calls had in the graph the user wrote.

    The partition binds each codegen call to a new variable (``lv``, ``lv1``, ...); the report names an
    offloaded site by its matmul's variable in ``original`` instead, the one the user's graph printed. A
    call's matmul is found there by its operands (each traced back to ``original``'s variables: the ones
    the partition kept, and earlier calls' fused outputs), its fused output by following the
    composite's epilogue ops from that matmul. Matmuls of the same operands (a graph that computes
    ``x @ W^T`` twice) name the calls in their order, each original matmul one call.
    """

    def __init__(self, original):
        self.bindings, self.users = _bindings_and_users(original) if isinstance(original, relax.Function) else ({}, {})
        self.of, self.matmul_of_call = {}, {}
        self.matmuls_of_x = {}  # the original's matmuls by their left operand
        self.named = set()  # the original's matmuls that name a call already
        for var, value in self.bindings.items():
            if isinstance(value, relax.Call) and getattr(value.op, "name", None) == "relax.matmul":
                self.matmuls_of_x.setdefault(value.args[0], []).append((var, value))

    def see(self, var, value, codegen_funcs):
        if var in self.bindings:
            self.of[var] = var
            return
        if not (isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar) and value.op in codegen_funcs):
            return
        found = self._match(value, codegen_funcs[value.op])
        if found is not None:
            self.matmul_of_call[var], self.of[var] = found

    def matmul_name(self, var) -> str:
        found = self.matmul_of_call.get(var)
        return found.name if found is not None else var.name

    def _match(self, call, codegen_func):
        comp, args = _composite_arguments(call, codegen_func)
        if comp is None or not args:
            return None
        arg_of = {param: self.of.get(a, a) for param, a in args.items()}  # -> the original variable
        mm = matmul_of(comp)
        x, _ = _matmul_operand(comp, mm.args[0], arg_of)
        w, transposed = _matmul_operand(comp, mm.args[1], arg_of)
        if x is None or w is None:
            return None
        for var, value in self.matmuls_of_x.get(x, ()):
            if var in self.named:
                continue
            rhs = value.args[1]
            producer = self.bindings.get(rhs) if isinstance(rhs, relax.Var) else None
            if transposed and not (isinstance(producer, relax.Call) and producer.args and producer.args[0].same_as(w)):
                continue
            if not transposed and not rhs.same_as(w):
                continue
            self.named.add(var)
            return var, self._fused_output(var, comp)
        return None

    def _fused_output(self, matmul_var, comp):
        """``matmul_var`` followed through the ops the composite fuses after its matmul."""
        ops = [getattr(b.value.op, "name", None) for block in comp.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call)]
        after = ops[ops.index("relax.matmul") + 1:] if "relax.matmul" in ops else []
        out = matmul_var
        for op in after:
            nxt = [u for u in self.users.get(out, ()) if getattr(getattr(self.bindings[u], "op", None), "name", None) == op]
            if len(nxt) != 1:
                return out
            out = nxt[0]
        return out


def _tvm_site(fname, var, call, bindings, users):
    lhs, rhs = call.args
    transposed, axes, weight = False, None, rhs
    producer = bindings.get(rhs) if isinstance(rhs, relax.Var) else None
    if isinstance(producer, relax.Call) and getattr(producer.op, "name", None) == "relax.permute_dims":
        w_shape = _shape(producer.args[0].ty)
        if w_shape is not None and swaps_last_axes(producer.attrs.axes, len(w_shape)):
            transposed, weight, axes = True, producer.args[0], producer.attrs.axes
        # else a permute but no transpose: the GEMM's operand is its output
    reason = gemm_reason(lhs.ty, weight.ty, call.ty, transposed, axes)
    lshape, wshape = _shape(lhs.ty), _shape(weight.ty)
    if reason is None:
        reason = "an intermediate value of the pattern is used elsewhere"
    m, n, k, batch = _report_sizes(lshape, wshape, transposed)
    dtype = str(lhs.ty.dtype) if isinstance(lhs.ty, relax.TensorType) else None
    out_dtype = str(call.ty.dtype) if isinstance(call.ty, relax.TensorType) else None
    note = _followed_by(users, var, bindings)
    if transposed:
        extra = "the build pipeline's FuseTransposeMatmul makes it TVM's NT_matmul kernel"
        note = extra if note is None else f"{note}; {extra}"
    return GemmSite(fname, var.name, False, "TVM", None, m, n, k, dtype, transposed, None, reason, note, out_dtype, batch)


def format_gemm_report(sites) -> str:
    """One line per GEMM site (what ``mqa-byoc`` prints)."""
    lines = []
    for s in sites:
        types = s.dtype if s.out_dtype in (None, s.dtype) else f"{s.dtype}->{s.out_dtype}"
        shape = (f"batch={s.batch} " if s.batch else "") + f"M={s.m} N={s.n} K={s.k} {types}{' W^T' if s.transposed else ''}"
        what = f"{s.composite} ({s.epilogue or 'no epilogue'})" if s.offloaded else s.reason
        lines.append(f"{s.function}/{s.output}: {shape} -> {s.runs_on}: {what}" + (f" [{s.note}]" if s.note else ""))
    return "\n".join(lines)


def composite_fields(name: str) -> dict:
    """:func:`mqa_byoc.contract.parse_gemm_composite` plus the epilogue as text."""
    fields = parse_gemm_composite(name)
    return {**fields, "epilogue": _epilogue(fields), "name": gemm_composite_name(**fields)}


def inline_gemm_composites(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every ``cublaslt`` function replaced by its composite's body as a plain Relax
    function: the partitioned graph as TVM would compute it (e.g. on llvm), to check that the rewrite
    computes what the original graph does.

    Raises
    ------
    ValueError
        When a composite does not take the function's parameters in order.
    """
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if not (isinstance(func, relax.Function) and func.attrs is not None
                and str(func.attrs.get("Codegen", "")) == GEMM_CODEGEN):
            continue
        name, comp = _composite_of(func)
        if comp is func:
            out[gv] = func.without_attr("Composite").without_attr("Codegen")
            continue
        call = next(b.value for block in func.body.blocks for b in block.bindings
                    if isinstance(b.value, relax.Call) and not isinstance(b.value, relax.Function)
                    and isinstance(b.value.op, relax.Var))
        if [a for a in call.args] != list(func.params) and not all(a.same_as(p) for a, p in zip(call.args, func.params)):
            raise ValueError(f"{gv.name_hint}: composite {name} does not take the function's parameters in order")
        out[gv] = comp.without_attr("Composite")
    return out
