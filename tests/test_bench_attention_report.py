"""Pure logic of benchmarks/attention.py (package benchmarks/attention_bench): suite expansion, page tables / kernel arguments for TVM's
paged-KV kernels, iteration planning, numerics comparison and the report (no GPU, no TVM build)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

_BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
_MODULES = ("suites", "paged_kv", "run", "report", "cli")


@pytest.fixture(scope="module")
def bench():
    """The public names of the benchmark's modules in one namespace."""
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    names = {}
    for m in _MODULES:
        mod = importlib.import_module(f"attention_bench.{m}")
        names.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
    return SimpleNamespace(**names)


# ------------------------------------------------------------------------------------------ suites


def test_preset_shapes_group_presets(bench):
    shapes = {s["shape"]: s for s in bench.preset_shapes()}
    assert list(shapes) == ["h64-kv8-d128", "h32-kv8-d128", "h71-kv1-d64"]
    assert shapes["h64-kv8-d128"]["presets"] == ["llama2-70b", "codellama-34b"]
    assert shapes["h32-kv8-d128"]["presets"] == ["llama3-8b", "mistral-7b"]
    assert shapes["h71-kv1-d64"]["presets"] == ["falcon-7b-mqa"]
    assert any("mistral-7b" in n and "sliding window" in n for n in shapes["h32-kv8-d128"]["notes"])
    assert shapes["h71-kv1-d64"]["notes"] == []


def test_presets_expansion(bench):
    cases = bench.expand_suite("presets")
    assert len(cases) == 3 * 2 * (3 + 4)
    assert len({c["name"] for c in cases}) == len(cases)
    for c in cases:
        assert c["suite"] == "presets" and c["group"] == c["dtype"]
        if c["mode"] == "prefill":
            assert c["causal"] and c["s_q"] == c["s_kv"] and c["s_kv"] in (1024, 4096, 16384)
        else:
            assert not c["causal"] and c["s_q"] == 1 and c["s_kv"] in (1024, 4096, 16384, 32768)
        # stock TVM only where s_q * s_kv is small: prefill 1k and every decode
        assert c["stock"] == (c["s_q"] * c["s_kv"] <= bench.STOCK_MAX_WORK)
    stock = {(c["mode"], c["s_kv"]) for c in cases if c["stock"]}
    assert stock == {("prefill", 1024), ("decode", 1024), ("decode", 4096), ("decode", 16384), ("decode", 32768)}
    names = {c["name"] for c in cases}
    assert "h71-kv1-d64-bf16-decode-32k" in names and "h64-kv8-d128-fp16-prefill-16k" in names
    only = bench.expand_suite("presets", shapes=["h71-kv1-d64"])
    assert len(only) == 14 and {c["shape"] for c in only} == {"h71-kv1-d64"}


def test_smoke_kept(bench):
    assert bench.expand_suite("smoke") == bench.SUITES["smoke"]
    assert [c["name"] for c in bench.SUITES["smoke"]] == ["decode-16k", "prefill-2k-causal"]
    with pytest.raises(KeyError):
        bench.expand_suite("nope")


def test_case_variants(bench):
    cases = {c["name"]: c for c in bench.expand_suite("presets")}
    pre = bench.case_variants(cases["h64-kv8-d128-fp16-prefill-1k"], ["native"], "attn-fp16.so", "tvm-llm-fp16.so")
    assert set(pre) == {"mqa-native", "repeat-native", "stock-tvm", "tvm-llm-ragged", "tvm-llm-paged"}
    assert pre["tvm-llm-ragged"]["kernel"] == "batch_prefill_ragged_kv"
    assert pre["tvm-llm-paged"]["kernel"] == "batch_prefill_paged_kv"
    dec = bench.case_variants(cases["h71-kv1-d64-bf16-decode-32k"], ["native", "python"], "attn-bf16.so", None)
    assert set(dec) == {"mqa-native", "repeat-native", "mqa-python", "repeat-python", "stock-tvm"}
    big = bench.case_variants(cases["h64-kv8-d128-fp16-prefill-16k"], ["native"], "a.so", "l.so")
    assert "stock-tvm" not in big
    for v in list(pre.values()) + list(dec.values()):
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v["func"]), v
    assert pre["mqa-native"]["func"] != pre["repeat-native"]["func"]


# ---------------------------------------------------------------------- TVM paged-KV kernel inputs


def test_paged_kv_layout(bench):
    rng = np.random.default_rng(0)
    s, hkv, d, ps = 37, 2, 4, 16
    k = rng.standard_normal((s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((s, hkv, d)).astype(np.float32)
    pages, perm, last = bench.paged_kv(k, v, ps)
    assert pages.shape == (3, 2, hkv, ps, d) and last == 5
    assert sorted(perm) == [0, 1, 2] and perm == bench.page_permutation(3)
    for t in range(s):
        p = perm[t // ps]
        np.testing.assert_array_equal(pages[p, 0, :, t % ps, :], k[t])
        np.testing.assert_array_equal(pages[p, 1, :, t % ps, :], v[t])
    assert not pages[perm[2], :, :, last:, :].any()  # padding of the last page
    full, perm16, last16 = bench.paged_kv(k[:32], v[:32], ps)
    assert full.shape[0] == 2 and last16 == 16


def test_llm_kernel_args_order(bench):
    rng = np.random.default_rng(1)
    h, hkv, d, s = 8, 2, 4, 20
    q = rng.standard_normal((s, h, d)).astype(np.float16)
    k = rng.standard_normal((s, hkv, d)).astype(np.float16)
    v = rng.standard_normal((s, hkv, d)).astype(np.float16)
    args, oi = bench.llm_kernel_args("batch_prefill_ragged_kv", q, k, v, True, 0.5)
    assert len(args) == 14 and oi == 7
    assert args[0] is q and args[2] is k and args[3] is v
    assert args[oi].shape == (s, h, d) and np.isnan(args[oi].astype(np.float32)).all()
    assert args[8].shape == (s, h) and args[8].dtype == np.float32
    assert args[9:] == [1, 0, 1.0, 10000.0, 0.5]
    args, oi = bench.llm_kernel_args("batch_prefill_paged_kv", q, k, v, True, 0.5)
    assert len(args) == 15 and oi == 8
    assert list(args[1]) == [0, s] and list(args[3]) == [0, 2] and list(args[5]) == [4]
    assert args[2].shape == (2, 2, hkv, bench.PAGE_SIZE, d)
    assert list(args[7]) == list(range(s))
    args, oi = bench.llm_kernel_args("batch_decode_paged_kv", q[-1:], k, v, False, 0.5)
    assert len(args) == 13 and oi == 7 and args[oi].shape == (1, h, d)
    assert list(args[6]) == [s - 1] and args[9:] == [0, 1.0, 10000.0, 0.5]
    with pytest.raises(ValueError):
        bench.llm_kernel_args("batch_decode_paged_kv", q, k, v, False, 0.5)


def test_plan_iterations(bench):
    assert bench.plan_iterations(10.0, 250e3, 200) == (200, 3)
    assert bench.plan_iterations(5000.0, 250e3, 200) == (50, 3)
    assert bench.plan_iterations(100e3, 250e3, 200) == (2, 2)
    assert bench.plan_iterations(400e3, 250e3, 200) == (1, 0)
    assert bench.plan_iterations(9e6, 250e3, 200, max_call_us=5e6) == (0, 0)


def test_compare_outputs(bench):
    torch = pytest.importorskip("torch")
    ref = torch.randn(1, 3, 6, 8)
    ok = bench.compare_outputs(ref.half(), ref, "float16")
    assert ok["numerics_ok"] and ok["num_bad_heads"] == 0 and ok["nonfinite_outputs"] == 0
    bad = ref.clone()
    bad[:, :, 4] = 0.0
    r = bench.compare_outputs(bad, ref, "float16")
    assert not r["numerics_ok"] and r["bad_heads"] == [4]
    nan = ref.clone().reshape(3, 6, 8)  # (S, H, D) as TVM's kernels write it
    nan[:, 5] = float("nan")
    r = bench.compare_outputs(nan, ref, "bfloat16")
    assert not r["numerics_ok"] and r["nonfinite_outputs"] == 3 * 8 and r["bad_heads"] == [5]
    assert r["max_abs_err_vs_fa2"] < 1e-6


# ----------------------------------------------------------------------------------------- report


def _rec(case, variant, us, mode="decode", dtype="float16", seq=16384, **kw):
    base = dict(benchmark="attention", suite="presets", case=case, shape="h64-kv8-d128",
                model="llama2-70b/codellama-34b", mode=mode, dtype=dtype, num_q_heads=64, num_kv_heads=8,
                head_dim=128, seq_q=1 if mode == "decode" else seq, seq_kv=seq, variant=variant, us=us)
    base.update(kw)
    return base


def _synthetic():
    return {
        "benchmark": "attention", "suite": "presets", "command": "benchmarks/attention.py run ...",
        "date": "2026-12-01T10:00:00+00:00", "gpu": "NVIDIA H200", "hbm_peak_tb_s": 4.8,
        "rel_tol": {"float16": 0.02, "bfloat16": 0.05}, "budget_ms": 250, "max_iters": 200, "idle_s": 1.0,
        "build": {"build_command": "python benchmarks/attention.py build --suite presets", "tvm": "0.27",
                  "offload": {"a": {"variant": "mqa-native", "check": "ok"},
                              "b": {"variant": "repeat-native", "check": "ok"}},
                  "llm_cpu_check": [{"kernel": "batch_decode_paged_kv", "max_abs_err": 3e-7, "ok": True}],
                  "llm_decode_heads_written_per_kv_head": {"float16": {"h71-kv1-d64": 68, "h64-kv8-d128": 8}}},
        "records": [
            _rec("d16k", "fa2-direct", 33.3, ratio_vs_fa2_direct=1.0, hbm_fraction=0.42),
            _rec("d16k", "mqa-native", 34.2, ratio_vs_fa2_direct=1.027, hbm_fraction=0.409, numerics_ok=True),
            _rec("d16k", "tvm-llm-paged", 900.0, ratio_vs_fa2_direct=27.0, hbm_fraction=0.0155, numerics_ok=False,
                 max_abs_err_vs_fa2=0.5, ref_max_abs=0.06, rel_err_vs_fa2=8.3, bad_heads=[68, 69, 70],
                 num_bad_heads=3, kernel="batch_decode_paged_kv"),
            {**_rec("d16k", "stock-tvm", None), "error": "RuntimeError: boom\nmore"},
            _rec("p1k", "fa2-direct", 80.0, mode="prefill", seq=1024, ratio_vs_fa2_direct=1.0, tflops=215.0,
                 sm_clock_mhz=1980, clock_limits=[]),
            _rec("p1k", "mqa-native", 76.0, mode="prefill", seq=1024, ratio_vs_fa2_direct=0.95, tflops=226.1,
                 numerics_ok=True, sm_clock_mhz=1575, clock_limits=["sw_power_cap"], kernel_sm_clock_mhz=1980,
                 notes=["mistral-7b uses a 4096-token sliding window; measured without one"]),
            _rec("p1k", "stock-tvm", 47000.0, mode="prefill", seq=1024, ratio_vs_fa2_direct=587.5, tflops=0.37,
                 numerics_ok=True),
            _rec("p1k", "cublas-qk-gemm", 40.0, mode="prefill", seq=1024, ratio_vs_fa2_direct=0.5, tflops=430.0),
        ],
    }


def test_render_markdown(bench):
    md = bench.render_markdown(_synthetic(), plots=["/x/2026-12-01-attention-presets-fp16.png"])
    assert "# Attention microbenchmarks — suite `presets`" in md
    assert "NVIDIA H200" in md and "4.8 TB/s" in md
    lines = md.splitlines()
    pre_hdr = next(ln for ln in lines if ln.startswith("| shape") and "| S |" in ln)
    assert pre_hdr.split("|")[4:8] == [" `fa2-direct` ", " `mqa-native` ", " `stock-tvm` ", " `cublas-qk-gemm` "]
    pre_row = next(ln for ln in lines if ln.startswith("| h64-kv8-d128") and "| 1k |" in ln)
    assert "80.0 (215 TF/s)" in pre_row and "76.0 (0.95x, 226 TF/s)" in pre_row
    assert "47,000 (588x, 0.37 TF/s)" in pre_row and "40.0 (0.50x, 430 TF/s)" in pre_row
    dec_row = next(ln for ln in lines if ln.startswith("| h64-kv8-d128") and "| 16k |" in ln)
    assert "33.3 (42% HBM)" in dec_row and "34.2 (1.03x, 41% HBM)" in dec_row
    assert "900 (27.0x, 2% HBM) ✗" in dec_row and "| error |" in dec_row
    assert "llama2-70b/codellama-34b" in dec_row
    assert "3 query heads off (first: [68, 69, 70])" in md
    assert "d16k `stock-tvm` failed: RuntimeError: boom" in md
    assert "sliding window" in md
    assert "1 `mqa=True` functions" in md and "CHECK FAILED" not in md
    assert "max abs err 3.0e-07" in md
    assert "h71-kv1-d64 fp16: TVM's `batch_decode_paged_kv` thread layout writes only 68 of the 71" in md
    assert "h64-kv8-d128 fp16: TVM" not in md
    assert "![2026-12-01-attention-presets-fp16.png](2026-12-01-attention-presets-fp16.png)" in md
    clock_hdr = lines.index("## SM clock during the timed loops")
    clock_row = next(ln for ln in lines[clock_hdr:] if ln.startswith("| p1k"))
    assert clock_row == "| p1k | 226 TF/s at 1,575 MHz; CUPTI at 1,980 | 215 TF/s at 1,980 MHz | sw_power_cap |"
    assert "1 s idle before the loop" in md


def test_report_files(bench, tmp_path):
    src = tmp_path / "run.json"
    src.write_text(json.dumps(_synthetic()))
    out = tmp_path / "results"
    bench.main(["report", str(src), "--out-dir", str(out), "--no-plots"])
    assert sorted(os.listdir(out)) == ["2026-12-01-attention-presets.json", "2026-12-01-attention-presets.md"]
    assert json.loads((out / "2026-12-01-attention-presets.json").read_text())["gpu"] == "NVIDIA H200"


def test_merge_runs(bench):
    first = _synthetic()
    rerun = {"command": "run --cases d16k", "date": "2026-12-01T11:00:00+00:00", "gpu": "NVIDIA H200",
             "records": [_rec("d16k", "stock-tvm", 7000.0, ratio_vs_fa2_direct=210.0, hbm_fraction=0.001)]}
    merged = bench.merge_runs([first, rerun])
    assert len(merged["records"]) == len(first["records"])
    stock = [r for r in merged["records"] if r["case"] == "d16k" and r["variant"] == "stock-tvm"]
    assert stock[0]["us"] == 7000.0 and "error" not in stock[0]
    assert merged["suite"] == "presets" and "run --cases d16k" in merged["command"]
    assert bench.merge_runs([first]) == first


def test_report_plots(bench, tmp_path):
    pytest.importorskip("matplotlib")
    paths = bench.render_plots(_synthetic(), str(tmp_path / "p"))
    assert [os.path.basename(p) for p in paths] == ["p-fp16.png"]
    assert os.path.getsize(paths[0]) > 1000
