"""benchmarks/decode_phases.py (no GPU): how it reads a call's phase buffer (CTAs that stamped every point,
medians of the spans between them from each CTA's own clock rate, the span of the call, the stream
window), its report, its command line; and that the package's own decode-kernel builds leave the
timestamps out."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_benchmark

from mqa_byoc.kernels import build as kbuild
from mqa_byoc.testing import decode_kernel as dk


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_phases.py", "decode_phases_bench")


def _cta(t0, steps_ns, sm, ghz=2.0):
    """16 words of one CTA: globaltimer at t0 + cumulative steps, the SM, clock64 at ghz cycles a ns."""
    t = [t0]
    for s in steps_ns:
        t.append(t[-1] + s)
    return t + [sm] + [int(x * ghz) for x in t] + [0]


def test_phases_of(bench):
    words = (_cta(1000, [800, 700, 900, 5000, 800, 1800], sm=3)
             + _cta(1100, [1000, 900, 700, 6000, 600, 1500], sm=9, ghz=1.5)
             + [0] * 16  # a CTA that never ran
             + _cta(1200, [900, 700, 0, 0, 0, 0], sm=4)[:3] + [0] * 13)  # one without keys: stops early
    p = bench.phases_of(words, 4)
    assert p["ctas"] == 2 and p["sms"] == 2
    assert p["sequence range"] == pytest.approx(0.9) and p["loop"] == pytest.approx(5.5)
    assert p["split merge"] == pytest.approx(1.65)
    assert p["span_us"] == pytest.approx((1100 + 10700 - 1000) / 1e3)  # first start to last end
    assert p["start_spread_us"] == pytest.approx(0.1)
    # first loads issued at 2500 (CTA 0) to the last tile of CTA 1 at 1100 + 8600
    assert p["stream_us"] == pytest.approx((9700 - 2500) / 1e3)
    with pytest.raises(ValueError, match="no CTA"):
        bench.phases_of([0] * 32, 2)


def _row():
    return {"shape": "64/8/128", "batch": 1, "keys": 16384, "bytes_us": 13.98, "plain_us": 21.0, "phases_us": 22.0,
            "plan": {"splits": 8, "kps": 2048, "warps": 8, "row_groups": 1}, "stream_tbps": 4.5, "max_diff": 0.0,
            "phases": {"ctas": 64, "sms": 64, "span_us": 20.3, "start_spread_us": 0.06, "loop_end_spread_us": 1.4,
                       "stream_us": 15.5, "sequence range": 1.2, "prologue": 1.3, "first tile": 1.1, "loop": 13.2,
                       "CTA merge": 1.2, "split merge": 1.8}}


def test_report(bench):
    text = bench.report([_row()], {"commit": "abc", "date": "d", "command": "python x"})
    assert ("| 64/8/128 | 1 | 16384 | 8 x 2048 (8) | 64 | 14.0 | 21.0 | 22.0 | 20.3 | 1.20 | 1.30 | 1.10 | 13.20 | "
            "1.20 | 1.80 | 15.5 | 4.50 | 5.5 | 1.50 | 0 |") in text
    assert "commit abc" in text and "`python x`" in text
    shared = dict(_row(), shape="71/1/64", keys="mixed", batch=8, asked="shared16",
                  plan={"splits": 16, "kps": 1024, "warps": 5, "row_groups": 1, "shared_tiles": 1})
    assert "| 71/1/64 | 8 | mixed | shared16: 16 x 1024 (5, SharedTiles) | 64 | 14.0 | 21.0 |" in bench.report(
        [shared], {})
    packed = dict(shared, asked="shared", plan=dict(shared["plan"], shared_tiles=2))
    assert "| shared: 16 x 1024 (5, SharedTiles packed) |" in bench.report([packed], {})


def test_command_line(bench, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "measure", lambda lib, phase_lib, out, cases: seen.update(lib=lib, phase_lib=phase_lib,
                                                                                          out=out, cases=cases))
    bench.main(["measure", "--lib", "a.so", "--phase-lib", "b.so", "--out", "r.json"])
    assert seen == {"lib": "a.so", "phase_lib": "b.so", "out": "r.json", "cases": bench.CASES}
    bench.main(["measure", "--lib", "a.so", "--phase-lib", "b.so", "--out", "r.json", "--cases", "71/1/64:8:mixed",
                "64/8/128:1:2048"])
    assert seen["cases"] == ((71, 1, 64, 8, "mixed", "rule"), (64, 8, 128, 1, 2048, "rule"))
    bench.main(["measure", "--lib", "a.so", "--phase-lib", "b.so", "--out", "r.json", "--cases",
                "71/1/64:8:16384:shared16", "71/1/64:8:mixed:classic", "71/1/64:32:mixed:shared", "71/1/64:4:mixed:packed"])
    assert [c[-1] for c in seen["cases"]] == ["shared16", "classic", "shared", "packed"]
    for bad in ("71/1:8:mixed", "71/1/64:8:mixed:tiles", "71/1/64:8:mixed:shared:2"):
        with pytest.raises(SystemExit):
            bench.main(["measure", "--lib", "a.so", "--phase-lib", "b.so", "--out", "r.json", "--cases", bad])
    (tmp_path / "r.json").write_text(json.dumps([_row()]))
    bench.main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md"), "--commit", "c", "--date", "d",
                "--command", "x"])
    assert "split merge" in (tmp_path / "r.md").read_text()


def test_timestamps_only_where_asked(tmp_path):
    """The decode kernel is compiled with its timestamps only for the benchmark: not into exported
    libraries (the support object's nvcc flags), not into the tests' and benchmarks' plain build."""
    assert not any("PHASES" in f for f in kbuild.gencode_flags("sm_90"))
    assert "-DMQA_BYOC_DECODE_PHASES" not in dk.build_command(tmp_path / "x.so")
    assert "-DMQA_BYOC_DECODE_PHASES" in dk.build_command(tmp_path / "x.so", phases=True)
    assert dk.PHASES[0] == "start" and len(dk.PHASES) == 7
