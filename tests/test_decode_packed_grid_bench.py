"""benchmarks/decode_packed_grid.py's report (no GPU): per case the classic blocks', the rule's and each grid's best
time, two CTAs an SM against the rule; its command line; and the plan it overrides (a CPU check of the
scratch it sizes)."""

from __future__ import annotations

import json
import types

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_packed_grid.py", "decode_packed_grid_bench")


def _row(batch=8, rule=20.0, rule2=19.0):
    r = {"batch": batch, "lengths": "mixed", "dtype": "float16", "gpu": "NVIDIA H100 80GB HBM3", "rule_shared": 2,
         "rule_splits": 396, "rule_kps": 256, "rule_warps": 5, "classic": 24.0, "rule": rule, "rule2": rule2,
         "diff": 1e-4}
    for per_sm in (1, 2):
        for kps in (64, 128, 256):
            r[f"g{132 * per_sm}k{kps}"] = 30.0 - 5 * per_sm + kps / 64
    return r


def test_report(bench):
    text = bench.report([_row(), _row(batch=4, rule=16.0, rule2=17.0)], {"commit": "abc", "date": "d", "command": "x"})
    # 1/SM: best 26.0 (k64), 27.0 at 128, 29.0 at 256; 2/SM: 21.0 / 22.0 / 24.0; the rule the better of two timings
    assert "| 71/1/64 | 8 | mixed | float16 | 24.0 | 19.0 (2: 396 x 256) | 26.0 (27.0, 29.0) | 21.0 (22.0, 24.0) | 1.16 | 0.0001 |" in text
    assert "| 71/1/64 | 4 | mixed | float16 | 24.0 | 16.0 (2: 396 x 256) |" in text
    assert "2 CTAs an SM, splits of at least 128 keys, against the rule: 1.16-1.38x over 2 cases." in text
    assert "commit abc" in text and "NVIDIA H100" in text
    assert "TVM's pages of 256;" in text  # rows from before the page was recorded: 256


def test_report_names_the_page(bench):
    text = bench.report([{**_row(), "page": 16}], {"commit": "abc", "date": "d", "command": "x"})
    assert "TVM's pages of 16;" in text


def test_packed_plan_override(bench, monkeypatch):
    """The override makes a packed plan of the grid (at least one CTA a sequence) and sizes its scratch: a
    partial of every row of every CTA (D floats and an LSE) and a (first partial, splits) pair a slot."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "empty", lambda n, dtype=None, device=None: ("scratch", n))
    plan = types.SimpleNamespace(warps=5, row_groups=1, splits=0, keys_per_split=0, o_part_floats=0, workspace_bytes=0)
    call = types.SimpleNamespace(plan=plan, set_packed=lambda: None)
    bench.packed(call, 264, 128, 8, 1, 64)
    assert (plan.splits, plan.keys_per_split) == (264, 128)
    assert plan.o_part_floats == 264 * 80 * 64 and plan.workspace_bytes == (264 * 80 * 65) * 4 + 8 * 8
    assert call.ws == ("scratch", plan.workspace_bytes)
    bench.packed(call, 132, 64, 200, 1, 64)  # more sequences than the grid: one CTA each
    assert plan.splits == 200


def test_command_line(bench, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "measure", lambda lib, out, **kw: seen.update(lib=lib, out=out, **kw))
    bench.main(["measure", "--lib", "x.so", "--out", "r.json"])
    assert seen == {"lib": "x.so", "out": "r.json", "batches": (4, 6, 8, 10, 12, 16, 32), "shape": (71, 1, 64),
                    "page": 256}
    bench.main(["measure", "--lib", "x.so", "--out", "r.json", "--shape", "40/2/64", "--batches", "4", "6",
                "--page", "16"])
    assert seen["batches"] == (4, 6) and seen["shape"] == (40, 2, 64) and seen["page"] == 16
    (tmp_path / "r.json").write_text(json.dumps([_row()]))
    bench.main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md"), "--commit", "c", "--date", "d",
                "--command", "x"])
    assert "| 71/1/64 | 8 |" in (tmp_path / "r.md").read_text()
