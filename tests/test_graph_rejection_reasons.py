"""What the analysis reports for runtime biases, tile-expanded sites, masks applied
before the scale, cast scale constants, and non-module inputs."""

import math

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R

from mqa_byoc.testing import graphs as G
from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
from mqa_byoc.compiler.partition import canonicalize_attention

F16 = "float16"


def _run(mod, args):
    ex = relax.build(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _attention_scales(mod):
    """The ``scale`` attribute of every R.nn.attention in the composites of ``mod``."""
    out = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == "relax.nn.attention":
            out.append(float(e.attrs.scale.value) if e.attrs.scale is not None else None)

    for _gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            relax.analysis.post_order_visit(f.body, visit)
    return out


# ----------------------------------------------------------------------------- non-module input
@pytest.mark.parametrize("entry", [offload_report, partition_for_cutlass])
def test_non_module_input_raises_type_error(entry):
    with pytest.raises(TypeError, match=r"expects a tvm.IRModule .* got str"):
        entry("model.so")
    func = G.attention_repeat_bsnh()["main"]
    with pytest.raises(TypeError, match=r"got Function .*tvm.IRModule\(\{'main': func\}\)"):
        entry(func)


# ----------------------------------------------------------------------------- graph pieces
def _qkv(h, hkv, d, s_q, s_kv, dtype=F16, bnsh=True):
    """The q, k, v parameters of a test graph: (1, H, S, D) when ``bnsh``, else (1, S, H, D)."""
    def var(name, heads, s):
        return relax.Var(name, relax.TensorType([1, heads, s, d] if bnsh else [1, s, heads, d], dtype))

    return var("q", h, s_q), var("k", hkv, s_kv), var("v", hkv, s_kv)


def _repeat_kv(bb, k, v, times, axis):
    """K and V expanded to the query heads with ``R.repeat`` along the heads axis."""
    return bb.emit(R.repeat(k, times, axis=axis)), bb.emit(R.repeat(v, times, axis=axis))


# ----------------------------------------------------------------------------- runtime bias
def _bias_attention(s_q, s_kv, h=8, hkv=2, d=64):
    bb = relax.BlockBuilder()
    q, k, v = _qkv(h, hkv, d, s_q, s_kv, bnsh=False)
    bias = relax.Var("bias", relax.TensorType([1, h, s_q, s_kv], F16))
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            kk, vv = _repeat_kv(bb, k, v, h // hkv, axis=2)
            o = bb.emit_output(R.nn.attention(q, kk, vv, bias))
        bb.emit_func_output(o)
    return bb.get()


@pytest.mark.parametrize("s_q, s_kv", [(16, 8), (8, 16)])
def test_runtime_bias_is_named_whatever_the_lengths(s_q, s_kv):
    """More queries than keys used to hide the real reason behind "no sample sequence lengths"."""
    (site,) = offload_report(_bias_attention(s_q, s_kv))
    assert not site.offloaded
    assert "runtime input 'bias'" in site.reason
    assert G.composites(partition_for_cutlass(_bias_attention(s_q, s_kv))) == []


# ----------------------------------------------------------------------------- tile + another reason
def test_tile_site_rejected_for_another_reason_reports_that_reason():
    """A tiled site (FA2 cannot group h % H_kv) whose TopLeft mask with S_q != S_kv rules out FA2
    altogether: the reason is the mask, not the tile (removing the tile would not help). The head
    counts are those of the graph's attention, i.e. after the tile (8 K/V heads), which is also what
    FA2 would be given if the site were offloaded on the expanded K/V; the tile is in the note."""
    mod = G.attention_repeat_bsnh(h=8, hkv=2, s=8, s_kv=16, expand="tile", causal="TopLeft")
    (site,) = offload_report(mod)
    assert not site.offloaded
    assert site.reason.startswith("TopLeft causal mask with S_q != S_kv"), site.reason
    assert (site.num_q_heads, site.num_kv_heads) == (8, 8)
    assert "tile" in site.note
    assert G.composites(partition_for_cutlass(mod)) == []


def test_tile_site_float32_reports_dtype_and_post_tile_heads():
    (site,) = offload_report(G.attention_repeat_bsnh(h=8, hkv=2, expand="tile", dtype="float32"))
    assert not site.offloaded and site.reason.startswith("dtype float32"), site.reason
    assert site.num_kv_heads == 8 and "tile" in site.note


def test_tile_site_otherwise_fine_is_offloaded_on_the_tiled_heads():
    """The same counting when the tile is the only problem: plain MHA on the 8 tiled K/V heads."""
    mod = G.attention_repeat_bsnh(h=8, hkv=2, expand="tile")
    (site,) = offload_report(mod)
    assert site.offloaded and site.num_kv_heads == 8 and "tile" in site.note
    assert site.composite == "flash_attn.attention"


# ----------------------------------------------------------------------------- layouts the analysis cannot follow
def _chain(params, operands):
    """softmax(q @ kt * 0.125) @ v, where ``operands(bb)`` emits (q, kt, v) from ``params``."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, kt, v = operands(bb)
            sc = bb.emit(R.multiply(bb.emit(R.matmul(q, kt)), relax.const(0.125, F16)))
            o = bb.emit_output(R.matmul(bb.emit(R.nn.softmax(sc, axis=-1)), v))
        bb.emit_func_output(o)
    return bb.get()


def test_k_given_transposed_names_its_axes_and_where_the_trace_stops():
    """A 3-D chain whose K^T is a parameter (B*H, D, S): the kernels need K with the head dim innermost."""
    q, v = (relax.Var(n, relax.TensorType([8, 16, 64], F16)) for n in "qv")
    kt = relax.Var("kt", relax.TensorType([8, 64, 16], F16))
    (site,) = offload_report(_chain([q, kt, v], lambda bb: (q, kt, v)))
    assert not site.offloaded
    assert site.reason.startswith("K reaches attention with axes (batch*heads, head dim, sequence) where the "
                                  "analysis stops following it, at a parameter of the function; the kernels take "
                                  "(batch, sequence, heads, head dim)"), site.reason


def test_grouped_query_with_its_head_factors_swapped_names_them():
    """A 5-D query whose two head factors are permuted: its heads are no longer read in the order of the
    output's, which the reason shows axis by axis."""
    q = relax.Var("q", relax.TensorType([1, 2, 4, 16, 64], F16))
    k, v = (relax.Var(n, relax.TensorType([1, 4, 2, 16, 64], F16)) for n in "kv")
    mod = _chain([q, k, v], lambda bb: (bb.emit(R.permute_dims(q, [0, 2, 1, 3, 4])),
                                        bb.emit(R.permute_dims(k, [0, 1, 2, 4, 3])), v))
    (site,) = offload_report(mod)
    assert not site.offloaded
    assert ("Q reaches attention with axes (batch, heads' inner factor, heads' outer factor, sequence, head dim) "
            "where the analysis stops following it, at a parameter of the function") in site.reason, site.reason


# ----------------------------------------------------------------------------- mask before the scale
def _mask_then_scale(form, fill, scale_value=None, h=8, hkv=2, d=64, s=16):
    """softmax((scores + mask) * scale) or softmax(where(keep, scores, fill) / sqrt(D)), 4-D BNSH."""
    bb = relax.BlockBuilder()
    q, k, v = _qkv(h, hkv, d, s, s)
    keep = np.tril(np.ones((s, s), bool))[None, None]
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = _repeat_kv(bb, k, v, h // hkv, axis=1)
            scores = bb.emit(R.matmul(q, R.permute_dims(kk, [0, 1, 3, 2])))
            if form == "add-then-multiply":
                mask = relax.const(np.where(keep, 0, fill).astype(F16))
                scale = relax.const(scale_value if scale_value is not None else d ** -0.5, F16)
                x = bb.emit(R.multiply(R.add(scores, mask), scale))
            else:
                divisor = relax.const(1 / scale_value if scale_value is not None else math.sqrt(d), F16)
                x = bb.emit(R.divide(R.where(relax.const(keep), scores, relax.const(fill, F16)), divisor))
            p = bb.emit(R.nn.softmax(x, axis=-1))
            o = bb.emit_output(R.matmul(p, vv))
        bb.emit_func_output(o)
    return bb.get()


@pytest.mark.parametrize("form", ["add-then-multiply", "where-then-divide"])
@pytest.mark.parametrize("fill", [float(np.finfo(np.float16).min), -np.inf])
def test_mask_applied_before_the_scale_is_offloaded(form, fill):
    """fp16's finfo.min scaled by 1/8 is -8188: every masked weight is still exactly zero."""
    mod = _mask_then_scale(form, fill)
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.causal, site.window, site.num_kv_heads) == ("BottomRight", None, 2)
    assert site.scale == pytest.approx(0.125)
    out = partition_for_cutlass(mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype(F16) for shape in ((1, 8, 16, 64), (1, 2, 16, 64), (1, 2, 16, 64))]
    want = _run(mod, args)
    got = _run(LegalizeGroupedAttention()(canonicalize_attention(mod)), args)
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", ["add-then-multiply", "where-then-divide"])
def test_fill_that_no_longer_masks_after_the_scale_is_rejected(form):
    """-1000 scaled by 1/8 is -125: a masked key keeps weight exp(-125 - rowmax), not zero for
    every row (logits around -100 are possible), so FA2 would differ."""
    (site,) = offload_report(_mask_then_scale(form, -1000.0))
    assert not site.offloaded
    assert "large negative" in site.reason


# ----------------------------------------------------------------------------- rounded scale constants
@pytest.mark.parametrize("dtype, rounded", [
    ("float16", float(np.float16(96 ** -0.5))),
    ("bfloat16", float(ml_dtypes.bfloat16(96 ** -0.5))),
])
def test_scale_cast_from_float32_reaches_fa2_rounded(dtype, rounded):
    """Upstream's rewrite multiplies by ``astype(const(scale, "float32"), dtype)``: the graph scales
    by the rounded value (1/sqrt(96) is 0.1020621 in float32, 0.1020508 in fp16, 0.1020508 in bf16),
    so FA2 must be given that value."""
    h, hkv, d, s = 8, 2, 96, 16
    assert rounded != pytest.approx(96 ** -0.5, rel=1e-6)
    bb = relax.BlockBuilder()
    q, k, v = _qkv(h, hkv, d, s, s, dtype)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = _repeat_kv(bb, k, v, h // hkv, axis=1)
            scores = bb.emit(R.matmul(q, R.permute_dims(kk, [0, 1, 3, 2])))
            scale = bb.emit(R.astype(relax.const(96 ** -0.5, "float32"), dtype))
            p = bb.emit(R.nn.softmax(R.multiply(scores, scale), axis=-1))
            o = bb.emit_output(R.matmul(p, vv))
        bb.emit_func_output(o)
    mod = bb.get()
    (site,) = offload_report(mod)
    assert site.offloaded, site.reason
    assert site.scale == rounded
    assert _attention_scales(partition_for_cutlass(mod)) == [pytest.approx(rounded, rel=1e-7)]


# ----------------------------------------------------------------------------- bool cumsum in a mask
def _packed_sequence_mask_chain(flag_below, s=8, h=8, hkv=2, d=64):
    """HF's cache-less causal mask as TVM's frontend emits it: a segment id per position from a
    ``cumsum`` of bools typed bool (torch: int64), keys visible when causal and in the same segment.
    ``flag_below``: positions < this start a new segment (0: none, what positions 0..S-1 give)."""
    bb = relax.BlockBuilder()
    q, k, v = _qkv(h, hkv, d, s, s)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            pos = bb.emit(R.arange(0, s, 1, "int64"))
            flag = bb.emit(R.less(pos, relax.const(flag_below, "int64")))
            segment = bb.emit(R.cumsum(flag, axis=-1))
            assert str(segment.ty.dtype) == "bool"
            causal = bb.emit(R.less_equal(R.expand_dims(pos, [0]), R.expand_dims(pos, [1])))
            same = bb.emit(R.equal(R.expand_dims(segment, [1]), R.expand_dims(segment, [0])))
            ok = bb.emit(R.logical_and(causal, same))
            kk, vv = _repeat_kv(bb, k, v, h // hkv, axis=1)
            scores = bb.emit(R.multiply(R.matmul(q, R.permute_dims(kk, [0, 1, 3, 2])), relax.const(d ** -0.5, F16)))
            masked = bb.emit(R.where(ok, scores, relax.const(-65504.0, F16)))
            o = bb.emit_output(R.matmul(R.nn.softmax(masked, axis=-1), vv))
        bb.emit_func_output(o)
    return bb.get()


def test_bool_cumsum_of_all_false_is_evaluated():
    """LLVM cannot build a bool cumsum (nor compare bools); the evaluator computes it in int32."""
    (site,) = offload_report(_packed_sequence_mask_chain(0))
    assert site.offloaded, site.reason
    assert site.causal == "BottomRight"


def test_bool_cumsum_of_anything_else_is_rejected():
    """With a True in its input a bool cumsum has no single meaning (a sum cast to bool? mod 2?)."""
    (site,) = offload_report(_packed_sequence_mask_chain(3))
    assert not site.offloaded
    assert "cumulative sum of a bool tensor that is not all False" in site.reason


# ----------------------------------------------------------------------------- a scale held by a weight
@pytest.mark.parametrize("per_head", [False, True])
def test_a_scale_held_by_a_weight_parameter_names_it_and_binding_offloads_a_scalar(per_head):
    """A learned temperature (``scores * self.t``) with the weights as parameters (the frontends'
    ``keep_params_as_input``) is not known at compile time: the reason names the weight and says to bind
    it. Bound, a scalar becomes the kernels' softmax scale (CPU numerics of the rewrite); a per-head one is
    then rejected as such."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    class Temperature(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = torch.nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5 if per_head else torch.tensor(0.2))

        def forward(self, q, k, v):
            k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
            return ((q @ k.transpose(-1, -2)) * self.t).softmax(-1) @ v

    model = Temperature().half()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(F16) for s in ((1, 8, 16, 32), (1, 2, 16, 32), (1, 2, 16, 32)))
    ep = torch.export.export(model, tuple(torch.from_numpy(a) for a in (q, k, v)))
    mod = from_exported_program(ep, keep_params_as_input=True)
    [site] = offload_report(mod)
    assert not site.offloaded and "`p_t`" in site.reason and "BindParams" in site.reason, site.reason
    weight = model.t.detach().numpy()
    bound = relax.transform.BindParams("main", {"p_t": weight})(mod)
    [site] = offload_report(bound)
    if per_head:
        assert not site.offloaded and "per-head" in site.reason, site.reason
        return
    assert site.offloaded and site.scale == pytest.approx(0.2, rel=1e-3), site.reason
    got = G.rewritten_on_cpu(bound, [q, k, v])
    np.testing.assert_allclose(got, model.float()(*(torch.from_numpy(a).float() for a in (q, k, v))).detach().numpy(),
                               rtol=2e-2, atol=2e-2)
