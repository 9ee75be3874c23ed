"""relax.ext.flash_attn: spec extraction, provider selection, python-provider forwarders (CPU only).

The python provider is exercised end to end on the CPU: the module is built for llvm, exported,
loaded, and the forwarder calls a numpy stand-in registered as ``mqa_byoc.flash_attn_forward``
(the real providers need CUDA). The CUDA-target build is only exported here: loading a library
with CUDA kernels needs the NVIDIA driver.
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
from mqa_byoc.testing import graphs as G
from mqa_byoc.testing.graphs import dim_maker
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from mqa_byoc.contract import PROVIDER_ATTR, PY_FORWARD_FUNC
from mqa_byoc.compiler import provider as provider_rule
from mqa_byoc.compiler.codegen.dispatch import spec_of
from mqa_byoc.compiler.codegen.sites import CodegenError, find_site
from mqa_byoc.compiler.provider import resolve_provider

ATT = "relax.nn.attention"


def attention_module(h=8, hkv=2, d=64, sq=4, skv=4, dtype="float16", scale=None, causal=None, window=None,
                     q_bnsh=False, out_bnsh=False, kv_same=False, b=1):
    """main(q, k[, v]) -> R.nn.attention(...) + 1 (so that main does more than the offloaded call)."""
    dim = dim_maker()

    B, SQ, SKV = dim(b), dim(sq), dim(skv)
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([B, h, SQ, d] if q_bnsh else [B, SQ, h, d], dtype))
    k = relax.Var("k", relax.TensorType([B, SKV, hkv, d], dtype))
    v = k if kv_same else relax.Var("v", relax.TensorType([B, SKV, hkv, d], dtype))
    params = [q, k] if kv_same else [q, k, v]
    with bb.function("main", params):
        with bb.dataflow():
            qq = bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3])) if q_bnsh else q
            o = bb.emit(relax.op.nn.attention(qq, k, v, scale=scale, causal_mask=causal, window_size=window))
            if out_bnsh:
                o = bb.emit(relax.op.permute_dims(o, [0, 2, 1, 3]))
            o = bb.emit_output(relax.op.add(o, relax.const(1.0, dtype)))
        bb.emit_func_output(o)
    return bb.get()


def partition(mod, name=None, q_bnsh=False, out_bnsh=False):
    """Hand partition (stands in for partition_for_cutlass): one Codegen function per attention."""
    q = is_op("relax.permute_dims")(wildcard()) if q_bnsh else wildcard()
    pat = is_op(ATT)(q, wildcard(), wildcard())
    if out_bnsh:
        pat = is_op("relax.permute_dims")(pat)
    if name is None:
        call = [b.value for b in mod["main"].body.blocks[0].bindings if getattr(b.value.op, "name", "") == ATT][0]
        grouped = int(call.args[1].ty.shape[2]) < int(call.args[0].ty.shape[2])
        name = "flash_attn.attention_mqa" if grouped else "flash_attn.attention"
    return relax.transform.FuseOpsByPattern([(name, pat)], annotate_codegen=True)(mod)


def codegen_funcs(mod):
    return [f for _, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs and "Codegen" in f.attrs]


def np_attention(q, k, v, scale, causal):
    """BSNH float32 reference with FA2's semantics (bottom-right causal, head h -> K/V head h // r)."""
    return G.reference_attention(q, k, v, scale=scale, causal="BottomRight" if causal else None)


@pytest.fixture
def numpy_forward():
    """Register a numpy stand-in for mqa_byoc.flash_attn_forward; restore the previous one after."""
    previous = tvm_ffi.get_global_func(PY_FORWARD_FUNC, allow_missing=True)
    calls = []

    def forward(q, k, v, out, scale, causal, window_left, window_right):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, out=out.shape, scale=scale, causal=causal,
                          window=(window_left, window_right)))
        o = np.from_dlpack(out)
        o[...] = np_attention(np.from_dlpack(q), np.from_dlpack(k), np.from_dlpack(v), scale, causal).astype(o.dtype)

    tvm_ffi.register_global_func(PY_FORWARD_FUNC, forward, override=True)
    yield calls
    if previous is not None:
        tvm_ffi.register_global_func(PY_FORWARD_FUNC, previous, override=True)
    else:
        # a Python closure left in TVM's registry is destroyed after the interpreter: segfault at exit
        tvm_ffi.remove_global_func(PY_FORWARD_FUNC)


# --------------------------------------------------------------------------- registration / RunCodegen


def test_codegen_is_registered():
    assert tvm_ffi.get_global_func("relax.ext.flash_attn", allow_missing=True) is not None


def test_run_codegen_python_provider_bakes_constants():
    mod = partition(attention_module(h=8, hkv=2, d=64, scale=0.125, causal="BottomRight", window=4))
    (func,) = codegen_funcs(mod)
    symbol = str(func.attrs["global_symbol"])
    out = relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})(mod)
    main = out["main"].script()
    assert f'R.call_dps_packed("{symbol}"' in main
    assert "Codegen" not in out.script()
    (ext,) = out.attrs["external_mods"]
    src = ext.inspect_source()
    for line in (
        "kNumQHeads = 8;", "kNumKVHeads = 2;", "kHeadDim = 64;", "kScale = 0.125;", "kCausal = true;",
        "kWindowLeft = 3;", "kWindowRight = 0;", "DLDataType{kDLFloat, 16, 1}",
        f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol},", '"mqa_byoc.flash_attn_forward"',
        "import mqa_byoc.runtime.providers",
    ):
        assert line in src, line


def test_one_python_module_for_several_sites():
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 4, 8, 64], "float16"))
    k = relax.Var("k", relax.TensorType([1, 4, 2, 64], "float16"))
    v = relax.Var("v", relax.TensorType([1, 4, 2, 64], "float16"))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.attention(q, k, v, causal_mask="TopLeft"))
            o = bb.emit_output(relax.op.nn.attention(a, k, v))
        bb.emit_func_output(o)
    mod = partition(bb.get(), "flash_attn.attention_mqa")
    assert len(codegen_funcs(mod)) == 2
    out = relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})(mod)
    (ext,) = out.attrs["external_mods"]
    src = ext.inspect_source()
    assert src.count("TVM_FFI_DLL_EXPORT_TYPED_FUNC(") == 2
    assert src.count("MqaByocPyForward() {") == 1  # shared prelude emitted once


# --------------------------------------------------------------------------- spec extraction


@pytest.mark.parametrize(
    "h, hkv, name", [(8, 1, "flash_attn.attention_mqa"), (8, 2, "flash_attn.attention_mqa"), (8, 8, "flash_attn.attention")]
)
def test_spec_mqa_gqa_mha(h, hkv, name):
    mod = partition(attention_module(h=h, hkv=hkv, d=128, sq="s", skv="s_kv", b="b", causal="BottomRight"))
    (func,) = codegen_funcs(mod)
    site = find_site(func)
    assert site.composite_name == name and site.arg_map == (0, 1, 2) and site.num_inputs == 3
    spec = spec_of(func)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.group_size) == (h, hkv, 128, h // hkv)
    assert spec.causal and (spec.window_left, spec.window_right) == (-1, -1)
    assert spec.scale == pytest.approx(1 / math.sqrt(128))  # scale None -> 1/sqrt(D)
    assert spec.dtype == "float16"


def test_spec_bf16_scale_window_and_layouts():
    mod = partition(attention_module(dtype="bfloat16", scale=0.5, window=16, q_bnsh=True, out_bnsh=True),
                    "flash_attn.attention_mqa", q_bnsh=True, out_bnsh=True)
    spec = spec_of(codegen_funcs(mod)[0])
    assert spec.dtype == "bfloat16" and spec.scale == 0.5 and not spec.causal
    assert (spec.window_left, spec.window_right) == (15, 0)
    assert (spec.q_layout, spec.k_layout, spec.v_layout, spec.out_layout) == ("BNSH", "BSNH", "BSNH", "BNSH")


def test_spec_errors_are_clear():
    f32 = partition(attention_module(dtype="float32"))
    with pytest.raises(CodegenError, match=r"\(fused\w*\): cannot read .*float32 is not supported by FA2"):
        spec_of(codegen_funcs(f32)[0])
    wrong_name = partition(attention_module(h=8, hkv=8), "flash_attn.attention_mqa")
    with pytest.raises(CodegenError, match="expected flash_attn.attention"):
        spec_of(codegen_funcs(wrong_name)[0])
    odd_dim = partition(attention_module(d=36))
    with pytest.raises(CodegenError, match="head dim 36"):
        spec_of(codegen_funcs(odd_dim)[0])
    # RunCodegen surfaces the same error
    with pytest.raises(Exception, match="float32 is not supported"):
        relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})(f32)


# --------------------------------------------------------------------------- provider selection


def test_provider_selection_order():
    func = codegen_funcs(partition(attention_module()))[0]
    tagged = func.with_attr(PROVIDER_ATTR, "native")
    # 1. function attribute beats the option
    assert resolve_provider(tagged, {"provider": "python"}) == "native"
    # 2. the codegen option
    assert resolve_provider(func, {"provider": "python"}) == "python"
    assert resolve_provider(func, {"provider": "hopper"}) == "hopper"
    # 3. default rule, which "auto" (at any level) also selects
    assert resolve_provider(func, {"target": {"kind": "llvm"}}) == "python"
    assert resolve_provider(func, {"provider": "auto", "target": {"kind": "llvm"}}) == "python"
    assert resolve_provider(func.with_attr(PROVIDER_ATTR, "auto"), {"provider": "native",
                                                                  "target": {"kind": "llvm"}}) == "python"
    with pytest.raises(ValueError, match="unknown flash_attn provider 'cutlass'"):
        resolve_provider(func, {"provider": "cutlass"})


def test_no_process_wide_provider_setting(monkeypatch):
    """The provider is an argument: no setter, and no environment variable changes the choice."""
    from mqa_byoc.compiler.codegen import dispatch

    for name in ("set_default_provider", "use_provider"):
        assert not hasattr(provider_rule, name) and not hasattr(dispatch, name)
    func = codegen_funcs(partition(attention_module()))[0]
    monkeypatch.setenv("MQA_BYOC_PROVIDER", "native")
    assert resolve_provider(func, {"target": {"kind": "llvm"}}) == "python"


def test_default_rule(monkeypatch):
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert provider_rule.default_provider(cuda, nvcc=True, native=True, hopper=False) == "native"
    # sm_90 with FA4 objects at hand: the hopper provider; any other arch keeps FA2
    assert provider_rule.default_provider(cuda, nvcc=True, native=True, hopper=True) == "hopper"
    sm80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert provider_rule.default_provider(sm80, nvcc=True, native=True, hopper=True) == "native"
    assert provider_rule.default_provider(sm80, nvcc=True, native=True) == "native"
    # detection: no flash-attn-4 and no prebuilt FA4 objects -> native, and the reason says how to get them
    from mqa_byoc.kernels import hopper as hopper_kernels

    monkeypatch.setattr(hopper_kernels, "compiler_available", lambda: False)
    monkeypatch.delenv("MQA_BYOC_KERNEL_DIR", raising=False)
    assert provider_rule.default_provider(cuda, nvcc=True, native=True) == "native"
    assert "flash-attn-4" in provider_rule.hopper_unavailable(cuda)
    assert "sm_90" in provider_rule.hopper_unavailable(sm80)
    assert provider_rule.default_provider(None, nvcc=True, native=True) == "native"  # no target: CUDA assumed
    assert provider_rule.default_provider(cuda, nvcc=False, native=True) == "python"
    assert provider_rule.default_provider(cuda, nvcc=True, native=False) == "python"
    assert provider_rule.default_provider({"kind": "llvm"}, nvcc=True, native=True) == "python"
    with cuda:
        assert provider_rule.default_provider(nvcc=True, native=True, hopper=False) == "native"
    with tvm.target.Target("llvm"):
        assert provider_rule.default_provider(nvcc=True, native=True) == "python"


def test_native_provider_plumbing(monkeypatch):
    import mqa_byoc.compiler.codegen as pkg

    class FakeSource:
        kernels = ()

        def __init__(self, code):
            self.code = code

    seen = []

    class FakeNative:
        @staticmethod
        def emit_native_source(symbol, spec, shape_args=0, **parameters):
            seen.append((symbol, spec))
            return FakeSource(f"// native source for {symbol}\n")

    monkeypatch.setitem(sys.modules, "mqa_byoc.compiler.codegen.native", FakeNative)
    monkeypatch.setattr(pkg, "native", FakeNative, raising=False)
    mod = partition(attention_module())
    out = relax.transform.RunCodegen({"flash_attn": {"provider": "native"}})(mod)
    (ext,) = out.attrs["external_mods"]
    assert ext.inspect_source().startswith("// native source for fused")
    assert seen and seen[0][1].num_kv_heads == 2


def test_native_provider_unavailable_is_clear(monkeypatch):
    import mqa_byoc.compiler.codegen as pkg

    monkeypatch.setitem(sys.modules, "mqa_byoc.compiler.codegen.native", None)
    monkeypatch.delattr(pkg, "native", raising=False)
    mod = partition(attention_module())
    with pytest.raises(Exception, match="provider 'native' needs mqa_byoc.compiler.codegen.native"):
        relax.transform.RunCodegen({"flash_attn": {"provider": "native"}})(mod)


# --------------------------------------------------------------------------- python provider end to end


def _build_cpu(mod, path):
    out = relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})(mod)
    ex = relax.build(out, target="llvm")
    ex.export_library(str(path))
    return tvm.runtime.load_module(str(path))


def _run(lib, *arrays):
    vm = relax.VirtualMachine(lib, tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in arrays)).numpy()


def test_python_provider_end_to_end_cpu(tmp_path, numpy_forward):
    rng = np.random.default_rng(0)
    # GQA, symbolic B/S, chunked prefill (S_q < S_kv), causal; q and out in BNSH (strided views)
    mod = partition(
        attention_module(h=8, hkv=2, d=64, sq="s", skv="s_kv", b="b", causal="BottomRight", scale=0.2,
                         q_bnsh=True, out_bnsh=True),
        "flash_attn.attention_mqa", q_bnsh=True, out_bnsh=True,
    )
    lib = _build_cpu(mod, tmp_path / "gqa.so")
    q = rng.standard_normal((2, 8, 3, 64)).astype("float16")  # BNSH
    k = rng.standard_normal((2, 5, 2, 64)).astype("float16")
    v = rng.standard_normal((2, 5, 2, 64)).astype("float16")
    got = _run(lib, q, k, v)
    ref = np_attention(q.transpose(0, 2, 1, 3), k, v, 0.2, True).transpose(0, 2, 1, 3) + 1.0
    np.testing.assert_allclose(got.astype("float32"), ref, atol=2e-2)
    (call,) = numpy_forward
    assert call["q"] == (2, 3, 8, 64) and call["out"] == (2, 3, 8, 64) and call["k"] == (2, 5, 2, 64)
    assert call["scale"] == pytest.approx(0.2) and call["causal"] is True and call["window"] == (-1, -1)


def test_python_provider_parameter_mapping(tmp_path, numpy_forward):
    """attention(q, k, k): the Codegen function has two parameters; the forwarder maps them."""
    mod = partition(attention_module(h=4, hkv=1, d=32, kv_same=True))
    site = find_site(codegen_funcs(mod)[0])
    assert site.arg_map == (0, 1, 1) and site.num_inputs == 2
    lib = _build_cpu(mod, tmp_path / "kv_same.so")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 4, 32)).astype("float16")
    k = rng.standard_normal((1, 4, 1, 32)).astype("float16")
    ref = np_attention(q, k, k, 1 / math.sqrt(32), False) + 1.0
    np.testing.assert_allclose(_run(lib, q, k).astype("float32"), ref, atol=2e-2)


def _decode_after_concat():
    """Decode attention on concat(past, new): S_kv is the expression past_len + 1, so the fused
    function gets a trailing ``tir_vars: R.Shape([past_len])`` parameter."""
    from mqa_byoc import partition_for_cutlass
    from tvm.relax import op as R

    p = tvm.tirx.Var("past_len", "int64")
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 1, 8, 64], "float16"))
    pk = relax.Var("past_k", relax.TensorType([1, p, 2, 64], "float16"))
    nk = relax.Var("new_k", relax.TensorType([1, 1, 2, 64], "float16"))
    with bb.function("main", [q, pk, nk]):
        with bb.dataflow():
            k = bb.emit(R.concat([pk, nk], axis=1))
            kk = bb.emit(R.repeat(k, 4, axis=2))
            out = bb.emit_output(R.nn.attention(q, kk, kk))
        bb.emit_func_output(out)
    return partition_for_cutlass(bb.get(), provider="python")


def test_length_shape_parameter_is_accepted(tmp_path, numpy_forward):
    mod = _decode_after_concat()
    site = find_site(codegen_funcs(mod)[0])
    assert site.num_inputs == 3 and site.shape_params == (2,), site  # q, concat, tir_vars
    lib = _build_cpu(mod, tmp_path / "concat.so")
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 1, 8, 64)).astype("float16")
    pk = rng.standard_normal((1, 6, 2, 64)).astype("float16")
    nk = rng.standard_normal((1, 1, 2, 64)).astype("float16")
    k = np.concatenate([pk, nk], axis=1)
    ref = np_attention(q, k, k, 1 / math.sqrt(64), False)
    np.testing.assert_allclose(_run(lib, q, pk, nk).astype("float32"), ref, atol=2e-2)
    # the native provider's wrapper for it (that such a source compiles: test_codegen_native)
    from mqa_byoc.compiler.codegen.native import emit_native_source

    code = emit_native_source("s", spec_of(codegen_funcs(mod)[0]), shape_args=len(site.shape_params)).code
    assert "tvm::ffi::Shape in3, DLTensor* out" in code and "run_params" in code


def test_forwarder_checks_shapes_and_missing_provider(tmp_path, numpy_forward):
    path = tmp_path / "mqa.so"
    lib = _build_cpu(partition(attention_module(h=8, hkv=2, d=64, sq=4, skv=4)), path)
    fn = [f for f in codegen_funcs(partition(attention_module()))][0]
    symbol = str(fn.attrs["global_symbol"])
    q = np.zeros((1, 4, 8, 64), "float16")
    bad_k = np.zeros((1, 4, 4, 64), "float16")  # 4 K/V heads; compiled for 2
    out = np.zeros((1, 4, 8, 64), "float16")
    (host,) = [m for m in lib.imports if m.implements_function(symbol)]
    with pytest.raises(Exception, match="k has 4 heads of dim 64, compiled for 2 heads"):
        host[symbol](*(tvm.runtime.tensor(a) for a in (q, bad_k, bad_k, out)))
    assert not numpy_forward
    # A fresh process that never imported the providers gets a clear error.
    script = textwrap.dedent(f"""
        import numpy as np, tvm
        from tvm import relax
        lib = tvm.runtime.load_module({str(path)!r})
        vm = relax.VirtualMachine(lib, tvm.cpu())
        x = [tvm.runtime.tensor(np.zeros(s, "float16")) for s in ((1, 4, 8, 64), (1, 4, 2, 64), (1, 4, 2, 64))]
        try:
            vm["main"](*x)
        except Exception as err:
            print("ERROR:", err)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "ERROR:" in res.stdout, res.stdout + res.stderr
    assert "import mqa_byoc.runtime.providers" in res.stdout


def test_cuda_target_export_with_python_provider(tmp_path):
    """Builds for sm_90 on this CPU machine; loading needs the NVIDIA driver, so only export + symbol."""
    mod = partition(attention_module(h=8, hkv=1, d=128, sq="s", skv="s", causal="BottomRight"))
    symbol = str(codegen_funcs(mod)[0].attrs["global_symbol"])
    out = relax.transform.RunCodegen({"flash_attn": {"provider": "python"}})(mod)
    ex = relax.build(out, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    path = tmp_path / "cuda_python.so"
    ex.export_library(str(path))
    assert path.stat().st_size > 0
    so = ctypes.CDLL(str(path))  # the host library itself loads without a GPU
    assert hasattr(so, f"__tvm_ffi_{symbol}")
