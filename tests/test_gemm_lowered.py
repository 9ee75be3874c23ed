"""Matmuls that TVM lowered before the partition (``FuseTransposeMatmul``'s ``NT_matmul``, ``LegalizeOps``'
``matmul``): read back as Relax matmuls, offloaded like the graph before the lowering, numerics on llvm;
PrimFuncs that only carry the name stay on TVM with a reason."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

import mqa_byoc
from mqa_byoc.compiler.graph import gemm
from mqa_byoc.compiler.graph.lowered_matmul import RestoreLoweredMatmul, lowered_matmul_reason
from mqa_byoc.contract import GEMM_CODEGEN, gemm_composite_name
from mqa_byoc.testing.gemm_graphs import FORMS, draw_inputs, gemm_graph, run_llvm, run_llvm_outputs

LOWERINGS = {"FuseTransposeMatmul": relax.transform.FuseTransposeMatmul, "LegalizeOps": relax.transform.LegalizeOps}


def _codegen_funcs(mod):
    return [f for f in mod.functions.values()
            if isinstance(f, relax.Function) and f.attrs is not None and str(f.attrs.get("Codegen", "")) == GEMM_CODEGEN]


def _prim_names(mod):
    return sorted(gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc))


@pytest.mark.parametrize("form", FORMS, ids=[gemm_composite_name(*f) for f in FORMS])
def test_after_fuse_transpose_matmul_every_pattern_is_offloaded_as_before(form):
    mod, specs = gemm_graph(*form, rows=(2, "n"))
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    if form[0]:
        assert "NT_matmul" in _prim_names(lowered)  # the pass did lower it: the test is about that form
    part = mqa_byoc.partition_for_cutlass(lowered)
    [func] = _codegen_funcs(part)
    assert str(func.attrs["global_symbol"]).endswith("cublaslt")
    [site] = gemm.gemm_report(lowered)
    assert site.offloaded and site.composite == gemm_composite_name(*form), gemm.format_gemm_report([site])
    [before] = gemm.gemm_report(mod)
    assert (site.m, site.n, site.k, site.transposed, site.epilogue) == \
        (before.m, 128, 64, form[0], before.epilogue) and "n" in site.m
    assert "NT_matmul" not in _prim_names(part)  # nothing of TVM's kernel is left to call
    arrays = draw_inputs(specs, {"n": 5})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)


#: every pattern form, and ToMixedPrecision's cast back of a float32 matmul output (the cast composites)
LEGALIZED_SITES = [(form, {}) for form in FORMS] + [
    ((t, False, None, False), {"out_dtype": "float32", "cast": "float16"}) for t in (True, False)]


@pytest.mark.parametrize("form,kwargs", LEGALIZED_SITES,
                         ids=[gemm_composite_name(*f) + ("_cast" if k else "") for f, k in LEGALIZED_SITES])
def test_after_legalize_ops_every_pattern_is_offloaded_as_before(form, kwargs):
    # LegalizeOps lowers the matmul, nn.Linear's weight transpose, the bias and residual adds, the
    # activation and the cast back to PrimFuncs of their own: each is read back (exactly LegalizeOps'
    # PrimFunc for these operands), so the composite is the one of the graph as written and no TVM kernel of
    # the site is left
    mod, specs = gemm_graph(*form, rows=(3, "n"), **kwargs)
    lowered = relax.transform.LegalizeOps()(mod)
    assert "matmul" in _prim_names(lowered)
    part = mqa_byoc.partition_for_cutlass(lowered)
    [func] = _codegen_funcs(part)
    [site] = gemm.gemm_report(lowered)
    [before] = gemm.gemm_report(mod)
    want = gemm_composite_name(*form) + ("_cast" if kwargs else "")
    assert site.offloaded and site.composite == before.composite == want, gemm.format_gemm_report([site])
    assert (site.transposed, site.epilogue) == (before.transposed, before.epilogue)
    assert _prim_names(part) == [], _prim_names(part)
    arrays = draw_inputs(specs, {"n": 4})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)


def test_a_legalized_epilogue_of_no_matmul_or_of_other_operands_stays_on_tvm():
    # an add of two parameters follows no matmul: it is left as TVM lowered it; an add PrimFunc swapped for
    # one that computes something else (a subtraction under the name) is not read back after the matmul
    x = relax.Var("x", relax.TensorType([4, 64], "float16"))
    w = relax.Var("w", relax.TensorType([64, 128], "float16"))
    b = relax.Var("b", relax.TensorType([128], "float16"))
    c = relax.Var("c", relax.TensorType([4, 64], "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, c]):
        with bb.dataflow():
            x2 = bb.emit(relax.op.add(x, c))
            y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x2, w)), b))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    lowered = relax.transform.LegalizeOps()(mod)
    restored = RestoreLoweredMatmul()(lowered)
    ops = [str(e.op.name) for e in _calls_in(restored["main"]) if isinstance(e.op, tvm.ir.Op)]
    assert ops.count("relax.call_tir") == 1 and "relax.matmul" in ops and "relax.add" in ops  # x + c stays
    [site] = gemm.gemm_report(lowered)
    assert site.offloaded and site.epilogue is not None
    arrays = draw_inputs([("x", (4, 64), "float16"), ("w", (64, 128), "float16"), ("b", (128,), "float16"),
                          ("c", (4, 64), "float16")])
    part = mqa_byoc.partition_for_cutlass(lowered)
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)
    bias_add = next(e.args[0] for e in _calls_in(lowered["main"]) if getattr(e.op, "name", None) == "relax.call_tir"
                    and any(getattr(f, "name", None) == "b" for f in e.args[1].fields))
    lowered = _swap_in(lowered, bias_add.name_hint, _subtract_bias)
    restored = RestoreLoweredMatmul()(lowered)
    assert bias_add.name_hint in _prim_names(restored)  # the edited "add" stays TVM's kernel
    [site] = gemm.gemm_report(lowered)
    assert site.offloaded and site.epilogue is None
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(mqa_byoc.partition_for_cutlass(lowered)), arrays),
                               run_llvm(lowered, arrays), rtol=1e-3, atol=1e-3)


@T.prim_func(private=True, s_tir=True)
def _subtract_bias(a: T.Buffer((T.int64(4), T.int64(128)), "float16"), b: T.Buffer((T.int64(128),), "float16"),
                   out: T.Buffer((T.int64(4), T.int64(128)), "float16")):
    T.func_attr({"tirx.noalias": True})
    for i, j in T.grid(T.int64(4), T.int64(128)):
        with T.sblock("T_add"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            out[v_i, v_j] = a[v_i, v_j] - b[v_j]


def _calls_in(func):
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found


def test_a_legalized_transpose_used_elsewhere_stays_and_one_of_other_axes_is_not_read_back():
    # the transposed weight also returned: the matmul reads the weight, the transpose kernel stays for
    # the other use
    w = relax.Var("w", relax.TensorType([32, 16], "float16"))
    x = relax.Var("x", relax.TensorType([4, 16], "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w))
            y = bb.emit(relax.op.matmul(x, wt))
            out = bb.emit_output(relax.Tuple([y, wt]))
        bb.emit_func_output(out)
    mod = bb.get()
    lowered = relax.transform.LegalizeOps()(mod)
    [site] = gemm.gemm_report(lowered)
    assert site.offloaded and site.composite == "cublaslt.matmul_transposed"
    part = mqa_byoc.partition_for_cutlass(lowered)
    assert any(name.startswith("transpose") for name in _prim_names(part))
    arrays = draw_inputs([("x", (4, 16), "float16"), ("w", (32, 16), "float16")])
    got_all = run_llvm_outputs(gemm.inline_gemm_composites(part), arrays)
    for got, want in zip(got_all, run_llvm_outputs(mod, arrays)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    # a 3-D weight whose transpose moves its first axis is no swap of the last two: the matmul reads the
    # transposed tensor
    w3 = relax.Var("w", relax.TensorType([16, 2, 32], "float16"))
    x3 = relax.Var("x", relax.TensorType([2, 4, 16], "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x3, w3]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(x3, bb.emit(relax.op.permute_dims(w3, [1, 0, 2])))))
        bb.emit_func_output(out)
    [site] = gemm.gemm_report(relax.transform.LegalizeOps()(bb.get()))
    assert site.offloaded and site.composite == "cublaslt.matmul" and not site.transposed


def test_a_site_neither_offload_takes_becomes_nt_matmul_again():
    mod, specs = gemm_graph(True, False, None, False, dtype="float32")
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    part = mqa_byoc.partition_for_cutlass(lowered)
    assert not _codegen_funcs(part)
    assert "NT_matmul" in _prim_names(part)
    assert not [b for blk in part["main"].body.blocks for b in blk.bindings
                if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", None) == "relax.matmul"]
    [site] = gemm.gemm_report(lowered)
    assert not site.offloaded and "float32 GEMM" in site.reason
    arrays = draw_inputs(specs)
    np.testing.assert_allclose(run_llvm(part, arrays), run_llvm(mod, arrays), rtol=1e-5, atol=1e-5)
    # without GEMM offload, the module keeps TVM's kernel too
    assert "NT_matmul" in _prim_names(mqa_byoc.partition_for_cutlass(relax.transform.FuseTransposeMatmul()(
        gemm_graph(True, False, None, False)[0]), gemm=False))


def _swap_in(mod, name, prim):
    """``mod`` with its PrimFunc ``name`` replaced by ``prim`` (same signature, other body)."""
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    gv = mod.get_global_var(name)
    out[gv] = prim
    return out


# x @ w^T with the weight read untransposed: a PrimFunc named NT_matmul that computes something else
@T.prim_func(private=True, s_tir=True)
def _not_transposed(x: T.Buffer((T.int64(2), T.int64(64)), "float16"), w: T.Buffer((T.int64(64), T.int64(64)), "float16"),
                    out: T.Buffer((T.int64(2), T.int64(64)), "float16")):
    T.func_attr({"tirx.noalias": True})
    for i0, i1, k in T.grid(T.int64(2), T.int64(64), T.int64(64)):
        with T.sblock("NT_matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            with T.init():
                out[v_i0, v_i1] = T.float16(0.0)
            out[v_i0, v_i1] = out[v_i0, v_i1] + x[v_i0, v_k] * w[v_k, v_i1]


def test_a_primfunc_that_only_carries_the_name_stays_on_tvm_with_a_reason():
    mod, _ = gemm_graph(True, False, None, False, rows=(2,), k=64, n=64)
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    edited = _swap_in(lowered, "NT_matmul", _not_transposed)
    part = mqa_byoc.partition_for_cutlass(edited)
    assert not _codegen_funcs(part)
    tvm.ir.assert_structural_equal(part["main"], edited["main"])
    [site] = gemm.gemm_report(edited)
    assert not site.offloaded and "is not the PrimFunc FuseTransposeMatmul makes" in site.reason
    assert (site.m, site.n, site.k, site.transposed) == ("2", 64, 64, True)  # read off the call's operands
    # the same module with TVM's own PrimFunc is read back (the check is not the name)
    call = next(b.value for blk in lowered["main"].body.blocks for b in blk.bindings
                if getattr(b.value, "op", None) is not None and getattr(b.value.op, "name", "") == "relax.call_tir")
    assert lowered_matmul_reason(lowered, call) == ("NT_matmul", None)
    assert lowered_matmul_reason(edited, call)[1] is not None


def test_a_matmul_fused_with_its_epilogue_by_tvm_stays_on_tvm_with_a_reason():
    mod, _ = gemm_graph(True, True, None, False, rows=(2, 8))
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    fused = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                      relax.transform.FuseOps(), relax.transform.FuseTIR()])(lowered)
    names = _prim_names(fused)
    assert any(n.startswith("fused_NT_matmul") for n in names), names
    assert not _codegen_funcs(mqa_byoc.partition_for_cutlass(fused))
    [site] = gemm.gemm_report(fused)
    assert not site.offloaded and site.transposed and "fused with other ops" in site.reason, site.reason


def test_restore_keeps_primfuncs_still_called_and_drops_the_others():
    mod, _ = gemm_graph(True, False, None, False, dtype="float32")
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    restored = RestoreLoweredMatmul()(lowered)
    assert "NT_matmul" not in _prim_names(restored)
    ops = [b.value.op.name for blk in restored["main"].body.blocks for b in blk.bindings
           if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]
    assert ops == ["relax.permute_dims", "relax.matmul"]
    edited = _swap_in(relax.transform.FuseTransposeMatmul()(gemm_graph(True, False, None, False, rows=(2,), k=64,
                                                                        n=64)[0]), "NT_matmul", _not_transposed)
    assert RestoreLoweredMatmul()(edited).same_as(edited)


def test_decoder_after_fuse_transpose_matmul_offloads_every_gemm_and_its_attention():
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled

    cfg = scaled("llama3-8b", num_layers=1, vocab_size=256, hidden_size=256, intermediate_size=512)
    mod = build_decoder(cfg)[0]
    before = gemm.gemm_report(mod)
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    assert any(n.startswith("NT_matmul") for n in _prim_names(lowered))
    after = gemm.gemm_report(lowered)
    assert [(s.function, s.offloaded, s.composite) for s in after] == \
        [(s.function, s.offloaded, s.composite) for s in before], gemm.format_gemm_report(after)
    attn_before = [s for s in mqa_byoc.offload_report(mod) if s.offloaded]
    attn_after = [s for s in mqa_byoc.offload_report(lowered) if s.offloaded]
    assert attn_before and sorted((s.function, s.output, s.composite) for s in attn_after) == \
        sorted((s.function, s.output, s.composite) for s in attn_before)


CHAINS = ["mlc_4d_chain", "upstream_3d_chain", "sink_chain", "softcap_chain", "safe_softmax_chain", "bsh_chain"]


@pytest.mark.parametrize("chain", CHAINS)
def test_an_attention_chain_after_fuse_transpose_matmul_is_offloaded_as_before(chain):
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention
    from mqa_byoc.testing import graphs

    mod = getattr(graphs, chain)()
    lowered = relax.transform.FuseTransposeMatmul()(mod)
    assert any(n.startswith("NT_matmul") for n in _prim_names(lowered))  # Q @ K^T became TVM's kernel
    [site] = mqa_byoc.offload_report(lowered)
    [expected] = mqa_byoc.offload_report(mod)
    assert site.offloaded and (site.composite, site.num_kv_heads, site.scale, site.causal, site.window) == \
        (expected.composite, expected.num_kv_heads, expected.scale, expected.causal, expected.window)
    part = mqa_byoc.partition_for_cutlass(lowered)
    assert any(f.attrs is not None and str(f.attrs.get("Codegen", "")) == "flash_attn"
               for f in part.functions.values() if isinstance(f, relax.Function))
    # the rewrite of the lowered module computes what it computed (TVM's grouped lowering, on llvm)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype(str(p.ty.dtype))
            for p in lowered["main"].params]
    rewritten = LegalizeGroupedAttention()(canonicalize_attention(RestoreLoweredMatmul()(lowered)))
    np.testing.assert_allclose(graphs.run_llvm(rewritten, args), graphs.run_llvm(lowered, args), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lowering", sorted(LOWERINGS))
def test_flattened_symbolic_rows_passed_as_sizes_are_read_back(lowering):
    # x (b, s, K) flattened to (b * s, K), as torch.export's dynamic batch and sequence make it: TVM's
    # PrimFunc cannot bind b and s from a buffer of b * s rows, so its call passes them after the operands
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType([b, s, 64], "float16"))
    w = relax.Var("w", relax.TensorType([128, 64], "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            rows = bb.emit(relax.op.reshape(x, relax.ShapeExpr([b * s, 64])), "rows")
            y = bb.emit_output(bb.emit(relax.op.matmul(rows, bb.emit(relax.op.permute_dims(w))), "y"))
        bb.emit_func_output(y)
    mod = bb.get()
    lowered = LOWERINGS[lowering]()(mod)
    call = next(bnd.value for bnd in lowered["main"].body.blocks[0].bindings
                if getattr(bnd.value.op, "name", None) == "relax.call_tir" and "matmul" in bnd.value.args[0].name_hint)
    assert len(call.args[1].fields) == 4  # x, w, b, s: the form this test is about
    [site] = gemm.gemm_report(lowered)
    assert site.offloaded and (site.m, site.n, site.k) == ("b * s", 128, 64), gemm.format_gemm_report([site])
    part = mqa_byoc.partition_for_cutlass(lowered)
    assert len(_codegen_funcs(part)) == 1 and not any("matmul" in n for n in _prim_names(part))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 3, 64)).astype("float16"), (rng.standard_normal((128, 64)) / 8).astype("float16")]
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)
