"""Decoders whose masks are built from symbolic lengths, offloaded to FA2 (mqa=True, native provider),
against the same graph lowered by TVM alone: prefill past the sliding window, then decode steps.
Artifacts: ``python tools/gpu/build_decoders.py`` (see tests/gpu/README.md)."""

from __future__ import annotations

import pytest

import gpu_common
from mqa_byoc.testing.cupti import is_attention_kernel  # noqa: E402

ARTIFACTS = gpu_common.ROOT / ".gpu-artifacts" / "decoders"
PROMPT = 40  # longer than the windowed case's window (24)
DECODE_STEPS = 3
MANIFEST = gpu_common.decoder_manifest(ARTIFACTS)


@pytest.fixture(scope="module")
def runners(rt):
    return gpu_common.decoder_runners(ARTIFACTS, MANIFEST, "build_decoders.py")


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
    ids = gpu_common.decoder_ids(torch, mqa, ref, 2, PROMPT + DECODE_STEPS)
    got_logits, got_caches = _steps(rt, mqa, ids)
    want_logits, want_caches = _steps(rt, ref, ids)
    errors = gpu_common.check_decoder_steps(torch, name, got_logits, want_logits, got_caches, want_caches)
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
    assert any(is_attention_kernel(n) for n in names), sorted(set(names))
    expansion = [n for n in names if any(w in n for w in ("repeat", "broadcast_to", "expand_dims"))]
    assert not expansion, expansion
