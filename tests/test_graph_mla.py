"""Multi-head latent attention's head dims: Q and K have one head dim d (DeepSeek's 128 + 64 = 192), V a
smaller one dv (128). FA2 takes one head dim for all three, so the canonicalization pads V with zeros to d
on its last axis and slices the output back to dv: exact, since a zero column of V is a zero column of the
output. The composite sees equal head dims (every provider's codegen takes it unchanged); the report records
dv and its note says what the padding costs. A V larger than Q/K, or one whose head dim is not a multiple of
8, stays in the graph with its reason. The HF families (DeepSeek-V3, MiniCPM3, ...) are in
tests/test_hf_families.py, more forms in tests/test_graph_rewrite_numerics.py."""

import math

import numpy as np
import pytest
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.codegen.dispatch import spec_of

from test_codegen_dispatch import _build_cpu, _run, codegen_funcs, numpy_forward  # noqa: F401 - a fixture

F16 = "float16"
SCALE = 0.125  # not 1/sqrt(96): the chain's own scale must reach the kernel


@I.ir_module
class MlaChain:
    """Eager attention as a frontend emits it, BNSH: Q/K head dim 96, V head dim 64."""

    @R.function
    def main(q: R.Tensor((1, 4, 16, 96), "float16"), k: R.Tensor((1, 4, 16, 96), "float16"),
             v: R.Tensor((1, 4, 16, 64), "float16")) -> R.Tensor((1, 16, 256), "float16"):
        with R.dataflow():
            kt = R.permute_dims(k, [0, 1, 3, 2])
            s = R.multiply(R.matmul(q, kt), R.const(SCALE, "float16"))
            p = R.astype(R.nn.softmax(R.astype(s, "float32"), axis=-1), "float16")
            o = R.permute_dims(R.matmul(p, v), [0, 2, 1, 3])
            o = R.reshape(o, R.shape([1, 16, 256]))
            R.output(o)
        return o


def _chain(d, dv):
    """``MlaChain`` with other head dims (d for Q and K, dv for V)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 4, 16, d], F16))
    k = relax.Var("k", relax.TensorType([1, 4, 16, d], F16))
    v = relax.Var("v", relax.TensorType([1, 4, 16, dv], F16))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            s = bb.emit(R.multiply(R.matmul(q, bb.emit(R.permute_dims(k, [0, 1, 3, 2]))), R.const(SCALE, F16)))
            p = bb.emit(R.astype(R.nn.softmax(R.astype(s, "float32"), axis=-1), F16))
            o = bb.emit(R.permute_dims(bb.emit(R.matmul(p, v)), [0, 2, 1, 3]))
            o = bb.emit_output(R.reshape(o, [1, 16, 4 * dv]))
        bb.emit_func_output(o)
    return bb.get()


def _inputs(mod, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(x) for x in p.ty.shape.values]).astype(F16) for p in mod["main"].params]


def _reference(q, k, v):
    return G.reference_attention(q, k, v, layouts=("BNSH",) * 3, out_layout="merged", scale=SCALE)


def test_tvmscript_chain_with_a_smaller_v_is_offloaded_on_padded_v():
    (site,) = offload_report(MlaChain)
    assert site.offloaded, site.reason
    assert (site.head_dim, site.head_dim_v, site.composite) == (96, 64, "flash_attn.attention")
    assert site.scale == pytest.approx(SCALE)
    assert ("V is padded with zeros from head dim 64 to 96" in site.note and "1.5x its size" in site.note
            and "over 96 columns instead of 64" in site.note), site.note
    out = partition_for_cutlass(MlaChain)
    assert G.composites(out) == ["flash_attn.attention"]
    assert G.count_ops(out, "relax.nn.softmax") == 0
    assert G.count_ops(out, "relax.nn.pad") == 1 and G.count_ops(out, "relax.strided_slice") == 1
    (func,) = codegen_funcs(out)
    spec = spec_of(func)  # the composite: one head dim, the chain's scale
    assert (spec.head_dim, spec.head_dim_v, spec.num_q_heads, spec.num_kv_heads) == (96, 96, 4, 4)
    assert spec.scale == pytest.approx(SCALE) and not spec.causal
    inputs = _inputs(MlaChain)
    got = G.rewritten_on_cpu(MlaChain, inputs)
    np.testing.assert_allclose(got.astype("float32"), _reference(*inputs), rtol=2e-2, atol=2e-2)


def test_python_provider_gets_the_padded_v_and_the_output_is_sliced(tmp_path, numpy_forward):  # noqa: F811
    """The partitioned graph built for the CPU, FA2's call served by a NumPy stand-in: it is handed V padded
    to head dim 96 and writes a 96-wide output, of which the graph keeps the first 64 columns."""
    out = partition_for_cutlass(MlaChain, provider="python")
    inputs = _inputs(MlaChain, seed=1)
    got = _run(_build_cpu(out, tmp_path / "mla.so"), *inputs)
    np.testing.assert_allclose(got.astype("float32"), G.run_llvm(MlaChain, inputs).astype("float32"),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got.astype("float32"), _reference(*inputs), rtol=2e-2, atol=2e-2)
    (call,) = numpy_forward
    assert call["q"] == call["k"] == call["v"] == call["out"] == (1, 16, 4, 96), call
    assert call["scale"] == pytest.approx(SCALE)


@pytest.mark.parametrize("provider", ["python", "native", "hopper"])
def test_every_provider_codegen_takes_the_padded_composite(provider):
    """d = 128, dv = 64: after padding the hopper provider's FA4 object for head dim 128 serves it too."""
    out = relax.transform.RunCodegen({"flash_attn": {"provider": provider}})(
        partition_for_cutlass(_chain(128, 64), provider=provider))
    (ext,) = out.attrs["external_mods"]
    src = ext.inspect_source()
    assert "kHeadDim = 128;" in src
    assert "kHeadDimV" not in src or "kHeadDimV = 128;" in src
    if provider == "hopper":
        assert "fa4_sm90_fp16_h128" in src


@pytest.mark.parametrize("mod, d, dv", [
    (lambda: G.attention_repeat_bsnh(h=8, hkv=2, d=192, dv=128, s=16, causal="BottomRight"), 192, 128),
    (lambda: G.hf_repeat_kv_chain(h=8, hkv=2, d=96, dv=64, s=16), 96, 64),
    (lambda: G.softcap_chain(h=8, hkv=4, d=128, dv=64, s=16), 128, 64),
], ids=["nn-attention-gqa", "hf-repeat-kv-gqa", "softcap"])
def test_forms_pad_v_on_the_native_kv_heads(mod, d, dv):
    """R.nn.attention, HF's repeat_kv chain and a soft-capped chain: V is padded before its expansion is
    removed (H_kv heads, not H), the rewrite computes what the graph does."""
    mod = mod()
    (site,) = offload_report(mod)
    assert site.offloaded and (site.head_dim, site.head_dim_v) == (d, dv), site.reason
    out = partition_for_cutlass(mod)
    pads = [b.value for b in out["main"].body.blocks[0].bindings if getattr(b.value.op, "name", "") == "relax.nn.pad"]
    assert len(pads) == 1 and site.num_kv_heads < site.num_q_heads
    assert math.prod(int(x) for x in pads[0].ty.shape.values) == 16 * site.num_kv_heads * d  # (B, S, H_kv, d)
    inputs = _inputs(mod)
    G.rewritten_on_cpu(mod, inputs)


@pytest.mark.parametrize("d, dv, why", [
    (64, 128, "head dims differ (q 64, k 64, v 128): V's head dim is larger than Q's and K's"),
    (96, 60, "head dims differ (q 96, k 96, v 60): V's head dim is not a multiple of 8"),
])
def test_v_larger_or_not_a_multiple_of_8_stays_with_its_reason(d, dv, why):
    mod = _chain(d, dv)
    (site,) = offload_report(mod)
    assert not site.offloaded and site.reason.startswith(why), site.reason
    assert (site.head_dim, site.head_dim_v, site.note) == (d, dv, None)
    out = partition_for_cutlass(mod, gemm=False)
    assert G.composites(out) == [] and tvm_ffi.structural_equal(out, mod)



def test_var_len_attention_pads_v_too():
    """R.nn.attention_var_len with a smaller V: offloaded on the padded V (numerics: test_graph_varlen.py's
    ``mla`` form)."""
    from mqa_byoc.compiler.graph import varlen
    from mqa_byoc.testing.varlen_graphs import var_len_attention

    mod = var_len_attention(h=8, hkv=2, d=96, dv=64)
    (site,) = offload_report(mod)
    assert site.offloaded and (site.head_dim, site.head_dim_v, site.composite) == (96, 64, varlen.COMPOSITE)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == [varlen.COMPOSITE] and G.count_ops(out, "relax.nn.pad") == 1
    assert spec_of(codegen_funcs(out)[0]).head_dim_v == 96
