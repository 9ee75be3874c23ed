"""mqa_byoc.kernels: TVM-free import, the build-kernels command line and dry run, the locked manifest.

Nothing here compiles a kernel; runs on CPU without nvcc (the dry-run tests say what they need).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mqa_byoc import kernels as K
from mqa_byoc.cli import build_kernels_request, build_parser, main
from mqa_byoc.kernels import BuildRequest, KernelKey

SRC = Path(__file__).resolve().parent.parent / "src"


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC)] + sys.path))


# ------------------------------------------------------------------------------------ import without TVM


def test_kernels_and_build_kernels_command_work_with_tvm_blocked(tmp_path):
    """The GPU machine has no TVM compiler: importing the package and running build-kernels must not touch tvm."""
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "tvm" or name.startswith("tvm.") or name == "tvm_ffi":
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import mqa_byoc.kernels, mqa_byoc.cli
        rc = mqa_byoc.cli.main(["build-kernels", "--arch", "sm_90", "--head-dims", "64", "--dtypes", "fp16",
                                "--dry-run"])
        assert rc == 0, rc
        bad = [m for m in sys.modules if m.split(".")[0] in ("tvm", "tvm_ffi")]
        assert not bad, bad
        print("OK")
        """
    )
    env = dict(_env(), MQA_BYOC_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("OK") and "hdim64 fp16 causal split" in r.stdout


def test_python_m_mqa_byoc_kernels_is_build_kernels(tmp_path):
    env = dict(_env(), MQA_BYOC_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "mqa_byoc.kernels", "--head-dims", "32", "--dtypes", "bf16",
                        "--causal", "no", "--split", "no", "--dry-run"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "kernels (1): hdim32 bf16" in r.stdout


def test_explicit_exports():
    assert dir(K) == sorted(K.__all__)
    for name in K.__all__:
        assert getattr(K, name) is not None, name
    # one definition of each fact: the package re-exports, it does not copy
    assert K.find_nvcc is K.toolchain.find_nvcc and K.KernelKey is K.keys.KernelKey


# ------------------------------------------------------------------------------------ command line


def _parse(*argv):
    return build_kernels_request(build_parser().parse_args(["build-kernels", *argv]))


def test_readme_build_kernels_command_parses():
    req = _parse("--arch", "sm_90", "--head-dims", "128", "--dtypes", "fp16,bf16")
    assert req == BuildRequest(arch="sm_90", head_dims=(128,), dtypes=("fp16", "bf16"))
    assert req.keys() == K.keys_for([128], ["fp16", "bf16"]) and len(req.keys()) == 8


def test_build_kernels_options():
    req = _parse("--head-dims", "80,64", "--dtypes", "float16", "--causal", "no", "--split", "yes", "-j", "3",
                 "--nice", "5", "--out", "/tmp/x", "--link-check", "--flash-attn-src", "/src", "--dry-run")
    assert req.head_dims == (80, 64) and req.causal == (False,) and req.split == (True,)
    assert (req.jobs, req.nice, req.out, req.link_check, req.flash_attn_src, req.dry_run) == (
        3, 5, "/tmp/x", True, "/src", True)
    assert req.keys() == (KernelKey(64, "fp16", False, True), KernelKey(96, "fp16", False, True))
    assert _parse("--jobs", "2", "--nice").nice == 10 and _parse().nice == 0  # README: `--jobs 2 --nice`


@pytest.mark.parametrize("argv", [["--causal", "sometimes"], ["--head-dims", "x"], ["--head-dims", ","],
                                  ["--arch"], ["--bogus"]])
def test_build_kernels_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["build-kernels", *argv])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_build_kernels_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["build-kernels", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for opt in ("--arch", "--head-dims", "--dtypes", "--causal", "--split", "--jobs", "--out", "--dry-run"):
        assert opt in out


# ------------------------------------------------------------------------------------ dry run


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MQA_BYOC_KERNEL_DIR", raising=False)
    monkeypatch.delenv("MQA_BYOC_FLASH_ATTN_SRC", raising=False)
    return tmp_path


def test_dry_run_without_nvcc_says_what_blocks(empty_cache, monkeypatch, capsys):
    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    assert main(["build-kernels", "--arch", "sm_90", "--head-dims", "128", "--dtypes", "fp16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "blocked: nvcc not found" in out
    assert "hdim128 fp16 causal split: to compile (needs nvcc)" in out
    assert "--no-build-isolation flash-attn==2.8.3" in out  # the pip fetch it would run
    assert not (empty_cache / "cache").exists()  # nothing written


@pytest.mark.skipif(not K.nvcc_available(), reason="nvcc not found (CUDA toolkit not installed)")
def test_dry_run_prints_cache_dir_and_nvcc_commands(empty_cache, capsys):
    assert main(["build-kernels", "--arch", "sm_90", "--head-dims", "64", "--dtypes", "bf16", "--causal", "yes",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    cfg = K.build_config("sm_90", download=False, progress=None, need_sources=False)
    assert f"cache dir: {cfg.dir}" in out
    assert f"-DMQA_BYOC_ENTRY=mqa_byoc_fa2_fwd_split_hdim64_bf16_causal" in out
    assert f"-o {cfg.dir / 'fwd_hdim64_bf16_causal.o'}" in out
    assert "dispatcher: compile" in out and K.cache.dispatcher_name() in out
    assert not (empty_cache / "cache").exists()


def test_dry_run_finds_prebuilt_objects(empty_cache, monkeypatch, capsys):
    d = empty_cache / "prebuilt" / "sm_90-abc"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text('{"arch": "sm_90"}')
    for k in K.keys_for([64], ["fp16"]):
        (d / f"{k.stem}.o").write_bytes(b"")
    (d / K.cache.dispatcher_name()).write_bytes(b"")
    monkeypatch.setenv("MQA_BYOC_KERNEL_DIR", str(empty_cache / "prebuilt"))
    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    assert main(["build-kernels", "--arch", "sm_90", "--head-dims", "64", "--dtypes", "fp16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"hdim64 fp16 causal split: found {d / 'fwd_split_hdim64_fp16_causal.o'}" in out
    assert f"dispatcher: found {d / K.cache.dispatcher_name()}" in out


# ------------------------------------------------------------------------------------ manifest lock


def _hammer_manifest(directory: str, worker: int, n: int) -> None:
    from mqa_byoc.kernels.cache import update_manifest

    for i in range(n):
        update_manifest(Path(directory), {"arch": "sm_90", "last": worker},
                        {"kernels": {f"w{worker}-{i}": {"file": f"{worker}_{i}.o"}}})


def test_concurrent_manifest_updates_lose_nothing(tmp_path):
    """Several build-kernels processes record objects in one cache dir at once: every entry survives."""
    workers, n = 4, 40
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer_manifest, args=(str(tmp_path), w, n)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    data = json.loads((tmp_path / "manifest.json").read_text())
    expected = {f"w{w}-{i}" for w in range(workers) for i in range(n)}
    assert set(data["kernels"]) == expected
    assert data["arch"] == "sm_90" and data["last"] in range(workers)
    assert (tmp_path / "manifest.json.lock").is_file()
    assert not list(tmp_path.glob(".manifest.json.*.tmp"))


def test_manifest_updates_from_threads_lose_nothing(tmp_path):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda w: _hammer_manifest(str(tmp_path), w, 25), range(4)))
    assert len(K.read_manifest(tmp_path)["kernels"]) == 100


def test_codegen_default_provider_uses_the_one_nvcc_lookup(monkeypatch, tmp_path):
    pytest.importorskip("tvm")
    from mqa_byoc.compiler.provider import default_provider

    monkeypatch.setenv("MQA_BYOC_NVCC", "")  # authoritative: no nvcc, whatever PATH holds
    assert default_provider(None, native=True) == "python"
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MQA_BYOC_NVCC", str(fake))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert default_provider(None, native=True) == "native"
