"""benchmarks/decode_grid.py (no GPU): the variants it times for a typical sequence (split sizes of at most
twice it, both warp counts, the typical grid and twice it merged either way, the grid of the longest
sequence), its report (the plan's time against the best of the grids before and after) and its command line."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_grid.py", "decode_grid_bench")


def test_variants(bench):
    got = list(bench.variants(2048, lambda kps: 32768 // kps))
    assert (1024, 4, 2, "auto") in got and (1024, 4, 2, "global") in got and (1024, 8, 4, "auto") in got
    assert (1024, 4, 32, "auto") in got and (1024, 4, 32, "global") not in got  # the grid before: as planned
    assert all(kps <= 4096 and 64 * kps >= 2048 for kps, _, _, _ in got)
    assert not [v for v in got if v[2] > 128]  # the merging CTA holds at most 128 splits
    assert (3584, 8, 1, "auto") in list(bench.variants(3584, lambda kps: 8, extra_kps=(3584,)))
    assert len(got) == len(set(got))


def _rows():
    return [{"shape": "64/8/128", "batch": 32, "keys": "2048", "typical": 2048, "bytes_us": 55.9,
             "rule": {"splits": 2, "kps": 2048, "warps": 8, "us": 68.0},
             "variants": [{"kps": 2048, "warps": 8, "splits": 32, "merge": "auto", "grid": "longest", "us": 85.0},
                          {"kps": 2048, "warps": 4, "splits": 1, "merge": "auto", "grid": "typical", "us": 65.0},
                          {"kps": 2048, "warps": 8, "splits": 1, "merge": "auto", "grid": "typical", "us": 66.0},
                          {"kps": 1024, "warps": 4, "splits": 64, "merge": "auto", "grid": "longest", "us": 80.0}],
             "max_diff": 2.4e-4, "rule_err": 8e-5}]


def test_report(bench):
    text = bench.report(_rows(), {"commit": "abc", "date": "d", "command": "python x"})
    assert ("| 64/8/128 | 32 | 2048 | 55.9 | 68.0 | 2 x 2048 (8) | 1.22 | 80.0 | 64 x 1024 (4, auto) | 65.0 | "
            "1 x 2048 (4, auto) | 0.85 | 1.05 | 0.80 | 1.03 | 0.00024 | 8e-05 |") in text
    assert "commit abc" in text and "`python x`" in text


def test_command_line(bench, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "measure", lambda lib, out, **kw: seen.update(lib=lib, out=out, **kw))
    bench.main(["measure", "--lib", "x.so", "--out", "r.json"])
    assert seen == {"lib": "x.so", "out": "r.json", "shape": (64, 8, 128), "batches": (1, 4, 8, 16, 32, 64),
                    "lengths": ("1024", "2048", "4096", "16384", "mixed")}
    bench.main(["measure", "--lib", "x.so", "--out", "r.json", "--shape", "32/8/128", "--batches", "8",
                "--lengths", "2048", "mixed"])
    assert seen["shape"] == (32, 8, 128) and seen["batches"] == (8,) and seen["lengths"] == ("2048", "mixed")
    (tmp_path / "r.json").write_text(json.dumps(_rows()))
    bench.main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md"), "--commit", "c", "--date", "d",
                "--command", "x"])
    assert "rule / best" in (tmp_path / "r.md").read_text()
