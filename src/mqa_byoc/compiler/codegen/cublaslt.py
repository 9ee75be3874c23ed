"""The ``cublaslt`` BYOC codegen: ``relax.ext.cublaslt``, one cuBLASLt call per offloaded GEMM.

``RunCodegen`` calls it with every function carrying ``Codegen = "cublaslt"`` (made by
:class:`mqa_byoc.compiler.graph.gemm.PartitionGemm`). For each it reads the ``cublaslt.*`` composite
(:data:`mqa_byoc.contract.GEMM_COMPOSITES`) and emits C++ exporting the function's ``global_symbol``
with the function's parameters plus the output (destination passing). The wrapper checks the tensors
against the compiled N, K and type, reads M off the output (batch x tokens, any static or symbolic
shape), takes TVM's stream (``TVMFFIEnvGetStream``) and calls ``mqa_byoc_cublaslt_gemm`` of
``mqa_byoc/native/cublaslt_gemm.cc``, which :func:`mqa_byoc.export_library` compiles and links (the
source carries :data:`GEMM_MARKER`). The dispatcher is referenced weakly: a library exported without
it loads and its GEMMs fail with a message naming ``mqa_byoc.export_library``.

At run time the library needs TVM's runtime and ``libcublasLt.so.13`` (the ``nvidia-cublas`` wheel,
``pip install "mqa-byoc[gemm]"``), opened at the first GEMM; see ``native/cublaslt_gemm.cc`` for where
it is looked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax

from mqa_byoc.compiler.cublaslt_build import GEMM_MARKER
from mqa_byoc.contract import GEMM_CODEGEN, GEMM_COMPOSITES, parse_gemm_composite

__all__ = ["GEMM_MARKER", "GemmCodegenError", "GemmCodegenSite", "cublaslt_codegen", "emit_gemm_source",
           "find_gemm_site", "register"]

_EPILOGUE_CODE = {None: 0, "bias": 1, "relu": 2, "gelu_tanh": 3}
#: operand type -> (the dispatcher's type code, DLPack type code, bits)
_DTYPE = {"float16": (0, "kDLFloat", 16), "bfloat16": (1, "kDLBfloat", 16)}
#: output type -> (what it adds to the type code, DLPack type code, bits); None: the operands' type
_OUT_DTYPE = {None: (0, None, None), "float32": (2, "kDLFloat", 32)}


class GemmCodegenError(ValueError):
    """A ``cublaslt`` function the codegen cannot turn into a cuBLASLt call."""


@dataclass(frozen=True)
class GemmCodegenSite:
    """One offloaded GEMM read off its ``Codegen`` function.

    ``x``, ``weight``, ``bias``, ``residual``: the positions of those operands among the function's
    parameters (None when absent); ``shape_params``: parameters of type ``R.Shape`` (ignored)."""

    symbol: str
    composite_name: str
    dtype: str
    n: int
    k: int
    transposed: bool
    activation: str | None
    x: int
    weight: int
    bias: int | None
    residual: int | None
    num_inputs: int
    shape_params: tuple[int, ...] = ()
    out_dtype: str | None = None  # the output's (and bias' and residual's) type when not ``dtype``
    batch_axes: int = 0  # leading axes x and the weight share (a batched GEMM); 0: a 2-D weight


def _attr(func, key):
    attrs = func.attrs
    return attrs[key] if attrs is not None and key in attrs else None


def _composite_call(func, symbol):
    bindings = [b for block in func.body.blocks for b in block.bindings]
    local = {b.var: b.value for b in bindings if isinstance(b.value, relax.Function)}
    calls = [(b.var, b.value, local[b.value.op]) for b in bindings
             if isinstance(b.value, relax.Call) and b.value.op in local]
    if len(calls) != 1 or len(bindings) != len(local) + 1:
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): expected exactly one composite call in the function")
    var, call, comp = calls[0]
    outer = []
    for j, arg in enumerate(call.args):
        idx = next((i for i, p in enumerate(func.params) if p.same_as(arg)), None)
        if idx is None:
            raise GemmCodegenError(f"cublaslt codegen ({symbol}): composite argument {j} `{arg}` is not a parameter "
                                   "(partition with bind_constants=False)")
        outer.append(idx)
    return str(_attr(comp, "Composite")), comp, outer


def find_gemm_site(func: relax.Function) -> GemmCodegenSite:
    """Read the ``cublaslt.*`` composite of a ``Codegen`` function.

    Raises
    ------
    GemmCodegenError
        When the function is not one GEMM composite on its parameters.
    """
    symbol = _attr(func, "global_symbol")
    if symbol is None or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(symbol)):
        raise GemmCodegenError(f"cublaslt codegen: global_symbol {symbol!r} is not a C identifier")
    symbol = str(symbol)
    if _attr(func, "Composite") is not None:
        name, comp, outer = str(_attr(func, "Composite")), func, list(range(len(func.params)))
    else:
        name, comp, outer = _composite_call(func, symbol)
    if name not in GEMM_COMPOSITES:
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): unknown composite {name!r}; expected one of {GEMM_COMPOSITES}")
    fields = parse_gemm_composite(name)
    values = {b.var: b.value for block in comp.body.blocks for b in block.bindings}
    param_index = {p: outer[j] for j, p in enumerate(comp.params)}

    def resolve(e):
        while isinstance(e, relax.Var) and e in values:
            e = values[e]
        return e

    def param(e, what):
        e = resolve(e) if not (isinstance(e, relax.Var) and e in param_index) else e
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == "relax.permute_dims" and what == "weight":
            e = e.args[0]
        if not (isinstance(e, relax.Var) and e in param_index):
            raise GemmCodegenError(f"cublaslt codegen ({symbol}): the {what} is not a parameter of the composite")
        return e

    matmul = next((v for v in values.values() if isinstance(v, relax.Call)
                   and getattr(v.op, "name", None) == "relax.matmul"), None)
    if matmul is None:
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): no matmul in composite {name}")
    adds = [v for v in values.values() if isinstance(v, relax.Call) and getattr(v.op, "name", None) == "relax.add"]

    def other_operand(add):
        a, b = add.args
        # the operand that is a composite parameter and not reached from the matmul
        for cand, rest in ((a, b), (b, a)):
            if isinstance(cand, relax.Var) and cand in param_index and not (
                    isinstance(rest, relax.Var) and rest in param_index):
                return cand
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): cannot tell the added operand of `{add}`")

    bias = residual = None
    if fields["bias"]:
        bias = param_index[other_operand(adds[0])]
    if fields["residual"]:
        residual = param_index[other_operand(adds[-1])]
    x_var, w_var = param(matmul.args[0], "x"), param(matmul.args[1], "weight")
    w_dims = list(w_var.ty.shape.values)
    batch_axes = len(w_dims) - 2
    try:
        w_shape = [int(d) for d in w_dims[-2:]]
        k = int(x_var.ty.shape.values[-1])
        n = int(matmul.ty.shape.values[-1])
    except TypeError as err:
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): K and N must be static") from err
    if w_shape != ([n, k] if fields["transposed"] else [k, n]):
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): weight {w_shape} does not match N={n}, K={k}")
    if batch_axes and len(x_var.ty.shape.values) != len(w_dims):
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): a batched weight needs x of the same rank")
    dtype, out_dtype = str(x_var.ty.dtype), str(matmul.ty.dtype)
    if fields["cast"]:  # astype of the float32 result: cuBLASLt writes the cast's type directly
        cast = next((v for v in values.values() if isinstance(v, relax.Call)
                     and getattr(v.op, "name", None) == "relax.astype"), None)
        if cast is None or str(cast.ty.dtype) != dtype:
            raise GemmCodegenError(f"cublaslt codegen ({symbol}): composite {name} does not cast to the operands' "
                                   f"type {dtype}")
        out_dtype = dtype
    if dtype not in _DTYPE or str(w_var.ty.dtype) != dtype:
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): operands {dtype} x {w_var.ty.dtype} are not both fp16 "
                               "or both bf16")
    out_dtype = None if out_dtype == dtype else out_dtype
    if out_dtype not in _OUT_DTYPE:
        raise GemmCodegenError(f"cublaslt codegen ({symbol}): output {out_dtype} from {dtype} operands; cuBLASLt here "
                               f"writes {dtype} or float32")
    shape_params = tuple(i for i, p in enumerate(func.params) if isinstance(p.ty, relax.ShapeType))
    return GemmCodegenSite(symbol, name, dtype, n, k, fields["transposed"], fields["activation"],
                           param_index[x_var], param_index[w_var], bias, residual,
                           len(func.params), shape_params, out_dtype, batch_axes)


_PRELUDE = r"""// Generated by mqa_byoc.compiler.cublaslt_codegen: cuBLASLt GEMMs of offloaded Relax matmuls.
@MARKER@
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

// mqa_byoc/native/cublaslt_gemm.cc, linked in by mqa_byoc.export_library. Weak, so that a library
// exported without it still loads and fails here with a clear message.
extern "C" __attribute__((weak)) int mqa_byoc_cublaslt_gemm(int device_id, void* stream, int dtype, int transposed,
                                                          int epilogue, int64_t batch, int64_t m, int64_t n,
                                                          int64_t k, const void* x, const void* w,
                                                          const void* bias, const void* residual, void* out);
extern "C" __attribute__((weak)) const char* mqa_byoc_cublaslt_last_error(void);

namespace {

const void* gemm_data(const DLTensor* t) { return static_cast<const char*>(t->data) + t->byte_offset; }

// t must be compact row-major, of type `code`/`bits`, on device `dev`, with last axis `last`; returns
// the product of its other axes (the rows).
int64_t gemm_check(const DLTensor* t, const char* symbol, const char* what, uint8_t code, int bits, int dev,
                   int64_t last, int min_ndim) {
  if (t->dtype.code != code || t->dtype.bits != bits || t->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << symbol << ": " << what << " has the wrong element type";
  }
  if (t->device.device_type != kDLCUDA || t->device.device_id != dev) {
    TVM_FFI_THROW(ValueError) << symbol << ": " << what << " must be on the CUDA device of x";
  }
  if (t->ndim < min_ndim || t->shape[t->ndim - 1] != last) {
    TVM_FFI_THROW(ValueError) << symbol << ": " << what << " must end in an axis of " << last;
  }
  int64_t rows = 1, expect = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->strides != nullptr && t->shape[i] != 1 && t->strides[i] != expect) {
      TVM_FFI_THROW(ValueError) << symbol << ": " << what << " must be contiguous (row-major)";
    }
    expect *= t->shape[i];
    if (i < t->ndim - 1) rows *= t->shape[i];
  }
  return rows;
}

// The product of t's first `axes` axes (a batched GEMM's batch), each equal to x's same axis.
int64_t gemm_batch(const DLTensor* t, const DLTensor* x, const char* symbol, const char* what, int axes) {
  int64_t batch = 1;
  for (int i = 0; i < axes; ++i) {
    if (t->ndim != x->ndim || t->shape[i] != x->shape[i]) {
      TVM_FFI_THROW(ValueError) << symbol << ": " << what << " must have x's batch axes";
    }
    batch *= t->shape[i];
  }
  return batch;
}

void gemm_call(const char* symbol, int dev, int dtype, int transposed, int epilogue, int64_t batch, int64_t m,
               int64_t n, int64_t k, const DLTensor* x, const DLTensor* w, const DLTensor* bias,
               const DLTensor* residual, DLTensor* out) {
  if (mqa_byoc_cublaslt_gemm == nullptr) {
    TVM_FFI_THROW(RuntimeError) << symbol << ": the cuBLASLt dispatcher is not linked into this library. Export it "
                                << "with mqa_byoc.export_library(executable, path) (a plain export_library does "
                                << "not link it), or partition with gemm=False.";
  }
  void* stream = TVMFFIEnvGetStream(kDLCUDA, dev);
  int rc = mqa_byoc_cublaslt_gemm(dev, stream, dtype, transposed, epilogue, batch, m, n, k, gemm_data(x), gemm_data(w),
                                  bias ? gemm_data(bias) : nullptr, residual ? gemm_data(residual) : nullptr,
                                  const_cast<void*>(gemm_data(out)));
  if (rc != 0) {
    TVM_FFI_THROW(RuntimeError) << symbol << ": " << mqa_byoc_cublaslt_last_error();
  }
}

}  // namespace
"""

_SITE = r"""
// ---- @SYMBOL@: @COMPOSITE@, N=@N@ K=@K@ @DTYPE@@OUT_NOTE@
namespace {
namespace mqa_byoc_gemm_@SYMBOL@ {
int run(@PARAMS@, DLTensor* out) {
  const char* s = "@SYMBOL@";
  const int dev = @X@->device.device_id;
  const int64_t rows = gemm_check(@X@, s, "x", @CODE@, 16, dev, @K@, 2 + @BATCH_AXES@);
  const int64_t batch = gemm_batch(@X@, @X@, s, "x", @BATCH_AXES@), m = batch ? rows / batch : 0;
  const int64_t w_rows = gemm_check(@W@, s, "the weight", @CODE@, 16, dev, @W_LAST@, 2);
  if (@W@->ndim != 2 + @BATCH_AXES@ || gemm_batch(@W@, @X@, s, "the weight", @BATCH_AXES@) != batch ||
      w_rows != batch * @W_ROWS@) {
    TVM_FFI_THROW(ValueError) << s << ": the weight must be (@W_BATCH@@W_ROWS@, @W_LAST@)";
  }
  if (gemm_check(out, s, "out", @OUT_CODE@, dev, @N@, 2) != rows) {
    TVM_FFI_THROW(ValueError) << s << ": out must have x's rows";
  }
@BIAS_CHECK@@RESIDUAL_CHECK@  gemm_call(s, dev, @DT@, @TRANSPOSED@, @EPILOGUE@, batch, m, @N@, @K@, @X@, @W@, @BIAS@, @RESIDUAL@, out);
  return 0;
}
}  // namespace mqa_byoc_gemm_@SYMBOL@
}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, mqa_byoc_gemm_@SYMBOL@::run);
"""


def emit_gemm_source(site: GemmCodegenSite, prelude: bool = True) -> str:
    """C++ exporting ``site.symbol(inputs..., out)`` that runs the GEMM on cuBLASLt."""
    dt, code, bits = _DTYPE[site.dtype]
    out_dt, out_code, out_bits = _OUT_DTYPE[site.out_dtype]
    out_code = f"{out_code or code}, {out_bits or bits}"  # the output's, bias' and residual's type
    params = ", ".join(f"tvm::ffi::Shape in{i}" if i in site.shape_params else f"DLTensor* in{i}"
                       for i in range(site.num_inputs))
    bias_check = residual_check = ""
    if site.bias is not None:
        b = f"in{site.bias}"
        bias_check = (f"  if (gemm_check({b}, s, \"the bias\", {out_code}, dev, {site.n}, 1) != 1) {{\n"
                      f"    TVM_FFI_THROW(ValueError) << s << \": the bias must hold {site.n} elements\";\n  }}\n")
    if site.residual is not None:
        r = f"in{site.residual}"
        residual_check = (f"  if (gemm_check({r}, s, \"the residual\", {out_code}, dev, {site.n}, 2) != rows) {{\n"
                          "    TVM_FFI_THROW(ValueError) << s << \": the residual must have the output's shape\";\n  }\n")
    epilogue = 0 if site.bias is None else _EPILOGUE_CODE[site.activation or "bias"]
    fields = {
        "@SYMBOL@": site.symbol, "@COMPOSITE@": site.composite_name, "@N@": str(site.n), "@K@": str(site.k),
        "@DTYPE@": site.dtype, "@PARAMS@": params, "@X@": f"in{site.x}", "@W@": f"in{site.weight}",
        "@CODE@": code, "@OUT_CODE@": out_code, "@DT@": str(dt + out_dt),
        "@OUT_NOTE@": f" -> {site.out_dtype}" if site.out_dtype else "", "@TRANSPOSED@": "1" if site.transposed else "0",
        "@W_ROWS@": str(site.n if site.transposed else site.k), "@W_LAST@": str(site.k if site.transposed else site.n),
        "@EPILOGUE@": str(epilogue), "@BATCH_AXES@": str(site.batch_axes),
        "@W_BATCH@": "x's batch axes, " if site.batch_axes else "", "@BIAS@": f"in{site.bias}" if site.bias is not None else "nullptr",
        "@RESIDUAL@": f"in{site.residual}" if site.residual is not None else "nullptr",
        "@BIAS_CHECK@": bias_check, "@RESIDUAL_CHECK@": residual_check,
    }
    code_text = _SITE
    for key, value in fields.items():
        code_text = code_text.replace(key, value)
    return (_PRELUDE.replace("@MARKER@", GEMM_MARKER) if prelude else "") + code_text


def cublaslt_codegen(funcs, options=None, constant_names=None) -> list:
    """``relax.ext.cublaslt``: one C source module holding every GEMM wrapper."""
    sites = [find_gemm_site(f) for f in funcs]
    if not sites:
        return []
    code = _PRELUDE.replace("@MARKER@", GEMM_MARKER) + "".join(emit_gemm_source(s, prelude=False) for s in sites)
    create = tvm.get_global_func("runtime.CSourceModuleCreate")
    return [create(code, "cc", [s.symbol for s in sites], [])]


def register() -> None:
    """Register ``relax.ext.cublaslt`` (done on import; idempotent)."""
    tvm_ffi.register_global_func("relax.ext." + GEMM_CODEGEN, cublaslt_codegen, override=True)


register()
