"""partition_for_cutlass / offload_report on every graph form: structure, report, rejections."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.partition import canonicalize_attention

EXPANSION_OPS = ("relax.repeat", "relax.broadcast_to", "relax.expand_dims", "relax.tile")

FORMS = {
    "repeat-bsnh": lambda: G.attention_repeat_bsnh(),
    "repeat-bsnh-window": lambda: G.attention_repeat_bsnh(window=8),
    "repeat-bsnh-scale": lambda: G.attention_repeat_bsnh(scale=0.003, causal=None),
    "repeat-bsnh-bf16": lambda: G.attention_repeat_bsnh(dtype="bfloat16"),
    "repeat-bsnh-decode": lambda: G.attention_repeat_bsnh(s=1, s_kv="m"),
    "repeat-bsnh-chunked": lambda: G.attention_repeat_bsnh(s=4, s_kv=20),
    "repeat-bsnh-symbolic-batch": lambda: G.attention_repeat_bsnh(b="b"),
    "mqa-broadcast": lambda: G.attention_repeat_bsnh(hkv=1, expand="broadcast"),
    "mqa-repeat": lambda: G.attention_repeat_bsnh(h=71, hkv=1, d=64),
    "repeat-bnsh-axis1": lambda: G.attention_repeat_bnsh(),
    "upstream-3d-chain": lambda: G.upstream_3d_chain(),
    "upstream-3d-chain-plain-scale": lambda: G.upstream_3d_chain(cast_scale=False),
    "mlc-4d-minimum": lambda: G.mlc_4d_chain(),
    "mlc-4d-add-multiply": lambda: G.mlc_4d_chain(mask="add", divide=False),
    "mlc-4d-where": lambda: G.mlc_4d_chain(mask="where"),
    "mlc-4d-chunked": lambda: G.mlc_4d_chain(s=4, s_kv=16),
    "mlc-4d-decode-nomask": lambda: G.mlc_4d_chain(s=1, s_kv=16, mask="none"),
    "hf-repeat-kv": lambda: G.hf_repeat_kv_chain(),
    "hf-repeat-kv-mqa": lambda: G.hf_repeat_kv_chain(hkv=1, mqa_broadcast=True),
    "grouped-5d-matmul": lambda: G.grouped_5d_chain(),
    "grouped-5d-matmul-mqa": lambda: G.grouped_5d_chain(hkv=1),
    "grouped-5d-matmul-symbolic": lambda: G.grouped_5d_chain(s="n"),
}


def _expected(name):
    return {"mqa-broadcast": 1, "mqa-repeat": 1, "hf-repeat-kv-mqa": 1, "grouped-5d-matmul-mqa": 1}.get(name, 2)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_offloaded_natively(name):
    mod = FORMS[name]()
    report = offload_report(mod)
    assert len(report) == 1
    site = report[0]
    assert site.offloaded, site.reason
    assert site.reason is None
    assert site.composite == "flash_attn.attention_mqa"
    assert site.num_kv_heads == _expected(name)
    assert site.num_q_heads in (8, 71)
    assert site.dtype in ("float16", "bfloat16")
    assert site.expansion_ops_removed >= 2

    out = partition_for_cutlass(mod, mqa=True)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    for op in EXPANSION_OPS + ("relax.nn.attention", "relax.nn.softmax", "relax.matmul"):
        assert G.count_ops(out, op) == 0, f"{op} left in main:\n{out['main']}"
    relax.analysis.well_formed(out)


def test_report_fields_causal_window_scale():
    (site,) = offload_report(G.attention_repeat_bsnh(window=8, scale=0.5))
    assert (site.causal, site.window, site.scale) == ("BottomRight", 8, 0.5)
    (site,) = offload_report(G.attention_repeat_bsnh(causal=None))
    assert site.causal is None and site.scale == pytest.approx(1 / 8)
    (site,) = offload_report(G.mlc_4d_chain())
    assert site.causal == "BottomRight" and site.scale == pytest.approx(1 / 8)
    assert site.expansion == "repeat" and site.expansion_ops_removed == 2
    (site,) = offload_report(G.hf_repeat_kv_chain())
    assert site.expansion == "repeat" and site.expansion_ops_removed == 6  # expand_dims, broadcast, reshape x2


def test_mqa_false_keeps_expansion_and_offloads_mha():
    for mod in (G.attention_repeat_bsnh(), G.mlc_4d_chain(), G.hf_repeat_kv_chain()):
        (site,) = offload_report(mod, mqa=False)
        assert site.offloaded and site.composite == "flash_attn.attention"
        assert site.num_kv_heads == site.num_q_heads == 8
        out = partition_for_cutlass(mod, mqa=False)
        assert G.composites(out) == ["flash_attn.attention"]
        assert sum(G.count_ops(out, op) for op in EXPANSION_OPS) >= 2


def test_native_gqa_attention_form6():
    mod = G.attention_repeat_bsnh(expand="none")
    (site,) = offload_report(mod)
    assert site.offloaded and site.composite == "flash_attn.attention_mqa" and site.expansion is None
    # the baseline repeats K/V explicitly, so TVM's h % H_kv lowering never sees fewer heads
    out = partition_for_cutlass(mod, mqa=False)
    assert G.composites(out) == ["flash_attn.attention"]
    assert G.count_ops(out, "relax.repeat") == 2


def test_tile_is_not_gqa_but_offloaded_as_mha():
    mod = G.attention_repeat_bsnh(expand="tile")
    (site,) = offload_report(mod)
    assert site.offloaded and site.composite == "flash_attn.attention"
    assert "h % H_kv" in site.note
    out = partition_for_cutlass(mod)
    assert G.count_ops(out, "relax.tile") == 2  # the expansion stays: FA2 groups heads differently
    mod = G.hf_repeat_kv_chain(outer=True)  # expand on the outer axis: also h % H_kv
    (site,) = offload_report(mod)
    assert site.composite == "flash_attn.attention" and "h % H_kv" in site.note


def test_tile_with_one_kv_head_is_mqa():
    mod = G.attention_repeat_bsnh(hkv=1, expand="tile")
    (site,) = offload_report(mod)
    assert site.composite == "flash_attn.attention_mqa" and site.num_kv_heads == 1


@I.ir_module
class GroupedQuery5D:
    """Grouped-query attention on 5-D tensors as TVMScript: R.matmul broadcasts K/V's unit group axis."""

    @R.function
    def main(q: R.Tensor((1, 8, 16, 64), "float16"), k: R.Tensor((1, 2, 16, 64), "float16"),
             v: R.Tensor((1, 2, 16, 64), "float16")):
        with R.dataflow():
            qg = R.reshape(q, R.shape([1, 2, 4, 16, 64]))
            kt = R.permute_dims(R.expand_dims(k, axis=[2]), axes=[0, 1, 2, 4, 3])
            scores = R.multiply(R.matmul(qg, kt), R.const(0.125, "float16"))
            p = R.nn.softmax(scores, axis=-1)
            o = R.reshape(R.matmul(p, R.expand_dims(v, axis=[2])), R.shape([1, 8, 16, 64]))
            R.output(o)
        return o


def _random_args(mod):
    rng = np.random.default_rng(0)
    return [rng.standard_normal([int(n) for n in p.ty.shape.values]).astype("float16") for p in mod["main"].params]


@pytest.mark.parametrize("make, hkv", [
    (lambda: GroupedQuery5D, 2),
    (lambda: G.grouped_5d_chain(), 2),
    (lambda: G.grouped_5d_chain(hkv=1), 1),
    (lambda: G.grouped_5d_chain(inputs="5d"), 2),  # the 5-D views are the parameters: read through reshapes
    (lambda: G.grouped_5d_chain(hkv=1, inputs="5d"), 1),
    (lambda: G.grouped_5d_chain(hkv=8), 8),  # groups of one query head: plain MHA
    (lambda: G.grouped_5d_chain(hkv=1, outer=True), 1),  # one K/V head: the outer grouping is the same
])
def test_grouped_5d_matmuls_offloaded_and_rewrite_numerics(make, hkv):
    """(B, H_kv, G, S, D) @ (B, H_kv, 1, D, S): query head h = kv * G + g uses K/V head h // G, FA2's
    grouping, with no K/V expansion in the graph to remove."""
    mod = make()
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.num_q_heads, site.num_kv_heads) == (8, hkv)
    out = partition_for_cutlass(mod)
    assert len(G.composites(out)) == 1
    for op in EXPANSION_OPS + ("relax.nn.softmax", "relax.matmul"):
        assert G.count_ops(out, op) == 0, f"{op} left in main:\n{out['main']}"
    G.rewritten_on_cpu(mod, _random_args(mod))


@pytest.mark.parametrize("inputs", ["4d", "5d"])
def test_grouped_5d_matmuls_with_the_outer_grouping_stay_in_the_graph(inputs):
    """(B, G, H_kv, S, D) @ (B, 1, H_kv, D, S): query head h uses K/V head h % H_kv; the matmul does the
    expansion, so none can be kept for plain MHA either."""
    mod = G.grouped_5d_chain(outer=True, inputs=inputs)
    for mqa in (True, False):
        (site,) = offload_report(mod, mqa=mqa)
        assert not site.offloaded and site.note is None
        assert "the matmul broadcasting them over the query's outer head factor (tile)" in site.reason, site.reason
        assert "h % H_kv" in site.reason
        assert G.composites(partition_for_cutlass(mod, mqa=mqa)) == []


def test_grouped_5d_matmuls_broadcasting_the_query_are_rejected():
    """Q (B, 1, G, S, D) against K/V (B, H_kv, 1, S, D): the matmul broadcasts the query over K/V heads."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 1, 4, 16, 64], "float16"))
    k = relax.Var("k", relax.TensorType([1, 2, 1, 16, 64], "float16"))
    with bb.function("main", [q, k]):
        with bb.dataflow():
            sc = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 2, 4, 3]))))
            p = bb.emit(relax.op.nn.softmax(sc, axis=-1))
            o = bb.emit_output(relax.op.matmul(p, k))
        bb.emit_func_output(o)
    (site,) = offload_report(bb.get())
    assert not site.offloaded
    assert "broadcast the query's head axes (1, 4) against K's (2, 1)" in site.reason, site.reason


REJECTIONS = {
    "float32": (lambda: G.attention_repeat_bsnh(dtype="float32"), "dtype float32"),
    "head-dim-not-multiple-of-8": (lambda: G.attention_repeat_bsnh(d=36), "head dim 36"),
    "head-dim-too-large": (lambda: G.attention_repeat_bsnh(d=320), "head dim 320"),
    "topleft-chunked": (lambda: G.attention_repeat_bsnh(s=4, s_kv=16, causal="TopLeft"), "TopLeft"),
    "runtime-mask": (lambda: G.mlc_4d_chain(mask="runtime"), "runtime input 'mask'"),
    "bias-not-causal": (
        lambda: G.mlc_4d_chain(mask="add", mask_const=np.random.default_rng(0).normal(
            size=(1, 1, 16, 16)).astype("float16")), "neither 0 nor a large negative"),
    "topleft-mask-chunked": (
        lambda: G.mlc_4d_chain(s=4, s_kv=16, mask="where", mask_const=np.tril(
            np.ones((4, 16), bool))[None, None]), "top-left"),
    "mask-differs-per-head": (
        lambda: G.mlc_4d_chain(mask="add", mask_const=np.concatenate(
            [G.causal_mask_np(16, 16, 0, -65504, "float16")] * 7
            + [np.zeros((1, 1, 16, 16), "float16")], axis=1)), "differs between batches or heads"),
}


@pytest.mark.parametrize("name", sorted(REJECTIONS))
def test_rejected_sites_keep_graph_and_say_why(name):
    make, words = REJECTIONS[name]
    mod = make()
    (site,) = offload_report(mod)
    assert not site.offloaded and site.composite is None
    assert site.reason and words in site.reason, site.reason
    assert G.composites(partition_for_cutlass(mod)) == []  # (an explicit chain's matmuls may be GEMMs)
    tvm.ir.assert_structural_equal(partition_for_cutlass(mod, gemm=False), mod)


def test_fp32_graph_offloads_after_mixed_precision():
    mod = G.attention_repeat_bsnh(dtype="float32", causal=None, s=16)
    assert not offload_report(mod)[0].offloaded
    mod = relax.transform.ToMixedPrecision(out_dtype="float16")(mod)
    (site,) = offload_report(mod)
    # ToMixedPrecision casts the inputs; the attention then runs in float16
    assert site.offloaded, site.reason


def test_symbolic_sequence_lengths_and_batch():
    mod = G.attention_repeat_bsnh(b="b", s="n", s_kv="m")
    (site,) = offload_report(mod)
    # BottomRight with independent S_q, S_kv: S_q <= S_kv is not provable
    assert not site.offloaded and "S_q <= S_kv" in site.reason
    mod = G.attention_repeat_bsnh(b="b", s=1, s_kv="m")
    assert offload_report(mod)[0].offloaded


def test_tvmscript_module_with_two_functions():
    @I.ir_module
    class Mod:
        @R.function
        def prefill(q: R.Tensor((1, "n", 32, 128), "float16"), k: R.Tensor((1, "n", 8, 128), "float16"),
                    v: R.Tensor((1, "n", 8, 128), "float16")):
            with R.dataflow():
                kk = R.repeat(k, 4, axis=2)
                vv = R.repeat(v, 4, axis=2)
                o = R.nn.attention(q, kk, vv, causal_mask="TopLeft")
                R.output(o)
            return o

        @R.function
        def decode(q: R.Tensor((1, 1, 32, 128), "float16"), k: R.Tensor((1, "m", 8, 128), "float16"),
                   v: R.Tensor((1, "m", 8, 128), "float16")):
            with R.dataflow():
                kk = R.repeat(k, 4, axis=2)
                vv = R.repeat(v, 4, axis=2)
                o = R.nn.attention(q, kk, vv)
                R.output(o)
            return o

    report = offload_report(Mod)
    assert sorted(s.function for s in report) == ["decode", "prefill"]
    assert all(s.offloaded and s.num_kv_heads == 8 for s in report)
    assert {s.causal for s in report} == {"TopLeft", None}
    out = partition_for_cutlass(Mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"] * 2
    for fn in ("prefill", "decode"):
        assert G.count_ops(out, "relax.repeat", fn) == 0


def test_provider_attribute_and_bad_provider():
    out = partition_for_cutlass(G.attention_repeat_bsnh(), provider="python")
    attrs = [f.attrs for f in out.functions.values() if isinstance(f, relax.Function)
             and f.attrs is not None and "Codegen" in f.attrs]
    assert [str(a["mqa_byoc.provider"]) for a in attrs] == ["python"]
    with pytest.raises(ValueError, match="provider"):
        partition_for_cutlass(G.attention_repeat_bsnh(), provider="cutlass")


def test_canonicalize_is_idempotent_and_leaves_no_expansion():
    mod = canonicalize_attention(G.hf_repeat_kv_chain())
    again = canonicalize_attention(mod)
    tvm.ir.assert_structural_equal(mod, again)


def test_passes_compose_in_a_user_sequential():
    """The partition's passes are module passes: a user Sequential gives what partition_for_cutlass gives."""
    from mqa_byoc import AnnotateProvider, CanonicalizeAttention, LegalizeGroupedAttention
    from mqa_byoc.compiler.graph.patterns import flash_attn_patterns

    mod = G.hf_repeat_kv_chain()
    seq = tvm.transform.Sequential([
        CanonicalizeAttention(mqa=True),
        relax.transform.FuseOpsByPattern(flash_attn_patterns(), annotate_codegen=True),
        AnnotateProvider("python"),
        LegalizeGroupedAttention(),
    ])
    tvm.ir.assert_structural_equal(seq(mod), partition_for_cutlass(mod, provider="python"))


@pytest.mark.parametrize("bad", ["main", None, 3])
def test_non_module_input_is_a_type_error(bad):
    for entry in (partition_for_cutlass, offload_report):
        with pytest.raises(TypeError, match="expects a tvm.IRModule"):
            entry(bad)


def test_patterns_are_in_tvms_pattern_registry():
    """As TVM's own backends do: the table under the prefix "flash_attn", highest priority first, and a
    user's FuseOpsByPattern with the registered patterns gives the partition's composites."""
    from tvm.relax.backend.pattern_registry import get_pattern, get_patterns_with_prefix

    from mqa_byoc import CanonicalizeAttention, LegalizeGroupedAttention
    from mqa_byoc.compiler.graph.patterns import flash_attn_patterns

    registered = get_patterns_with_prefix("flash_attn")
    assert [p.name for p in registered] == [p.name for p in flash_attn_patterns()]
    assert {p.name for p in registered} == {"flash_attn.attention_mqa", "flash_attn.attention",
                                            "flash_attn.attention_var_len"}
    assert get_pattern("flash_attn.attention_var_len") is not None
    for name, mqa in (("hf-repeat-kv", True), ("repeat-bsnh", True), ("mqa-repeat", False)):
        mod = FORMS[name]()
        seq = tvm.transform.Sequential([
            CanonicalizeAttention(mqa=mqa),
            relax.transform.FuseOpsByPattern(get_patterns_with_prefix("flash_attn"), annotate_codegen=True),
            LegalizeGroupedAttention(),
        ])
        ours = partition_for_cutlass(mod, mqa=mqa)
        assert G.composites(ours)
        tvm.ir.assert_structural_equal(seq(mod), ours)


def test_use_flash_mqa_is_upstreams_name_of_mqa():
    mod = G.attention_repeat_bsnh()
    for flag in (True, False):
        want = partition_for_cutlass(mod, mqa=flag)
        tvm.ir.assert_structural_equal(partition_for_cutlass(mod, use_flash_mqa=flag), want)
        tvm.ir.assert_structural_equal(partition_for_cutlass(mod, mqa=flag, use_flash_mqa=flag), want)
    assert G.composites(partition_for_cutlass(mod, use_flash_mqa=True)) != \
        G.composites(partition_for_cutlass(mod, use_flash_mqa=False))
    tvm.ir.assert_structural_equal(partition_for_cutlass(mod), partition_for_cutlass(mod, mqa=True))
    with pytest.raises(ValueError, match="mqa=True and use_flash_mqa=False disagree"):
        partition_for_cutlass(mod, mqa=True, use_flash_mqa=False)
