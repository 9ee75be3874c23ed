"""Codegen of ``flash_attn.attention_var_len`` composites, for every provider (native and hopper
link FA2's var-len forward, python forwards to the run-time registry).

The ``Codegen`` function's parameters are the composite's operands in whatever order (and with
whatever de-duplication: TVM's Python API passes ``seqstart_q`` for an omitted ``seqstart_k`` and
``max_seqlen_q`` for ``max_seqlen_k``) ``FuseOpsByPattern`` gave them, possibly followed by ``R.Shape``
parameters; :func:`find_var_len_site` maps the seven operands of ``R.nn.attention_var_len`` to them.
The emitted function ``<symbol>(inputs..., out)`` checks them against the compiled
:class:`~.spec.AttentionSpec` and calls

- native: ``mqa_byoc_fa2_varlen_forward`` (``native/fa2_dispatch.cc``) with the seqstarts as device
  pointers (FA2's ``cu_seqlens``) and the max lengths as ints;
- hopper: the same, and before it FA4's sm90 var-len forward (``native/fa4_ragged.cu`` around the
  "varlen" / "varlen_causal" objects, :func:`fa4_var_len_key`) for sites without a window, head dims
  64/128, when the operands suit its TMA loads and, for a causal site, q and K/V share one seqstart (a
  sequence with more query rows than keys is FA2's case: it writes zeros where a row sees no key);
  the kernel option ``hopper_fa4="never"`` keeps FA2;
- python: the global function ``mqa_byoc.flash_attn_varlen_forward`` (``runtime/varlen_provider.py``).

``max_seqlen_q`` / ``max_seqlen_k`` are read where they live: a host tensor (TVM's CUTLASS tests put
them there with ``R.to_vdevice(..., "llvm:0")``) gives its value (clamped to the total length); a
device tensor is not read (that would synchronize the stream) and the total length bounds the
grid instead: correct, with more (empty) thread blocks. The value is trusted like FA2's
``max_seqlen``: one below a real sequence length leaves rows of that sequence unwritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tvm
from tvm import relax

from mqa_byoc.contract import PY_VAR_LEN_FORWARD_FUNC

from mqa_byoc.compiler.codegen.python import py_function_lookup
from mqa_byoc.compiler.codegen.sites import CodegenError, composite_call, composite_name_of
from mqa_byoc.compiler.graph.exprs import get_attr
from mqa_byoc.compiler.graph.spec import MAX_HEAD_DIM, SUPPORTED_DTYPES, AttentionSpec, static_shape
from mqa_byoc.compiler.graph.varlen import COMPOSITE, VAR_LEN_OP

OPERANDS = ("q", "k", "v", "seqstart_q", "seqstart_k", "max_seqlen_q", "max_seqlen_k")


class VarLenCodegenError(CodegenError):
    """A ``flash_attn.attention_var_len`` function the codegen cannot turn into a kernel call."""


@dataclass(frozen=True)
class VarLenCodegenSite:
    """One offloaded var-len attention, read off its ``Codegen`` function (the graph stage's site of
    the same form is :class:`mqa_byoc.compiler.graph.varlen.VarLenSite`)."""

    symbol: str
    spec: AttentionSpec
    arg_map: tuple[int, ...]  # operand OPERANDS[i] is input arg_map[i] of the Codegen function
    num_inputs: int
    shape_params: tuple[int, ...]


def is_var_len(func) -> bool:
    """Whether a ``Codegen="flash_attn"`` function holds a ``flash_attn.attention_var_len`` composite."""
    return composite_name_of(func) == COMPOSITE


def find_var_len_site(func) -> VarLenCodegenSite:
    """Read the spec and the operand-to-parameter map off a var-len ``Codegen`` function."""
    symbol = str(get_attr(func.attrs, "global_symbol") or "")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", symbol):
        raise VarLenCodegenError(f"flash_attn codegen: global_symbol {symbol!r} is not a C identifier")
    params = list(func.params)
    if get_attr(func.attrs, "Composite") is not None:
        composite, outer = func, list(range(len(params)))
    else:
        _, composite, outer = composite_call(func, symbol, VarLenCodegenError)
    body = {b.var: b.value for block in composite.body.blocks for b in block.bindings}
    att = composite.body.body
    while isinstance(att, relax.Var) and att in body:
        att = body[att]
    if not (isinstance(att, relax.Call) and isinstance(att.op, tvm.ir.Op) and att.op.name == VAR_LEN_OP):
        raise VarLenCodegenError(f"flash_attn codegen ({symbol}): composite body is not one R.nn.attention_var_len")
    inner = list(composite.params)
    arg_map = []
    for name, operand in zip(OPERANDS, att.args):
        idx = next((j for j, p in enumerate(inner) if p.same_as(operand)), None)
        if idx is None:
            raise VarLenCodegenError(f"flash_attn codegen ({symbol}): operand {name} is `{operand}`, "
                                     "not a composite parameter")
        arg_map.append(outer[idx])
    shape_params = tuple(i for i, p in enumerate(params) if isinstance(p.ty, relax.ShapeType))
    return VarLenCodegenSite(symbol, spec_of_call(att, symbol), tuple(arg_map), len(params), shape_params)


def spec_of_call(att, symbol="composite") -> AttentionSpec:
    """The :class:`AttentionSpec` of a canonical ``R.nn.attention_var_len`` call (BSNH operands)."""
    try:
        q, k, v = (static_shape(a.ty, n) for a, n in zip(att.args[:3], "qkv"))
    except ValueError as err:
        raise VarLenCodegenError(f"flash_attn codegen ({symbol}): {err}") from err
    dtypes = {str(a.ty.dtype) for a in att.args[:3]}
    (h, d), (hkv, dk), (hv, dv) = q[2:], k[2:], v[2:]
    problem = None
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        problem = f"q, k, v dtypes {sorted(dtypes)}: FA2 needs all float16 or all bfloat16"
    elif not (d == dk == dv) or d > MAX_HEAD_DIM or d % 8:
        problem = f"head dims q {d}, k {dk}, v {dv}: FA2 needs one head dim, a multiple of 8 up to {MAX_HEAD_DIM}"
    elif hv != hkv or hkv < 1 or h % hkv:
        problem = f"{h} query heads cannot share k {hkv} / v {hv} heads"
    elif any(str(a.ty.dtype) != "int32" for a in att.args[3:7]):
        problem = "seqstart and max_seqlen operands must be int32"
    if problem:
        raise VarLenCodegenError(f"flash_attn codegen ({symbol}): {problem}")
    attrs = att.attrs
    scale = float(attrs.scale.value) if attrs.scale is not None else AttentionSpec.default_scale(d)
    window = int(attrs.window_size) if attrs.window_size is not None else None
    wl, wr = (-1, -1) if window is None else (window - 1, 0)
    return AttentionSpec(h, hkv, d, dv, next(iter(dtypes)), scale, attrs.causal_mask is not None, wl, wr)


def _inputs(site: VarLenCodegenSite, tensor_type: str) -> str:
    return ", ".join(f"{'tvm::ffi::Shape' if i in site.shape_params else tensor_type} in{i}"
                     for i in range(site.num_inputs))


def _operand_lines(site: VarLenCodegenSite, tensor_type: str) -> str:
    return "\n".join(f"  {tensor_type} {name} = in{i};" for name, i in zip(OPERANDS, site.arg_map))


# --------------------------------------------------------------------------- python provider
_PY_HELPERS = r"""
#ifndef MQA_BYOC_VARLEN_PY_HELPERS
#define MQA_BYOC_VARLEN_PY_HELPERS
namespace {
@LOOKUP@}  // namespace
#endif
"""


def emit_python_forwarder(site: VarLenCodegenSite) -> str:
    """C++ exporting ``symbol(inputs..., out)`` that forwards to ``mqa_byoc.flash_attn_varlen_forward``
    (the checks are the Python function's)."""

    spec = site.spec
    lookup = py_function_lookup("MqaByocPyVarLenForward", PY_VAR_LEN_FORWARD_FUNC)
    return _PY_HELPERS.replace("@LOOKUP@", lookup) + f"""
// ---- {site.symbol}: var-len, {spec.num_q_heads} query heads over {spec.num_kv_heads} K/V heads, head dim {spec.head_dim}, {spec.dtype}
namespace {{
namespace mqa_byoc_{site.symbol} {{
void Run({_inputs(site, 'tvm::ffi::Tensor')}, tvm::ffi::Tensor out) {{
{_operand_lines(site, 'tvm::ffi::Tensor')}
  MqaByocPyVarLenForward()(q, k, v, seqstart_q, seqstart_k, max_seqlen_q, max_seqlen_k, out,
                           {float(spec.scale)!r}, {"true" if spec.causal else "false"},
                           static_cast<int64_t>({int(spec.window_left)}), static_cast<int64_t>({int(spec.window_right)}),
                           static_cast<int64_t>({spec.num_q_heads}), static_cast<int64_t>({spec.num_kv_heads}),
                           static_cast<int64_t>({spec.head_dim}));
}}
}}  // namespace mqa_byoc_{site.symbol}
}}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC({site.symbol}, mqa_byoc_{site.symbol}::Run);
"""


# --------------------------------------------------------------------------- native provider
def fa4_var_len_key(spec: AttentionSpec):
    """The FA4 var-len object the hopper provider runs ``spec`` on, or None (FA2): the site's FA4 key
    (:func:`mqa_byoc.compiler.codegen.hopper.kernel_key`: head dims, dtypes, no sinks or soft-cap)
    without a sliding window, as its var-len mask."""
    from mqa_byoc.compiler.codegen import hopper as hopper_codegen
    from mqa_byoc.kernels import hopper

    key = hopper_codegen.kernel_key(spec)
    if key is None or key.mask == "local":
        return None
    return hopper.HopperKernelKey(key.dtype, key.head_dim, key.group, "varlen_causal" if key.mask == "causal" else "varlen")


def emit_native_source(site: VarLenCodegenSite, hopper: bool = False):
    """:class:`~.native_codegen.NativeSource` of the wrapper calling ``mqa_byoc_fa2_varlen_forward``
    (``hopper``: FA4's var-len forward first, where :func:`fa4_var_len_key` has an object)."""
    from mqa_byoc.kernels import hopper as _hopper
    from mqa_byoc.kernels import marker_line, plan_kernels

    from mqa_byoc.compiler.codegen.native import SPEC_MARKER, NativeSource, check_spec, fill_template, spec_fields

    spec = site.spec
    fa4 = fa4_var_len_key(spec) if hopper else None
    check_spec(site.symbol, spec)
    # the same families as fixed-length attention; var-len runs the plain (non-split) kernels only
    kernels = tuple(key for key in plan_kernels(spec) if not key.split)
    spec_line = (f"{SPEC_MARKER} symbol={site.symbol} var_len=1 H={spec.num_q_heads} H_kv={spec.num_kv_heads} "
                 f"D={spec.head_dim} dtype={spec.dtype} scale={float(spec.scale)!r} causal={int(spec.causal)} "
                 f"window=({spec.window_left},{spec.window_right})")
    code = fill_template(_NATIVE_TEMPLATE, {
        "@MARKER@": marker_line(kernels) + ("\n" + _hopper.marker_line([fa4]) if fa4 else ""),
        "@SPEC@": spec_line,
        "@FA4_DECL@": _FA4_DECL.replace("@FA4SYM@", fa4.symbol).replace("@RAGGED_DECL@", _hopper.RAGGED_DECL)
                      if fa4 else "",
        "@FA4_CALL@": _FA4_CALL.replace("@FA4SYM@", fa4.symbol) if fa4 else "",
        "@INPUTS@": _inputs(site, "DLTensor*"),
        "@OPERANDS@": _operand_lines(site, "DLTensor*"),
        **spec_fields(site.symbol, spec),
    })
    return NativeSource(code, kernels)


_FA4_DECL = r"""
// FA4's sm90 var-len forward (hopper provider; flash-attn-4, compiled by mqa_byoc.kernels.hopper_aot) and
// native/fa4_ragged.cu around it. Weak: a library exported without them fails with a hint.
extern "C" __attribute__((weak)) int __tvm_ffi_@FA4SYM@(void* self, const TVMFFIAny* args, int32_t num_args,
                                                         TVMFFIAny* result);
@RAGGED_DECL@
// the library's hopper_fa4 kernel option (fa2_dispatch.h's mqa_byoc_kernel_options; 2: "never")
extern "C" __attribute__((weak, visibility("hidden"))) const struct mqa_byoc_varlen_options_view {
  int decode_kernel, decode_merge, split_combine, hopper_fa4;
} mqa_byoc_library_kernel_options;
"""

_FA4_CALL = r"""
  {
    const DLTensor* ts[4] = {q, k, v, out};
    const int64_t* st[4] = {qs, ks, vs, os};
    bool ok = &mqa_byoc_library_kernel_options == nullptr || mqa_byoc_library_kernel_options.hopper_fa4 != 2;
    // causal: a row of a sequence with more queries than keys sees none (FA2 writes zeros there); one
    // shared seqstart rules that out
    ok = ok && (!kCausal || data_of(seqstart_q) == data_of(seqstart_k));
    for (int i = 0; ok && i < 4; ++i) {
      ok = (reinterpret_cast<uintptr_t>(data_of(ts[i])) & 15) == 0 && ts[i]->shape[1] <= INT32_MAX &&
           st[i][0] % 8 == 0 && st[i][1] % 8 == 0 && st[i][0] <= INT32_MAX && st[i][1] <= INT32_MAX;
    }
    if (ok) {
      if (&__tvm_ffi_@FA4SYM@ == nullptr || &mqa_byoc_fa4_ragged_forward == nullptr) {
        TVM_FFI_THROW(RuntimeError) << kSymbol << ": the FA4 var-len object @FA4SYM@ (and fa4_ragged.cu) is not "
                                    << "linked into this library; export it with mqa_byoc.export_library(executable, "
                                    << "path), or build with provider=\"native\"";
      }
      const int frc = mqa_byoc_fa4_ragged_forward(
          &__tvm_ffi_@FA4SYM@, data_of(q), data_of(k), data_of(v), const_cast<void*>(data_of(out)), nullptr,
          static_cast<const int32_t*>(data_of(seqstart_q)), static_cast<const int32_t*>(data_of(seqstart_k)),
          n_q - 1, total_q, total_k, kHeads, kKvHeads, kHeadDim, qs, ks, vs, os, kIsBf16, kScale, dev, stream);
      if (frc == -1) throw ::tvm::ffi::details::MoveFromSafeCallRaised();
      if (frc != 0) TVM_FFI_THROW(RuntimeError) << kSymbol << ": FA4 var-len: " << mqa_byoc_fa2_last_error();
      return 0;
    }
  }"""


_NATIVE_TEMPLATE = r"""// Generated by mqa_byoc.compiler.codegen.varlen: FA2 var-len forward for one offloaded attention.
@MARKER@
@SPEC@
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>

// mqa_byoc/native/fa2_dispatch.h, linked in by mqa_byoc.export_library (weak: see native_codegen.py).
extern "C" __attribute__((weak)) int mqa_byoc_fa2_varlen_forward(
    const void* q, const void* k, const void* v, void* out, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, int64_t batch, int64_t total_q, int64_t total_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, int64_t num_heads, int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride,
    const int64_t* k_stride, const int64_t* v_stride, const int64_t* o_stride, int is_bf16,
    float softmax_scale, int causal, int window_left, int window_right, int device_id, void* stream);
extern "C" __attribute__((weak)) const char* mqa_byoc_fa2_last_error(void);
@FA4_DECL@
namespace {

@PRELUDE@
// (1, total, heads, dim), @DTYPE_NAME@, on CUDA, contiguous last axis; fills the (row, head, dim) strides.
int64_t check_rows(const DLTensor* t, const char* name, int64_t heads, int64_t* strides) {
  if (t == nullptr) TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " is null";
  if (t->ndim != 4 || t->shape[0] != 1 || t->shape[2] != heads || t->shape[3] != kHeadDim) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " must have shape (1, total, " << heads << ", "
                              << kHeadDim << ")";
  }
  if (t->dtype.code != @DTYPE_CODE@ || t->dtype.bits != 16 || t->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << kSymbol << ": " << name << " must be @DTYPE_NAME@";
  }
  if (t->device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " must be on a CUDA device";
  }
  int64_t st[4];
  strides4(t, st);
  if (st[3] != 1) TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " needs a contiguous last axis";
  strides[0] = st[1];
  strides[1] = st[2];
  strides[2] = 1;
  return t->shape[1];
}

// 1-D int32 on the given CUDA device, contiguous: FA2's cu_seqlens. Returns its length.
int64_t check_seqstart(const DLTensor* t, const char* name, int device) {
  if (t == nullptr || t->ndim != 1 || t->dtype.code != kDLInt || t->dtype.bits != 32 || t->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << kSymbol << ": " << name << " must be a 1-D int32 tensor";
  }
  if (t->device.device_type != kDLCUDA || t->device.device_id != device) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " must be on the CUDA device of q";
  }
  if (t->strides != nullptr && t->shape[0] > 1 && t->strides[0] != 1) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " must be contiguous";
  }
  return t->shape[0];
}

// The max length: its value when the tensor is on the host, else (not read: that would synchronize
// the stream) the total, which bounds every sequence.
int64_t max_length(const DLTensor* t, const char* name, int64_t total) {
  int64_t n = 1;
  for (int i = 0; t != nullptr && i < t->ndim; ++i) n *= t->shape[i];
  if (t == nullptr || n != 1 || t->dtype.code != kDLInt || t->dtype.bits != 32 || t->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << kSymbol << ": " << name << " must be an int32 tensor with one element";
  }
  if (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDAHost) return total;
  const int64_t value = *static_cast<const int32_t*>(data_of(t));
  if (value < 0 || (value == 0 && total > 0)) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " is " << value << " but the sequences hold "
                              << total << " rows";
  }
  return std::min(value, total);
}

int run(@INPUTS@, DLTensor* out) {
  require_linked(&mqa_byoc_fa2_varlen_forward != nullptr && &mqa_byoc_fa2_last_error != nullptr);
@OPERANDS@
  int64_t qs[3], ks[3], vs[3], os[3];
  const int64_t total_q = check_rows(q, "q", kHeads, qs);
  const int64_t total_k = check_rows(k, "k", kKvHeads, ks);
  if (check_rows(v, "v", kKvHeads, vs) != total_k || check_rows(out, "out", kHeads, os) != total_q) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": v must have as many rows as k, out as many as q";
  }
  const int dev = common_device(q, k, v, out);
  const int64_t n_q = check_seqstart(seqstart_q, "seqstart_q", dev);
  const int64_t n_k = check_seqstart(seqstart_k, "seqstart_k", dev);
  if (n_q != n_k || n_q < 1) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": seqstart_q has " << n_q << " entries, seqstart_k " << n_k
                              << "; both need batch + 1";
  }
  const int64_t max_q = max_length(max_seqlen_q, "max_seqlen_q", total_q);
  const int64_t max_k = max_length(max_seqlen_k, "max_seqlen_k", total_k);
  void* stream = TVMFFIEnvGetStream(kDLCUDA, dev);@FA4_CALL@
  int rc = mqa_byoc_fa2_varlen_forward(
      data_of(q), data_of(k), data_of(v), const_cast<void*>(data_of(out)),
      static_cast<const int32_t*>(data_of(seqstart_q)), static_cast<const int32_t*>(data_of(seqstart_k)),
      n_q - 1, total_q, total_k, max_q, max_k, kHeads, kKvHeads, kHeadDim, qs, ks, vs, os, kIsBf16, kScale,
      kCausal, kWindowLeft, kWindowRight, dev, stream);
  if (rc != 0) TVM_FFI_THROW(RuntimeError) << kSymbol << ": " << mqa_byoc_fa2_last_error();
  return 0;
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run);
"""
