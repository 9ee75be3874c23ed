"""Sites a user writes outside ``R.dataflow()`` blocks, and inside ``R.If`` branches: reported, partitioned
and rewritten like the same sites at the top level of a dataflow block (TVM's ``FuseOpsByPattern`` only
groups dataflow bindings; the partition's ``EnterDataflow`` moves them there first)."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I, relax as R

import mqa_byoc
from mqa_byoc.compiler.graph import gemm
from mqa_byoc.compiler.graph.dataflow import EnterDataflow, sites_outside_dataflow
from mqa_byoc.testing import graphs as G


def _attention_no_dataflow():
    @I.ir_module
    class Module:
        @R.function
        def main(q: R.Tensor((1, 16, 8, 64), "float16"), k: R.Tensor((1, 16, 2, 64), "float16"),
                 v: R.Tensor((1, 16, 2, 64), "float16"), w: R.Tensor((128, 512), "float16")):
            kr = R.repeat(k, 4, axis=2)
            vr = R.repeat(v, 4, axis=2)
            o = R.nn.attention(q, kr, vr, causal_mask="BottomRight")
            o2 = R.reshape(o, (16, 512))
            y = R.matmul(o2, R.permute_dims(w))
            return y
    return Module


def _attention_in_a_branch():
    @I.ir_module
    class Module:
        @R.function
        def main(c: R.Tensor((), "bool"), q: R.Tensor((1, 16, 8, 64), "float16"),
                 k: R.Tensor((1, 16, 2, 64), "float16"), v: R.Tensor((1, 16, 2, 64), "float16"),
                 w: R.Tensor((128, 512), "float16")):
            if c:
                kr = R.repeat(k, 4, axis=2)
                vr = R.repeat(v, 4, axis=2)
                o = R.nn.attention(q, kr, vr, causal_mask="BottomRight")
                o2 = R.reshape(o, (16, 512))
                r = R.matmul(o2, R.permute_dims(w))
            else:
                r = R.zeros((16, 128), "float16")
            return r
    return Module


def _inputs(with_condition):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float16") for s in ((1, 16, 8, 64), (1, 16, 2, 64), (1, 16, 2, 64))]
    arrays.append((rng.standard_normal((128, 512)) / 16).astype("float16"))
    return ([np.array(True)] if with_condition else []) + arrays


@pytest.mark.parametrize("build", [_attention_no_dataflow, _attention_in_a_branch], ids=["no-dataflow", "if-branch"])
def test_report_and_partition_agree_on_sites_outside_a_dataflow_block(build):
    mod = build()
    report = mqa_byoc.offload_report(mod, gemm=True)
    attention = [s for s in report if isinstance(s, mqa_byoc.OffloadSite)]
    gemms = [s for s in report if isinstance(s, gemm.GemmSite)]
    assert [(s.offloaded, s.num_kv_heads, s.expansion_ops_removed) for s in attention] == [(True, 2, 2)], attention
    assert [(s.offloaded, s.composite) for s in gemms] == [(True, "cublaslt.matmul_transposed")], gemms
    part = mqa_byoc.partition_for_cutlass(mod)
    assert G.composites(part) == ["flash_attn.attention_mqa"]
    assert sorted(str(f.attrs["Codegen"]) for f in part.functions.values()
                  if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs) == [
        "cublaslt", "flash_attn"]
    assert G.count_ops(part, "relax.repeat") == 0
    relax.transform.RunCodegen()(part)  # the codegens read both sites


@pytest.mark.parametrize("build", [_attention_no_dataflow, _attention_in_a_branch], ids=["no-dataflow", "if-branch"])
def test_rewrite_of_sites_outside_a_dataflow_block_computes_the_original(build):
    mod = build()
    args = _inputs(build is _attention_in_a_branch)
    G.rewritten_on_cpu(mod, args)  # the attention on the native K/V heads, inside the branch too
    # the GEMM composite inlined back: what cuBLASLt's call computes, on the CPU
    gemm_only = gemm.inline_gemm_composites(gemm.PartitionGemm()(mod))
    np.testing.assert_allclose(G.run_llvm(gemm_only, args), G.run_llvm(mod, args), rtol=2e-2, atol=2e-2)
    if build is _attention_in_a_branch:  # the other branch
        args[0] = np.array(False)
        np.testing.assert_allclose(G.run_llvm(gemm_only, args), 0)


def test_enter_dataflow_leaves_modules_without_sites_outside_dataflow_unchanged():
    mod = G.hf_repeat_kv_chain(s=8)  # in a dataflow block already
    assert not sites_outside_dataflow(mod["main"])
    assert EnterDataflow()(mod).same_as(mod)

    @I.ir_module
    class NoSite:
        @R.function
        def main(x: R.Tensor((4, 8), "float16")):
            y = R.add(x, x)
            return y

    assert EnterDataflow()(NoSite).same_as(NoSite)
    moved = EnterDataflow()(_attention_no_dataflow())
    assert sites_outside_dataflow(_attention_no_dataflow()["main"]) and not sites_outside_dataflow(moved["main"])
    tvm.ir.assert_structural_equal(moved, relax.transform.ConvertToDataflow(min_size=1)(_attention_no_dataflow()))
