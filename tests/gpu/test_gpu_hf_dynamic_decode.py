"""A serving loop's decode step on the GPU: one graph, batch and past length symbolic, called at several pasts.

Artifacts from ``tools/gpu/build_hf_dynamic_decode.py`` (build machine): float32 HF Mistral (one K/V head,
a 16-key sliding window, sdpa) and GPT-OSS (GQA 8/2, learned sinks, a sliding layer and a full one) decode
steps exported with ``torch.export`` with a dynamic batch and past (the past at least the window: HF's
sliding cache keeps the last w - 1 keys through ``torch.sym_max``), imported with the fixes convert map,
``ToMixedPrecision(out_dtype="float16")``, partitioned with ``partition_for_cutlass(mqa=True / False,
gemm=False)`` (native) and not partitioned, built for sm_90; float32 and fp16 PyTorch eager logits computed on CPU at
each call's past.

Here, per model and call (Mistral's pasts 15, 40, 300 of one graph; GPT-OSS's per-layer pasts 15 / 24 and
15 / 200):

- the logits of ``mqa`` (FA2 on the K/V heads), ``nomqa`` (FA2 as plain MHA on the expanded K/V) and ``tvm``
  (not partitioned; TVM 0.27's own pipeline fails on these graphs, the manifest says how) match float32 eager
  within the manifest's tolerances (``build_hf.tolerances``: 16x fp16 eager's error at the model's calls),
  top-1 agreeing where the reference's margin is clear, and ``mqa`` is no less accurate than ``tvm``, or
  ``nomqa`` where TVM does not build (x1.5 + fp16 eager's error);
- with ``torch.profiler``: ``mqa`` launches one attention kernel a layer and no K/V expansion kernel (TVM
  kernels named like one that the builder proved are not K/V's are listed in the manifest).

Skips without a CUDA GPU or without the artifacts. ``MQA_BYOC_GPU_HF_DYNAMIC_ARTIFACTS=<dir>`` reads them
from elsewhere than ``.gpu-artifacts/hf-dynamic-decode``.
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

ARTIFACTS = Path(os.environ.get("MQA_BYOC_GPU_HF_DYNAMIC_ARTIFACTS",
                                gc.ROOT / ".gpu-artifacts" / "hf-dynamic-decode"))
MANIFEST = json.loads((ARTIFACTS / "manifest.json").read_text()) if (ARTIFACTS / "manifest.json").exists() else None
NO_ARTIFACTS = (f"no dynamic-decode HF artifacts in {ARTIFACTS}: run `python tools/gpu/build_hf_dynamic_decode.py` "
                "on the build machine and copy .gpu-artifacts/hf-dynamic-decode")
KV_EXPANSION = re.compile(r"repeat|broadcast|tile|expand", re.IGNORECASE)


def _params():
    if MANIFEST is None:
        return [pytest.param(None, None, id="no-artifacts", marks=pytest.mark.skip(reason=NO_ARTIFACTS))]
    return [pytest.param(name, i, id=f"{name}-past{'-'.join(map(str, c['pasts']))}")
            for name, m in MANIFEST["models"].items() for i, c in enumerate(m["cases"])]


class DynamicRuntime:
    def __init__(self, rt):
        self.rt, self.torch, self.tvm = rt, rt.torch, rt.tvm
        self.vms, self.models = {}, {}

    def vm(self, library):
        if library not in self.vms:
            lib = self.tvm.runtime.load_module(str(ARTIFACTS / library))
            self.vms[library] = self.tvm.runtime.vm.VirtualMachine(lib, self.tvm.cuda(0))
        return self.vms[library]

    def model(self, name):
        if name not in self.models:
            torch, m = self.torch, MANIFEST["models"][name]
            w = np.load(ARTIFACTS / m["weights"])
            weights = [torch.from_numpy(w[p]).to("cuda", copy=True).to(getattr(torch, d)) for p, _s, d in m["params"]]
            self.models[name] = {"m": m, "weights": weights, "cases": np.load(ARTIFACTS / m["cases_file"])}
        return self.models[name]

    def logits(self, name, case, variant, clone=True):
        d = self.model(name)
        c = d["m"]["cases"][case]
        inputs = [self.torch.from_numpy(d["cases"][k]).to("cuda", copy=True) for k in c["inputs"]]
        out = self.vm(d["m"]["library"][variant])[d["m"]["vm"][variant]](*[self.tvm.runtime.from_dlpack(t) for t in inputs + d["weights"]])
        out = out[0] if not hasattr(out, "shape") else out
        return self.torch.from_dlpack(out).clone() if clone else out

    def kernels(self, name, case):
        return cuda_kernel_names(self.torch, lambda: self.logits(name, case, "mqa", clone=False))


@pytest.fixture(scope="module")
def dyn(rt):
    if MANIFEST is None:
        pytest.skip(NO_ARTIFACTS)
    return DynamicRuntime(rt)


@pytest.mark.parametrize("name, case", _params())
def test_dynamic_decode_logits_match_pytorch_eager(dyn, name, case):
    torch = dyn.torch
    d = dyn.model(name)
    m, c = d["m"], d["m"]["cases"][case]
    tol, e16 = m["tolerances"], m["fp16_eager_vs_fp32_eager"]["logits"]
    want = torch.from_numpy(d["cases"][c["reference"]])
    record = dyn.rt.results.setdefault(f"hf-dynamic-decode:{name}-{case}", {"pasts": c["pasts"]})
    record["tolerance_vs_fp32_eager"] = tol["vs_fp32"]["logits"]
    if "tvm_not_built" in m:  # TVM's own build of the graph fails (the builder recorded why)
        record["tvm_not_built"] = m["tvm_not_built"]
    got = {v: dyn.logits(name, case, v) for v in m["vm"]}
    # against TVM's own build, else FA2 on the expanded K/V
    failures, errs = logits_check(torch, got, want, tol, e16, base="tvm" if "tvm" in got else "nomqa")
    record["vs_fp32_eager"] = errs
    assert not failures, f"{name} at pasts {c['pasts']}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name, case", _params())
def test_dynamic_decode_launches_one_attention_a_layer(dyn, name, case):
    layers = len(MANIFEST["models"][name]["reports"])  # one site a layer
    try:
        kernels = dyn.kernels(name, case)
    except Exception as err:  # noqa: BLE001 - CUPTI may be unavailable
        pytest.skip(f"torch.profiler (CUPTI) could not record kernels: {type(err).__name__}: {err}")
    dyn.rt.results.setdefault(f"hf-dynamic-decode:{name}-{case}", {})["kernels"] = kernels
    attention = [k for k in kernels if ATTENTION_FORWARD.search(k)]
    assert len(attention) == layers, f"{len(attention)} attention kernels for {layers} layers: {kernels}"
    # kernels named like an expansion that the builder proved are not K/V's (an sdpa graph's o_proj weight
    # broadcast, a no-op broadcast_to before a batched matmul)
    allowed = MANIFEST["models"][name]["not_kv_expansion_kernels"]
    expanded = [k for k in kernels if not is_attention_kernel(k) and KV_EXPANSION.search(k)
                and not any(k.startswith(a) for a in allowed)]
    assert not expanded, f"K/V expansion kernels launched: {expanded} (not K/V: {allowed})"
