"""TVM PagedKVCache attention on FA2 (UseFlashAttentionForPagedKVCache) vs TVM's TIR kernels, on the GPU.

Artifacts: ``python tools/gpu/build_paged.py`` (``.gpu-artifacts/paged``). Per case (GQA 64/8 d128,
MQA 71/1 d64, MQA 8/1 d128) and batch (1; 8 with mixed lengths), the same steps on both libraries:
a prefill (ragged attention only), a second prefill chunk on the filled sequences plus a new one (paged
prefill over the prefixes, one sequence without any, + ragged + TVM's LSE merge: checks the base-2 LSE
and the empty-sequence rows), then decode steps. Every output is
compared with an fp32 reference of the K/V history; TVM's TIR output is recorded against it too, and
FA2 must agree with TIR wherever TIR agrees with the reference. Then the whole decoder (GQA cases):
prefill and decode logits of both libraries with the same random weights against each other, and each
against an fp32 torch decoder (``DecoderReference``): where FA2 and TIR differ beyond the tolerance, FA2
must be the nearer to it. Measured on the H200: TVM's own GPU kernels, which both libraries share, are
off the fp32 decoder (bf16: 0.10 from the prefill on, where rounding each op to bf16 gives 0.0065; the
fp16 case's shortest sequences at the second and third decode step: 0.18 and 0.47, FA2 and TIR alike),
while TVM's llvm build meets it (tests/test_paged_driver_cpu.py; in fp16 with the test's lengths and
four layers, 0.006 at every step).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest

import gpu_common

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".gpu-artifacts" / "paged"
sys.path.insert(0, str(ROOT / "src"))  # the package from this checkout (a runtime-only GPU machine need not install it)
MANIFEST = json.loads((ARTIFACTS / "manifest.json").read_text()) if (ARTIFACTS / "manifest.json").is_file() else {}
TOL = 2e-2  # max |err| / max |reference|: fp16 inputs and outputs
# decoder logits FA2 vs TIR (max |err| / max |reference|) after the layers of random weights: each side's
# rounding compounds; bf16 keeps 8 mantissa bits to fp16's 11 (8x the step)
DECODER_TOL = {"float16": 2e-2, "bfloat16": 1.2e-1}
BATCHES = {1: [777], 8: [1, 37, 129, 256, 300, 513, 64, 1000]}
SECOND_CHUNK = {1: [33], 8: [5, 17, 1, 128, 3, 64, 250, 2]}
DECODE_STEPS = 3
RESULTS: dict = {}


@pytest.fixture(scope="module")
def env():
    if gpu_common.skip_reason():  # no torch, or no CUDA GPU
        pytest.skip(gpu_common.skip_reason())
    import torch
    if not MANIFEST:
        pytest.skip(f"no artifacts in {ARTIFACTS}: run `python tools/gpu/build_paged.py` on the build machine "
                    "and copy .gpu-artifacts/paged")
    if os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        from mqa_byoc.deploy import prepare_runtime

        prepare_runtime()  # the runtime kit's set-up: CUDA runtime + nvcc hook
    import tvm
    import tvm.runtime.vm  # noqa: F401
    import tvm_ffi

    from mqa_byoc.testing.cuda_compile import HOOK, memoized_cuda_compile

    previous = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    if previous is not None:  # loading compiles the libraries' CUDA; tir.so and fa2.so share most kernels
        tvm_ffi.register_global_func(HOOK, memoized_cuda_compile(previous), override=True)
    yield tvm, torch
    if previous is not None:
        tvm_ffi.register_global_func(HOOK, previous, override=True)
    out = os.environ.get("MQA_BYOC_GPU_RESULTS")
    if out:
        Path(out).write_text(json.dumps({"paged": RESULTS}, indent=1) + "\n")


_LOADED: dict = {}


def _models(env, name):
    """Both libraries of a case, loaded once per session (loading compiles their CUDA kernels)."""
    from mqa_byoc.runtime.paged_driver import PagedModel

    tvm, torch = env
    case = MANIFEST[name]
    if name not in _LOADED:
        _LOADED[name] = {impl: PagedModel(tvm, torch, ARTIFACTS / case["libraries"][impl], case, impl)
                         for impl in ("tir", *_ours(case))}
    return _LOADED[name]


def _ours(case) -> list[str]:
    """Our libraries of a case: ``fa2`` (native provider) and, where built, ``fa4`` (hopper provider: the
    ragged prefill on FA4's var-len forward)."""
    return [impl for impl in ("fa2", "fa4") if impl in case["libraries"]]


def _rel(torch, got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name", sorted(MANIFEST) or ["(no artifacts)"])
def test_paged_attention_matches_reference_and_tir(env, name, batch):
    from mqa_byoc.runtime.paged_driver import Reference

    tvm, torch = env
    models = _models(env, name)
    cfg = MANIFEST[name]["config"]
    dtype = getattr(torch, cfg["dtype"])
    lens, chunk2 = BATCHES[batch], SECOND_CHUNK[batch]
    seqs = list(range(batch))
    # the second chunk also starts a new sequence: it has no pages yet, so the paged prefill over the
    # prefixes sees a sequence without K/V next to the others
    seqs2, new_len = seqs + [batch], 19
    total = sum(lens) + sum(chunk2) + new_len + DECODE_STEPS * (batch + 1)
    caches = {impl: m.new_cache(batch + 1, total, max(sum(lens), 1024)) for impl, m in models.items()}
    for impl, m in models.items():
        m.add(caches[impl], seqs2)
    ref = Reference(torch, cfg)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    heads = cfg["num_q_heads"] + 2 * cfg["num_kv_heads"]
    steps = [("prefill", seqs, lens), ("prefill_chunk2", seqs2, chunk2 + [new_len])]
    steps += [(f"decode{i}", seqs2, [1] * len(seqs2)) for i in range(DECODE_STEPS)]
    record = {}
    for step, ids, lengths in steps:
        decode = step.startswith("decode")
        shape = (len(ids), 1) if decode else (1, sum(lengths))
        qkv = torch.randn(*shape, heads, cfg["head_dim"], generator=gen, device="cuda").to(dtype)
        want = ref.step(ids, lengths, qkv)
        outs = {}
        for impl, m in models.items():
            m.begin(caches[impl], ids, lengths)
            outs[impl] = m.attend(caches[impl], qkv).clone()
            m.end(caches[impl])
        torch.cuda.synchronize()
        errs = {impl: _rel(torch, o, want) for impl, o in outs.items()}
        ours = _ours(MANIFEST[name])
        for impl in ours:
            errs[f"{impl}_vs_tir"] = _rel(torch, outs[impl], outs["tir"].float())
        record[step] = {k: round(v, 6) for k, v in errs.items()}
        for impl in ours:
            assert errs[impl] < TOL, f"{name} batch {batch} {step}: {impl} vs fp32 reference {errs}"
            # ours vs TIR only where TIR matches the reference: in prefill_chunk2 of mqa71_1_d64 TVM's TIR
            # merge_state leaves head 70 unmerged (its grid is 2 blocks of 35 heads; ours merge every head)
            if errs["tir"] < TOL:
                assert errs[f"{impl}_vs_tir"] < 2 * TOL, f"{name} batch {batch} {step}: {impl} vs TIR {errs}"
        if errs["tir"] >= TOL:  # recorded, not hidden: the results say where TIR was off the reference
            record[step]["vs_tir_not_asserted"] = "TIR differs from the fp32 reference"
    RESULTS.setdefault("attention", {})[f"{name}/b{batch}"] = record


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in sorted(MANIFEST) if n.startswith("gqa")] or ["(no artifacts)"])
def test_paged_decoder_logits_match_tir(env, name):
    from mqa_byoc.runtime.paged_driver import DecoderReference

    tvm, torch = env
    models = _models(env, name)
    cfg = MANIFEST[name]["config"]
    lens = BATCHES[8]
    seqs = list(range(len(lens)))
    gen = torch.Generator(device="cuda").manual_seed(7)
    prompt = torch.randint(0, cfg["vocab"], (1, sum(lens)), generator=gen, device="cuda", dtype=torch.int32)
    steps = [torch.randint(0, cfg["vocab"], (len(lens), 1), generator=gen, device="cuda", dtype=torch.int32)
             for _ in range(DECODE_STEPS)]
    logits = {}
    for impl, m in models.items():
        m.set_params(seed=0)
        cache = m.new_cache(len(lens), sum(lens) + DECODE_STEPS * len(lens), sum(lens))
        m.add(cache, seqs)
        m.begin(cache, seqs, lens)
        got = [m.logits("prefill", cache, prompt).clone()]
        m.end(cache)
        for ids in steps:
            m.begin(cache, seqs, [1] * len(lens))
            got.append(m.logits("decode", cache, ids).clone())
            m.end(cache)
        logits[impl] = got
    # the fp32 oracle on the same (rounded) weights: which library is off, not only that they differ
    ref = DecoderReference(torch, cfg, models["fa2"].weights)
    want = [ref.step(seqs, lens, prompt)] + [ref.step(seqs, [1] * len(lens), ids) for ids in steps]
    errs = {impl: [_rel(torch, g, w) for g, w in zip(logits[impl], want)] for impl in logits}
    for impl in _ours(MANIFEST[name]):
        errs[f"{impl}_vs_tir"] = [_rel(torch, f, t) for f, t in zip(logits[impl], logits["tir"])]
    # per sequence (prefill: its tokens; decode: its row), FA2 vs the oracle: where an error sits
    bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
    errs["fa2_per_sequence"] = [[_rel(torch, logits["fa2"][0][:, bounds[i]:bounds[i + 1]], want[0][:, bounds[i]:bounds[i + 1]])
                                 for i in seqs]]
    errs["fa2_per_sequence"] += [[_rel(torch, g[i], w[i]) for i in seqs] for g, w in zip(logits["fa2"][1:], want[1:])]
    RESULTS.setdefault("decoder", {})[name] = {k: [v if isinstance(v, list) else round(v, 6) for v in vs]
                                               for k, vs in errs.items()}
    tol = DECODER_TOL[cfg.get("dtype", "float16")]
    for impl in _ours(MANIFEST[name]):
        for i, (f_t, f_ref, t_ref) in enumerate(zip(errs[f"{impl}_vs_tir"], errs[impl], errs["tir"])):
            # the unrewritten library is the baseline; where ours and TIR part, ours must be the nearer the math
            assert f_t < tol or f_ref <= t_ref, (f"{name} step {i}: decoder logits {impl} vs TIR {f_t:.4f} (tolerance "
                                                f"{tol}) and {impl} farther from the fp32 decoder than TIR: {errs}")


def _ragged_reference(torch, q, k, v, q_lens, k_lens, g, scale, causal):
    """fp32 attention of each sequence (bottom-right causal when ``causal``) and TVM's base-2 LSE."""
    outs, lses, qo, ko = [], [], 0, 0
    for lq, lk in zip(q_lens, k_lens):
        qs = q[qo:qo + lq].float().transpose(0, 1)  # (H, lq, D)
        ks = k[ko:ko + lk].float().repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[ko:ko + lk].float().repeat_interleave(g, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        lses.append((torch.logsumexp(s, dim=-1) / math.log(2)).transpose(0, 1))  # (lq, H), base 2
        outs.append((torch.softmax(s, dim=-1) @ vs).transpose(0, 1))
        qo, ko = qo + lq, ko + lk
    return torch.cat(outs), torch.cat(lses)


#: the ragged entry's batches: a few sequences, and 64 of up to 600 rows, enough that the FA2 entry
#: reads the longest sequence back instead of launching total_q's row blocks per sequence (fa2_paged.cu)
RAGGED_BATCHES = {"few": ([5, 300, 1, 129], [17, 300, 40, 129])}
_lens = [int(x) for x in __import__("random").Random(5).choices(range(1, 601), k=64)]
RAGGED_BATCHES["many"] = (_lens, [n + (i % 3) * 7 for i, n in enumerate(_lens)])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", sorted(RAGGED_BATCHES))
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("name", sorted(MANIFEST) or ["(no artifacts)"])
def test_ragged_entry_causal_and_not(env, name, causal, batch):
    """The ragged entry of every library of ours, called as TVM's cache calls it, with causal 1 (what the
    cache's prefill passes) and 0 (K/V longer than the queries), against fp32: output and base-2 LSE."""
    import tvm_ffi

    from mqa_byoc.testing.cupti import capture_kernels

    tvm, torch = env
    case = MANIFEST[name]
    cfg = case["config"]
    h, hkv, d = cfg["num_q_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    dtype = getattr(torch, cfg["dtype"])
    q_lens, k_lens = RAGGED_BATCHES[batch]
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(sum(q_lens), h, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(sum(k_lens), hkv, d, generator=gen, device="cuda").to(dtype)
    qo = torch.tensor([0, *itertools.accumulate(q_lens)], device="cuda", dtype=torch.int32)
    ko = torch.tensor([0, *itertools.accumulate(k_lens)], device="cuda", dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    want, want_lse = _ragged_reference(torch, q, k, v, q_lens, k_lens, h // hkv, scale, causal)
    pos = torch.zeros(sum(q_lens), device="cuda", dtype=torch.int32)
    koff = torch.zeros(len(q_lens), device="cuda", dtype=torch.int32)
    for impl in _ours(case):
        lib = tvm.runtime.load_module(str(ARTIFACTS / case["libraries"][impl]))
        sym = next(line.split(" -> ")[1].split(" ")[0] for line in case["report"] if "batch_prefill_ragged_kv" in line)
        fn = lib.get_function(sym, query_imports=True)
        out = torch.empty_like(q)
        lse = torch.empty(sum(q_lens), h, device="cuda", dtype=torch.float32)
        args = [tvm_ffi.from_dlpack(t) for t in (q, qo, k, v, ko, pos, koff, out, lse)]
        fn(*args, causal, 0, 1.0, 1e4, scale)  # the first call loads the kernels
        with capture_kernels() as cap:
            fn(*args, causal, 0, 1.0, 1e4, scale)
        names = sorted({n for n, _ in cap.events})
        err, lse_err = _rel(torch, out, want), float((lse - want_lse).abs().max())
        RESULTS.setdefault("ragged_entry", {})[f"{name}/{impl}/causal{causal}/{batch}"] = {
            "err": round(err, 6), "lse_max_abs": round(lse_err, 6), "kernels": [n[:80] for n in names]}
        assert err < TOL and lse_err < 1e-2, f"{name} {impl} causal={causal}: output {err}, LSE {lse_err}"
        # what ran: FA4's sm90 forward in the hopper provider's library, FA2's var-len kernel in the native one
        fa4 = any("FlashAttentionForwardSm90" in n for n in names)
        fa2 = any("flash_fwd_kernel" in n for n in names)
        assert (fa4, fa2) == ((True, False) if impl == "fa4" else (False, True)), f"{name} {impl}: ran {names}"
