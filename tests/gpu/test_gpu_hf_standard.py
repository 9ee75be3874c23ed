"""The standard HF path on the GPU.

Artifacts from ``tools/gpu/build_hf_standard.py`` (build machine): float32 HF Llama (GQA, eager),
Mistral (MQA, window 16, sdpa), GPT-OSS (GQA, learned sinks, a sliding layer and a full one; offloaded as
``flash_attn.attention_mqa_sink``), GraniteSWA (the same sinks applied after attention, with the fixes
convert map; the same composite) and Gemma 2 (GQA, head dim 256, attention soft-cap 50, final soft-cap
30, ``query_pre_attn_scalar``, a sliding layer and a full one; ``flash_attn.attention_mqa_softcap``),
Gemma 4 (sliding GQA layers and K = V full layers of their own head dim, scale 1, KV-shared layers) and
DeepSeek-V4's sliding layers (one K = V head, sinks; prefill only)
decoders exported with ``torch.export``, imported with plain
``from_exported_program`` (no custom convert map; Llama 4, whose chunked layers' prefill runs as
attention on blocks, with ``fixes_convert_map()``, prefill only), ``ToMixedPrecision(out_dtype="float16")``,
partitioned with ``partition_for_cutlass(mqa=True)`` (native FA2) and not partitioned, built for sm_90
into one library; float32 PyTorch eager logits computed on CPU.

Here (runtime-only TVM, the session fixture ``rt`` of conftest.py), per model and function (prefill,
one decode step):

- the logits of ``mqa`` and ``tvm`` match float32 eager within the manifest's tolerances (derived as
  in ``test_gpu_hf_decoder.py``: 16x the relative L2 / max abs error of fp16 eager, because TVM's
  fp16 matmuls accumulate in fp16); top-1 agrees where the reference's margin is clear;
- ``mqa`` is no less accurate than TVM's own build (x1.5 + the fp16-eager error), where TVM builds the
  graph at all (GraniteSWA's decode: its own CUDA pipeline fails, the manifest says why);
- the builder checked that the window, sinks, soft-cap and chunked blocks each move the float32 logits by more than twice
  the tolerance (``feature_effects`` in the manifest): a site offloaded without one of them fails here;
- with ``torch.profiler``: ``mqa`` launches one attention kernel per layer (FA2 forward, our decode; a
  chunked layer one to three, as the manifest counts) and no K/V expansion
  kernel (TVM kernels named like one that the builder proved are not K/V's are listed in the manifest).

Skips without a CUDA GPU or without the artifacts. ``MQA_BYOC_GPU_HF_STANDARD_ARTIFACTS=<dir>``
reads them from elsewhere than ``.gpu-artifacts/hf-standard``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import gpu_common as gc
from test_gpu_hf_decoder import ATTENTION_FORWARD, cuda_kernel_names, logits_check
from mqa_byoc.testing.cupti import is_attention_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

ARTIFACTS = Path(os.environ.get("MQA_BYOC_GPU_HF_STANDARD_ARTIFACTS", gc.ROOT / ".gpu-artifacts" / "hf-standard"))
MANIFEST = json.loads((ARTIFACTS / "manifest.json").read_text()) if (ARTIFACTS / "manifest.json").exists() else None
NO_ARTIFACTS = (f"no standard-path HF artifacts in {ARTIFACTS}: run `python tools/gpu/build_hf_standard.py` on "
                "the build machine and copy .gpu-artifacts/hf-standard")
KV_EXPANSION = re.compile(r"repeat|broadcast|tile|expand", re.IGNORECASE)


def _params():
    if MANIFEST is None:
        return [pytest.param(None, None, id="no-artifacts", marks=pytest.mark.skip(reason=NO_ARTIFACTS))]
    # each model's functions: prefill and decode, or prefill only (Llama 4's chunked layers)
    return [pytest.param(name, mode, id=f"{name}-{mode}") for name, m in MANIFEST["models"].items()
            for mode in m["functions"]]


class StandardRuntime:
    def __init__(self, rt):
        self.rt, self.torch, self.tvm = rt, rt.torch, rt.tvm
        lib = self.tvm.runtime.load_module(str(ARTIFACTS / MANIFEST["library"]["library"]))
        self.vm = self.tvm.runtime.vm.VirtualMachine(lib, self.tvm.cuda(0))
        self.models = {}

    def model(self, name):
        if name not in self.models:
            torch, m = self.torch, MANIFEST["models"][name]
            npz = {k: np.load(ARTIFACTS / m[k]) for k in ("weights", "inputs", "reference")}
            # stored fp16 where that is exact; the functions take the parameters' dtype (float32)
            weights = [torch.from_numpy(npz["weights"][p]).to("cuda", copy=True).to(getattr(torch, d))
                       for p, _s, d in m["params"]]
            inputs = {mode: [torch.from_numpy(npz["inputs"][k]).to("cuda", copy=True) for k in m["input_keys"][mode]]
                      for mode in m["functions"]}
            ref = {k: torch.from_numpy(npz["reference"][k]) for k in npz["reference"].files}
            self.models[name] = {"m": m, "weights": weights, "inputs": inputs, "ref": ref}
        return self.models[name]

    def logits(self, name, mode, variant, clone=True):
        d = self.model(name)
        fn = self.vm[d["m"]["functions"][mode]["vm"][variant]]
        out = fn(*[self.tvm.runtime.from_dlpack(t) for t in d["inputs"][mode] + d["weights"]])
        return self.torch.from_dlpack(out[0]).clone() if clone else out

    def kernels(self, name, mode, variant):
        return cuda_kernel_names(self.torch, lambda: self.logits(name, mode, variant, clone=False))


@pytest.fixture(scope="module")
def std(rt):
    if MANIFEST is None:
        pytest.skip(NO_ARTIFACTS)
    return StandardRuntime(rt)


@pytest.mark.parametrize("name, mode", _params())
def test_standard_path_logits_match_pytorch_eager(std, name, mode):
    torch = std.torch
    d = std.model(name)
    f = d["m"]["functions"][mode]
    tol, e16 = f["tolerances"], f["fp16_eager_vs_fp32_eager"]["logits"]
    want = d["ref"][f"{mode}_logits"]
    record = std.rt.results.setdefault(f"hf-standard:{name}-{mode}", {"fp16_eager_vs_fp32_eager": e16})
    record["tolerance_vs_fp32_eager"] = tol["vs_fp32"]["logits"]
    if "tvm_not_built" in f:  # TVM's own build of this graph fails (the builder recorded why)
        record["tvm_not_built"] = f["tvm_not_built"]
    got = {v: std.logits(name, mode, v) for v in ("mqa", "tvm") if v in f["vm"]}
    failures, errs = logits_check(torch, got, want, tol, e16, base="tvm")
    record["vs_fp32_eager"] = errs
    assert not failures, f"{name}/{mode}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name, mode", _params())
def test_standard_path_launches_fa2_and_no_kv_expansion(std, name, mode):
    layers = MANIFEST["models"][name]["spec"]["layers"]
    # one attention kernel a layer; a chunked layer's blocks one to three (the manifest's count)
    want = MANIFEST["models"][name]["functions"][mode].get("attention_calls", layers)
    try:
        kernels = std.kernels(name, mode, "mqa")
    except Exception as err:  # noqa: BLE001 - CUPTI may be unavailable
        pytest.skip(f"torch.profiler (CUPTI) could not record kernels: {type(err).__name__}: {err}")
    std.rt.results.setdefault(f"hf-standard:{name}-{mode}", {})["kernels"] = kernels
    fa2 = [k for k in kernels if ATTENTION_FORWARD.search(k)]
    assert len(fa2) == want, (f"{len(fa2)} attention kernels (FA2 forward, our decode) for {layers} layers, "
                              f"want {want}: {kernels}")
    # kernels named like an expansion that the builder proved are not K/V's (the o_proj weight
    # broadcast of an sdpa graph, a no-op broadcast_to before a batched matmul)
    allowed = MANIFEST["models"][name]["functions"][mode]["not_kv_expansion_kernels"]
    expanded = [k for k in kernels if not is_attention_kernel(k) and KV_EXPANSION.search(k)
                and not any(k.startswith(a) for a in allowed)]
    assert not expanded, f"K/V expansion kernels launched: {expanded} (not K/V: {allowed})"
