"""CPU check of the GPU var-len test's fp32 reference (``test_gpu_varlen.reference``) against the NumPy
reference of mqa_byoc.testing.varlen_graphs (itself checked against PyTorch's SDPA in tests/test_graph_varlen.py), on
the cases of mqa_byoc.testing.varlen_cases (what tools/gpu/build_varlen.py builds); and of the built manifest
where it exists."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_common as gc
import test_gpu_varlen as tgv
from mqa_byoc.testing import varlen_cases as vc


@pytest.mark.parametrize("index", range(len(vc.CASES)))
def test_gpu_reference_equals_numpy_reference(index):
    torch = pytest.importorskip("torch")
    if not gc.full_tvm():
        pytest.skip("needs the full TVM (tvm.relax): this is a runtime-only TVM")
    from mqa_byoc.testing.varlen_graphs import var_len_reference

    case = vc.CASES[index]
    specs, values = vc.case_inputs(case, vc.case_graph(case))
    entry = {"inputs": specs, "lens_q": case["lens_q"], "lens_k": case["lens_k"],
             "attention": vc.case_attention(case), "merged": bool(case["graph"].get("merged"))}
    tensors = []
    for spec in specs:
        arr = values[f"{case['name']}/{spec['name']}"]
        if spec["dtype"] == "bfloat16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        tensors.append(torch.from_numpy(np.asarray(arr)))
    got = tgv.reference(torch, entry, tensors).double().numpy()
    by_name = {s["name"]: t.double().numpy() for s, t in zip(specs, tensors)}
    att = entry["attention"]
    h, hkv, d = att["num_q_heads"], att["num_kv_heads"], att["head_dim"]
    want = var_len_reference(by_name["q"].reshape(1, -1, h, d), by_name["k"].reshape(1, -1, hkv, d),
                             by_name["v"].reshape(1, -1, hkv, d), case["lens_q"], case["lens_k"],
                             att["causal"], att["window"], att["scale"])
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-4)
    if case["name"].endswith("more_queries"):  # the first rows of sequence 0 see no key
        assert (want[0, :case["lens_q"][0] - case["lens_k"][0]] == 0).all()


def test_built_manifest_is_consistent():
    if tgv.MANIFEST is None:
        pytest.skip(f"no {tgv.ARTIFACTS}/manifest.json (python tools/gpu/build_varlen.py)")
    inputs = np.load(tgv.ARTIFACTS / "inputs.npz")
    for name, case in tgv.MANIFEST["cases"].items():
        assert "mqa_python" in case["functions"]
        for spec in case["inputs"]:
            assert list(inputs[f"{name}/{spec['name']}"].shape) == spec["shape"]
        assert any(s["device"] == "cpu" for s in case["inputs"]) == any(
            s["name"].startswith("max") and s["device"] == "cpu" for s in case["inputs"])
    for lib in tgv.MANIFEST["libraries"].values():
        assert (tgv.ARTIFACTS / lib["file"]).stat().st_size == lib["size"]
