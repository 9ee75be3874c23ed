"""GPU test of R.nn.attention_var_len offloaded to FA2's var-len forward.

Artifacts from ``python tools/gpu/build_varlen.py`` (``.gpu-artifacts/varlen``, or
``MQA_BYOC_VARLEN_ARTIFACTS``); runs with a runtime-only TVM (``rt`` fixture of conftest.py: the runtime kit's set-up,
torch, the python providers). Per case and variant (``mqa``/``nomqa`` x ``python``/``native``):

- the output matches an fp32 PyTorch reference computed sequence by sequence from the manifest (query
  head h reads K/V head h // (H / H_kv); BottomRight causal per sequence, TopLeft, window w keys ending
  at the diagonal; a row that sees no key is 0, FA2's output there); ``mqa=True`` matches ``mqa=False``;
- ``max_seqlen`` inputs live on the host in some cases and on the GPU in others (the wrappers read the
  former, bound the grid by the total length for the latter);
- with ``torch.profiler`` (CUPTI): the ``mqa=True`` run launches an attention kernel and no K/V expansion
  kernel; in the hopper provider's library FA4's sm90 kernel exactly where the site has no window, head
  dim 64/128 and, if causal, one seqstart for q and K/V (FA2's var-len kernel elsewhere).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from mqa_byoc.testing.attention_cases import TOLERANCES
from mqa_byoc.testing.cupti import is_attention_kernel

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("MQA_BYOC_VARLEN_ARTIFACTS", ROOT / ".gpu-artifacts" / "varlen"))
TIGHT = TOLERANCES["fp32"]  # the graph-form cases' tolerance against the fp32 reference, by dtype
EXPANSION = re.compile(r"repeat|broadcast|tile|concat|expand", re.IGNORECASE)


def _manifest():
    path = ARTIFACTS / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


MANIFEST = _manifest()


def _params():
    if MANIFEST is None:
        return [pytest.param(None, None, id="no-artifacts", marks=pytest.mark.skip(
            reason=f"no {ARTIFACTS}/manifest.json: run `python tools/gpu/build_varlen.py` on the build machine"))]
    out = []
    for name, case in MANIFEST["cases"].items():
        for variant in sorted(case["functions"]):
            out.append(pytest.param(name, variant, id=f"{name}-{variant}"))
    return out


@pytest.fixture(scope="module")
def varlen(rt):
    tvm = rt.tvm
    vms = {}
    for provider, lib in MANIFEST["libraries"].items():
        module = tvm.runtime.load_module(str(ARTIFACTS / lib["file"]))
        vms[provider] = tvm.runtime.vm.VirtualMachine(module, tvm.cuda(0))
    return {"vms": vms, "inputs": np.load(ARTIFACTS / "inputs.npz")}


def _tensors(rt, varlen, name):
    """The case's inputs as torch tensors on the device the manifest names (cuda or cpu)."""
    torch = rt.torch
    out = []
    for spec in MANIFEST["cases"][name]["inputs"]:
        arr = varlen["inputs"][f"{name}/{spec['name']}"]
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if spec["dtype"] == "bfloat16" else \
            torch.from_numpy(arr.copy())  # not ascontiguousarray: it makes a 0-d max_seqlen 1-d
        out.append(t.to(spec["device"], copy=True))
    return out


def _run(rt, varlen, name, variant, tensors):
    provider = variant.split("_", 1)[1]
    fn = varlen["vms"][provider][MANIFEST["cases"][name]["functions"][variant]]
    out = fn(*[rt.tvm.runtime.from_dlpack(t) for t in tensors])
    return rt.torch.from_dlpack(out).clone()


def reference(torch, case, tensors):
    """fp32 var-len attention, sequence by sequence (see the module docstring)."""
    att = case["attention"]
    by_name = {spec["name"]: t for spec, t in zip(case["inputs"], tensors)}
    h, hkv, d = att["num_q_heads"], att["num_kv_heads"], att["head_dim"]
    q = by_name["q"].float().reshape(-1, h, d)
    k = by_name["k"].float().reshape(-1, hkv, d).repeat_interleave(h // hkv, dim=1)
    v = by_name["v"].float().reshape(-1, hkv, d).repeat_interleave(h // hkv, dim=1)
    out = torch.zeros_like(q)
    cq = np.concatenate([[0], np.cumsum(case["lens_q"])])
    ck = np.concatenate([[0], np.cumsum(case["lens_k"])])
    for i, (sq, sk) in enumerate(zip(case["lens_q"], case["lens_k"])):
        qi, ki, vi = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        s = torch.einsum("qhd,khd->hqk", qi, ki) * float(att["scale"])
        row = torch.arange(sq, device=q.device)[:, None]
        col = torch.arange(sk, device=q.device)[None, :]
        diag = row if att["causal"] == "TopLeft" else row + (sk - sq)
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if att["causal"] is not None:
            keep &= col <= diag
        if att["window"] is not None:
            keep &= col > diag - int(att["window"])
        p = s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)  # no visible key: 0
        out[cq[i]:cq[i + 1]] = torch.einsum("hqk,khd->qhd", p, vi)
    return out.reshape(-1, h * d) if case["merged"] else out[None]


@pytest.mark.parametrize("name, variant", _params())
def test_varlen_matches_fp32_reference(rt, varlen, name, variant):
    torch = rt.torch
    case = MANIFEST["cases"][name]
    tensors = _tensors(rt, varlen, name)
    got = _run(rt, varlen, name, variant, tensors)
    want = reference(torch, case, [t.cuda() for t in tensors])
    err = float((got.float() - want).abs().max())
    rt.results.setdefault(f"varlen-{name}-{variant}", {})["max_abs_err"] = err
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want, **TIGHT[case["attention"]["dtype"]],
                               msg=lambda s: f"{name} {variant} vs fp32 (max err {err}): {s}")
    other = variant.replace("mqa_", "nomqa_") if variant.startswith("mqa_") else variant.replace("nomqa_", "mqa_")
    if other in case["functions"]:
        torch.testing.assert_close(got.float(), _run(rt, varlen, name, other, tensors).float(),
                                   **TIGHT[case["attention"]["dtype"]])


@pytest.mark.parametrize("name, variant", [p for p in _params() if p.values[1] is None
                                           or p.values[1].startswith("mqa_")])
def test_varlen_mqa_launches_no_kv_expansion(rt, varlen, name, variant):
    torch = rt.torch
    from torch.profiler import ProfilerActivity, profile

    tensors = _tensors(rt, varlen, name)
    _run(rt, varlen, name, variant, tensors)
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _run(rt, varlen, name, variant, tensors)
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - CUPTI may be unavailable
        pytest.skip(f"torch.profiler (CUPTI) could not record kernels: {type(err).__name__}: {err}")
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    rt.results.setdefault(f"varlen-{name}-{variant}", {})["kernels"] = names
    assert any(is_attention_kernel(n) for n in names), f"no attention kernel: {names}"
    assert not [n for n in names if EXPANSION.search(n)], f"K/V expansion kernels with mqa=True: {names}"
    if variant.endswith("_hopper"):
        case = MANIFEST["cases"][name]
        att = case["attention"]
        want_fa4 = (att["window"] is None and att["head_dim"] in (64, 128)
                    and (att["causal"] is None or case.get("same_seqstart", False)))
        ran_fa4 = any("FlashAttentionForwardSm90" in n for n in names)
        assert ran_fa4 == want_fa4, f"{name} {variant}: FA4 expected {want_fa4}, kernels {names}"
