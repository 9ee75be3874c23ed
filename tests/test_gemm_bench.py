"""benchmarks/gemm.py's report (no GPU): decode rows in TB/s, prefill rows in TFLOP/s, and with
``--read-floor`` each decode GEMM against the least time a kernel takes to read its weight; its
command line refuses a row limit below 1."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gemm.py", "gemm_bench")


def _variant(us, flop, nbytes):
    return {"us": us, "tflops": round(flop / us / 1e6, 1), "tbps": round(nbytes / us / 1e6, 3)}


def _row(name, m, n, k, ours_us, torch_us):
    flop, nbytes = 2.0 * m * n * k, 2.0 * (m * k + n * k + m * n)
    row = {"gemm": name, "M": m, "N": n, "K": k, "flop": flop, "bytes": nbytes, "iters": 10,
           "ours": _variant(ours_us, flop, nbytes), "torch": _variant(torch_us, flop, nbytes),
           "tvm_static": {"error": "RuntimeError: x"}, "tvm_sym": _variant(4 * ours_us, flop, nbytes)}
    row["ours"]["vs_torch"] = round(torch_us / ours_us, 3)
    return row


def _result(floors=None, cold=False):
    res = {"date": "d", "commit": "c", "gpu": "NVIDIA H200", "torch": "2.11", "command": "gemm.py --x",
           "cold": cold, "rows": [_row("o_proj", 1, 8192, 8192, 32.0, 30.0),
                                  _row("o_proj", 2048, 8192, 8192, 360.0, 350.0)]}
    if floors:
        res["read_floor"] = floors
    return res


def test_rates_by_rows(bench):
    text = bench.markdown(_result())
    # M = 1: bytes (x, W, out) per second; M = 2048: FLOP/s; a failed variant says so
    assert "| o_proj 8192x8192 | 1 | 32.0 µs (4.20 TB/s) | error |" in text
    assert "| o_proj 8192x8192 | 2048 | 360.0 µs (764 TF/s) |" in text
    assert "read floor" not in text


def test_read_floor_table_compares_the_decode_gemms(bench):
    floors = {"o_proj": {"read_floor_cold_us": 30.0, "hbm_us": 27.96, "read_floor_warm_us": 20.0,
                         "empty_kernel_us": 0.6}}
    text = bench.markdown(_result(floors, cold=True))
    assert "`--cold`" in text
    # W of 134 MB, its HBM time, the floor and floor / limit; ours 32 / 30 and torch 30 / 30 over the floor
    assert "| o_proj 8192x8192 | 134 | 28.0 | 30.0 | 1.073 | 1 | 1.07 | 1.00 |" in text
    # the prefill row is not compared with a read floor
    assert "| 2048 | 12.00 |" not in text and text.count("| o_proj 8192x8192 | 134 |") == 1


def test_command_line_refuses_a_row_limit_below_one(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--artifacts", "a", "--out", "o", "--max-m", "0"])
    assert "--max-m must be at least 1" in capsys.readouterr().err
