"""The standard HF path (``torch.export`` -> plain ``from_exported_program`` -> ``ToMixedPrecision``) on
the GQA decoder families users compile besides Llama and Mistral: Qwen2 (q/k/v biases), Qwen3 and OLMo2
(RMSNorm on q and k), Phi-3 (one fused ``qkv_proj``), Gemma 3 (scaled query, sliding-window layers),
StarCoder2, Granite (its own scalings). Every attention is offloaded with the K/V expansion removed;
Gemma 2's logit soft-capping (tanh) is not built into the kernels and is rejected saying so."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.models import hf  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 2, 8, 2, 32, 8
_SIZES = dict(hidden_size=256, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=256,
              vocab_size=128, num_hidden_layers=LAYERS, max_position_embeddings=256)
#: family -> (config class name, extra config, attention implementations, windows of the prefill's layers)
FAMILIES = {
    "qwen2": ("Qwen2Config", dict(head_dim=HEAD_DIM), ("eager", "sdpa"), (None, None)),
    "qwen3": ("Qwen3Config", dict(head_dim=HEAD_DIM), ("eager", "sdpa"), (None, None)),
    "olmo2": ("Olmo2Config", {}, ("eager", "sdpa"), (None, None)),
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), ("eager", "sdpa"), (None, None)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=HEAD_DIM, sliding_window=WINDOW), ("eager", "sdpa"),
               (WINDOW, WINDOW)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=None), ("eager", "sdpa"), (None, None)),
    "granite": ("GraniteConfig", {}, ("eager", "sdpa"), (None, None)),
}


def _model(family, impl, **extra):
    cls_name, kw, _, _ = FAMILIES.get(family, (family, {}, (), ()))
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    cfg = cls(**_SIZES, **{**kw, **extra})
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _import(model, mode):
    return hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="standard",
                        mixed_precision=True)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("family, impl", [(f, i) for f, (_, _, impls, _) in FAMILIES.items() for i in impls])
def test_family_offloaded(family, impl, mode):
    imp = _import(_model(family, impl), mode)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    windows = FAMILIES[family][3] if mode == "prefill" else (None,) * LAYERS  # 7 keys fit any window
    for site, window in zip(report, windows):
        assert site.offloaded, site.reason
        assert (site.num_q_heads, site.num_kv_heads, site.dtype) == (HEADS, KV_HEADS, "float16")
        assert site.causal == ("BottomRight" if mode == "prefill" else None)
        assert site.window == window
    out = partition_for_cutlass(imp.mod)
    assert hf.kv_expansions_left(imp.mod) and not hf.kv_expansions_left(out)


@pytest.mark.parametrize("family, mode", [("qwen3", "prefill"), ("phi3", "decode"), ("granite", "prefill")])
def test_family_rewrite_numerics_cpu(family, mode):
    """The rewritten graph gives the graph's logits (and both are near float32 eager)."""
    model = _model(family, "eager")
    imp = _import(model, mode)
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args)
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_gemma2_soft_capping_is_rejected_naming_it(mode):
    model = _model("Gemma2Config", "eager", head_dim=HEAD_DIM, sliding_window=WINDOW)
    report = offload_report(_import(model, mode).mod)
    assert len(report) == LAYERS
    assert all(not s.offloaded and "soft-capping" in s.reason for s in report), [s.reason for s in report]
    # without soft-capping the same model is offloaded
    model = _model("Gemma2Config", "eager", head_dim=HEAD_DIM, sliding_window=WINDOW, attn_logit_softcapping=None)
    assert all(s.offloaded for s in offload_report(_import(model, mode).mod))
