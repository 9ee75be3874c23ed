"""``mqa_byoc.testing``: importable with a runtime-only TVM, the CUDA-compile hook restores the
previous one, the kernel capture and the run header (fake torch.cuda where a GPU would be needed); the
GPU case tables and the manifest format the GPU tests read on a runtime-only TVM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mqa_byoc import testing
from mqa_byoc.testing import cuda_compile, cupti, header, setup


def test_import_without_relax():
    """No tvm.relax (or torch) at import, for the runtime-only TVM of the GPU machine."""
    code = textwrap.dedent("""
        import sys
        import mqa_byoc.testing as t
        for name in t.__all__:
            getattr(t, name)
        # the case tables and the manifest format, read by the GPU tests there
        import mqa_byoc.testing.attention_cases, mqa_byoc.testing.gpu_manifest, mqa_byoc.testing.varlen_cases
        import mqa_byoc.testing.hf_models
        bad = [m for m in ("tvm.relax", "torch", "mqa_byoc.compiler") if m in sys.modules]
        assert not bad, bad
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cuda_compile_hook" in dir(testing)


def test_cuda_compile_hook_restores_previous():
    import tvm_ffi

    name = cuda_compile.HOOK
    before = tvm_ffi.get_global_func(name, allow_missing=True)
    calls = []

    def outer(code, *rest):
        calls.append(("outer", code))
        return bytearray(b"outer")

    tvm_ffi.register_global_func(name, outer, override=True)
    try:
        def make(previous):
            def compile_cuda(code, *rest):
                if code == "cached":
                    return bytearray(b"hit")
                return previous(code, *rest)
            return compile_cuda

        with cuda_compile.cuda_compile_hook(make):
            f = tvm_ffi.get_global_func(name)
            assert bytes(f("cached")) == b"hit" and bytes(f("other")) == b"outer"
        assert bytes(tvm_ffi.get_global_func(name)("cached")) == b"outer"  # the previous one is back
        assert calls == [("outer", "other"), ("outer", "cached")]
        with cuda_compile.cuda_compile_hook(cuda_compile.memoized_cuda_compile):
            f = tvm_ffi.get_global_func(name)
            assert bytes(f("x")) == bytes(f("x")) == b"outer"
        assert calls[2:] == [("outer", "x")]  # compiled once
    finally:
        if before is not None:
            tvm_ffi.register_global_func(name, before, override=True)
        else:
            tvm_ffi.remove_global_func(name)
    if before is None:
        with cuda_compile.cuda_compile_hook(lambda prev: (lambda code: bytearray(b"only"))):
            pass
        assert tvm_ffi.get_global_func(name, allow_missing=True) is None
        with pytest.raises(RuntimeError, match="no tvm_callback_cuda_compile"):
            cuda_compile.memoized_cuda_compile(None)


def test_fatbin_cache_key():
    assert cuda_compile.fatbin_cache_key("a", "sm_90") != cuda_compile.fatbin_cache_key("b", "sm_90")
    assert cuda_compile.fatbin_cache_key("a", "sm_90").endswith("-sm_90")


class _Evt:
    def __init__(self, name, t, dev="DeviceType.CUDA"):
        self.name, self.device_time, self.device_type = name, t, dev


def test_capture_kernels(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.profiler

    launched = [_Evt("k1", 2.0), _Evt("memcpy", 0.5), _Evt("k1", 3.0), _Evt("cpu_op", 9.0, "DeviceType.CPU"),
                _Evt("k2", 0.0)]

    class Prof:
        def __init__(self, activities):
            self.activities = activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return launched

    monkeypatch.setattr(torch.profiler, "profile", Prof)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with cupti.capture_kernels() as cap:
        assert cap.events == []
    assert cap.names() == ["k1", "memcpy", "k1", "k2"]
    assert {s.name: s.times_us for s in cap.stats()} == {"k1": [2.0, 3.0], "memcpy": [0.5]}
    assert {s.name: s.total for s in cupti.collect_kernels(Prof(None))} == {"k1": 5.0, "memcpy": 0.5}


def test_run_header(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=0: "Fake H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i=0: type("P", (), {"major": 9, "minor": 0}))
    h = header.run_header("bench run", suite="x")
    assert (h["command"], h["gpu"], h["sm"], h["torch"], h["suite"]) == ("bench run", "Fake H200", "sm_90",
                                                                         torch.__version__, "x")
    assert h["date"].endswith("+00:00") and "cuda" in h


def test_import_setup(monkeypatch, tmp_path):
    (tmp_path / "kit_setup_mod.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(setup.SETUP_ENV, "kit_setup_mod")
    assert setup.import_setup() == ["kit_setup_mod"] and sys.modules["kit_setup_mod"].LOADED
    assert setup.import_setup(["json"]) == ["json"]
    monkeypatch.delenv(setup.SETUP_ENV)
    assert setup.import_setup() == []
    with pytest.raises(ImportError):
        setup.import_setup(["no_such_kit_module_xyz"])


def test_clock_sampler_summary(monkeypatch):
    """The SM clock summary: mean and lowest clock, mean power, every limit reason seen; nothing without NVML."""
    from mqa_byoc.testing import gpu_clock

    monkeypatch.setattr(gpu_clock, "_library", lambda: None)
    with gpu_clock.ClockSampler() as none:
        pass
    assert none.summary() == {} and none.samples == []
    s = gpu_clock.ClockSampler()
    s.samples = [(1980, 300.0, 0), (1500, 700.0, 0x4), (1560, 690.0, 0x4 | 0x20)]
    assert s.summary() == {"sm_clock_mhz": 1680, "sm_clock_min_mhz": 1500, "power_w": 563.3,
                           "clock_limits": ["sw_power_cap", "sw_thermal"], "clock_samples": 3}


def test_attention_cases_table():
    from mqa_byoc.contract import composite_name
    from mqa_byoc.testing import attention_cases as ac

    names = [c.name for c in ac.CASES]
    assert len(names) == len(set(names)) and len(names) >= 40
    assert all(c.builder in ac.BUILDERS for c in ac.CASES)
    assert ac.case("repeat_gqa_bf16_decode").dtype == "bfloat16"
    with pytest.raises(KeyError, match="repeat_gqa_bf16_decode"):
        ac.case("no_such_case")
    gqa = ac.case("fewer_gqa_f16_causal_chunked")  # 16 / 4 heads, R.nn.attention without an expansion
    assert gqa.expected_composite(True) == composite_name(16, 4) and gqa.expected_composite(False) == composite_name(16, 16)
    assert gqa.nomqa_expands_kv and not gqa.kv_expanded_in_graph
    sink = ac.case("sink_gptoss_f16_hdim64_causal_prefill")
    assert sink.expected_composite(True) == composite_name(64, 8, sinks=True)
    assert gqa.tolerances() == {k: v["float16"] for k, v in ac.TOLERANCES.items()}
    mla = ac.case("mla_f16_d128_dv64_causal_prefill")  # as many K/V heads as query heads, V narrower
    assert (mla.hkv, mla.d, mla.dv) == (16, 128, 64) and not mla.nomqa_expands_kv
    assert mla.expected_composite(True) == composite_name(16, 16)
    assert (mla.attention()["head_dim"], mla.attention()["head_dim_v"]) == (128, 64)
    assert ac.case("einsum_bshd_gqa_f16_causal_chunked").layouts()["q"] == "BSNH"
    assert ac.case("einsum_bhsd_gqa_f16_causal_prefill").layouts()["output"] == "BNSH"
    own = ac.Case("x", "1 repeat", "attention_repeat_bsnh", dict(h=2, hkv=1, d=64, dtype="bfloat16"),
                  tolerance={"fp32": dict(atol=1.0, rtol=1.0)})
    assert own.tolerances()["fp32"] == dict(atol=1.0, rtol=1.0)
    assert own.tolerances()["tvm_reference"] == ac.TOLERANCES["tvm_reference"]["bfloat16"]
    assert own.as_dict()["tolerance"] == {"fp32": dict(atol=1.0, rtol=1.0)}


def test_gpu_manifest_imports_nothing_of_the_package():
    """The standalone child loads it by path in a process where mqa_byoc cannot be imported."""
    import ast
    from pathlib import Path

    from mqa_byoc.testing import gpu_manifest

    tree = ast.parse(Path(gpu_manifest.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "json", "os", "zlib", "pathlib", "numpy"}, imported


def test_replaced_global_func_restores_or_removes():
    import tvm_ffi

    from mqa_byoc.runtime.ffi_globals import replaced_global_func

    name = "mqa_byoc.testing.replaced_probe"
    seen = []
    with replaced_global_func(name, lambda prev: (seen.append(prev), lambda: 1)[1]) as fn:
        assert tvm_ffi.get_global_func(name)() == 1 and fn() == 1
    assert seen == [None] and tvm_ffi.get_global_func(name, allow_missing=True) is None
    tvm_ffi.register_global_func(name, lambda: 2, override=True)
    try:
        with replaced_global_func(name, lambda prev: (lambda: prev() + 10)):
            assert tvm_ffi.get_global_func(name)() == 12
        assert tvm_ffi.get_global_func(name)() == 2
    finally:
        tvm_ffi.remove_global_func(name)


def test_as_accurate_as_holds_the_rewrite_to_the_graphs_own_rounding():
    from mqa_byoc.testing.graphs import assert_as_accurate_as

    exact = np.linspace(-1, 1, 64, dtype="float32")
    graph = exact.astype("float16")  # the unrewritten graph's rounding
    assert_as_accurate_as((exact + 2e-5).astype("float16"), graph, exact)  # another rounding: as accurate
    with pytest.raises(AssertionError, match="from float32"):
        assert_as_accurate_as(exact[::-1].astype("float16"), graph, exact)  # a wrong result is not
