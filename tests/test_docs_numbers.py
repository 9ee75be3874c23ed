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

from mqa_byoc.contract import GEMM_COMPOSITES

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

def _assert_in_paged_doc(claims: dict, name: str) -> None:
    """docs/paged_kv_cache.md (whitespace folded) states ``claims[name]``."""
    text = " ".join(PAGED_DOC.read_text().split())
    assert claims[name] in text, f"docs/paged_kv_cache.md lacks {name}: {claims[name]!r}"


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
DECODERS_RUN = "2026-12-01-decoders.json"
DECODERS_GEMMS_RUN = "2026-12-01-decoders-prefill-gemms.json"
GEMM_TABLE_RUN = "2026-12-01-profile-codellama34b-4l-paged-gemm-2k-table.json"
PAGED_RUN = "2026-12-01-paged-attention-loadpath-16k.json"
PAGED_EARLIER = "2026-11-30-paged-attention.json"
PAGED_PROFILE = "2026-11-30-profile-codellama34b-4l-paged-2k.json"
KERNEL_RUN = "2026-12-01-decode-kernel-loadpath.json"
FLOOR_RUN = "2026-12-01-decode-kernel-read-floor.json"
FUZZ_RUN = "2026-12-01-fuzz-1000-seed8.json"
GEMM_FUZZ_RUN = "2026-12-07-gemm-fuzz-1000-seed17-epilogues.json"
TILES_RUN = "2026-12-02-mqa-decode-tiles.json"
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


def row_tiles_claims() -> dict[str, str]:
    """Warps of 2 or 3 M tiles against the kernel before them (the faster of the two per case)."""
    cases = _load(TILES_RUN)["cases"]
    more = lambda c: min(c["us"]["tiles2"], c["us"]["tiles3"]) / c["us"]["before"]  # noqa: E731
    falcon = [c for c in cases if c["shape"] == "mqa71_1_d64"]
    return {
        "tiles Falcon pages b8-64": _range([more(c) for c in falcon if "pages" in c["layout"] and c["batch"] > 1]),
        "tiles Falcon b1": _range([more(c) for c in falcon if c["batch"] == 1]),
        "one tile vs before": _range([c["us"]["tiles1"] / c["us"]["before"] for c in cases]),
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


def gemm_fuzz_claim() -> str:
    f = _load(GEMM_FUZZ_RUN)
    assert f["violations"] == []
    composites = {name.split(" ")[0] for name in f["composites"]}
    assert composites == set(GEMM_COMPOSITES), set(GEMM_COMPOSITES) - composites  # every composite offloaded
    legalized = sum(n for name, n in f["composites"].items() if name.endswith("(legalize)")
                    and any(e in name.split(" ")[0] for e in ("_bias", "_residual", "_cast")))
    return (f"{f['graphs']:,} graphs, {f['sites']:,} GEMM sites, {f['offloaded']} offloaded (every composite of the "
            f"pattern table, batched ones too; {legalized} of them after `LegalizeOps` with their epilogue or cast "
            f"back), no "
            f"violation ({f['seconds']:.0f} s")


def partition_claim() -> str:
    p = _load(PARTITION_RUN)
    return (f"{p['layers']} layers, {p['sites']} attention sites, all offloaded: "
            f"{min(p['partition_s']):.1f}–{max(p['partition_s']):.1f} s")


def all_claims() -> dict[str, str]:
    out = {**prefill_claims(), **decode_claims(), **kernel_alone_claims(), **decoder_claims(), **paged_claims(),
           **row_tiles_claims()}
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


def test_testing_page_gemm_fuzz_claim():
    text = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    assert gemm_fuzz_claim() in text


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


def test_readme_granite_swa_gpu_claim():
    """The README's GraniteSWA numbers: the offloaded and TVM's builds' prefill logits against float32 eager
    (max abs), and TVM's decode build recorded as failed."""
    run = _load("2026-12-06-gpu-hf-standard-granite-swa-h100.json")
    prefill = run["hf-standard:granite_swa_sinks-prefill"]["vs_fp32_eager"]
    claim = (f"prefill logits within {prefill['mqa']['max_abs']:.4f} of float32 eager, TVM's own build "
             f"{prefill['tvm']['max_abs']:.4f}; TVM cannot build its decode step, ours can")
    assert claim in " ".join(README.read_text().split())
    decode = run["hf-standard:granite_swa_sinks-decode"]
    assert "tvm_not_built" in decode and set(decode["vs_fp32_eager"]) == {"mqa"}


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
    """The README's GEMM numbers, from the GEMM benchmark and the decoders' run."""
    rows = _load("2026-12-01-gemm.json")["rows"]
    big = [r for r in rows if r["M"] >= 2048]
    ours = [r["ours"]["tflops"] for r in big]
    tvm = [min(r["tvm_static"]["tflops"], r["tvm_sym"]["tflops"]) for r in big]
    tvm_hi = [max(r["tvm_static"]["tflops"], r["tvm_sym"]["tflops"]) for r in big]
    vs = [r["ours"]["vs_torch"] for r in big]
    prefill = {p["tokens"]: p["ms"] for p in _load(DECODERS_RUN)["parts"]["paged-gemm"]["prefill"]}
    prefill_tvm = {p["tokens"]: p["ms"] for p in _load(DECODERS_RUN)["parts"]["paged-tvm"]["prefill"]}
    return {
        "prefill rate": f"at {min(ours):.0f}–{max(ours):.0f} TFLOP/s, {min(vs):.2f}–{max(vs):.2f}x `torch.matmul`",
        "tvm rate": f"(TVM's own kernels: {min(tvm):.0f}–{max(tvm_hi):.0f} TFLOP/s)",
        "prefill": f"its prefill is {prefill_tvm[2048] / prefill[2048]:.2f}x (2k) and {prefill_tvm[16384] / prefill[16384]:.2f}x "
                   "(16k) faster than with TVM's GEMM kernels",
    }


@pytest.mark.parametrize("name", sorted(gemm_claims()))
def test_readme_gemm_claim(name):
    text = " ".join(README.read_text().split())
    assert gemm_claims()[name] in text, f"README lacks {name}: {gemm_claims()[name]!r}"



# ---------------------------------------------------------------------------------------------
# whole decoders with GEMMs on cuBLASLt, against the limits and HF transformers (benchmarks/decoders.py)

GEMM_DOC = ROOT / "docs" / "gemm.md"
DECODE_CASES = ((1, 2048), (1, 16384), (8, 2048), (32, 2048))
DECODE_ROWS = {  # performance.md's decode table: label -> part
    "PagedKVCache, GEMMs on cuBLASLt (the default: measured algorithms)": "paged-gemm-measure",
    "PagedKVCache, cuBLASLt, the heuristic's first algorithm": "paged-gemm",
    "PagedKVCache, cuBLASLt, CUDA graphs (`--cuda-graph`)": "paged-gemm-graph",
    "PagedKVCache, GEMMs on TVM's kernels (`--no-gemm`)": "paged-tvm",
    "in-place cache (dlight's GEMV at M = 1)": "inplace-gemm",
    "in-place cache, CUDA graphs (`--cuda-graph`)": "inplace-gemm-graph",
    "in-place cache, GEMMs on TVM's kernels (`--no-gemm`)": "inplace-tvm",
    "HF transformers, eager (SDPA, dynamic cache)": "hf-eager",
    "HF transformers, `torch.compile` (static cache)": "hf-compile",
}
PREFILL_ROWS = {
    "PagedKVCache on cuBLASLt": ("paged-gemm", "paged-tvm"),
    "in-place cache on cuBLASLt": ("inplace-gemm", "inplace-tvm"),
    "PagedKVCache on TVM's GEMM kernels": ("paged-tvm", None),
    "in-place cache on TVM's GEMM kernels": ("inplace-tvm", None),
    "HF transformers eager (SDPA)": ("hf-eager", None),
    "HF `torch.compile`": ("hf-compile", None),
}


def _decode_rec(parts, name, batch, context):
    return next((d for d in parts[name]["decode"] if (d["batch"], d["context"]) == (batch, context)), None)


def _decode_cells(parts, name, limits="paged-gemm") -> list[str]:
    """A decode table row: ms per step and, in brackets, over the bytes limit, per DECODE_CASES (the limits
    of the part ``limits``: HF's parts have none, and the limit is the model's, the same for every build)."""
    cells = []
    for b, c in DECODE_CASES:
        d, ref = _decode_rec(parts, name, b, c), _decode_rec(parts, limits, b, c)
        cells.append("–" if d is None else f"{d['ms_per_step']:.3f} ({d['ms_per_step'] / ref['limit_ms']:.2f}x)")
    return cells


def decoders_decode_rows() -> dict[str, list[str]]:
    parts = _load(DECODERS_RUN)["parts"]
    return {label: _decode_cells(parts, name) for label, name in DECODE_ROWS.items()}


def _prefill_cells(parts, name, base=None) -> list[str]:
    """A prefill table row: ms at 2k and 16k and, with ``base``, in brackets its time over this one's."""
    cells = []
    for tokens in (2048, 16384):
        p = next((x for x in parts[name]["prefill"] if x["tokens"] == tokens), None)
        q = base and next((x for x in parts[base]["prefill"] if x["tokens"] == tokens), None)
        cells.append("–" if p is None else f"{p['ms']:.1f}" + (f" ({q['ms'] / p['ms']:.2f}x)" if q else ""))
    return cells


def decoders_prefill_rows() -> dict[str, list[str]]:
    parts = _load(DECODERS_RUN)["parts"]
    return {label: _prefill_cells(parts, name, base) for label, (name, base) in PREFILL_ROWS.items()}


def decoders_claims() -> dict[str, str]:
    run = _load(DECODERS_RUN)
    parts = run["parts"]
    meas = [_decode_rec(parts, "paged-gemm", b, c)["ms_per_step"] / _decode_rec(parts, "paged-gemm-measure", b, c)["ms_per_step"]
            for b, c in DECODE_CASES]
    best = _decode_rec(parts, "paged-gemm-measure", 1, 2048)
    gemms = _load(DECODERS_GEMMS_RUN)["parts"]
    vs, rates = [], []
    for name in ("paged-gemm", "inplace-gemm"):
        for p in gemms[name]["prefill"]:
            for r in p["gemms"]["rows"]:
                if r.get("vs_torch"):
                    vs.append(r["vs_torch"])
                    rates.append(r["tflops"])
    table = _load(GEMM_TABLE_RUN)["modes"]["mqa"]["phases"]["decode"]["gemms"]
    rows = {r["gemm"]: r for r in table["rows"]}
    hf_b1 = {m: _decode_rec(parts, m, 1, 2048)["ms_per_step"] for m in ("hf-eager", "hf-compile")}
    hf_b8 = {m: _decode_rec(parts, m, 8, 2048)["ms_per_step"] for m in ("hf-eager", "hf-compile")}
    b8 = _decode_rec(parts, "paged-gemm-measure", 8, 2048)
    heur, graph = _decode_rec(parts, "paged-gemm", 1, 2048), _decode_rec(parts, "paged-gemm-graph", 1, 2048)
    gap_h = heur["ms_per_step"] - heur["kernel_ms_per_step"]
    gap_g = graph["ms_per_step"] - graph["kernel_ms_per_step"]
    graph_p = [_decode_rec(parts, "paged-gemm", b, c)["ms_per_step"] / _decode_rec(parts, "paged-gemm-graph", b, c)["ms_per_step"]
               for b, c in DECODE_CASES]
    graph_i = [_decode_rec(parts, "inplace-gemm", 1, c)["ms_per_step"] / _decode_rec(parts, "inplace-gemm-graph", 1, c)["ms_per_step"]
               for c in (2048, 16384)]
    logits = run["logits"].values()
    ig16 = _decode_rec(parts, "inplace-gemm-graph", 1, 16384)
    head = next(r for r in gemms["paged-gemm"]["prefill"][0]["gemms"]["rows"] if r["gemm"] == "lm_head")
    return {
        "weights": f"every weight the step multiplies by ({run['limits']['weight_bytes'] / 1e9:.2f} GB)",
        "transformers": f"transformers {parts['hf-eager']['transformers'].rsplit('.', 1)[0]}",
        "measure": f"decode steps {_range(meas)} faster than with the heuristic's first choice at batch 1 to 32",
        "graphs": f"CUDA graphs make a paged step {_range(graph_p)} faster and an in-place one {_range(graph_i)}",
        "logits": f"differ from it by up to {max(v['max_abs'] for v in logits):.2f} (logits up to "
                  f"{max(v['ref_max_abs'] for v in logits):.2f})",
        "kernels vs gaps": f"the measured algorithms take {1e3 * (heur['kernel_ms_per_step'] - best['kernel_ms_per_step']):.0f} µs "
                           f"off the kernels ({heur['kernel_ms_per_step']:.3f} to {best['kernel_ms_per_step']:.3f} ms per step); "
                           f"host time between steps is the other {1e3 * (best['ms_per_step'] - best['kernel_ms_per_step']):.0f} µs "
                           f"(back to back minus kernels), of which CUDA graphs remove {1e3 * (gap_h - gap_g):.0f} µs",
        "in-place 16k": f"{ig16['vs_limit']:.2f}x with CUDA graphs, its kernels {ig16['kernels_vs_limit']:.2f}x; dlight's GEMVs run at "
                        + _range([r["tbps"] for r in ig16["gemms"]["rows"]], 2, " TB/s"),
        "lm_head prefill": f"its `lm_head` at M = {head['M']} takes {head['us_per_call'] / 1e3:.1f} ms",
        "decode GEMMs": ", ".join(f"{g} {rows[g]['tbps']:.2f}" for g in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj", "lm_head"))
                        + f" TB/s ({_range([r['fraction_of_limit'] * 100 for r in rows.values()], 0, '%')} of 4.8 TB/s)",
        "decode GEMM share": f"{table['gemm_us_per_step']:,.1f} µs of the step's {table['kernel_us_per_step']:,.1f} µs of "
                             f"kernels against {table['limit_us_per_step']:,.1f} µs at 4.8 TB/s",
        "prefill GEMMs": f"every GEMM at {_range(vs)} `torch.matmul`'s TFLOP/s ({min(rates):.0f}–{max(rates):.0f} TFLOP/s)",
        "best batch 1": f"{best['ms_per_step']:.3f} ms/token at 2k context, {best['vs_limit']:.2f}x the bytes limit "
                        f"(its kernels alone {best['kernels_vs_limit']:.2f}x)",
        "vs hf": f"{hf_b1['hf-eager'] / best['ms_per_step']:.2f}x the speed of HF transformers' eager decode and "
                 f"{hf_b1['hf-compile'] / best['ms_per_step']:.2f}x that of its `torch.compile` (static cache) at batch 1, "
                 f"{hf_b8['hf-eager'] / b8['ms_per_step']:.2f}x and {hf_b8['hf-compile'] / b8['ms_per_step']:.2f}x at batch 8",
    }


def test_performance_decoder_tables():
    text = PERF.read_text()
    for label, cells in {**decoders_decode_rows(), **decoders_prefill_rows()}.items():
        assert _table_row(text, label) == cells, label


@pytest.mark.parametrize("name", sorted(decoders_claims()))
def test_decoders_claim(name):
    claim = decoders_claims()[name]
    where = {"measure": [GEMM_DOC, PERF], "decode GEMMs": [GEMM_DOC, PERF], "decode GEMM share": [GEMM_DOC, PERF],
             "weights": [PERF], "transformers": [PERF], "graphs": [PERF], "logits": [PERF], "kernels vs gaps": [PERF],
             "in-place 16k": [PERF], "lm_head prefill": [PERF],
             "prefill GEMMs": [GEMM_DOC, PERF, README], "best batch 1": [PERF, README], "vs hf": [PERF, README]}[name]
    for doc in where:
        assert claim in " ".join(doc.read_text().split()), f"{doc.name} lacks {name}: {claim!r}"

# the second decoders run (the default builds: batch_prefill, measured algorithms, CUDA graphs)

DECODERS_RUN2 = "2026-12-02-decoders.json"
DECODE_ROWS2 = {"paged, default build |": "paged-gemm", "paged, default build, CUDA graphs |": "paged-gemm-graph",
                "in-place, hopper provider, CUDA graphs |": "inplace-gemm-graph", "HF eager, same run |": "hf-eager",
                "HF `torch.compile`, same run |": "hf-compile"}


def decoders2_rows() -> dict[str, tuple[list[str], list[str]]]:
    """performance.md's two tables of the second run: label -> (decode cells, prefill cells)."""
    parts = _load(DECODERS_RUN2)["parts"]
    return {label: (_decode_cells(parts, name), _prefill_cells(parts, name)) for label, name in DECODE_ROWS2.items()}


def test_performance_second_decoder_run_tables():
    lines = [ln for ln in PERF.read_text().splitlines() if ln.startswith("| ")]
    for label, (dec, pre) in decoders2_rows().items():
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")[1:]] for ln in lines if ln.startswith("| " + label)]
        assert dec in rows and pre in rows, (label, rows)


def decoders2_claims() -> dict[str, str]:
    parts = _load(DECODERS_RUN2)["parts"]
    first = _load(DECODERS_RUN)["parts"]
    pre = {n: next(x for x in parts[n]["prefill"] if x["tokens"] == 2048)["ms"] for n in ("paged-gemm", "hf-eager", "hf-compile")}
    d = {(n, b): _decode_rec(parts, n, b, 2048) for n in ("paged-gemm", "paged-gemm-graph", "hf-compile") for b in (1, 8, 32)
         if _decode_rec(parts, n, b, 2048)}
    g1 = d[("paged-gemm-graph", 1)]
    ig16 = _decode_rec(parts, "inplace-gemm-graph", 1, 16384)
    tb = [r["tbps"] for r in d[("paged-gemm", 1)]["gemms"]["rows"]]
    vs = [r["vs_torch"] for n in ("paged-gemm", "paged-gemm-graph", "inplace-gemm-graph") for p in parts[n]["prefill"]
          for r in p["gemms"]["rows"] if r.get("vs_torch")]
    first_pre = next(x for x in first["paged-gemm"]["prefill"] if x["tokens"] == 2048)["ms"]
    return {
        "prefill": f"paged prefill of 2k tokens takes {pre['paged-gemm']:.1f} ms ({first_pre:.1f} in the first run), "
                   f"{pre['hf-compile'] / pre['paged-gemm']:.2f}x faster than HF's `torch.compile` and "
                   f"{pre['hf-eager'] / pre['paged-gemm']:.2f}x faster than its eager forward in the same run",
        "decode vs compile": f"its decode at batch 1 is {d[('hf-compile', 1)]['ms_per_step'] / d[('paged-gemm', 1)]['ms_per_step']:.2f}x "
                             f"the speed of `torch.compile`'s and {d[('hf-compile', 8)]['ms_per_step'] / d[('paged-gemm', 8)]['ms_per_step']:.2f}x at batch 8",
        "graphs": f"With CUDA graphs the paged decoder reaches {d[('paged-gemm-graph', 32)]['vs_limit']:.2f}x the bytes limit at "
                  f"batch 32 and {d[('paged-gemm-graph', 8)]['vs_limit']:.2f}x at batch 8; at batch 1 it stays at "
                  f"{g1['vs_limit']:.2f}x (its kernels alone {g1['kernels_vs_limit']:.2f}x), the in-place decoder at 16k at "
                  f"{ig16['vs_limit']:.2f}x (its kernels {ig16['kernels_vs_limit']:.2f}x)",
        "gemv rates": f"the measured algorithms raise to {_range(tb, 2, ' TB/s')} at batch 1",
        "hf eager": f"eager decode at batch 1 took {_decode_rec(parts, 'hf-eager', 1, 2048)['ms_per_step']:.2f} ms/step here, "
                    f"{_decode_rec(first, 'hf-eager', 1, 2048)['ms_per_step']:.2f} in the first run",
        "prefill GEMMs": f"Every prefill GEMM of this run is at {_range(vs)} `torch.matmul`'s TFLOP/s",
    }


@pytest.mark.parametrize("name", sorted(decoders2_claims()))
def test_second_decoders_run_claim(name):
    claim = decoders2_claims()[name]
    for doc in [PERF, README] if name == "prefill" else [PERF]:
        assert claim in " ".join(doc.read_text().split()), f"{doc.name} lacks {name}: {claim!r}"


# the third decoders run (decode only): the cuBLASLt choice before and now, batch-1 GEMMs on dlight or cuBLASLt

DECODERS_RUN3 = "2026-12-03-decoders-gemm-measure.json"
DECODE_ROWS3 = {"paged, cuBLASLt choice before |": "paged-before", "paged, cuBLASLt choice now |": "paged",
                "paged, choice now, CUDA graphs |": "paged-graph",
                "in-place, static M = 1 on dlight's GEMV |": "inplace-dlight",
                "in-place, static M = 1 on cuBLASLt |": "inplace-cublaslt"}


def test_performance_third_decoder_run_table():
    parts, text = _load(DECODERS_RUN3)["parts"], PERF.read_text()
    for label, name in DECODE_ROWS3.items():
        assert _table_row(text, label) == _decode_cells(parts, name, limits="paged"), label


def _gemm_us(parts, name, batch=1, context=2048) -> dict[str, float]:
    """µs per call of each GEMM of a decode case (the part's GEMM table)."""
    return {r["gemm"]: r["us_per_call"] for r in _decode_rec(parts, name, batch, context)["gemms"]["rows"]}


def decoders3_claims() -> dict[str, str]:
    parts = _load(DECODERS_RUN3)["parts"]
    now, graph = (_decode_rec(parts, n, 1, 2048) for n in ("paged", "paged-graph"))
    ratios = [_decode_rec(parts, "paged-before", b, c)["ms_per_step"] / _decode_rec(parts, "paged", b, c)["ms_per_step"]
              for b, c in DECODE_CASES]
    inplace = [_decode_rec(parts, "inplace-dlight", 1, c)["ms_per_step"] / _decode_rec(parts, "inplace-cublaslt", 1, c)["ms_per_step"]
               for c in (2048, 16384)]
    host, host_graph = ((d["ms_per_step"] - d["kernel_ms_per_step"]) * 1e3 for d in (now, graph))
    us = {"before": _gemm_us(parts, "paged-before"), "now": _gemm_us(parts, "paged")}
    return {
        "choice": f"The new choice makes a paged decode step {_range(ratios)} faster than the choice before in the same run; at "
                  f"batch 1 and 2k context its kernels take {now['kernels_vs_limit']:.2f}x the bytes limit, the step itself "
                  f"{now['vs_limit']:.2f}x (host time between steps, ~{host:.0f} µs, is the rest; CUDA graphs took "
                  f"{host - host_graph:.0f} µs of it here)",
        "gemms": f"qkv_proj {us['now']['qkv_proj']:.1f} vs {us['before']['qkv_proj']:.1f} µs, gate_up_proj {us['now']['gate_up_proj']:.1f} vs "
                 f"{us['before']['gate_up_proj']:.1f} µs",
        "inplace": f"The in-place decoder's step is {_range(inplace)} faster with its batch-1 GEMMs on cuBLASLt, at 16k "
                   f"{_decode_rec(parts, 'inplace-cublaslt', 1, 16384)['vs_limit']:.2f}x the bytes limit",
    }


def gemm_doc_claims() -> dict[str, str]:
    """docs/gemm.md's figures of the third decoders run: the dispatch rule and the algorithm choice."""
    parts = _load(DECODERS_RUN3)["parts"]

    lt, dl = _gemm_us(parts, "inplace-cublaslt"), _gemm_us(parts, "inplace-dlight")
    names = (("qkv_proj", "qkv"), ("o_proj", "o_proj"), ("gate_up_proj", "gate_up"), ("down_proj", "down"),
             ("lm_head", "lm_head"))
    pairs = ", ".join(f"{label} {lt[g]:.1f} vs {dl[g]:.1f}" + (" µs" if i == 0 else "") for i, (g, label) in enumerate(names))
    step = {n: {c: _decode_rec(parts, n, 1, c)["ms_per_step"] for c in (2048, 16384)} for n in ("inplace-cublaslt", "inplace-dlight")}
    saved = [1 - _decode_rec(parts, "paged", b, c)["ms_per_step"] / _decode_rec(parts, "paged-before", b, c)["ms_per_step"]
             for b, c in DECODE_CASES]
    gate_up = {n: _gemm_us(parts, n)["gate_up_proj"] for n in ("paged", "paged-graph", "inplace-cublaslt")}
    warm = _load("2026-12-03-decoders-gemm-unsplit-warm.json")["parts"]
    rows = {n: next(r for r in _decode_rec(warm, n, 1, 2048)["gemms"]["rows"] if r["gemm"] == "gate_up_proj")
            for n in ("paged-before", "paged-unsplit-warm")}
    assert rows["paged-before"]["kernels"] == rows["paged-unsplit-warm"]["kernels"]
    return {
        "back to back": f"kept the kernel of the choice before (`{rows['paged-before']['kernels'][0]}`, "
                        f"{rows['paged-unsplit-warm']['us_per_call']:.1f} µs a call against "
                        f"{rows['paged-before']['us_per_call']:.1f}, `2026-12-03-decoders-gemm-unsplit-warm.md`); timed "
                        f"from a cold L2 it takes a faster one ({gate_up['paged']:.1f} µs in",
        "dispatch": f"kernel time per call at M = 1 {pairs}, and a decode step at 2k context "
                    f"{step['inplace-cublaslt'][2048]:.3f} vs {step['inplace-dlight'][2048]:.3f} ms (at 16k "
                    f"{step['inplace-cublaslt'][16384]:.3f} vs {step['inplace-dlight'][16384]:.3f})",
        "choice": f"The split-count-1 forms and the cold L2 then took another {_range([100 * x for x in saved], 1, '%')} off a decode step",
        "spread": f"took {gate_up['paged']:.1f} µs per call in the paged build, {gate_up['paged-graph']:.1f} in its CUDA graph "
                  f"build and {gate_up['inplace-cublaslt']:.1f} in the in-place one",
    }


RUN3_DOCS = {"performance.md": (PERF, decoders3_claims), "gemm.md": (GEMM_DOC, gemm_doc_claims)}


@pytest.mark.parametrize("doc,name", [(d, n) for d, (_, claims) in RUN3_DOCS.items() for n in sorted(claims())])
def test_third_decoders_run_claim(doc, name):
    path, claims = RUN3_DOCS[doc]
    claim = claims()[name]
    assert claim in " ".join(path.read_text().split()), f"{doc} lacks {name}: {claim!r}"


# docs/paged_kv_cache.md: our paged attention against FlashInfer (benchmarks/paged_attention.py kernels)

PAGED_FLASHINFER = "2026-12-01-paged-attention-flashinfer.json"
PAGED_DOC = ROOT / "docs" / "paged_kv_cache.md"
_FI_SHAPES = (("gqa64_8_d128", "GQA 64/8/128"), ("gqa32_8_d128", "GQA 32/8/128"), ("mqa71_1_d64", "MQA 71/1/64"))
_FI_BATCHES = (1, 8, 32, 64)


def _fi_fastest(case, prefix="flashinfer"):
    """FlashInfer's fastest variant whose output passed the fp32 check (None: none did)."""
    times = [t for k, t in case["us"].items() if k.startswith(prefix) and case["ok"].get(k, True)]
    return min(times) if times else None


def _fi_case(cases, kind, shape, batch, dtype="float16", lengths="mixed"):
    return next(c for c in cases if (c["kind"], c["shape"], c["batch"], c["dtype"], c["lengths_kind"])
                == (kind, shape, batch, dtype, lengths))


def flashinfer_table_rows() -> dict[str, list[str]]:
    cases = _load(PAGED_FLASHINFER)["cases"]
    rows = {}
    for shape, label in _FI_SHAPES:
        dec = [_fi_case(cases, "decode", shape, b) for b in _FI_BATCHES]
        rows[f"decode µs, ours, {label}"] = [_num(c["us"]["ours"]) for c in dec]
        rows[f"decode µs, FlashInfer fastest, {label}"] = [_num(_fi_fastest(c)) for c in dec]
    for shape, label in _FI_SHAPES:
        rag = [_fi_case(cases, "ragged_prefill", shape, b) for b in _FI_BATCHES]
        rows[f"ragged prefill TFLOP/s, ours, {label}"] = [f"{c['tflops']['ours']:.0f}" for c in rag]
        rows[f"ragged prefill TFLOP/s, FlashInfer fa2, {label}"] = [
            f"{c['tflops']['flashinfer_fa2']:.0f}" if c["ok"]["flashinfer_fa2"] else "NaN ✗" for c in rag]
    return rows


def flashinfer_claims() -> dict[str, str]:
    cases = _load(PAGED_FLASHINFER)["cases"]
    dec = [c for c in cases if c["kind"] == "decode"]
    gqa = [c for c in dec if c["shape"].startswith("gqa")]
    not_slower = sum(c["us"]["ours"] / _fi_fastest(c) <= 1.0 for c in gqa)
    ratios = [c["us"]["ours"] / _fi_fastest(c) for c in gqa]
    at16k = [c for c in gqa if all(n == 16384 for n in c["lengths"])]
    bytes_b1 = [c["us"]["ours"] / c["bytes_us"] for c in at16k if c["batch"] == 1]
    bytes_many = [c["us"]["ours"] / c["bytes_us"] for c in at16k if c["batch"] > 1]
    mqa = [c["us"]["ours"] / _fi_fastest(c) for c in dec if c["shape"].startswith("mqa")]
    rag = [c for c in cases if c["kind"] == "ragged_prefill" and c["ok"]["flashinfer_fa2"]]
    rag_ratio = [c["tflops"]["ours"] / c["tflops"]["flashinfer_fa2"] for c in rag]
    bad = [c for c in cases if c["kind"] == "ragged_prefill" and not c["ok"]["flashinfer_fa2"]]
    paged = [c for c in cases if c["kind"] == "paged_prefill"]
    paged_ratio = [c["us"]["ours"] / _fi_fastest(c) for c in paged]
    assert all(v for c in cases for k, v in c["ok"].items() if k.startswith("ours"))
    return {
        "decode gqa": f"GQA decode: ours is no slower than FlashInfer's fastest variant in {not_slower} of {len(gqa)} "
                      f"cases ({min(ratios):.2f}–{max(ratios):.2f}x its time)",
        "decode bytes": f"{min(bytes_many):.2f}–{max(bytes_many):.2f}x the bytes limit at batch 8 to 64, "
                        f"{min(bytes_b1):.2f}–{max(bytes_b1):.2f}x at batch 1",
        "decode mqa": f"MQA 71/1/64 decode: ours takes {min(mqa):.2f}–{max(mqa):.2f}x FlashInfer's time",
        "ragged": f"ours runs {min(rag_ratio):.2f}–{max(rag_ratio):.2f}x FlashInfer's FA2 TFLOP/s "
                  f"({sum(r >= 1.0 for r in rag_ratio)} of {len(rag)} cases at least as fast)",
        "ragged nan": f"FlashInfer's output is NaN in {len(bad)} cases",
        "paged prefill": f"as TVM runs it): ours takes {min(paged_ratio):.2f}–{max(paged_ratio):.2f}x FlashInfer's time",
    }


def test_paged_doc_flashinfer_table():
    text = PAGED_DOC.read_text()
    for label, cells in flashinfer_table_rows().items():
        assert _table_row(text, label) == cells, label


@pytest.mark.parametrize("name", sorted(flashinfer_claims()))
def test_paged_doc_flashinfer_claim(name):
    _assert_in_paged_doc(flashinfer_claims(), name)


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


# docs/paged_kv_cache.md: the hopper provider's ragged prefill on FA4 (one run with FlashInfer) and the decoder

PAGED_FA4 = "2026-12-02-paged-ragged-fa4.json"
DECODERS_PAGED_HOPPER = "2026-12-02-decoders-paged-hopper.json"


def fa4_ragged_table_rows() -> dict[str, list[str]]:
    cases = _load(PAGED_FA4)["cases"]
    rows = {}
    for shape, label in _FI_SHAPES:
        rag = [_fi_case(cases, "ragged_prefill", shape, b) for b in _FI_BATCHES]
        rows[f"ragged prefill, FA4 (hopper), {label}"] = [f"{c['tflops']['ours_fa4']:.0f}" for c in rag]
        rows[f"ragged prefill, FA2 (native), {label}"] = [f"{c['tflops']['ours']:.0f}" for c in rag]
        rows[f"ragged prefill, FlashInfer fa2, {label}"] = [
            f"{c['tflops']['flashinfer_fa2']:.0f}" if c["ok"]["flashinfer_fa2"] else "NaN ✗" for c in rag]
    return rows


def fa4_ragged_claims() -> dict[str, str]:
    cases = _load(PAGED_FA4)["cases"]
    assert all(c["ok"]["ours"] and c["ok"]["ours_fa4"] for c in cases)
    ok = [c for c in cases if c["ok"]["flashinfer_fa2"]]
    r4 = [c["tflops"]["ours_fa4"] / c["tflops"]["flashinfer_fa2"] for c in ok]
    r2 = [c["tflops"]["ours"] / c["tflops"]["flashinfer_fa2"] for c in ok]
    f42 = [c["tflops"]["ours_fa4"] / c["tflops"]["ours"] for c in cases]
    parts = _load(DECODERS_PAGED_HOPPER)["parts"]
    pre = {n: {p["tokens"]: p["ms"] for p in parts[n]["prefill"]} for n in ("paged-native", "paged-hopper")}
    h, n = pre["paged-hopper"], pre["paged-native"]
    return {
        "fa4 vs flashinfer": f"FA4 runs the ragged prefill at {min(r4):.2f}–{max(r4):.2f}x FlashInfer's FA2 TFLOP/s "
                             f"({sum(r >= 1 for r in r4)} of {len(ok)} cases at least as fast) and "
                             f"{min(f42):.2f}–{max(f42):.2f}x our FA2 entry's",
        "lse": f"its LSE matches FA2's within {max(c['lse_max_diff_fa4'] for c in cases):.1e}",
        "fa2 vs flashinfer": f"In this run our FA2 entry ran {min(r2):.2f}–{max(r2):.2f}x FlashInfer's rate",
        "decoder": f"a 16k prompt's prefill takes {h[16384]:.1f} ms with the hopper provider against {n[16384]:.1f} ms "
                   f"with the native one ({n[16384] / h[16384]:.2f}x), a 2k prompt's {h[2048]:.2f} against "
                   f"{n[2048]:.2f} ms",
    }


def test_paged_doc_fa4_ragged_table():
    text = PAGED_DOC.read_text()
    for label, cells in fa4_ragged_table_rows().items():
        assert _table_row(text, label) == cells, label


@pytest.mark.parametrize("name", sorted(fa4_ragged_claims()))
def test_paged_doc_fa4_ragged_claim(name):
    _assert_in_paged_doc(fa4_ragged_claims(), name)


PAGED_READBACK = "2026-12-02-paged-prefill-readback.json"


def readback_claims() -> dict[str, str]:
    cases = _load(PAGED_READBACK)["cases"]
    assert all(v for c in cases for k, v in c["ok"].items() if k.startswith("ours"))
    rag = [c for c in cases if c["kind"] == "ragged_prefill" and c["ok"]["flashinfer_fa2"]]
    r = [c["tflops"]["ours"] / c["tflops"]["flashinfer_fa2"] for c in rag]
    paged = [c for c in cases if c["kind"] == "paged_prefill"]
    q = [c["us"]["ours"] / _fi_fastest(c) for c in paged]
    return {
        "ragged": f"the ragged prefill ran {min(r):.2f}–{max(r):.2f}x FlashInfer's FA2 TFLOP/s "
                  f"({sum(x >= 1 for x in r)} of {len(rag)} cases at least as fast)",
        "paged": f"the paged prefill took {min(q):.2f}–{max(q):.2f}x its time ({sum(x <= 1 for x in q)} of {len(paged)} "
                 "no slower)",
    }


@pytest.mark.parametrize("name", sorted(readback_claims()))
def test_paged_doc_readback_claim(name):
    _assert_in_paged_doc(readback_claims(), name)


PAGED_DECODE_FI = "2026-12-02-paged-decode-flashinfer.json"
DECODE_BUILDS = "2026-12-02-decode-builds.json"
DECODE_BUILDS_SLACK = "2026-12-02-decode-builds-slack.json"


def decode_rerun_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on the decode kernel after its instruction cuts: the run of the two builds
    and the decode-only run with FlashInfer."""
    builds = _load(DECODE_BUILDS)
    q = {s: [r["us"]["new"] / r["us"]["base"] for r in builds if r["shape"] == s] for s in ("71/1/64", "64/8/128", "32/8/128")}
    cases = _load(PAGED_DECODE_FI)["cases"]
    assert all(v for c in cases for k, v in c["ok"].items() if k.startswith("ours"))
    gqa = [c for c in cases if c["shape"].startswith("gqa")]
    r = [c["us"]["ours"] / _fi_fastest(c) for c in gqa]
    mqa = [c["us"]["ours"] / _fi_fastest(c) for c in cases if c["shape"].startswith("mqa")]
    at16k = [c["us"]["ours"] / c["bytes_us"] for c in gqa if all(n == 16384 for n in c["lengths"]) and c["batch"] > 1]
    gqa_q = q["64/8/128"] + q["32/8/128"]
    slack = _load(DECODE_BUILDS_SLACK)
    qs = {s: [r["us"]["after"] / r["us"]["before"] for r in slack if r["shape"] == s] for s in q}
    gqa_s = qs["64/8/128"] + qs["32/8/128"]
    return {
        "slack": f"{min(qs['71/1/64']):.2f}–{max(qs['71/1/64']):.2f}x for MQA and {min(gqa_s):.2f}–{max(gqa_s):.2f}x "
                 "for GQA in a second run of both builds",
        "builds": f"took {min(q['71/1/64']):.2f}–{max(q['71/1/64']):.2f}x the time of the kernel before for MQA "
                  f"71/1/64 and {min(gqa_q):.2f}–{max(gqa_q):.2f}x for GQA",
        "gqa": f"GQA decode ran {min(r):.2f}–{max(r):.2f}x FlashInfer's fastest variant ({sum(x <= 1 for x in r)} of "
               f"{len(r)} cases no slower)",
        "bytes": f"{min(at16k):.2f}–{max(at16k):.2f}x the bytes limit with every sequence at 16k (batch 8 to 64)",
        "mqa": f"MQA 71/1/64 {min(mqa):.2f}–{max(mqa):.2f}x",
    }


@pytest.mark.parametrize("name", sorted(decode_rerun_claims()))
def test_paged_doc_decode_rerun_claim(name):
    _assert_in_paged_doc(decode_rerun_claims(), name)


PAGED_DECODE_FI_SHARED = "2026-12-02-paged-decode-flashinfer-shared.json"
DECODE_BUILDS_LOADS = "2026-12-02-decode-builds-loads.json"
DECODE_SHARED = "2026-12-02-decode-shared-tiles.json"


def decode_shared_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on the decode kernel's load cuts and SharedTiles: the two runs of builds and
    the decode-only run with FlashInfer on the result."""
    def ratios(name, new, old):
        rows = _load(name)
        q = {s: [r["us"][new] / r["us"][old] for r in rows if r["shape"] == s] for s in ("71/1/64", "64/8/128", "32/8/128")}
        gqa = q["64/8/128"] + q["32/8/128"]
        return f"{min(q['71/1/64']):.2f}–{max(q['71/1/64']):.2f}x", f"{min(gqa):.2f}–{max(gqa):.2f}x"
    loads, shared = ratios(DECODE_BUILDS_LOADS, "after", "before"), ratios(DECODE_SHARED, "after", "before")
    big = [r["us"]["after"] / r["us"]["before"] for r in _load(DECODE_SHARED) if r["shape"] == "71/1/64" and r["batch"] >= 32]
    cases = _load(PAGED_DECODE_FI_SHARED)["cases"]
    assert all(v for c in cases for k, v in c["ok"].items() if k.startswith("ours"))
    mqa = {b: [c["us"]["ours"] / _fi_fastest(c) for c in cases if c["shape"].startswith("mqa") and c["batch"] == b]
           for b in (1, 8, 32, 64)}
    mqa16k = [c["us"]["ours"] / _fi_fastest(c) for c in cases if c["shape"].startswith("mqa") and c["batch"] >= 32
              and all(n == 16384 for n in c["lengths"])]
    gqa = [c["us"]["ours"] / _fi_fastest(c) for c in cases if c["shape"].startswith("gqa")]
    every = [c["us"]["ours"] / _fi_fastest(c) for c in cases]
    gqa_slow = [c["us"]["ours"] / _fi_fastest(c) for c in cases if c["shape"].startswith("gqa") and (
        c["batch"] == 8 or (c["batch"] >= 32 and all(n == 16384 for n in c["lengths"])))]
    return {
        "gqa_slow": f"GQA at batch 8 and with every sequence at 16k ({min(gqa_slow):.2f}–{max(gqa_slow):.2f}x)",
        "loads": f"{loads[0]} the time of the kernel before for MQA 71/1/64 and {loads[1]} for GQA",
        "shared": f"both together {shared[0]} for MQA ({min(big):.2f}–{max(big):.2f}x at 32 and 64 sequences) and "
                  f"{shared[1]} for GQA",
        "mqa": f"MQA 71/1/64 ran {min(mqa[1]):.2f}x FlashInfer's fastest variant at batch 1, "
               f"{min(mqa[8]):.2f}–{max(mqa[8]):.2f}x at 8, {min(mqa[32] + mqa[64]):.2f}–{max(mqa[32] + mqa[64]):.2f}x at "
               f"32 and 64 ({min(mqa16k):.2f}–{max(mqa16k):.2f}x there with every sequence at 16k)",
        "gqa": f"GQA {min(gqa):.2f}–{max(gqa):.2f}x",
        "all": f"{sum(x <= 1 for x in every)} of {len(every)} cases no slower",
    }


def test_paged_doc_shared_tiles_instructions():
    runs = _load("2026-12-02-decode-shared-tiles-ncu.json")["runs"]
    classic, shared = (runs[k]["smsp__inst_executed_sum"] for k in ("classic (gqa_decode.cu of 7c0c1dc)",
                                                                     "SharedTiles (first version)"))
    text = " ".join(PAGED_DOC.read_text().split())
    assert f"{round(100 * (1 - shared / classic))}% fewer instructions than the classic blocks" in text


def test_performance_doc_shared_tiles_claim():
    big = [r["us"]["after"] / r["us"]["before"] for r in _load(DECODE_SHARED) if r["shape"] == "71/1/64" and r["batch"] >= 32]
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    assert f"in {min(big):.2f}–{max(big):.2f}x the time of the classic blocks" in text


@pytest.mark.parametrize("name", sorted(decode_shared_claims()))
def test_paged_doc_decode_shared_claim(name):
    _assert_in_paged_doc(decode_shared_claims(), name)


DECODE_BUILDS_PACKED = "2026-12-03-decode-builds-packed.json"
DECODE_BUILDS_STEP = "2026-12-03-decode-builds-step.json"


def decode_packed_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on SharedTiles' packed splits and its 32-key step: the runs of the two builds
    each, and the MQA cases of the latest beside the decode-only FlashInfer run (the same cases and
    lengths, another run)."""
    rows = _load(DECODE_BUILDS_PACKED)
    assert all(r["max_diff"] < 1e-3 for r in rows)

    def q(r):
        return r["us"]["after"] / r["us"]["before"]

    big = [r for r in rows if r["shape"] == "71/1/64" and r["batch"] >= 32]
    mixed = [q(r) for r in big if r["kind"] == "mixed"]
    uniform = [q(r) for r in big if r["kind"] == "uniform16k"]
    rest = [q(r) for r in rows if r not in big]
    fi = {(c["batch"], c["lengths_kind"]): _fi_fastest(c) for c in _load(PAGED_DECODE_FI_SHARED)["cases"]
          if c["shape"] == "mqa71_1_d64" and c["dtype"] == "float16"}
    step = _load(DECODE_BUILDS_STEP)
    assert all(r["max_diff"] < 1e-3 for r in step)
    step_big = [q(r) for r in step if r["shape"] == "71/1/64" and r["batch"] >= 32]
    step_rest = [q(r) for r in step if not (r["shape"] == "71/1/64" and r["batch"] >= 32)]
    ours = {(r["batch"], r["kind"]): r["us"]["after"] for r in step
            if r["shape"] == "71/1/64" and r["batch"] >= 32 and r["page"] == 256}
    return {
        "mixed": f"{_range(mixed)} the time of the per-sequence splits",
        "uniform": f"with every sequence at 16k {_range(uniform)}",
        "rest": f"the other cases {_range(rest)}",
        "step": f"MQA 71/1/64 at 32 and 64 sequences {_range(step_big)}, the other cases {_range(step_rest)}",
        "fi": "; ".join(f"{b} sequences, {k}: {ours[(b, k)]:.1f} µs against FlashInfer's {fi[(b, k)]:.1f}"
                        for b in (32, 64) for k in ("mixed", "uniform16k")),
    }


@pytest.mark.parametrize("name", sorted(decode_packed_claims()))
def test_paged_doc_decode_packed_claim(name):
    _assert_in_paged_doc(decode_packed_claims(), name)


DECODE_SHARED_FEW = "2026-12-03-decode-shared-tiles-few.json"


def decode_shared_few_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on where the rule takes SharedTiles: SharedTiles asked for against the
    classic blocks at few sequences, 71/1/64 (5 warps a CTA) and 40/2/64 (2)."""
    rows = _load(DECODE_SHARED_FEW)
    assert all(r["max_diff"] < 1e-3 for r in rows)

    def q(shape, batches, kind=None):
        return [r["asked"] / r["classic"] for r in rows if r["shape"] == shape and r["batch"] in batches
                and (kind is None or r["lengths"] == kind)]
    return {
        "rule_71": f"71/1/64 at 12-16 sequences {_range(q('71/1/64', range(12, 17)))}",
        "ten_71": f"at 10 sequences {_range(q('71/1/64', (10,), 'mixed'))} with mixed lengths",
        "eight_71": f"at 8 {_range(q('71/1/64', (8,), 'mixed'))} and {_range(q('71/1/64', (8,), 'uniform16k'))}",
        "few_40": f"took {_range(q('40/2/64', range(6, 17), 'mixed'))} the classic blocks' time with mixed lengths "
                  "at 6-16 sequences",
        "many_40": f"and {_range(q('40/2/64', range(24, 65)))} at 24-64",
    }


@pytest.mark.parametrize("name", sorted(decode_shared_few_claims()))
def test_paged_doc_decode_shared_few_claim(name):
    _assert_in_paged_doc(decode_shared_few_claims(), name)


DECODE_KEY_GROUPS = "2026-12-04-decode-shared-tiles-key-groups.json"
DECODE_KEY_GROUPS_71 = "2026-12-04-decode-shared-tiles-key-groups-71.json"
DECODE_BUILDS_KEY_GROUPS = "2026-12-04-decode-builds-key-groups.json"


def decode_key_groups_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on SharedTiles' two key groups: one group against two on the same grid
    (40/2/64, and Falcon's 71/1/64 from 10 sequences), and the builds before and after the rule."""
    kg = _load(DECODE_KEY_GROUPS)
    kg71 = _load(DECODE_KEY_GROUPS_71)
    assert all(r["max_diff"] < 1e-3 for r in kg + kg71)
    builds = _load(DECODE_BUILDS_KEY_GROUPS)
    assert all(r["max_diff"] < 1e-3 for r in builds)

    def q(r):
        return r["us"]["after"] / r["us"]["before"]

    eight = {r["kind"]: q(r) for r in builds if r["shape"] == "40/2/64" and r["batch"] == 8 and r["page"] == 256}
    return {
        "k2_40": f"two key groups took {_range([r['asked_k2'] / r['asked'] for r in kg])} the time of one",
        "k2_71": f"took {_range([r['asked_k2'] / r['asked'] for r in kg71 if r['batch'] >= 10])} the time of one "
                 "from 10 sequences on",
        "builds_40": "40/2/64 at 32 and 64 sequences "
                     f"{_range([q(r) for r in builds if r['shape'] == '40/2/64' and r['batch'] >= 32])}",
        "eight_40": f"on pages of 256 {_range([eight['uniform16k']])} ({_range([eight['mixed']])} with mixed lengths)",
        "others": f"other shapes (71/1/64, 64/8/128) {_range([q(r) for r in builds if r['shape'] != '40/2/64'])}",
    }


@pytest.mark.parametrize("name", sorted(decode_key_groups_claims()))
def test_paged_doc_decode_key_groups_claim(name):
    _assert_in_paged_doc(decode_key_groups_claims(), name)


DECODE_GRID = "2026-12-04-decode-grid.json"
DECODE_BUILDS_GRID = "2026-12-04-decode-builds-grid.json"
DECODERS_GRID = "2026-12-04-decoders-decode-grid.json"


def decode_grid_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on the decode kernel's grid on pages: the plan against the same split in the
    grid before (the longest sequence the pages could hold) and in a grid of one typical sequence, the
    builds before and after, and the whole paged decoder's decode kernels and steps."""
    rows = [r for r in _load(DECODE_GRID) if r["batch"] >= 4]
    assert all(r["max_diff"] < 1e-3 and r["rule_err"] < 1e-3 for r in rows)

    def same(r, **match):
        ru = r["rule"]
        v = [v["us"] for v in r["variants"] if v["kps"] == ru["kps"] and v["warps"] == ru["warps"]
             and v["merge"] == "auto" and all(v[k] == x for k, x in match.items())]
        assert len(v) == 1, (r["batch"], r["keys"], match)
        return v[0]

    def vs_before(r):
        return r["rule"]["us"] / same(r, grid="longest")

    def one_vs_rule(r):
        return same(r, splits=-(-r["typical"] // r["rule"]["kps"])) / r["rule"]["us"]

    alike = [r for r in rows if r["keys"] != "mixed"]
    mixed = [r for r in rows if r["keys"] == "mixed"]
    b32_2k = next(r for r in alike if (r["batch"], r["keys"]) == (32, "2048"))
    builds = _load(DECODE_BUILDS_GRID)
    assert all(r["max_diff"] < 1e-3 for r in builds)

    def q(r):
        return r["us"]["after"] / r["us"]["before"]

    falcon8 = next(r for r in builds if (r["shape"], r["page"], r["batch"], r["kind"]) == ("71/1/64", 256, 8, "mixed"))
    dec = _load(DECODERS_GRID)["parts"]

    def attention_us(name, batch):
        rec = next(r for r in dec[name]["decode"] if r["batch"] == batch)
        return [k["us_per_step"] for k in rec["top_kernels"] if "gqa_decode" in k["name"]][0]

    def gap_us(name):
        rec = next(r for r in dec[name]["decode"] if r["batch"] == 32)
        return (rec["ms_per_step"] - rec["kernel_ms_per_step"]) * 1e3

    steps = [dec[a]["decode"][i]["ms_per_step"] / dec[b]["decode"][i]["ms_per_step"]
             for a, b in (("paged-grid", "paged-grid-before"), ("paged-grid-2", "paged-grid-before-2"))
             for i in range(len(dec[a]["decode"]))]
    now = [attention_us(n, b) for n in ("paged-grid", "paged-grid-2") for b in (32, 8)]
    before = [attention_us(n, b) for n in ("paged-grid-before", "paged-grid-before-2") for b in (32, 8)]
    assert max(now[0], now[2]) < min(before[0], before[2]) and max(now[1], now[3]) < min(before[1], before[3])
    return {
        "alike": f"the plan took {_range([vs_before(r) for r in alike])} the time of the same split in the grid "
                 f"before with every sequence alike ({_range([vs_before(b32_2k)])} at 32 sequences of 2k keys), "
                 f"{_range([vs_before(r) for r in mixed])} with mixed lengths",
        "one_typical": f"A grid of one typical sequence took {_range([one_vs_rule(r) for r in alike])} the plan's "
                       f"time with every sequence alike, but "
                       f"{_range([one_vs_rule(r) for r in mixed if r['batch'] in (4, 16)])} at 4 and 16 sequences",
        "builds": "64/8/128 and 32/8/128 "
                  f"{_range([q(r) for r in builds if r['shape'] != '71/1/64'])} the time of the build before, "
                  f"Falcon's 71/1/64 {_range([q(r) for r in builds if r['shape'] == '71/1/64'])} "
                  f"({_range([q(falcon8)])} at 8 sequences of mixed lengths: {falcon8['us']['after']:.1f} µs)",
        "decoder": f"the decode kernels took {round(now[0])} µs a step at batch 32 and {round(now[1])} µs at batch 8, "
                   f"against {round(before[0])} and {round(before[1])} µs before, but the steps took "
                   f"{_range(steps)} the time. At batch 32 the step time (CUDA events, a pass of its own) was "
                   f"{_range([gap_us('paged-grid-before'), gap_us('paged-grid-before-2')], 0, '')} µs above the "
                   f"kernels' sum (CUPTI, the next pass) before and "
                   f"{_range([gap_us('paged-grid'), gap_us('paged-grid-2')], 0, '')} µs above it now",
    }


@pytest.mark.parametrize("name", sorted(decode_grid_claims()))
def test_paged_doc_decode_grid_claim(name):
    _assert_in_paged_doc(decode_grid_claims(), name)


def test_performance_decode_grid_table():
    """docs/performance.md's table of the paged decoder before and after the decode kernel's grid on pages
    (the first pass of each build), and its sentence on the batch-32 and batch-8 decode kernels."""
    parts = _load(DECODERS_GRID)["parts"]
    text = PERF.read_text()
    for label, name in (("paged, the grid before", "paged-grid-before"), ("paged, the grid now", "paged-grid")):
        assert _table_row(text, label) == _decode_cells(parts, name, limits=name), label
    claims = decode_grid_claims()["decoder"]
    b32_now, b8_now, b32_before, b8_before = re.search(
        r"took (\d+) µs a step at batch 32 and (\d+) µs at batch 8, against (\d+) and (\d+) µs", claims).groups()
    assert (f"The decode kernels of a batch-32 step took {b32_now} µs instead of {b32_before}, of a batch-8 step "
            f"{b8_now} instead of {b8_before}") in " ".join(text.split())


# ---------------------------------------------------------------------------------------------
# ToMixedPrecision's default form with the cast fused (benchmarks/gemm.py, the cast pair)

def gemm_cast_claims() -> dict[str, str]:
    """docs/gemm.md's figures of the fused cast, from the GEMM benchmark's cast pair."""
    rows = _load("2026-12-04-gemm-cast.json")["rows"]
    speed = [r["ours_cast"]["speedup_vs_unfused"] for r in rows]
    return {
        "range": f"ran {min(speed):.2f}-{max(speed):.2f}x as fast as a float32-output",
        "count": f"faster in {sum(s > 1 for s in speed)} of {len(speed)} cases",
        "shapes": f"at M = {min(r['M'] for r in rows)} to {max(r['M'] for r in rows)}",
    }


@pytest.mark.parametrize("name", sorted(gemm_cast_claims()))
def test_gemm_doc_cast_claim(name):
    text = " ".join(GEMM_DOC.read_text().split())
    assert gemm_cast_claims()[name] in text, f"docs/gemm.md lacks {name}: {gemm_cast_claims()[name]!r}"


# ---------------------------------------------------------------------------------------------
# cuBLASLt's configurations against our measured choice (benchmarks/cublaslt_search.cu's log)

def cublaslt_search_claims() -> dict[str, str]:
    """docs/gemm.md's figures of the configuration search, parsed from its raw log."""
    log = (RESULTS / "2026-12-05-cublaslt-search.log").read_text()
    ours, wider, by_hand, counts = {}, {}, {}, set()
    for block in log.split("\n== ")[1:]:
        name = block.split()[0]
        ours[name] = float(re.search(r"our rule best of \d+: ([\d.]+)", block).group(1))
        wider[name] = float(re.search(r"heuristic64 x splits best of \d+: ([\d.]+)", block).group(1))
        n, t = re.search(r"enumerated \d+ configs \((\d+) ran\): best ([\d.]+)", block).groups()
        by_hand[name], _ = float(t), counts.add(int(n))
    assert len(ours) == 6 and len(counts) == 1, (ours, counts)
    worst = max(ours[k] / min(ours[k], wider[k], by_hand[k]) - 1 for k in ours)
    equal = [k for k in ours if ours[k] <= min(wider[k], by_hand[k])]
    return {
        "within": f"within {100 * worst:.1f}% of the fastest of all of them for every weight",
        "gate_up": f"gate_up_proj {ours['gate_up']:.1f} µs against {min(wider['gate_up'], by_hand['gate_up']):.1f}",
        "by hand": f"(the fastest of those {_range([by_hand[k] / ours[k] for k in ours])} its time)",
        "count": f"set by hand ({counts.pop():,} a weight)",
        "equal": str(len(equal)),
    }


@pytest.mark.parametrize("name", sorted(set(cublaslt_search_claims()) - {"equal"}))
def test_gemm_doc_cublaslt_search_claim(name):
    text = " ".join(GEMM_DOC.read_text().split())
    assert cublaslt_search_claims()[name] in text, f"docs/gemm.md lacks {name}: {cublaslt_search_claims()[name]!r}"


def test_cublaslt_search_every_other_weight_equal():
    """The doc names five weights (qkv_proj, o_proj, down_proj, lm_head; o_proj with and without the residual)
    where the choice was the fastest: the log must say so for all but gate_up."""
    assert cublaslt_search_claims()["equal"] == "5"


DECODE_PHASES = "2026-12-04-decode-phases.json"


def decode_phases_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on where a batch-1 decode call's time goes (benchmarks/decode_phases.py): the
    stream of its K/V against the steps around it, at 16k and at 1k keys."""
    rows = _load(DECODE_PHASES)
    assert all(r["max_diff"] == 0.0 for r in rows)  # the stamps change no output
    r16 = next(r for r in rows if (r["shape"], r["batch"], r["keys"]) == ("64/8/128", 1, 16384))
    r1 = next(r for r in rows if (r["shape"], r["batch"], r["keys"]) == ("64/8/128", 1, 1024))
    p = r16["phases"]
    mixed8 = next(r for r in _load("2026-12-04-decode-phases-mixed.json")
                  if (r["shape"], r["batch"], r["keys"]) == ("71/1/64", 8, "mixed"))
    around = ("sequence range", "prologue", "first tile", "CTA merge", "split merge")
    return {
        "batch1": f"at one sequence of 16k keys (64/8/128) a call took {r16['plain_us']:.1f} µs against "
                  f"{r16['bytes_us']:.1f} µs of K/V bytes at 4.8 TB/s. Its K/V stream, from the first CTA's first "
                  f"loads to the last CTA's last tile, took {p['stream_us']:.1f} µs ({r16['stream_tbps']:.2f} TB/s). "
                  f"Before it each CTA spent {p['sequence range']:.2f} µs reading the sequence's CSR entries, "
                  f"{p['prologue']:.2f} µs looking up its first page and issuing its first loads and "
                  f"{p['first tile']:.2f} µs until its first tile landed; after its last tile, "
                  f"{p['CTA merge']:.2f} µs merging its warps and {p['split merge']:.2f} µs merging the splits "
                  f"and writing the output. At 1k keys those steps took "
                  f"{sum(r1['phases'][s] for s in around):.1f} µs of a {r1['plain_us']:.1f} µs call",
        "mixed": f"at Falcon's 71/1/64, 8 sequences of 1k–16k keys, the CTAs' last tiles spread over "
                 f"{mixed8['phases']['loop_end_spread_us']:.1f} µs of a {mixed8['plain_us']:.1f} µs call",
    }


@pytest.mark.parametrize("name", sorted(decode_phases_claims()))
def test_paged_doc_decode_phases_claim(name):
    _assert_in_paged_doc(decode_phases_claims(), name)


PAGED_DECODE_FI_NOW = "2026-12-05-paged-decode-flashinfer.json"


def _span(xs) -> str:
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}–{hi}x"


def decode_flashinfer_now_claims() -> dict[str, str]:
    """docs/paged_kv_cache.md on the decode-only run of the current decode kernel beside FlashInfer."""
    cases = _load(PAGED_DECODE_FI_NOW)["cases"]
    assert all(v for c in cases for v in c["ok"].values())
    r = {id(c): c["us"]["ours"] / _fi_fastest(c) for c in cases}
    every = list(r.values())
    gqa = [r[id(c)] for c in cases if c["shape"].startswith("gqa")]
    gqa_slow = [x for x in gqa if x > 1]
    mqa = [c for c in cases if c["shape"].startswith("mqa")]
    mqa_slow = [c for c in mqa if r[id(c)] > 1]
    assert {(c["batch"], c["lengths_kind"]) for c in mqa_slow} == {(8, "mixed")}
    mqa_rest = [r[id(c)] for c in mqa if c not in mqa_slow]
    slow = _fi_case(cases, "decode", "mqa71_1_d64", 8)
    u16 = {k: [c["us"]["ours"] / c["bytes_us"] for c in cases if c["shape"].startswith(k)
               and c["batch"] >= 8 and c["lengths_kind"] == "uniform16k"] for k in ("gqa", "mqa")}
    b1 = [c["us"]["ours"] / c["bytes_us"] for c in cases if c["shape"].startswith("gqa") and c["batch"] == 1]
    return {
        "all": f"ours no slower than FlashInfer's fastest variant in {sum(x <= 1 for x in every)} of {len(every)} cases",
        "gqa": f"GQA {min(gqa):.2f}–{max(gqa):.2f}x its time (the {len(gqa_slow)} slower cases within "
               f"{max(gqa_slow):.2f}x)",
        "mqa": f"Falcon's MQA 71/1/64 {min(mqa_rest):.2f}–{max(mqa_rest):.2f}x, except at 8 sequences of mixed "
               f"lengths: {_span([r[id(c)] for c in mqa_slow])} ({slow['us']['ours']:.1f} µs against "
               f"{_fi_fastest(slow):.1f} in fp16)",
        "bytes": f"With every sequence at 16k, GQA reads K/V at {min(u16['gqa']):.2f}–{max(u16['gqa']):.2f}x the bytes "
                 f"limit at batch 8 to 64 ({min(b1):.2f}–{max(b1):.2f}x at batch 1, one sequence of 16k), MQA at "
                 f"{min(u16['mqa']):.2f}–{max(u16['mqa']):.2f}x",
    }


@pytest.mark.parametrize("name", sorted(decode_flashinfer_now_claims()))
def test_paged_doc_decode_flashinfer_now_claim(name):
    _assert_in_paged_doc(decode_flashinfer_now_claims(), name)


PROFILES_NOW = {name: f"2026-12-05-profile-codellama34b-4l-{name}.json" for name in ("paged-2k", "paged-16k", "inplace-16k")}
BZ_KERNEL = "nvjet_sm90_hsh_64x8_64x16_2x1_v_bz_TNT"


def _decode_phase(name):
    (mode,) = [m for m in _load(PROFILES_NOW[name])["modes"].values() if m.get("mqa")]
    return mode["phases"]["decode"]


def decode_step_claims() -> dict[str, str]:
    """docs/performance.md's table of what a decode step of the current builds is made of (mqa-byoc profile
    run, batch 1): one row a profile."""
    labels = {"paged-2k": ("PagedKVCache", "2k"), "paged-16k": ("PagedKVCache", "16k"),
              "inplace-16k": ("in-place cache", "16k")}
    kinds = {"Memcpy HtoD (Pinned -> Device)": "host-to-device", "Memcpy DtoD (Device -> Device)": "device-to-device"}
    out = {}
    for name in PROFILES_NOW:
        p = _decode_phase(name)
        steps = p["steps"]
        gemm = sum(r["us_per_step"] for r in p["gemms"]["rows"])
        limit = sum(r["limit_us_per_call"] * r["calls_per_step"] for r in p["gemms"]["rows"])
        kernels = p["kernel_ms_per_step"] * 1000
        count = sum(r["instances"] for r in p["kernels"]) / steps
        mem = {r["name"]: r["instances"] / steps for r in p["memory_ops"]}
        memsets = mem.pop("Memset (Device)", 0)
        bz = sum(r["instances"] for r in p["kernels"] if r["name"] == BZ_KERNEL) / steps
        assert memsets == bz, (name, memsets, bz)  # as many as that cuBLASLt kernel's calls
        (copy_name, n_copies), = mem.items()
        cache, ctx = labels[name]
        out[name] = (f"| {cache} | {ctx} | {kernels:,.0f} | {gemm:,.0f} | {gemm / limit:.2f}x ({limit:,.0f}) | "
                     f"{count:.0f} | {memsets:.0f} | {n_copies:.0f} {kinds[copy_name]} |")
    return out


def decode_step_summary() -> dict[str, str]:
    """docs/performance.md's sentences under that table: the GEMMs' range against their limit and what the
    1.20x goal leaves of a step for everything else (the decode limit counts the K/V as well)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decoders_bench", ROOT / "benchmarks" / "decoders.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ratios, left = [], {}
    for name in PROFILES_NOW:
        p = _decode_phase(name)
        gemm = sum(r["us_per_step"] for r in p["gemms"]["rows"])
        limit = sum(r["limit_us_per_call"] * r["calls_per_step"] for r in p["gemms"]["rows"])
        ratios.append(gemm / limit)
        (mode,) = [m for m in _load(PROFILES_NOW[name])["modes"].values() if m.get("mqa")]
        step_limit = bench.decode_limit_ms(mode, 1, _load(PROFILES_NOW[name])["prompt_len"]) * 1000
        left[name] = 1.2 * step_limit - gemm
    return {"range": f"The GEMMs alone take {min(ratios):.2f}–{max(ratios):.2f}x their bytes limit.",
            "left": f"{left['paged-2k']:.0f} µs a step at 2k and {left['paged-16k']:.0f} µs at 16k"}


@pytest.mark.parametrize("name", ["range", "left"])
def test_performance_doc_decode_step_summary(name):
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    assert decode_step_summary()[name] in text, decode_step_summary()[name]


@pytest.mark.parametrize("name", sorted(PROFILES_NOW))
def test_performance_doc_decode_step_claim(name):
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    claim = decode_step_claims()[name]
    assert claim in text, claim


# ---------------------------------------------------------------------------------------------
# CUTLASS's GEMV at one row (benchmarks/cutlass_gemv.cu's log, the decoders with and without it)

DECODERS_GEMV = "2026-12-05-decoders-gemv.json"
DECODERS_GEMV_BEFORE_AFTER = "2026-12-05-decoders-gemv-before-after.json"
GEMV_ROWS = {
    "paged, cuBLASLt alone (`gemm_gemv=off`)": "paged-nogemv",
    "paged, the default: CUTLASS's GEMV at one row": "paged-gemv",
    "paged, the default, CUDA graphs": "paged-gemv-graph",
    "in-place, cuBLASLt alone (`gemm_gemv=off`)": "inplace-nogemv",
    "in-place, the default": "inplace-gemv",
    "in-place, the default, CUDA graphs": "inplace-gemv-graph",
}


def _own_limit_cells(parts, name) -> list[str]:
    out = []
    for b, c in DECODE_CASES:
        d = _decode_rec(parts, name, b, c)
        out.append("–" if d is None else f"{d['ms_per_step']:.3f} ({d['ms_per_step'] / d['limit_ms']:.2f}x)")
    return out


def gemv_table_rows() -> dict[str, list[str]]:
    parts = _load(DECODERS_GEMV)["parts"]
    rows = {}
    for label, name in GEMV_ROWS.items():
        rows[label] = _own_limit_cells(parts, name)
        rows[f"{label}, second pass"] = _own_limit_cells(parts, f"{name}.2")
    return rows


def gemv_decoder_claims() -> dict[str, str]:
    """performance.md's sentences on the run with and without CUTLASS's GEMV, and the run before/after."""
    parts = _load(DECODERS_GEMV)["parts"]

    def ratio(name, b, c):
        d = _decode_rec(parts, name, b, c)
        return f"{d['ms_per_step'] / d['limit_ms']:.2f}x"

    def gemm_us(name, gemm):
        d = _decode_rec(parts, name, 1, 2048)
        return next(r for r in d["gemms"]["rows"] if r["gemm"] == gemm)["us_per_call"]

    def ms(name, b, c, p=parts):
        return _decode_rec(p, name, b, c)["ms_per_step"]

    many = [ms(f"paged-gemv{s}", b, c) / ms(f"paged-nogemv{s}", b, c) for s in ("", ".2") for b, c in ((8, 2048), (32, 2048))]
    logits = _load(DECODERS_GEMV)["logits"]
    diffs = [v["max_abs"] for v in logits.values()]
    ref = max(v["ref_max_abs"] for v in logits.values())
    assert all(v["argmax_equal"] for v in logits.values())
    ba = _load(DECODERS_GEMV_BEFORE_AFTER)["parts"]

    def pair(name, b, c):
        return f"{ms(name, b, c, ba):.3f} and {ms(name + '.2', b, c, ba):.3f}"

    def faster(before, now, b, c):
        return _range([ms(f"{before}{s}", b, c, ba) / ms(f"{now}{s}", b, c, ba) for s in ("", ".2")])

    per_gemm = {g: (gemm_us("paged-gemv", g), gemm_us("paged-nogemv", g)) for g in
                ("gate_up_proj", "qkv_proj", "lm_head", "down_proj", "o_proj")}
    return {
        "paged 2k": f"takes {ratio('paged-gemv', 1, 2048)} and {ratio('paged-gemv.2', 1, 2048)} the bytes limit "
                    f"(1.27x on cuBLASLt alone in the same run), with CUDA graphs {ratio('paged-gemv-graph', 1, 2048)} and "
                    f"{ratio('paged-gemv-graph.2', 1, 2048)}",
        "paged 16k": f"At 16k it takes {ratio('paged-gemv-graph', 1, 16384)} and {ratio('paged-gemv-graph.2', 1, 16384)} "
                     "with CUDA graphs",
        "inplace 16k": f"the in-place decoder at 16k {ratio('inplace-gemv', 1, 16384)}, with CUDA graphs "
                       f"{ratio('inplace-gemv-graph', 1, 16384)}",
        "many rows": f"({_range(many)} the time of the builds on cuBLASLt alone)",
        "gemms": "gate_up_proj {:.1f} µs a call on the GEMV against {:.1f} on cuBLASLt, qkv_proj {:.1f} against {:.1f}, "
                 "lm_head {:.1f} against {:.1f}, down_proj {:.1f} against {:.1f}; o_proj runs on the GEMV too, {:.1f} "
                 "against {:.1f} µs".format(*[x for g in per_gemm.values() for x in g]),
        "logits": f"differ from cuBLASLt's by at most {max(diffs):.3f} (logits up to {ref:.1f}), argmax equal",
        "before paged": f"a paged batch-1 step at 2k took {pair('A-paged', 1, 2048)} ms before and {pair('C-paged', 1, 2048)} "
                        f"now ({faster('A-paged', 'C-paged', 1, 2048)} faster)",
        "before graph": f"with CUDA graphs {pair('A-paged-graph', 1, 2048)} before, {pair('C-paged-graph', 1, 2048)} now "
                        f"({faster('A-paged-graph', 'C-paged-graph', 1, 2048)})",
        "before inplace": f"the in-place step at 16k {pair('A-inplace', 1, 16384)} before, {pair('C-inplace', 1, 16384)} now "
                          f"({faster('A-inplace', 'C-inplace', 1, 16384)})",
    }


def test_gemv_table():
    text = PERF.read_text()
    for label, cells in gemv_table_rows().items():
        assert _table_row(text, label) == cells, label


def test_readme_gemv_claim():
    text = " ".join(README.read_text().split())
    assert gemv_decoder_claims()["paged 2k"] in text


@pytest.mark.parametrize("name", sorted(gemv_decoder_claims()))
def test_gemv_decoders_claim(name):
    text = " ".join(PERF.read_text().split())
    assert gemv_decoder_claims()[name] in text, f"performance.md lacks {name}: {gemv_decoder_claims()[name]!r}"


def cutlass_gemv_claims() -> dict[str, str]:
    """docs/gemm.md's figures of benchmarks/cutlass_gemv.cu's H200 run (read and write flush), from its log."""
    log = (RESULTS / "2026-12-05-cutlass-gemv.log").read_text()
    runs = {}
    for part in re.split(r"(?m)^device ", log)[1:]:
        mode = "read" if "read twice" in part.splitlines()[0] else "write"
        rows = {}
        for block in part.split("\n== ")[1:]:
            name, m = re.match(r"(\S+) M=(\d+)", block).groups()
            lt = float(re.search(r"cublasLt \(our rule\): ([\d.]+) us", block).group(1))
            gv = [float(t) for t in re.findall(r"cutlass Gemv threads=\d+ per_row=\d+: ([\d.]+) us", block)]
            sm = [float(t) for t in re.findall(r"cutlass sm90 swapped .+?: ([\d.]+) us", block)]
            assert "WRONG" not in block
            rows[(name, int(m))] = (lt, min(gv) if gv else None, min(sm))
        runs[mode] = rows
    read = runs["read"]
    gu = read[("gate_up_proj", 1)]
    others = [g / lt for (n, m), (lt, g, _) in read.items() if m == 1 and n != "gate_up_proj"]
    sm1 = [s / lt for (n, m), (lt, _, s) in read.items() if m == 1]
    sm8 = [s / lt for (n, m), (lt, _, s) in read.items() if m == 8]
    decoders = _load(DECODERS_GEMV)["parts"]
    qkv_in_decoder = next(r for r in _decode_rec(decoders, "paged-nogemv", 1, 2048)["gemms"]["rows"]
                          if r["gemm"] == "qkv_proj")["us_per_call"]
    return {
        "gate_up": f"read gate_up_proj in {gu[1]:.1f} µs against {gu[0]:.1f} for cuBLASLt's measured choice "
                   f"({gu[1] / gu[0]:.3f}x) and was within {min(others):.3f}–{max(others):.3f}x of it on the other weights",
        "sm90": f"took {_range(sm1)} cuBLASLt's time at M = 1 and {_range(sm8)} at M = 8",
        "flush": f"cuBLASLt's qkv_proj GEMV took {runs['write'][('qkv_proj', 1)][0]:.1f} µs after the write, "
                 f"{read[('qkv_proj', 1)][0]:.1f} after the read, {qkv_in_decoder:.1f} inside the paged decoder",
    }


@pytest.mark.parametrize("name", sorted(cutlass_gemv_claims()))
def test_gemm_doc_cutlass_gemv_claim(name):
    text = " ".join(GEMM_DOC.read_text().split())
    assert cutlass_gemv_claims()[name] in text, f"docs/gemm.md lacks {name}: {cutlass_gemv_claims()[name]!r}"


# ---------------------------------------------------------------------------------------------
# split_rope on the GPU: the in-place decoder with it and with the Relax-op form (one run, two passes)

SPLIT_ROPE = "2026-12-06-decoders-split-rope.json"
SPLIT_ROPE_PROFILE = "2026-12-06-profile-codellama34b-4l-inplace-16k-h100.json"


def split_rope_claims() -> dict[str, str]:
    parts = _load(SPLIT_ROPE)["parts"]

    def ms(name, context, key="ms_per_step"):
        return _decode_rec(parts, name, 1, context)[key]

    def both(name, context, key="ms_per_step"):
        return f"{ms(name, context, key):.3f}, {ms(name + '.2', context, key):.3f}"

    def ratio(graph):
        return _range([ms(f"inplace-rope{graph}{s}", c) / ms(f"inplace-ops{graph}{s}", c)
                       for s in ("", ".2") for c in (2048, 16384)])

    rows = {}
    for label, name in (("ops form", "inplace-ops"), ("`split_rope`", "inplace-rope"),
                        ("ops form, CUDA graphs", "inplace-ops-graph"), ("`split_rope`, CUDA graphs", "inplace-rope-graph")):
        rows[label] = (f"| {label} | {both(name, 2048)} | {both(name, 16384)} | "
                       f"{both(name, 16384, 'kernel_ms_per_step')} |")
    (mode,) = [m for m in _load(SPLIT_ROPE_PROFILE)["modes"].values() if m.get("mqa")]
    phase = mode["phases"]["decode"]
    kernels = sum(k["instances"] for k in phase["kernels"]) / phase["steps"]
    (rope,) = [k for k in phase["kernels"] if k["name"] == "split_rope_kernel"]
    (logits,) = _load(SPLIT_ROPE)["logits"].values()
    assert logits["argmax_equal"]
    return {**rows,
            "ratios": f"took {ratio('')} the time of the ops form's without CUDA graphs and {ratio('-graph')} with them",
            "profile": f"has {kernels:.0f} kernels a step: `split_rope` takes {rope['avg_ns'] / 1000:.2f} µs a call",
            "logits": f"by at most {logits['max_abs']:.3f} (logits up to {logits['ref_max_abs']:.1f};"}


@pytest.mark.parametrize("name", sorted(split_rope_claims()))
def test_performance_doc_split_rope_claim(name):
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    claim = " ".join(split_rope_claims()[name].split())
    assert claim in text, claim


# ------------------------------------------------------------------ launch overlap and split_rope's prefill
LAUNCH_OVERLAP = "2026-12-06-decoders-launch-overlap.json"
SPLIT_ROPE_PREFILL = "2026-12-06-decoders-split-rope-prefill.json"
#: performance.md's launch-overlap table: label -> part (the second pass is the part + ".2")
LAUNCH_OVERLAP_ROWS = {
    "paged, `off`": "po", "paged, `prefetch`": "pf",
    "paged, `off`, CUDA graphs": "po-graph", "paged, `pdl`, CUDA graphs": "pp-graph",
    "paged, `prefetch`, CUDA graphs": "pf-graph", "paged, `prefetch`, `gemm_gemv=always`, CUDA graphs": "pg-graph",
    "in-place, `off`, CUDA graphs": "io-graph", "in-place, `prefetch`, CUDA graphs": "if-graph",
}


def launch_overlap_claims() -> dict[str, str]:
    data = _load(LAUNCH_OVERLAP)
    parts = data["parts"]

    def ms(name, b, c):
        rec = _decode_rec(parts, name, b, c)
        return None if rec is None else rec["ms_per_step"]

    rows = {}
    for label, name in LAUNCH_OVERLAP_ROWS.items():
        cells = []
        for b, c in ((1, 2048), (1, 16384), (8, 2048), (32, 2048)):
            a, z = ms(name, b, c), ms(name + ".2", b, c)
            cells.append("–" if a is None else f"{a:.3f}, {z:.3f}")
        rows[label] = f"| {label} | " + " | ".join(cells) + " |"

    def ratios(on, off, cases):
        return _range([ms(f"{on}{s}", b, c) / ms(f"{off}{s}", b, c) for s in ("", ".2") for b, c in cases])

    paged = ((1, 2048), (1, 16384), (8, 2048), (32, 2048))
    inplace = ((1, 2048), (1, 16384))
    spread = _range([ms(f"{n}.2", b, c) / ms(n, b, c) for n in LAUNCH_OVERLAP_ROWS.values()
                     for b, c in (paged if n.startswith("p") else inplace)])
    logits = data["logits"]
    assert all(v["argmax_equal"] for v in logits.values())
    paged_diff = _range([v["max_abs"] for k, v in logits.items() if k.startswith("p")], digits=3, unit="")
    return {**rows,
            "ratios": (f"`pdl` took {ratios('pp-graph', 'po-graph', paged)} the time of `off` with CUDA graphs, "
                       f"`prefetch` {ratios('pf-graph', 'po-graph', paged)} with them and "
                       f"{ratios('pf', 'po', paged)} without; the in-place decoder with `prefetch` "
                       f"{ratios('if-graph', 'io-graph', inplace)}"),
            "spread": f"the second pass took {spread} the time of the first",
            "logits": (f"differ from the `off` build's by {paged_diff} (paged; the builds measure their GEMM "
                       f"algorithms separately) and {logits['if-graph vs io-graph']['max_abs']:.1f} (in-place)")}


def split_rope_prefill_claims() -> dict[str, str]:
    parts = _load(SPLIT_ROPE_PREFILL)["parts"]

    def ms(name, tokens):
        return next(p["ms"] for p in parts[name]["prefill"] if p["tokens"] == tokens)

    cells = {n: {t: f"{ms(n, t):.2f}, {ms(n + '.2', t):.2f}" for t in (2048, 16384)}
             for n in ("ops-prefill", "rope-prefill")}
    ratio = _range([ms(f"rope-prefill{s}", t) / ms(f"ops-prefill{s}", t) for s in ("", ".2") for t in (2048, 16384)])
    return {"prefill": (f"a prefill of 2k tokens took {cells['rope-prefill'][2048]} ms with `split_rope` and "
                        f"{cells['ops-prefill'][2048]} with the ops form, of 16k tokens {cells['rope-prefill'][16384]} "
                        f"and {cells['ops-prefill'][16384]} ({ratio} the time)")}


@pytest.mark.parametrize("name", sorted(launch_overlap_claims()) + [f"rope:{n}" for n in split_rope_prefill_claims()])
def test_performance_doc_launch_overlap_claim(name):
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    claims = split_rope_prefill_claims() if name.startswith("rope:") else launch_overlap_claims()
    claim = " ".join(claims[name.removeprefix("rope:")].split())
    assert claim in text, claim


FLASHINFER_71 = "2026-12-06-paged-decode-flashinfer-71.json"


def flashinfer_71_claims() -> dict[str, str]:
    cases = _load(FLASHINFER_71)["cases"]
    assert all(all(c["ok"].values()) for c in cases)
    cells, slower = [], []
    for c in sorted(cases, key=lambda c: (c["batch"], c["lengths_kind"] != "mixed")):
        fi = min(v for k, v in c["us"].items() if k.startswith("flashinfer") and c["ok"][k])
        what = f"{c['batch']} {'sequence' if c['batch'] == 1 else 'sequences'}" + (
            "" if c["batch"] == 1 else (" of mixed lengths" if c["lengths_kind"] == "mixed" else " at 16k"))
        cells.append(f"{what}: {c['us']['ours']:.1f} µs against {fi:.1f}")
        if c["us"]["ours"] > fi:
            slower.append(f"{c['us']['ours'] / fi:.2f}x")
    no_slower = len(cases) - len(slower)
    return {"cases": "; ".join(cells),
            "count": f"no slower than FlashInfer's fastest variant in {no_slower} of {len(cases)} cases",
            "slower": f"({', '.join(slower)})"}


@pytest.mark.parametrize("name", sorted(flashinfer_71_claims()))
def test_paged_doc_flashinfer_71_claim(name):
    _assert_in_paged_doc(flashinfer_71_claims(), name)


FLASHINFER_H100 = "2026-12-06-paged-decode-flashinfer-h100.json"


def _h100_fi_cases(name: str) -> list:
    """The decode cases of an H100 run beside FlashInfer (its own 3.35 TB/s), every output matching fp32."""
    data = _load(name)
    assert data["hbm_bytes_per_s"] == 3.35e12 and data["device"].startswith("NVIDIA H100")
    assert all(all(c["ok"].values()) for c in data["cases"])
    return data["cases"]


def _batch1_bytes(cases) -> dict:
    """Per GQA shape, the range of ours over the K/V bytes limit at batch 1 (one sequence of 16k)."""
    return {s: _range([c["us"]["ours"] / c["bytes_us"] for c in cases if c["shape"] == s and c["batch"] == 1])
            for s in ("gqa64_8_d128", "gqa32_8_d128")}


def flashinfer_h100_claims() -> dict[str, str]:
    """paged_kv_cache.md's paragraph on every decode shape beside FlashInfer on an H100 (its own 3.35 TB/s)."""
    cases = _h100_fi_cases(FLASHINFER_H100)
    fi = _fi_fastest
    def ratios(pred):
        return [c["us"]["ours"] / fi(c) for c in cases if pred(c)]

    slower = sorted((c for c in cases if c["us"]["ours"] > fi(c)), key=lambda c: c["dtype"] != "float16")
    assert all((c["shape"], c["batch"], c["lengths_kind"]) == ("mqa71_1_d64", 8, "mixed") for c in slower)
    gqa = lambda c: c["shape"].startswith("gqa")  # noqa: E731
    at_16k = lambda c: c["batch"] > 1 and c["lengths_kind"] == "uniform16k"  # noqa: E731
    bytes_ = _batch1_bytes(cases)
    return {
        "count": f"no slower than FlashInfer's fastest variant in {len(cases) - len(slower)} of {len(cases)} cases",
        "gqa": f"GQA {_range(ratios(gqa))} its time",
        "mqa": f"Falcon's 71/1/64 {_range(ratios(lambda c: not gqa(c)))}",
        "slower": "slower only at 8 sequences of mixed lengths: " + ", ".join(
            f"{c['us']['ours']:.1f} µs against {fi(c):.1f} in {dict(float16='fp16', bfloat16='bf16')[c['dtype']]}"
            for c in slower),
        "bytes": f"GQA reads K/V at {_range([c['us']['ours'] / c['bytes_us'] for c in cases if gqa(c) and at_16k(c)])} "
                 f"the H100's bytes limit at batch 8 to 64 with every sequence at 16k, at batch 1 (one sequence of "
                 f"16k) {bytes_['gqa64_8_d128']} for 64/8/128 and {bytes_['gqa32_8_d128']} for 32/8/128",
    }


@pytest.mark.parametrize("name", sorted(flashinfer_h100_claims()))
def test_paged_doc_flashinfer_h100_claim(name):
    _assert_in_paged_doc(flashinfer_h100_claims(), name)


# ------------------------------------------------------------------ the decoders on an H100, its own limits
H100_LIMITS = "2026-12-06-decoders-h100-limits.json"
H100_PROFILE = "2026-12-06-profile-codellama34b-4l-paged-graph-16k-h100.json"
#: performance.md's H100 table: label -> part (the passes are the part + "-1" and "-2")
H100_ROWS = {"paged, the default": "paged", "paged, the default, CUDA graphs": "paged-graph",
             "in-place, the default, CUDA graphs": "inplace-graph"}


def h100_limits_claims() -> dict[str, str]:
    data = _load(H100_LIMITS)
    assert data["limits"]["hbm_tbps"] == 3.35 and data["limits"]["gpu"] == data["gpu"]
    parts = data["parts"]
    rows = {}
    for label, name in H100_ROWS.items():
        cells = []
        for b, c in ((1, 2048), (1, 16384), (8, 2048), (32, 2048)):
            recs = [_decode_rec(parts, f"{name}-{p}", b, c) for p in (1, 2)]
            cells.append("–" if recs[0] is None else
                         ", ".join(f"{r['ms_per_step']:.3f} ({r['vs_limit']:.2f}x)" for r in recs))
        rows[label] = f"| {label} | " + " | ".join(cells) + " |"
    in16 = [_decode_rec(parts, f"inplace-graph-{p}", 1, 16384) for p in (1, 2)]
    limit_2k = _decode_rec(parts, "paged-1", 1, 2048)["limit_ms"]
    prof = _load(H100_PROFILE)["modes"]["mqa"]
    table = prof["phases"]["decode"]["gemms"]
    assert table["limits"]["hbm_tbps"] == 3.35
    fr = [r["fraction_of_limit"] for r in table["rows"]]
    kernel = next(k for k in prof["phases"]["decode"]["kernels"] if "gqa_decode_kernel" in k["name"])
    kv_us = 2 * 16384 * prof["num_kv_heads"] * prof["head_dim"] * 2 / (3.35e12) * 1e6
    return {**rows, "limit": f"(the limit of a batch-1 step at 2k context: {limit_2k:.3f} ms)",
            "inplace": f"the in-place decoder at 16k takes {_range([r['vs_limit'] for r in in16])} (its kernels "
                       f"{_range([r['kernels_vs_limit'] for r in in16])})",
            "gemms": (f"decode GEMMs at {100 * min(fr):.0f}–{100 * max(fr):.0f}% of 3.35 TB/s "
                      f"({100 * table['fraction_of_limit']:.0f}% together) and the decode kernel at "
                      f"{kernel['avg_ns'] / 1e3:.1f} µs a call against {kv_us:.1f} µs")}


@pytest.mark.parametrize("name", sorted(h100_limits_claims()))
def test_performance_h100_limits_claim(name):
    text = " ".join(PERF.read_text().split())
    claim = " ".join(h100_limits_claims()[name].split())
    assert claim in text, claim


H100_AGAIN = "2026-12-07-decoders-h100-paged-inplace.json"


def h100_again_claims() -> dict[str, str]:
    """performance.md: the default builds of a later commit on another H100, against the first machine's."""
    data, first = _load(H100_AGAIN), _load(H100_LIMITS)
    assert data["limits"]["hbm_tbps"] == 3.35 and data["gpu"].startswith("NVIDIA H100")
    parts = data["parts"]
    paged = [f"paged-cache{g}{p}" for g in ("", "-graph") for p in ("", ".2")]

    def recs(names, b, c):
        return [_decode_rec(parts, n, b, c) for n in names]

    b1 = recs(paged, 1, 16384)
    in16 = recs(["inplace-cache-graph", "inplace-cache-graph.2"], 1, 16384)

    def gate_up(rec):
        return next(r for r in rec["gemms"]["rows"] if r["gemm"] == "gate_up_proj")

    now = gate_up(in16[0])
    before = gate_up(_decode_rec(first["parts"], "inplace-graph-1", 1, 16384))
    assert now["kernels"] == before["kernels"]  # the same GEMV kernel on both machines
    return {
        "b1": (f"the paged decoder at batch 1 and 16k took {_range([r['vs_limit'] for r in b1])} the limit (its "
               f"kernels {_range([r['kernels_vs_limit'] for r in b1])})"),
        "b8": (f"batch 8 {_range([r['vs_limit'] for r in recs(paged, 8, 2048)])}, batch 32 "
               f"{_range([r['vs_limit'] for r in recs(paged, 32, 2048)])}"),
        "inplace": (f"the in-place decoder at 16k {in16[0]['vs_limit']:.3f}x and {in16[1]['vs_limit']:.3f}x (its "
                    f"kernels {_range([r['kernels_vs_limit'] for r in in16])})"),
        "gemv": (f"the same kernel read gate_up_proj at {now['tbps']:.2f} TB/s where the first machine read "
                 f"{before['tbps']:.2f}"),
    }


@pytest.mark.parametrize("name", sorted(h100_again_claims()))
def test_performance_h100_again_claim(name):
    text = " ".join(PERF.read_text().split())
    claim = " ".join(h100_again_claims()[name].split())
    assert claim in text, claim


# docs/paged_kv_cache.md and performance.md: Falcon's packed splits over two CTAs an SM (the plan's sweep)

PACKED_GRID_71 = "2026-12-07-decode-packed-grid-71-h100.json"


def packed_grid_71_claims() -> dict[str, str]:
    rows = _load(PACKED_GRID_71)
    assert all(r["gpu"].startswith("NVIDIA H100") for r in rows)
    sms = 132
    rule = {(r["batch"], r["lengths"], r["dtype"]): min(r["rule"], r["rule2"]) for r in rows}
    new = {(r["batch"], r["lengths"], r["dtype"]): r[f"g{2 * sms}k128"] for r in rows}
    ratios = [new[k] / rule[k] for k in rule]
    # three CTAs an SM against two, the best least split of each
    three = []
    for r in rows:
        best = {per_sm: min(v for k, v in r.items() if k.startswith(f"g{per_sm * sms}k")) for per_sm in (2, 3)}
        three.append(best[3] / best[2])
    b4 = {k: next(r for r in rows if (r["batch"], r["lengths"]) == (4, k)) for k in ("mixed", "uniform16k")}
    assert all(r["rule_shared"] == 0 for r in b4.values())  # the classic blocks before
    m8 = {t: (new[(8, "mixed", t)], rule[(8, "mixed", t)]) for t in ("float16", "bfloat16")}
    return {
        "three": f"took {min(three):.2f}-{max(three):.2f}x the time of two (each at its best least split)",
        "least split": f"(128 keys: {b4['mixed'][f'g{2 * sms}k128']:.1f} µs, 256: {b4['mixed'][f'g{2 * sms}k256']:.1f})",
        "four": f"(the classic blocks before: {rule[(4, 'mixed', 'float16')]:.1f} and "
                f"{rule[(4, 'uniform16k', 'float16')]:.1f} µs at 4 sequences, mixed and 16k; packed "
                f"{new[(4, 'mixed', 'float16')]:.1f} and {new[(4, 'uniform16k', 'float16')]:.1f})",
        "range": f"{min(ratios):.2f}-{max(ratios):.2f}x the time of the plan before over the {len(rows)} cases, 8 "
                 f"sequences of mixed lengths {m8['float16'][0]:.1f} µs against {m8['float16'][1]:.1f} (fp16; bf16 "
                 f"{m8['bfloat16'][0]:.1f} against {m8['bfloat16'][1]:.1f})",
        "performance": f"{min(ratios):.2f}–{max(ratios):.2f}x the time of three CTAs an SM at 4 to 32",
    }


@pytest.mark.parametrize("name", sorted(packed_grid_71_claims()))
def test_packed_grid_71_claim(name):
    claims = packed_grid_71_claims()
    if name == "performance":
        text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
        assert claims[name] in text, claims[name]
    else:
        _assert_in_paged_doc(claims, name)


BUILDS_PACKED_71 = ("2026-12-07-decode-builds-packed-71-first-h100.json", "2026-12-07-decode-builds-packed-71-h100.json")


def builds_packed_71_claims() -> dict[str, str]:
    first, final = (_load(n) for n in BUILDS_PACKED_71)
    worst = {page: max(r["us"]["after"] / r["us"]["before"] for r in first if r["page"] == page) for page in (256, 16)}
    # where two CTAs an SM at every batch lost: 64 sequences on pages of 256, from 12 on pages of 16
    assert all(r["batch"] == 64 for r in first if r["page"] == 256 and r["us"]["after"] / r["us"]["before"] > 1.03)
    assert all(r["batch"] >= 12 for r in first if r["page"] == 16 and r["us"]["after"] / r["us"]["before"] > 1.03)
    q = [r["us"]["after"] / r["us"]["before"] for r in final]
    m8 = next(r for r in final if (r["page"], r["batch"], r["kind"], r["dtype"]) == (256, 8, "mixed", "float16"))
    return {
        "first": f"they took up to {worst[256]:.2f}x and {worst[16]:.2f}x the time of three",
        "final": f"{len(final)} cases, fp16 and bf16): {min(q):.2f}-{max(q):.2f}x, 8 sequences of mixed lengths on "
                 f"pages of 256 {m8['us']['after']:.1f} µs against {m8['us']['before']:.1f}",
    }


@pytest.mark.parametrize("name", sorted(builds_packed_71_claims()))
def test_builds_packed_71_claim(name):
    _assert_in_paged_doc(builds_packed_71_claims(), name)


# docs/paged_kv_cache.md: every decode shape beside FlashInfer at the packed rule, and the grid between 32 and 48

FLASHINFER_H100_PACKED = "2026-12-07-paged-decode-flashinfer-h100-packed.json"
PACKED_GRID_71_40_47 = "2026-12-07-decode-packed-grid-71-40-47-h100.json"
PACKED_GRID_71_PAGE16 = "2026-12-07-decode-packed-grid-71-page16-h100.json"


def flashinfer_h100_packed_claims() -> dict[str, str]:
    cases = _h100_fi_cases(FLASHINFER_H100_PACKED)
    fi = _fi_fastest
    gqa = lambda c: c["shape"].startswith("gqa")  # noqa: E731
    ratios = lambda pred: [c["us"]["ours"] / fi(c) for c in cases if pred(c)]  # noqa: E731
    slower = [c for c in cases if c["us"]["ours"] > fi(c)]
    m8 = {t: _fi_case(cases, "decode", "mqa71_1_d64", 8, t) for t in ("float16", "bfloat16")}
    bytes_ = _batch1_bytes(cases)
    return {
        "count": f"ours no slower than FlashInfer's fastest variant in {len(cases) - len(slower)} of {len(cases)} cases",
        "ratios": f"GQA {_range(ratios(gqa))} its time, Falcon's 71/1/64 {_range(ratios(lambda c: not gqa(c)))}",
        "falcon 8": (f"{m8['float16']['us']['ours']:.1f} µs against {fi(m8['float16']):.1f} in fp16 and "
                     f"{m8['bfloat16']['us']['ours']:.1f} µs against {fi(m8['bfloat16']):.1f} in bf16"),
        "bytes": f"{bytes_['gqa64_8_d128']} the H100's bytes limit for 64/8/128 and {bytes_['gqa32_8_d128']} for 32/8/128",
    }


@pytest.mark.parametrize("name", sorted(flashinfer_h100_packed_claims()))
def test_paged_doc_flashinfer_h100_packed_claim(name):
    _assert_in_paged_doc(flashinfer_h100_packed_claims(), name)


def packed_grid_71_40_47_claims() -> dict[str, str]:
    rows = _load(PACKED_GRID_71_40_47)
    sms = rows[0]["sms"]
    assert all(r["gpu"].startswith("NVIDIA H100") and r["rule_splits"] == 3 * sms for r in rows)  # the rule: three
    two = {k: [r[f"g{2 * sms}k128"] / min(r["rule"], r["rule2"]) for r in rows if r["lengths"] == k]
           for k in ("mixed", "uniform16k")}
    return {"grid": f"took {_range(two['mixed'])} the rule's time with mixed lengths and {_range(two['uniform16k'])} "
                    "with every sequence at 16k"}


def packed_grid_71_page16_claims() -> dict[str, str]:
    rows = _load(PACKED_GRID_71_PAGE16)
    sms = rows[0]["sms"]
    assert all(r["gpu"].startswith("NVIDIA H100") and r["page"] == 16 and r["rule_splits"] == 3 * sms for r in rows)
    assert sorted({r["batch"] for r in rows}) == [9, 10, 11]
    rule = lambda r: min(r["rule"], r["rule2"])  # noqa: E731
    two = {k: [r[f"g{2 * sms}k128"] / rule(r) for r in rows if r["lengths"] == k] for k in ("mixed", "uniform16k")}
    classic = [r["classic"] / rule(r) for r in rows]
    return {"grid": f"took {_range(two['mixed'])} the rule's time with mixed lengths and {_range(two['uniform16k'])} "
                    f"with every sequence at 16k; the classic blocks {_range(classic)}"}


def test_paged_doc_packed_grid_71_40_47_claim():
    _assert_in_paged_doc(packed_grid_71_40_47_claims(), "grid")


def test_paged_doc_packed_grid_71_page16_claim():
    _assert_in_paged_doc(packed_grid_71_page16_claims(), "grid")
