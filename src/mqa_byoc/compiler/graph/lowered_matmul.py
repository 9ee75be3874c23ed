"""Matmuls that TVM already lowered, read back as the Relax matmuls they compute.

``relax.transform.FuseTransposeMatmul`` turns ``R.matmul(x, R.permute_dims(w))`` into a ``call_tir`` of
its own ``NT_matmul`` PrimFunc, and ``LegalizeOps`` turns ``R.matmul(x, w)`` into one of a ``matmul``
PrimFunc. A module that has been through either before the partition has no ``R.matmul`` left for the
GEMM and attention patterns. :class:`RestoreLoweredMatmul` makes each such call the Relax matmul again,
but only when its PrimFunc is, up to attributes, the very function TVM's pass makes for these operands
(the reference is built by the same pass on the same struct info and compared with
``tvm_ffi.structural_equal``): a PrimFunc of the same name that was fused with an epilogue, scheduled or
edited is left alone, and :func:`lowered_matmul_reason` says why. ``LegalizeOps`` lowers nn.Linear's
``permute_dims`` of the weight to a ``transpose`` PrimFunc too: a ``matmul`` whose weight is such a call
(:func:`legalized_transpose_of`, compared the same way) is read back as the transposed matmul. The
epilogues ``LegalizeOps`` lowered after such a matmul (``add`` of a bias or a residual, ``relu``, ``silu``,
``gelu``, ``gelu_tanh``, the ``cast`` of ``R.astype``: a call with an operand that is a matmul or an
epilogue read back) are read back the same way (:func:`legalized_epilogue_of`), so that the GEMM patterns
fuse them as they do before ``LegalizeOps``.

The partition then offloads the matmuls it can and leaves the others in the graph, where
``FuseTransposeMatmul`` makes the transposed ones ``NT_matmul`` calls again
(:func:`mqa_byoc.compiler.partition.partition_for_cutlass`), and the build's ``LegalizeOps`` the others.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

__all__ = ["EPILOGUES", "RestoreLoweredMatmul", "has_lowered_nt_matmul", "legalized_epilogue_of",
           "legalized_transpose_of", "lowered_matmul_reason", "restored_matmul", "transpose_axes"]

#: the two forms: TVM's pass that makes the PrimFunc, and whether the weight is transposed
FORMS = {"NT_matmul": ("FuseTransposeMatmul", True), "matmul": ("LegalizeOps", False)}
#: the GEMM epilogues read back after a restored matmul: ``LegalizeOps``' PrimFunc name -> (operands, the op
#: of the operands and the output's dtype); ``cast`` is ``R.astype`` (``ToMixedPrecision``'s cast back)
EPILOGUES = {"add": (2, lambda a, b, _dtype: relax.op.add(a, b)),
             "relu": (1, lambda x, _dtype: relax.op.nn.relu(x)),
             "silu": (1, lambda x, _dtype: relax.op.nn.silu(x)),
             "gelu": (1, lambda x, _dtype: relax.op.nn.gelu(x)),
             "gelu_tanh": (1, lambda x, _dtype: relax.op.nn.gelu_tanh(x)),
             "cast": (1, relax.op.astype)}
_RELAX_OPS = {"relax.matmul", "relax.add", "relax.nn.relu", "relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh",
              "relax.astype"}


def _callee(call):
    """The PrimFunc's GlobalVar of a ``call_tir``, else None."""
    if not isinstance(call, relax.Call) or getattr(call.op, "name", None) != "relax.call_tir":
        return None
    gv = call.args[0]
    return gv if isinstance(gv, tvm.ir.GlobalVar) and isinstance(call.args[1], relax.Tuple) else None


def _named(name: str, base: str) -> bool:
    """Whether a PrimFunc's name is ``base`` as TVM's passes name it (``base``, ``base1``, ...)."""
    return name == base or (name.startswith(base) and name[len(base):].isdigit())


def _candidate_form(name: str) -> str | None:
    """The form a PrimFunc's name says it is (``fused_`` ones too: FuseOps + FuseTIR keep the name)."""
    for form in FORMS:  # NT_matmul first: "matmul" is a suffix of it
        if _named(name, form):
            return form
    if name.startswith("fused_"):
        return next((form for form in FORMS if form in name), None)
    return None


def transpose_axes(ndim: int) -> list[int] | None:
    """``permute_dims`` axes that swap the last two of ``ndim`` axes (None, the default reversal, for 2-D)."""
    return None if ndim == 2 else list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _matmul(bb: relax.BlockBuilder, x, w, form: str, out_dtype: str):
    """``R.matmul(x, w)``, or ``R.matmul(x, R.permute_dims(w))`` for ``NT_matmul`` (the permute emitted)."""
    rhs = w
    if FORMS[form][1]:
        rhs = bb.emit(relax.op.permute_dims(w, transpose_axes(len(w.ty.shape.values))),
                      name_hint=f"{w.name}_T" if isinstance(w, relax.Var) else "weight_T")
    return relax.op.matmul(x, rhs, out_dtype=out_dtype)


def _without_attrs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    for key in list(func.attrs.keys()) if func.attrs is not None else []:
        func = func.without_attr(key)
    return func


def _lowered_alone(params: list, emit, lower_pass):
    """(the one PrimFunc ``lower_pass`` makes of a function of ``params`` whose body is ``emit(bb, *params)``,
    the ``call_tir`` of it); (None, None) when the pass makes something else."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(emit(bb, *params)))
        bb.emit_func_output(out)
    lowered = lower_pass(bb.get())
    funcs = [f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc)]
    calls = [c for c in _calls(lowered["main"]) if _callee(c) is not None]
    return (funcs[0], calls[0]) if len(funcs) == 1 and len(calls) == 1 else (None, None)


def _reference(form: str, x_ty, w_ty, out_dtype: str):
    """(the PrimFunc TVM's pass makes for ``form`` on operands of these struct infos, the symbolic values its
    call passes after the operands: the sizes of ``x`` its buffers cannot bind, e.g. ``b`` and ``s`` of a
    flattened (b * s, K)); (None, ()) when the pass makes something else."""
    lower_pass = relax.transform.FuseTransposeMatmul() if form == "NT_matmul" else relax.transform.LegalizeOps()
    func, call = _lowered_alone([relax.Var("x", x_ty), relax.Var("w", w_ty)],
                                lambda bb, x, w: _matmul(bb, x, w, form, out_dtype), lower_pass)
    return (func, tuple(call.args[1].fields[2:])) if func is not None else (None, ())


def _transpose_reference(w_ty):
    """The PrimFunc ``LegalizeOps`` makes for ``permute_dims`` swapping the last two axes of a ``w_ty``
    tensor (None when it makes something else)."""
    return _lowered_alone([relax.Var("w", w_ty)],
                          lambda bb, w: relax.op.permute_dims(w, transpose_axes(len(w_ty.shape.values))),
                          relax.transform.LegalizeOps())[0]


def legalized_transpose_of(mod: tvm.IRModule, call, cache: dict):
    """The tensor ``call`` transposes when it is a ``call_tir`` of exactly the ``transpose`` PrimFunc
    ``LegalizeOps`` makes for swapping its operand's last two axes (a weight stored (N, K) that a
    legalized nn.Linear transposes on every call), else None."""
    gv = _callee(call)
    if gv is None or not _named(gv.name_hint, "transpose"):
        return None
    fields = list(call.args[1].fields)
    if len(fields) != 1 or len(call.args) > 2 or gv not in mod.functions:
        return None
    w_ty = fields[0].ty
    if not (isinstance(w_ty, relax.TensorType) and isinstance(w_ty.shape, relax.ShapeExpr)
            and len(w_ty.shape.values) >= 2):
        return None
    key = ("transpose", gv, str(w_ty))
    if key not in cache:
        try:
            ref = _transpose_reference(w_ty)
        except tvm.TVMError:
            ref = None
        func = mod[gv]
        cache[key] = ref is not None and isinstance(func, tirx.PrimFunc) and tvm_ffi.structural_equal(
            _without_attrs(ref), _without_attrs(func))
    return fields[0] if cache[key] else None


def _tensor_with_shape(ty) -> bool:
    return isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr)


def legalized_epilogue_of(mod: tvm.IRModule, call, cache: dict):
    """(the op as a function of its operands, the operands) when ``call`` is a ``call_tir`` of exactly the
    PrimFunc ``LegalizeOps`` makes for one of :data:`EPILOGUES` on these operands, else None. Whether an
    operand comes from a restored matmul is the caller's test."""
    gv = _callee(call)
    name = next((n for n in EPILOGUES if gv is not None and _named(gv.name_hint, n)), None)
    if name is None or len(call.args) > 2 or gv not in mod.functions:
        return None
    arity, op = EPILOGUES[name]
    fields = list(call.args[1].fields)
    if len(fields) != arity or not all(_tensor_with_shape(f.ty) for f in fields) or not _tensor_with_shape(call.ty):
        return None
    dtype = str(call.ty.dtype)
    key = (name, gv, tuple(str(f.ty) for f in fields), str(call.ty))
    if key not in cache:
        try:
            ref, ref_call = _lowered_alone([relax.Var(f"a{i}", f.ty) for i, f in enumerate(fields)],
                                           lambda bb, *args: op(*args, dtype), relax.transform.LegalizeOps())
        except tvm.TVMError:
            ref = ref_call = None
        func = mod[gv]
        cache[key] = (ref is not None and len(ref_call.args) == 2 and isinstance(func, tirx.PrimFunc)
                      and tvm_ffi.structural_equal(ref_call.ty, call.ty)
                      and tvm_ffi.structural_equal(_without_attrs(ref), _without_attrs(func)))
    return (lambda *args: op(*args, dtype), fields) if cache[key] else None


def _calls(func):
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found


def _is_size(e) -> bool:
    """Whether a ``call_tir`` argument is a symbolic size (a TIR value, not a tensor)."""
    return isinstance(getattr(e, "ty", None), tvm.ir.PrimType)


def _same_values(a, b) -> bool:
    """Whether two sequences of symbolic sizes are the same values (the same TIR variables)."""
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y, map_free_vars=False) for x, y in zip(a, b))


def lowered_matmul_reason(mod: tvm.IRModule, call, cache: dict | None = None) -> tuple[str | None, str | None]:
    """Whether ``call`` (a binding's value in ``mod``) is a matmul TVM lowered, and can be read back.
    ``cache``: a dict kept across the calls of one module (each PrimFunc and operand types compared once).

    Returns
    -------
    (form, reason)
        ``form`` is ``"NT_matmul"`` or ``"matmul"`` for a call of a PrimFunc of that name (None: not a
        lowered matmul at all); ``reason`` is None when the PrimFunc is exactly TVM's for these operands
        (:class:`RestoreLoweredMatmul` restores it), else why it is not.
    """
    gv = _callee(call)
    form = _candidate_form(gv.name_hint) if gv is not None else None
    if form is None:
        return None, None
    fields = list(call.args[1].fields)
    symbolic = fields[2:]  # sizes the PrimFunc takes as values (checked against TVM's own call below)
    if gv.name_hint.startswith("fused_") or len(fields) < 2 or not all(_is_size(f) for f in symbolic):
        return form, (f"TVM's {gv.name_hint} is a matmul fused with other ops (FuseOps + FuseTIR ran first): "
                      "partition before the build pipeline, as mqa_byoc.build does")
    x, w = fields[:2]
    out_ty = call.ty
    if not all(isinstance(t, relax.TensorType) and t.shape is not None and isinstance(t.shape, relax.ShapeExpr)
               for t in (x.ty, w.ty, out_ty)):
        return form, f"TVM's {gv.name_hint}: its operands or output have no known shape"
    if len(call.args) > 2:
        return form, f"TVM's {gv.name_hint} takes symbolic values as extra arguments (tir_vars)"
    func = mod[gv] if gv in mod.functions else None
    if not isinstance(func, tirx.PrimFunc):
        return form, f"{gv.name_hint} is not a PrimFunc of the module"
    key = (gv, str(x.ty), str(w.ty), str(out_ty.dtype), tuple(str(v) for v in symbolic))
    cache = {} if cache is None else cache
    if key not in cache:
        try:
            ref, ref_values = _reference(form, x.ty, w.ty, str(out_ty.dtype))
        except tvm.TVMError:
            ref, ref_values = None, ()
        cache[key] = ref is not None and _same_values(ref_values, symbolic) and tvm_ffi.structural_equal(
            _without_attrs(ref), _without_attrs(func))
    if not cache[key]:
        return form, (f"TVM's {gv.name_hint} is not the PrimFunc {FORMS[form][0]} makes for these operands (fused with "
                      "another op, scheduled or edited): partition before the build pipeline, as mqa_byoc.build does")
    return form, None


def restored_matmul(call, form: str, bb: relax.BlockBuilder):
    """The Relax matmul ``call`` computes (the weight's permute emitted into ``bb`` for ``NT_matmul``)."""
    x, w = call.args[1].fields[:2]
    return _matmul(bb, x, w, form, str(call.ty.dtype))


@mutator
class _Restorer(PyExprMutator):  # pylint: disable=abstract-method
    def __init__(self, mod):
        super().__init__(mod)
        self.mod, self.cache, self.restored = mod, {}, 0

    def _restored(self, e) -> bool:
        """Whether ``e`` is bound to a Relax matmul or epilogue op (in a legalized function: one read back)."""
        bound = self.lookup_binding(e) if isinstance(e, relax.Var) else None
        return isinstance(bound, relax.Call) and getattr(bound.op, "name", None) in _RELAX_OPS

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        epilogue = legalized_epilogue_of(self.mod, call, self.cache)
        if epilogue is not None and any(self._restored(f) for f in epilogue[1]):
            self.restored += 1
            return epilogue[0](*epilogue[1])
        form, reason = lowered_matmul_reason(self.mod, call, self.cache)
        if form is None or reason is not None:
            return call
        self.restored += 1
        if form == "matmul":  # LegalizeOps' nn.Linear: the weight's transpose is a kernel of its own
            x, w = call.args[1].fields[:2]
            bound = self.lookup_binding(w) if isinstance(w, relax.Var) else None
            source = legalized_transpose_of(self.mod, bound, self.cache) if bound is not None else None
            if source is not None:
                return _matmul(self.builder_, x, source, "NT_matmul", str(call.ty.dtype))
        return restored_matmul(call, form, self.builder_)


@tvm.transform.module_pass(opt_level=0, name="RestoreLoweredMatmul")
class RestoreLoweredMatmul:
    """Module pass: every ``call_tir`` of TVM's own ``NT_matmul`` / ``matmul`` PrimFunc (exactly what
    ``FuseTransposeMatmul`` / ``LegalizeOps`` make for its operands) becomes ``R.matmul`` again, with
    ``R.permute_dims`` of the weight for ``NT_matmul``, and for a ``matmul`` whose weight is the output of
    ``LegalizeOps``' own ``transpose`` of the last two axes (a legalized nn.Linear); the legalized epilogues
    after them (:data:`EPILOGUES`) become Relax ops again; bindings and PrimFuncs no call uses any more are
    dropped."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        restorer = _Restorer(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                new = restorer.visit_expr(func)
                if not new.same_as(func):  # a transpose only the matmul read is gone with it
                    restorer.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
        if not restorer.restored:
            return mod
        out = restorer.builder_.get()
        used = set()
        for func in out.functions.values():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(
                    func, lambda e: used.add(e) if isinstance(e, tvm.ir.GlobalVar) else None)
        for gv in list(out.functions.keys()):
            if isinstance(out[gv], tirx.PrimFunc) and gv not in used and (
                    _candidate_form(gv.name_hint) or any(_named(gv.name_hint, n) for n in ("transpose", *EPILOGUES))):
                del out[gv]
        return out


def has_lowered_nt_matmul(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` calls a ``NT_matmul`` PrimFunc that :class:`RestoreLoweredMatmul` restores."""
    cache, found = {}, []

    def visit(e):
        if not found and lowered_matmul_reason(mod, e, cache) == ("NT_matmul", None):
            found.append(e)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return bool(found)
