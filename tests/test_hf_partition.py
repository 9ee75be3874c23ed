"""A real HF transformers decoder (random weights from a config, nothing downloaded), exported with
torch.export and imported with TVM's PyTorch frontend: every attention is offloaded with native
K/V heads, and the rewritten graph computes what the original does."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from mqa_byoc.testing import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention  # noqa: E402
from mqa_byoc.compiler.partition import canonicalize_attention  # noqa: E402
from mqa_byoc.models import hf  # noqa: E402

LAYERS = 2


def _import(impl, kind, mode, **kw):
    cfg = hf.make_hf_config(kind, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                            intermediate_size=256, vocab_size=128, num_layers=LAYERS,
                            attn_implementation=impl, sliding_window=8 if kind == "mistral" else None)
    model = hf.build_hf_model(cfg, dtype="float16")
    return hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, **kw)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_hf_decoder_offloaded_natively(impl, kind, mode):
    imp = _import(impl, kind, mode)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for site in report:
        assert site.offloaded, site.reason
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (8, 2, 32)
        assert site.composite == "flash_attn.attention_mqa"
        if mode == "prefill":
            assert site.causal == "BottomRight"
            assert site.window == (8 if kind == "mistral" else None)
        else:  # one query sees every cached key
            assert site.causal is None
        assert site.scale == pytest.approx(32 ** -0.5, rel=1e-3)
    if mode == "prefill":
        assert all(s.expansion == "repeat" and s.expansion_ops_removed == 6 for s in report)
    out = partition_for_cutlass(imp.mod)
    assert G.composites(out) == ["flash_attn.attention_mqa"] * LAYERS
    assert G.count_ops(out, "relax.nn.softmax") == 0
    assert G.count_ops(out, "relax.reshape") < G.count_ops(imp.mod, "relax.reshape")


def _run(mod, args):
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    first = out[0] if isinstance(out, (tvm.ir.Array, list, tuple)) or hasattr(out, "__getitem__") and not hasattr(out, "numpy") else out
    return first.numpy().astype("float32")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_rewrite_numerics_cpu(impl):
    """The canonicalized graph (attention on 2 K/V heads, lowered by TVM with the h // r fix) gives the
    original graph's logits, and both are close to PyTorch eager."""
    imp = _import(impl, "llama", "prefill")
    ids = np.random.default_rng(0).integers(0, 128, size=(1, 12)).astype("int64")
    args = [ids, *imp.params]
    want = _run(imp.mod, args)
    got = _run(LegalizeGroupedAttention()(canonicalize_attention(imp.mod)), args)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    ref = imp.reference(ids)
    np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-2)


def test_hf_mixed_precision_pipeline_offloads():
    """The frontend's default float32 matmuls + ToMixedPrecision: q/k arrive in float32 through RoPE
    and are cast before the matmul; the cast moves to the un-expanded K/V and the site offloads."""
    imp = _import("eager", "llama", "prefill", matmul_dtype="float32", mixed_precision=True)
    report = offload_report(imp.mod)
    assert report and all(s.offloaded and s.num_kv_heads == 2 and s.dtype == "float16" for s in report)


def test_hf_float32_matmuls_without_mixed_precision_are_rejected_with_reason():
    imp = _import("eager", "llama", "prefill", matmul_dtype="float32")
    report = offload_report(imp.mod)
    assert report and not any(s.offloaded for s in report)
    assert all("float32" in s.reason and "ToMixedPrecision" in s.reason for s in report)
