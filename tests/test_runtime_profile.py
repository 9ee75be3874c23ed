"""``mqa-byoc profile``: CLI, kernel tables, JSON records, the PNG, NVTX switches, runtime-only imports,
and (slow) a real ``profile build`` of a tiny decoder and the NVTX-instrumented dispatcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mqa_byoc import cli
from mqa_byoc.runtime import backends, kernel_plot, profiling, providers
from mqa_byoc.runtime.runner import SUMMARY_HEADER, KernelStat, kernel_summary, stat_row

FA_DECODE = ("void mqa_byoc_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
             "cutlass::half_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::half_t> >, true, false>(Flash_fwd_params)")
FA_COMBINE = ("void mqa_byoc_flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, "
              "false, cutlass::half_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::half_t> >, 4, 3, true>"
              "(Flash_fwd_params)")


def _subprocess(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
    )


def _has_cuda_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ CLI


def test_cli_parses_profile_commands():
    p = cli.build_parser()
    a = p.parse_args(["profile", "build", "--preset", "llama3-8b", "--layers", "2", "--out", "d", "--provider",
                      "python", "--kv-expand", "hf-broadcast", "--vocab", "512", "--dtype", "bfloat16"])
    assert (a.command, a.profile_command, a.preset, a.layers, a.out, a.provider, a.kv_expand, a.vocab, a.dtype) == \
        ("profile", "build", "llama3-8b", 2, "d", "python", "hf-broadcast", 512, "bfloat16")
    assert a.logits is None and a.arch == "sm_90" and a.hidden_size is None  # None: the cache's default
    assert a.projections == "fused"
    assert p.parse_args(["profile", "build", "--projections", "separate"]).projections == "separate"
    a = p.parse_args(["profile", "build"])
    assert (a.kv_cache, a.kv_expand, a.logits) == ("inplace", None, None)
    assert (a.preset, a.layers, a.provider, a.dtype, a.out) == ("codellama-34b", 4, "native", "float16",
                                                                 ".profile-artifacts")
    a = p.parse_args(["profile", "run", "arts", "--prompt-len", "4096", "--decode-steps", "8", "--json", "o.json",
                      "--png", "o.png", "--no-nvtx"])
    assert (a.dir, a.prompt_len, a.decode_steps, a.json, a.png, a.no_nvtx) == ("arts", 4096, 8, "o.json", "o.png", True)
    a = p.parse_args(["profile", "run", "arts"])
    assert (a.prompt_len, a.decode_steps, a.json, a.png, a.no_nvtx, a.no_cupti) == (2048, 32, None, None, False, False)
    assert p.parse_args(["profile", "run", "arts", "--no-cupti"]).no_cupti is True
    assert p.parse_args(["profile", "run", "arts", "--setup", "kit_boot"]).setup == ["kit_boot"]
    assert p.parse_args(["profile", "run", "arts"]).setup is None
    a = p.parse_args(["profile", "plot", "o.json", "--png", "o.png"])
    assert (a.json, a.png, a.top) == ("o.json", "o.png", 15)
    for bad in (["profile"], ["profile", "run"], ["profile", "plot", "o.json"],
                ["profile", "build", "--provider", "cutlass"], ["profile", "build", "--projections", "qkv"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(SystemExit):  # main() rejects what parse_known_args would let through
        cli.main(["profile", "run", "arts", "--bogus"])


def test_profile_build_defaults_of_the_inplace_cache(monkeypatch, tmp_path, capsys):
    """--kv-expand / --logits not given: the in-place and functional builds get repeat / last."""
    pytest.importorskip("tvm.relax")
    from mqa_byoc.models import decoder_libs

    calls = []
    monkeypatch.setattr(decoder_libs, "build_decoder_libraries", lambda config, out, **kw: calls.append(kw))
    out = str(tmp_path / "o")
    assert cli.main(["profile", "build", "--layers", "1", "--out", out]) == 0
    assert cli.main(["profile", "build", "--kv-cache", "functional", "--logits", "all", "--kv-expand", "native",
                     "--out", out]) == 0
    assert [(c["kv_cache"], c["kv_expand"], c["logits"]) for c in calls] == \
        [("inplace", "repeat", "last"), ("functional", "native", "all")]
    assert "inplace KV cache" in capsys.readouterr().out


@pytest.mark.skipif(_has_cuda_torch(), reason="checks the no-GPU message; this machine has a GPU")
def test_run_without_gpu_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["profile", "run", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU here" in err and "Traceback" not in err


def test_run_module_imports_without_tvm_relax(tmp_path):
    """What `profile run` imports works with a runtime-only TVM: tvm.relax and mqa_byoc.compiler blocked."""
    res = _subprocess(f"""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "tvm.relax" or name.startswith("tvm.relax.") or name.startswith("mqa_byoc.compiler"):
                    raise ImportError(f"blocked: {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        import mqa_byoc.runtime.profiling, mqa_byoc.runtime.kernel_plot, mqa_byoc.runtime.runner
        import mqa_byoc.runtime.paged_driver  # the PagedKVCache runner of `profile run`
        from mqa_byoc import cli
        rc = cli.main(["profile", "run", {str(tmp_path)!r}])  # no GPU here: exits 1; on a GPU: no libraries
        bad = [m for m in sys.modules if m == "tvm.relax" or m.startswith(("tvm.relax.", "mqa_byoc.compiler"))]
        assert not bad, bad
        assert "mqa_byoc.runtime.profiling" in sys.modules and "mqa_byoc.runtime.paged_driver" in sys.modules
        assert "mqa_byoc.models.paged_llama" not in sys.modules and "mqa_byoc.models.decoder_libs" not in sys.modules
        print("OK", rc)
    """)
    assert res.returncode == 0 and "OK 1" in res.stdout, res.stdout + res.stderr


# ------------------------------------------------------------------------------------------ tables and records


def test_kernel_summary_columns_and_values():
    stats = [KernelStat("small_kernel", [1.0, 2.0, 3.0]), KernelStat("big_kernel", [10.0, 30.0])]
    text = kernel_summary(stats)
    lines = text.splitlines()
    assert lines[0].split() == "Time (%) Total Time (ns) Instances Avg (ns) Med (ns) Min (ns) Max (ns) StdDev (ns) Name".split()
    assert SUMMARY_HEADER[-1] == "Name" and len(SUMMARY_HEADER) == 9
    assert set(lines[1].replace(" ", "")) == {"-"}
    big, small = lines[2].split(), lines[3].split()  # largest total first
    assert big == ["87.0", "40,000", "2", "20,000.0", "20,000.0", "10,000", "30,000", "10,000.0", "big_kernel"]
    assert small == ["13.0", "6,000", "3", "2,000.0", "2,000.0", "1,000", "3,000", "816.5", "small_kernel"]
    r = stat_row(stats[0])
    assert r["total_ns"] == pytest.approx(6000) and r["stddev_ns"] == pytest.approx(816.4966, rel=1e-4)


def test_phase_record_keeps_memory_ops_apart():
    stats = [KernelStat("NT_matmul_kernel", [100.0, 110.0]), KernelStat("Memcpy DtoD (Device -> Device)", [5.0]),
             KernelStat("Memset (Device)", [1.0])]
    rec = profiling.phase_record(stats, [0.002, 0.003], steps=2)
    assert [k["name"] for k in rec["kernels"]] == ["NT_matmul_kernel"]
    assert {m["name"] for m in rec["memory_ops"]} == {"Memcpy DtoD (Device -> Device)", "Memset (Device)"}
    assert rec["kernel_ms_per_step"] == pytest.approx(0.105)  # (100 + 110) us / 2 steps, memory ops excluded
    assert rec["wall_ms"] == [2.0, 3.0] and rec["wall_ms_median"] == 2.5


def _record(mode, decode_kernels, prefill_kernels, decode_wall, prefill_wall, steps=4):
    return {
        "library": f"m.{mode}.so", "mode": mode, "mqa": mode == "mqa", "preset": "codellama-34b", "num_layers": 4,
        "num_heads": 64, "num_kv_heads": 8, "head_dim": 128, "provider": "native", "dtype": "float16",
        "phases": {
            "prefill": profiling.phase_record([KernelStat(n, t) for n, t in prefill_kernels.items()], [prefill_wall], 1),
            "decode": profiling.phase_record([KernelStat(n, t) for n, t in decode_kernels.items()],
                                             [decode_wall] * steps, steps),
        },
        "decode_tokens_per_s": round(1 / decode_wall, 1),
    }


def synthetic_profile(n_extra=0):
    common = {"NT_matmul2_kernel": [88.0] * 16, FA_COMBINE: [9.5] * 16, "rms_norm_kernel": [2.3] * 36}
    common.update({f"fused_extra{i}_kernel": [0.5 + 0.1 * i] * 4 for i in range(n_extra)})
    mqa = _record("mqa", {**common, FA_DECODE: [22.0] * 16}, {"NT_matmul2_kernel": [900.0] * 4, FA_DECODE: [60.0] * 4},
                  0.00224, 0.030)
    rep = _record("repeat", {**common, FA_DECODE: [133.0] * 16, "repeat_kernel": [735.0] * 16},
                  {"NT_matmul2_kernel": [900.0] * 4, FA_DECODE: [80.0] * 4, "repeat_kernel": [400.0] * 8},
                  0.00513, 0.034)
    modes = {"mqa": mqa, "repeat": rep}
    return {"command": "mqa-byoc profile run x", "gpu": "NVIDIA H200", "prompt_len": 2048, "decode_steps": 4,
            "modes": modes, "comparison": profiling.compare(modes)}


def test_compare_finds_the_expansion_kernel():
    data = synthetic_profile()
    cmp = data["comparison"]
    assert cmp["decode_speedup"] == pytest.approx(5.13 / 2.24, rel=1e-3)
    assert list(cmp["decode_only_repeat"]) == ["repeat_kernel"]
    assert cmp["decode_only_repeat"]["repeat_kernel"] == pytest.approx(735.0 * 16 / 4)  # us per step
    assert cmp["decode_only_mqa"] == {} and "repeat_kernel" in cmp["prefill_only_repeat"]
    text = profiling.format_comparison(cmp, data["modes"])
    assert "decode kernels only with mqa=False: repeat_kernel" in text and "2.29x" in text


def test_format_record_prints_both_phases():
    data = synthetic_profile()
    text = profiling.format_record(data["modes"]["repeat"], 2048)
    assert text.startswith("== m.repeat.so: mqa=False, native provider, 4 layers, H=64 H_kv=8 D=128")
    assert text.count("Time (%)") == 2 and "repeat_kernel" in text
    assert "decode, 4 steps at context 2049..2052: median 5.130 ms/token" in text


def test_find_libraries(tmp_path):
    for name, meta in (("a.repeat.so", {"mqa": False}), ("a.mqa.so", {"mqa": True})):
        (tmp_path / name).write_bytes(b"")
        (tmp_path / (name + ".json")).write_text(json.dumps(meta))
    (tmp_path / "stray.so").write_bytes(b"")  # no sidecar: not a profile library
    assert [os.path.basename(p) for p in profiling.find_libraries(str(tmp_path))] == ["a.mqa.so", "a.repeat.so"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no libraries with sidecars"):
        profiling.find_libraries(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="profile build"):
        profiling.find_libraries(str(tmp_path / "missing"))


class _FakeEvent:
    device_type = "DeviceType.CUDA"

    def __init__(self, name, device_time):
        self.name, self.device_time = name, device_time


_SINK: list = []  # kernels "launched" by the fake runner, collected by the fake profiler


class _FakeProfile:
    def __init__(self, activities=None):
        self._events = []

    def __enter__(self):
        _SINK.clear()
        return self

    def __exit__(self, *exc):
        self._events = list(_SINK)
        return False

    def events(self):
        return self._events


class _FakeRunner:
    """Stands in for DecoderRunner (no GPU): each step 'launches' kernels into _SINK."""

    def __init__(self, lib_path):
        import torch

        with open(lib_path + ".json") as f:
            self.meta = json.load(f)
        self.torch, self.mqa = torch, self.meta["mqa"]

    def make_ids(self, batch, length):
        return ("ids", batch, length)

    def _launch(self, phase):
        ks = [("NT_matmul_kernel", 50.0), (FA_DECODE, 20.0 if self.mqa else 60.0), ("Memset (Device)", 1.0)]
        if not self.mqa:
            ks.append(("repeat_kernel", 900.0 if phase == "prefill" else 200.0))
        _SINK.extend(_FakeEvent(n, t) for n, t in ks)

    def new_caches(self, capacity):
        self.reserved = capacity  # made before the profiled region, room for prompt + steps
        return "empty caches"

    def prefill(self, batch, length, ids=None, caches=None):
        assert ids == ("ids", 1, length)  # made before the profiled region
        assert caches == "empty caches" and self.reserved >= length
        self._launch("prefill")
        return "logits", "caches"

    def decode(self, caches, batch=1, ids=None):
        assert ids == ("ids", 1, 1) and caches == "caches"
        self._launch("decode")
        return "logits", caches

    def run(self, prompt_len, steps, batch=1, nvtx=True):
        return {"prefill": [0.030 if self.mqa else 0.040], "decode": [0.002 if self.mqa else 0.005] * steps}, None

    def decode_loop_ms(self, prompt_len, steps):
        return 1.6 if self.mqa else 4.0


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Two sidecar'd libraries in tmp_path, a fake runner and profiler, torch.cuda patched; the NVTX ranges."""
    torch = pytest.importorskip("torch")
    import torch.profiler

    for name, meta in (("m.mqa.so", {"mqa": True, "provider": "native", "num_layers": 4}),
                       ("m.repeat.so", {"mqa": False, "provider": "native", "num_layers": 4})):
        (tmp_path / name).write_bytes(b"")
        (tmp_path / (name + ".json")).write_text(json.dumps(meta))
    ranges = []
    monkeypatch.setattr(profiling, "DecoderRunner", _FakeRunner)
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=0: "Fake H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i=0: type("P", (), {"major": 9, "minor": 0}))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: ranges.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    monkeypatch.setenv(profiling.NVTX_ENV_VAR, "x")
    monkeypatch.delenv(profiling.NVTX_ENV_VAR)  # unset now, restored after the test
    return ranges


def test_run_profile_glue(tmp_path, fake_gpu):
    """run_profile end to end with a fake runner and profiler: tables, comparison, NVTX, JSON, PNG."""
    ranges = fake_gpu
    printed = []
    png = tmp_path / "p.png"
    data = profiling.run_profile(str(tmp_path), 16, 3, warmup=1, png_path=str(png), command="mqa-byoc profile run x",
                                 printer=printed.append)
    text = "\n".join(printed)
    assert os.environ[profiling.NVTX_ENV_VAR] == "1" and data["nvtx_flash_attn"] is True
    assert ranges == ["prefill[16]", "decode[0]", "decode[1]", "decode[2]"] * 2  # profiled steps, both libraries
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["modes"].keys() == {"mqa", "repeat"} and saved["gpu"] == "Fake H200" and saved["sm"] == "sm_90"
    dec = saved["modes"]["mqa"]["phases"]["decode"]
    assert {k["name"]: k["instances"] for k in dec["kernels"]} == {"NT_matmul_kernel": 3, FA_DECODE: 3}
    assert [m["name"] for m in dec["memory_ops"]] == ["Memset (Device)"]
    assert dec["kernel_ms_per_step"] == pytest.approx(0.070) and dec["wall_ms_median"] == 2.0
    assert saved["modes"]["mqa"]["decode_tokens_per_s"] == 500.0
    assert saved["comparison"]["decode_speedup"] == 2.5
    assert saved["modes"]["mqa"]["decode_loop_tokens_per_s"] == 625.0  # back to back, CUDA events
    assert saved["comparison"]["decode_loop_tokens_per_s_ratio"] == 2.5
    assert "decode tokens/s (back to back): 625.0 with mqa=True vs 250.0 with mqa=False (2.50x)" in text
    assert saved["comparison"]["decode_only_repeat"] == {"repeat_kernel": 200.0}
    assert saved["comparison"]["prefill_only_repeat"] == {"repeat_kernel": 900.0}
    assert text.count("Time (%)") == 4 and "== m.mqa.so: mqa=True, native provider, 4 layers" in text
    assert "decode kernels only with mqa=False: repeat_kernel 200.0 us/step" in text
    if kernel_plot_available():
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "mqa-byoc profile plot" in text


def test_run_profile_without_cupti(tmp_path, fake_gpu):
    printed = []
    data = profiling.run_profile(str(tmp_path), 16, 3, cupti=False, png_path=str(tmp_path / "p.png"),
                                 printer=printed.append)
    assert fake_gpu == []  # no profiled run (the fake runner's timed runs push no ranges)
    assert data["cupti"] is False and data["modes"]["mqa"]["phases"]["decode"]["kernels"] == []
    assert data["modes"]["repeat"]["phases"]["decode"]["wall_ms"] == [5.0, 5.0, 5.0]
    assert data["comparison"]["decode_speedup"] == 2.5
    text = "\n".join(printed)
    assert text.count("(no kernels recorded: run without --no-cupti)") == 4 and "Traceback" not in text
    assert not (tmp_path / "p.png").exists()


def test_run_profile_rejects_decode_only_libraries(tmp_path, fake_gpu):
    (tmp_path / "m.mqa.so.json").write_text(json.dumps({"mqa": True, "functions": ["decode"]}))  # a decode-only build
    with pytest.raises(profiling.ProfileError, match=r"m.mqa.so has only \['decode'\]"):
        profiling.run_profile(str(tmp_path), 16, 3, printer=lambda _m: None)


def kernel_plot_available():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------ the PNG


@pytest.mark.parametrize("name, short", [
    (FA_DECODE, "flash_fwd_splitkv_kernel<128,64,128,4>"),
    (FA_COMBINE, "flash_fwd_splitkv_combine_kernel<128,64,128,4>"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<unsigned int, 4, at::nat",
     "distribution_elementwise_grid_stride_kernel<4>"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::direct_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#8}>(at::TensorIteratorBase&)>(int)",
     "elementwise_kernel<128,4>"),
    ("NT_matmul_kernel", "NT_matmul_kernel"),
])
def test_short_name(name, short):
    assert kernel_plot.short_name(name) == short


def test_short_name_is_bounded():
    s = kernel_plot.short_name("fused_reshape4_split_tir_negative_concatenate1_multiply1_multiply1_add_kernel", width=30)
    assert len(s) == 30 and s.endswith("\u2026")


def test_series_ranks_by_either_mode_and_sums_the_rest():
    data = synthetic_profile(n_extra=12)
    names, labels, values = kernel_plot.series(data, "decode", top=4)
    # repeat_kernel (mqa=False only) and the FA2 kernel (larger with mqa=False) rank by their larger time
    assert names[:4] == ["repeat_kernel", FA_DECODE, "NT_matmul2_kernel", FA_COMBINE]
    assert labels[1] == "flash_fwd_splitkv_kernel<128,64,128,4>"
    assert values["mqa"][0] == 0.0 and values["repeat"][0] == pytest.approx(735.0 * 16 / 4)
    assert values["mqa"][1] == pytest.approx(22.0 * 16 / 4) and values["repeat"][1] == pytest.approx(133.0 * 16 / 4)
    assert names[-1] == "other" and labels[-1] == "other (13 kernels)"  # rms_norm + 12 extras
    extras = sum((0.5 + 0.1 * i) * 4 / 4 for i in range(12)) + 2.3 * 36 / 4
    assert values["mqa"][-1] == pytest.approx(extras) and values["repeat"][-1] == pytest.approx(extras)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    data = synthetic_profile(n_extra=20)
    js, png = tmp_path / "profile.json", tmp_path / "profile.png"
    js.write_text(json.dumps(data))
    assert cli.main(["profile", "plot", str(js), "--png", str(png)]) == 0
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
    # the chart has two panels: taller than a one-panel chart of the decode phase alone
    one = json.loads(js.read_text())
    for rec in one["modes"].values():
        rec["phases"]["prefill"]["kernels"] = []
    kernel_plot.plot_profile(one, str(tmp_path / "one.png"))
    from PIL import Image  # matplotlib depends on pillow

    assert Image.open(png).size[1] > Image.open(tmp_path / "one.png").size[1]


def test_no_matplotlib_never_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    data = synthetic_profile()
    with pytest.raises(kernel_plot.MatplotlibMissing, match="matplotlib is not installed"):
        kernel_plot.plot_profile(data, str(tmp_path / "x.png"))
    said = []
    assert profiling.write_png(data, "out/profile.json", str(tmp_path / "x.png"), printer=said.append) is False
    assert not (tmp_path / "x.png").exists()
    assert "mqa-byoc profile plot out/profile.json --png x.png" in said[0]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(data))
    assert cli.main(["profile", "plot", str(js), "--png", str(tmp_path / "y.png")]) == 1


# ------------------------------------------------------------------------------------------ NVTX (Python provider)


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), (" ON ", True), ("", False), ("0", False),
                                       ("false", False), ("Off", False), ("no", False)])
def test_nvtx_switch(value, on):
    assert providers.nvtx_requested(value) is on


class _FakeTensor:
    def __init__(self, shape):
        self.shape = shape
        self.device = type("Dev", (), {"index": 0, "type": "cuda"})()


class _FakeTorch:
    Tensor = _FakeTensor

    def __init__(self, log):
        nvtx = type("Nvtx", (), {"range_push": staticmethod(lambda name: log.append(("push", name))),
                                 "range_pop": staticmethod(lambda: log.append(("pop",)))})
        self.cuda = type("Cuda", (), {"nvtx": nvtx, "current_stream": staticmethod(lambda _i: "s"),
                                      "current_device": staticmethod(lambda: 0)})


class _FakeBackend:
    name = "fake"

    def __init__(self, log, fail=False):
        self.torch, self.log, self.fail = _FakeTorch(log), log, fail

    def stream_for(self, _index):
        return "s"

    def run(self, *args):
        self.log.append(("run",))
        if self.fail:
            raise RuntimeError("kernel failed")


@pytest.mark.parametrize("env, expect", [("1", [("push", "flash_attn[h=64,kv=8,d=128]"), ("run",), ("pop",)]),
                                         ("0", [("run",)])])
def test_provider_nvtx_range_around_the_kernel(monkeypatch, env, expect):
    log = []
    monkeypatch.setenv(providers.NVTX_ENV_VAR, env)
    monkeypatch.setattr(providers, "_check", lambda *a: None)
    providers.reset()
    monkeypatch.setattr(backends, "_backend", _FakeBackend(log))
    q, kv = _FakeTensor((1, 1, 64, 128)), _FakeTensor((1, 2048, 8, 128))
    try:
        providers.flash_attn_forward(q, kv, kv, q, 0.088, False, -1, -1)
        assert log == expect
        # the switch is read once: changing the environment does not matter until reset()
        monkeypatch.setenv(providers.NVTX_ENV_VAR, "0" if env == "1" else "1")
        log.clear()
        providers.flash_attn_forward(q, kv, kv, q, 0.088, False, -1, -1)
        assert log == expect
    finally:
        providers.reset()


def test_provider_nvtx_range_is_closed_when_the_kernel_fails(monkeypatch):
    log = []
    monkeypatch.setenv(providers.NVTX_ENV_VAR, "1")
    monkeypatch.setattr(providers, "_check", lambda *a: None)
    providers.reset()
    monkeypatch.setattr(backends, "_backend", _FakeBackend(log, fail=True))
    q, kv = _FakeTensor((1, 16, 32, 64)), _FakeTensor((1, 16, 1, 64))
    try:
        with pytest.raises(RuntimeError, match="kernel failed"):
            providers.flash_attn_forward(q, kv, kv, q, 0.125, True, -1, -1)
        assert log == [("push", "flash_attn[h=32,kv=1,d=64]"), ("run",), ("pop",)]
    finally:
        providers.reset()


# ------------------------------------------------------------------------------------------ slow: real builds


def _native_toolchain():
    from mqa_byoc import kernels as K

    try:
        K.find_nvcc()
        return K.flash_attn_source(download=False, progress=lambda _m: None)
    except K.NativeKernelsUnavailable:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_native_toolchain() is None, reason="nvcc or flash-attn sources not available offline")
def test_dispatcher_has_the_nvtx_ranges(monkeypatch, tmp_path):
    from mqa_byoc import kernels as K

    monkeypatch.setenv("MQA_BYOC_FLASH_ATTN_SRC", str(_native_toolchain()))
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MQA_BYOC_KERNEL_DIR", raising=False)
    obj = K.build_dispatcher(progress=None)
    assert obj.parent == tmp_path / "cache" / "fa2" / "dispatch"
    blob = obj.read_bytes()
    assert b"MQA_BYOC_NVTX" in blob and b"flash_attn[h=%lld,kv=%lld,d=%lld]" in blob
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert "nvtxRangePushA" in syms  # NVTX3's header-only API is compiled in
    # the cache name follows the source: a changed dispatcher is rebuilt, never an old object reused
    src = (K.NATIVE_DIR / "fa2_dispatch.cc").read_bytes()
    monkeypatch.setattr(K.paths, "DISPATCH_SOURCE", tmp_path / "fa2_dispatch.cc")
    (tmp_path / "fa2_dispatch.cc").write_bytes(src + b"\n// changed\n")
    assert K.cache.dispatcher_name() != obj.name


@pytest.mark.skipif(_native_toolchain() is None, reason="nvcc or flash-attn sources not available offline")
def test_paged_entries_open_nvtx_ranges(monkeypatch):
    """The PagedKVCache entries (fa2_paged.cu) name their calls through the dispatcher's NVTX switch."""
    from mqa_byoc.compiler.paged.build import paged_object

    monkeypatch.setenv("MQA_BYOC_FLASH_ATTN_SRC", str(_native_toolchain()))
    obj = paged_object("sm_90", progress=None)
    blob = obj.read_bytes()
    assert b"flash_attn_paged[h=%lld,kv=%lld,d=%lld]" in blob and b"flash_attn_ragged[h=%lld,kv=%lld,d=%lld]" in blob
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert "U mqa_byoc_fa2_nvtx_push" in syms and "U mqa_byoc_fa2_nvtx_pop" in syms


@pytest.mark.slow
def test_profile_build_writes_both_libraries(tmp_path, capsys):
    pytest.importorskip("tvm.relax")
    out = tmp_path / "arts"
    rc = cli.main(["profile", "build", "--preset", "llama3-8b", "--layers", "1", "--vocab", "256", "--hidden-size",
                   "256", "--intermediate-size", "512", "--provider", "python", "--out", str(out)])
    assert rc == 0
    assert f"python3 -m mqa_byoc.cli profile run {out}" in capsys.readouterr().out
    libs = profiling.find_libraries(str(out))
    assert [os.path.basename(p) for p in libs] == ["llama3-8b-scaled.mqa.so", "llama3-8b-scaled.repeat.so"]
    metas = [json.loads(open(p + ".json").read()) for p in libs]
    for meta, mqa in zip(metas, (True, False)):
        assert meta["mqa"] is mqa and meta["provider"] == "python" and meta["functions"] == ["prefill", "decode"]
        assert meta["kv_cache"] == "inplace"  # the default: both modes on TVM's in-place cache
        assert (meta["num_heads"], meta["num_kv_heads"], meta["head_dim"], meta["num_layers"]) == (32, 8, 128, 1)
        assert meta["preset"] == "llama3-8b" and meta["vocab_size"] == 256 and meta["hidden_size"] == 256
        names = [p[0] for p in meta["params"]]
        assert len(names) == len(set(names)) > 5 and all(len(p[1]) >= 1 for p in meta["params"])
        # mlc-llm's fused projections by default (--projections separate: HF's five)
        assert meta["fused_projections"] is True
        assert {"layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight"} <= set(names)
    # one attention per function (prefill, decode) in the one layer, offloaded with native K/V heads or not
    assert metas[0]["offloaded"] == {"flash_attn.attention_mqa": 2}
    assert metas[1]["offloaded"] == {"flash_attn.attention": 2}
    # TVM keeps the CUDA source in the library: the K/V expansion kernel exists only in the baseline
    blobs = [open(p, "rb").read() for p in libs]
    assert b"repeat_kernel" not in blobs[0] and b"repeat_kernel" in blobs[1]
    assert all(b"mqa_byoc.flash_attn_forward" in b for b in blobs)  # the Python provider's entry point
