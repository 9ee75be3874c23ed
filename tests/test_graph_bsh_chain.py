"""The 3-D single-head chain: Q, K, V of shape (B, S, D) with no head axis (upstream TVM's BSH form of
test_attention_rewrite_offload), offloaded as FA2 attention with one query and one K/V head.

Report fields, the partition (one composite, no softmax left), CPU numerics of the rewrite against the
original graph, builds for CUDA with both providers; and the (B*H, S, D) chain reshaped from 4-D, which
is not single-head, still partitioned as grouped attention.
"""

from __future__ import annotations

import math
import re
import subprocess

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R

from mqa_byoc.testing import graphs as G
import mqa_byoc
from mqa_byoc.compiler.link import iter_modules, root_module
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
from mqa_byoc.compiler.partition import canonicalize_attention
from mqa_byoc.compiler.graph.spec import spec_from_composite

TARGET = {"kind": "cuda", "arch": "sm_90"}
NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def graph_scale(dtype, scale=0.1, divide=False, cast_scale=True):
    """The factor the graph applies to the scores: the constant rounded to ``dtype`` (astype'd from
    float32 or written in ``dtype``), inverted for a divide."""
    c = 1.0 / scale if divide else scale
    if cast_scale:
        c = np.float32(c)
    c = float(NP_DTYPE[dtype](c))
    return 1.0 / c if divide else c


# ---------------------------------------------------------------------------------------------- report
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask", ["none", "add", "where", "positions"])
@pytest.mark.parametrize("divide", [False, True])
def test_report_one_head(dtype, mask, divide):
    mod = G.bsh_chain(d=96, s=8, dtype=dtype, mask=mask, divide=divide, scale=0.1)
    (site,) = mqa_byoc.offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (1, 1, 96, dtype)
    assert site.composite == "flash_attn.attention" and site.form == "matmul-softmax chain"
    assert site.causal == (None if mask == "none" else "BottomRight") and site.window is None
    assert site.scale == pytest.approx(graph_scale(dtype, divide=divide), rel=1e-6)
    assert site.expansion is None and site.expansion_ops_removed == 0


@pytest.mark.parametrize("softmax_dtype", ["float32", None])
@pytest.mark.parametrize("cast_scale", [True, False])
def test_report_softmax_and_scale_spellings(softmax_dtype, cast_scale):
    mod = G.bsh_chain(d=64, s=4, s_kv=12, mask="add", softmax_dtype=softmax_dtype, cast_scale=cast_scale,
                      scale=0.1)
    (site,) = mqa_byoc.offload_report(mod)
    assert site.offloaded, site.reason
    assert site.causal == "BottomRight"  # S_q 4 < S_kv 12: bottom-right aligned
    assert site.scale == pytest.approx(graph_scale("float16", cast_scale=cast_scale), rel=1e-6)


def test_symbolic_lengths_and_batch():
    (site,) = mqa_byoc.offload_report(G.bsh_chain(b="b", s="n", mask="positions"))
    assert site.offloaded and site.causal == "BottomRight", site.reason
    # S_q <= S_kv is not provable for two unrelated lengths: the same rule as every other form
    (site,) = mqa_byoc.offload_report(G.bsh_chain(s="n", s_kv="m", mask="positions"))
    assert not site.offloaded and "S_q <= S_kv is not provable" in site.reason
    (site,) = mqa_byoc.offload_report(G.bsh_chain(s=1, s_kv="m"))  # decode, no mask
    assert site.offloaded and (site.num_q_heads, site.num_kv_heads) == (1, 1), site.reason


@pytest.mark.parametrize("kwargs, reason", [
    (dict(d=76), "head dim 76: FA2 needs a multiple of 8"),
    (dict(d=512), "head dim 512"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(mask="runtime"), "runtime input 'mask'"),
])
def test_rejected_with_the_rules_of_every_form(kwargs, reason):
    mod = G.bsh_chain(**kwargs)
    (site,) = mqa_byoc.offload_report(mod)
    assert not site.offloaded and reason in site.reason
    part = mqa_byoc.partition_for_cutlass(mod)
    assert G.composites(part) == [] and G.count_ops(part, "relax.nn.softmax") == 1


def _mixed_chain():
    """Q given as (B*H, S, D), K/V as (B, S, H, D) reshaped to (B*H, S, D): the graph is valid attention,
    but Q has no head axis and K/V have one."""
    b, h, s, d = 1, 2, 8, 64
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([b * h, s, d], "float16"))
    k = relax.Var("k", relax.TensorType([b, s, h, d], "float16"))
    v = relax.Var("v", relax.TensorType([b, s, h, d], "float16"))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            k3, v3 = (bb.emit(R.reshape(bb.emit(R.permute_dims(x, [0, 2, 1, 3])), [b * h, s, d])) for x in (k, v))
            sc = bb.emit(R.multiply(bb.emit(R.matmul(q, bb.emit(R.permute_dims(k3, [0, 2, 1])))),
                                    relax.const(0.125, "float16")))
            o = bb.emit_output(R.matmul(bb.emit(R.nn.softmax(sc, axis=-1)), v3))
        bb.emit_func_output(o)
    return bb.get()


def test_mixed_single_head_and_headed_operands_rejected():
    mod = _mixed_chain()
    (site,) = mqa_byoc.offload_report(mod)
    assert not site.offloaded
    assert "mix (B, S, D) single-head operands" in site.reason and "Q BSH, K BSNH, V BSNH" in site.reason
    assert G.composites(mqa_byoc.partition_for_cutlass(mod)) == []


# ------------------------------------------------------------------------------------------- partition
def _composite_funcs(mod):
    found = []
    for _gv, f in mod.functions.items():
        if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs:
            relax.analysis.post_order_visit(f.body, lambda e: found.append(e) if isinstance(e, relax.Function)
                                            and e.attrs is not None and "Composite" in e.attrs else None)
    return found


@pytest.mark.parametrize("mqa", [True, False])
@pytest.mark.parametrize("kwargs", [
    dict(mask="add", dtype="bfloat16", divide=True),
    dict(mask="none", softmax_dtype=None, b=2),
    dict(mask="where", s=4, s_kv=12, d=128),
], ids=["bf16-add-divide", "f16-nomask-batch2", "f16-where-chunked-d128"])
def test_partition_one_composite_no_softmax(kwargs, mqa):
    mod = G.bsh_chain(**kwargs)
    part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa)
    assert G.composites(part) == ["flash_attn.attention"]
    for op in ("relax.nn.softmax", "relax.matmul", "relax.nn.attention", "relax.permute_dims"):
        assert G.count_ops(part, op) == 0, f"{op} left in main:\n{part['main']}"
    relax.analysis.well_formed(part)
    (func,) = _composite_funcs(part)
    spec = spec_from_composite(func)
    (site,) = mqa_byoc.offload_report(mod, mqa=mqa)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (1, 1, site.head_dim)
    assert spec.causal == (site.causal is not None) and spec.scale == pytest.approx(site.scale)
    assert (spec.q_layout, spec.k_layout, spec.v_layout, spec.out_layout) == ("BSNH",) * 4
    b, s = (int(x) for x in mod["main"].params[0].ty.shape.values[:2])
    assert [int(x) for x in func.params[0].ty.shape.values] == [b, s, 1, site.head_dim]
    assert [int(x) for x in part["main"].ret_ty.shape.values] == [b, s, site.head_dim]  # (B, S, D) again


def test_upstream_3d_chain_from_4d_keeps_its_heads():
    """The (B*H, S, D) chain reshaped from 4-D BSNH is grouped attention, not single-head: traced to the
    4-D sources, FA2 gets H and H_kv heads and the operands without any (B, S, 1, D) view."""
    mod = G.upstream_3d_chain(h=8, hkv=2, d=64, s=16)
    (site,) = mqa_byoc.offload_report(mod)
    assert site.offloaded and (site.num_q_heads, site.num_kv_heads) == (8, 2)
    assert site.composite == "flash_attn.attention_mqa" and site.expansion_ops_removed == 2
    canon = canonicalize_attention(mod)
    atts = []
    relax.analysis.post_order_visit(canon["main"].body, lambda e: atts.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", "") == "relax.nn.attention" else None)
    (att,) = atts
    assert [a.same_as(p) for a, p in zip(att.args[:3], canon["main"].params)] == [True] * 3


# ------------------------------------------------------------------------------------------- numerics
def _inputs(func, dims, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for p in func.params:
        shape = [int(x) if isinstance(x, tvm.tirx.IntImm) else dims[x.name] for x in p.ty.shape.values]
        out.append(rng.standard_normal(shape).astype(NP_DTYPE.get(str(p.ty.dtype), np.float32)))
    return out


def _run_cpu(mod, inputs):
    ex = relax.build(LegalizeGroupedAttention()(mod), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy().astype("float32")


NUMERICS = {
    "f16-multiply-causal-add": dict(mask="add", s=16),
    "f16-divide-where-chunked": dict(mask="where", s=5, s_kv=12, divide=True),
    "f16-positions-symbolic": dict(mask="positions", s="n", b="b"),
    "f16-nomask-f16-softmax-batch3": dict(b=3, s=7, s_kv=9, softmax_dtype=None, cast_scale=False),
    "bf16-multiply-causal-add": dict(mask="add", s=16, dtype="bfloat16"),
    "bf16-divide-nomask": dict(s=6, s_kv=10, divide=True, dtype="bfloat16", d=128),
    "bf16-positions-chunked": dict(mask="positions", s=3, s_kv=11, dtype="bfloat16", scale=0.3),
}


@pytest.mark.parametrize("name", sorted(NUMERICS))
def test_rewrite_matches_original_on_cpu(name):
    kwargs = NUMERICS[name]
    mod = G.bsh_chain(**kwargs)
    (site,) = mqa_byoc.offload_report(mod)
    assert site.offloaded, site.reason
    rewritten = canonicalize_attention(mod)
    assert G.count_ops(rewritten, "relax.nn.softmax") == 0 and G.count_ops(rewritten, "relax.nn.attention") == 1
    inputs = _inputs(mod["main"], {"n": 13, "b": 2})
    want = _run_cpu(mod, inputs)
    got = _run_cpu(rewritten, inputs)
    tol = 2e-2 if kwargs.get("dtype", "float16") == "float16" else 6e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # the inputs make a difference: a rewrite that dropped the mask or the scale would not pass
    if site.causal:
        dropped = canonicalize_attention(G.bsh_chain(**{**kwargs, "mask": "none"}))
        assert np.abs(_run_cpu(dropped, inputs) - want).max() > 10 * tol


# ---------------------------------------------------------------------------------------------- builds
BUILDS = {
    "f16-causal-d128": dict(mask="add", s=32, d=128),
    "bf16-divide-f32softmax-d64": dict(s=16, s_kv=48, d=64, divide=True, dtype="bfloat16", mask="where"),
    "f16-nomask-d64": dict(b=2, s=24, d=64),
    "bf16-causal-positions-d128": dict(mask="positions", s="n", d=128, dtype="bfloat16"),
}


def _sources(ex) -> str:
    return "\n".join(m.inspect_source() for m in iter_modules(root_module(ex)) if m.kind in ("c", "source"))


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_python_provider_builds_for_cuda(name, tmp_path):
    mod = G.bsh_chain(**BUILDS[name])
    (site,) = mqa_byoc.offload_report(mod)
    ex = mqa_byoc.build(mod, TARGET, provider="python")
    src = _sources(ex)
    assert "provider: python" in src
    assert "kNumQHeads = 1;" in src and "kNumKVHeads = 1;" in src and f"kHeadDim = {site.head_dim};" in src
    assert f"kCausal = {'true' if site.causal else 'false'};" in src
    assert "nn.softmax" not in ex.as_text() and "flash_attn" in ex.as_text()
    ex.export_library(str(tmp_path / "python.so"))
    assert (tmp_path / "python.so").stat().st_size > 0


@pytest.mark.skipif(G.native_export_skip_reason() is not None, reason=str(G.native_export_skip_reason()))
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_native_provider_builds_and_links(name, tmp_path):
    mod = G.bsh_chain(**BUILDS[name])
    (site,) = mqa_byoc.offload_report(mod)
    ex = mqa_byoc.build(mod, TARGET, provider="native")
    src = _sources(ex)
    assert "kHeads = 1;" in src and "kKvHeads = 1;" in src and f"kHeadDim = {site.head_dim};" in src
    path = tmp_path / "native.so"
    mqa_byoc.export_library(ex, str(path), arch="sm_90", build=False, progress=None)
    syms = subprocess.run(["nm", str(path)], capture_output=True, text=True, check=True).stdout
    dt = "bf16" if site.dtype == "bfloat16" else "fp16"
    kernel = f"mqa_byoc_fa2_fwd_hdim{site.head_dim}_{dt}{'_causal' if site.causal else ''}"
    assert re.search(rf" [Tt] {kernel}\b", syms), f"{kernel} not linked"
    assert re.search(r" [Tt] mqa_byoc_fa2_forward\b", syms)


def test_scale_helper_rounds_like_the_graph():
    # 0.1 is not a float16: the graph multiplies by float16(0.1); 10 is, so a divide gives exactly 0.1
    assert graph_scale("float16") == float(np.float16(0.1)) != 0.1
    assert graph_scale("float16", divide=True) == pytest.approx(0.1, rel=1e-12)
    assert math.isclose(graph_scale("bfloat16"), float(ml_dtypes.bfloat16(0.1)))
