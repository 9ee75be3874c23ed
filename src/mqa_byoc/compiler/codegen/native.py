"""C++ source for the "native" provider: one TVM-FFI function per offloaded attention.

The emitted function ``<symbol>(q, k, v, out)`` (destination passing, BSNH DLTensors) checks its
arguments against the compiled :class:`AttentionSpec`, reads B / S_q / S_kv and strides off the
tensors, takes TVM's current CUDA stream (``TVMFFIEnvGetStream``) and calls ``mqa_byoc_fa2_forward``
from ``mqa_byoc/native/fa2_dispatch.cc``. It is compiled by ``export_library`` (g++, TVM's include
paths) and linked with the dispatcher and FA2 kernel objects by :func:`mqa_byoc.compiler.export.export_library`,
which finds the kernels through the marker line (:data:`mqa_byoc.kernels.MARKER`).

This module does not import TVM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mqa_byoc.compiler.codegen import hopper as hopper_codegen
from mqa_byoc.compiler.graph.spec import MAX_HEAD_DIM, SUPPORTED_DTYPES, AttentionSpec
from mqa_byoc.kernels import KernelKey, marker_line, plan_kernels

SPEC_MARKER = "// mqa_byoc-spec:"

_DL_DTYPE = {"float16": ("kDLFloat", "float16"), "bfloat16": ("kDLBfloat", "bfloat16")}


@dataclass(frozen=True)
class NativeSource:
    """Source of one wrapper and the kernel families it needs at link time."""

    code: str
    kernels: tuple[KernelKey, ...]


def check_spec(symbol: str, spec: AttentionSpec) -> None:
    """ValueError unless FA2 computes ``spec`` and ``symbol`` is a C identifier (both native wrappers)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", symbol):
        raise ValueError(f"symbol {symbol!r} is not a C identifier")
    if spec.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{symbol}: FA2 supports {SUPPORTED_DTYPES}, got {spec.dtype!r}")
    if spec.num_kv_heads <= 0 or spec.num_q_heads % spec.num_kv_heads:
        raise ValueError(f"{symbol}: H={spec.num_q_heads} is not a multiple of H_kv={spec.num_kv_heads}")
    if not (0 < spec.head_dim <= MAX_HEAD_DIM and spec.head_dim % 8 == 0):
        raise ValueError(f"{symbol}: head dim {spec.head_dim} is not a multiple of 8 in (0, 256]")
    if spec.head_dim_v != spec.head_dim:
        raise ValueError(f"{symbol}: FA2 needs head_dim_v == head_dim, got {spec.head_dim_v} != {spec.head_dim}")
    if not (spec.scale == spec.scale and abs(spec.scale) != float("inf")):
        raise ValueError(f"{symbol}: softmax scale {spec.scale} is not finite")
    for name in ("window_left", "window_right"):
        if int(getattr(spec, name)) < -1:
            raise ValueError(f"{symbol}: {name} must be >= -1")


def spec_fields(symbol: str, spec: AttentionSpec) -> dict[str, str]:
    """The template fields :data:`WRAPPER_PRELUDE` bakes from the spec (and the dtype names the
    operand checks use)."""
    type_code, type_name = _DL_DTYPE[spec.dtype]
    return {
        "@SYMBOL@": symbol,
        "@H@": str(int(spec.num_q_heads)),
        "@HKV@": str(int(spec.num_kv_heads)),
        "@D@": str(int(spec.head_dim)),
        "@DTYPE_CODE@": type_code,
        "@DTYPE_NAME@": type_name,
        "@IS_BF16@": "1" if spec.dtype == "bfloat16" else "0",
        "@SCALE@": repr(float(spec.scale)),
        "@CAUSAL@": "1" if spec.causal else "0",
        "@WL@": str(int(spec.window_left)),
        "@WR@": str(int(spec.window_right)),
    }


def fill_template(template: str, fields: dict[str, str]) -> str:
    """``template`` with :data:`WRAPPER_PRELUDE` at ``@PRELUDE@`` and every field replaced."""
    code = template.replace("@PRELUDE@", WRAPPER_PRELUDE)
    for key, value in fields.items():
        code = code.replace(key, value)
    return code


def _export_lines(symbol: str, arg_map, num_inputs: int, shape_params) -> str:
    """The export of ``run(q, k, v, out)`` under the function's own parameter list: the Codegen
    function passes its parameters in the order ``FuseOpsByPattern`` gave them (an operand used
    twice comes once; length shapes may follow), so a wrapper maps them onto q, k, v."""
    if tuple(arg_map) == tuple(range(len(arg_map))) and num_inputs == len(arg_map):
        return "TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run);"
    if sorted(set(arg_map) | set(shape_params)) != list(range(num_inputs)) or set(arg_map) & set(shape_params):
        raise ValueError(f"{symbol}: inputs {num_inputs} with q, k, v at {tuple(arg_map)} and shapes at "
                         f"{tuple(shape_params)} do not cover each input once")
    params = ", ".join(f"tvm::ffi::Shape in{i}" if i in shape_params else f"DLTensor* in{i}"
                       for i in range(num_inputs))
    operands = ", ".join(f"in{i}" for i in arg_map)  # q, k, v (, sinks)
    return ("namespace {\n"
            f"int run_params({params}, DLTensor* out) {{ return run({operands}, out); }}\n"
            "}  // namespace\n"
            "TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run_params);")


def emit_native_source(symbol: str, spec: AttentionSpec, shape_args: int = 0, *, arg_map=(0, 1, 2),
                       num_inputs: int | None = None, shape_params=(), hopper: bool = False) -> NativeSource:
    """C++ for ``TVM_FFI_DLL_EXPORT_TYPED_FUNC(symbol, ...)`` calling FA2 with ``spec`` baked in.

    Parameters
    ----------
    symbol, spec
        The exported name and the attention it computes.
    shape_args
        Shorthand for ``R.Shape`` inputs after q, k, v (the fused function's ``tir_vars``).
    arg_map, num_inputs, shape_params
        The exported function's parameter list: q, k, v are inputs ``arg_map`` (an input may serve
        twice), ``R.Shape`` inputs are at ``shape_params`` and are ignored (lengths are read off the
        tensors); ``out`` comes last. Default: ``(q, k, v, <shape_args shapes>, out)``.
    hopper
        The hopper provider: calls with enough query rows run FA4's sm90 object
        (:mod:`mqa_byoc.compiler.codegen.hopper`), the others FA2.

    Returns
    -------
    NativeSource
        The C++ source and the FA2 kernel families it needs at link time.
    """
    if shape_args and not shape_params:
        shape_params = tuple(range(3, 3 + shape_args))
    if num_inputs is None:
        num_inputs = max(tuple(arg_map) + tuple(shape_params)) + 1
    check_spec(symbol, spec)
    kernels = plan_kernels(spec)
    layouts = {x: str(getattr(spec, f"{x}_layout", "BSNH")) for x in ("q", "k", "v", "out")}
    for x, lay in layouts.items():
        if lay not in ("BSNH", "BNSH"):
            raise ValueError(f"{symbol}: {x} layout {lay!r} is neither BSNH nor BNSH")
    spec_line = (
        f"{SPEC_MARKER} symbol={symbol} H={spec.num_q_heads} H_kv={spec.num_kv_heads} "
        f"D={spec.head_dim} dtype={spec.dtype} scale={float(spec.scale)!r} causal={int(spec.causal)} "
        f"window=({spec.window_left},{spec.window_right}) layouts=q:{layouts['q']},k:{layouts['k']},"
        f"v:{layouts['v']},out:{layouts['out']}"
    )
    sinks = spec.sinks_dtype is not None
    if sinks and len(arg_map) != 4:
        raise ValueError(f"{symbol}: attention with sinks takes q, k, v and sinks, got operands at {tuple(arg_map)}")
    if sinks and spec.sinks_dtype not in _SINK_DTYPE_CODES:
        raise ValueError(f"{symbol}: sinks of dtype {spec.sinks_dtype}; expected one of {tuple(_SINK_DTYPE_CODES)}")
    # attention with sinks: FA2 and our sink epilogue with either linked provider (kernel_key is None)
    fa4 = hopper_codegen.kernel_key(spec) if hopper else None
    if sinks:
        spec_line += f" sinks={spec.sinks_dtype}"
    if spec.softcap:
        if sinks or not (0 < float(spec.softcap) < float("inf")):
            raise ValueError(f"{symbol}: soft-cap {spec.softcap} (needs a finite cap > 0, without sinks)")
        spec_line += f" softcap={float(spec.softcap)!r}"
    code = fill_template(_TEMPLATE, {
        **hopper_codegen.fragments(fa4, hopper_codegen.decode_key(spec) if fa4 is not None else None),
        **_sink_fields(spec),
        "@MARKER@": marker_line(kernels),
        "@SPEC@": spec_line,
        "@EXPORT@": _export_lines(symbol, arg_map, num_inputs, set(shape_params)),
        **spec_fields(symbol, spec),
        "@DV@": str(int(spec.head_dim_v)),
        "@Q_BNSH@": "true" if layouts["q"] == "BNSH" else "false",
        "@K_BNSH@": "true" if layouts["k"] == "BNSH" else "false",
        "@V_BNSH@": "true" if layouts["v"] == "BNSH" else "false",
        "@O_BNSH@": "true" if layouts["out"] == "BNSH" else "false",
    })
    return NativeSource(code, kernels)


# the dispatcher's code for the dtype of a sinks operand
_SINK_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


def _sink_fields(spec: AttentionSpec) -> dict[str, str]:
    """Template fields of the sinks operand: empty without sinks; else the parameter, its check and the
    dispatcher's sink entry (FA2's output scaled by sigmoid(lse - sink), fa2_dispatch.h). A soft-capped spec
    calls the dispatcher's soft-capping entry with the cap baked in."""
    if spec.softcap:
        return {"@SINK_PARAM@": "", "@SINK_CHECK@": "", "@FORWARD@": "mqa_byoc_fa2_forward_softcap",
                "@SINK_ARGS@": f"static_cast<float>({float(spec.softcap)!r}), ", "@SINK_DECL_ARGS@": "float softcap, "}
    if spec.sinks_dtype is None:
        return {"@SINK_PARAM@": "", "@SINK_CHECK@": "", "@FORWARD@": "mqa_byoc_fa2_forward", "@SINK_ARGS@": "",
                "@SINK_DECL_ARGS@": ""}
    code = _SINK_DTYPE_CODES[spec.sinks_dtype]
    bits = 32 if spec.sinks_dtype == "float32" else 16
    dl = "kDLBfloat" if spec.sinks_dtype == "bfloat16" else "kDLFloat"
    check = (f"  if (sinks == nullptr || sinks->ndim != 1 || sinks->shape[0] != kHeads || sinks->dtype.code != {dl} ||\n"
             f"      sinks->dtype.bits != {bits} || sinks->device.device_type != kDLCUDA ||\n"
             "      (sinks->strides != nullptr && sinks->strides[0] != 1)) {\n"
             f"    TVM_FFI_THROW(ValueError) << kSymbol << \": sinks must be a contiguous ({spec.num_q_heads},) "
             f"{spec.sinks_dtype} CUDA tensor\";\n  }}\n")
    return {"@SINK_PARAM@": "DLTensor* sinks, ", "@SINK_CHECK@": check, "@FORWARD@": "mqa_byoc_fa2_forward_sink",
            "@SINK_ARGS@": f"data_of(sinks), {code}, ", "@SINK_DECL_ARGS@": "const void* sinks, int sinks_dtype, "}


# C++ that both native wrappers (this module's and codegen/varlen.py's) open their anonymous namespace
# with: the baked spec, and the helpers every wrapper needs.
WRAPPER_PRELUDE = r"""constexpr int64_t kHeads = @H@;
constexpr int64_t kKvHeads = @HKV@;
constexpr int64_t kHeadDim = @D@;
constexpr int kIsBf16 = @IS_BF16@;
constexpr float kScale = static_cast<float>(@SCALE@);
constexpr int kCausal = @CAUSAL@;
constexpr int kWindowLeft = @WL@;
constexpr int kWindowRight = @WR@;
constexpr const char* kSymbol = "@SYMBOL@";

const void* data_of(const DLTensor* t) { return static_cast<const char*>(t->data) + t->byte_offset; }

// The dispatcher is referenced weakly: its address is null in a library exported without it.
void require_linked(bool linked) {
  if (!linked) {
    TVM_FFI_THROW(RuntimeError)
        << kSymbol << ": the native FA2 kernels are not linked into this library. Export it with "
        << "mqa_byoc.export_library(executable, path), which links them (a plain export_library links "
        << "only what mqa_byoc.build attached), "
        << "or build with provider=\"python\".";
  }
}

// The four strides of t in elements (compact row-major when it carries none).
void strides4(const DLTensor* t, int64_t* st) {
  if (t->strides == nullptr) {
    st[3] = 1;
    for (int i = 2; i >= 0; --i) st[i] = st[i + 1] * t->shape[i + 1];
  } else {
    for (int i = 0; i < 4; ++i) st[i] = t->strides[i];
  }
}

// The CUDA device of q, which k, v and out must share.
int common_device(const DLTensor* q, const DLTensor* k, const DLTensor* v, const DLTensor* out) {
  const int dev = q->device.device_id;
  if (k->device.device_id != dev || v->device.device_id != dev || out->device.device_id != dev) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": q, k, v and out must be on the same CUDA device";
  }
  return dev;
}
"""


_TEMPLATE = r"""// Generated by mqa_byoc.compiler.codegen.native: FA2 forward for one offloaded attention.
@MARKER@
@HOPPER_MARKER@
@SPEC@
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// mqa_byoc/native/fa2_dispatch.h, linked in by mqa_byoc.export_library. Weak, so that a library
// exported without it (ex.export_library / ex.jit) still loads and fails here with a clear message.
extern "C" __attribute__((weak)) int @FORWARD@(const void* q, const void* k, const void* v, @SINK_DECL_ARGS@void* out,
                                    int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                    int64_t num_heads, int64_t num_heads_k, int64_t head_dim,
                                    const int64_t* q_stride, const int64_t* k_stride,
                                    const int64_t* v_stride, const int64_t* o_stride, int is_bf16,
                                    float softmax_scale, int causal, int window_left,
                                    int window_right, int device_id, void* stream);
extern "C" __attribute__((weak)) const char* mqa_byoc_fa2_last_error(void);

namespace {

@PRELUDE@
constexpr int64_t kHeadDimV = @DV@;
constexpr bool kQBnsh = @Q_BNSH@;  // layouts: false = BSNH, true = BNSH
constexpr bool kKBnsh = @K_BNSH@;
constexpr bool kVBnsh = @V_BNSH@;
constexpr bool kOBnsh = @O_BNSH@;

const char* shape_str(const DLTensor* t, char* buf, int n) {
  int pos = 0;
  pos += snprintf(buf + pos, n - pos, "(");
  for (int i = 0; i < t->ndim && pos < n; ++i) {
    pos += snprintf(buf + pos, n - pos, i ? ", %lld" : "%lld", static_cast<long long>(t->shape[i]));
  }
  if (pos < n) snprintf(buf + pos, n - pos, ")");
  return buf;
}

// 4-D, @DTYPE_NAME@, on CUDA, given heads and head dim, contiguous last axis. Fills the shape and
// strides of the logical BSNH view (a BNSH tensor is read through swapped strides, no copy).
void check_tensor(const DLTensor* t, const char* name, int64_t heads, int64_t dim, bool bnsh,
                  int64_t* shape, int64_t* strides) {
  char buf[160];
  if (t == nullptr) TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " is null";
  if (t->ndim != 4) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " must be 4-D (B, S, N, D), got shape "
                              << shape_str(t, buf, sizeof(buf));
  }
  if (t->dtype.code != @DTYPE_CODE@ || t->dtype.bits != 16 || t->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << kSymbol << ": " << name << " must be @DTYPE_NAME@ (dtype code "
                             << int(t->dtype.code) << ", bits " << int(t->dtype.bits) << ")";
  }
  if (t->device.device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " must be on a CUDA device, got device type "
                              << int(t->device.device_type);
  }
  const int heads_axis = bnsh ? 1 : 2;
  if (t->shape[heads_axis] != heads || t->shape[3] != dim) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " has shape " << shape_str(t, buf, sizeof(buf))
                              << ", compiled for " << (bnsh ? "(B, " : "(B, S, ") << heads
                              << (bnsh ? ", S, " : ", ") << dim << ")";
  }
  int64_t st[4];
  strides4(t, st);
  if (st[3] != 1) {
    TVM_FFI_THROW(ValueError) << kSymbol << ": " << name << " needs a contiguous last axis, stride is "
                              << st[3];
  }
  const int seq_axis = bnsh ? 2 : 1;
  shape[0] = t->shape[0];
  shape[1] = t->shape[seq_axis];
  shape[2] = t->shape[heads_axis];
  shape[3] = t->shape[3];
  strides[0] = st[0];
  strides[1] = st[seq_axis];
  strides[2] = st[heads_axis];
  strides[3] = 1;
}

@HOPPER_DECL@
int run(DLTensor* q, DLTensor* k, DLTensor* v, @SINK_PARAM@DLTensor* out) {
  require_linked(&@FORWARD@ != nullptr && &mqa_byoc_fa2_last_error != nullptr);
  int64_t qn[4], kn[4], vn[4], on[4], qs[4], ks[4], vs[4], os[4];
  check_tensor(q, "q", kHeads, kHeadDim, kQBnsh, qn, qs);
  check_tensor(k, "k", kKvHeads, kHeadDim, kKBnsh, kn, ks);
  check_tensor(v, "v", kKvHeads, kHeadDimV, kVBnsh, vn, vs);
  check_tensor(out, "out", kHeads, kHeadDimV, kOBnsh, on, os);
  const int64_t batch = qn[0], seqlen_q = qn[1], seqlen_k = kn[1];
  if (kn[0] != batch || vn[0] != batch || on[0] != batch || vn[1] != seqlen_k || on[1] != seqlen_q) {
    char b1[160], b2[160], b3[160], b4[160];
    TVM_FFI_THROW(ValueError) << kSymbol << ": inconsistent shapes q " << shape_str(q, b1, 160) << ", k "
                              << shape_str(k, b2, 160) << ", v " << shape_str(v, b3, 160) << ", out "
                              << shape_str(out, b4, 160);
  }
  const int dev = common_device(q, k, v, out);
@SINK_CHECK@@HOPPER_CALL@
  void* stream = TVMFFIEnvGetStream(kDLCUDA, dev);
  int rc = @FORWARD@(data_of(q), data_of(k), data_of(v), @SINK_ARGS@const_cast<void*>(data_of(out)),
                                batch, seqlen_q, seqlen_k, kHeads, kKvHeads, kHeadDim, qs, ks, vs, os,
                                kIsBf16, kScale, kCausal, kWindowLeft, kWindowRight, dev, stream);
  if (rc != 0) {
    TVM_FFI_THROW(RuntimeError) << kSymbol << ": " << mqa_byoc_fa2_last_error();
  }
  return 0;
}

}  // namespace

@EXPORT@
"""
