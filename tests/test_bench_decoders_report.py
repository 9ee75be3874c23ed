"""``benchmarks/decoders.py``'s report half (no GPU): the committed results' markdown is what ``report``
writes from their JSON, the limits are the model's bytes and FLOPs, and a parts folder merges into the
same comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def decoders():
    mod = load_benchmark("decoders.py", "bench_decoders")
    return mod


@pytest.mark.parametrize("stem", ["2026-12-01-decoders", "2026-12-01-decoders-prefill-gemms", "2026-12-02-decoders",
                                  "2026-12-02-decoders-paged-hopper", "2026-12-03-decoders-gemm-measure",
                                  "2026-12-03-decoders-gemm-unsplit-warm", "2026-12-05-decoders-gemv",
                                  "2026-12-05-decoders-gemv-before-after", "2026-12-06-decoders-split-rope",
                                  "2026-12-06-decoders-h100-limits"])
def test_committed_markdown_is_the_reports(decoders, stem):
    result = json.loads((RESULTS / f"{stem}.json").read_text())
    assert decoders.markdown(result) == (RESULTS / f"{stem}.md").read_text()


def test_limits(decoders):
    shapes = decoders.CODELLAMA
    h, i, L, v = shapes["hidden_size"], shapes["intermediate_size"], shapes["num_layers"], shapes["vocab_size"]
    q, kv = shapes["num_heads"] * shapes["head_dim"], shapes["num_kv_heads"] * shapes["head_dim"]
    weights = 2 * (L * (h * (q + 2 * kv) + q * h + 3 * h * i) + v * h)
    assert decoders.weight_bytes(shapes) == weights
    kv_2k = 2 * 2 * L * kv * 2048
    assert decoders.decode_limit_ms(shapes, 1, 2048) == pytest.approx((weights + kv_2k) / 4.8e9)
    assert decoders.decode_limit_ms(shapes, 8, 2048) == pytest.approx((weights + 8 * kv_2k) / 4.8e9)
    # prefill: the GEMMs (lm_head on every position or the last one) and causal attention's two products
    t = 2048
    gemm = 2 * t * (weights / 2 - v * h)
    attn = 2 * t * t * q * L
    assert decoders.prefill_limit_ms(shapes, t, "all") == pytest.approx((gemm + 2 * t * v * h + attn) / 989e9)
    assert decoders.prefill_limit_ms(shapes, t, "last") == pytest.approx((gemm + 2 * v * h + attn) / 989e9)


def test_report_merges_parts(decoders, tmp_path):
    committed = json.loads((RESULTS / "2026-12-01-decoders.json").read_text())
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("paged-gemm", "paged-tvm", "hf-eager"):
        (parts / f"{name}.json").write_text(json.dumps(committed["parts"][name]))
    result = decoders.report(parts, tmp_path / "out", "abc1234", "cmd")
    assert list(result["parts"]) == ["paged-gemm", "paged-tvm", "hf-eager"]  # the table's order, not the files'
    cmp = result["comparisons"]
    pg, pt, hf = (committed["parts"][n] for n in ("paged-gemm", "paged-tvm", "hf-eager"))
    assert cmp["paged-gemm_vs_paged-tvm_prefill_2048"] == round(pt["prefill"][0]["ms"] / pg["prefill"][0]["ms"], 3)
    assert cmp["paged-gemm_vs_hf-eager_decode_b1_2048"] == round(hf["decode"][0]["ms_per_step"] / pg["decode"][0]["ms_per_step"], 3)
    assert "inplace" not in " ".join(cmp)
    assert (tmp_path / "out.md").read_text() == decoders.markdown(result)


def test_decode_only_run_compares_the_algorithm_choices_and_plots(decoders, tmp_path):
    committed = json.loads((RESULTS / "2026-12-03-decoders-gemm-measure.json").read_text())
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("inplace-cublaslt", "paged", "paged-before", "inplace-dlight"):
        (parts / f"{name}.json").write_text(json.dumps(committed["parts"][name]))
    result = decoders.report(parts, tmp_path / "out", "abc1234", "cmd")
    assert list(result["parts"]) == ["paged-before", "paged", "inplace-dlight", "inplace-cublaslt"]
    cmp = result["comparisons"]
    before, now = committed["parts"]["paged-before"]["decode"], committed["parts"]["paged"]["decode"]
    for b, n in zip(before, now):
        key = f"paged_vs_paged-before_decode_b{n['batch']}_{n['context']}"
        assert cmp[key] == round(b["ms_per_step"] / n["ms_per_step"], 3)
    d, c = (committed["parts"][k]["decode"][0] for k in ("inplace-dlight", "inplace-cublaslt"))
    assert cmp["inplace-cublaslt_vs_inplace-dlight_decode_b1_2048"] == round(d["ms_per_step"] / c["ms_per_step"], 3)
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert png.is_file() and png.stat().st_size > 10_000  # decode only: one panel, each step against its limit
    for p in result["parts"].values():
        p["decode"] = []
    with pytest.raises(ValueError, match="decode rows"):
        decoders.plot(result, tmp_path / "none.png")


@pytest.mark.parametrize("argv, lengths", [([], [2048, 16384]), (["--prefill"], [2048, 16384]),
                                           (["--prefill", "512"], [512]), (["--no-prefill"], [])])
def test_prefill_flag(decoders, argv, lengths):
    """``--prefill`` alone times the default prompt lengths (it used to mean none); ``--no-prefill`` none."""
    import argparse

    parser = argparse.ArgumentParser()
    decoders._prefill_args(parser, [2048, 16384])
    assert parser.parse_args(argv).prefill == lengths


def test_gemm_table_and_plot_name_the_runs_limits(decoders, tmp_path, monkeypatch):
    """A run on an H100 rates its GEMMs against 3.35 TB/s: the table's header and the plot's labels say so
    (they once said 4.8 TB/s whatever the run's GPU)."""
    result = json.loads((RESULTS / "2026-12-06-decoders-h100-limits.json").read_text())
    assert result["limits"]["hbm_tbps"] == 3.35
    text = decoders.markdown(result)
    assert "| of 3.35 TB/s |" in text and "4.8 TB/s" not in text
    row = next(r for p in result["parts"].values() for d in p["decode"] for r in d["gemms"]["rows"])
    assert row["fraction_of_limit"] == pytest.approx(row["tbps"] / 3.35, abs=0.01)
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    labels = []
    real = decoders._panel
    monkeypatch.setattr(decoders, "_panel", lambda ax, *a, **k: (labels.append(a[3]), real(ax, *a, **k)))
    decoders.plot(result, tmp_path / "h100.png")
    assert labels[0] == "decode step / bytes limit (3.35 TB/s)"
