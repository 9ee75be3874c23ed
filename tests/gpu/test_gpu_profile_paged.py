"""``mqa-byoc profile`` on TVM's PagedKVCache, on the GPU: the pair that ``profile build --kv-cache paged``
makes computes the same decoder (RoPE by the cache, mode NORMAL, which the paged-attention test's builds
leave out; FA2 matches TIR or is the nearer to an fp32 torch decoder), and ``profile run`` of it records FA2's kernels for ``mqa=True`` and TVM's TIR attention
kernels for ``mqa=False``.

Artifacts, built on the build machine and copied to the GPU machine as ``.gpu-artifacts/profile-paged``:

    MQA_BYOC_KERNEL_DIR=<prebuilt FA2 objects> python -m mqa_byoc.cli profile build --kv-cache paged \\
        --preset codellama-34b --layers 2 --vocab 4096 --hidden-size 2048 --intermediate-size 4096 \\
        --out .gpu-artifacts/profile-paged
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import gpu_common
from mqa_byoc.testing.cupti import is_attention_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".gpu-artifacts" / "profile-paged"
sys.path.insert(0, str(ROOT / "src"))  # the package from this checkout (a runtime-only GPU machine need not install it)
TOL = 2e-2  # max |err| / max |logits|, fp16 decoder of two layers (the paged decoder test measured 0.006)
PROMPT, STEPS = 300, 3  # 300: not a multiple of either page size (16, 128)


def _libraries() -> list[str]:
    from mqa_byoc.runtime.profiling import find_libraries

    try:
        return find_libraries(str(ARTIFACTS), "paged")
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def env():
    if gpu_common.skip_reason():  # no torch, or no CUDA GPU
        pytest.skip(gpu_common.skip_reason())
    import torch
    if os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        from mqa_byoc.deploy import prepare_runtime

        prepare_runtime()  # the runtime kit's set-up: CUDA runtime + nvcc hook
    if len(_libraries()) != 2:
        pytest.skip(f"no paged pair in {ARTIFACTS}: build it with the command in this file's docstring")
    import tvm
    import tvm.runtime.vm  # noqa: F401

    return tvm, torch


def _rel(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.mark.gpu
def test_profile_pair_computes_the_same_decoder(env):
    """Same random weights, same tokens: prefill (last position) and decode logits of the FA2 and TIR
    libraries, against each other and against the fp32 torch decoder with RoPE (``DecoderReference``):
    where they differ beyond the tolerance, FA2 must be the nearer to the oracle."""
    from mqa_byoc.runtime.paged_driver import DecoderReference, PagedDecoderRunner

    _tvm, torch = env
    fa2_path, tir_path = _libraries()
    runners = [PagedDecoderRunner(p, seed=0) for p in (fa2_path, tir_path)]
    assert [r.meta["paged_attention"] for r in runners] == ["fa2", "tir"]
    vocab = runners[0].meta["vocab_size"]
    ids = torch.randint(0, vocab, (1, PROMPT + STEPS), dtype=torch.int32, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    prompt = ids[:, :PROMPT].clone()
    tokens = [ids[:, PROMPT + i:PROMPT + i + 1].clone() for i in range(STEPS)]  # clones: 64-byte aligned
    logits = []
    for r in runners:
        out, caches = r.prefill(1, PROMPT, ids=r.tvm.runtime.from_dlpack(prompt), caches=r.new_caches(PROMPT + STEPS))
        seq = [torch.from_dlpack(out)[0, -1].clone()]
        for t in tokens:
            out, caches = r.decode(caches, ids=r.tvm.runtime.from_dlpack(t))
            seq.append(torch.from_dlpack(out)[0, 0].clone())
        torch.cuda.synchronize()
        logits.append(seq)
    assert all(torch.isfinite(x).all() for x in logits[0])
    ref = DecoderReference(torch, runners[0].meta["paged_config"], runners[0].model.weights)
    seq = [PagedDecoderRunner.SEQ]
    want = [ref.step(seq, [PROMPT], prompt)[0, -1]] + [ref.step(seq, [1], t)[0, 0] for t in tokens]
    errs = {"fa2_vs_tir": [_rel(a, b) for a, b in zip(*logits)],
            "fa2": [_rel(a, w) for a, w in zip(logits[0], want)], "tir": [_rel(a, w) for a, w in zip(logits[1], want)]}
    print(f"logits (prefill, decode...) max |err| / max |ref|: {errs}")
    for i, (f_t, f_ref, t_ref) in enumerate(zip(errs["fa2_vs_tir"], errs["fa2"], errs["tir"])):
        assert f_t < TOL or f_ref <= t_ref, f"step {i}: FA2 vs TIR {f_t:.4f} and FA2 farther from the fp32 decoder: {errs}"


@pytest.mark.gpu
def test_profile_run_records_each_sides_attention(env, tmp_path):
    from mqa_byoc.runtime.profiling import run_profile

    printed = []
    data = run_profile(str(ARTIFACTS), PROMPT, 4, warmup=1, json_path=str(tmp_path / "p.json"),
                       png_path=str(tmp_path / "p.png"), kv_cache="paged", printer=printed.append)
    text = "\n".join(printed)
    assert data["kv_cache"] == "paged" and set(data["modes"]) == {"mqa", "repeat"}
    names = {m: {ph: [k["name"] for k in data["modes"][m]["phases"][ph]["kernels"]] for ph in ("prefill", "decode")}
             for m in data["modes"]}
    for ph in ("prefill", "decode"):
        assert any(is_attention_kernel(n) for n in names["mqa"][ph]), (ph, names["mqa"][ph])
        assert not any("batch_prefill" in n or "batch_decode" in n for n in names["mqa"][ph]), names["mqa"][ph]
        assert not any(is_attention_kernel(n) for n in names["repeat"][ph]), names["repeat"][ph]
    assert any("batch_decode_paged_kv" in n for n in names["repeat"]["decode"])
    assert any("batch_prefill_ragged_kv" in n for n in names["repeat"]["prefill"])
    assert any("batch_decode_paged_kv" in n for n in data["comparison"]["decode_only_repeat"])
    for rec in data["modes"].values():
        assert rec["decode_loop_tokens_per_s"] > 0 and len(rec["phases"]["decode"]["wall_ms"]) == 4
    ours = "FA4 and FA2" if data["modes"]["mqa"].get("provider") == "hopper" else "FA2"
    assert f"paged KV cache: attention on {ours} vs on TVM's TIR kernels" in text
    assert json.loads((tmp_path / "p.json").read_text())["comparison"] == data["comparison"]
