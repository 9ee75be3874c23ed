"""Native provider: emitted wrapper source, kernel planning, toolchain errors, compile/link smoke.

Runs on CPU. Nothing here compiles an FA2 kernel file; the `slow` tests compile the dispatcher and the
emitted wrapper (seconds) and skip when nvcc / flash-attn's sources / TVM are not available.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mqa_byoc.compiler.codegen.native import NativeSource, emit_native_source
from mqa_byoc.compiler.graph.spec import AttentionSpec
from mqa_byoc import kernels as K
from mqa_byoc.kernels import KernelKey, NativeKernelsUnavailable


def spec(h=32, hkv=8, d=128, dtype="float16", causal=True, wl=-1, wr=-1, scale=None, **layouts):
    return AttentionSpec(h, hkv, d, d, dtype, AttentionSpec.default_scale(d) if scale is None else scale,
                         causal, wl, wr, **layouts)


def _nvcc_or_none():
    try:
        return K.find_nvcc()
    except NativeKernelsUnavailable:
        return None


def _fa_tree_or_none():
    try:
        return K.flash_attn_source(download=False, progress=lambda _m: None)
    except NativeKernelsUnavailable:
        return None


NVCC = _nvcc_or_none()
FA_TREE = _fa_tree_or_none()  # resolved before any test redirects the cache
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit not installed)")
needs_fa = pytest.mark.skipif(
    FA_TREE is None,
    reason="flash-attn sources not available offline (set MQA_BYOC_FLASH_ATTN_SRC or run mqa-byoc build-kernels)",
)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """An empty cache, no prebuilt dirs, flash-attn sources only through MQA_BYOC_FLASH_ATTN_SRC."""
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MQA_BYOC_KERNEL_DIR", raising=False)
    monkeypatch.delenv("MQA_BYOC_NVCC", raising=False)
    if FA_TREE is not None:
        monkeypatch.setenv("MQA_BYOC_FLASH_ATTN_SRC", str(FA_TREE))
    else:
        monkeypatch.delenv("MQA_BYOC_FLASH_ATTN_SRC", raising=False)
    return tmp_path


# ------------------------------------------------------------------------------------ planning


@pytest.mark.parametrize("d,kd", [(8, 32), (32, 32), (40, 64), (64, 64), (80, 96), (96, 96), (112, 128),
                                  (128, 128), (136, 192), (192, 192), (200, 256), (256, 256)])
def test_kernel_head_dim_rounding(d, kd):
    assert K.kernel_head_dim(d) == kd


@pytest.mark.parametrize("d", [0, 84, 260, 512, -8])
def test_kernel_head_dim_rejects(d):
    with pytest.raises(ValueError, match="multiple of 8"):
        K.kernel_head_dim(d)


def test_plan_causal_needs_causal_and_noncausal_split_and_not():
    keys = K.plan_kernels(spec(d=128, causal=True))
    assert keys == (
        KernelKey(128, "fp16", False, False),
        KernelKey(128, "fp16", False, True),
        KernelKey(128, "fp16", True, False),
        KernelKey(128, "fp16", True, True),
    )


def test_plan_noncausal_bf16_rounds_head_dim():
    keys = K.plan_kernels(spec(d=80, dtype="bfloat16", causal=False))
    assert keys == (KernelKey(96, "bf16", False, False), KernelKey(96, "bf16", False, True))
    assert {k.label for k in keys} == {"hdim96 bf16", "hdim96 bf16 split"}


def test_plan_window_also_plans_causal():
    # a sliding window wider than S_kv degenerates to causal at run time (window_right == 0)
    keys = K.plan_kernels(spec(d=64, causal=False, wl=255, wr=0))
    assert {k.causal for k in keys} == {False, True} and {k.split for k in keys} == {False, True}


def test_plan_rejects_mismatched_v_dim():
    bad = AttentionSpec(8, 2, 64, 128, "float16", 0.125, False)
    with pytest.raises(ValueError, match="head dims"):
        K.plan_kernels(bad)


def test_kernel_key_names():
    k = KernelKey(128, "fp16", True, True)
    assert k.entry_symbol == "mqa_byoc_fa2_fwd_split_hdim128_fp16_causal"
    assert k.flash_attn_file == "flash_fwd_split_hdim128_fp16_causal_sm80.cu"
    assert k.stem == "fwd_split_hdim128_fp16_causal"
    k2 = KernelKey(64, "bf16", False, False)
    assert k2.entry_symbol == "mqa_byoc_fa2_fwd_hdim64_bf16"
    assert k2.flash_attn_file == "flash_fwd_hdim64_bf16_sm80.cu"
    with pytest.raises(ValueError):
        KernelKey(80, "fp16", False, False)
    with pytest.raises(ValueError):
        KernelKey(64, "fp32", False, False)


def test_entry_symbols_match_dispatcher_pattern():
    # fa2_dispatch.cc builds its weak references as mqa_byoc_fa2_fwd[_split]_hdim<hd>_<dt><_causal|>
    src = (K.NATIVE_DIR / "fa2_dispatch.cc").read_text()
    assert "mqa_byoc_fa2_fwd_hdim##hd##_##dt##c" in src
    assert "mqa_byoc_fa2_fwd_split_hdim##hd##_##dt##c" in src
    for hd in K.KERNEL_HEAD_DIMS:
        assert f"MQA_BYOC_DT_CAUSAL(X, {hd})" in src


@needs_fa
def test_flash_attn_has_every_planned_file():
    src = FA_TREE / "csrc/flash_attn/src"
    for key in K.keys_for(K.KERNEL_HEAD_DIMS, K.DTYPES):
        assert (src / key.flash_attn_file).is_file(), key.flash_attn_file


def test_labels_and_markers_roundtrip():
    keys = K.keys_for([64, 80], ["fp16", "bfloat16"])
    assert len(keys) == 16
    for k in keys:
        assert KernelKey.parse(k.label) == k
    assert KernelKey.parse("sm_90 hdim128 fp16 causal split") == KernelKey(128, "fp16", True, True)
    src = "int x;\n" + K.marker_line(keys[:5]) + "\n" + K.marker_line(keys[3:]) + "\n"
    assert K.parse_markers(src) == keys
    with pytest.raises(ValueError):
        KernelKey.parse("hdim128 fp16 sideways")


@pytest.mark.parametrize("arch,norm", [("sm_90", "sm_90"), ("90", "sm_90"), ("9.0", "sm_90"), ("sm80", "sm_80"),
                                       ("compute_86", "sm_86"), ("sm_90a", "sm_90a")])
def test_normalize_arch(arch, norm):
    assert K.normalize_arch(arch) == norm


def test_normalize_arch_rejects_old():
    with pytest.raises(ValueError, match="sm_80"):
        K.normalize_arch("sm_75")


def test_build_command_hint():
    keys = K.plan_kernels(spec(d=128, dtype="bfloat16"))
    assert K.build_command_hint(keys, "sm_90") == "mqa-byoc build-kernels --arch sm_90 --head-dims 128 --dtypes bf16"


# ------------------------------------------------------------------------------------ emitted source


def _const(code, name):
    m = re.search(rf"constexpr [\w: ]+ {name} = ([^;]+);", code)
    assert m, name
    return m.group(1)


def test_emit_constants_gqa_causal_fp16():
    s = spec(h=32, hkv=8, d=128, causal=True)
    src = emit_native_source("fused_attn_site0", s)
    assert isinstance(src, NativeSource)
    code = src.code
    assert _const(code, "kHeads") == "32"
    assert _const(code, "kKvHeads") == "8"
    assert _const(code, "kHeadDim") == "128" and _const(code, "kHeadDimV") == "128"
    assert _const(code, "kIsBf16") == "0"
    assert _const(code, "kCausal") == "1"
    assert _const(code, "kWindowLeft") == "-1" and _const(code, "kWindowRight") == "-1"
    assert _const(code, "kScale") == f"static_cast<float>({s.scale!r})"
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_attn_site0, run);" in code
    assert "TVMFFIEnvGetStream(kDLCUDA, dev)" in code
    assert "t->dtype.code != kDLFloat" in code
    assert "mqa_byoc_fa2_forward(" in code and "mqa_byoc_fa2_last_error()" in code
    assert "// mqa_byoc-kernels: hdim128 fp16; hdim128 fp16 split; hdim128 fp16 causal; hdim128 fp16 causal split" in code
    assert src.kernels == K.plan_kernels(s)
    assert K.parse_markers(code) == src.kernels


def test_emit_constants_mqa_bf16_window_bnsh():
    s = spec(h=16, hkv=1, d=80, dtype="bfloat16", causal=False, wl=4095, wr=0, scale=0.5,
             q_layout="BNSH", k_layout="BNSH", v_layout="BSNH", out_layout="BNSH")
    src = emit_native_source("attn_mqa", s)
    code = src.code
    assert _const(code, "kHeads") == "16" and _const(code, "kKvHeads") == "1"
    assert _const(code, "kHeadDim") == "80"
    assert _const(code, "kIsBf16") == "1" and "t->dtype.code != kDLBfloat" in code
    assert _const(code, "kCausal") == "0"
    assert _const(code, "kWindowLeft") == "4095" and _const(code, "kWindowRight") == "0"
    assert _const(code, "kScale") == "static_cast<float>(0.5)"
    assert [_const(code, n) for n in ("kQBnsh", "kKBnsh", "kVBnsh", "kOBnsh")] == ["true", "true", "false", "true"]
    assert {k.head_dim for k in src.kernels} == {96}
    assert {k.dtype for k in src.kernels} == {"bf16"}
    assert len(src.kernels) == 4  # window_right == 0: causal kernels too


def test_emit_is_deterministic_and_symbol_specific():
    a = emit_native_source("s0", spec()).code
    assert a == emit_native_source("s0", spec()).code
    b = emit_native_source("s1", spec()).code
    assert a != b and "TVM_FFI_DLL_EXPORT_TYPED_FUNC(s1, run);" in b


@pytest.mark.parametrize(
    "symbol,s,match",
    [
        ("bad-name", spec(), "C identifier"),
        ("ok", spec(dtype="float32"), "supports"),
        ("ok", spec(h=12, hkv=5), "multiple"),
        ("ok", spec(d=84), "multiple of 8"),
        ("ok", spec(d=264), "multiple of 8"),
        ("ok", AttentionSpec(8, 2, 64, 32, "float16", 0.1, False), "head_dim_v"),
        ("ok", spec(scale=float("nan")), "finite"),
        ("ok", spec(q_layout="SBNH"), "layout"),
    ],
)
def test_emit_rejects(symbol, s, match):
    with pytest.raises(ValueError, match=match):
        emit_native_source(symbol, s)


def test_kernel_build_modules_do_not_import_tvm():
    code = (
        "import sys, mqa_byoc.kernels, mqa_byoc.compiler.codegen.native;"
        "bad=[m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')];"
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ------------------------------------------------------------------------------------ toolchain errors


def test_nvcc_missing_via_env(monkeypatch):
    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    with pytest.raises(NativeKernelsUnavailable, match=r'nvcc not found.*provider="python"'):
        K.find_nvcc()


def test_nvcc_missing_via_path(monkeypatch, tmp_path):
    monkeypatch.delenv("MQA_BYOC_NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(K.toolchain, "_NVCC_CANDIDATES", ())
    with pytest.raises(NativeKernelsUnavailable, match="nvcc not found; install the CUDA toolkit"):
        K.find_nvcc()


def test_build_without_nvcc_is_clear(clean_env, monkeypatch):
    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    with pytest.raises(NativeKernelsUnavailable, match="nvcc not found"):
        K.link_inputs([spec()], "sm_90")


def test_cli_without_nvcc(clean_env, monkeypatch, capsys):
    from mqa_byoc.cli import main

    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    assert main(["build-kernels", "--arch", "sm_90", "--head-dims", "128", "--dtypes", "fp16"]) == 1
    assert "nvcc not found" in capsys.readouterr().err


def test_prebuilt_dir_is_used_without_nvcc(clean_env, monkeypatch):
    # objects copied to another machine (MQA_BYOC_KERNEL_DIR) are found even where nvcc is absent
    d = clean_env / "artifacts" / "sm_90-abc"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text('{"arch": "sm_90"}')
    keys = K.plan_kernels(spec(d=64, causal=False))
    for k in keys:
        (d / f"{k.stem}.o").write_bytes(b"")
    monkeypatch.setenv("MQA_BYOC_KERNEL_DIR", str(clean_env / "artifacts"))
    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    found = K.build_kernels(keys, "sm_90", build=False, progress=None)
    assert set(found) == set(keys) and all(p.parent == d for p in found.values())
    assert K.find_kernels(keys, "sm_80") == {}


@needs_nvcc
@needs_fa
def test_build_false_names_the_command(clean_env):
    with pytest.raises(NativeKernelsUnavailable, match=r"mqa-byoc build-kernels --arch sm_90 --head-dims 128 --dtypes bf16"):
        K.build_kernels(K.plan_kernels(spec(dtype="bfloat16")), "sm_90", build=False, progress=None)


@needs_nvcc
@needs_fa
def test_cache_dir_keyed_by_arch_and_toolchain(clean_env):
    a = K.build_config("sm_90", download=False)
    b = K.build_config("sm_80", download=False)
    assert a.dir != b.dir and a.dir.name.startswith("sm_90-") and K.FLASH_ATTN_VERSION in str(a.dir)
    assert a.dir.is_relative_to(clean_env / "cache")


# ------------------------------------------------------------------------------------ compile smoke (slow)


def _tvm_include_flags():
    tvm = pytest.importorskip("tvm")
    import tvm_ffi.libinfo as ffi_info

    return ["-I" + p for p in (tvm.libinfo.find_include_path(), ffi_info.find_include_path(),
                               ffi_info.find_dlpack_include_path())]


@pytest.mark.slow
@needs_gxx
def test_emitted_wrapper_compiles(tmp_path):
    flags = _tvm_include_flags()
    specs = [spec(), spec(h=16, hkv=1, d=80, dtype="bfloat16", causal=False, wl=127, wr=0,
                          q_layout="BNSH", out_layout="BNSH"), spec()]
    for i, s in enumerate(specs):
        cc = tmp_path / f"w{i}.cc"
        # the last one takes a trailing R.Shape (tir_vars of a fused function with S_kv = past_len + 1)
        cc.write_text(emit_native_source(f"site{i}", s, shape_args=1 if i == 2 else 0).code)
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-Wall", "-Werror", "-c", str(cc), "-o",
                            str(tmp_path / f"w{i}.o")] + flags, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        syms = subprocess.run(["nm", str(tmp_path / f"w{i}.o")], capture_output=True, text=True).stdout
        assert f"T __tvm_ffi_site{i}" in syms
        assert re.search(r"w mqa_byoc_fa2_forward", syms)  # weak: a missing dispatcher is a clear error


@pytest.mark.slow
@needs_nvcc
@needs_fa
def test_dispatcher_compiles_and_links(clean_env):
    obj = K.build_dispatcher(progress=None)
    assert obj.is_file() and obj.is_relative_to(clean_env / "cache")
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert re.search(r"T mqa_byoc_fa2_forward\b", syms) and re.search(r"T mqa_byoc_fa2_forward_softcap\b", syms)
    weak = re.findall(r" w (mqa_byoc_fa2_fwd\w+)", syms)
    # head dims x dtypes x causal x split, plain and soft-capping families
    assert len(weak) == 6 * 2 * 2 * 2 * 2 and "mqa_byoc_fa2_fwd_split_hdim128_fp16_causal" in weak
    assert "mqa_byoc_fa2_fwd_split_hdim256_bf16_causal_softcap" in weak
    # the same object again comes from the cache
    assert K.build_dispatcher(build=False, progress=None) == obj
    # its split-KV decode kernels (split_kv_combine.cu) are the one strong reference it needs besides cudart
    support = K.build.support_object("sm_90", progress=None)
    support_syms = subprocess.run(["nm", "--defined-only", str(support)], capture_output=True, text=True).stdout
    assert "T mqa_byoc_combine_chunks" in support_syms and "T mqa_byoc_chunk_lengths" in support_syms
    # a C++ program links against both with static cudart (no kernels: all weak refs stay null)
    exe = K.link_check([str(obj), str(support)], out=clean_env / "link_check", progress=lambda _m: None)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0 kernel families linked" in out.stdout


@pytest.mark.slow
@needs_nvcc
@needs_fa
@needs_gxx
def test_export_links_native_wrapper_and_loads(clean_env):
    tvm = pytest.importorskip("tvm")
    from mqa_byoc.testing.graphs import import_c_source, site_call_executable
    from tvm import relax

    from mqa_byoc.compiler import export as E

    ex, q, kv = site_call_executable("mqa_site0")
    path = clean_env / "plain.so"
    E.export_library(ex, path, arch="sm_90", build=False)  # no markers: exported unchanged
    assert path.is_file()

    import_c_source(ex, emit_native_source("mqa_site0", spec(h=8, hkv=2, d=64)).code, ["mqa_site0"])
    # TVM's own export does not link the dispatcher: the library loads, the call explains
    ex.export_library(str(clean_env / "tvm_export.so"))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(clean_env / "tvm_export.so")), tvm.cpu())
    with pytest.raises(Exception, match="not linked into this library.*mqa_byoc.export_library"):
        vm["main"](q, kv, kv)
    assert E.collect_kernel_keys(ex) == K.plan_kernels(spec(h=8, hkv=2, d=64))
    with pytest.raises(NativeKernelsUnavailable, match="mqa-byoc build-kernels --arch sm_90 --head-dims 64"):
        E.export_library(ex, clean_env / "x.so", arch="sm_90", build=False, progress=None)

    K.build_dispatcher(progress=None)
    path = clean_env / "native.so"
    E.export_library(ex, path, arch="sm_90", build=False, allow_missing=True, progress=None)
    ldd = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    assert "libcudart" not in ldd  # static CUDA runtime
    lib = tvm.runtime.load_module(str(path))
    vm = relax.VirtualMachine(lib, tvm.cpu())
    with pytest.raises(Exception, match="mqa_site0: q must be on a CUDA device"):
        vm["main"](q, kv, kv)


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80"])
def test_decode_support_compiles_for_gpus_without_clusters(clean_env, arch):
    # thread-block clusters (the decode kernel's cluster merge) are sm_90's: a build for Ampere or Ada keeps
    # every other path, so a site reported offloaded for those targets builds
    support = K.build.support_object(arch, progress=None)
    syms = subprocess.run(["nm", "--defined-only", str(support)], capture_output=True, text=True).stdout
    assert "T mqa_byoc_combine_chunks" in syms and "T mqa_byoc_decode_supported" in syms
