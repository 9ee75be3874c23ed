"""A Hugging Face transformers decoder through TVM's PyTorch frontend, run on the GPU.

The artifacts come from ``tools/gpu/build_hf.py`` (build machine: transformers, the TVM
compiler): random-weight HF Llama (GQA, Llama-3-8B attention) and Mistral (MQA, sliding window)
decoders exported with ``torch.export``, imported with ``from_exported_program``, partitioned with
``partition_for_cutlass(mqa=True)`` (and ``mqa=False``, and not at all), built for sm_90 into one
library, plus their fp16 weights, inputs and the float32 PyTorch eager logits computed on CPU.

Here (runtime-only TVM: ``tvm.runtime.load_module`` + ``tvm.runtime.vm.VirtualMachine``; the session
fixture ``rt`` of conftest.py runs the runtime kit's set-up first), per model and function (prefill,
one decode step):

- the logits (and the returned K/V caches) of each variant match float32 eager within the manifest's
  tolerances (``tolerances()`` in tools/gpu/build_hf.py: relative L2 and max abs error at most 16x
  those of fp16 PyTorch eager, because TVM's own fp16 kernels accumulate in fp16); the top-1 token
  agrees wherever the reference's top-1 / top-2 margin exceeds twice the max-abs tolerance, and
  overall for at least 90% of the positions (a sanity floor);
- ``mqa=True`` and ``mqa=False`` agree within 2x the fp16-eager error (both are FA2, only its
  GQA / split-KV path differs) and ``mqa=True`` is no less accurate than TVM's own unpartitioned
  build (x1.5 + the fp16-eager error);
- decode fed with the GPU prefill's caches (generation as it runs) stays within 2x the tolerance;
- with ``torch.profiler`` (CUPTI): the ``mqa=True`` functions launch one attention kernel per layer (FA2 forward or our decode kernel)
  and no K/V expansion kernel (TVM names kernels after the fused ops: ``repeat``, ``broadcast_to``,
  ``tile``, ``expand_dims``), while ``mqa=False`` launches the expansion.

Skips, with the reason, without a CUDA GPU (conftest) or without the artifacts. Environment:
``MQA_BYOC_GPU_HF_ARTIFACTS=<dir>`` reads them from elsewhere than ``.gpu-artifacts/hf``;
``MQA_BYOC_GPU_RESULTS=<file.json>`` also records errors, kernels and per-call times (``hf:*`` keys).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import gpu_common as gc
from mqa_byoc.testing.cupti import ATTENTION_FORWARD, is_attention_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

HF_ARTIFACTS = Path(os.environ.get("MQA_BYOC_GPU_HF_ARTIFACTS", gc.ROOT / ".gpu-artifacts" / "hf"))
MODES = ("prefill", "decode")
VARIANTS = ("mqa", "nomqa", "tvm")
TIMING_ITERS = 10


def _load_manifest():
    path = HF_ARTIFACTS / "manifest.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


MANIFEST = _load_manifest()
NO_ARTIFACTS = (f"no HF decoder artifacts in {HF_ARTIFACTS}: run `python tools/gpu/build_hf.py` on the "
                "build machine and copy .gpu-artifacts/hf")


def _params(modes=MODES):
    if MANIFEST is None:
        return [pytest.param(None, None, id="no-hf-artifacts", marks=pytest.mark.skip(reason=NO_ARTIFACTS))]
    return [pytest.param(name, mode, id=f"{name}-{mode}") for name in MANIFEST["models"] for mode in modes]


class HFRuntime:
    """The library, its VM, and each model's weights / inputs on the GPU (loaded once)."""

    def __init__(self, rt, device="cuda"):
        self.rt, self.torch, self.tvm, self.device = rt, rt.torch, rt.tvm, device
        path = HF_ARTIFACTS / MANIFEST["library"]["library"]
        t0 = time.time()
        self.lib = self.tvm.runtime.load_module(str(path))  # compiles TVM's CUDA kernels (the runtime kit's nvcc hook)
        dev = self.tvm.cuda(0) if device == "cuda" else self.tvm.cpu(0)  # cpu: a dry run of this harness
        self.vm = self.tvm.runtime.vm.VirtualMachine(self.lib, dev)
        self.load_seconds = time.time() - t0
        rt.results.setdefault("hf:_library", {})["load_seconds"] = self.load_seconds
        self.models = {}

    def model(self, name):
        if name not in self.models:
            torch, m = self.torch, MANIFEST["models"][name]
            npz = {k: np.load(HF_ARTIFACTS / m[k]) for k in ("weights", "inputs", "reference")}
            # fresh, aligned CUDA buffers; kept alive here while TVM views them through DLPack
            weights = [torch.from_numpy(npz["weights"][p]).to(self.device, copy=True) for p, _shape, _dt in m["params"]]
            inputs = {mode: [torch.from_numpy(npz["inputs"][k]).to(self.device, copy=True)
                             for k in m["input_keys"][mode]]
                      for mode in MODES}
            ref = {k: torch.from_numpy(npz["reference"][k]) for k in npz["reference"].files}
            self.models[name] = {"m": m, "weights": weights, "inputs": inputs, "ref": ref}
        return self.models[name]

    def call(self, name, mode, variant, inputs=None, clone=True):
        """Outputs ``[logits, k_0, v_0, ...]`` of ``<name>__<mode>__<variant>`` (torch, on the GPU)."""
        d = self.model(name)
        fn = self.vm[d["m"]["functions"][mode]["vm"][variant]]
        args = [self.tvm.runtime.from_dlpack(t) for t in (inputs if inputs is not None else d["inputs"][mode])]
        args += [self.tvm.runtime.from_dlpack(t) for t in d["weights"]]
        out = fn(*args)
        if not clone:
            return out
        # the copies are ours (kept out of profiled calls): VM outputs go back to its pool when released
        return [self.torch.from_dlpack(out[i]).clone() for i in range(len(out))]

    def kernels(self, name, mode, variant):
        """CUDA kernel / memcpy names of one call (after a warm-up call)."""
        from mqa_byoc.testing import capture_kernels

        self.call(name, mode, variant)
        self.torch.cuda.synchronize()
        with capture_kernels() as cap:
            self.call(name, mode, variant, clone=False)
        return cap.names()

    def time_us(self, name, mode, variant):
        torch = self.torch
        self.call(name, mode, variant, clone=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(TIMING_ITERS):
            self.call(name, mode, variant, clone=False)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / TIMING_ITERS * 1e6


@pytest.fixture(scope="module")
def hf(rt):
    if MANIFEST is None:
        pytest.skip(NO_ARTIFACTS)
    return HFRuntime(rt)


def _stats(got, want, logits=False) -> dict:
    got, want = got.float().cpu(), want.float().cpu()
    d = (got - want).abs()
    out = {"max_abs": float(d.max()), "rel_l2": float((got - want).norm() / want.norm())}
    if logits:
        out["top1_agreement"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    return out


def _within(stats: dict, tol: dict) -> bool:
    return stats["rel_l2"] <= tol["rel_l2"] and stats["max_abs"] <= tol["max_abs"]


def _top1_failures(torch, logits, ref, tol: dict) -> list[str]:
    """Top-1 must agree where the reference's margin is clear; overall agreement >= min_agreement."""
    logits, ref = logits.float().cpu(), ref.float().cpu()
    top2 = ref.topk(2, dim=-1).values
    confident = (top2[..., 0] - top2[..., 1]) > tol["confident_margin"]
    agree = logits.argmax(-1) == ref.argmax(-1)
    out = []
    flipped = int((confident & ~agree).sum())
    if flipped:
        out.append(f"top-1 differs at {flipped} of {int(confident.sum())} positions with a margin > "
                   f"{tol['confident_margin']:.3g}")
    rate = float(agree.float().mean())
    if rate < tol["min_agreement"]:
        out.append(f"top-1 agreement {rate:.3f} < {tol['min_agreement']}")
    return out


def logits_check(torch, variants: dict, want, tol: dict, e16: dict, base: str | None) -> tuple[list[str], dict]:
    """Each variant's logits (``variants``: name -> tensor) against the float32 reference ``want``: finite, of
    its shape, within ``tol["vs_fp32"]["logits"]``, top-1 as ``tol["top1"]`` asks; ``mqa`` no less accurate
    than ``base`` (x1.5 + fp16 eager's error ``e16``). Returns the failures and each variant's errors."""
    failures, errs = [], {}
    for variant, got in variants.items():
        if list(got.shape) != list(want.shape) or not torch.isfinite(got.float()).all():
            failures.append(f"{variant}: logits of shape {list(got.shape)} (want {list(want.shape)}) or non-finite")
            continue
        errs[variant] = st = _stats(got, want, logits=True)
        if not _within(st, tol["vs_fp32"]["logits"]):
            failures.append(f"{variant}: logits vs float32 eager {st}, tolerance {tol['vs_fp32']['logits']}")
        failures += [f"{variant}: {msg}" for msg in _top1_failures(torch, got, want, tol["top1"])]
    if "mqa" in errs and base in errs:
        for k in ("rel_l2", "max_abs"):
            if errs["mqa"][k] > 1.5 * errs[base][k] + e16[k]:
                failures.append(f"mqa logits less accurate than the {base} build: {k} {errs['mqa'][k]:.3g} vs "
                                f"{errs[base][k]:.3g} (allowed 1.5x + fp16 eager's {e16[k]:.3g})")
    return failures, errs


def cuda_kernel_names(torch, call) -> list[str]:
    """The CUDA kernels one ``call()`` launches (torch.profiler), after a warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _expected_outputs(d, mode) -> dict:
    """float32 references per output name. Prefill: the logits and the K/V caches (the decode step's past:
    float32 eager caches rounded to fp16). Decode: the logits and the new (last) position of each cache."""
    ref, names = d["ref"], [o[0] for o in d["m"]["functions"][mode]["outputs"]]
    if mode == "prefill":
        caches = [d["inputs"]["decode"][1 + i].float().cpu() for i in range(len(names) - 1)]
        return {"logits": ref["prefill_logits"], **dict(zip(names[1:], caches))}
    return {"logits": ref["decode_logits"], **{n: ref[f"decode_{n}_last"] for n in names[1:]}}


@pytest.mark.parametrize("name, mode", _params())
def test_logits_match_pytorch_eager(hf, name, mode):
    torch = hf.torch
    d = hf.model(name)
    f = d["m"]["functions"][mode]
    tol, e16 = f["tolerances"], f["fp16_eager_vs_fp32_eager"]
    names = [o[0] for o in f["outputs"]]
    want = _expected_outputs(d, mode)
    outs = {v: hf.call(name, mode, v) for v in VARIANTS}
    failures, record = [], hf.rt.results.setdefault(f"hf:{name}-{mode}", {})
    record["fp16_eager_vs_fp32_eager"] = {n: {k: e16[n][k] for k in ("max_abs", "rel_l2")} for n in names}
    errs = record.setdefault("vs_fp32_eager", {})

    for variant, out in outs.items():
        shapes = [list(o.shape) for o in out]
        if shapes != [o[1] for o in f["outputs"]]:
            failures.append(f"{variant}: output shapes {shapes}, manifest says {[o[1] for o in f['outputs']]}")
            continue
        if not all(torch.isfinite(o.float()).all() for o in out):
            failures.append(f"{variant}: non-finite outputs")
            continue
        errs[variant] = {}
        for i, n in enumerate(names):
            got = out[i]
            if mode == "decode" and i:  # the cache: the past (cropped by a sliding window) + the new position
                past = d["inputs"]["decode"][i]
                keep = got.shape[2] - 1
                if not torch.equal(got[:, :, :-1], torch.cat([past, got[:, :, -1:]], dim=2)[:, :, -keep - 1:-1]):
                    failures.append(f"{variant}: decode cache {n} does not carry the past over unchanged")
                got = got[:, :, -1:]
            st = _stats(got, want[n], logits=n == "logits")
            errs[variant][n] = st
            if not _within(st, tol["vs_fp32"][n]):
                failures.append(f"{variant}: {n} vs float32 eager {st}, tolerance {tol['vs_fp32'][n]} "
                                f"(fp16 eager: {e16[n]['rel_l2']:.3g} rel_l2, {e16[n]['max_abs']:.3g} max_abs)")
        failures += [f"{variant}: {msg}" for msg in _top1_failures(torch, out[0], want["logits"], tol["top1"])]

    if "mqa" in errs and "nomqa" in errs:
        pair = record.setdefault("mqa_vs_nomqa", {})
        for i, n in enumerate(names):
            st = _stats(outs["mqa"][i], outs["nomqa"][i])
            pair[n] = st
            if not _within(st, tol["mqa_vs_nomqa"][n]):
                failures.append(f"mqa=True vs mqa=False: {n} {st}, tolerance {tol['mqa_vs_nomqa'][n]}")
    if "mqa" in errs and "tvm" in errs:
        a, b, e = errs["mqa"]["logits"], errs["tvm"]["logits"], e16["logits"]
        for k in ("rel_l2", "max_abs"):
            if a[k] > 1.5 * b[k] + e[k]:
                failures.append(f"mqa=True logits less accurate than TVM's own build: {k} {a[k]:.3g} vs "
                                f"{b[k]:.3g} (allowed 1.5x + fp16 eager's {e[k]:.3g})")
    assert not failures, f"{name}/{mode}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name, mode", _params(modes=("decode",)))
def test_decode_after_gpu_prefill(hf, name, mode):
    """Generation as it runs: the decode step takes the caches the GPU prefill returned."""
    d = hf.model(name)
    f = d["m"]["functions"]["decode"]
    tol = f["tolerances"]
    factor = tol["chained_factor"]
    record = hf.rt.results.setdefault(f"hf:{name}-decode-after-gpu-prefill", {})
    failures = []
    for variant in ("mqa", "nomqa"):
        caches = hf.call(name, "prefill", variant)[1:]
        out = hf.call(name, "decode", variant, inputs=[d["inputs"]["decode"][0], *caches])
        st = _stats(out[0], d["ref"]["decode_logits"], logits=True)
        record[variant] = st
        lim = {k: factor * v for k, v in tol["vs_fp32"]["logits"].items()}
        if not _within(st, lim):
            failures.append(f"{variant}: logits vs float32 eager {st}, tolerance {lim}")
    assert not failures, f"{name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name, mode", _params())
def test_mqa_launches_fa2_and_no_kv_expansion(hf, name, mode):
    m = MANIFEST["models"][name]
    layers, expands = m["spec"]["layers"], m["spec"]["kv_heads"] < m["spec"]["heads"]
    expansion = re.compile(MANIFEST["kv_expansion_kernels"], re.IGNORECASE)
    try:
        kernels = {v: hf.kernels(name, mode, v) for v in ("mqa", "nomqa")}
    except Exception as err:  # noqa: BLE001 - CUPTI may be unavailable
        pytest.skip(f"torch.profiler (CUPTI) could not record kernels: {type(err).__name__}: {err}")
    record = hf.rt.results.setdefault(f"hf:{name}-{mode}", {})
    record["kernels"] = kernels
    record["time_us"] = {v: hf.time_us(name, mode, v) for v in VARIANTS}

    mqa, nomqa = kernels["mqa"], kernels["nomqa"]
    assert mqa, "no CUDA activity recorded for the mqa=True call"
    fa2 = [k for k in mqa if ATTENTION_FORWARD.search(k)]
    assert len(fa2) == layers, f"mqa=True: {len(fa2)} attention kernels (FA2 forward, our decode) for {layers} attention layers: {mqa}"
    # TVM's kernels carry the fused ops' names; FA2's (C++ templates) are left out of the pattern match
    expanded = [k for k in mqa if not is_attention_kernel(k) and expansion.search(k)]
    assert not expanded, f"mqa=True launched K/V expansion kernels: {expanded}"
    assert sum(bool(ATTENTION_FORWARD.search(k)) for k in nomqa) == layers, f"mqa=False attention kernels: {nomqa}"
    if expands:
        assert any(not is_attention_kernel(k) and expansion.search(k) for k in nomqa), (
            f"mqa=False launched no K/V expansion kernel: {nomqa}")
