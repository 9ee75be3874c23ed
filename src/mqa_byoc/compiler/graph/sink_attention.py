"""Attention with sinks or logit soft-capping: the canonical form of such a site and its offload
(see :mod:`.sinks`).

``R.nn.attention`` has no sink operand and no soft-cap, so such a site is rewritten into a call of a
function of its own, ``f(q, k, v, sinks)`` (soft-capped: ``f(q, k, v)``, the cap c in
:data:`~mqa_byoc.contract.SOFTCAP_ATTR`; the scores become ``c * tanh(scores / c)`` before the mask)
with the native K/V heads (q, k, v in the layouts the graph holds them,
BSNH or BNSH; sinks (H,)), returning (B, S_q, H, D). Its body is the reference computation in plain
Relax (K/V repeated to the query heads, the scores in float32, the mask from positions, the sink
column, the row maximum subtracted, softmax, the sink column dropped, @ V): TVM lowers it anywhere,
so the rewritten graph is checked on the CPU against the original. Its attributes carry what the
kernels need (:data:`~mqa_byoc.contract.SINK_ATTR` and the scale, mask and layout attributes).

:class:`OffloadSinkAttention` (a partition step) turns each such function into a ``Codegen =
"flash_attn"`` function holding the composite (:data:`~mqa_byoc.contract.COMPOSITE_MQA_SINK` or
:data:`~mqa_byoc.contract.COMPOSITE_MHA_SINK`), as ``FuseOpsByPattern`` does for the other forms.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from mqa_byoc.contract import (CODEGEN, SINK_ATTR, SINK_CAUSAL_ATTR, SINK_LAYOUTS_ATTR, SINK_SCALE_ATTR,
                               SINK_WINDOW_ATTR, SOFTCAP_ATTR, composite_name)

from mqa_byoc.compiler.graph.spec import MAX_HEAD_DIM, SUPPORTED_DTYPES, AttentionSpec
from mqa_byoc.compiler.graph.site import output_steps
from mqa_byoc.compiler.graph.trace import as_int

FUNC_PREFIX = "attention_sinks"
SOFTCAP_FUNC_PREFIX = "attention_softcap"


def _layout(traced) -> str:
    return traced.layout()


def emit_canonical(mutator, var, site, mqa: bool):
    """Bind ``var`` to ``f(q, k, v, sinks)`` / soft-capped ``f(q, k, v)`` (then the graph's output layout)
    for the sink or soft-capped ``site``."""
    bb = mutator.builder_
    rep = None
    if not mqa and site.num_kv_heads != site.num_q_heads:
        rep = site.num_q_heads // site.num_kv_heads
    args, layouts = [], []
    for name, traced in (("q", site.q), ("k", site.k), ("v", site.v)):
        x = mutator.visit_expr(traced.source)
        if traced.is_view():
            x = bb.emit(relax.op.reshape(x, traced.shape()))
        if str(traced.source.ty.dtype) != site.dtype:
            x = bb.emit(relax.op.astype(x, site.dtype))
        if name == "v":
            x = mutator.pad_head_dim(x, site.head_dim)
        layout = _layout(traced)
        if rep is not None and name != "q":
            x = bb.emit(relax.op.repeat(x, rep, axis=1 if layout == "BNSH" else 2))
        args.append(x)
        layouts.append(layout)
    if site.sinks is not None:
        sinks = mutator.visit_expr(site.sinks.source)
        if len(sinks.ty.shape.values) != 1:
            sinks = bb.emit(relax.op.reshape(sinks, [site.num_q_heads]))
        args.append(sinks)
    heads_kv = site.num_q_heads if rep else site.num_kv_heads
    func = reference_function(
        [a.ty for a in args], layouts, dtype=site.dtype, num_q_heads=site.num_q_heads, num_kv_heads=heads_kv,
        head_dim=site.head_dim, scale=site.scale if site.scale is not None else site.head_dim ** -0.5,
        causal=bool(site.mask.causal), window=site.mask.window, softcap=site.softcap)
    gv = bb.add_func(func, SOFTCAP_FUNC_PREFIX if site.softcap is not None else FUNC_PREFIX)
    out = bb.emit(mutator.slice_value_dims(relax.Call(gv, args), site))
    mutator.attention_vars.add(out)
    labels, root_ty = site.out_labels, var.ty
    expr = out
    heads_first, reshape = output_steps(labels)
    if heads_first:
        expr = bb.emit(relax.op.permute_dims(expr, [0, 2, 1, 3]))
    if reshape:
        expr = bb.emit(relax.op.reshape(expr, root_ty.shape))
    if str(root_ty.dtype) != site.dtype:
        expr = relax.op.astype(expr, root_ty.dtype)
    bb.emit_normalized(relax.VarBinding(var, bb.normalize(expr) if not isinstance(expr, relax.Var) else expr))


def reference_function(arg_types, layouts, *, dtype, num_q_heads, num_kv_heads, head_dim, scale, causal,
                       window, softcap=None) -> relax.Function:
    """``f(q, k, v, sinks) -> (B, S_q, H, D)``: attention with sinks in plain Relax (module doc), with the
    kernel attributes; with ``softcap`` (and ``arg_types`` of q, k, v only) ``f(q, k, v)``, the soft-capped
    attention without sinks. Lengths and batch are fresh shape variables of its own."""
    b, s_q, s_kv = tirx.Var("b", "int64"), tirx.Var("s_q", "int64"), tirx.Var("s_kv", "int64")
    h, hkv, d = num_q_heads, num_kv_heads, head_dim

    def shape(layout, seq, heads):
        return [b, seq, heads, d] if layout == "BSNH" else [b, heads, seq, d]

    params = [relax.Var(n, relax.TensorType(shape(lay, seq, heads), dtype))
              for n, lay, seq, heads in zip("qkv", layouts, (s_q, s_kv, s_kv), (h, hkv, hkv))]
    has_sinks = len(arg_types) > 3
    if has_sinks:
        params.append(relax.Var("sinks", relax.TensorType([h], str(arg_types[3].dtype))))
    f32 = "float32"
    bb = relax.BlockBuilder()
    name = "attention_softcap" if softcap is not None else "attention_sinks"
    with bb.function(name, params, pure=True, private=True):
        with bb.dataflow():
            q, k, v = params[:3]
            heads_first = []
            for x, lay in zip((q, k, v), layouts):
                x = x if lay == "BNSH" else bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3]))
                heads_first.append(bb.emit(relax.op.astype(x, f32)))
            qh, kh, vh = heads_first
            if h != hkv:
                kh = bb.emit(relax.op.repeat(kh, h // hkv, axis=1))
                vh = bb.emit(relax.op.repeat(vh, h // hkv, axis=1))
            scores = bb.emit(relax.op.matmul(qh, bb.emit(relax.op.permute_dims(kh, [0, 1, 3, 2]))))
            scores = bb.emit(relax.op.multiply(scores, relax.const(float(scale), f32)))
            if softcap is not None:
                cap = relax.const(float(softcap), f32)
                scores = bb.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(scores, cap)), cap))
            if causal or window:
                # bottom-right aligned: row i is position i + S_kv - S_q among the keys
                rows = bb.emit(relax.op.reshape(relax.op.arange(s_kv - s_q, s_kv, dtype="int64"), [s_q, 1]))
                cols = bb.emit(relax.op.reshape(relax.op.arange(0, s_kv, dtype="int64"), [1, s_kv]))
                allowed = bb.emit(relax.op.less_equal(cols, rows))
                if window:
                    first = bb.emit(relax.op.subtract(rows, relax.const(int(window) - 1, "int64")))
                    allowed = bb.emit(relax.op.logical_and(allowed, bb.emit(relax.op.greater_equal(cols, first))))
                scores = bb.emit(relax.op.where(allowed, scores, relax.const(float("-inf"), f32)))
            if has_sinks:
                column = bb.emit(relax.op.reshape(relax.op.astype(params[3], f32), [1, h, 1, 1]))
                column = bb.emit(relax.op.broadcast_to(column, [b, h, s_q, 1]))
                logits = bb.emit(relax.op.concat([scores, column], axis=-1))
                logits = bb.emit(relax.op.subtract(logits, relax.op.max(logits, axis=-1, keepdims=True)))
                probs = bb.emit(relax.op.nn.softmax(logits, axis=-1))
                probs = bb.emit(relax.op.strided_slice(probs, axes=[3], begin=[0], end=[s_kv]))
            else:
                probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit(relax.op.matmul(probs, vh))
            out = bb.emit(relax.op.permute_dims(out, [0, 2, 1, 3]))
            out = bb.emit_output(relax.op.astype(out, dtype))
        bb.emit_func_output(out)
    func = bb.get()[name]
    attrs = {
        SINK_ATTR: composite_name(h, hkv, sinks=has_sinks, softcap=softcap is not None),
        SINK_SCALE_ATTR: tvm.tirx.FloatImm("float64", float(scale)),
        SINK_CAUSAL_ATTR: tvm.tirx.IntImm("int32", 1 if (causal or window) else 0),
        SINK_WINDOW_ATTR: tvm.tirx.IntImm("int32", int(window or 0)),
        SINK_LAYOUTS_ATTR: ",".join(layouts),
    }
    if softcap is not None:
        attrs[SOFTCAP_ATTR] = tvm.tirx.FloatImm("float64", float(softcap))
    for key, value in attrs.items():
        func = func.with_attr(key, value)
    return func


def is_sink_function(func) -> bool:
    """Whether ``func`` is a sink attention's function (before or inside the partition's composite)."""
    attrs = getattr(func, "attrs", None)
    return isinstance(func, relax.Function) and attrs is not None and SINK_ATTR in attrs


@tvm.transform.module_pass(opt_level=0, name="OffloadSinkAttention")
class OffloadSinkAttention:
    """Module pass: each sink attention's function becomes its ``flash_attn`` composite (module doc).

    Parameters
    ----------
    annotate_codegen : bool
        Wrap the composite in a ``Codegen = "flash_attn"`` function (as ``FuseOpsByPattern`` does), else
        the function itself becomes the composite.
    """

    def __init__(self, annotate_codegen: bool = True):
        self.annotate_codegen = annotate_codegen

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in list(mod.functions.items()):
            if not is_sink_function(func) or "Composite" in func.attrs or "Codegen" in func.attrs:
                continue
            composite = func.with_attr("Composite", str(func.attrs[SINK_ATTR]))
            if not self.annotate_codegen:
                # as FuseOpsByPattern marks its own composites: later pattern passes leave it alone
                mod[gv] = composite.with_attr("Primitive", True)
                continue
            # the wrapper's shape variables are its own (the composite defines its own too)
            fresh = {}

            def own(ty):
                # the dimensions are variables or constants (reference_function)
                dims = [fresh.get(x, x) if isinstance(x, tirx.Var) else x for x in ty.shape.values]
                return relax.TensorType(dims, ty.dtype)

            for p in func.params:
                for x in p.ty.shape.values:
                    if isinstance(x, tirx.Var) and x not in fresh:
                        fresh[x] = tirx.Var(x.name, "int64")
            params = [relax.Var(p.name, own(p.ty)) for p in func.params]
            ret_ty = own(func.ret_ty)
            local = relax.Var("local_func", composite.ty)
            out = relax.Var("output", ret_ty)
            block = relax.BindingBlock([relax.VarBinding(local, composite),
                                        relax.VarBinding(out, relax.Call(local, params))])
            wrapper = relax.BlockBuilder().normalize(
                relax.Function(params, relax.SeqExpr([block], out), ret_ty, is_pure=True))
            wrapper = wrapper.with_attr("Codegen", CODEGEN).with_attr(SINK_ATTR, str(func.attrs[SINK_ATTR]))
            wrapper = wrapper.with_attr("global_symbol", gv.name_hint)
            mod[gv] = wrapper
        return mod


def fixed_heads(func) -> tuple[int, int, int]:
    """(H, H_kv, D) of a sink function, read off its q and k parameters."""
    layouts = str(func.attrs[SINK_LAYOUTS_ATTR]).split(",")
    q, k = func.params[0].ty.shape.values, func.params[1].ty.shape.values
    head_axis = {"BSNH": 2, "BNSH": 1}
    return (as_int(q[head_axis[layouts[0]]]), as_int(k[head_axis[layouts[1]]]), as_int(q[3]))


SINK_DTYPES = ("float32", "float16", "bfloat16")


def read_sink_composite(func) -> tuple[AttentionSpec, tuple[int, ...]]:
    """The :class:`AttentionSpec` (with ``sinks_dtype``, or ``softcap``) of a sink or soft-capped composite;
    operands are its parameters in order (q, k, v, sinks / q, k, v).

    Raises
    ------
    ValueError
        When the function is not one the kernels compute.
    """
    attrs = func.attrs
    for key in (SINK_SCALE_ATTR, SINK_CAUSAL_ATTR, SINK_WINDOW_ATTR, SINK_LAYOUTS_ATTR):
        if key not in attrs:
            raise ValueError(f"sink composite without its attribute {key!r}")
    softcap = float(attrs[SOFTCAP_ATTR]) if SOFTCAP_ATTR in attrs else None
    if softcap is not None:
        if not (softcap > 0 and softcap != float("inf")):
            raise ValueError(f"soft-cap {softcap}: the kernels need a finite soft-cap > 0")
        if len(func.params) != 3:
            raise ValueError(f"soft-capped composite takes (q, k, v), got {len(func.params)} parameters")
    elif len(func.params) != 4:
        raise ValueError(f"sink composite takes (q, k, v, sinks), got {len(func.params)} parameters")
    layouts = str(attrs[SINK_LAYOUTS_ATTR]).split(",")
    if len(layouts) != 3 or any(x not in ("BSNH", "BNSH") for x in layouts):
        raise ValueError(f"sink composite layouts {layouts}: expected three of BSNH / BNSH")
    h, hkv, d = fixed_heads(func)
    dtypes = {str(p.ty.dtype) for p in func.params[:3]}
    sink_ty = func.params[3].ty if softcap is None else None
    if None in (h, hkv, d):
        raise ValueError("heads and head dim must be static")
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        raise ValueError(f"q, k, v dtypes {sorted(dtypes)}: FA2 needs one of {SUPPORTED_DTYPES}")
    if sink_ty is not None and (str(sink_ty.dtype) not in SINK_DTYPES
                                or [int(x) for x in sink_ty.shape.values] != [h]):
        raise ValueError(f"sinks must be ({h},) of {SINK_DTYPES}, got {sink_ty}")
    if d > MAX_HEAD_DIM or d % 8 or h % hkv:
        raise ValueError(f"head dim {d} with {h} / {hkv} heads is not an FA2 attention")
    window = int(attrs[SINK_WINDOW_ATTR])
    causal = bool(int(attrs[SINK_CAUSAL_ATTR]))
    wl, wr = (-1, -1) if window <= 0 else (window - 1, 0)
    spec = AttentionSpec(h, hkv, d, d, next(iter(dtypes)), float(attrs[SINK_SCALE_ATTR]), causal, wl, wr,
                         *layouts, "BSNH", sinks_dtype=str(sink_ty.dtype) if sink_ty is not None else None,
                         softcap=softcap or 0.0)
    return spec, tuple(range(len(func.params)))
