"""``mqa-byoc demo``, the README's first command: on a machine without a GPU and without built FA2
kernels it partitions, builds, exports and says what it did not do, compiling no kernel."""

from __future__ import annotations

import numpy as np
import pytest

from mqa_byoc import cli
from mqa_byoc.contract import PY_FORWARD_FUNC
from mqa_byoc.demo import choose_provider
from mqa_byoc.kernels import KernelKey

KEYS = [KernelKey(head_dim=128, dtype="fp16", causal=False, split=False)]


def _never():
    raise AssertionError("the kernel check must not run here")


def test_choose_provider():
    # asked for: no kernel check
    assert choose_provider("python", gpu=True, build_kernels=False, missing_kernels=_never) == ("python", False, None)
    assert choose_provider("native", gpu=False, build_kernels=False, missing_kernels=_never) == ("native", True, None)
    # a GPU machine gets the full run
    assert choose_provider("auto-native", gpu=True, build_kernels=False, missing_kernels=_never) == \
        ("native", True, None)
    assert choose_provider("auto-native", gpu=False, build_kernels=True, missing_kernels=_never) == \
        ("native", True, None)
    # no GPU: native only with the kernels already built
    assert choose_provider("auto-native", gpu=False, build_kernels=False, missing_kernels=lambda: []) == \
        ("native", False, None)
    provider, compile_, why = choose_provider("auto-native", gpu=False, build_kernels=False,
                                              missing_kernels=lambda: KEYS)
    assert (provider, compile_) == ("python", False)
    assert "1 FA2 kernel file(s) not built (hdim128 fp16" in why and "mqa-byoc demo --build-kernels" in why
    provider, _, why = choose_provider("auto-python", gpu=True, build_kernels=False, missing_kernels=_never)
    assert provider == "python" and "no nvcc" in why


def test_cli_parses_demo():
    a = cli.build_parser().parse_args(["demo", "--build-kernels", "--layers", "1"])
    assert (a.build_kernels, a.layers, a.provider) == (True, 1, "auto")
    assert cli.build_parser().parse_args(["demo"]).build_kernels is False


@pytest.mark.parametrize("argv, message", [
    (["demo", "--preset", "llama5"], "invalid choice: 'llama5'"),
    (["demo", "--layers", "0"], "--layers: must be at least 1, got 0"),
    (["demo", "--prompt-len", "-4"], "--prompt-len: must be at least 1, got -4"),
    (["profile", "build", "--layers", "two"], "--layers: expected an integer, got 'two'"),
    (["profile", "build", "--preset", "gpt4"], "invalid choice: 'gpt4'"),
    (["profile", "build", "--vocab", "0"], "--vocab: must be at least 1"),
    (["profile", "build", "--kernel-options", "gemm_gemv=fast"],
     "gemm_gemv='fast': expected one of ('measure', 'off', 'always')"),
    (["profile", "run", "DIR", "--decode-steps", "0"], "--decode-steps: must be at least 1"),
])
def test_cli_refuses_bad_sizes_and_presets_with_a_usage_error(argv, message, capsys):
    """A preset that does not exist or a size below 1 is a usage error naming the argument, before any build
    (a decoder of 0 layers used to build)."""
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_decoder_config_refuses_sizes_below_one():
    import dataclasses

    from mqa_byoc.models import presets

    config = presets.get_preset("llama3-8b")
    assert dataclasses.replace(config, num_layers=np.int64(2)).num_layers == 2  # numpy integers are integers
    for field, value in (("num_layers", 0), ("num_kv_heads", -1), ("vocab_size", 2.5), ("head_dim", True)):
        with pytest.raises(ValueError, match=f"{field} must be an integer of at least 1"):
            dataclasses.replace(config, **{field: value})


@pytest.mark.slow
def test_demo_quick_path(tmp_path, monkeypatch, capsys):
    """The whole command, small (1 layer), with an empty kernel cache: python provider, library exported."""
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("a GPU machine runs the full demo (native kernels, prefill + decode)")
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MQA_BYOC_KERNEL_DIR", raising=False)
    assert cli.main(["demo", "--layers", "1", "--vocab", "256", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "attention sites found: 2; offloaded: 2 (2 with native K/V heads)" in out
    assert "kernel provider: python" in out
    assert "Not done here:" in out and "run: no CUDA GPU here" in out
    from mqa_byoc.compiler.provider import default_provider

    if default_provider("cuda") == "native":  # nvcc here: the native library was skipped, saying how to get it
        assert "FA2 kernel file(s) not built" in out and "--build-kernels" in out
    # no FA2 kernel compiled: the one object is the cuBLASLt dispatcher of the offloaded GEMMs (host code)
    objects = list((tmp_path / "cache").rglob("*.o")) if (tmp_path / "cache").exists() else []
    assert all(p.parent.name == "cublaslt" for p in objects), objects
    assert "GEMM sites:" in out and "-> cuBLASLt: cublaslt.matmul_transposed" in out
    lib = tmp_path / "out" / "codellama-34b-mqa.so"
    assert lib.stat().st_size > 0
    # the python provider's forwarder is in it, calling the registered FA2 function
    assert PY_FORWARD_FUNC.encode() in lib.read_bytes()
