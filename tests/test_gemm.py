"""GEMM offload to cuBLASLt on the CPU: the pattern table, its checks and reasons, the report, the
rewrite's numerics (the composites inlined and run on llvm against the original graph), the generated
C++ (compiled with g++ against TVM's and cuBLASLt's headers) and the export."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.relax.backend.pattern_registry import get_patterns_with_prefix

import mqa_byoc
from mqa_byoc.testing.gemm_graphs import FORMS, draw_inputs, gemm_graph, quantized_weight_graph, run_llvm
from mqa_byoc.compiler import cublaslt_build
from mqa_byoc.compiler.codegen.cublaslt import GemmCodegenError, emit_gemm_source, find_gemm_site
from mqa_byoc.compiler.graph import gemm
from mqa_byoc.contract import GEMM_CODEGEN, GEMM_COMPOSITES, gemm_composite_name, parse_gemm_composite


def _codegen_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and f.attrs is not None and str(f.attrs.get("Codegen", "")) == GEMM_CODEGEN}


def test_pattern_table_is_registered_with_tvm_largest_first():
    names = [p.name for p in get_patterns_with_prefix(GEMM_CODEGEN)]
    assert names == list(GEMM_COMPOSITES)
    assert names[0] == "cublaslt.matmul_transposed_bias_residual" and names[-1] == "cublaslt.matmul"
    for name in GEMM_COMPOSITES:
        assert gemm_composite_name(**parse_gemm_composite(name)) == name


def test_composite_names_refuse_what_cublaslt_cannot_fuse():
    with pytest.raises(ValueError, match="no cuBLASLt epilogue"):
        gemm_composite_name(True, False, "relu")  # an activation needs the bias epilogue
    with pytest.raises(ValueError, match="no cuBLASLt epilogue"):
        gemm_composite_name(True, True, "silu")
    with pytest.raises(ValueError, match="no cuBLASLt epilogue"):
        gemm_composite_name(True, True, "gelu_tanh", residual=True)  # cuBLASLt would apply it after C
    with pytest.raises(ValueError, match="unknown GEMM composite"):
        parse_gemm_composite("cublaslt.matmul_silu")


@pytest.mark.parametrize("form", FORMS, ids=[gemm_composite_name(*f) for f in FORMS])
def test_every_pattern_is_offloaded_and_computes_the_original(form):
    mod, specs = gemm_graph(*form)
    part = mqa_byoc.partition_for_cutlass(mod)
    funcs = _codegen_funcs(part)
    assert len(funcs) == 1
    site = find_gemm_site(next(iter(funcs.values())))
    assert site.composite_name == gemm_composite_name(*form)
    assert (site.transposed, site.bias is not None, site.activation, site.residual is not None) == form
    [report] = gemm.gemm_report(mod)
    assert report.offloaded and report.runs_on == "cuBLASLt" and report.composite == site.composite_name
    assert (report.n, report.k, report.dtype) == (128, 64, "float16")
    # the rewrite computes what the graph did: composites inlined back and run on llvm
    arrays = draw_inputs(specs, {"n": 5})
    got = run_llvm(gemm.inline_gemm_composites(part), arrays)
    np.testing.assert_allclose(got, run_llvm(mod, arrays), rtol=1e-3, atol=1e-3)


def test_operand_order_of_the_adds_and_bias_spellings():
    mod, specs = gemm_graph(True, True, None, True, residual_first=False, bias_shape=(1, 1, 128))
    part = mqa_byoc.partition_for_cutlass(mod)
    site = find_gemm_site(next(iter(_codegen_funcs(part).values())))
    assert site.composite_name == "cublaslt.matmul_transposed_bias_residual"
    names = [p.name for p in next(iter(_codegen_funcs(part).values())).params]
    assert (names[site.x], names[site.weight], names[site.bias], names[site.residual]) == ("x", "w", "b", "r")
    arrays = draw_inputs(specs, {"n": 4})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)


def _two_projections_graph():
    """Two GEMMs of one input whose epilogues come after both matmuls, the second fed by the first's
    fused output (the order a graph importer may emit)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([8, 64], "float16"))
    wq = relax.Var("wq", relax.TensorType([64, 64], "float16"))
    wk = relax.Var("wk", relax.TensorType([64, 64], "float16"))
    bq = relax.Var("bq", relax.TensorType([64], "float16"))
    with bb.function("main", [x, wq, wk, bq]):
        with bb.dataflow():
            q = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(wq), "wq_t")), "q_proj")
            k = bb.emit(relax.op.matmul(x, wk), "k_proj")
            qb = bb.emit(relax.op.add(q, bq), "q_biased")
            kr = bb.emit(relax.op.add(k, x), "k_residual")
            o = bb.emit(relax.op.matmul(qb, bb.emit(relax.op.permute_dims(wk), "wk_t")), "o_proj")
            y = bb.emit_output(bb.emit(relax.op.add(o, kr), "out"))
        bb.emit_func_output(y)
    return bb.get()


def test_report_names_each_offloaded_site_by_its_matmul_in_the_users_graph():
    mod = _two_projections_graph()
    sites = gemm.gemm_report(mod)
    assert all(s.offloaded for s in sites), gemm.format_gemm_report(sites)
    by_name = {s.output: s for s in sites}
    assert set(by_name) == {"q_proj", "k_proj", "o_proj"}, gemm.format_gemm_report(sites)
    assert by_name["q_proj"].epilogue == "bias" and by_name["q_proj"].transposed
    assert by_name["k_proj"].epilogue == "residual" and not by_name["k_proj"].transposed
    assert by_name["o_proj"].epilogue == "residual"  # its input is q_proj's fused output
    assert "main/q_proj:" in gemm.format_gemm_report(sites)
    # the same names through offload_report, after the attention partition rebound the module
    assert {s.output for s in mqa_byoc.offload_report(mod, gemm=True)} == set(by_name)


def test_report_names_matmuls_of_the_same_operands_each_by_its_own_variable():
    """A graph that computes ``x @ W^T`` (and ``x2 @ W2``) twice, with different epilogues: each offloaded
    call is named by its own matmul, in the graph's order, not both by the first."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, 256], "float16"))
    w = relax.Var("w", relax.TensorType([512, 256], "float16"))
    b = relax.Var("b", relax.TensorType([512], "float16"))
    x2 = relax.Var("x2", relax.TensorType([7, 256], "bfloat16"))
    w2 = relax.Var("w2", relax.TensorType([256, 128], "bfloat16"))
    with bb.function("main", [x, w, b, x2, w2]):
        with bb.dataflow():
            first = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w))), "first")
            biased = bb.emit(relax.op.add(first, b), "biased")
            second = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w))), "second")
            act = bb.emit(relax.op.nn.silu(second), "act")
            third = bb.emit(relax.op.matmul(x2, w2), "third")
            fourth = bb.emit(relax.op.matmul(x2, w2), "fourth")
            out = bb.emit_output(relax.Tuple([biased, act, third, fourth]))
        bb.emit_func_output(out)
    sites = gemm.gemm_report(bb.get())
    assert [s.output for s in sites] == ["first", "second", "third", "fourth"], gemm.format_gemm_report(sites)
    assert all(s.offloaded for s in sites)
    assert [s.epilogue for s in sites] == ["bias", None, None, None]


def test_bf16_and_static_shapes_and_constant_weights():
    # a static M of one row (decode at batch 1) too: cuBLASLt's measured choice outruns dlight's GEMV there
    for kw in (dict(dtype="bfloat16"), dict(rows=(4, 33)), dict(rows=("b", "s")), dict(weight_const=True),
               dict(rows=(1, 1)), dict(rows=(1,))):
        mod, _ = gemm_graph(True, False, None, False, **kw)
        [site] = gemm.gemm_report(mod)
        assert site.offloaded, (kw, site)
    mod, specs = gemm_graph(True, True, None, False, weight_const=True)
    part = mqa_byoc.partition_for_cutlass(mod)
    [func] = _codegen_funcs(part).values()
    assert find_gemm_site(func).num_inputs == 3  # the constant weight is a parameter of the function
    arrays = draw_inputs(specs, {"n": 3})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)


def test_one_row_residual_matched_as_a_bias_computes_the_residual_add():
    # x (1, 1, K) @ W^T + r (1, 1, N): r has a bias's shape too; whichever composite takes it, the sum is the same
    mod, specs = gemm_graph(True, False, None, True, rows=(1, 1))
    part = mqa_byoc.partition_for_cutlass(mod)
    [site] = gemm.gemm_report(part)
    assert site.offloaded and site.epilogue in ("bias", "residual"), site
    arrays = draw_inputs(specs, {})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)


def _int8_graph():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([16, 64], "int8"))
    w = relax.Var("w", relax.TensorType([64, 64], "int8"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, w, out_dtype="int32")))
        bb.emit_func_output(y)
    return bb.get()


def _batched_rhs_graph(x_shape=(2, 16, 64), w_shape=(1, 64, 32)):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(x_shape), "float16"))
    w = relax.Var("w", relax.TensorType(list(w_shape), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    return bb.get()


def _vector_rhs_graph():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([16, 64], "float16"))
    w = relax.Var("w", relax.TensorType([64], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    return bb.get()


def _symbolic_k_graph():
    k = tirx.Var("k", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([16, k], "float16"))
    w = relax.Var("w", relax.TensorType([k, 64], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    return bb.get()


def _fp16_out_of_bf16_graph():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([16, 64], "bfloat16"))
    w = relax.Var("w", relax.TensorType([64, 64], "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, w, out_dtype="float16")))
        bb.emit_func_output(y)
    return bb.get()


BAD = {
    "int8": (_int8_graph, "integer GEMM"),
    "fp32": (lambda: gemm_graph(dtype="float32")[0], "float32 GEMM"),
    "k_unaligned": (lambda: gemm_graph(k=60)[0], "K = 60 is not a multiple of 8"),
    "n_unaligned": (lambda: gemm_graph(n=100)[0], "N = 100 is not a multiple of 8"),
    "broadcast_batch": (_batched_rhs_graph, "not provably equal (a broadcast batch)"),
    "batch_rank": (lambda: _batched_rhs_graph((16, 64), (2, 64, 32)), "another rank: a broadcast batch"),
    "vector_rhs": (_vector_rhs_graph, "matrix-vector product"),
    "symbolic_k": (_symbolic_k_graph, "symbolic size"),
    "fp16_output_of_bf16": (_fp16_out_of_bf16_graph, "writes bfloat16 or float32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_stays_on_tvm_with_a_reason(case):
    build, why = BAD[case]
    mod = build()
    part = mqa_byoc.partition_for_cutlass(mod)
    assert not _codegen_funcs(part)
    tvm.ir.assert_structural_equal(part["main"], mod["main"])
    [site] = gemm.gemm_report(mod)
    assert not site.offloaded and site.runs_on == "TVM"
    assert why in site.reason, site.reason


def test_epilogues_cublaslt_lacks_stay_on_tvm_with_a_note():
    # erf GELU: cuBLASLt's GELU is the tanh form, so only matmul + bias is fused
    mod, specs = gemm_graph(True, True, "gelu", False)
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.composite == "cublaslt.matmul_transposed_bias"
    assert "tanh approximation" in site.note
    part = mqa_byoc.partition_for_cutlass(mod)
    arrays = draw_inputs(specs, {"n": 3})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)
    mod, _ = gemm_graph(True, False, "silu", False)
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.composite == "cublaslt.matmul_transposed" and "no silu epilogue" in site.note
    # an added operand that is neither a bias vector nor of the output's shape is left to TVM
    mod, _ = gemm_graph(True, True, None, False, bias_shape=(3, 128), rows=(2, 3))
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.composite == "cublaslt.matmul_transposed"


def test_gemm_false_leaves_matmuls_and_offload_report_lists_gemm_sites():
    mod, _ = gemm_graph(True, True, None, True)
    assert not _codegen_funcs(mqa_byoc.partition_for_cutlass(mod, gemm=False))
    assert mqa_byoc.offload_report(mod) == []  # attention only by default
    [site] = mqa_byoc.offload_report(mod, gemm=True)
    assert isinstance(site, gemm.GemmSite) and site.composite == "cublaslt.matmul_transposed_bias_residual"
    assert "cuBLASLt" in gemm.format_gemm_report([site])


def test_the_decoders_gemm_sites():
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama
    from mqa_byoc.models.presets import scaled

    cfg = scaled("llama3-8b", num_layers=1, vocab_size=256, hidden_size=256, intermediate_size=512)
    mod, _ = build_decoder(cfg, kv_expand="repeat", logits="all", functions=("prefill", "decode"), batch=1,
                           kv_cache="inplace")
    sites = gemm.gemm_report(mqa_byoc.partition_for_cutlass(mod, gemm=False))
    prefill = [s for s in sites if s.function == "prefill"]
    decode = [s for s in sites if s.function == "decode"]
    # qkv, o_proj, gate_up, down (+ the residual) and lm_head; prefill's rows are symbolic
    assert len(prefill) == 5 and all(s.offloaded and s.transposed for s in prefill), gemm.format_gemm_report(prefill)
    assert sum(s.epilogue == "residual" for s in prefill) >= 1
    # decode's rows are a static 1: offloaded as well, with the same epilogues as prefill's
    assert len(decode) == 5 and all(s.offloaded and s.m == "1" for s in decode), gemm.format_gemm_report(decode)
    # an added (1, 1, N) residual of one row is also a bias of shape (1, ..., 1, N): either epilogue adds it
    assert all(d.epilogue == p.epilogue or (p.epilogue == "residual" and d.epilogue == "bias")
               for d, p in zip(decode, prefill)), gemm.format_gemm_report(decode)
    silu = [s for s in prefill if s.note and "silu" in s.note]
    assert len(silu) == 1 and silu[0].n == 2 * cfg.intermediate_size
    pcfg = PagedLlamaConfig(num_q_heads=8, num_kv_heads=2, head_dim=64, hidden=512, intermediate=1024, layers=1,
                            vocab=256)
    pmod, _params, _ = export_paged_llama(pcfg, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    psites = gemm.gemm_report(pmod)
    by_fn = {}
    for s in psites:
        by_fn.setdefault(s.function, []).append(s)
    assert by_fn["decode"] and all(s.offloaded for s in by_fn["decode"]), gemm.format_gemm_report(psites)
    assert by_fn["prefill"] and all(s.offloaded for s in by_fn["prefill"])
    # batch_prefill: the same layers, and lm_head on the gathered last positions (M = the batch, symbolic)
    assert len(by_fn["batch_prefill"]) == len(by_fn["prefill"]) and all(s.offloaded for s in by_fn["batch_prefill"])


def test_codegen_errors_are_typed():
    mod, _ = gemm_graph(True, False, None, False)
    with pytest.raises(GemmCodegenError, match="exactly one composite call"):
        find_gemm_site(mod["main"])  # not a partitioned function
    with pytest.raises(GemmCodegenError, match="unknown composite"):
        find_gemm_site(mod["main"].with_attr("Composite", "cublaslt.matmul_silu"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_generated_source_and_dispatcher_compile(tmp_path):
    missing = cublaslt_build.headers_unavailable()
    if missing:
        pytest.skip(missing)
    import dataclasses

    sources = []
    for i, (form, out) in enumerate([(f, None) for f in FORMS] + [(f, "float32") for f in FORMS[:6]]):
        part = mqa_byoc.partition_for_cutlass(gemm_graph(*form, dtype="bfloat16" if form[1] else "float16",
                                                         out_dtype=out)[0])
        site = find_gemm_site(next(iter(_codegen_funcs(part).values())))
        sources.append(emit_gemm_source(dataclasses.replace(site, symbol=f"{site.symbol}_{i}"), prelude=not sources))
    for i, (t, b, r) in enumerate([(True, False, False), (False, True, True)]):  # batched, symbolic batch axis
        part = mqa_byoc.partition_for_cutlass(gemm_graph(t, b, None, r, batch=(2, "h"), rows=("m",), n=32)[0])
        site = find_gemm_site(next(iter(_codegen_funcs(part).values())))
        sources.append(emit_gemm_source(dataclasses.replace(site, symbol=f"{site.symbol}_b{i}"), prelude=False))
    src = tmp_path / "gemm.cc"
    src.write_text("".join(sources))
    tvm_inc = [f for f in cublaslt_build.include_flags() if "nvidia" not in f and "cuda" not in f]
    res = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *tvm_inc, str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    obj = cublaslt_build.dispatcher_object(progress=None)
    syms = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert " T mqa_byoc_cublaslt_gemm" in syms and " U TVMBackendAllocWorkspace" in syms
    undefined = [ln.split()[-1] for ln in syms.splitlines() if ln.split()[:1] == ["U"]]
    assert not [u for u in undefined if "cublasLt" in u or u.startswith("cu")]  # opened at run time, not linked


@pytest.mark.slow
def test_export_links_the_dispatcher(tmp_path):
    missing = cublaslt_build.headers_unavailable()
    if missing:
        pytest.skip(missing)
    mod, _ = gemm_graph(True, True, "gelu_tanh", False)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    ex = mqa_byoc.build(mod, target, provider="python")
    path = tmp_path / "gemm.so"
    mqa_byoc.export_library(ex, path, progress=None)
    syms = subprocess.run(["nm", str(path)], capture_output=True, text=True).stdout
    assert " t mqa_byoc_cublaslt_gemm" in syms or " T mqa_byoc_cublaslt_gemm" in syms
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert "cublas" not in needed.lower()  # libcublasLt is opened at the first GEMM
    # TVM's own export_library links it too: mqa_byoc.build attached the dispatcher as a static library
    plain = tmp_path / "plain.so"
    ex.export_library(str(plain))
    syms = subprocess.run(["nm", str(plain)], capture_output=True, text=True).stdout
    assert " t mqa_byoc_cublaslt_gemm" in syms or " T mqa_byoc_cublaslt_gemm" in syms
    assert "cublas" not in subprocess.run(["readelf", "-d", str(plain)], capture_output=True, text=True).stdout.lower()
    # built by hand (RunCodegen + relax.build, nothing attached): the dispatcher stays a weak reference whose
    # GEMMs say how to export, and mqa_byoc.export_library links it
    with target:
        bare = relax.build(relax.transform.RunCodegen()(mqa_byoc.partition_for_cutlass(mod, provider="python")),
                           target=target)
    weak = tmp_path / "weak.so"
    bare.export_library(str(weak))
    syms = subprocess.run(["nm", str(weak)], capture_output=True, text=True).stdout
    assert " w mqa_byoc_cublaslt_gemm" in syms
    assert b"mqa_byoc.export_library(executable, path)" in weak.read_bytes()
    linked = tmp_path / "linked.so"
    mqa_byoc.export_library(bare, linked, progress=None)
    syms = subprocess.run(["nm", str(linked)], capture_output=True, text=True).stdout
    assert " t mqa_byoc_cublaslt_gemm" in syms or " T mqa_byoc_cublaslt_gemm" in syms


@pytest.mark.parametrize("form", FORMS, ids=[gemm_composite_name(*f) for f in FORMS])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_output_of_every_pattern_is_offloaded_and_computes_the_original(form, dtype):
    # R.matmul(x, w, out_dtype="float32") on fp16/bf16 operands, bias and residual in float32 (cuBLASLt's C/D)
    mod, specs = gemm_graph(*form, dtype=dtype, out_dtype="float32")
    part = mqa_byoc.partition_for_cutlass(mod)
    [func] = _codegen_funcs(part).values()
    site = find_gemm_site(func)
    assert (site.dtype, site.out_dtype, site.composite_name) == (dtype, "float32", gemm_composite_name(*form))
    [report] = gemm.gemm_report(mod)
    assert report.offloaded and (report.dtype, report.out_dtype) == (dtype, "float32")
    if dtype == "float16":  # numpy has no bfloat16 for the llvm run
        arrays = draw_inputs(specs, {"n": 5})
        got = run_llvm(gemm.inline_gemm_composites(part), arrays)
        np.testing.assert_allclose(got, run_llvm(mod, arrays), rtol=1e-3, atol=1e-3)
    src = emit_gemm_source(site)
    code = 2 + (dtype == "bfloat16")
    assert f"gemm_call(s, dev, {code}, " in src and '"out", kDLFloat, 32' in src
    assert ("kDLFloat, 32, dev, 128, 1)" in src) == form[1]  # the bias checked as float32


def test_to_mixed_precision_default_output_type_is_offloaded():
    # TVM's ToMixedPrecision() keeps out_dtype="float32": every matmul becomes fp16 x fp16 -> fp32, cast back
    # to fp16 at once; cuBLASLt writes the fp16 result (one rounding, as the cast's)
    mod, specs = gemm_graph(True, True, None, True, dtype="float32", rows=(3, "n"))
    mixed = relax.transform.ToMixedPrecision()(mod)
    [site] = gemm.gemm_report(mixed)
    assert site.offloaded and (site.dtype, site.out_dtype) == ("float16", "float16"), gemm.format_gemm_report([site])
    # (ToMixedPrecision casts the permuted weight, so the matmul sees a plain (K, N) operand)
    assert site.composite == "cublaslt.matmul_cast" and site.epilogue == "cast"
    part = mqa_byoc.partition_for_cutlass(mixed)
    arrays = draw_inputs(specs, {"n": 4})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mixed, arrays),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dtype, rows, batch", [("float16", (2, "n"), ()), ("bfloat16", (7,), ()),
                                                ("float16", ("m",), (3,))])
def test_a_cast_of_the_float32_result_to_the_operands_type_is_fused(transposed, dtype, rows, batch):
    # astype(matmul(x, w, out_dtype="float32"), x's type): one composite whose cuBLASLt call writes x's type
    mod, specs = gemm_graph(transposed, dtype=dtype, out_dtype="float32", cast=dtype, rows=rows, batch=batch)
    part = mqa_byoc.partition_for_cutlass(mod)
    [func] = _codegen_funcs(part).values()
    site = find_gemm_site(func)
    assert site.composite_name == gemm_composite_name(transposed, False, cast=True)
    assert (site.dtype, site.out_dtype) == (dtype, None)  # the output is of the operands' type
    [report] = gemm.gemm_report(mod)
    assert report.offloaded and (report.out_dtype, report.epilogue) == (dtype, "cast"), gemm.format_gemm_report([report])
    # nothing of the graph is left outside the composite: no astype runs on TVM
    ops = {getattr(b.value.op, "name", None) for block in part["main"].body.blocks for b in block.bindings
           if isinstance(b.value, relax.Call)}
    assert "relax.astype" not in ops and "relax.matmul" not in ops
    src = emit_gemm_source(site)
    code = 0 + (dtype == "bfloat16")  # the operands' type code, without the float32-output flag
    assert f"gemm_call(s, dev, {code}, " in src
    if dtype == "float16":
        arrays = draw_inputs(specs, {"n": 5, "m": 4})
        np.testing.assert_array_equal(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays))


@pytest.mark.parametrize("case", ["other_type", "float32_result_used"])
def test_a_cast_that_cublaslt_cannot_write_leaves_the_cast_on_tvm(case):
    # a cast to another type, or a float32 result the graph also uses: the matmul alone is offloaded
    # (float32 output) and the astype stays in the graph
    kw = {"cast": "bfloat16"} if case == "other_type" else {"cast": "float16", "cast_used_elsewhere": True}
    mod, specs = gemm_graph(True, out_dtype="float32", **kw)
    part = mqa_byoc.partition_for_cutlass(mod)
    [func] = _codegen_funcs(part).values()
    site = find_gemm_site(func)
    assert (site.composite_name, site.out_dtype) == ("cublaslt.matmul_transposed", "float32")
    ops = [getattr(b.value.op, "name", None) for block in part["main"].body.blocks for b in block.bindings
           if isinstance(b.value, relax.Call)]
    assert "relax.astype" in ops
    [report] = gemm.gemm_report(mod)
    assert report.offloaded and report.out_dtype == "float32" and report.epilogue is None
    if case == "other_type":
        reason = gemm._cast_reason(relax.TensorType([2], "bfloat16"), relax.TensorType([2], "float16"))
        assert "not to the operands' type float16" in reason


def test_codegen_refuses_a_cast_composite_to_another_type():
    mod, _ = gemm_graph(True, out_dtype="float32", cast="float16")
    [func] = _codegen_funcs(mqa_byoc.partition_for_cutlass(mod)).values()

    @relax.expr_functor.mutator
    class CastToBf16(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if getattr(call.op, "name", None) == "relax.astype":
                return relax.op.astype(call.args[0], "bfloat16")
            return call

    edited = CastToBf16().visit_expr(func)
    with pytest.raises(GemmCodegenError, match="does not cast to the operands' type"):
        find_gemm_site(edited)


@pytest.mark.parametrize("form", ["int4_ops", "int4_call_tir", "fp8"])
def test_a_weight_dequantized_in_the_graph_is_offloaded_with_a_note(form):
    # TVM's own pipeline keeps the dequantize a kernel of its own (FuseOps does not fuse it into the
    # matmul), so cuBLASLt reads the same fp16 weight TVM's matmul would; the note names the quantized
    # tensor and the switch for a pipeline that fuses the two (mlc-llm's)
    mod = quantized_weight_graph(form)[0]
    [site] = gemm.gemm_report(mod)
    assert site.offloaded, gemm.format_gemm_report([site])
    source = {"fp8": "`w_fp8` (float8_e4m3fn (128, 256))"}.get(form, "`w_q` (uint32 (128, 32))")
    assert f"dequantized in the graph from {source}" in site.note and "gemm=False" in site.note
    assert "BindParams" not in site.note  # folding would store the fp16 weight: no advice to
    if form != "fp8":  # the rewrite computes the original (numpy has no float8 for the llvm run)
        arrays = draw_inputs(quantized_weight_graph(form)[1], seed=3)
        part = mqa_byoc.partition_for_cutlass(mod)
        np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                                   rtol=1e-3, atol=1e-3)
    lowered = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    names = [gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tirx.PrimFunc)]
    with_matmul = [n for n in names if "matmul" in n]
    assert len(with_matmul) == 1 and len(names) == 2, names  # the dequantize and the matmul apart


@pytest.mark.parametrize("form", ["fp32_param", "experts"])
def test_a_weight_cast_from_floats_or_gathered_by_an_index_is_no_dequantize(form):
    # a float32 parameter cast to fp16 is no quantized weight; an expert index is far smaller than the
    # weights it gathers
    mod = quantized_weight_graph(form)[0]
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and "dequantized" not in (site.note or ""), gemm.format_gemm_report([site])
    assert ("BindParams" in (site.note or "")) == (form == "fp32_param")


def test_dequantized_source_follows_call_tir_back_to_the_packed_parameter():
    mod = quantized_weight_graph("int4_call_tir")[0]
    bindings = {b.var: b.value for block in mod["main"].body.blocks for b in block.bindings}
    weight = next(v for v in bindings if isinstance(bindings[v], relax.Call) and "call_tir" in str(bindings[v].op))
    assert gemm.dequantized_source(weight, bindings).name == "w_q"
    x = mod["main"].params[0]
    assert gemm.dequantized_source(x, bindings) is None  # a parameter: nothing computes it


@pytest.mark.parametrize("transposed, bias, residual, batch, rows", [
    (True, False, False, (2, 3), "m"), (False, True, True, (4,), 5), (True, True, False, ("b",), "m"),
    (False, False, True, (2, "h"), 1)])
def test_batched_gemm_is_offloaded_and_computes_the_original(transposed, bias, residual, batch, rows):
    # both operands batched over the same axes: one cuBLASLt strided-batched call (upstream's cuBLAS
    # partition takes these too); e.g. attention's scores when the attention itself stays on TVM
    mod, specs = gemm_graph(transposed, bias, None, residual, batch=batch, rows=(rows,), n=32)
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.composite == gemm_composite_name(transposed, bias, None, residual), \
        gemm.format_gemm_report([site])
    assert (site.n, site.k) == (32, 64) and site.batch is not None and "batch=" in gemm.format_gemm_report([site])
    part = mqa_byoc.partition_for_cutlass(mod)
    [func] = _codegen_funcs(part).values()
    code = find_gemm_site(func)
    assert code.batch_axes == len(batch)
    src = emit_gemm_source(code)
    assert f"gemm_batch(in{code.weight}, in{code.x}, s, \"the weight\", {len(batch)})" in src
    args = draw_inputs(specs, {"m": 7, "b": 3, "h": 2})
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), args), run_llvm(mod, args),
                               rtol=1e-3, atol=1e-3)


def test_a_permute_that_is_no_transpose_of_a_batched_weight_offloads_its_output():
    # permute_dims(w, [1, 0, 2]) swaps batch axes: the GEMM reads the permuted tensor (TVM computes it)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([3, 8, 64], "float16"))
    w = relax.Var("w", relax.TensorType([64, 3, 32], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w, [1, 0, 2])))))
        bb.emit_func_output(y)
    mod = bb.get()
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.composite == "cublaslt.matmul" and not site.transposed
    part = mqa_byoc.partition_for_cutlass(mod)
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((3, 8, 64)).astype("float16"), rng.standard_normal((64, 3, 32)).astype("float16")]
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), args), run_llvm(mod, args),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("annotate_codegen", [True, False])
@pytest.mark.parametrize("chain", ["mlc_4d_chain", "upstream_3d_chain", "sink_chain", "softcap_chain"])
def test_an_offloaded_attention_keeps_its_matmuls(chain, annotate_codegen):
    # the attention's Q @ K^T and P @ V are batched GEMMs, but the attention partition runs first and
    # takes them (with or without the codegen annotation); no cublaslt composite may hold them
    from mqa_byoc.testing import graphs

    mod = getattr(graphs, chain)()
    part = mqa_byoc.partition_for_cutlass(mod, annotate_codegen=annotate_codegen)
    names = [gv.name_hint for gv in part.get_global_vars()]
    assert not any("matmul" in n for n in names), names
    assert not [s for s in mqa_byoc.offload_report(mod, gemm=True) if isinstance(s, gemm.GemmSite)]


def test_a_rejected_attention_runs_its_matmuls_as_batched_gemms():
    from mqa_byoc.testing import graphs

    mod = graphs.mlc_4d_chain(d=264, s=16)
    [attn] = mqa_byoc.offload_report(mod)
    assert not attn.offloaded and "head dim 264" in attn.reason
    sites = [s for s in mqa_byoc.offload_report(mod, gemm=True) if isinstance(s, gemm.GemmSite)]
    assert [(s.offloaded, s.composite, s.batch, s.m, s.n, s.k) for s in sites] == [
        (True, "cublaslt.matmul_transposed", "8", "16", 16, 264), (True, "cublaslt.matmul", "8", "16", 264, 16)]
    part = mqa_byoc.partition_for_cutlass(mod)
    rng = np.random.default_rng(2)
    args = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype(str(p.ty.dtype))
            for p in mod["main"].params]
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), args), run_llvm(mod, args),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows, bias", [(4, False), (1, False), (4, True)])
def test_an_add_of_the_gemms_own_result_to_itself_stays_on_tvm_and_builds(rows, bias):
    # `h = x @ W^T (+ b); h + h` (what common-subexpression elimination makes of `lin(x) + lin(x)`): the
    # pattern's added-operand wildcard matches the matmul (or its bias add) again; cuBLASLt reads C from
    # memory, so the site is the matmul (with its bias) and the doubling stays on TVM
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([rows, 64], "float16"))
    w = relax.Var("w", relax.TensorType([128, 64], "float16"))
    b = relax.Var("b", relax.TensorType([128], "float16"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w))), "h")
            if bias:
                h = bb.emit(relax.op.add(h, b), "hb")
            y = bb.emit_output(bb.emit(relax.op.add(h, h), "y"))
        bb.emit_func_output(y)
    mod = bb.get()
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.epilogue == ("bias" if bias else None), gemm.format_gemm_report([site])
    part = mqa_byoc.partition_for_cutlass(mod)
    [func] = _codegen_funcs(part).values()
    assert find_gemm_site(func).residual is None  # the codegen reads the site (it raised on `h + h` before)
    relax.transform.RunCodegen()(part)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype("float16") for shape in ((rows, 64), (128, 64), (128,))]
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), arrays), run_llvm(mod, arrays),
                               rtol=1e-3, atol=1e-3)


def test_report_of_a_broadcast_batch_names_the_results_batch_and_plain_shapes():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([5, 64], "float16"))
    w = relax.Var("w", relax.TensorType([2, 64, 32], "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(y)
    (site,) = gemm.gemm_report(bb.get())
    assert not site.offloaded and (site.batch, site.m, site.n, site.k) == ("2", "5", 32, 64)
    assert "(2, 64, 32) has batch axes and x (5, 64)" in site.reason, site.reason
