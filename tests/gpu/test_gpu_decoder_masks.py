"""Decoders whose masks are built from symbolic lengths, offloaded to FA2 (mqa=True, native provider),
against the same graph lowered by TVM alone: prefill past the sliding window, then decode steps.
Artifacts: ``python tools/gpu/build_decoders.py`` (see tests/gpu/README.md)."""

from __future__ import annotations

import json
import os

import pytest

import gpu_common

ARTIFACTS = gpu_common.ROOT / ".gpu-artifacts" / "decoders"
PROMPT = 40  # longer than the windowed case's window (24)
DECODE_STEPS = 3


def _manifest():
    path = ARTIFACTS / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


MANIFEST = _manifest()


@pytest.fixture(scope="module")
def runners(rt):
    if not MANIFEST:
        pytest.skip(f"no artifacts in {ARTIFACTS}: run `python tools/gpu/build_decoders.py` on the "
                    "build machine and carry .gpu-artifacts/decoders")
    from mqa_byoc.runtime.runner import DecoderRunner

    return {(name, variant): DecoderRunner(os.path.join(ARTIFACTS, f), seed=0)
            for name, case in MANIFEST.items() for variant, f in case["files"].items()}


def _steps(rt, runner, ids):
    """prefill(ids[:, :PROMPT]) then one decode step per remaining id: logits (float32) and caches."""
    torch, tvm = rt.torch, rt.tvm
    batch = ids.shape[0]
    out, caches = runner.prefill(batch, PROMPT, ids=tvm.runtime.from_dlpack(ids[:, :PROMPT].clone()))
    logits = [torch.from_dlpack(out).clone()]
    for t in range(PROMPT, ids.shape[1]):
        out, caches = runner.decode(caches, batch, ids=tvm.runtime.from_dlpack(ids[:, t:t + 1].clone()))
        logits.append(torch.from_dlpack(out).clone())
    return logits, [torch.from_dlpack(caches[i]).clone() for i in range(len(caches))]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MANIFEST) or ["(no artifacts)"])
def test_offloaded_decoder_matches_tvm(rt, runners, name):
    torch = rt.torch
    mqa, ref = runners[(name, "mqa")], runners[(name, "reference")]
    for a, b in zip(mqa._keep, ref._keep):  # same seed, same device: the same weights
        assert torch.equal(a, b)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, mqa.meta["vocab_size"], (2, PROMPT + DECODE_STEPS), generator=g, device="cuda",
                        dtype=torch.int32)
    got_logits, got_caches = _steps(rt, mqa, ids)
    want_logits, want_caches = _steps(rt, ref, ids)
    errors = []
    for step, (g_l, w_l) in enumerate(zip(got_logits, want_logits)):
        assert g_l.shape == w_l.shape and torch.isfinite(g_l).all()
        scale = float(w_l.abs().max())
        err = float((g_l - w_l).abs().max())
        errors.append(err / scale)
        # fp16 attention with different accumulation orders: a few fp16 ulps of the logit range
        assert err <= 2e-2 * scale, (name, "prefill" if step == 0 else f"decode {step}", err, scale)
        # the same next token, where the reference is not a near-tie
        top2 = w_l.topk(2, dim=-1).values
        decided = (top2[..., 0] - top2[..., 1]) > 4e-2 * scale
        assert torch.equal(g_l.argmax(-1)[decided], w_l.argmax(-1)[decided])
    for g_c, w_c in zip(got_caches, want_caches):
        assert g_c.shape == w_c.shape
        assert float((g_c.float() - w_c.float()).abs().max()) <= 2e-2 * float(w_c.abs().max().float())
    rt.results.setdefault("decoder_masks", {})[name] = {
        "max_rel_logit_err_per_step": [round(e, 6) for e in errors], "window": MANIFEST[name]["window"],
        "form": MANIFEST[name]["form"]}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MANIFEST) or ["(no artifacts)"])
def test_offloaded_decoder_runs_fa2_without_kv_expansion(rt, runners, name):
    torch = rt.torch
    from mqa_byoc.testing import capture_kernels

    mqa = runners[(name, "mqa")]
    ids = torch.zeros((1, PROMPT + 1), dtype=torch.int32, device="cuda")
    _steps(rt, mqa, ids)
    torch.cuda.synchronize()
    with capture_kernels() as cap:
        _steps(rt, mqa, ids)
    names = cap.names()
    assert any("flash" in n for n in names), sorted(set(names))
    expansion = [n for n in names if any(w in n for w in ("repeat", "broadcast_to", "expand_dims"))]
    assert not expansion, expansion
