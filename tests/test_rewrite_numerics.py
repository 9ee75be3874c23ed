"""Every rewrite, checked numerically on the CPU: the canonicalized graph (attention on the native
K/V heads, lowered by TVM with LegalizeGroupedAttention) against the original graph."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import graphs as G
from mqa_byoc.compiler.gqa_legalize import LegalizeGroupedAttention
from mqa_byoc.compiler.partition import canonicalize_attention

CASES = {
    "repeat-bsnh-causal": lambda: G.attention_repeat_bsnh(s=16),
    "repeat-bsnh-chunked": lambda: G.attention_repeat_bsnh(s=5, s_kv=12),
    "repeat-bsnh-negative-scale": lambda: G.attention_repeat_bsnh(s=8, causal=None, scale=-0.2),
    "repeat-bsnh-topleft": lambda: G.attention_repeat_bsnh(s=8, causal="TopLeft"),
    "mqa-broadcast": lambda: G.attention_repeat_bsnh(s=8, hkv=1, expand="broadcast"),
    "repeat-bnsh-axis1": lambda: G.attention_repeat_bnsh(s=8),
    "upstream-3d-chain": lambda: G.upstream_3d_chain(s=8),
    "mlc-4d-minimum": lambda: G.mlc_4d_chain(s=8),
    "mlc-4d-chunked-add": lambda: G.mlc_4d_chain(s=3, s_kv=10, mask="add", divide=False),
    "mlc-4d-where": lambda: G.mlc_4d_chain(s=8, mask="where"),
    "hf-repeat-kv": lambda: G.hf_repeat_kv_chain(s=8),
    "hf-repeat-kv-mqa": lambda: G.hf_repeat_kv_chain(s=8, hkv=1, mqa_broadcast=True),
    "tile-kept": lambda: G.attention_repeat_bsnh(s=8, expand="tile"),
}



def _run(mod, inputs):
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy().astype("float32")


def _inputs(func, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in func.params:
        shape = [int(x) if isinstance(x, tvm.tirx.IntImm) else 8 for x in p.ty.shape.values]
        out.append(rng.standard_normal(shape).astype(str(p.ty.dtype)))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mqa", [True, False])
def test_canonicalized_graph_matches_original(name, mqa):
    mod = CASES[name]()
    rewritten = canonicalize_attention(mod, mqa=mqa)
    if mqa and name != "tile-kept":  # else R.nn.attention on the expanded K/V: nothing to rewrite
        assert not tvm_ffi.structural_equal(rewritten, mod)
    inputs = _inputs(mod["main"])
    want = _run(LegalizeGroupedAttention()(mod), inputs)
    got = _run(LegalizeGroupedAttention()(rewritten), inputs)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
