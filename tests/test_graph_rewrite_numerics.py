"""Every rewrite, checked numerically on the CPU: the canonicalized graph (attention on the native
K/V heads, lowered by TVM with LegalizeGroupedAttention) against a float32 NumPy reference of what
the original graph computes (``graphs.reference_attention``: query head h reads K/V head
h // (H / H_kv), or h % H_kv for tile; bottom-right causal and window masks).

The reference is itself checked against TVM's lowering of the original graphs in
``test_reference_is_what_the_original_graph_computes`` (slow: it builds every original graph)."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from mqa_byoc.testing import graphs as G
from mqa_byoc.compiler.graph.canonicalize import canonicalize_attention
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention

BNSH3 = ("BNSH",) * 3
# name: (graph, what it computes in reference_attention's terms)
CASES = {
    "repeat-bsnh-causal": (lambda: G.attention_repeat_bsnh(s=16), dict(causal="BottomRight")),
    "repeat-bsnh-chunked": (lambda: G.attention_repeat_bsnh(s=4, s_kv=16), dict(causal="BottomRight")),
    "repeat-bsnh-scale": (lambda: G.attention_repeat_bsnh(s=8, causal=None, scale=0.2), dict(scale=0.2)),
    "repeat-bsnh-topleft": (lambda: G.attention_repeat_bsnh(s=8, causal="TopLeft"), dict(causal="TopLeft")),
    "repeat-bsnh-window": (lambda: G.attention_repeat_bsnh(s=16, window=4), dict(causal="BottomRight", window=4)),
    "repeat-bsnh-window-chunked": (lambda: G.attention_repeat_bsnh(s=4, s_kv=16, causal=None, window=3),
                                   dict(window=3)),
    "mqa-broadcast": (lambda: G.attention_repeat_bsnh(s=8, hkv=1, expand="broadcast"), dict(causal="BottomRight")),
    "repeat-bnsh-axis1": (lambda: G.attention_repeat_bnsh(s=8),
                          dict(layouts=BNSH3, out_layout="BNSH", causal="BottomRight")),
    "mixed-q-bsnh-kv-bnsh": (lambda: G.attention_mixed_layouts(s=8, layouts="BSNH,BNSH,BNSH", out_layout="BNSH"),
                             dict(layouts=("BSNH", "BNSH", "BNSH"), out_layout="BNSH", causal="BottomRight")),
    "mixed-v-bnsh-chunked": (lambda: G.attention_mixed_layouts(s=4, s_kv=16, layouts="BNSH,BSNH,BNSH"),
                             dict(layouts=("BNSH", "BSNH", "BNSH"), causal="BottomRight")),
    "upstream-3d-chain": (lambda: G.upstream_3d_chain(s=8), dict()),
    "mlc-4d-minimum": (lambda: G.mlc_4d_chain(s=8), dict(out_layout="merged", causal="BottomRight")),
    "mlc-4d-chunked-add": (lambda: G.mlc_4d_chain(s=4, s_kv=16, mask="add", divide=False),
                           dict(out_layout="merged", causal="BottomRight")),
    "mlc-4d-where": (lambda: G.mlc_4d_chain(s=8, mask="where"), dict(out_layout="merged", causal="BottomRight")),
    "hf-repeat-kv": (lambda: G.hf_repeat_kv_chain(s=8),
                     dict(layouts=BNSH3, out_layout="merged", causal="BottomRight")),
    "hf-repeat-kv-mqa": (lambda: G.hf_repeat_kv_chain(s=8, hkv=1, mqa_broadcast=True),
                         dict(layouts=BNSH3, out_layout="merged", causal="BottomRight")),
    "tile-kept": (lambda: G.attention_repeat_bsnh(s=8, expand="tile"), dict(causal="BottomRight", grouping="tile")),
    # multi-head latent attention: V's head dim smaller than Q's and K's, V padded with zeros to theirs
    "mla-repeat-bsnh": (lambda: G.attention_repeat_bsnh(s=8, d=192, dv=128), dict(causal="BottomRight")),
    "mla-hf-repeat-kv": (lambda: G.hf_repeat_kv_chain(s=8, d=96, dv=64),
                         dict(layouts=BNSH3, out_layout="merged", causal="BottomRight")),
}


# Shapes are powers of two: LLVM takes minutes to compile TVM's fp16 attention kernels for odd
# lengths (S_q = 5, S_kv = 12: 40-120 s when the VM loads them), seconds for these.


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


def _reference(name, inputs):
    return G.reference_attention(*inputs, **CASES[name][1])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mqa", [True, False])
def test_canonicalized_graph_matches_reference(name, mqa):
    mod = CASES[name][0]()
    rewritten = canonicalize_attention(mod, mqa=mqa)
    if mqa and name != "tile-kept":  # else R.nn.attention on the expanded K/V: nothing to rewrite
        assert not tvm_ffi.structural_equal(rewritten, mod)
    inputs = _inputs(mod["main"])
    got = _run(LegalizeGroupedAttention()(rewritten), inputs)
    np.testing.assert_allclose(got, _reference(name, inputs), rtol=2e-2, atol=2e-2)





@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_is_what_the_original_graph_computes(name):
    mod = CASES[name][0]()
    inputs = _inputs(mod["main"])
    want = _run(LegalizeGroupedAttention()(mod), inputs)
    np.testing.assert_allclose(_reference(name, inputs), want, rtol=2e-2, atol=2e-2)
