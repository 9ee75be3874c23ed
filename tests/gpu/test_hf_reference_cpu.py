"""CPU checks of the HF decoder artifacts (``tools/gpu/build_hf.py``), no GPU needed.

- the manifest agrees with the files: weights, inputs and references have the shapes and dtypes the
  library's functions take, and the folder stays small enough to copy to the GPU machine with the ~20 MiB runtime kit;
- provenance (needs torch and transformers, i.e. the build machine): the model rebuilt from the
  manifest's config and seed has exactly the stored weights, and PyTorch eager on the stored inputs
  reproduces the stored float32 reference logits and caches.

Skipped without artifacts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HF_ARTIFACTS = Path(os.environ.get("MQA_BYOC_GPU_HF_ARTIFACTS", ROOT / ".gpu-artifacts" / "hf"))
COPY_BUDGET = 44 * 2**20  # with the ~20 MiB runtime kit, at most 64 MiB go to the GPU machine
MANIFEST = json.loads((HF_ARTIFACTS / "manifest.json").read_text()) if (HF_ARTIFACTS / "manifest.json").exists() \
    else None
MODELS = list(MANIFEST["models"]) if MANIFEST else []
NO_ARTIFACTS = pytest.mark.skipif(MANIFEST is None, reason=f"no HF decoder artifacts in {HF_ARTIFACTS} "
                                                           "(python tools/gpu/build_hf.py)")


def _npz(m, key):
    return np.load(HF_ARTIFACTS / m[key])


@NO_ARTIFACTS
def test_hf_manifest_matches_files():
    for rel, size in MANIFEST["files"].items():
        assert (HF_ARTIFACTS / rel).stat().st_size == size, rel
    assert MANIFEST["total_bytes"] <= COPY_BUDGET, f"{MANIFEST['total_bytes'] / 2**20:.1f} MiB"
    assert (HF_ARTIFACTS / MANIFEST["library"]["library"]).exists()
    for name, m in MANIFEST["models"].items():
        weights, inputs, ref = _npz(m, "weights"), _npz(m, "inputs"), _npz(m, "reference")
        for pname, shape, dtype in m["params"]:
            assert weights[pname].shape == tuple(shape) and str(weights[pname].dtype) == dtype, pname
        for mode, f in m["functions"].items():
            keys = m["input_keys"][mode]
            assert [[k, list(inputs[k].shape), str(inputs[k].dtype)] for k in keys] == \
                   [[k, s, d] for k, (_n, s, d) in zip(keys, f["inputs"])], (name, mode)
            assert list(ref[f"{mode}_logits"].shape) == f["outputs"][0][1]
            assert set(f["vm"]) == {"mqa", "nomqa", "tvm"}
            assert all(s["offloaded"] for r in f["reports"].values() for s in r)
            assert f["partitioned"]["mqa"]["expansion_ops_left"] == {
                "relax.broadcast_to": 0, "relax.repeat": 0, "relax.tile": 0}
        # the prefill's caches are the decode step's past
        prefill_caches = [o[1] for o in m["functions"]["prefill"]["outputs"][1:]]
        assert [list(inputs[k].shape) for k in m["input_keys"]["decode"][1:]] == prefill_caches


@NO_ARTIFACTS
@pytest.mark.parametrize("name", MODELS)
def test_hf_reference_reproduces(name):
    pytest.importorskip("torch", reason="needs torch (CPU is enough)")
    pytest.importorskip("transformers", reason="needs transformers (the build machine)")
    from mqa_byoc.testing import hf_models as hm

    m = MANIFEST["models"][name]
    spec = hm.HFModel(**m["spec"])
    m16, m32, _ = hm.build_models(spec, m["seed"])
    weights, inputs, ref = _npz(m, "weights"), _npz(m, "inputs"), _npz(m, "reference")
    for hf_name, p in m16.named_parameters():
        stored = weights[f"p_model_{hf_name.replace('.', '_')}"]
        assert np.array_equal(p.detach().numpy(), stored), hf_name
    assert len(list(m16.parameters())) == len(m["params"])

    prefill = hm.eager(m32, "prefill", [inputs[k] for k in m["input_keys"]["prefill"]])
    decode = hm.eager(m32, "decode", [inputs[k] for k in m["input_keys"]["decode"]])
    # bitwise with the build's thread count; allow float32 reduction-order noise otherwise
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(prefill[0], ref["prefill_logits"], **tol)
    np.testing.assert_allclose(decode[0], ref["decode_logits"], **tol)
    for i, k in enumerate(m["input_keys"]["decode"][1:]):
        np.testing.assert_allclose(prefill[1 + i], inputs[k].astype(np.float32), rtol=1e-3, atol=1e-3)  # fp16 past
        out = m["functions"]["decode"]["outputs"][1 + i][0]
        np.testing.assert_allclose(decode[1 + i][:, :, -1:], ref[f"decode_{out}_last"], **tol)
    assert np.array_equal(inputs["decode_input_ids"][:, 0], ref["prefill_logits"][:, -1].argmax(-1))
