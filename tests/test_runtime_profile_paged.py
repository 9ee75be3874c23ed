"""``mqa-byoc profile`` on TVM's PagedKVCache (``--kv-cache paged``): the CLI, choosing the runner and the
libraries of a directory, the tables and comparison of a paged pair (fake GPU, and kernels recorded on the
H200), :class:`PagedDecoderRunner` on a real CPU build, and (slow) a real ``profile build --kv-cache paged``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mqa_byoc.testing import graphs
from mqa_byoc import cli
from mqa_byoc.runtime import profiling
from mqa_byoc.runtime.runner import KernelStat
from test_runtime_profile import _FakeRunner, fake_gpu  # noqa: F401 - fake_gpu is a fixture

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "2026-11-30-paged-attention.json"


def _write_libs(directory: Path, libs: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, meta in libs.items():
        (directory / name).write_bytes(b"")
        (directory / (name + ".json")).write_text(json.dumps(meta))


def _paged_meta(mqa: bool) -> dict:
    return {"mqa": mqa, "kv_cache": "paged", "paged_attention": "fa2" if mqa else "tir",
            "page_size": 128 if mqa else 16, "num_layers": 2, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128,
            "dtype": "float16", "paged_served": ["batch_decode_paged_kv", "batch_prefill_ragged_kv"] if mqa else [],
            **({"provider": "native"} if mqa else {})}


PAGED_PAIR = {"m.paged-fa2.so": _paged_meta(True), "m.paged-tir.so": _paged_meta(False)}


# ------------------------------------------------------------------------------------------ CLI


def test_cli_parses_the_paged_choice():
    p = cli.build_parser()
    a = p.parse_args(["profile", "build", "--kv-cache", "paged", "--preset", "falcon-7b-mqa", "--layers", "2"])
    assert (a.kv_cache, a.preset, a.layers, a.provider, a.kv_expand, a.logits) == \
        ("paged", "falcon-7b-mqa", 2, "native", None, None)
    assert p.parse_args(["profile", "build"]).kv_cache == "inplace"  # the default stays the in-place cache
    assert p.parse_args(["profile", "run", "d", "--kv-cache", "paged"]).kv_cache == "paged"
    assert p.parse_args(["profile", "run", "d"]).kv_cache is None
    with pytest.raises(SystemExit):
        p.parse_args(["profile", "run", "d", "--kv-cache", "pages"])
    help_text = next(a for a in p._subparsers._group_actions[0].choices["profile"]._subparsers._group_actions[0]
                     .choices["build"]._actions if a.dest == "kv_cache").help
    assert "paged" in help_text and "TIR" in help_text and "FA2" in help_text


@pytest.mark.parametrize("extra, named", [(["--provider", "python"], "--provider python"),
                                          (["--kv-expand", "repeat"], "--kv-expand repeat"),
                                          (["--projections", "separate"], "--projections separate")])
def test_paged_build_rejects_options_that_do_not_apply(tmp_path, capsys, extra, named):
    rc = cli.main(["profile", "build", "--kv-cache", "paged", "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and "does not apply to --kv-cache paged" in err
    assert not (tmp_path / "o").exists()  # nothing built


@pytest.mark.parametrize("extra, want", [([], "last"), (["--logits", "all"], "all"), (["--logits", "last"], "last")])
def test_paged_build_passes_the_logits_choice(tmp_path, monkeypatch, extra, want):
    """--logits picks the prefill the paged libraries' runner serves a prompt with (batch_prefill: last)."""
    from mqa_byoc.models import decoder_libs

    seen = {}
    monkeypatch.setattr(decoder_libs, "build_paged_decoder_libraries", lambda *a, **kw: seen.update(kw))
    assert cli.main(["profile", "build", "--kv-cache", "paged", "--out", str(tmp_path / "o"), *extra]) == 0
    assert seen["logits"] == want


@pytest.mark.parametrize("extra, want", [([], "native"), (["--provider", "hopper"], "hopper")])
def test_paged_build_passes_the_provider(tmp_path, monkeypatch, capsys, extra, want):
    """--provider hopper puts the paged library's ragged prefill on FA4; the build says so."""
    from mqa_byoc.models import decoder_libs

    seen = {}
    monkeypatch.setattr(decoder_libs, "build_paged_decoder_libraries", lambda *a, **kw: seen.update(kw))
    assert cli.main(["profile", "build", "--kv-cache", "paged", "--out", str(tmp_path / "o"), *extra]) == 0
    assert seen["provider"] == want
    assert ("ragged prefill on FA4" in capsys.readouterr().out) == (want == "hopper")


def test_paged_build_refuses_the_python_provider_in_the_api(tmp_path):
    pytest.importorskip("tvm.relax")
    from mqa_byoc.models.decoder_libs import build_paged_decoder_libraries
    from mqa_byoc.models.presets import get_preset, scaled

    with pytest.raises(ValueError, match="provider must be 'native', 'hopper' or 'auto'"):
        build_paged_decoder_libraries(scaled(get_preset("llama3-8b"), num_layers=1), str(tmp_path), provider="python",
                                      progress=None)


def test_paged_build_refuses_an_unknown_logits_choice(tmp_path):
    pytest.importorskip("tvm.relax")
    from mqa_byoc.models.decoder_libs import build_paged_decoder_libraries
    from mqa_byoc.models.presets import get_preset, scaled

    with pytest.raises(ValueError, match="logits must be 'last' or 'all'"):
        build_paged_decoder_libraries(scaled(get_preset("llama3-8b"), num_layers=1), str(tmp_path), logits="first",
                                      progress=None)


def test_paged_build_rejects_a_sliding_window_preset(tmp_path, capsys):
    pytest.importorskip("tvm.relax")
    rc = cli.main(["profile", "build", "--kv-cache", "paged", "--preset", "mistral-7b", "--layers", "1",
                   "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "mistral-7b-scaled: the paged decoder has no sliding window" in err and "4096" in err
    assert not (tmp_path / "o").exists()


def test_paged_config_keeps_the_preset_shapes():
    pytest.importorskip("tvm.relax")
    from mqa_byoc.models.decoder_libs import paged_config_of
    from mqa_byoc.models.presets import scaled

    c = scaled("falcon-7b-mqa", num_layers=2, vocab_size=512, hidden_size=256, intermediate_size=512)
    p = paged_config_of(c, "bfloat16")
    assert (p.num_q_heads, p.num_kv_heads, p.head_dim, p.hidden, p.intermediate, p.layers, p.vocab, p.dtype) == \
        (71, 1, 64, 256, 512, 2, 512, "bfloat16")
    assert p.rope_theta == c.rope_theta and p.rope_mode == 1  # RoPE by the cache on append (NORMAL)


# ------------------------------------------------------------------------------------------ choosing libraries


def test_find_libraries_keeps_one_cache_per_run(tmp_path):
    _write_libs(tmp_path, {**PAGED_PAIR, "m.mqa.so": {"mqa": True, "kv_cache": "inplace"},
                           "m.repeat.so": {"mqa": False, "kv_cache": "inplace"}})
    with pytest.raises(profiling.ProfileError,
                       match=r"several KV caches \(inplace, paged\); choose one with --kv-cache"):
        profiling.find_libraries(str(tmp_path))
    assert [os.path.basename(p) for p in profiling.find_libraries(str(tmp_path), "paged")] == \
        ["m.paged-fa2.so", "m.paged-tir.so"]  # mqa=True (FA2) first
    assert [os.path.basename(p) for p in profiling.find_libraries(str(tmp_path), "inplace")] == \
        ["m.mqa.so", "m.repeat.so"]
    with pytest.raises(FileNotFoundError, match=r"no functional-cache libraries .* \(it has: inplace, paged\)"):
        profiling.find_libraries(str(tmp_path), "functional")
    # a sidecar without the field is the functional cache (sidecars written before it)
    assert profiling.cache_of({"mqa": True}) == "functional"


def test_open_runner_by_sidecar(monkeypatch):
    made = []
    monkeypatch.setattr(profiling, "DecoderRunner", lambda p: made.append(("decoder", p)))
    monkeypatch.setattr(profiling, "PagedDecoderRunner", lambda p: made.append(("paged", p)))
    profiling.open_runner("a.so", {"kv_cache": "paged"})
    profiling.open_runner("b.so", {"kv_cache": "inplace"})
    profiling.open_runner("c.so", {})
    assert made == [("paged", "a.so"), ("decoder", "b.so"), ("decoder", "c.so")]


# ------------------------------------------------------------------------------------------ the run, fake GPU


def test_run_profile_paged_pair(tmp_path, fake_gpu, monkeypatch):  # noqa: F811 - the fixture
    """A directory of a paged pair goes to PagedDecoderRunner; tables, comparison, NVTX ranges, JSON."""
    ranges = fake_gpu
    d = tmp_path / "paged"
    _write_libs(d, PAGED_PAIR)

    class NotThisRunner:
        def __init__(self, lib_path):
            raise AssertionError(f"{lib_path}: a paged library must not run on DecoderRunner")

    monkeypatch.setattr(profiling, "DecoderRunner", NotThisRunner)
    monkeypatch.setattr(profiling, "PagedDecoderRunner", _FakeRunner)
    printed = []
    data = profiling.run_profile(str(d), 16, 3, warmup=1, printer=printed.append)
    text = "\n".join(printed)
    assert ranges == ["prefill[16]", "decode[0]", "decode[1]", "decode[2]"] * 2
    assert data["kv_cache"] == "paged" and data["nvtx_steps"] is True
    assert data["nvtx_flash_attn"] is True  # the paged FA2 entries open flash_attn_paged / _ragged ranges
    saved = json.loads((d / "profile.json").read_text())
    assert saved["modes"].keys() == {"mqa", "repeat"}
    assert saved["modes"]["mqa"]["library"] == "m.paged-fa2.so" and saved["modes"]["repeat"]["page_size"] == 16
    assert saved["modes"]["mqa"]["paged_served"] == PAGED_PAIR["m.paged-fa2.so"]["paged_served"]
    assert "== m.paged-fa2.so: mqa=True, native provider, 2 layers, H=64 H_kv=8 D=128, float16, paged KV cache " \
           "(page size 128), attention on FA2 (UseFlashAttentionForPagedKVCache), FA2 serves " in text
    assert "== m.paged-tir.so: mqa=False, 2 layers, H=64 H_kv=8 D=128, float16, paged KV cache (page size 16), " \
           "attention on TVM's TIR kernels ==" in text
    assert "== mqa=True vs mqa=False (paged KV cache: attention on FA2 vs on TVM's TIR kernels) ==" in text
    assert "decode tokens/s (back to back): 625.0 with mqa=True vs 250.0 with mqa=False (2.50x)" in text
    assert text.count("Time (%)") == 4


def test_hopper_paged_library_is_described_with_its_fa4_prefill():
    """A paged library of the hopper provider runs its ragged prefill on FA4: the profile says so, in the
    library's line and in the comparison's header (the native provider's stays FA2)."""
    rec = {"mode": "mqa", "provider": "hopper", "kv_cache": "paged", "paged_attention": "fa2", "page_size": 128,
           "paged_served": ["ragged prefill", "decode"]}
    text = profiling._describe(rec)
    assert "attention on FA4 for the ragged prefill, FA2 for the rest" in text and "hopper provider" in text
    assert "FA4 and FA2 serve ragged prefill, decode" in text
    native = profiling._describe({**rec, "provider": "native"})
    assert "attention on FA2 (UseFlashAttentionForPagedKVCache)" in native and "FA2 serves ragged prefill" in native
    cmp = {"decode_loop_tokens_per_s_ratio": 2.0}
    modes = {"mqa": {**rec, "decode_loop_tokens_per_s": 2.0}, "repeat": {"kv_cache": "paged", "decode_loop_tokens_per_s": 1.0}}
    assert profiling.format_comparison(cmp, modes).startswith(
        "== mqa=True vs mqa=False (paged KV cache: attention on FA4 and FA2 vs on TVM's TIR kernels) ==")
    modes["mqa"]["provider"] = "native"
    assert "attention on FA2 vs on TVM's TIR kernels" in profiling.format_comparison(cmp, modes)


def test_run_profile_selects_the_cache_of_a_mixed_directory(tmp_path, fake_gpu, monkeypatch):  # noqa: F811
    _write_libs(tmp_path, PAGED_PAIR)  # next to the fixture's in-place pair (m.mqa.so, m.repeat.so)
    with pytest.raises(profiling.ProfileError, match="several KV caches"):
        profiling.run_profile(str(tmp_path), 16, 1, printer=lambda _m: None)
    monkeypatch.setattr(profiling, "PagedDecoderRunner", _FakeRunner)
    data = profiling.run_profile(str(tmp_path), 16, 1, kv_cache="paged", printer=lambda _m: None)
    assert [r["library"] for r in data["modes"].values()] == ["m.paged-fa2.so", "m.paged-tir.so"]


# ------------------------------------------------------------------------------------------ recorded kernels


def _recorded_step(impl: str, case="gqa64_8_d128", key="decode16384_b1") -> dict:
    """One layer's paged attention call on the H200 (kernel -> µs), from the paged benchmark's results."""
    return json.loads(RECORDED.read_text())["cases"][case][key][impl]["kernels_us"]


@pytest.mark.skipif(not RECORDED.is_file(), reason=f"{RECORDED.name} is not in this checkout")
def test_compare_on_kernels_recorded_on_the_h200():
    """The comparison of a paged pair, on the kernels one decode-16k attention call launched on the H200 (as if
    each decode step were that call in each of 4 layers): TIR's decode kernel only with mqa=False, FA2's split-KV
    and our block-table bridge only with mqa=True, the cache's own kernels in both, memory copies apart."""
    steps, layers = 2, 4
    recs = {}
    for mode, impl in (("mqa", "fa2"), ("repeat", "tir")):
        kernels = _recorded_step(impl)
        stats = [KernelStat(n, [us] * (layers * steps)) for n, us in kernels.items()]
        prefill = [KernelStat(n, [us] * layers) for n, us in _recorded_step(impl, key="prefill4096_b1").items()]
        recs[mode] = {"library": f"m.paged-{impl}.so", "mode": mode, "kv_cache": "paged",
                      "phases": {"prefill": profiling.phase_record(prefill, [0.1], 1),
                                 "decode": profiling.phase_record(stats, [0.002] * steps, steps)}}
    fa2, tir = _recorded_step("fa2"), _recorded_step("tir")
    cmp = profiling.compare(recs)
    assert set(cmp["decode_only_repeat"]) == {n for n in tir if n not in fa2 and not n.startswith("Memcpy")}
    assert "batch_decode_paged_kv_kernel" in cmp["decode_only_repeat"]
    assert cmp["decode_only_repeat"]["batch_decode_paged_kv_kernel"] == \
        pytest.approx(round(tir["batch_decode_paged_kv_kernel"] * layers, 1))  # µs per step
    only_fa2 = list(cmp["decode_only_mqa"])
    assert any("flash_fwd_splitkv_kernel" in n for n in only_fa2) and any("csr_to_block_table" in n for n in only_fa2)
    assert "fused_rope_kernel" not in only_fa2 and "fused_rope_kernel" not in cmp["decode_only_repeat"]
    mem = recs["mqa"]["phases"]["decode"]["memory_ops"]
    assert [m["name"] for m in mem] == ["Memcpy HtoD (Pinned -> Device)"]  # the cache's page tables, apart
    want = sum(us for n, us in fa2.items() if not n.startswith("Memcpy")) * layers / 1e3
    assert recs["mqa"]["phases"]["decode"]["kernel_ms_per_step"] == pytest.approx(want, abs=1e-4)
    assert cmp["decode_kernel_time_ratio"] > 20  # TIR's decode attention at 16k against FA2's
    text = profiling.format_comparison(cmp, recs)
    assert text.startswith("== mqa=True vs mqa=False (paged KV cache")
    assert "decode kernels only with mqa=False: batch_decode_paged_kv_kernel" in text


# ------------------------------------------------------------------------------------------ the runner, CPU build


@pytest.fixture(scope="module")
def cpu_paged_lib(tmp_path_factory):
    """A tiny PagedLlama (RoPE NORMAL, fp32) built for llvm with TVM's CPU paged kernels, exported with a
    sidecar of the fields PagedDecoderRunner reads (the slow build test checks the real sidecar has them)."""
    pytest.importorskip("torch")
    import dataclasses

    import tvm

    from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama

    cfg = PagedLlamaConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, hidden=32, intermediate=64, layers=2,
                           vocab=32, dtype="float32")
    mod, params, _ = export_paged_llama(cfg, {"kind": "llvm"})
    path = tmp_path_factory.mktemp("paged_cpu") / "tiny.paged-tir.so"
    tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})).export_library(str(path))
    meta = {"kv_cache": "paged", "paged_attention": "tir", "page_size": 16, "vocab_size": cfg.vocab,
            "paged_config": dataclasses.asdict(cfg), "mqa": False,
            "params": [[n, [int(x) for x in p.shape], str(p.dtype)] for n, p in params]}
    Path(str(path) + ".json").write_text(json.dumps(meta))
    return str(path)


def test_paged_runner_steps_keep_the_sequence(cpu_paged_lib):
    """Prefill then decode through the runner's begin/call/end steps: each decode's logits equal the last
    position of a prefill of the whole sequence in a fresh cache (RoPE makes a wrong position show)."""
    import torch

    from mqa_byoc.runtime.paged_driver import PagedDecoderRunner

    r = PagedDecoderRunner(cpu_paged_lib, device="cpu")
    assert r.meta["kv_cache"] == "paged" and r.model.page_size == 16
    ids = torch.randint(0, 32, (1, 12), dtype=torch.int32)
    prompt, new = ids[:, :9].clone(), [ids[:, i:i + 1].clone() for i in range(9, 12)]  # 64-byte aligned
    caches = r.new_caches(12)
    assert caches.length == 0
    logits, caches = r.prefill(1, 9, ids=r.tvm.runtime.from_dlpack(prompt), caches=caches)
    assert caches.length == 9 and tuple(logits.shape) == (1, 9, 32)  # every position's logits
    steps = []
    for tok in new:
        logits, caches = r.decode(caches, ids=r.tvm.runtime.from_dlpack(tok))
        steps.append(torch.from_dlpack(logits).clone())
    assert caches.length == 12
    for i in range(len(new)):
        whole, _ = r.prefill(1, 10 + i, ids=r.tvm.runtime.from_dlpack(ids[:, :10 + i].clone()))
        want = torch.from_dlpack(whole)[0, -1]
        assert float((steps[i][0, 0] - want).abs().max()) < 1e-4 * max(float(want.abs().max()), 1.0), i
    # a different token at the same position gives other logits: the check above can fail
    other, _ = r.prefill(1, 10, ids=r.tvm.runtime.from_dlpack(torch.cat([prompt, (new[0] + 1) % 32], 1)))
    assert float((torch.from_dlpack(other)[0, -1] - steps[0][0, 0]).abs().max()) > 1e-3


def test_paged_runner_serves_a_prompt_with_batch_prefill_when_the_build_says_last(cpu_paged_lib, tmp_path):
    """A library whose sidecar says logits "last" (the default build): the runner's prefill calls
    batch_prefill and returns the last position's logits, equal to that row of every position's."""
    import shutil

    import torch

    from mqa_byoc.runtime.paged_driver import PagedDecoderRunner

    last_lib = tmp_path / "tiny-last.paged-tir.so"
    shutil.copy(cpu_paged_lib, last_lib)
    meta = json.loads(Path(cpu_paged_lib + ".json").read_text())
    Path(str(last_lib) + ".json").write_text(json.dumps({**meta, "logits": "last"}))
    every, last = PagedDecoderRunner(cpu_paged_lib, device="cpu"), PagedDecoderRunner(str(last_lib), device="cpu")
    ids = torch.randint(0, 32, (1, 11), dtype=torch.int32)
    for n in (11, 5):  # a second length: the positions follow the prompt
        want, _ = every.prefill(1, n, ids=every.tvm.runtime.from_dlpack(ids[:, :n].clone()))
        got, caches = last.prefill(1, n, ids=last.tvm.runtime.from_dlpack(ids[:, :n].clone()))
        assert tuple(got.shape) == (1, 1, 32) and caches.length == n
        ref = torch.from_dlpack(want)[0, -1]
        assert float((torch.from_dlpack(got)[0, 0] - ref).abs().max()) < 1e-5 * max(float(ref.abs().max()), 1.0)
        # not the first position's: the check above can fail
        assert float((torch.from_dlpack(want)[0, 0] - ref).abs().max()) > 1e-3


def test_paged_runner_refuses_what_it_cannot_do(cpu_paged_lib, tmp_path):
    from mqa_byoc.runtime.paged_driver import PagedDecoderRunner

    r = PagedDecoderRunner(cpu_paged_lib, device="cpu")
    caches = r.new_caches(8)
    with pytest.raises(ValueError, match="batch must be 1"):
        r.prefill(2, 4, caches=caches)
    _, full = r.prefill(1, 4, caches=caches)
    with pytest.raises(ValueError, match="prefill needs an empty cache; this one holds 4 tokens"):
        r.prefill(1, 4, caches=full)
    other = tmp_path / "x.so"
    other.write_bytes(b"")
    (tmp_path / "x.so.json").write_text(json.dumps({"kv_cache": "inplace"}))
    with pytest.raises(ValueError, match="not a paged-cache library"):
        PagedDecoderRunner(str(other), device="cpu")


# ------------------------------------------------------------------------------------------ slow: the real build


@pytest.mark.slow
@pytest.mark.skipif(graphs.native_export_skip_reason() is not None, reason=str(graphs.native_export_skip_reason()))
def test_profile_build_paged_writes_the_pair(tmp_path, capsys):
    pytest.importorskip("tvm.relax")
    out = tmp_path / "arts"
    rc = cli.main(["profile", "build", "--kv-cache", "paged", "--preset", "llama3-8b", "--layers", "1", "--vocab",
                   "256", "--hidden-size", "256", "--intermediate-size", "512", "--out", str(out)])
    assert rc == 0
    said = capsys.readouterr().out
    assert f"python3 -m mqa_byoc.cli profile run {out}" in said and "page size 128" in said
    libs = profiling.find_libraries(str(out))
    assert [os.path.basename(p) for p in libs] == ["llama3-8b-scaled.paged-fa2.so", "llama3-8b-scaled.paged-tir.so"]
    metas = [json.loads(open(p + ".json").read()) for p in libs]
    for meta, mqa in zip(metas, (True, False)):
        assert meta["mqa"] is mqa and meta["kv_cache"] == "paged"
        assert meta["functions"] == ["prefill", "batch_prefill", "decode"]
        assert meta["paged_attention"] == ("fa2" if mqa else "tir") and meta["page_size"] == (128 if mqa else 16)
        assert (meta["num_heads"], meta["num_kv_heads"], meta["head_dim"], meta["num_layers"]) == (32, 8, 128, 1)
        assert meta["preset"] == "llama3-8b" and meta["vocab_size"] == 256 and meta["logits"] == "last"
        pc = meta["paged_config"]
        assert (pc["num_q_heads"], pc["num_kv_heads"], pc["head_dim"], pc["vocab"], pc["rope_mode"]) == \
            (32, 8, 128, 256, 1)
        names = [p[0] for p in meta["params"]]
        assert len(names) == len(set(names)) > 5 and "lm_head.weight" in names
    assert metas[0]["provider"] == "native" and "provider" not in metas[1]
    assert metas[0]["paged_served"] == ["batch_decode_paged_kv", "batch_prefill_paged_kv", "batch_prefill_ragged_kv",
                                        "tir_attention_merge_state"] and metas[1]["paged_served"] == []
    symbols = [subprocess.run(["nm", "-D", "--defined-only", p], capture_output=True, text=True).stdout for p in libs]
    for kind in ("prefill", "decode", "ragged", "merge"):
        assert f"__tvm_ffi_mqa_byoc_paged_{kind}_h32kv8d128p128_fp16" in symbols[0]
    assert "mqa_byoc_paged_" not in symbols[1]
    # TVM keeps the CUDA source in the library: the TIR library has TVM's paged decode kernel, the FA2 one not
    blobs = [open(p, "rb").read() for p in libs]
    assert b"batch_decode_paged_kv_kernel" not in blobs[0] and b"batch_decode_paged_kv_kernel" in blobs[1]


def test_the_png_of_a_paged_pair_says_so(tmp_path, monkeypatch):
    """The chart's title names the paged cache (its modes' labels are mqa=True / mqa=False as for the others)."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from mqa_byoc.runtime import kernel_plot
    from test_runtime_profile import synthetic_profile

    data = synthetic_profile()
    for rec in data["modes"].values():
        rec["kv_cache"] = "paged"
    titles = []
    original = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda fig, t, **kw: titles.append(t) or original(fig, t, **kw))
    kernel_plot.plot_profile(data, str(tmp_path / "p.png"))
    assert "(FA2 vs TVM's TIR attention), paged KV cache" in titles[0]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
