"""The GEMM table of ``mqa-byoc profile`` (:mod:`mqa_byoc.runtime.gemm_rates`), from recorded kernel lists:
the committed profile JSONs (kernel totals only) and launch sequences made from them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mqa_byoc.cli import main
from mqa_byoc.runtime.gemm_rates import (DENSE_TFLOPS, HBM_TBPS, format_gemm_table, gemm_table, is_gemm_kernel,
                                         kernel_group, model_gemms)
from mqa_byoc.runtime.profiling import add_gemm_tables, gemm_report, phase_record

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
PAGED_GEMM = RESULTS / "2026-12-01-profile-codellama34b-4l-paged-gemm-2k.json"
PAGED_TVM = RESULTS / "2026-12-01-profile-codellama34b-4l-paged-nogemm-2k.json"
INPLACE_16K = RESULTS / "2026-12-01-profile-codellama34b-4l-loadpath-16k.json"


def _load(path):
    data = json.loads(path.read_text())
    return data, data["modes"]["mqa"]


def test_model_gemms_of_codellama_shapes():
    _, rec = _load(PAGED_GEMM)
    decode = model_gemms(rec, "decode", 2048)
    assert [g.name for g in decode] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    qkv, o, gu, down, head = decode
    assert (qkv.n, qkv.k) == ((64 + 2 * 8) * 128, 8192) and (o.n, o.k) == (8192, 64 * 128)
    assert (gu.n, gu.k, down.n, down.k) == (2 * 22016, 8192, 8192, 22016) and (head.n, head.k) == (32000, 8192)
    assert all(g.m == 1 for g in decode) and [g.count for g in decode] == [4, 4, 4, 4, 1]
    # bytes of a decode step: every weight once (plus the tiny activations)
    weights = sum(2 * g.n * g.k * g.count for g in decode)
    assert sum(g.bytes * g.count for g in decode) == pytest.approx(weights, rel=1e-3)
    assert all(g.bound() == "bytes" for g in decode)
    prefill = model_gemms(rec, "prefill", 2048)
    assert all(g.m == 2048 for g in prefill)  # the paged model's prefill: logits of every position
    assert all(g.bound() == "FLOPs" for g in prefill)
    _, inplace = _load(INPLACE_16K)
    assert model_gemms(inplace, "prefill", 16384)[-1].m == 1  # logits of the last position only
    separate = model_gemms({**inplace, "fused_projections": False}, "decode", 16384)
    assert [g.name for g in separate][:3] == ["q_proj", "k_proj", "v_proj"] and len(separate) == 8


def test_kernel_names():
    assert is_gemm_kernel("nvjet_sm90_hsh_192x8_64x8_2x1_v_bz_TNT")
    assert is_gemm_kernel("fused_NT_matmul3_add2_strided_slice_kernel")
    assert not is_gemm_kernel("void cublasLt::splitKreduce_kernel<32, 16, int, float, __half>")
    assert not is_gemm_kernel("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_obj")
    assert not is_gemm_kernel("fused_split_silu_multiply_kernel")
    assert kernel_group("fused_NT_matmul3_add2_strided_slice_kernel") == kernel_group("fused_NT_matmul3_add2_kernel")
    assert kernel_group("NT_matmul3_kernel") != kernel_group("NT_matmul_kernel")


def _rates_match_kernels(table, phase):
    """Each row's rate is its bytes / FLOPs over the time of the kernels it was mapped to."""
    for r in table["rows"]:
        t = r["us_per_call"]
        assert r["tbps"] == pytest.approx(2 * (r["M"] * r["K"] + r["N"] * r["K"] + r["M"] * r["N"]) / t / 1e6, rel=2e-3)
        assert r["tflops"] == pytest.approx(2 * r["M"] * r["N"] * r["K"] / t / 1e6, rel=2e-3, abs=0.06)
        assert 0 < r["fraction_of_limit"] <= 1.0, r
    ns = {k["name"]: k["total_ns"] for k in phase["kernels"]}
    mapped = {k for r in table["rows"] for k in r["kernels"]}
    gemm_ns = sum(ns[k] for k in mapped) / 1e3 / phase["steps"]
    assert table["gemm_us_per_step"] == pytest.approx(gemm_ns + table["split_k_reduce_us_per_step"], rel=1e-3)


def test_decode_gemms_of_the_cublaslt_profile_from_kernel_totals():
    data, rec = _load(PAGED_GEMM)
    table = gemm_table(rec, "decode", data["prompt_len"])
    phase = rec["phases"]["decode"]
    _rates_match_kernels(table, phase)
    rows = {r["gemm"]: r for r in table["rows"]}
    # five cuBLASLt kernel configurations, one per GEMM: the instance counts (80 = 4 layers x 20 steps,
    # 20 = lm_head) and the most even rates pick which is which
    assert len({k for r in rows.values() for k in r["kernels"]}) == 5
    assert all(r["mapped_by"] == "kernel totals" and not r["shared_with"] for r in rows.values())
    head = next(k for k in phase["kernels"] if k["instances"] == phase["steps"] and is_gemm_kernel(k["name"]))
    assert rows["lm_head"]["kernels"] == [head["name"]]
    # the largest per-layer kernel total is gate_up (the largest weight)
    per_layer = [k for k in phase["kernels"] if k["instances"] == 4 * phase["steps"] and is_gemm_kernel(k["name"])]
    assert rows["gate_up_proj"]["kernels"] == [max(per_layer, key=lambda k: k["total_ns"])["name"]]
    reduce_ns = sum(k["total_ns"] for k in phase["kernels"] if "splitKreduce" in k["name"])
    assert reduce_ns > 0 and table["split_k_reduce_us_per_step"] == pytest.approx(reduce_ns / 1e3 / phase["steps"], rel=1e-3)
    limit = sum(2 * g.n * g.k * g.count for g in model_gemms(rec, "decode", 2048)) / (HBM_TBPS * 1e6)
    assert table["limit_us_per_step"] == pytest.approx(limit, rel=1e-3)


def test_prefill_kernels_shared_by_two_gemms():
    data, rec = _load(PAGED_GEMM)
    table = gemm_table(rec, "prefill", data["prompt_len"])
    _rates_match_kernels(table, rec["phases"]["prefill"])
    rows = {r["gemm"]: r for r in table["rows"]}
    # 8 launches per prefill of two kernels: each runs two GEMMs of every layer
    assert rows["qkv_proj"]["shared_with"] and rows["qkv_proj"]["kernels"] == rows[rows["qkv_proj"]["shared_with"][0]]["kernels"]
    for r in rows.values():
        assert r["bound"] == "FLOPs" and r["tflops"] < DENSE_TFLOPS
    # a shared kernel gives its GEMMs the same rate
    mate = rows[rows["qkv_proj"]["shared_with"][0]]
    assert rows["qkv_proj"]["fraction_of_limit"] == pytest.approx(mate["fraction_of_limit"], abs=2e-3)


def test_tvm_kernels_and_fused_variants():
    data, rec = _load(INPLACE_16K)
    table = gemm_table(rec, "decode", data["prompt_len"])
    _rates_match_kernels(table, rec["phases"]["decode"])
    down = next(r for r in table["rows"] if r["gemm"] == "down_proj")
    assert len(down["kernels"]) == 2 and all("NT_matmul3" in k for k in down["kernels"])  # last layer's is fused on
    data, rec = _load(PAGED_TVM)
    t = gemm_table(rec, "prefill", data["prompt_len"])
    assert {r["gemm"]: r["kernels"] for r in t["rows"]}["lm_head"] == ["NT_matmul9_kernel"]


def _launches_in_model_order(phase, table):
    """A launch sequence made from a table (what `profile run` records now): per step the GEMM kernels
    in the model's order, a split-K reduction after every split-K kernel, other kernels between."""
    names = [k["name"] for k in phase["kernels"]]
    other = next(i for i, n in enumerate(names) if not is_gemm_kernel(n) and "splitK" not in n)
    reduce_ = next((i for i, n in enumerate(names) if "splitKreduce" in n), None)
    layer = [r for r in table["rows"] if r["calls_per_step"] > 1]
    once = [r for r in table["rows"] if r["calls_per_step"] == 1]
    seq = []
    for step in range(phase["steps"]):
        for li in range(layer[0]["calls_per_step"]):
            for j, r in enumerate(layer):
                seq.append([other, 1000])
                k = names.index(r["kernels"][0])
                seq.append([k, 10000 * (j + 1) + li])
                if reduce_ is not None and "splitK" in names[k]:
                    seq.append([reduce_, 500])
        for r in once:
            seq.append([names.index(r["kernels"][0]), 99000])
    return seq


def test_launch_order_maps_each_launch():
    data, rec = _load(PAGED_GEMM)
    rec = copy.deepcopy(rec)
    phase = rec["phases"]["decode"]
    phase["launches"] = _launches_in_model_order(phase, gemm_table(rec, "decode", 2048))
    table = gemm_table(rec, "decode", 2048)
    rows = {r["gemm"]: r for r in table["rows"]}
    assert all(r["mapped_by"] == "launch order" for r in rows.values())
    # qkv is the first GEMM of a layer: (10000 + layer) ns, plus a 500 ns reduction when split-K
    splitk = "splitK" in rows["qkv_proj"]["kernels"][0]
    assert rows["qkv_proj"]["us_per_call"] == pytest.approx(10.0 + 0.0015 + (0.5 if splitk else 0), abs=0.01)
    assert rows["gate_up_proj"]["us_per_call"] == pytest.approx(30.0015, abs=0.01)  # no split-K
    assert rows["lm_head"]["us_per_call"] == pytest.approx(99.0)
    assert any("splitKreduce" in k for k in rows["down_proj"]["kernels"])
    assert table["split_k_reduce_us_per_step"] == 0  # counted with their GEMMs
    # a sequence that does not fit the model (one GEMM launch missing) falls back to the totals
    phase["launches"] = phase["launches"][:-1]
    assert gemm_table(rec, "decode", 2048)["rows"][0]["mapped_by"] == "kernel totals"


def test_phase_record_keeps_the_launch_order():
    from mqa_byoc.testing.cupti import KernelStat

    events = [("a_kernel", 2.0), ("nvjet_x", 5.0), ("Memcpy HtoD", 1.0), ("a_kernel", 3.0)]
    stats = [KernelStat("a_kernel", [2.0, 3.0]), KernelStat("nvjet_x", [5.0]), KernelStat("Memcpy HtoD", [1.0])]
    ph = phase_record(stats, [0.01], 1, events)
    names = [k["name"] for k in ph["kernels"]]
    assert [names[i] for i, _ in ph["launches"]] == ["a_kernel", "nvjet_x", "a_kernel"]
    assert [ns for _, ns in ph["launches"]] == [2000, 5000, 3000]
    assert "launches" not in phase_record(stats, [0.01], 1)


def test_unmappable_and_shapeless_records():
    data, rec = _load(PAGED_GEMM)
    bad = copy.deepcopy(rec)
    bad["num_layers"] = 3  # 80 launches per 20 steps no longer add up
    assert gemm_table(bad, "decode", 2048) is None
    assert "could not be mapped" in format_gemm_table(None)
    shapeless = {k: v for k, v in rec.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        gemm_table(shapeless, "decode", 2048)
    assert "gemms" not in add_gemm_tables(copy.deepcopy(shapeless), 2048)["phases"]["decode"]


def test_profile_gemms_command(capsys):
    assert main(["profile", "gemms", str(PAGED_GEMM)]) == 0
    out = capsys.readouterr().out
    data = json.loads(PAGED_GEMM.read_text())
    assert out == gemm_report(data)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "split-K reductions"):
        assert name in out
    assert out.count("GEMMs, decode") == 1 and out.count("GEMMs, prefill") == 1
