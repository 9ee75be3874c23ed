"""Pure logic of benchmarks/paged_attention.py's comparison with FlashInfer (no GPU, no FlashInfer): the
batches' lengths, TVM's page list and page layout of the inputs both sides read, the fp32 reference, the
FLOP counts, the goals and the report, and the message when FlashInfer is missing."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import load_benchmark

torch = pytest.importorskip("torch")



@pytest.fixture(scope="module")
def bench():
    mod = load_benchmark("paged_attention.py", "paged_attention_bench")
    mod.DEVICE = "cpu"
    return mod


@pytest.mark.parametrize("batch", [1, 2, 8, 64])
def test_mixed_lengths_span_1k_to_16k(bench, batch):
    lengths = bench.mixed_lengths(batch)
    assert len(lengths) == batch
    assert all(bench.MIN_LEN <= n <= bench.MAX_LEN for n in lengths)
    assert max(lengths) == bench.MAX_LEN
    if batch > 1:
        assert min(lengths) == bench.MIN_LEN
    assert bench.mixed_lengths(batch) == lengths  # deterministic: every implementation and rerun sees the same


def test_page_list_is_tvms_csr_form(bench):
    lengths = [1, 16, 17, 40]
    indptr, values, last, total = bench.page_list(lengths, 16, seed=3)
    assert indptr == [0, 1, 2, 4, 7] and total == 7
    assert sorted(values) == list(range(7)) and values != list(range(7))  # every page once, shuffled
    assert last == [1, 16, 1, 8]
    for b, n in enumerate(lengths):
        assert (indptr[b + 1] - indptr[b] - 1) * 16 + last[b] == n


@pytest.mark.parametrize("page", [16, 128])
def test_pages_hold_each_sequences_keys_in_tvm_layout(bench, page):
    lengths = [130, 5, 300]
    inp = bench.PagedInputs(torch, lengths, 2, 8, torch.float16, (page,), seed=1)
    p = inp.paged[page]
    pages = p["pages"]
    assert pages.shape[1:] == (2, 2, page, 8)  # (num_pages, K/V, H_kv, page, D)
    indptr, values, last = p["indptr"].tolist(), p["values"].tolist(), p["last"].tolist()
    for b, n in enumerate(lengths):
        ids = values[indptr[b]:indptr[b + 1]]
        assert (len(ids) - 1) * page + last[b] == n
        for slot, src in ((0, inp.k), (1, inp.v)):
            got = torch.cat([pages[i, slot].transpose(0, 1) for i in ids])[:n]  # (n, H_kv, D)
            lo = inp.kv_indptr[b]
            assert torch.equal(got, src[lo:lo + n])


def test_reference_rows_is_softmax_attention_with_grouped_heads(bench):
    inp = bench.PagedInputs(torch, [7, 12], 2, 4, torch.float32, (16,), seed=2)
    q = torch.randn(3, 4, 4)  # 3 rows, 4 query heads over 2 K/V heads
    scale = 0.5
    b, n = 1, 12
    lo = inp.kv_indptr[b]
    got = bench.reference_rows(torch, q, inp, b, [0, 1, 2], n - 3, True, scale, 2)
    for r in range(3):
        for h in range(4):
            k, v = inp.k[lo:lo + n, h // 2], inp.v[lo:lo + n, h // 2]
            visible = n - 3 + r + 1  # bottom-right aligned causal mask
            w = torch.softmax((k[:visible] @ q[r, h]) * scale, dim=0)
            assert torch.allclose(got[r, h], w @ v[:visible], atol=1e-5)
    full = bench.reference_rows(torch, q, inp, b, [0, 1, 2], 0, False, scale, 2)
    k, v = inp.k[lo:lo + n, 0], inp.v[lo:lo + n, 0]
    assert torch.allclose(full[1, 0], torch.softmax((k @ q[1, 0]) * scale, dim=0) @ v, atol=1e-5)


def test_flop_counts(bench):
    # causal, bottom-right aligned: query row i of lq sees (lk - lq) + i + 1 keys
    lq, lk, h, d = 5, 9, 3, 4
    pairs = sum(lk - lq + i + 1 for i in range(lq))
    assert bench.causal_flops([lq], [lk], h, d) == 4 * h * d * pairs
    assert bench.causal_flops([lk], [lk], h, d) == 4 * h * d * lk * (lk + 1) // 2
    assert bench.full_flops([2, 3], [10, 20], h, d) == 4 * h * d * (20 + 60)
    assert bench.decode_bytes([1024, 16384], 8, 128, 2) == 2 * (1024 + 16384) * 8 * 128 * 2


def _results():
    def dec(batch, kind, ours, fi_cc, fi_tc, ok=True):
        return {"kind": "decode", "shape": "gqa64_8_d128", "dtype": "float16", "batch": batch, "lengths_kind": kind,
                "lengths": [16384] * batch if kind == "uniform16k" else [16384] + [1024] * (batch - 1),
                "bytes_us": 100.0, "us": {"ours": ours, "ours_page16": ours * 1.1, "flashinfer_p16_cuda_cores": fi_cc,
                                          "flashinfer_p16_tensor_cores": fi_tc},
                "ok": {"ours": ok, "flashinfer_p16_cuda_cores": True}, "max_err": {}}

    rag = {"kind": "ragged_prefill", "shape": "gqa64_8_d128", "dtype": "float16", "batch": 8, "lengths_kind": "mixed",
           "us": {"ours": 10.0, "flashinfer_fa2": 12.0, "flashinfer_fa3": 8.0},
           "tflops": {"ours": 400.0, "flashinfer_fa2": 333.0, "flashinfer_fa3": 500.0}, "ok": {"ours": True},
           "errors": {"flashinfer_x": "MissingJITCacheError: not built"}}
    return {"device": "NVIDIA H200", "torch": "2.11", "flashinfer": "0.7.2", "iters": 20,
            "cases": [dec(1, "mixed", 110.0, 150.0, 120.0), dec(8, "uniform16k", 130.0, 125.0, 140.0),
                      dec(8, "mixed", 90.0, 95.0, 99.0), rag]}


def test_goals_count_what_they_say(bench):
    g = bench.goals(_results())
    assert g["decode_cases"] == 3 and g["decode_not_slower"] == 2
    assert g["decode_worst_vs_flashinfer"] == pytest.approx(130.0 / 125.0)
    assert g["decode_at_16k"] == 2 and g["decode_16k_within_1_25x"] == 1
    assert g["decode_16k_worst_vs_bytes"] == pytest.approx(1.3)
    assert g["ragged_cases"] == 1 and g["ragged_at_least_best"] == 0 and g["ragged_at_least_fa2"] == 1
    assert g["all_outputs_ok"] is True
    bad = _results()
    bad["cases"][0]["ok"]["ours"] = False
    assert bench.goals(bad)["all_outputs_ok"] is False


def test_report_tables(bench):
    text = bench.report(_results(), {"commit": "abc123", "date": "2026-12-02", "command": "python x"})
    assert "commit abc123" in text and "`python x`" in text
    assert "| gqa64_8_d128 | float16 | uniform16k | 8 | 130.0 | 143.0 | 125.0 (p16_cuda_cores) | 1.04 |" in text
    assert "| gqa64_8_d128 | float16 | 8 | 400.0 (10) | 333.0 (12) | 500.0 (8) | 0.80 |" in text
    assert "flashinfer_x: MissingJITCacheError" in text
    assert "decode no slower than FlashInfer's fastest variant: 2 of 3 cases" in text


def test_missing_flashinfer_says_how_to_install(bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as if not installed
    assert bench.flashinfer_or_none(False) is None
    with pytest.raises(SystemExit, match=r'pip install "mqa-byoc\[bench\]"'):
        bench.flashinfer_or_none(True)


def test_kernels_command_parses_its_options(bench, monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(bench, "bench_kernels", lambda args: seen.setdefault("args", args))
    bench.main(["kernels", "--native", str(tmp_path), "--out", str(tmp_path / "r.json"), "--batches", "1", "64",
                "--no-flashinfer"])
    args = seen["args"]
    assert args.batches == [1, 64] and args.no_flashinfer and args.shapes == list(bench.SHAPES)


def test_error_text_keeps_the_reason_not_the_paths(bench):
    e = RuntimeError("Error in function 'operator()' at /a/b/c.cache/gen/batch_decode.cu:63: Unsupported group_size: 71")
    assert bench._error_text(e) == "RuntimeError: Error in function 'operator()' at batch_decode.cu:63: Unsupported group_size: 71"


def test_fa4_ragged_variant_is_counted_and_tabled(bench):
    res = _results()
    rag = res["cases"][-1]
    rag["us"]["ours_fa4"], rag["tflops"]["ours_fa4"], rag["ok"]["ours_fa4"] = 6.0, 600.0, True
    g = bench.goals(res)
    assert g["ragged_fa4_cases"] == 1 and g["ragged_fa4_at_least_best"] == 1
    assert g["ragged_fa4_worst_vs_flashinfer"] == pytest.approx(600.0 / 500.0)
    text = bench.report(res, {"commit": "abc123", "date": "2026-12-02", "command": "python x"})
    assert "| gqa64_8_d128 | float16 | 8 | 400.0 (10) | 333.0 (12) | 500.0 (8) | 600.0 (6) | 0.80 | 1.20 |" in text
    assert "(`ours_fa4`) at least FlashInfer's fastest TFLOP/s: 1 of 1" in text
    rag["ok"]["ours_fa4"] = False  # a wrong output (or LSE) is not counted as fast
    assert bench.goals(res)["ragged_fa4_at_least_best"] == 0


def test_fa4_ragged_objects_cover_every_shape_and_the_shim_indexes_them(bench):
    from mqa_byoc.kernels import hopper

    labels = bench.fa4_ragged_labels()
    assert len(labels) == 12 and labels == sorted(labels)
    assert {"fp16 h128 g8 varlen_causal", "bf16 h128 g4 varlen", "fp16 h64 g71 varlen_causal"} <= set(labels)
    src = bench.fa4_shim(labels)
    table = src[src.index("table[12] = {"):].split("}", 1)[0]
    assert table.count("&__tvm_ffi_") == 12
    # the table's order is the labels' order (the benchmark passes an index)
    for i, label in enumerate(labels):
        assert table.split(", ")[i].endswith(hopper.HopperKernelKey.parse(label).symbol)


@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="needs nvcc")
def test_decode_only_build_runs_decode_alone(bench, tmp_path):
    """``build-native --decode-only`` builds our decode kernel alone (no FA2 objects) and says so;
    ``kernels`` on it takes decode only and says how to run the prefills."""
    bench.main(["build-native", "--decode-only", "--out", str(tmp_path)])
    info = __import__("json").loads((tmp_path / "native.json").read_text())
    assert info["decode_only"] is True and info["libraries"] == [bench.DECODE_LIB]
    assert (tmp_path / bench.DECODE_LIB).is_file() and not (tmp_path / bench.NATIVE_LIB).exists()
    ours = bench.Ours(tmp_path)
    assert ours.lib is None and ours.decode_lib.mqa_byoc_decode_supported(64, 71, 1) == 1
    with pytest.raises(SystemExit, match="--kinds decode"):
        bench.main(["kernels", "--native", str(tmp_path), "--out", str(tmp_path / "r.json"), "--no-flashinfer",
                    "--kinds", "decode", "ragged_prefill"])
    with pytest.raises(SystemExit, match="--kinds decode"):
        ours.paged(torch, None, None, None, None, torch.zeros(2), 1, 0.125, False)


def test_report_says_what_ours_is(bench):
    """A run on a decode-only build describes ours as the decode kernel alone; a full build as the C API."""
    full = bench.report(_results(), {})
    assert "ours: the C API our PagedKVCache wrappers call" in full
    only = bench.report({**_results(), "native_build": {"decode_only": True}}, {})
    assert "ours: our grouped-query decode kernel alone (`build-native --decode-only`" in only
    assert "the C API our PagedKVCache" not in only
