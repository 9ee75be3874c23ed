"""Codegen of attention with sinks (``flash_attn.attention_mqa_sink`` / ``flash_attn.attention_sink``).

The composite is the sink attention's function (:mod:`mqa_byoc.compiler.graph.sink_attention`, which
also reads its :class:`AttentionSpec`): parameters
``(q, k, v, sinks)``, q/k/v in the layouts its :data:`~mqa_byoc.contract.SINK_LAYOUTS_ATTR` names, sinks
(H,), output (B, S_q, H, D); scale and mask in its attributes. The kernels compute FA2's attention and
its log-sum-exp and scale each output row by ``sigmoid(lse - sink_h)``:

- python provider: ``mqa_byoc.flash_attn_sink_forward(q, k, v, sinks, out, scale, causal, window_left,
  window_right)`` (``mqa_byoc.runtime.providers``);
- native and hopper providers: the native wrapper calling the dispatcher's ``mqa_byoc_fa2_forward_sink``
  (FA2 or our decode kernel, then our sink epilogue kernel); the hopper provider has no FA4 sink path.

Soft-capped attention (``flash_attn.attention_mqa_softcap`` / ``flash_attn.attention_softcap``, parameters
``(q, k, v)``, the cap in the spec) takes the same route: the python provider's
``mqa_byoc.flash_attn_softcap_forward(q, k, v, out, scale, softcap, causal, window_left, window_right)``, the
native wrapper's ``mqa_byoc_fa2_forward_softcap`` (FA2's soft-capping kernel families).
"""

from __future__ import annotations

from mqa_byoc.contract import PY_SINK_FORWARD_FUNC, PY_SOFTCAP_FORWARD_FUNC

from mqa_byoc.compiler.codegen.python import DL_DATA_TYPES, operand_checks, py_function_lookup, spec_constants
from mqa_byoc.compiler.graph.spec import AttentionSpec



def emit_python_forwarder(symbol: str, spec: AttentionSpec, arg_map, num_inputs: int, shape_params=()) -> str:
    """C++ exporting ``symbol(inputs..., out)`` that calls ``mqa_byoc.flash_attn_sink_forward`` (the
    python provider's prelude, :data:`mqa_byoc.compiler.codegen.python.PY_PRELUDE`, defines the helpers);
    for a soft-capped spec ``mqa_byoc.flash_attn_softcap_forward``."""
    if spec.softcap:
        return _emit_softcap_forwarder(symbol, spec, arg_map, num_inputs, shape_params)
    ins = ", ".join(f"tvm::ffi::{'Shape' if i in shape_params else 'Tensor'} in{i}" for i in range(num_inputs))
    bnsh = {"q": spec.q_layout == "BNSH", "k": spec.k_layout == "BNSH", "v": spec.v_layout == "BNSH", "out": False}
    operand = {"q": f"in{arg_map[0]}", "k": f"in{arg_map[1]}", "v": f"in{arg_map[2]}", "out": "out"}
    checks, views = operand_checks(symbol, spec, operand, bnsh, dict.fromkeys(("q", "k", "v", "out"), "kHeadDim"))
    sinks = f"in{arg_map[3]}"
    lookup = py_function_lookup("MqaByocPySinkForward", PY_SINK_FORWARD_FUNC)
    return f"""
// ---- {symbol}: attention with sinks, {spec.num_q_heads} query heads over {spec.num_kv_heads} K/V heads, head dim {spec.head_dim}, {spec.dtype}, sinks {spec.sinks_dtype}
namespace {{
namespace mqa_byoc_{symbol} {{
{spec_constants(spec, head_dim_v=False)}
const DLDataType kSinkDType = {DL_DATA_TYPES[spec.sinks_dtype]};

@LOOKUP@
void Run({ins}, tvm::ffi::Tensor out) {{
{checks}
  DLDataType sd = {sinks}.dtype();
  if ({sinks}.ndim() != 1 || {sinks}.size(0) != kNumQHeads || sd.code != kSinkDType.code || sd.bits != kSinkDType.bits) {{
    TVM_FFI_THROW(ValueError) << "{symbol}: sinks must be ({spec.num_q_heads},) {spec.sinks_dtype}";
  }}
{views}
  MqaByocPySinkForward()(q_bsnh, k_bsnh, v_bsnh, {sinks}, out_bsnh, kScale, kCausal, kWindowLeft, kWindowRight);
}}
}}  // namespace mqa_byoc_{symbol}
}}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, mqa_byoc_{symbol}::Run);
""".replace("@LOOKUP@", lookup)


def _emit_softcap_forwarder(symbol: str, spec: AttentionSpec, arg_map, num_inputs: int, shape_params=()) -> str:
    ins = ", ".join(f"tvm::ffi::{'Shape' if i in shape_params else 'Tensor'} in{i}" for i in range(num_inputs))
    bnsh = {"q": spec.q_layout == "BNSH", "k": spec.k_layout == "BNSH", "v": spec.v_layout == "BNSH", "out": False}
    operand = {"q": f"in{arg_map[0]}", "k": f"in{arg_map[1]}", "v": f"in{arg_map[2]}", "out": "out"}
    checks, views = operand_checks(symbol, spec, operand, bnsh, dict.fromkeys(("q", "k", "v", "out"), "kHeadDim"))
    lookup = py_function_lookup("MqaByocPySoftcapForward", PY_SOFTCAP_FORWARD_FUNC)
    return f"""
// ---- {symbol}: soft-capped attention, {spec.num_q_heads} query heads over {spec.num_kv_heads} K/V heads, head dim {spec.head_dim}, {spec.dtype}, softcap {float(spec.softcap)!r}
namespace {{
namespace mqa_byoc_{symbol} {{
{spec_constants(spec, head_dim_v=False)}
constexpr double kSoftcap = {float(spec.softcap)!r};

@LOOKUP@
void Run({ins}, tvm::ffi::Tensor out) {{
{checks}
{views}
  MqaByocPySoftcapForward()(q_bsnh, k_bsnh, v_bsnh, out_bsnh, kScale, kSoftcap, kCausal, kWindowLeft, kWindowRight);
}}
}}  // namespace mqa_byoc_{symbol}
}}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, mqa_byoc_{symbol}::Run);
""".replace("@LOOKUP@", lookup)
