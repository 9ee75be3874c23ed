"""Decoders on TVM's in-place KV cache (``kv_cache="inplace"``), offloaded to FA2 (mqa=True, native
provider), against the same decoder lowered by TVM alone (its qkv split and RoPE as Relax ops, where the
offloaded build has the one ``split_rope`` kernel): a prompt, then decode steps; and what a decode step
launches (no kernel copies the cache). Artifacts: ``python tools/gpu/build_inplace.py``."""

from __future__ import annotations

import pytest

import gpu_common
from mqa_byoc.runtime.gemm_rates import SPLIT_K_REDUCE, is_gemm_kernel  # noqa: E402
from mqa_byoc.testing.cupti import is_attention_kernel  # noqa: E402

ARTIFACTS = gpu_common.ROOT / ".gpu-artifacts" / "inplace"
PROMPT = 40
DECODE_STEPS = 3
VIEW = "vm.builtin.attention_kv_cache_view"  # mqa_byoc.models.kv_caches.VIEW (that module needs tvm.relax)
MANIFEST = gpu_common.decoder_manifest(ARTIFACTS)


@pytest.fixture(scope="module")
def runners(rt):
    return gpu_common.decoder_runners(ARTIFACTS, MANIFEST, "build_inplace.py")


def _steps(rt, runner, ids):
    """prefill(ids[:, :PROMPT]) into caches reserved for all of ids, then one decode step per remaining
    id: logits (float32) per call and the caches' contents (S, H_kv, D) at the end."""
    torch, tvm = rt.torch, rt.tvm
    caches = runner.new_caches(ids.shape[1])
    out, caches = runner.prefill(1, PROMPT, ids=tvm.runtime.from_dlpack(ids[:, :PROMPT].clone()), caches=caches)
    logits = [torch.from_dlpack(out).clone()]
    for t in range(PROMPT, ids.shape[1]):
        out, caches = runner.decode(caches, 1, ids=tvm.runtime.from_dlpack(ids[:, t:t + 1].clone()))
        logits.append(torch.from_dlpack(out).clone())
    assert caches.length == ids.shape[1]
    view = tvm.get_global_func(VIEW)
    return logits, [torch.from_dlpack(view(c)).clone() for c in caches.objects]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MANIFEST) or ["(no artifacts)"])
def test_inplace_decoder_matches_tvm(rt, runners, name):
    torch = rt.torch
    mqa, ref = runners[(name, "mqa")], runners[(name, "reference")]
    assert mqa.kv_cache == ref.kv_cache == "inplace"
    ids = gpu_common.decoder_ids(torch, mqa, ref, 1, PROMPT + DECODE_STEPS)
    got_logits, got_caches = _steps(rt, mqa, ids)
    want_logits, want_caches = _steps(rt, ref, ids)
    assert len(got_caches) == 2 * MANIFEST[name]["num_layers"]
    for g_c in got_caches:
        assert g_c.shape == (PROMPT + DECODE_STEPS, mqa.meta["num_kv_heads"], mqa.meta["head_dim"])
    errors = gpu_common.check_decoder_steps(torch, name, got_logits, want_logits, got_caches, want_caches)
    rt.results.setdefault("inplace_decoder", {})[name] = {
        "max_rel_logit_err_per_step": [round(e, 6) for e in errors], "form": MANIFEST[name]["form"],
        "fused_projections": MANIFEST[name].get("fused_projections")}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MANIFEST) or ["(no artifacts)"])
def test_inplace_decode_step_copies_no_cache(rt, runners, name):
    """Under CUPTI, mqa=True decode steps launch our attention kernels, cuBLASLt's kernels for the offloaded GEMMs
    (one GEMM kernel per call) and kernels of the decode's own PrimFuncs only (the build proved none of those reads
    the cache), and copy memory only for the appends: one device-to-device copy of the new token's row per layer
    and K/V."""
    torch = rt.torch
    from mqa_byoc.testing import capture_kernels

    case = MANIFEST[name]
    assert case["mqa_decode_cache_readers"] == {"reshape": 2 * case["num_layers"], "attention": 2 * case["num_layers"]}
    mqa = runners[(name, "mqa")]
    ids = torch.zeros((1, PROMPT + 2 * DECODE_STEPS), dtype=torch.int32, device="cuda")
    _steps(rt, mqa, ids[:, :PROMPT + DECODE_STEPS])  # warm-up
    caches = mqa.new_caches(ids.shape[1])
    _, caches = mqa.prefill(1, PROMPT, ids=rt.tvm.runtime.from_dlpack(ids[:, :PROMPT].clone()), caches=caches)
    tokens = [rt.tvm.runtime.from_dlpack(ids[:, t:t + 1].clone()) for t in range(DECODE_STEPS)]
    torch.cuda.synchronize()
    with capture_kernels() as cap:
        for tok in tokens:
            _, caches = mqa.decode(caches, 1, ids=tok)
    names = cap.names()
    copies = [n for n in names if n.startswith("Memcpy")]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    assert any(is_attention_kernel(n) for n in kernels), sorted(set(kernels))
    own = [c for c in case["decode_calls"]["mqa"] if "flash" not in c and not c.endswith("_cublaslt")]
    gemm_calls = [c for c in case["decode_calls"]["mqa"] if c.endswith("_cublaslt")]
    tvm_kernels = [n for n in kernels if any(n.startswith(f"{c}_kernel") for c in own)]
    # the offloaded GEMMs launch cuBLASLt's kernels: one GEMM per call (and maybe its split-K reduction)
    cublaslt = [n for n in kernels if n not in tvm_kernels and (is_gemm_kernel(n) or SPLIT_K_REDUCE.search(n))]
    assert gemm_calls, case["decode_calls"]["mqa"]
    assert len([n for n in cublaslt if is_gemm_kernel(n)]) == len(gemm_calls) * DECODE_STEPS, sorted(set(cublaslt))
    foreign = sorted({n for n in kernels if not is_attention_kernel(n) and n not in tvm_kernels and n not in cublaslt})
    assert not foreign, (foreign, own)
    assert not [n for n in kernels if any(w in n for w in ("repeat", "broadcast_to", "expand_dims"))]
    dtod = [n for n in copies if "DtoD" in n]
    assert len(dtod) == 2 * case["num_layers"] * DECODE_STEPS and len(copies) == len(dtod), copies
    rt.results.setdefault("inplace_decoder", {}).setdefault(name, {})["decode_step_kernels"] = sorted(set(kernels))
