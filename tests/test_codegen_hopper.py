"""The hopper provider on the CPU: kernel keys, markers, the wrapper it emits, the report, and (when
flash-attn-4 is installed) the ahead-of-time compile of FA4 objects and their link into a library.

Its numerics, kernel choice and standalone run are checked on the H200 by tests/gpu (build_forms --hopper).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess

import pytest

from mqa_byoc.testing import graphs
import mqa_byoc
from mqa_byoc.compiler.codegen import hopper as hopper_codegen
from mqa_byoc.compiler.codegen import native as native_codegen
from mqa_byoc.compiler.graph.spec import AttentionSpec
from mqa_byoc.kernels import hopper

SM90 = {"kind": "cuda", "arch": "sm_90"}


def _spec(h=64, hkv=8, d=128, dtype="float16", causal=True, wl=-1, wr=-1):
    return AttentionSpec(num_q_heads=h, num_kv_heads=hkv, head_dim=d, head_dim_v=d, dtype=dtype,
                         scale=d ** -0.5, causal=causal, window_left=wl, window_right=wr)


def test_key_label_round_trip_and_validation():
    key = hopper.HopperKernelKey("float16", 128, 8, "causal")
    assert key.dtype == "fp16" and key.label == "fp16 h128 g8 causal"
    assert hopper.HopperKernelKey.parse(key.label) == key
    assert key.symbol == "mqa_byoc_fa4_sm90_fp16_h128_g8_causal" and key.num_args == 5
    assert hopper.HopperKernelKey.parse("bf16 h64 g71 local").num_args == 7
    for bad in (("fp16", 32, 8, "causal"), ("fp16", 128, 0, "causal"), ("fp16", 128, 8, "topleft"),
                ("float32", 128, 8, "none")):
        with pytest.raises(ValueError):
            hopper.HopperKernelKey(*bad)
    with pytest.raises(ValueError, match="bad hopper kernel label"):
        hopper.HopperKernelKey.parse("fp16 128 8 causal")


def test_mask_kinds():
    assert hopper.mask_kind(True, -1, -1) == "causal"
    assert hopper.mask_kind(True, 4095, -1) == "local"  # Mistral: causal + window
    assert hopper.mask_kind(False, -1, -1) == "none"
    assert hopper.mask_kind(False, -1, 0) == "local"


def test_markers_round_trip():
    keys = [hopper.HopperKernelKey("fp16", 128, 8, "causal"), hopper.HopperKernelKey("bf16", 64, 71, "splitkv")]
    src = "// other\n" + hopper.marker_line(keys) + "\nint x;\n"
    assert hopper.parse_markers(src) == set(keys)
    assert hopper.parse_markers("// mqa_byoc-kernels: hdim128 fp16\n") == set()


def test_kernel_keys_of_specs():
    assert hopper_codegen.kernel_key(_spec()).label == "fp16 h128 g8 causal"
    assert hopper_codegen.decode_key(_spec()).label == "fp16 h128 g8 splitkv"
    local = _spec(wl=4095)
    assert hopper_codegen.kernel_key(local).label == "fp16 h128 g8 local"
    assert hopper_codegen.decode_key(local) is None  # the windowed decode stays on FA2
    assert hopper_codegen.kernel_key(_spec(h=71, hkv=1, d=64, dtype="bfloat16", causal=False)).label == \
        "bf16 h64 g71 none"
    small = _spec(h=8, hkv=2, d=32)
    assert hopper_codegen.kernel_key(small) is None and "head dim 32" in hopper_codegen.fa4_rejection(small)


def test_wrapper_calls_fa4_and_keeps_fa2():
    code = native_codegen.emit_native_source("site0", _spec(), hopper=True).code
    assert "__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h128_g8_causal" in code
    assert "__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h128_g8_splitkv" in code
    assert hopper.parse_markers(code) == {hopper.HopperKernelKey("fp16", 128, 8, "causal"),
                                          hopper.HopperKernelKey("fp16", 128, 8, "splitkv")}
    assert "mqa_byoc_fa2_forward(" in code and "mqa_byoc_library_kernel_options" in code  # FA2 stays for the rest
    assert "getenv" not in code  # the FA4 choice is the library's kernel option, not the environment
    plain = native_codegen.emit_native_source("site0", _spec()).code
    assert not hopper.parse_markers(plain) and "__tvm_ffi_mqa_byoc_fa4" not in plain
    # a windowed site: FA4 with both window bounds, no split-KV decode object
    local = native_codegen.emit_native_source("site1", _spec(wl=127), hopper=True).code
    assert "args[5] = kWindowLeft < 0" in local and "splitkv" not in local
    # no FA4 object for head dim 32: the hopper wrapper is the FA2 one
    small = native_codegen.emit_native_source("site2", _spec(h=8, hkv=2, d=32), hopper=True).code
    assert small == native_codegen.emit_native_source("site2", _spec(h=8, hkv=2, d=32)).code


def test_offload_report_names_the_kernel():
    mod = graphs.attention_repeat_bsnh(h=64, hkv=8, d=128, s="n")
    site = mqa_byoc.offload_report(mod, target=SM90, provider="hopper")[0]
    assert site.provider == "hopper" and site.kernel.startswith("FA4 sm90")
    assert site.kernel.endswith("otherwise FA2 (decode: our grouped-query decode kernel)")
    site = mqa_byoc.offload_report(mod, target={"kind": "cuda", "arch": "sm_80"}, provider="native")[0]
    assert site.provider == "native" and site.kernel.startswith("FA2")
    small = mqa_byoc.offload_report(graphs.attention_repeat_bsnh(h=8, hkv=2, d=32, s="n"), target=SM90,
                                    provider="hopper")[0]
    assert small.kernel.startswith("FA2") and "head dim 32" in small.kernel
    assert small.kernel.startswith("FA2 (decode: FA2 split-KV)")  # no decode kernel for head dim 32
    falcon = mqa_byoc.offload_report(graphs.attention_repeat_bsnh(h=71, hkv=1, d=64, s="n"), target=SM90,
                                     provider="native")[0]
    assert falcon.kernel == "FA2 (decode: our grouped-query decode kernel), linked"  # 71 rows: 5 CTAs per split
    # before Hopper the decode kernel's plans do not fit (clusters, 227 KB of shared memory): FA2's split-KV
    ampere = mqa_byoc.offload_report(graphs.attention_repeat_bsnh(h=71, hkv=1, d=64, s="n"),
                                     target={"kind": "cuda", "arch": "sm_80"}, provider="native")[0]
    assert ampere.kernel == "FA2 (decode: FA2 split-KV), linked"


def test_unavailable_reasons(monkeypatch, tmp_path):
    monkeypatch.setattr(hopper, "compiler_available", lambda: False)
    monkeypatch.setenv("MQA_BYOC_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    assert "sm_90" in hopper.available("sm_80")
    assert "flash-attn-4" in hopper.available("sm_90")
    with pytest.raises(mqa_byoc.kernels.NativeKernelsUnavailable, match="build-kernels --hopper"):
        hopper.build_objects([hopper.HopperKernelKey("fp16", 128, 8, "causal")], "sm_90")


def test_preset_keys_cover_the_presets():
    from mqa_byoc.models.presets import attention_shapes

    labels = {k.label for k in hopper.preset_keys(attention_shapes())}
    for want in ("fp16 h128 g8 causal", "bf16 h128 g4 splitkv", "fp16 h64 g71 none", "fp16 h128 g1 local"):
        assert want in labels


needs_fa4 = pytest.mark.skipif(not hopper.compiler_available(),
                               reason=f"flash-attn-4 is not installed ({hopper.install_hint()})")
ALLOWED_UNDEFINED = ("TVMFFI", "_cuda", "_cu", "cuda_dialect_", "CuteDSLRT_TVMFFISetRaised", "_GLOBAL_OFFSET_TABLE_")


@needs_fa4
@pytest.mark.slow
def test_aot_compile_exports_one_tvm_ffi_function(tmp_path, monkeypatch):
    key = hopper.HopperKernelKey("fp16", 64, 2, "causal")
    objs = hopper.build_objects([key], "sm_90", out=tmp_path, progress=None)
    obj = objs[key]
    assert obj.parent.name == f"fa4-sm_90-{hopper.FA4_VERSION}"
    defined = subprocess.run(["nm", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    assert f"T __tvm_ffi_{key.symbol}" in defined
    undefined = subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True, check=True).stdout.split()
    stray = [s for s in undefined if s != "U" and not s.startswith(ALLOWED_UNDEFINED)]
    assert not stray, f"the FA4 object needs more than the static shim and TVM-FFI: {stray}"
    manifest = json.loads((obj.parent / hopper.MANIFEST).read_text())
    assert manifest["family"] == "fa4" and manifest["kernels"][key.filename]["label"] == key.label
    assert (obj.parent / hopper.RUNTIME_ARCHIVE).is_file()
    # found there through MQA_BYOC_KERNEL_DIR, as a prebuilt dir
    monkeypatch.setenv("MQA_BYOC_KERNEL_DIR", str(tmp_path))
    assert hopper.find_objects([key])[key] == obj


@needs_fa4
@pytest.mark.slow
def test_export_links_fa4_and_fa2(tmp_path):
    reason = graphs.native_export_skip_reason()
    if reason:
        pytest.skip(reason)
    mod = graphs.attention_repeat_bsnh(h=16, hkv=2, d=64, s="n")
    ex = mqa_byoc.build(mod, SM90, provider="hopper")
    path = tmp_path / "hopper.so"
    mqa_byoc.export_library(ex, str(path), arch="sm_90", progress=None)
    dyn = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    for sym in ("__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h64_g8_causal", "__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h64_g8_splitkv",
                "mqa_byoc_fa4_decode", "CuteDSLRT_TVMFFISetRaisedCudaError"):
        assert sym in dyn
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True,
                               check=True).stdout
    assert "CuteDSLRT_" not in undefined and "libcute_dsl_runtime" not in undefined
    ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)  # every symbol resolves against TVM's runtime
