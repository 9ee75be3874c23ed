"""Every measured number README.md and docs/performance.md show, recomputed from benchmarks/results.

Each claim below is computed from a result file and formatted as the documents write it; the test fails
when a document does not contain it (a number typed by hand that the files do not give, or a result file
changed under the text). Also: the results index lists every file of benchmarks/results, and the
documents cite only files that exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
PERF = ROOT / "docs" / "performance.md"
HBM_TB_S = 4.8  # the H200's HBM3e peak, as the benchmarks record it (hbm_peak_tb_s)


def _load(name):
    return json.loads((RESULTS / name).read_text())


def _by_case(records, key="kernel_us"):
    """{(mode, shape, dtype, seq_kv): {variant: value}} of an attention run's records."""
    out = {}
    for r in records:
        if r.get(key) is not None:
            out.setdefault((r["mode"], r["shape"], r["dtype"], r["seq_kv"]), {})[r["variant"]] = r[key]
    return out


def _num(x, digits=1):
    """As the documents write numbers: thousands separated, ``digits`` decimals below 100, none above."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.{digits}f}"


def _range(values, digits=2, unit="x"):
    assert values, "no values: the result file lacks the cases the claim is about"
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def _ratios(cases, num, den, where=lambda k: True):
    return [v[num] / v[den] for k, v in cases.items() if where(k) and num in v and den in v]


# ---------------------------------------------------------------------------------------------
# the claims

DECODE_RUN = "2026-12-01-attention-loadpath.json"
PREFILL_RUN = "2026-12-01-attention-prefill-idle.json"
PREFILL_RERUN = "2026-12-01-attention-prefill-idle-2.json"
PROFILE_RUN = "2026-12-01-profile-codellama34b-4l-loadpath-16k.json"
EARLIER_RUN = "2026-11-30-attention-presets.json"
HOPPER_RUN = "2026-11-30-attention-hopper.json"
PAGED_RUN = "2026-12-01-paged-attention-loadpath-16k.json"
PAGED_EARLIER = "2026-11-30-paged-attention.json"
PAGED_PROFILE = "2026-11-30-profile-codellama34b-4l-paged-2k.json"
KERNEL_RUN = "2026-12-01-decode-kernel-loadpath.json"
FLOOR_RUN = "2026-12-01-decode-kernel-read-floor.json"
FUZZ_RUN = "2026-12-01-fuzz-1000-seed8.json"
PARTITION_RUN = "2026-11-29-partition-speed.json"

TABLE_ROWS = {  # README / performance.md kernel table: row label -> variant
    "mqa-byoc, hopper provider": "mqa-hopper",
    "mqa-byoc, native provider": "mqa-native",
    "PyTorch SDPA, `enable_gqa=True`": "torch-sdpa-gqa",
    "FA2 called directly": "fa2-direct",
}
TABLE_COLUMNS = [("decode", 1024), ("decode", 16384), ("decode", 32768), ("prefill", 4096), ("prefill", 16384)]
GQA = ("h64-kv8-d128", "h32-kv8-d128")
FALCON = "h71-kv1-d64"


def kernel_table_rows() -> dict[str, list[str]]:
    """The kernel table: 64/8/128 fp16, decode from the decode run, prefill from the same-clock run."""
    decode = _by_case(_load(DECODE_RUN)["records"])
    prefill = _by_case(_load(PREFILL_RUN)["records"])
    rows = {}
    for label, variant in TABLE_ROWS.items():
        cells = []
        for mode, n in TABLE_COLUMNS:
            cases = decode if mode == "decode" else prefill
            cells.append(_num(cases[(mode, "h64-kv8-d128", "float16", n)][variant]))
        rows[label] = cells
    return rows


def prefill_claims() -> dict[str, str]:
    out = {}
    for tag, run in (("", PREFILL_RUN), ("rerun ", PREFILL_RERUN)):
        data = _load(run)
        cases = _by_case(data["records"])
        out[f"{tag}hopper vs cuDNN"] = _range(_ratios(cases, "torch-sdpa-gqa", "mqa-hopper"))
        out[f"{tag}hopper vs FA2"] = _range(_ratios(cases, "fa2-direct", "mqa-hopper"))
        out[f"{tag}cuDNN vs FA2"] = _range(_ratios(cases, "fa2-direct", "torch-sdpa-gqa"))
        tf = _by_case(data["records"], "kernel_tflops")
        for dtype in ("float16", "bfloat16"):
            vals = [tf[("prefill", s, dtype, 16384)]["mqa-hopper"] for s in GQA]
            out[f"{tag}hopper TFLOP/s 16k {dtype}"] = _range(vals, 0, " TFLOP/s")
    return out


def decode_claims() -> dict[str, str]:
    data = _load(DECODE_RUN)
    cases = _by_case(data["records"])
    hbm = {}
    for r in data["records"]:
        if r["mode"] == "decode":
            kv_bytes = 2 * r["seq_kv"] * r["num_kv_heads"] * r["head_dim"] * 2  # K and V, 2-byte dtypes
            hbm[(r["shape"], r["dtype"], r["seq_kv"])] = kv_bytes / (HBM_TB_S * 1e6)  # µs
    gqa = lambda k: k[0] == "decode" and k[1] in GQA  # noqa: E731
    falcon = lambda k: k[0] == "decode" and k[1] == FALCON  # noqa: E731
    at32k = lambda k: gqa(k) and k[3] == 32768  # noqa: E731
    return {
        "decode GQA vs cuDNN": _range(_ratios(cases, "torch-sdpa-gqa", "mqa-native", gqa)),
        "decode Falcon vs cuDNN": _range(_ratios(cases, "torch-sdpa-gqa", "mqa-native", falcon)),
        "decode GQA HBM 32k ours": _range([v["mqa-native"] / hbm[k[1:]] for k, v in cases.items() if at32k(k)]),
        "decode GQA HBM 32k cuDNN": _range([v["torch-sdpa-gqa"] / hbm[k[1:]] for k, v in cases.items() if at32k(k)]),
    }


def kernel_alone_claims() -> dict[str, str]:
    cases = _load(KERNEL_RUN)["cases"]
    gqa = [c["ours_us"] / c["cudnn_us"] for c in cases if c["shape"] in ("64/8/128", "32/8/128")]
    falcon = [c["ours_us"] / c["cudnn_us"] for c in cases if c["shape"] == "71/1/64"]
    floor = _load(FLOOR_RUN)["cases"]
    f32 = [c for c in floor if c["keys"] == 32768]
    return {
        "kernel alone GQA / cuDNN": _range(gqa),
        "kernel alone Falcon / cuDNN": _range(falcon),
        "read floor GQA 32k": _range([c["read_floor_cold_us"] / c["hbm_us"] for c in f32 if c["shape"] != "71/1/64"]),
        "ours GQA 32k cold": _range([c["ours_cold_us"] / c["hbm_us"] for c in f32 if c["shape"] != "71/1/64"]),
        "read floor Falcon 32k cold": _range([c["read_floor_cold_us"] / c["hbm_us"] for c in f32
                                              if c["shape"] == "71/1/64"]),
        "read floor Falcon 32k warm": _range([c["read_floor_warm_us"] / c["hbm_us"] for c in f32
                                              if c["shape"] == "71/1/64"]),
    }


def fa4_decode_claim() -> str:
    cases = _by_case(_load(HOPPER_RUN)["records"])
    return _range(_ratios(cases, "mqa-hopper-fa4-decode", "mqa-native", lambda k: k[0] == "decode"))


def weights_and_kv_bytes(mode: dict, context: int) -> float:
    """Bytes a decode step must read at least: every weight (lm_head, not the embedding table) and the K/V."""
    h, i, layers = mode["hidden_size"], mode["intermediate_size"], mode["num_layers"]
    kv_dim = mode["num_kv_heads"] * mode["head_dim"]
    q_dim = mode["num_heads"] * mode["head_dim"]
    per_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * i  # qkv, o, gate/up, down
    kv = layers * 2 * context * kv_dim
    return 2 * (layers * per_layer + mode["vocab_size"] * h + kv)  # fp16


def decoder_claims() -> dict[str, str]:
    data = _load(PROFILE_RUN)
    mqa, rep = data["modes"]["mqa"], data["modes"]["repeat"]
    limit_ms = weights_and_kv_bytes(mqa, data["prompt_len"]) / (HBM_TB_S * 1e12) * 1e3
    return {
        "tokens/s": f"{mqa['decode_loop_tokens_per_s']} tokens/s with `mqa=True` vs {rep['decode_loop_tokens_per_s']}",
        "ratio": f"({mqa['decode_loop_tokens_per_s'] / rep['decode_loop_tokens_per_s']:.2f}x)",
        "ms/token": f"{mqa['decode_loop_ms_per_token']:.3f} ms/token",
        "limit ms": f"{limit_ms:.2f} ms",
        "limit ratio": f"{mqa['decode_loop_ms_per_token'] / limit_ms:.2f}x",
    }


def earlier_table_rows() -> dict[str, list[str]]:
    data = _load(EARLIER_RUN)
    cases = _by_case(data["records"], "us")
    ok = {(r["mode"], r["shape"], r["dtype"], r["seq_kv"], r["variant"]): r.get("numerics_ok") for r in data["records"]}
    rows = {}
    for label, variants in (("mqa-byoc (`mqa=True`", ("mqa-native", "mqa-native")),
                            ("K/V repeated + FA2 as plain MHA", ("repeat-native", "repeat-native")),
                            ("TVM's `relax.frontend.nn.llm` TIR kernels", ("tvm-llm-paged", "tvm-llm-ragged")),
                            ("stock TVM `R.nn.attention` lowering", ("stock-tvm", "stock-tvm"))):
        cells = []
        for mode, n in TABLE_COLUMNS:
            variant = variants[0] if mode == "decode" else variants[1]
            key = (mode, "h64-kv8-d128", "float16", n)
            if variant not in cases.get(key, {}):
                cells.append("–")
                continue
            mark = " ✗" if ok[key + (variant,)] is False else ""
            cells.append(_num(cases[key][variant]) + mark)
        rows[label] = cells
    return rows


def paged_claims() -> dict[str, str]:
    cur = _load(PAGED_RUN)["cases"]
    out = {}
    for case, label in (("gqa64_8_d128", "GQA"), ("mqa71_1_d64", "MQA")):
        for batch in (1, 8):
            run = cur[case][f"decode16384_b{batch}"]
            ours = run["fa2"]["attention_kernels_us"]
            if "tir" in run:
                tir = run["tir"]["attention_kernels_us"]
                ratio = f"{tir / ours:.1f}x" if tir / ours < 20 else f"{tir / ours:.0f}x"
                out[f"paged {label} b{batch}"] = f"{ratio} ({_num(tir)} vs {_num(ours)} µs)"
            else:
                out[f"paged {label} b{batch}"] = f"{_num(ours)} µs"
    old = _load(PAGED_EARLIER)["cases"]
    for case, label in (("gqa64_8_d128", "GQA"), ("mqa71_1_d64", "MQA")):
        for batch in (1, 8):
            out[f"paged prefill {label} b{batch}"] = f"{old[case][f'prefill4096_b{batch}']['tir_over_fa2']['attention_kernels']:,.0f}x"
    for batch in (1, 8):
        d = old["gqa64_8_d128"][f"decoder_decode4096_b{batch}"]
        out[f"paged decoder b{batch}"] = (f"{_num(d['fa2']['tokens_per_second'])} vs {_num(d['tir']['tokens_per_second'])} "
                                          f"tokens/s ({d['fa2_over_tir_tokens_per_second']:.2f}x)")
    prof = _load(PAGED_PROFILE)
    m, r = prof["modes"]["mqa"], prof["modes"]["repeat"]
    out["paged profile decode"] = (f"{m['decode_loop_tokens_per_s']} vs {r['decode_loop_tokens_per_s']} tokens/s "
                                   f"({prof['comparison']['decode_speedup']:.2f}x)")
    pm, pr = m["phases"]["prefill"]["kernel_ms_per_step"], r["phases"]["prefill"]["kernel_ms_per_step"]
    out["paged profile prefill"] = f"{pm:.1f} vs {pr:.1f} ms ({pr / pm:.2f}x)"
    return out


def fuzz_claim() -> str:
    f = _load(FUZZ_RUN)
    assert f["violations"] == {}
    return (f"{f['graphs']:,} graphs, {f['sites']:,} sites, {f['offloaded']} offloaded, {f['built']} graphs built "
            f"for sm_90 with both providers, no violation ({f['seconds']:.0f} s")


def partition_claim() -> str:
    p = _load(PARTITION_RUN)
    return (f"{p['layers']} layers, {p['sites']} attention sites, all offloaded: "
            f"{min(p['partition_s']):.1f}–{max(p['partition_s']):.1f} s")


def all_claims() -> dict[str, str]:
    out = {**prefill_claims(), **decode_claims(), **kernel_alone_claims(), **decoder_claims(), **paged_claims()}
    out["FA4 decode / ours"] = fa4_decode_claim()
    out["partition"] = partition_claim()
    return out


# ---------------------------------------------------------------------------------------------
# the tests


def _table_row(text: str, label: str) -> list[str]:
    line = next((ln for ln in text.splitlines() if ln.startswith("|") and label in ln), None)
    assert line is not None, f"no table row {label!r}"
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")[1:]]


@pytest.mark.parametrize("doc", [README, PERF], ids=lambda p: p.name)
def test_kernel_table(doc):
    text = doc.read_text()
    for label, cells in kernel_table_rows().items():
        assert _table_row(text, label) == cells, label


def test_earlier_table():
    text = PERF.read_text()
    for label, cells in earlier_table_rows().items():
        assert _table_row(text, label) == cells, label


def test_readme_decoder_line():
    text = " ".join(README.read_text().split())
    c = decoder_claims()
    assert f"{c['tokens/s']} with `mqa=False` {c['ratio']}" in text.replace("**", "")
    assert f"{c['limit ratio']} the time it takes to read every weight and the K/V once" in text


@pytest.mark.parametrize("name", sorted(all_claims()))
def test_performance_page_claim(name):
    text = " ".join(PERF.read_text().split())
    assert all_claims()[name] in text, f"docs/performance.md lacks {name}: {all_claims()[name]!r}"


def test_testing_page_fuzz_claim():
    text = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    assert fuzz_claim() in text


def test_the_whole_decoder_claim_is_the_current_build():
    """The bold whole-decoder line is the current build's run, not the best of several builds."""
    assert decoder_claims()["ratio"] == "(2.67x)"


_CITED = re.compile(r"20\d\d-\d\d-\d\d-[A-Za-z0-9_.{},-]+")


def _cited_files(text: str) -> set[str]:
    names = set()
    for m in _CITED.findall(text):
        m = m.rstrip(".,)`")
        brace = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", m)
        for stem in ([brace.group(1) + x + brace.group(3) for x in brace.group(2).split(",")] if brace else [m]):
            names.add(stem)
    return names


def test_documents_cite_existing_results():
    docs = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "gpu" / "README.md"]
    missing = []
    for doc in docs:
        for name in _cited_files(doc.read_text()):
            if not any(p.name.startswith(name) for p in RESULTS.iterdir()):
                missing.append(f"{doc.name}: {name}")
    assert not missing, missing


def test_results_index_lists_every_file():
    listed = _cited_files((RESULTS / "README.md").read_text())
    files = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert files - listed == set(), "not in benchmarks/results/README.md"
    assert listed - files == set(), "listed in benchmarks/results/README.md but missing"


def test_results_index_records_commit_date_gpu_command():
    rows = [ln for ln in (RESULTS / "README.md").read_text().splitlines() if ln.startswith("| `20")]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row
        files, _what, commit, date, gpu, command = cells
        assert re.fullmatch(r"[0-9a-f]{7,}", commit), row
        assert re.match(r"20\d\d-\d\d-\d\d", date), row
        assert gpu and command, row


def gemm_claims() -> dict[str, str]:
    """The README's GEMM numbers, from the GEMM benchmark and the paged decoder's same-run profiles."""
    rows = _load("2026-12-01-gemm.json")["rows"]
    big = [r for r in rows if r["M"] >= 2048]
    ours = [r["ours"]["tflops"] for r in big]
    tvm = [min(r["tvm_static"]["tflops"], r["tvm_sym"]["tflops"]) for r in big]
    tvm_hi = [max(r["tvm_static"]["tflops"], r["tvm_sym"]["tflops"]) for r in big]
    vs = [r["ours"]["vs_torch"] for r in big]
    on = _load("2026-12-01-profile-codellama34b-4l-paged-gemm-2k.json")
    off = _load("2026-12-01-profile-codellama34b-4l-paged-nogemm-2k.json")
    m_on, m_off = on["modes"]["mqa"], off["modes"]["mqa"]
    limit_ms = weights_and_kv_bytes(m_on, on["prompt_len"]) / (HBM_TB_S * 1e12) * 1e3
    d_on, d_off = m_on["decode_loop_ms_per_token"], m_off["decode_loop_ms_per_token"]
    p_on = m_on["phases"]["prefill"]["wall_ms_median"]
    p_off = m_off["phases"]["prefill"]["wall_ms_median"]
    return {
        "prefill rate": f"at {min(ours):.0f}–{max(ours):.0f} TFLOP/s, {min(vs):.2f}–{max(vs):.2f}x `torch.matmul`",
        "tvm rate": f"(TVM's own kernels: {min(tvm):.0f}–{max(tvm_hi):.0f} TFLOP/s)",
        "decode": f"decode {d_on:.3f} ms/token vs {d_off:.3f} on TVM's kernels ({d_off / d_on:.2f}x), "
                  f"{d_on / limit_ms:.2f}x the time it takes to read every weight and the K/V once",
        "prefill": f"prefill {p_on:.1f} ms vs {p_off:.1f} ms ({p_off / p_on:.2f}x)",
    }


@pytest.mark.parametrize("name", sorted(gemm_claims()))
def test_readme_gemm_claim(name):
    text = " ".join(README.read_text().split())
    assert gemm_claims()[name] in text, f"README lacks {name}: {gemm_claims()[name]!r}"



def cuda_binary_claim() -> str:
    """deployment.md's cost of ``cuda_binary``, from its measurement."""
    d = _load("2026-12-01-cuda-binary-cost.json")["decoder"]
    share = d["median_nvcc_s"] / (d["median_build_s"] + d["median_export_s"])
    return (f"compiles its {d['kernels']} TVM kernels, one module, in {d['median_nvcc_s']:.1f} s (median of "
            f"{len(d['repeats'])}), beside {d['median_build_s']:.1f} s of build and {d['median_export_s']:.1f} s of "
            f"export: {share:.0%} more.")


def test_deployment_page_cuda_binary_claim():
    assert _load("2026-12-01-cuda-binary-cost.json")["decoder"]["cuda_modules_compiled"] == 1
    text = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    assert cuda_binary_claim() in text, cuda_binary_claim()
