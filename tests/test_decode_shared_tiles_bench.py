"""benchmarks/decode_shared_tiles.py's report (no GPU): per case the classic blocks' time, each split count's,
the best against the classic blocks; and its command line."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_shared_tiles.py", "decode_shared_tiles_bench")


def _rows():
    return [{"shape": "40/2/64", "batch": 16, "lengths": "mixed", "rule_shared_tiles": 1, "classic": 40.0,
             "rule": 34.0, "asked": 32.0, "asked_shared_tiles": 2, "g8": 50.0, "g16": 36.0, "max_diff": 1e-4},
            {"batch": 8, "lengths": "mixed", "rule_shared_tiles": 0, "classic": 20.0, "rule": 20.0, "g8": 25.0,
             "g16": 30.0, "max_diff": 0.0}]


def test_report(bench):
    text = bench.report(_rows(), {"commit": "abc", "date": "d", "command": "python x"})
    assert "| 40/2/64 | 16 | mixed | 40.0 | 34.0 (1) | 32.0 (2) | 50.0 | 36.0 | 0.90 | 0.85 | 0.80 | 0.0001 |" in text
    # a run from before the `asked` column: 71/1/64, no asked time
    assert "| 71/1/64 | 8 | mixed | 20.0 | 20.0 (0) | – | 25.0 | 30.0 | 1.25 | 1.00 | – | 0 |" in text
    assert "g16 / classic: batch 16 mixed 0.90" in text and "commit abc" in text


def test_report_with_key_groups(bench):
    rows = [{"shape": "71/1/64", "batch": 8, "lengths": "mixed", "rule_shared_tiles": 0, "classic": 20.0,
             "rule": 20.0, "asked": 26.0, "asked_shared_tiles": 1, "asked_k2": 16.0, "g16": 26.0, "g16k2": 15.0,
             "max_diff": 0.0}]
    text = bench.report(rows, {"commit": "abc", "date": "d", "command": "python x"})
    assert "| asked k2 µs | g16 µs | g16k2 µs |" in text and "one key group" in text
    assert "| 71/1/64 | 8 | mixed | 20.0 | 20.0 (0) | 26.0 (1) | 16.0 | 26.0 | 15.0 | 0.75 | 1.00 | 1.30 | 0 |" in text


def test_command_line(bench, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "measure", lambda lib, out, **kw: seen.update(lib=lib, out=out, **kw))
    bench.main(["measure", "--lib", "x.so", "--out", "r.json"])
    assert seen == {"lib": "x.so", "out": "r.json", "batches": (8, 16, 24), "shape": (71, 1, 64), "key_groups": 1}
    bench.main(["measure", "--lib", "x.so", "--out", "r.json", "--shape", "40/2/64", "--batches", "4", "6",
                "--key-groups", "2"])
    assert seen["batches"] == (4, 6) and seen["shape"] == (40, 2, 64) and seen["key_groups"] == 2
    (tmp_path / "r.json").write_text(json.dumps(_rows()))
    bench.main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md"), "--commit", "c", "--date", "d",
                "--command", "x"])
    assert "rule / classic" in (tmp_path / "r.md").read_text()
