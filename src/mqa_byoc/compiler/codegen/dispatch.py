"""The ``flash_attn`` BYOC codegen: ``relax.ext.flash_attn``.

Importing this module registers ``relax.ext.flash_attn``, which ``relax.transform.RunCodegen()``
calls with every function that carries ``Codegen = "flash_attn"`` (see docs/design.md, "The
composite contract"). For each such function the codegen reads an
:class:`~mqa_byoc.compiler.graph.spec.AttentionSpec` off its inner ``Composite`` function and emits C++
that exports a function named by the function's ``global_symbol`` taking ``(q, k, v, out)``
(destination passing, the inputs in the order of the function's parameters). What that C++ does
depends on the *provider*:

``"native"``
    source from :func:`mqa_byoc.compiler.codegen.native.emit_native_source`, which launches FA2
    forward kernels compiled from flash-attn's sources; export with ``mqa_byoc.export_library``.
``"hopper"``
    the native wrapper with FA4's sm90 kernel (flash-attn-4, compiled ahead of time by
    :mod:`mqa_byoc.kernels.hopper`) for calls with enough query rows (prefill) and FA2 for the
    others (split-KV decode) and for var-len attention; sm_90 only, exported the same way.
``"python"``
    a forwarder that calls the global function ``mqa_byoc.flash_attn_forward`` (registered by
    ``import mqa_byoc.runtime.providers``; backed by the ``flash-attn`` package or by PyTorch's FA2)
    with ``(q, k, v, out, scale, causal, window_left, window_right)``, all tensors viewed as BSNH.
    Any C++ compiler builds it (``tvm.runtime.Module.export_library`` works).

Provider selection, first match wins:

1. the function attribute ``mqa_byoc.provider`` on the ``Codegen`` function (set by
   ``partition_for_cutlass(..., provider=...)``): the most specific, explicit choice;
2. the codegen option ``provider``: ``relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})``;
3. the process-wide setting: :func:`set_default_provider` or ``with use_provider("python"): ...``;
4. the environment variable ``MQA_BYOC_PROVIDER``;
5. the default rule (:func:`default_provider`): ``"native"`` when ``nvcc`` is found at compile time
   and the target is CUDA (the target from the option ``target``, else ``Target.current()``; no
   target known counts as CUDA since both providers run only there), else ``"python"``; and
   ``"hopper"`` instead of ``"native"`` when the target's arch is sm_90 and FA4 objects can be had
   (prebuilt under ``MQA_BYOC_KERNEL_DIR`` or flash-attn-4 installed to compile them).

The value ``"auto"`` at any level means "use the default rule". ``tvm.transform.PassContext``
config keys cannot be registered from Python in TVM 0.27 (unknown keys are rejected), so there
is no PassContext option; the codegen option and :func:`use_provider` play that role.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax

from mqa_byoc.contract import (
    LINKED_PROVIDERS,
    CODEGEN,
    COMPOSITES,
    PROVIDER_ATTR,
    PROVIDERS,
    PY_FORWARD_FUNC,
    check_provider,
    composite_name,
)

from mqa_byoc.kernels.toolchain import nvcc_available
from mqa_byoc.compiler.codegen import varlen as varlen_codegen
from mqa_byoc.compiler.graph.spec import AttentionSpec, read_composite

__all__ = [
    "CODEGEN",
    "PROVIDERS",
    "PROVIDER_ATTR",
    "PY_FORWARD_FUNC",
    "CodegenError",
    "CodegenSite",
    "default_provider",
    "emit_python_forwarder",
    "flash_attn_codegen",
    "find_site",
    "resolve_provider",
    "set_default_provider",
    "spec_of",
    "use_provider",
]

logger = logging.getLogger(__name__)

PROVIDER_OPTION = "provider"
PROVIDER_ENV = "MQA_BYOC_PROVIDER"

_default_provider: str | None = None


class CodegenError(ValueError):
    """A ``flash_attn`` function the codegen cannot turn into a kernel call."""


# --------------------------------------------------------------------------- provider selection


def set_default_provider(provider: str | None) -> None:
    """Set the process-wide provider (``"native"``, ``"python"``, ``"auto"``; None resets)."""
    global _default_provider
    _default_provider = None if provider is None else check_provider(provider, "set_default_provider", allow_auto=True)


@contextlib.contextmanager
def use_provider(provider: str | None) -> Iterator[None]:
    """``with use_provider("python"): relax.transform.RunCodegen()(mod)`` (restores on exit)."""
    global _default_provider
    saved = _default_provider
    set_default_provider(provider)
    try:
        yield
    finally:
        _default_provider = saved


def _native_codegen_available() -> bool:
    try:
        from mqa_byoc.compiler.codegen import native  # noqa: F401
    except ImportError:
        return False
    return True


def _target_kind(target) -> str | None:
    if target is None:
        return None
    if isinstance(target, (dict, str)):
        target = tvm.target.Target(target)
    return str(target.kind.name)


def target_arch(target) -> str | None:
    """The ``arch`` attribute of a CUDA target (``sm_90``), None when it has none."""
    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    if target is None:
        return None
    if isinstance(target, (dict, str)):
        target = tvm.target.Target(target)
    arch = target.attrs.get("arch") if str(target.kind.name) == "cuda" else None
    return None if arch is None else str(arch)


def hopper_unavailable(target) -> str | None:
    """Why the default rule does not pick the hopper provider for ``target`` (None: it does)."""
    from mqa_byoc.kernels import hopper

    return hopper.available(target_arch(target))


def default_provider(target=None, *, nvcc: bool | None = None, native: bool | None = None,
                     hopper: bool | None = None) -> str:
    """The default rule: ``"native"`` when nvcc is found and the target is CUDA, else ``"python"``;
    ``"hopper"`` for native on an sm_90 target when FA4 objects can be had (:func:`hopper_unavailable`).

    ``target``: a Target (or its dict/str form); None means ``Target.current()``, and no target at
    all counts as CUDA. ``nvcc`` / ``native`` override the detection of nvcc and of
    ``mqa_byoc.compiler.codegen.native`` (for tests). While ``native_codegen`` is missing the rule
    gives ``"python"`` and logs a warning.
    """
    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    kind = _target_kind(target)
    if kind not in (None, "cuda"):
        return "python"
    if not (nvcc_available() if nvcc is None else nvcc):
        return "python"
    if not (_native_codegen_available() if native is None else native):
        logger.warning(
            "nvcc found but mqa_byoc.compiler.codegen.native is not importable; using the python provider"
        )
        return "python"
    if hopper is None:
        hopper = hopper_unavailable(target) is None
    else:
        hopper = hopper and _is_sm90(target_arch(target))
    return "hopper" if hopper else "native"


def _is_sm90(arch) -> bool:
    from mqa_byoc.kernels import normalize_arch

    try:
        return arch is not None and normalize_arch(arch) == "sm_90"
    except ValueError:
        return False


def _get(mapping, key):
    if mapping is None:
        return None
    try:
        return mapping[key] if key in mapping else None
    except Exception:  # noqa: BLE001 - tvm Map / DictAttrs / dict all work with `in`; be lenient
        return None


def resolve_provider(func: relax.Function | None = None, options=None) -> str:
    """The provider for one ``Codegen`` function (see the module docstring for the order)."""
    choices = (
        (_get(func.attrs if func is not None else None, PROVIDER_ATTR), f"function attribute {PROVIDER_ATTR!r}"),
        (_get(options, PROVIDER_OPTION), f"codegen option {PROVIDER_OPTION!r}"),
        (_default_provider, "set_default_provider/use_provider"),
        (os.environ.get(PROVIDER_ENV) or None, f"environment variable {PROVIDER_ENV}"),
    )
    for value, where in choices:
        if value is None:
            continue
        provider = check_provider(value, where, allow_auto=True)
        if provider != "auto":
            return provider
        break
    return default_provider(_get(options, "target"))


# --------------------------------------------------------------------------- reading the function


@dataclass(frozen=True)
class CodegenSite:
    """One offloaded attention, read once off its ``Codegen`` function and composite."""

    symbol: str
    composite: relax.Function
    composite_name: str
    spec: AttentionSpec
    # attention operand i (q, k, v) is the Codegen function's parameter arg_map[i]
    arg_map: tuple[int, int, int]
    num_inputs: int
    # parameters of type R.Shape: FuseOpsByPattern adds ``tir_vars`` when a length is an expression
    # (S_kv = past_len + 1) so that the function can define past_len; the kernels read lengths from
    # the tensors and ignore it
    shape_params: tuple[int, ...] = ()


def find_site(func: relax.Function) -> CodegenSite:
    """Read the single ``flash_attn.*`` composite call inside a ``Codegen`` function.

    Returns
    -------
    CodegenSite
        The exported symbol, the composite and its :class:`AttentionSpec`, and how the function's
        parameters map to q, k, v.

    Raises
    ------
    CodegenError
        When the function is not one composite call on its parameters that FA2 can compute.
    """
    if not isinstance(func, relax.Function):
        raise CodegenError(f"flash_attn codegen: expected a relax.Function, got {type(func).__name__}")
    attrs = func.attrs
    symbol = _get(attrs, "global_symbol")
    if symbol is None:
        raise CodegenError(f"flash_attn codegen: function has no global_symbol attribute:\n{func}")
    symbol = str(symbol)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", symbol):
        raise CodegenError(f"flash_attn codegen: global_symbol {symbol!r} is not a C identifier")
    if _get(attrs, "Composite") is not None:
        # a Codegen function that is itself the composite (no wrapper)
        name, composite, outer = str(attrs["Composite"]), func, list(range(len(func.params)))
    else:
        name, composite, outer = _composite_call(func, symbol)
    if name not in COMPOSITES:
        raise CodegenError(f"flash_attn codegen ({symbol}): unknown composite {name!r}; expected one of {COMPOSITES}")
    spec, operand_params = _read(composite, symbol)
    want = composite_name(spec.num_q_heads, spec.num_kv_heads)
    if name != want:
        raise CodegenError(
            f"flash_attn codegen ({symbol}): composite {name} but the heads are "
            f"{spec.num_q_heads} (q) / {spec.num_kv_heads} (k/v); expected {want}"
        )
    arg_map = tuple(outer[j] for j in operand_params)
    shape_params = tuple(i for i, p in enumerate(func.params) if isinstance(p.ty, relax.ShapeType))
    return CodegenSite(symbol, composite, name, spec, arg_map, len(func.params), shape_params)


def _composite_call(func: relax.Function, symbol: str):
    """(composite name, composite, outer) where composite parameter j is function parameter outer[j]."""
    body = func.body
    bindings = [b for block in body.blocks for b in block.bindings]
    local_funcs = {b.var: b.value for b in bindings if isinstance(b.value, relax.Function)}
    calls = []
    for b in bindings:
        value = b.value
        if isinstance(value, relax.Function):
            continue
        if isinstance(value, relax.Call):
            callee = local_funcs.get(value.op, value.op)
            if isinstance(callee, relax.Function) and _get(callee.attrs, "Composite") is not None:
                calls.append((b.var, value, callee))
                continue
            if isinstance(value.op, relax.GlobalVar):
                raise CodegenError(
                    f"flash_attn codegen ({symbol}): the composite is a global function "
                    f"({value.op.name_hint}); partition with annotate_codegen=True so it is local"
                )
        raise CodegenError(
            f"flash_attn codegen ({symbol}): the function must hold exactly one composite call "
            f"and nothing else; found the binding `{b.var.name_hint} = {value}`"
        )
    if len(calls) != 1:
        raise CodegenError(
            f"flash_attn codegen ({symbol}): expected one flash_attn.* composite call, found {len(calls)}"
        )
    var, call, composite = calls[0]
    if not (isinstance(body.body, relax.Var) and body.body.same_as(var)):
        raise CodegenError(f"flash_attn codegen ({symbol}): the function must return the composite's result")
    params = list(func.params)
    outer = []
    for j, arg in enumerate(call.args):
        idx = next((i for i, p in enumerate(params) if p.same_as(arg)), None)
        if idx is None:
            raise CodegenError(
                f"flash_attn codegen ({symbol}): composite argument {j} is `{arg}`, not a parameter of "
                "the function (constants and computed operands are not supported)"
            )
        outer.append(idx)
    return str(composite.attrs["Composite"]), composite, outer


def _read(composite: relax.Function, where: str):
    try:
        return read_composite(composite)
    except (ValueError, TypeError, AttributeError) as err:
        raise CodegenError(f"flash_attn codegen ({where}): cannot read the attention parameters: {err}") from err


def spec_of(func: relax.Function) -> AttentionSpec:
    """The :class:`AttentionSpec` of a ``Codegen`` function or of a composite; errors name the site.

    Returns
    -------
    AttentionSpec
        ``find_site(func).spec`` for a ``Codegen`` function (the var-len reader's for a var-len
        one); read off ``func`` for a composite.
    """
    if _get(func.attrs, "Codegen") is not None:
        if varlen_codegen.is_var_len(func):
            return varlen_codegen.find_var_len_site(func).spec
        return find_site(func).spec
    return _read(func, str(_get(func.attrs, "global_symbol") or "composite"))[0]


# --------------------------------------------------------------------------- python provider

def py_function_lookup(cpp_name: str, global_name: str) -> str:
    """C++ defining ``tvm::ffi::Function cpp_name()``: the global function ``global_name`` that
    ``import mqa_byoc.runtime.providers`` registers, or a RuntimeError saying so. Both python-provider
    forwarders (fixed-length and var-len) call through one of these; emit it inside a namespace."""
    return r"""
// Looked up at every call, not cached: a cached reference to the Python callable would outlive the
// interpreter (static destructors run after it) and crash the process at exit.
tvm::ffi::Function @CPPNAME@() {
  std::optional<tvm::ffi::Function> fn = tvm::ffi::Function::GetGlobal("@FORWARD@");
  if (!fn.has_value()) {
    TVM_FFI_THROW(RuntimeError)
        << "mqa_byoc: the global function \"@FORWARD@\" is not registered. "
        << "This library was built with the python FA2 provider: run `import mqa_byoc.runtime.providers` "
        << "in this process before calling it (needs torch with CUDA; flash-attn optional: "
        << "pip install \"mqa-byoc[gpu]\"), or rebuild with provider=\"native\".";
  }
  return *fn;
}
""".replace("@CPPNAME@", cpp_name).replace("@FORWARD@", global_name)


_PY_PRELUDE = r"""// Generated by mqa_byoc.compiler.codegen.dispatch (provider: python).
// Each exported function forwards one FA2 forward call to the global function
// "@FORWARD@"(q, k, v, out, scale, causal, window_left, window_right),
// registered by `import mqa_byoc.runtime.providers`, with every tensor viewed as BSNH.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <optional>

namespace {
@LOOKUP@
// Check one operand against the baked spec; `heads_axis` is 2 for BSNH storage, 1 for BNSH.
void MqaByocCheck(const tvm::ffi::Tensor& t, const char* symbol, const char* what, int heads_axis,
                  int64_t heads, int64_t head_dim, DLDataType dtype, const char* dtype_name) {
  if (t.ndim() != 4) {
    TVM_FFI_THROW(ValueError) << symbol << ": " << what << " must be 4-D, got " << t.ndim() << "-D";
  }
  if (t.size(heads_axis) != heads || t.size(3) != head_dim) {
    TVM_FFI_THROW(ValueError) << symbol << ": " << what << " has " << t.size(heads_axis)
                              << " heads of dim " << t.size(3) << ", compiled for " << heads
                              << " heads of dim " << head_dim;
  }
  DLDataType d = t.dtype();
  if (d.code != dtype.code || d.bits != dtype.bits || d.lanes != dtype.lanes) {
    TVM_FFI_THROW(TypeError) << symbol << ": " << what << " must be " << dtype_name;
  }
}

// View a 4-D tensor with axes 1 and 2 swapped (BNSH storage as logical BSNH); no copy.
tvm::ffi::Tensor MqaByocSwap12(const tvm::ffi::Tensor& t) {
  int64_t shape[4] = {t.size(0), t.size(2), t.size(1), t.size(3)};
  int64_t strides[4];
  const DLTensor* dl = t.GetDLTensorPtr();
  if (dl->strides != nullptr) {
    for (int i = 0; i < 4; ++i) strides[i] = dl->strides[i];
  } else {
    strides[3] = 1;
    for (int i = 2; i >= 0; --i) strides[i] = strides[i + 1] * t.size(i + 1);
  }
  int64_t s1 = strides[1];
  strides[1] = strides[2];
  strides[2] = s1;
  return t.as_strided(tvm::ffi::ShapeView(shape, 4), tvm::ffi::ShapeView(strides, 4));
}

}  // namespace
""".replace("@LOOKUP@", py_function_lookup("MqaByocPyForward", PY_FORWARD_FUNC)).replace("@FORWARD@", PY_FORWARD_FUNC)

_DLTYPE = {"float16": "DLDataType{kDLFloat, 16, 1}", "bfloat16": "DLDataType{kDLBfloat, 16, 1}",
           "float32": "DLDataType{kDLFloat, 32, 1}"}


def emit_python_forwarder(symbol: str, spec: AttentionSpec, arg_map=(0, 1, 2), num_inputs: int | None = None,
                          prelude: bool = True, shape_params: tuple[int, ...] = ()) -> str:
    """C++ exporting ``symbol(inputs..., out)`` that calls ``mqa_byoc.flash_attn_forward``.

    ``arg_map[i]`` is the input position of composite operand i (q, k, v); ``num_inputs`` the
    number of inputs the exported function takes (default ``max(arg_map) + 1``).
    """
    if spec.dtype not in _DLTYPE:
        raise CodegenError(f"flash_attn codegen ({symbol}): unsupported dtype {spec.dtype}")
    n = max(arg_map) + 1 if num_inputs is None else int(num_inputs)
    ins = ", ".join(f"tvm::ffi::{'Shape' if i in shape_params else 'Tensor'} in{i}" for i in range(n))
    bnsh = {"q": spec.q_layout == "BNSH", "k": spec.k_layout == "BNSH", "v": spec.v_layout == "BNSH",
            "out": spec.out_layout == "BNSH"}
    operand = {"q": f"in{arg_map[0]}", "k": f"in{arg_map[1]}", "v": f"in{arg_map[2]}", "out": "out"}
    heads = {"q": "kNumQHeads", "k": "kNumKVHeads", "v": "kNumKVHeads", "out": "kNumQHeads"}
    dims = {"q": "kHeadDim", "k": "kHeadDim", "v": "kHeadDimV", "out": "kHeadDimV"}
    checks = "\n".join(
        f'  MqaByocCheck({operand[x]}, "{symbol}", "{x}", {1 if bnsh[x] else 2}, {heads[x]}, {dims[x]}, '
        f'kDType, "{spec.dtype}");'
        for x in ("q", "k", "v", "out")
    )
    views = "\n".join(
        f"  tvm::ffi::Tensor {x}_bsnh = {'MqaByocSwap12(' + operand[x] + ')' if bnsh[x] else operand[x]};"
        for x in ("q", "k", "v", "out")
    )
    body = f"""
// ---- {symbol}: {spec.num_q_heads} query heads over {spec.num_kv_heads} K/V heads (group {spec.group_size}), head dim {spec.head_dim}, {spec.dtype}
// layouts q={spec.q_layout} k={spec.k_layout} v={spec.v_layout} out={spec.out_layout}
namespace {{
namespace mqa_byoc_{symbol} {{
constexpr int64_t kNumQHeads = {spec.num_q_heads};
constexpr int64_t kNumKVHeads = {spec.num_kv_heads};
constexpr int64_t kHeadDim = {spec.head_dim};
constexpr int64_t kHeadDimV = {spec.head_dim_v};
constexpr double kScale = {float(spec.scale)!r};
constexpr bool kCausal = {"true" if spec.causal else "false"};
constexpr int64_t kWindowLeft = {int(spec.window_left)};
constexpr int64_t kWindowRight = {int(spec.window_right)};
const DLDataType kDType = {_DLTYPE[spec.dtype]};

void Run({ins}, tvm::ffi::Tensor out) {{
{checks}
{views}
  MqaByocPyForward()(q_bsnh, k_bsnh, v_bsnh, out_bsnh, kScale, kCausal, kWindowLeft, kWindowRight);
}}
}}  // namespace mqa_byoc_{symbol}
}}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, mqa_byoc_{symbol}::Run);
"""
    return (_PY_PRELUDE if prelude else "") + body


# --------------------------------------------------------------------------- native provider


def _native_module(site: CodegenSite, hopper: bool = False):
    try:
        from mqa_byoc.compiler.codegen import native as native_codegen
    except ImportError as err:
        raise CodegenError(
            f"flash_attn codegen ({site.symbol}): provider 'native' needs mqa_byoc.compiler.codegen.native, "
            f"which failed to import ({err}). Select the python provider instead: "
            "partition_for_cutlass(..., provider='python') or "
            "RunCodegen({'flash_attn': {'provider': 'python'}})"
        ) from err
    # The source carries a marker line naming its FA2 kernel families (NativeSource.kernels);
    # mqa_byoc.export_library reads it from the C source module and links those kernels.
    source = native_codegen.emit_native_source(site.symbol, site.spec, arg_map=site.arg_map, num_inputs=site.num_inputs,
                                                shape_params=site.shape_params, hopper=hopper)
    return _csource_module(source.code, [site.symbol])


# --------------------------------------------------------------------------- the codegen


def _csource_module(code: str, symbols: list[str]):
    return tvm.get_global_func("runtime.CSourceModuleCreate")(code, "cc", symbols, [])


def flash_attn_codegen(funcs, options=None, constant_names=None) -> list:
    """``relax.ext.flash_attn``: one runtime module per native function, one for all python ones."""
    python_parts: list[str] = []
    python_symbols: list[str] = []
    modules = []
    for func in funcs:
        if varlen_codegen.is_var_len(func):
            vl = varlen_codegen.find_var_len_site(func)
            if resolve_provider(func, options) in LINKED_PROVIDERS:  # hopper: var-len stays on FA2
                modules.append(_csource_module(varlen_codegen.emit_native_source(vl).code, [vl.symbol]))
            else:
                python_parts.append(varlen_codegen.emit_python_forwarder(vl))
                python_symbols.append(vl.symbol)
            continue
        site = find_site(func)
        spec = site.spec
        provider = resolve_provider(func, options)
        logger.debug("flash_attn codegen: %s -> %s provider (%s)", site.symbol, provider, spec)
        if provider in LINKED_PROVIDERS:
            modules.append(_native_module(site, hopper=provider == "hopper"))
        else:
            python_parts.append(
                emit_python_forwarder(site.symbol, spec, site.arg_map, site.num_inputs, prelude=False,
                                      shape_params=site.shape_params)
            )
            python_symbols.append(site.symbol)
    if python_parts:
        modules.append(_csource_module(_PY_PRELUDE + "".join(python_parts), python_symbols))
    return modules


tvm_ffi.register_global_func("relax.ext." + CODEGEN, flash_attn_codegen, override=True)
