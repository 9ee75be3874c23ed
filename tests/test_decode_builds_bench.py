"""benchmarks/decode_builds.py's report (no GPU): each build's time, the later builds against the first,
the bytes limit, the range per shape; and its command line."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    mod = load_benchmark("decode_builds.py", "decode_builds_bench")
    return mod


def _rows():
    return [{"shape": "71/1/64", "page": 256, "batch": 8, "kind": "mixed", "bytes_us": 3.0,
             "us": {"before": 30.0, "after": 24.0}, "max_diff": 3e-5},
            {"shape": "71/1/64", "page": 16, "batch": 8, "kind": "mixed", "bytes_us": 3.0,
             "us": {"before": 30.0, "after": 27.0}, "max_diff": 3e-5}]


def test_report_rows_and_ranges(bench):
    text = bench.report(_rows(), {"commit": "abc", "date": "d", "command": "python x"})
    # rows from before the dtype column: fp16
    assert "| 71/1/64 | 256 | 8 | mixed | float16 | 30.0 | 24.0 | 0.800 | 3.0 | 10.00 | 8.00 | 3e-05 |" in text
    assert "- 71/1/64: after / before 0.80-0.90 over 2 cases" in text and "commit abc" in text


def test_command_line(bench, tmp_path, monkeypatch):
    import json

    seen = {}
    monkeypatch.setattr(bench, "measure", lambda out, libs, shapes, batches, dtypes: seen.update(
        out=out, libs=libs, shapes=shapes, batches=batches, dtypes=dtypes))
    bench.main(["measure", "--out", "r.json", "a=1.so", "b=2.so"])
    assert seen == {"out": "r.json", "libs": ["a=1.so", "b=2.so"], "shapes": list(bench.SHAPES),
                    "batches": [1, 8, 32, 64], "dtypes": ["float16"]}
    bench.main(["measure", "--out", "r.json", "a=1.so", "--shapes", "71/1/64", "32/8/128", "--batches", "4", "6",
                "--dtypes", "float16", "bfloat16"])
    assert seen["shapes"] == [(71, 1, 64), (32, 8, 128)] and seen["libs"] == ["a=1.so"]
    assert seen["batches"] == [4, 6] and seen["dtypes"] == ["float16", "bfloat16"]
    (tmp_path / "r.json").write_text(json.dumps(_rows()))
    bench.main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md"), "--commit", "c", "--date", "d",
                "--command", "x"])
    assert "after / before" in (tmp_path / "r.md").read_text()
