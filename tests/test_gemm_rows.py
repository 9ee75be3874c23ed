"""GEMMs that ``torch.export`` writes on flattened rows (``nn.Linear`` of a (B, S, K) input: reshape to
(B*S, K), matmul, bias, reshape back): the partition writes them on the input's axes again
(``graph/gemm_rows.py``), so the activation and the residual add after the reshape are the GEMM's
epilogue. Graphs exported from torch modules as users write them, imported with plain
``from_exported_program``, ``ToMixedPrecision(out_dtype="float16")``; numerics on llvm against the graph."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402

import mqa_byoc  # noqa: E402
from mqa_byoc.compiler.graph import gemm  # noqa: E402
from mqa_byoc.compiler.graph.gemm_rows import UnflattenGemmRows, flattened_gemm_plans  # noqa: E402
from mqa_byoc.contract import gemm_composite_name  # noqa: E402
from mqa_byoc.testing.gemm_graphs import FORMS, draw_inputs, gemm_graph, run_llvm, run_llvm_outputs  # noqa: E402

K, N = 64, 128


class Projection(torch.nn.Module):
    """One projection of a (B, S, K) input as models write it; ``form`` names what follows it."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        bias = form not in ("plain", "residual")
        self.linear = torch.nn.Linear(K, N if "residual" not in form else K, bias=bias)
        self.weight = torch.nn.Parameter(torch.randn(K, N) * 0.05)  # HF Conv1D: (K, N), x @ W + b
        self.bias = torch.nn.Parameter(torch.randn(N) * 0.05)
        self.pre = torch.nn.Linear(K, K, bias=False)  # the residual stream in fp16, as in a model's layer

    def forward(self, x):
        f = self.form
        if f == "conv1d":  # HF's Conv1D (GPT-2, StarCoder's c_attn): addmm on x.view(-1, K)
            y = torch.addmm(self.bias, x.view(-1, K), self.weight)
            return torch.relu(y.view(x.shape[:-1] + (N,)))
        y = self.linear(x)
        if f == "relu":
            return torch.relu(y)
        if f == "gelu_tanh":
            return torch.nn.functional.gelu(y, approximate="tanh")
        if f in ("residual", "bias_residual"):
            h = torch.relu(self.pre(x))  # the residual stream: no GEMM's own output
            return h + self.linear(h)
        return y


# form -> the composite of its site
EXPECTED = {"plain": "cublaslt.matmul_transposed", "bias": "cublaslt.matmul_transposed_bias",
            "relu": "cublaslt.matmul_transposed_bias_relu", "gelu_tanh": "cublaslt.matmul_transposed_bias_gelu_tanh",
            "residual": "cublaslt.matmul_transposed_residual",
            "bias_residual": "cublaslt.matmul_transposed_bias_residual", "conv1d": "cublaslt.matmul_bias_relu"}


def _export(module, shape=(2, 8, K), dynamic=False):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    dyn = None
    if dynamic:
        dyn = {"x": {0: torch.export.Dim("b", max=64), 1: torch.export.Dim("s", max=4096)}}
    mod = from_exported_program(torch.export.export(module.eval(), (x,), dynamic_shapes=dyn))
    return relax.transform.ToMixedPrecision(out_dtype="float16")(mod), x.numpy()


def _matmul_names(mod):
    return [b.var.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", None) == "relax.matmul"]


# static shapes, and symbolic ones (gelu_tanh only symbolic: llvm takes minutes over fp16 tanh at static sizes)
CASES = [(f, False) for f in EXPECTED if f != "gelu_tanh"] + [(f, True) for f in ("gelu_tanh", "relu", "bias_residual")]


@pytest.mark.parametrize("form,dynamic", CASES, ids=[f"{f}-{'symbolic' if d else 'static'}" for f, d in CASES])
def test_an_exported_projection_gets_the_epilogue_after_the_reshape(form, dynamic):
    torch.manual_seed(1)
    mod, x = _export(Projection(form), dynamic=dynamic)
    # torch.export flattened the rows: the matmul is 2-D and a reshape stands between it and the epilogue
    assert flattened_gemm_plans(mod["main"])
    sites = [s for s in mqa_byoc.offload_report(mod, gemm=True) if isinstance(s, gemm.GemmSite)]
    assert len(sites) == (2 if "residual" in form else 1)
    site = sites[-1]
    assert site.offloaded and site.composite == EXPECTED[form], gemm.format_gemm_report([site])
    assert site.output in _matmul_names(mod)  # named as in the user's graph
    if not dynamic:
        assert site.m == "16"
    part = mqa_byoc.partition_for_cutlass(mod)
    # the epilogue is in the composite: no TVM op of it left beside the call
    main_ops = {getattr(b.value.op, "name", None) for block in part["main"].body.blocks for b in block.bindings
                if isinstance(b.value, relax.Call)}
    fused = {"relu": "relax.nn.relu", "conv1d": "relax.nn.relu", "gelu_tanh": "relax.nn.gelu_tanh"}.get(form)
    assert not main_ops & ({fused, "relax.add", "relax.matmul"} - {None}), main_ops
    np.testing.assert_allclose(run_llvm(gemm.inline_gemm_composites(part), [x]), run_llvm(mod, [x]),
                               rtol=1e-3, atol=1e-3)


def test_symbolic_rows_run_at_other_sizes():
    mod, _ = _export(Projection("bias_residual"), dynamic=True)
    part = gemm.inline_gemm_composites(mqa_byoc.partition_for_cutlass(mod))
    for shape in [(1, 1, K), (3, 5, K)]:
        x = np.random.default_rng(2).standard_normal(shape).astype("float32")
        np.testing.assert_allclose(run_llvm(part, [x]), run_llvm(mod, [x]), rtol=1e-3, atol=1e-3)


def _flat_graph(out_shape, *, also_return_flat=False, full_bias=False, bias_shape=(N,)):
    """x (2, 8, K) flattened to (16, K), matmul, + b (``bias_shape``), reshaped to ``out_shape``, relu."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 8, K], "float16"))
    w = relax.Var("w", relax.TensorType([K, N], "float16"))
    b = relax.Var("b", relax.TensorType([16, N] if full_bias else list(bias_shape), "float16"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(x, [16, K]))
            mm = bb.emit(relax.op.matmul(flat, w))
            biased = bb.emit(relax.op.add(mm, b))
            back = bb.emit(relax.op.reshape(biased, out_shape))
            out = bb.emit(relax.op.nn.relu(back))
            gv = bb.emit_output(relax.Tuple([out, mm]) if also_return_flat else out)
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("case", ["same_rows", "other_split", "flat_read_elsewhere", "full_bias", "wide_bias"])
def test_only_the_same_rows_are_unflattened(case):
    """Reshaped back to x's own leading axes, the site is the GEMM on x (the relu its epilogue). Reshaped
    to other leading axes, the 2-D result read elsewhere too, or an add of a full (M, N) operand: the
    graph is left as written (the matmul still offloaded, with what it fuses there), and so it is for a bias
    row of more axes than the flattened result (which broadcasts that result to more axes)."""
    mod = {"other_split": lambda: _flat_graph([4, 4, N]),
           "flat_read_elsewhere": lambda: _flat_graph([2, 8, N], also_return_flat=True),
           "full_bias": lambda: _flat_graph([2, 8, N], full_bias=True),
           "wide_bias": lambda: _flat_graph([2, 8, N], bias_shape=(1, 1, 1, N)),
           "same_rows": lambda: _flat_graph([2, 8, N])}[case]()
    out = UnflattenGemmRows()(mod)
    if case == "same_rows":
        assert flattened_gemm_plans(mod["main"]) and not flattened_gemm_plans(out["main"])
        assert "relax.reshape" not in out["main"].script() and "R.reshape" not in out["main"].script()
        assert tvm_ffi.structural_equal(UnflattenGemmRows()(out), out)
    else:
        assert not flattened_gemm_plans(mod["main"]) and out.same_as(mod)
    # the site as the partition takes it: the relu fused on x's rows; else the flattened site's bias add
    # (a full operand is a residual add), nothing where the 2-D result is read by another op
    expected = {"same_rows": "cublaslt.matmul_bias_relu", "other_split": "cublaslt.matmul_bias",
                "wide_bias": "cublaslt.matmul_bias",
                "flat_read_elsewhere": "cublaslt.matmul", "full_bias": "cublaslt.matmul_residual"}[case]
    assert [s.composite for s in gemm.gemm_report(mod)] == [expected]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([2, 8, K]).astype("float16"), (rng.standard_normal([K, N]) * 0.1).astype("float16"),
            rng.standard_normal([16, N] if case == "full_bias" else [1, 1, 1, N] if case == "wide_bias"
                                else [N]).astype("float16")]
    got = run_llvm_outputs(gemm.inline_gemm_composites(mqa_byoc.partition_for_cutlass(mod)), args)
    for g, r in zip(got, run_llvm_outputs(mod, args), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-2)


def test_hf_models_exported_get_their_activation_and_residual_fused():
    """HF families whose linear layers torch.export flattens: StarCoder2's MLP (gelu_tanh after c_fc) and
    Phi's parallel block (the residual after its MLP's fc2) fuse the epilogue into the GEMM. (The numerics
    of the rewrite are the tests above: these graphs do not build on llvm, unrewritten either.)"""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=1, vocab_size=128)
    expected = {"starcoder2": (transformers.Starcoder2Config, "cublaslt.matmul_transposed_bias_gelu_tanh"),
                "phi": (transformers.PhiConfig, "cublaslt.matmul_transposed_bias_residual")}
    for name, (config, composite) in expected.items():
        cfg = config(**small)
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()

        class Logits(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, ids):
                return self.m(input_ids=ids, use_cache=False).logits

        ids = torch.randint(0, 128, (1, 8))
        mod = from_exported_program(torch.export.export(Logits(model), (ids,)))
        mod = relax.transform.ToMixedPrecision(out_dtype="float16")(mod)
        sites = [s for s in mqa_byoc.offload_report(mod, gemm=True) if isinstance(s, gemm.GemmSite)]
        assert len(sites) == 7 and all(s.offloaded for s in sites), gemm.format_gemm_report(sites)
        assert [s.composite for s in sites].count(composite) == 1, (name, gemm.format_gemm_report(sites))
        assert all(s.output in _matmul_names(mod) for s in sites)


@pytest.mark.parametrize("form", FORMS, ids=[gemm_composite_name(*f) for f in FORMS])
def test_every_pattern_flattened_is_the_pattern_as_written(form):
    """Each composite's graph in torch.export's flattened form (symbolic rows): the same composite as the
    graph written on x's axes, and the numerics of the graph."""
    mod, specs = gemm_graph(*form, flattened=True)
    [site] = gemm.gemm_report(mod)
    assert site.offloaded and site.composite == gemm_composite_name(*form)
    arrays = draw_inputs(specs, {"n": 5})
    got = run_llvm(gemm.inline_gemm_composites(mqa_byoc.partition_for_cutlass(mod)), arrays)
    np.testing.assert_allclose(got, run_llvm(mod, arrays), rtol=1e-3, atol=1e-3)
