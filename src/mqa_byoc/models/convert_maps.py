"""``custom_convert_map`` s for TVM's ``from_exported_program``: converters that fix what the frontend of
apache-tvm 0.27 gets wrong or cannot convert in the graphs torch.export makes of Hugging Face decoders
(:func:`fixes_convert_map`), and one that keeps every matmul in the model's type
(:func:`native_dtype_convert_map`). Each converter says which failure it fixes; the tests
(``tests/test_models_decoders.py``, ``tests/test_hf_families.py``) pin the frontend's failure beside the fix.
:mod:`.hf` uses them (``import_hf``) and exports them under its name too."""

from __future__ import annotations

from functools import partial


def fixes_convert_map() -> dict:
    """Converters that fix frontend bugs HF decoders hit (always used by :func:`import_hf`).

    ``cat.default``: torch.cat skips 1-D empty tensors, the frontend's concat rejects them
    ("Concat expects all input tensors to have same ndim"); ``DynamicCache.update`` on an empty
    layer concatenates onto ``torch.tensor([])``, so any export that fills a fresh cache hits it.

    ``cumsum.default``: torch sums bool / integer inputs in int64, the frontend keeps ``bool``
    (``R.cumsum(bool)``), which then fails in LLVM codegen ("CreateAdd ... kDLFloat"). HF's mask
    builder cumsums a bool tensor (packed-sequence detection), so every HF decoder hits it.

    ``index_put.default``: a ``StaticCache`` write (:func:`.hf_static.index_put_converter`).

    ``index.Tensor``: indexing one axis with a list (Falcon's ``qkv[:, :, :, [-2]]``) becomes
    ``R.take(mode="fast")``, which reads out of bounds for a negative index; taken with ``mode="wrap"``
    instead (torch counts a negative index from the end). Other index forms keep the frontend's converter.

    ``select.int``: ``x[..., -2, :]`` (Falcon-40B's K from its grouped qkv in transformers 5.2x) becomes the
    same ``R.take(mode="fast")`` of a negative constant (NaN or another row's values on the GPU and the
    CPU); the index is counted from the end of its (static) axis as torch does, else taken with ``mode="wrap"``.

    ``slice_scatter.default``: ``R.slice_scatter`` takes its bounds as ``PrimValue`` operands, on which
    ``ToMixedPrecision`` fails ("Expected TensorType, but got T.int64"). Multi-head latent attention
    (DeepSeek-V3, MiniCPM3) writes its key into a new tensor slice by slice, which torch.export turns into
    ``slice_scatter``; on a static axis with step 1 it is the ``concat`` of the source with the untouched
    slices of the input instead. Other forms keep the frontend's converter.

    ``addmm.default``: every biased ``nn.Linear`` (Qwen2's q/k/v, GPT-2's ``Conv1D``) is ``addmm(bias, x, w)``
    after torch.export's decompositions; the frontend adds the bias in the model's type to its float32
    ``matmul``, so an fp16 or bf16 model with a bias fails to import ("Binary operators must have the same
    datatype"). The bias is cast to the matmul's type (:func:`native_dtype_convert_map`: the matmul keeps
    the model's type).

    The rest, each in its converter's docstring: ``div.Tensor_mode`` of an integer tensor by a number
    (:func:`_div_mode`), float results of integer tensors (``div``, ``log``, ...: :func:`_float_of_integers`),
    ``full`` / ``full_like`` of ``-inf`` (:func:`_full_of_inf`), ``topk(sorted=False)`` (:func:`_topk`),
    ``clamp`` with constant bounds (:func:`_clamp`), ``amax`` / ``amin`` (:func:`_reduce`), ``sym_max`` /
    ``sym_min`` of sizes (:func:`_sym_extreme`) and complex arithmetic (:func:`_complex_converters`).
    """
    from tvm import relax, tirx

    def cumsum(node, importer):
        x = importer.env[node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", None)
        dtype = node.kwargs.get("dtype", None)
        if dtype is not None:
            dtype = importer._convert_data_type(str(dtype), importer.env)
        elif str(x.ty.dtype) == "bool" or str(x.ty.dtype).startswith(("int", "uint")):
            dtype = "int64"
        return importer.block_builder.emit(relax.op.cumsum(x, dim, dtype))

    def cat(node, importer):
        # torch.cat skips 1-D empty tensors (legacy behaviour); DynamicCache relies on it: its
        # first update() concatenates the new K/V onto torch.tensor([])
        args = importer.retrieve_args(node)
        dim = args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        parts = [
            t
            for t in args[0]
            if not (
                t.ty.ndim == 1
                and t.ty.shape is not None
                and isinstance(t.ty.shape.values[0], tirx.IntImm)
                and int(t.ty.shape.values[0]) == 0
            )
        ]
        if len(parts) == 1:
            return parts[0]
        return importer.block_builder.emit(relax.op.concat(parts, axis=dim))

    def index(node, importer):
        args = importer.retrieve_args(node)
        given = [(axis, idx) for axis, idx in enumerate(args[1]) if idx is not None]
        if len(given) != 1:
            return importer._index_tensor(node)
        axis, idx = given[0]
        return importer.block_builder.emit(relax.op.take(args[0], idx, axis=axis, mode="wrap"))

    def select(node, importer):
        x = importer.env[node.args[0]]
        dim, idx = node.args[1], node.args[2]
        if not isinstance(idx, int) or idx >= 0:
            return importer._select(node)
        dim = dim % x.ty.ndim
        size = x.ty.shape.values[dim] if x.ty.shape is not None else None
        if isinstance(size, tirx.IntImm):
            return importer.block_builder.emit(relax.op.take(x, relax.const(idx + int(size), "int64"), axis=dim))
        return importer.block_builder.emit(relax.op.take(x, relax.const(idx, "int64"), axis=dim, mode="wrap"))

    def slice_scatter(node, importer):
        x, src, *rest = importer.retrieve_args(node)
        dim, start, end, step = rest + [0, None, None, 1][len(rest):]
        size = x.ty.shape.values[dim % x.ty.ndim] if x.ty.shape is not None else None
        static = all(b is None or isinstance(b, int) for b in (start, end)) and isinstance(size, tirx.IntImm)
        if node.kwargs or step != 1 or not static:
            return importer._slice_scatter(node)
        dim, size = dim % x.ty.ndim, int(size)
        start, end = (min(max(b + size if b < 0 else b, 0), size)  # torch's bounds
                      for b in (start or 0, size if end is None else end))
        bb = importer.block_builder
        parts = [bb.emit(relax.op.strided_slice(x, [dim], [0], [start]))] if start > 0 else []
        parts.append(src)
        if end < size:
            parts.append(bb.emit(relax.op.strided_slice(x, [dim], [end], [size])))
        return src if len(parts) == 1 else bb.emit(relax.op.concat(parts, axis=dim))

    from .hf_static import index_put_converter

    return {"cumsum.default": cumsum, "cat.default": cat, "index_put.default": index_put_converter,
            "index.Tensor": index, "select.int": select, "slice_scatter.default": slice_scatter,
            "addmm.default": partial(_addmm, out_dtype="float32"), "div.Tensor_mode": _div_mode,
            "full.default": partial(_full_of_inf, like=False), "full_like.default": partial(_full_of_inf, like=True),
            **{name: partial(_float_of_integers, name=name) for name in _FLOAT_OF_INTEGERS},
            "topk.default": _topk, "clamp.default": _clamp, "amax.default": partial(_reduce, op="max"),
            "amin.default": partial(_reduce, op="min"), "sym_max": partial(_sym_extreme, op="max"),
            "sym_min": partial(_sym_extreme, op="min"), **_complex_converters()}


def _sym_extreme(node, importer, *, op: str):
    """``torch.sym_max`` / ``sym_min`` of symbolic sizes, which the frontend does not convert ("Unsupported
    function types ['sym_max']"): a sliding-window decode exported with a dynamic past length (HF's
    sliding-window cache keeps the last ``window - 1`` keys: ``max(past - window + 1, 0)``). Both operands
    are sizes (``PrimExpr``) or ints; the result is the same kind, as the frontend's other size arithmetic."""
    from tvm import tirx

    a, b = importer.retrieve_args(node)[:2]
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b) if op == "max" else min(a, b)
    return tirx.max(a, b) if op == "max" else tirx.min(a, b)


def _clamp(node, importer):
    """``clamp`` with constant bounds as ``maximum`` / ``minimum`` of constants in the tensor's type. The
    frontend's ``clip`` carries its bounds as float64 ``PrimValue`` operands: ``ToMixedPrecision`` fails on
    them where a matmul feeds the clamp ("Expected TensorType, but got T.float64": DeepSeek-V4's clamped
    SwiGLU), and a missing bound becomes infinity, which an integer ``clip`` cannot legalize ("Cannot convert infinity to
    BigInt": ``positions.clamp(min=0)`` builds for no target). ``min(max(x, low), high)`` is torch's
    ``clamp`` (``high`` wins where ``low > high``). Tensor bounds and other forms: the frontend's."""
    from tvm import relax

    args = importer.retrieve_args(node)
    x = args[0]
    low = args[1] if len(args) > 1 else node.kwargs.get("min")
    high = args[2] if len(args) > 2 else node.kwargs.get("max")
    bounds = [b for b in (low, high) if b is not None]
    dtype = str(getattr(getattr(x, "ty", None), "dtype", ""))
    integer = dtype.startswith(("int", "uint"))
    if (not isinstance(x, relax.Expr) or not bounds or not dtype
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or (integer and not all(isinstance(b, int) for b in bounds))):
        return importer._clamp(node)
    out = x
    if low is not None:
        out = importer.block_builder.emit(relax.op.maximum(out, relax.const(low, dtype)))
    if high is not None:
        out = importer.block_builder.emit(relax.op.minimum(out, relax.const(high, dtype)))
    return out


def _reduce(node, importer, *, op: str):
    """``torch.amax`` / ``amin`` (the frontend has no converter: "Unsupported function types ['amax.default']")
    as Relax's ``max`` / ``min`` over the same axes."""
    from tvm import relax

    args = importer.retrieve_args(node)
    dims = args[1] if len(args) > 1 else node.kwargs.get("dim", ())
    keepdim = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
    axis = None if dims in ((), []) else ([dims] if isinstance(dims, int) else list(dims))
    return importer.block_builder.emit(getattr(relax.op, op)(args[0], axis=axis, keepdims=keepdim))


def _topk(node, importer):
    """``torch.topk(x, k, dim, largest, sorted=False)`` (MoE routers: GLM-4 MoE, DeepSeek-V3's group selection)
    as the sorted top k: torch leaves the order of an unsorted result unspecified, and the values and indices
    stay paired, so the sorted one is a valid result. The frontend refuses ``sorted=False`` ("Currently
    supports only sorted output for topk operator")."""
    from tvm import relax

    args = importer.retrieve_args(node)
    x = args[0]
    k = args[1] if len(args) > 1 else node.kwargs.get("k", 1)
    dim = args[2] if len(args) > 2 else node.kwargs.get("dim", -1)
    largest = args[3] if len(args) > 3 else node.kwargs.get("largest", True)
    return importer.block_builder.emit(relax.op.topk(x, k=k, axis=dim, largest=largest, ret_type="both",
                                                     dtype="int64"))


#: ops torch computes in floating point when given integer tensors (``positions / n``, ``log(1 + positions)``)
_FLOAT_OF_INTEGERS = ("div.Tensor", "log.default", "log1p.default", "exp.default", "sin.default", "cos.default",
                      "sigmoid.default", "tanh.default")


def _float_of_integers(node, importer, *, name: str):
    """``name`` (one of :data:`_FLOAT_OF_INTEGERS`) with its integer / bool tensor operands cast to the float
    type torch gives the result, then the frontend's own converter. The frontend keeps their type: ``i / n`` of
    an int64 tensor becomes an integer division (wrong numbers, silently) and ``log`` of one fails ("requires
    the input tensor to have float dtype": Ministral 3's query scaling, ``log(1 + floor(positions / n))``)."""
    from tvm import relax

    original = getattr(importer, "_mqa_byoc_frontend_map", None)
    if original is None:
        original = importer._mqa_byoc_frontend_map = importer.create_convert_map()
    val = node.meta.get("val")
    dtype = getattr(val, "dtype", None)
    if dtype is None or not dtype.is_floating_point:
        return original[name](node)
    dtype = importer._convert_data_type(dtype, importer.env)
    swapped = {}
    for arg in node.args:
        value = importer.env.get(arg) if hasattr(arg, "meta") else None
        if isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType) and \
                str(value.ty.dtype).startswith(("int", "uint", "bool")):
            swapped[arg] = value
            importer.env[arg] = importer.block_builder.emit(relax.op.astype(value, dtype))
    try:
        return original[name](node)
    finally:
        importer.env.update(swapped)


def _full_of_inf(node, importer, *, like: bool):
    """``torch.full`` / ``full_like`` with an infinite or NaN fill (a causal mask's ``-inf``, an MoE router's
    ``full_like(logits, -inf)``) as ``broadcast_to`` of that constant: TVM legalizes the ``R.full`` the
    frontend emits through ``topi.full``, which fails on such a fill ("argument of type 'PrimType' is not
    iterable"), so the graph builds for no target. Other fills: the frontend's converter."""
    import math

    from tvm import relax

    args = importer.retrieve_args(node)
    value = args[1]
    val = node.meta.get("val")
    if like:
        shape = args[0].ty.shape if isinstance(args[0], relax.Expr) else None
    else:
        shape = relax.ShapeExpr(args[0] if isinstance(args[0], (list, tuple)) else [args[0]])
    if not (isinstance(value, float) and (math.isinf(value) or math.isnan(value))) or val is None or shape is None:
        return importer._full_like(node) if like else importer._full(node)
    dtype = importer._convert_data_type(val.dtype, importer.env)
    return importer.block_builder.emit(relax.op.broadcast_to(relax.const(value, dtype), shape))


def _div_mode(node, importer):
    """``torch.div(x, c, rounding_mode=...)`` of a tensor by a Python number, the number in the tensor's type
    (an int64 tensor divided by an int: the frontend's constant is int32 and the import fails, "Binary
    operators must have the same datatype": Llama 4's chunked mask, ``position // attention_chunk_size``); an
    integer tensor divided by a float is divided as float32, as torch promotes it. Other forms: the
    frontend's converter."""
    from tvm import relax

    x, c = importer.retrieve_args(node)[:2]
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("rounding_mode", None)
    if not (isinstance(x, relax.Expr) and isinstance(c, (int, float)) and not isinstance(c, bool)):
        return importer._div(node)
    bb, dtype = importer.block_builder, str(x.ty.dtype)
    if dtype.startswith(("int", "uint")) and (isinstance(c, float) or mode is None):
        x, dtype = bb.emit(relax.op.astype(x, "float32")), "float32"
    c = relax.const(c, dtype)
    if mode is None:
        return bb.emit(relax.op.divide(x, c))
    if mode == "floor":
        return bb.emit(relax.op.floor_divide(x, c))
    if mode == "trunc":
        q = bb.emit(relax.op.divide(x, c))
        return q if dtype.startswith(("int", "uint")) else bb.emit(relax.op.trunc(q))
    raise ValueError(f"unsupported rounding_mode {mode!r}")


#: what a complex tensor may feed, as torch.export names the ops (the rest fails the import by name)
_COMPLEX_OPS = {"aten.polar.default", "aten.view_as_complex.default", "aten.view_as_real.default",
                "aten.mul.Tensor", "aten.unsqueeze.default", "aten._assert_tensor_metadata.default",
                "aten.slice.Tensor", "aten.view.default", "aten.reshape.default"}


def _complex_parts() -> dict:
    import torch  # there whenever a torch frontend map is: the frontend needs it

    return {torch.complex32: "float16", torch.complex64: "float32", torch.complex128: "float64"}


def _complex_converters() -> dict:
    """Converters for the complex arithmetic of a complex rotary embedding (Llama 4, DeepSeek-V2:
    ``view_as_complex(x.reshape(..., -1, 2)) * polar(1, angles)`` then ``view_as_real``), which the frontend
    does not convert at all. Relax has no complex type: a complex tensor of shape (..., n) is the float
    tensor (..., n, 2) of its real and imaginary parts, so ``view_as_complex`` / ``view_as_real`` are the
    identity, ``polar`` stacks ``abs * cos`` and ``abs * sin``, a product of complex tensors is computed
    part by part, ``unsqueeze`` counts a negative axis past the parts, ``view`` / ``reshape`` keep them last
    and ``slice`` takes a non-negative axis as it is (Meta's reference Llama slices and views its
    ``freqs_cis``). A complex buffer or parameter still fails in the frontend ("input_type torch.complex64 is
    not handled yet"): store it as ``view_as_real`` of itself. A complex tensor read by any other
    op fails the import naming that op (it would otherwise be read as a float tensor of the wrong shape)."""
    import operator

    from tvm import relax

    parts_type = _complex_parts()  # the float type of a complex type's parts

    def complex_node(arg) -> bool:
        val = arg.meta.get("val") if hasattr(arg, "meta") else None
        return getattr(getattr(val, "dtype", None), "is_complex", False)

    def check_readers(node):
        for user in node.users:
            name = str(user.target)
            if name not in _COMPLEX_OPS:
                raise NotImplementedError(
                    f"{name} reads the complex tensor {node.name}: the convert map takes complex tensors only "
                    f"through {sorted(_COMPLEX_OPS)}")

    def parts(bb, x):
        return [bb.emit(relax.op.take(x, relax.const(i, "int64"), axis=-1)) for i in (0, 1)]

    def stack(bb, re, im):
        return bb.emit(relax.op.concat([bb.emit(relax.op.expand_dims(re, -1)), bb.emit(relax.op.expand_dims(im, -1))],
                                       axis=-1))

    def polar(node, importer):
        check_readers(node)
        bb = importer.block_builder
        r, theta = importer.retrieve_args(node)[:2]
        return stack(bb, bb.emit(relax.op.multiply(r, bb.emit(relax.op.cos(theta)))),
                     bb.emit(relax.op.multiply(r, bb.emit(relax.op.sin(theta)))))

    def view_as_complex(node, importer):
        check_readers(node)
        return importer.env[node.args[0]]

    def view_as_real(node, importer):
        return importer.env[node.args[0]]

    def mul(node, importer):
        a, b = node.args[:2]
        if not (complex_node(a) or complex_node(b)):
            return importer._binary_op(relax.op.multiply, operator.mul)(node)
        check_readers(node)
        bb = importer.block_builder
        x, y = importer.retrieve_args(node)[:2]
        parts_dtype = parts_type[node.meta["val"].dtype]  # torch promotes (a complex32 table by a complex64)
        x, y = (bb.emit(relax.op.astype(t, parts_dtype)) if isinstance(t, relax.Expr) and str(t.ty.dtype) != parts_dtype
                else t for t in (x, y))
        if complex_node(a) and complex_node(b):
            (xr, xi), (yr, yi) = parts(bb, x), parts(bb, y)
            mul_ = lambda u, v: bb.emit(relax.op.multiply(u, v))  # noqa: E731
            return stack(bb, bb.emit(relax.op.subtract(mul_(xr, yr), mul_(xi, yi))),
                         bb.emit(relax.op.add(mul_(xr, yi), mul_(xi, yr))))
        c, r = (x, y) if complex_node(a) else (y, x)
        if isinstance(r, relax.Expr):
            r = bb.emit(relax.op.expand_dims(r, -1)) if r.ty.ndim > 0 else r
        else:
            r = relax.const(r, c.ty.dtype)
        return bb.emit(relax.op.multiply(c, r))

    def unsqueeze(node, importer):
        x, dim = importer.env[node.args[0]], node.args[1]
        if complex_node(node.args[0]):
            check_readers(node)
            dim = dim - 1 if dim < 0 else dim
        return importer.block_builder.emit(relax.op.expand_dims(x, dim))

    def slice_(node, importer):
        if complex_node(node.args[0]):
            check_readers(node)
            if (node.args[1] if len(node.args) > 1 else 0) < 0:
                raise NotImplementedError(f"{node.name}: a slice of a complex tensor on a negative axis")
        return importer._slice(node)  # the parts' axis is last: the leading axes are the complex tensor's

    def reshape(node, importer):
        if not complex_node(node.args[0]):
            return importer._reshape(node)
        check_readers(node)
        args = importer.retrieve_args(node)
        dims = list(args[1]) if isinstance(args[1], (list, tuple)) else list(args[1:])  # torch.Size is a tuple
        return importer._emit_torch_reshape(args[0], [*dims, 2])

    return {"polar.default": polar, "view_as_complex.default": view_as_complex,
            "view_as_real.default": view_as_real, "mul.Tensor": mul, "unsqueeze.default": unsqueeze,
            "slice.Tensor": slice_, "view.default": reshape, "reshape.default": reshape}


def _addmm(node, importer, *, out_dtype: str | None):
    """``beta * bias + alpha * (a @ b)`` as torch computes it, the product of type ``out_dtype`` (None: the
    operands'), the bias cast to the product's type when it differs (the frontend's own converter adds them
    as they are, which fails for an fp16 / bf16 bias beside its float32 product)."""
    from tvm import relax

    bias, a, b = importer.retrieve_args(node)[:3]
    alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
    bb = importer.block_builder
    res = None
    if alpha != 0:
        res = bb.emit(relax.op.matmul(a, b, out_dtype=out_dtype))
        if alpha != 1:
            res = bb.emit(relax.op.multiply(res, relax.const(alpha, res.ty.dtype)))
    if beta == 0:
        return res
    if res is not None and bias.ty.dtype != res.ty.dtype:
        bias = bb.emit(relax.op.astype(bias, res.ty.dtype))
    if beta != 1:
        bias = bb.emit(relax.op.multiply(bias, relax.const(beta, bias.ty.dtype)))
    return bias if res is None else bb.emit(relax.op.add(res, bias))


def native_dtype_convert_map() -> dict:
    """``custom_convert_map`` for ``from_exported_program``: matmuls keep their input dtype.

    Replaces the converters of ``mm``, ``bmm``, ``matmul``, ``linear`` and ``addmm`` (a biased linear after
    torch.export's decompositions), which otherwise emit ``out_dtype="float32"`` (see the module docstring).
    """
    from tvm import relax

    def matmul(node, importer):
        a, b = importer.retrieve_args(node)[:2]
        return importer.block_builder.emit(relax.op.matmul(a, b))

    def linear(node, importer):
        args = importer.retrieve_args(node)
        bias = args[2] if len(args) > 2 else None
        return importer.block_builder.emit(relax.op.linear(args[0], args[1], bias))

    return {**fixes_convert_map(),
        "mm.default": matmul,
        "bmm.default": matmul,
        "matmul.default": matmul,
        "linear.default": linear,
        "addmm.default": partial(_addmm, out_dtype=None),
    }
