"""Relax graphs of GEMM sites for the GEMM tests (CPU and GPU): one matmul with an epilogue each."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

#: (transposed, bias, activation, residual) of each composite, and the op that spells the activation
FORMS = [(t, b, a, r) for t in (True, False)
         for b, a, r in ((True, None, True), (True, "gelu_tanh", False), (True, "relu", False),
                         (True, None, False), (False, None, True), (False, None, False))]
ACTIVATION_OPS = {"gelu_tanh": relax.op.nn.gelu_tanh, "relu": relax.op.nn.relu, "gelu": relax.op.nn.gelu,
                  "silu": relax.op.nn.silu}


def gemm_graph(transposed=True, bias=False, activation=None, residual=False, *, dtype="float16",
               rows=(2, "n"), k=64, n=128, weight_const=False, seed=0, bias_shape=None, residual_first=True,
               function="main", out_dtype=None, batch=(), cast=None, cast_used_elsewhere=False, flattened=False):
    """``main(x, [w], [b], [r])`` computing one GEMM site: x (*rows, K) @ w (K, N) or permute_dims(w (N, K)),
    ``+ b``, activation, ``+ r``. ``rows``: ints or names of symbolic axes. ``weight_const``: w is a constant
    (drawn with ``seed``). ``out_dtype``: the matmul's (and the bias' and residual's) type, default ``dtype``.
    ``batch``: axes (ints or names) leading both x and w, a batched GEMM (w (*batch, K, N), its permute
    swapping the last two axes). ``cast``: ``R.astype`` of the result to this type last (``ToMixedPrecision``'s
    form, with ``out_dtype="float32"``); ``cast_used_elsewhere``: the result before the cast is returned too.
    ``flattened``: torch.export's form of a linear layer: x reshaped to (prod(rows), K) for the matmul and
    the bias add, reshaped back to (*rows, N) before the activation and the residual add.
    Returns (module, parameter specs [(name, shape, dtype)])."""
    out_dtype = out_dtype or dtype
    syms = {}
    rows = (*batch, *rows)
    row_dims = [syms.setdefault(d, tirx.Var(d, "int64")) if isinstance(d, str) else d for d in rows]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([*row_dims, k], dtype))
    params, specs = [x], [("x", (*rows, k), dtype)]
    w_shape = (*batch, n, k) if transposed else (*batch, k, n)
    if weight_const:
        if dtype == "bfloat16":
            raise ValueError("this helper makes constant weights of numpy types only (not bfloat16)")
        # drawn through fp16, so that a float32 twin of the graph holds the same values
        w = relax.const((np.random.default_rng(seed).standard_normal(w_shape) * 0.1).astype("float16").astype(dtype))
    else:
        w = relax.Var("w", relax.TensorType([*row_dims[:len(batch)], *w_shape[len(batch):]], dtype))
        params.append(w)
        specs.append(("w", w_shape, dtype))
    b = r = None
    if bias:
        b = relax.Var("b", relax.TensorType(bias_shape or (n,), out_dtype))
        params.append(b)
        specs.append(("b", bias_shape or (n,), out_dtype))
    if residual:
        r = relax.Var("r", relax.TensorType([*row_dims, n], out_dtype))
        params.append(r)
        specs.append(("r", (*rows, n), out_dtype))
    with bb.function(function, params):
        with bb.dataflow():
            nb = len(batch)
            rhs = bb.emit(relax.op.permute_dims(w, list(range(nb)) + [nb + 1, nb] if nb else None)) if transposed else w
            lhs = x
            if flattened:
                flat = row_dims[0]
                for d in row_dims[1:]:
                    flat = flat * d
                lhs = bb.emit(relax.op.reshape(x, [flat, k]))
            y = bb.emit(relax.op.matmul(lhs, rhs, out_dtype=None if out_dtype == dtype else out_dtype))
            if b is not None:
                y = bb.emit(relax.op.add(y, b))
            if flattened:
                y = bb.emit(relax.op.reshape(y, [*row_dims, n]))
            if activation is not None:
                y = bb.emit(ACTIVATION_OPS[activation](y))
            if r is not None:
                y = bb.emit(relax.op.add(r, y) if residual_first else relax.op.add(y, r))
            if cast is not None:
                c = bb.emit(relax.op.astype(y, cast))
                y = relax.Tuple([c, y]) if cast_used_elsewhere else c
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), specs


def quantized_weight_graph(form, *, dtype="float16", function="main"):
    """``function(x, ...)``: x (1, 256) @ W^T with W (128, 256) computed in the graph: ``int4_ops`` /
    ``int4_call_tir``: dequantized from packed int4 (8 nibbles a uint32 word, a scale per 32 elements) by
    relax ops, or by one TIR function as mlc-llm's group quantization emits it; ``fp8``: cast from float8;
    ``fp32_param``: cast from a float32 parameter (``ToMixedPrecision`` on unbound weights); ``experts``:
    gathered from 4 experts by an index (x (2, 1, 256), a batched GEMM). ``dtype``: of x, the scales and
    W (float32 for a reference). Returns (module, parameter specs [(name, shape, dtype)])."""
    from tvm import te

    specs = {"int4_ops": [("x", (1, 256), dtype), ("w_q", (128, 32), "uint32"), ("w_scale", (128, 8), dtype)],
             "fp8": [("x", (1, 256), dtype), ("w_fp8", (128, 256), "float8_e4m3fn")],
             "fp32_param": [("x", (1, 256), dtype), ("w", (128, 256), "float32")],
             "experts": [("xb", (2, 1, 256), dtype), ("experts", (4, 256, 128), dtype), ("expert_ids", (2,), "int64")]}
    specs["int4_call_tir"] = specs["int4_ops"]
    params = [relax.Var(n, relax.TensorType(list(shape), dt)) for n, shape, dt in specs[form]]
    bb = relax.BlockBuilder()
    with bb.function(function, params):
        with bb.dataflow():
            if form == "int4_ops":
                wq, scale = params[1:]
                shifts = relax.const(np.arange(0, 32, 4, dtype="uint32").reshape(1, 1, 8))
                q = bb.emit(relax.op.bitwise_and(relax.op.right_shift(relax.op.expand_dims(wq, 2), shifts),
                                                 relax.const(15, "uint32")))
                qf = bb.emit(relax.op.reshape(relax.op.astype(q, dtype), [128, 8, 32]))
                w = bb.emit(relax.op.reshape(relax.op.multiply(qf, relax.op.expand_dims(scale, 2)), [128, 256]))
            elif form == "int4_call_tir":
                def dequantize(q, s):
                    return te.compute((128, 256), lambda i, j: ((q[i, j // 8] >> ((j % 8) * 4).astype("uint32"))
                                                                 & 15).astype(dtype) * s[i, j // 32],
                                      name="dequantize")
                w = bb.emit_te(dequantize, *params[1:])
            elif form in ("fp8", "fp32_param"):
                w = bb.emit(relax.op.astype(params[1], dtype))
            if form == "experts":
                y = bb.emit(relax.op.matmul(params[0], bb.emit(relax.op.take(params[1], params[2], axis=0))))
            else:
                y = bb.emit(relax.op.matmul(params[0], relax.op.permute_dims(w)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), specs[form]


def draw_inputs(specs, sizes=None, seed=0):
    """numpy arrays for ``specs`` with symbolic axes set from ``sizes`` (default 3); weights scaled by 0.1,
    scales (``*_scale``) by 0.01; integer tensors uniform over their type (packed quantized weights)."""
    rng = np.random.default_rng(seed)
    sizes = dict(sizes or {})
    out = []
    for name, shape, dtype in specs:
        concrete = [sizes.get(d, 3) if isinstance(d, str) else d for d in shape]
        if dtype.startswith(("int", "uint")):
            info = np.iinfo(dtype)
            out.append(rng.integers(info.min, info.max, concrete, dtype=dtype, endpoint=True))
            continue
        a = rng.standard_normal(concrete) * (0.1 if name == "w" else 0.01 if name.endswith("_scale") else 1.0)
        out.append(a.astype("float32" if dtype == "bfloat16" else dtype))
    return out


def run_llvm_outputs(mod, arrays, function="main") -> list:
    """``function`` of ``mod`` on llvm; each of its outputs (one, or a tuple's fields) as float32."""
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    res = vm[function](*[tvm.runtime.tensor(a) for a in arrays])
    return [r.numpy().astype("float32") for r in ([res] if hasattr(res, "numpy") else res)]


def run_llvm(mod, arrays, function="main"):
    """``function`` of ``mod`` on llvm; the output as float32."""
    [out] = run_llvm_outputs(mod, arrays, function)
    return out
