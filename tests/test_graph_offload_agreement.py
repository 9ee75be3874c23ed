"""A site reported offloaded is partitioned and builds with both providers, and a
site that is not offloaded stays buildable.

- operands in any mix of BSNH / BNSH (composite parameters in any order) build with the native
  provider as with the python one (RunCodegen + relax.build for sm_90; no GPU needed);
- a sliding window whose S_q <= S_kv is not provable is rejected with the reason, and TVM's own
  lowering of the site left in the graph builds;
- several HF 3-D chains reading one BNSH K/V are each offloaded.
"""

from __future__ import annotations

import itertools
import subprocess

import pytest
import tvm
from tvm import relax

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.codegen.sites import find_site
from mqa_byoc.compiler.graph.spec import AttentionSpec

CUDA = {"kind": "cuda", "arch": "sm_90"}
LAYOUT_MIXES = [",".join(x) for x in itertools.product(("BSNH", "BNSH"), repeat=3)]


def build_cuda(mod, provider):
    """partition_for_cutlass -> RunCodegen -> relax.build for sm_90; returns (partitioned, executable)."""
    part = partition_for_cutlass(mod, provider=provider)
    out = relax.transform.RunCodegen({"flash_attn": {"provider": provider}})(part)
    return part, relax.build(out, target=tvm.target.Target(CUDA))


def _sites(part):
    return [find_site(f) for f in part.functions.values()
            if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs]


@pytest.mark.parametrize("out_layout", ["BSNH", "BNSH"])
@pytest.mark.parametrize("layouts", LAYOUT_MIXES)
def test_mixed_layouts_build_with_both_providers(layouts, out_layout):
    mod = G.attention_mixed_layouts(layouts=layouts, out_layout=out_layout)
    assert G.report_partition_disagreement(mod) == []
    (site,) = offload_report(mod)
    assert site.offloaded and site.composite == "flash_attn.attention_mqa", site.reason
    for provider in ("native", "python"):
        part, ex = build_cuda(mod, provider)
        (cs,) = _sites(part)
        spec = cs.spec
        assert (spec.q_layout, spec.k_layout, spec.v_layout) == tuple(layouts.split(","))
        assert spec.num_kv_heads == 2
        assert sorted(cs.arg_map) == [0, 1, 2]
        assert ex is not None


def test_native_wrapper_maps_parameters_onto_q_k_v():
    """Q in BSNH, K/V in BNSH: FuseOpsByPattern orders the parameters (k, v, q)."""
    part = partition_for_cutlass(G.attention_mixed_layouts(layouts="BSNH,BNSH,BNSH"), provider="native")
    (cs,) = _sites(part)
    assert cs.arg_map != (0, 1, 2)
    out = relax.transform.RunCodegen()(part)
    (ext,) = out.attrs["external_mods"]
    q, k, v = (f"in{i}" for i in cs.arg_map)
    assert f"return run({q}, {k}, {v}, out);" in ext.inspect_source()


def test_shared_operand_and_length_shape_in_native_wrapper():
    from mqa_byoc.compiler.codegen.native import emit_native_source

    spec = AttentionSpec(8, 2, 64, 64, "float16", 0.125, False)
    code = emit_native_source("s", spec, arg_map=(1, 0, 0), num_inputs=3, shape_params=(2,)).code
    assert "int run_params(DLTensor* in0, DLTensor* in1, tvm::ffi::Shape in2, DLTensor* out)" in code
    assert "return run(in1, in0, in0, out);" in code
    with pytest.raises(ValueError, match="do not cover each input once"):
        emit_native_source("s", spec, arg_map=(0, 1, 2), num_inputs=4)


WINDOW_FORMS = {
    "window-no-causal-symbolic": dict(s="n", s_kv="m", causal=None, window=8),
    "window-no-causal-fewer-heads": dict(s="n", s_kv="m", causal=None, window=8, expand="none"),
    "window-causal-symbolic": dict(s="n", s_kv="m", window=8),
}


@pytest.mark.parametrize("name", sorted(WINDOW_FORMS))
def test_window_without_provable_lengths_is_rejected_and_builds(name):
    mod = G.attention_repeat_bsnh(**WINDOW_FORMS[name])
    (site,) = offload_report(mod)
    assert not site.offloaded and "S_q <= S_kv is not provable" in site.reason
    assert G.report_partition_disagreement(mod) == []
    for provider in ("native", "python"):
        part, ex = build_cuda(mod, provider)
        assert G.composite_calls_per_function(part) == {}
        assert ex is not None


def test_window_with_provable_lengths_is_offloaded():
    mod = G.attention_repeat_bsnh(s=16, causal=None, window=8)
    (site,) = offload_report(mod)
    assert site.offloaded and site.window == 8
    assert G.report_partition_disagreement(mod) == []


@pytest.mark.parametrize("share_expansion", [False, True])
@pytest.mark.parametrize("sites", [2, 3])
def test_hf_chains_sharing_kv_are_each_offloaded(sites, share_expansion):
    mod = G.hf_chains_shared_kv(sites=sites, share_expansion=share_expansion)
    report = offload_report(mod)
    assert len(report) == sites and all(s.offloaded for s in report)
    assert G.report_partition_disagreement(mod) == []
    part = partition_for_cutlass(mod)
    assert G.composite_calls_per_function(part) == {"main": ["flash_attn.attention_mqa"] * sites}
    for op in ("relax.matmul", "relax.nn.softmax", "relax.broadcast_to"):
        assert G.count_ops(part, op) == 0


@pytest.mark.parametrize("make", [
    lambda: G.attention_repeat_bsnh(), lambda: G.attention_repeat_bsnh(s="n", s_kv="m"),
    lambda: G.upstream_3d_chain(), lambda: G.mlc_4d_chain(), lambda: G.hf_repeat_kv_chain(),
    lambda: G.mlc_4d_chain(mask="runtime"), lambda: G.attention_repeat_bsnh(dtype="float32"),
], ids=["repeat", "repeat-unprovable-causal", "upstream-3d", "mlc-4d", "hf", "runtime-mask", "fp32"])
@pytest.mark.parametrize("mqa", [True, False])
def test_report_and_partition_agree(make, mqa):
    assert G.report_partition_disagreement(make(), mqa=mqa) == []


def _heads_innermost_query(form):
    """Q a (B, S, heads) projection reshaped heads-innermost, (B, S, D, H), and permuted to the kernels' axes:
    its view chain passes through axes that are no layout, so Q is the permuted tensor itself."""
    from tvm.script import ir as I, relax as R

    if form == "fused":
        @I.ir_module
        class Fused:
            @R.function
            def main(qp: R.Tensor((1, 16, 256), "float16"), k: R.Tensor((1, 16, 2, 32), "float16"),
                     v: R.Tensor((1, 16, 2, 32), "float16")):
                with R.dataflow():
                    q = R.permute_dims(R.reshape(qp, R.shape([1, 16, 32, 8])), [0, 1, 3, 2])
                    o = R.nn.attention(q, R.repeat(k, 4, axis=2), R.repeat(v, 4, axis=2), causal_mask="BottomRight")
                    R.output(o)
                return o
        return Fused, (1, 16, 2, 32)

    @I.ir_module
    class Chain:
        @R.function
        def main(qp: R.Tensor((1, 16, 256), "float16"), k: R.Tensor((1, 2, 16, 32), "float16"),
                 v: R.Tensor((1, 2, 16, 32), "float16")):
            with R.dataflow():
                q = R.permute_dims(R.reshape(qp, R.shape([1, 16, 32, 8])), [0, 3, 1, 2])
                s = R.multiply(R.matmul(q, R.permute_dims(R.repeat(k, 4, axis=1), [0, 1, 3, 2])),
                               R.const(0.17677669529, "float16"))
                o = R.matmul(R.nn.softmax(s, axis=-1), R.repeat(v, 4, axis=1))
                R.output(o)
            return o
    return Chain, (1, 2, 16, 32)


@pytest.mark.parametrize("form", ["fused", "chain"])
def test_a_query_viewed_heads_innermost_is_offloaded_as_reported(form):
    import numpy as np

    mod, kv_shape = _heads_innermost_query(form)
    (site,) = offload_report(mod)
    assert site.offloaded and (site.num_q_heads, site.num_kv_heads) == (8, 2), site.reason
    for mqa in (True, False):
        assert G.report_partition_disagreement(mod, mqa=mqa) == []
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype("float16") for shape in ((1, 16, 256), kv_shape, kv_shape)]
    G.rewritten_on_cpu(mod, args)


@pytest.mark.skipif(G.native_export_skip_reason() is not None, reason=str(G.native_export_skip_reason()))
@pytest.mark.parametrize("layouts", ["BSNH,BNSH,BNSH", "BNSH,BSNH,BNSH"])
def test_mixed_layouts_export_native(layouts, tmp_path):
    """The native library links its wrapper, the dispatcher and the kernels (no GPU needed to export)."""
    from mqa_byoc import export_library

    mod = G.attention_mixed_layouts(h=16, hkv=4, d=128, layouts=layouts)
    part, ex = build_cuda(mod, "native")
    (cs,) = _sites(part)
    path = tmp_path / "native.so"
    export_library(ex, path, arch="sm_90", build=False)
    symbols = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True).stdout
    assert f"__tvm_ffi_{cs.symbol}" in symbols
    assert " mqa_byoc_fa2_forward" in symbols and "mqa_byoc_fa2_fwd_hdim128_fp16" in symbols
