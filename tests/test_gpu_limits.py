"""The limits GEMM tables and decoder benchmarks measure against are the GPU's own
(:mod:`mqa_byoc.runtime.gpu_limits`): by name from the data sheet, else derived from the driver's figures;
a record names the limits it was measured against, and older records those of the GPU they name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mqa_byoc.runtime import gpu_limits
from mqa_byoc.runtime.gemm_rates import gemm_table
from mqa_byoc.runtime.gpu_limits import DEFAULT, derived_limits, given, limits_for, record_limits
from mqa_byoc.runtime.profiling import gemm_report

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H200_PROFILE = RESULTS / "2026-12-05-profile-codellama34b-4l-paged-2k.json"


@pytest.mark.parametrize("name, tbps, tflops", [
    ("NVIDIA H100 80GB HBM3", 3.35, 989), ("NVIDIA H100 PCIe", 2.0, 756), ("NVIDIA H100 NVL", 3.9, 835),
    ("NVIDIA H200", 4.8, 989), ("NVIDIA H200 NVL", 4.8, 835), ("NVIDIA GH200 480GB", 4.0, 989),
    ("NVIDIA GH200 144G HBM3e", 4.9, 989), ("NVIDIA H20", 4.0, 148), ("NVIDIA A100-SXM4-80GB", 2.039, 312),
    ("NVIDIA A100 80GB PCIe", 1.935, 312), ("NVIDIA A100-PCIE-40GB", 1.555, 312), ("NVIDIA L40S", 0.864, 362),
    ("NVIDIA L4", 0.3, 121), ("NVIDIA B200", 8.0, 2250)])
def test_data_sheet_limits_by_the_names_the_driver_gives(name, tbps, tflops):
    got = limits_for(name)
    assert (got.hbm_tbps, got.dense_tflops, got.source) == (tbps, tflops, "data sheet")


def test_a_gpu_not_in_the_table_has_no_data_sheet_limits():
    assert limits_for("Tesla T4") is None and limits_for(None) is None


def test_limits_derived_from_the_driver_figures():
    # an H100 SXM's figures as its driver reports them: HBM3 at 2619 MHz on a 5120-bit bus, 132 SMs at 1980 MHz
    props = {"name": "Some sm_90 GPU", "memory_clock_khz": 2619000, "bus_width_bits": 5120, "sms": 132,
             "clock_khz": 1980000, "major": 9, "minor": 0}
    got = derived_limits(props)
    assert got.source == "CUDA driver"
    assert got.hbm_tbps == pytest.approx(3.35, rel=0.01)
    assert got.dense_tflops == pytest.approx(132 * 1.98e9 * 4096 / 1e12, rel=1e-3)
    assert derived_limits({**props, "major": 7, "minor": 5}) is None  # no tensor rate known for sm_75
    assert derived_limits({k: v for k, v in props.items() if k != "bus_width_bits"}) is None


def test_device_limits_without_limits_names_the_option(monkeypatch):
    monkeypatch.setattr(gpu_limits, "driver_properties", lambda ordinal=0: {"name": "Tesla T4", "major": 7, "minor": 5})
    with pytest.raises(gpu_limits.DriverError, match="--limits"):
        gpu_limits.device_limits()


def test_given_limits_must_be_positive():
    assert given(3.35, 989).source == "given"
    with pytest.raises(ValueError, match="positive"):
        given(0, 989)


def test_record_limits_own_then_gpu_then_default():
    own = {"limits": {"gpu": "x", "hbm_tbps": 2.0, "dense_tflops": 500.0, "source": "given"}, "gpu": "NVIDIA H200"}
    assert (record_limits(own).hbm_tbps, record_limits(own).source) == (2.0, "given")
    assert record_limits({"gpu": "NVIDIA H100 80GB HBM3"}).hbm_tbps == 3.35
    assert record_limits({}) == DEFAULT and record_limits({"gpu": "Tesla T4"}) == DEFAULT


def test_gemm_table_measures_against_the_gpus_limits():
    data = json.loads(H200_PROFILE.read_text())
    rec = copy.deepcopy(data["modes"]["mqa"])
    rec.pop("limits", None)
    h200 = gemm_table(rec, "decode", data["prompt_len"])
    h100 = gemm_table(rec, "decode", data["prompt_len"], limits=limits_for("NVIDIA H100 80GB HBM3"))
    assert h200["limits"]["hbm_tbps"] == 4.8 and h100["limits"]["hbm_tbps"] == 3.35
    for a, b in zip(h200["rows"], h100["rows"]):  # decode GEMMs are bound by their bytes
        assert a["bound"] == b["bound"] == "bytes"
        assert b["fraction_of_limit"] == pytest.approx(a["fraction_of_limit"] * 4.8 / 3.35, abs=2e-3)
        assert a["us_per_call"] == b["us_per_call"]


def test_profile_gemms_uses_the_limits_of_the_gpu_the_run_names():
    data = json.loads(H200_PROFILE.read_text())
    assert "NVIDIA H200; data sheet" in gemm_report(data)
    data["gpu"] = "NVIDIA H100 80GB HBM3"
    for rec in data["modes"].values():
        rec.pop("limits", None)
    text = gemm_report(data)
    assert "3.35 TB/s" in text and "4.8 TB/s" not in text
    assert "2 TB/s, 500 TFLOP/s" in gemm_report(data, limits=given(2.0, 500.0))


def test_cli_limits_option(capsys):
    from mqa_byoc.cli import main

    assert main(["profile", "gemms", "--limits", "2,500", str(H200_PROFILE)]) == 0
    assert "limits 2 TB/s, 500 TFLOP/s dense (given)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["profile", "gemms", "--limits", "fast", str(H200_PROFILE)])
    assert "expected TBPS,TFLOPS" in capsys.readouterr().err


def test_benchmark_reports_name_the_gpu_and_bandwidth_their_rows_record():
    from bench_scripts import load_benchmark

    from mqa_byoc.testing.header import hbm_bytes_per_s, rows_gpu

    builds = load_benchmark("decode_builds.py", "decode_builds_limits")
    rows = [{"shape": "71/1/64", "page": 256, "batch": 8, "kind": "mixed", "bytes_us": 3.0, "gpu": "NVIDIA H100 80GB HBM3",
             "hbm_tbps": 3.35, "us": {"before": 30.0, "after": 24.0}, "max_diff": 0.0}]
    text = builds.report(rows, {"commit": "abc", "date": "d", "command": "x"})
    assert "NVIDIA H100 80GB HBM3" in text and "NVIDIA H200" not in text
    assert builds.gpu_tbps(rows) == "3.35"
    old = [{k: v for k, v in rows[0].items() if k not in ("gpu", "hbm_tbps")}]  # rows written before: an H200's
    assert rows_gpu(old) == ("NVIDIA H200", 4.8) and "NVIDIA H200" in builds.report(old, {})
    grid = load_benchmark("decode_grid.py", "decode_grid_limits")
    assert grid.gpu_tbps(rows) == "3.35"
    assert hbm_bytes_per_s({"gpu": "NVIDIA H100 80GB HBM3"}) == 3.35e12  # a header without limits: its GPU's
    assert hbm_bytes_per_s({"gpu": "NVIDIA H100 80GB HBM3", "limits": given(2.0, 500.0).as_dict()}) == 2.0e12
    kernel = load_benchmark("decode_kernel.py", "decode_kernel_limits")
    header = {"gpu": "NVIDIA H100 80GB HBM3", "date": "d", "command": "x"}
    assert "K and V bytes at 3.35 TB/s" in kernel.markdown(header, [])
