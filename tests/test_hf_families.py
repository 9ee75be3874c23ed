"""The standard HF path (``torch.export`` -> plain ``from_exported_program`` -> ``ToMixedPrecision``) on
the GQA decoder families users compile besides Llama and Mistral: Qwen2 (q/k/v biases), Qwen3 and OLMo2
(RMSNorm on q and k), Phi-3 (one fused ``qkv_proj``), Gemma 3 (scaled query, sliding-window layers),
StarCoder2, GPTBigCode (multi-query and not), Granite (its own scalings), Mixtral (its experts as batched matmuls: TVM's frontend has no
converter for transformers' default grouped_mm), Cohere 2, EXAONE 4 and OLMo 3 (sliding-window layers), GLM-4
(interleaved rotary embedding), ERNIE 4.5, Helium, SmolLM3 (layers without RoPE), Qwen2-MoE. Every attention is offloaded with the K/V expansion
removed; Doge's learned, data-dependent mask is rejected naming its weight; Gemma 2's logit soft-capping runs on FA2's soft-capping kernel families.
Falcon: multi-query (Falcon-7B) is offloaded with its one K/V head; the new decoder architecture
(Falcon-40B/180B) expands K before its rotary embedding and caches every head, so it runs as attention
over the expanded heads, the note saying why. Multi-head latent attention (DeepSeek-V3, MiniCPM3, Youtu, GLM-4
MoE Lite): V's head dim is smaller than Q/K's, and V is padded to theirs for the kernels."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mqa_byoc.testing import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.models import hf  # noqa: E402
from mqa_byoc.contract import COMPOSITE_MQA_SINK  # noqa: E402

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
    "mixtral": ("MixtralConfig", dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=None,
                                      experts_implementation="batched_mm"), ("eager", "sdpa"), (None, None)),
    "cohere2": ("Cohere2Config", dict(head_dim=HEAD_DIM, sliding_window=WINDOW), ("eager", "sdpa"), (WINDOW, WINDOW)),
    "exaone4": ("Exaone4Config", dict(head_dim=HEAD_DIM, sliding_window=WINDOW), ("eager", "sdpa"), (WINDOW, WINDOW)),
    "olmo3": ("Olmo3Config", dict(sliding_window=WINDOW), ("eager", "sdpa"), (WINDOW, WINDOW)),
    "glm4": ("Glm4Config", dict(head_dim=HEAD_DIM, pad_token_id=0), ("eager", "sdpa"), (None, None)),
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=HEAD_DIM), ("eager", "sdpa"), (None, None)),
    "helium": ("HeliumConfig", dict(head_dim=HEAD_DIM, pad_token_id=0), ("eager", "sdpa"), (None, None)),
    "smollm3": ("SmolLM3Config", dict(pad_token_id=0), ("eager", "sdpa"), (None, None)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, experts_implementation="batched_mm"),
                  ("eager", "sdpa"), (None, None)),
}
FALCON = dict(alibi=False, parallel_attn=True, bias=False)


def _falcon(impl, **kw):
    """A Falcon model: its config names K/V heads ``num_kv_heads`` / ``multi_query``, not Llama's key."""
    cfg = transformers.FalconConfig(**{k: v for k, v in _SIZES.items() if k != "num_key_value_heads"}, **FALCON, **kw)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _model(family, impl, **extra):
    cls_name, kw, _, _ = FAMILIES.get(family, (family, {}, (), ()))
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    cfg = cls(**_SIZES, **{**kw, **extra})
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _peaked(model, factor=3.0):
    """``model`` with its query and key projections scaled by ``factor``: with HF's init (std 0.02) the
    softmax rows of some families are nearly flat, and their logits would barely move with a wrong scale
    (Phi-3: a softmax scale 1.25x off moves them by 0.016, under the tolerance; 0.14 once scaled)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in ("q_proj", "k_proj", "qkv_proj", "c_attn",
                                                                    "query_key_value"):
                p.mul_(factor)
    return model


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
    model = _peaked(_model(family, "eager"))
    imp = _import(model, mode)
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args)
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_gemma2_offloaded_with_and_without_soft_capping(mode):
    """Gemma 2's logit soft-capping runs on FA2's soft-capping families (tests/test_graph_softcap.py checks
    its parameters and numerics); without it the same model is plain attention."""
    model = _model("Gemma2Config", "eager", head_dim=HEAD_DIM, sliding_window=WINDOW)
    report = offload_report(_import(model, mode).mod)
    assert len(report) == LAYERS
    assert all(s.offloaded and s.softcap == 50.0 and s.composite == "flash_attn.attention_mqa_softcap"
               for s in report), [s.reason for s in report]
    model = _model("Gemma2Config", "eager", head_dim=HEAD_DIM, sliding_window=WINDOW, attn_logit_softcapping=None)
    report = offload_report(_import(model, mode).mod)
    assert all(s.offloaded and s.softcap is None and s.composite == "flash_attn.attention_mqa" for s in report)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_granite_swa_sink_as_output_scaling_offloaded_as_a_sink_site(mode):
    """GraniteSWA applies its per-head sink after attention, ``o * sigmoid(logsumexp(s) - sink)`` (what an
    extra softmax logit gives), with ``torch.logsumexp`` of the same scores; TVM's frontend imports it only
    with a converter for ``amax`` (ours: ``convert="native"``). Each layer is one sink site (windows as the
    layers have them) rooted at the scaling: the scores, their log-sum-exp and the K/V expansion are gone
    from the partitioned graph, and its logits are the graph's on the CPU and near float32 eager; the
    sinks move those logits, so a site that dropped them would fail."""
    model = _model("GraniteSWAConfig", "eager", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    sinks = [p for name, p in model.named_parameters() if name.endswith("sinks")]
    with torch.no_grad():
        for p in sinks:
            p.copy_(3.0 + 2.0 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    _peaked(model)
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="native", mixed_precision=True)
    report = offload_report(imp.mod)
    assert [(s.offloaded, s.composite, s.window) for s in report] == [
        (True, COMPOSITE_MQA_SINK, WINDOW if mode == "prefill" else None), (True, COMPOSITE_MQA_SINK, None)], \
        [s.reason for s in report]
    assert all(s.note is None and s.num_kv_heads == KV_HEADS for s in report)
    part = partition_for_cutlass(imp.mod)
    assert len(hf.kv_expansions_left(imp.mod)) == 2 * LAYERS and not hf.kv_expansions_left(part)
    assert [G.count_ops(part, op) for op in ("relax.nn.softmax", "relax.log", "relax.exp")] == [0, 0, 0]
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args, rtol=5e-2, atol=5e-2)
    want = imp.reference(*inputs)
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    with torch.no_grad():
        for p in sinks:
            p.fill_(-1e4)  # sigmoid(lse + 1e4) = 1: no sink
    assert np.abs(imp.reference(*inputs) - want).max() > 0.1  # twice the tolerance


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_falcon_multi_query_offloaded_with_one_kv_head(impl, mode):
    model = _falcon(impl, multi_query=True, new_decoder_architecture=False)
    imp = _import(model, mode)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for site in report:
        assert site.offloaded, site.reason
        assert (site.num_q_heads, site.num_kv_heads) == (HEADS, 1)
        assert site.causal == ("BottomRight" if mode == "prefill" else None)
    assert not hf.kv_expansions_left(partition_for_cutlass(imp.mod))
    if impl == "eager":
        _falcon_numerics(_peaked(model), mode)


def _falcon_numerics(model, mode):
    """The rewritten graph gives HF's logits. Imported with our convert map: the frontend takes Falcon's
    ``qkv[..., [-2], :]`` with a negative index out of bounds (``test_models_decoders.py``)."""
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes",
                       mixed_precision=True)
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    got = G.rewritten_on_cpu(imp.mod, [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params])
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("multi_query", [True, False])
def test_gpt_bigcode_offloaded_with_its_kv_heads(multi_query, impl, mode):
    """GPTBigCode (StarCoder, SantaCoder): one fused ``c_attn``; with ``multi_query`` K and V have one head,
    which the kernels read as it is; without, as many as the queries."""
    cfg = transformers.GPTBigCodeConfig(n_embd=256, n_head=HEADS, n_layer=LAYERS, n_positions=256, vocab_size=128,
                                        multi_query=multi_query, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    imp = _import(model, mode)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for site in report:
        assert site.offloaded, site.reason
        assert (site.num_q_heads, site.num_kv_heads) == (HEADS, 1 if multi_query else HEADS)
        assert site.causal == ("BottomRight" if mode == "prefill" else None)
    assert not hf.kv_expansions_left(partition_for_cutlass(imp.mod))
    if impl == "eager" and multi_query:
        imp = _import(_peaked(model), mode)
        inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
        got = G.rewritten_on_cpu(imp.mod, [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params])
        np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_falcon_new_architecture_runs_on_the_expanded_heads(mode):
    """Falcon-40B's form: K/V sliced from the fused qkv as (B, S, H_kv, 1, D) and broadcast to every query
    head; V reaches attention through the broadcast (traced to its unit axis), K through the rotary
    embedding applied after it. The site runs as attention over the expanded heads and says why; decode
    reads a cache HF keeps with every head. Where transformers keeps K/V (and its cache) at num_kv_heads,
    the site is offloaded on those heads with no expansion left."""
    model = _falcon("sdpa", num_kv_heads=KV_HEADS, new_decoder_architecture=True)
    imp = _import(model, mode)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    # newer transformers (5.2x) keep Falcon-40B's K/V at num_kv_heads, in its cache too, and attend through
    # the shared attention functions (repeat_kv): then the site is plain GQA on the native K/V heads
    with torch.no_grad():
        cache = model(torch.zeros(1, 3, dtype=torch.long), use_cache=True).past_key_values
    cached_heads = cache.layers[0].keys.shape[1] if hasattr(cache, "layers") else cache[0][0].shape[1]
    assert cached_heads in (HEADS, KV_HEADS), cached_heads
    for site in report:
        assert site.offloaded and (site.num_q_heads, site.num_kv_heads) == (HEADS, cached_heads)
        if mode == "prefill" and cached_heads == HEADS:
            assert "V is expanded (repeat x4) but no expansion of K" in site.note, site.note
    if cached_heads == KV_HEADS:
        assert not hf.kv_expansions_left(partition_for_cutlass(imp.mod))
    _falcon_numerics(_peaked(model), mode)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_padding_mask_input_stays_in_the_graph_saying_what_to_do(impl):
    """Batched generation with left padding: the export takes ``attention_mask``, and every layer's mask
    depends on it. No kernel takes a per-element mask, so every site stays, the reason naming the input
    and the var-len form."""
    model = _model("LlamaConfig", impl)

    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    ids, mask = torch.randint(0, 128, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    mod = from_exported_program(torch.export.export(WithMask(), (ids, mask)), keep_params_as_input=True)
    report = offload_report(relax.transform.ToMixedPrecision(out_dtype="float16")(mod))
    assert len(report) == LAYERS
    for site in report:
        assert not site.offloaded and "runtime input 'mask'" in site.reason and "attention_var_len" in site.reason


def test_a_learned_data_dependent_mask_is_rejected_naming_the_weight():
    # Doge's mask is a per-key score bias computed from the value states and a learned weight A: no
    # causal or window mask the kernels take, and no padding mask either (the reason names the weight)
    if getattr(transformers, "DogeConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no DogeConfig")
    cfg = transformers.DogeConfig(**_SIZES, head_dim=HEAD_DIM, sliding_window=WINDOW)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    report = offload_report(_import(transformers.AutoModelForCausalLM.from_config(cfg).eval(), "prefill").mod)
    assert len(report) == LAYERS
    for layer, site in enumerate(report):
        assert not site.offloaded
        assert f"model weight 'p_model_model_layers_{layer}_self_attn_a'" in site.reason, site.reason
        assert "padding" not in site.reason


# ----------------------------------------------------------------------------- multi-head latent attention
#: MLA families: (config class, config, Q/K head dim, V head dim). Q and K have qk_nope + qk_rope dims, V
#: v_head_dim; K/V are up-projected from a latent to every query head. Dense MLPs (the MoE layers' routing is
#: not what is tested here), sizes DeepSeek's (192 / 128) or half of them.
_LATENT = dict(num_key_value_heads=HEADS, kv_lora_rank=64)
MLA_FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", dict(_LATENT, q_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128, first_k_dense_replace=LAYERS), 192, 128),
    "minicpm3": ("MiniCPM3Config", dict(_LATENT, q_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                        v_head_dim=64), 96, 64),
    "youtu": ("YoutuConfig", dict(_LATENT, q_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
              96, 64),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(_LATENT, q_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                                v_head_dim=64, mlp_layer_types=["dense"] * LAYERS), 96, 64),
}
#: DeepSeek-V3's long-context RoPE: YaRN with mscale_all_dim, which scales the softmax by mscale ** 2 too
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
            beta_fast=32.0, beta_slow=1.0, rope_theta=10000.0)


def _mla_model(family, impl, std=None, **extra):
    cls_name, kw, _, _ = MLA_FAMILIES.get(family, (family, {}, None, None))
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    cfg = cls(**{**_SIZES, **kw, **extra})
    cfg._attn_implementation = impl
    if std is not None:  # weights large enough that the attention moves the logits
        return hf.build_hf_model(cfg, std=std)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _mla_import(model, mode):
    """The standard path with the fixes convert map: plain ToMixedPrecision fails on the R.slice_scatter
    MLA's key assembly imports as (test_mla_standard_path_limits)."""
    return hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes", mixed_precision=True)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("family, impl", [(f, "eager") for f in MLA_FAMILIES] + [("deepseek_v3", "sdpa")])
def test_mla_family_offloaded_with_v_padded(family, impl, mode):
    """Every layer's attention is reported (one softmax each) and offloaded: Q/K head dim d, V's dv < d padded
    with zeros to d before the composite and the output sliced back, the model's softmax scale."""
    model = _mla_model(family, impl)
    _, _, d, dv = MLA_FAMILIES[family]
    imp = _mla_import(model, mode)
    assert G.count_ops(imp.mod, "relax.nn.softmax") == LAYERS
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for site in report:
        assert site.offloaded, site.reason
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.head_dim_v, site.dtype) == (
            HEADS, HEADS, d, dv, "float16")
        assert site.composite == "flash_attn.attention"
        assert site.causal == ("BottomRight" if mode == "prefill" else None)
        assert site.scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-3)
        assert f"V is padded with zeros from head dim {dv} to {d}" in site.note, site.note
    out = partition_for_cutlass(imp.mod)
    assert G.composites(out) == ["flash_attn.attention"] * LAYERS
    assert G.count_ops(out, "relax.nn.softmax") == 0 and G.count_ops(out, "relax.nn.pad") == LAYERS


@pytest.mark.parametrize("family, mode, rope", [("deepseek_v3", "prefill", YARN), ("deepseek_v3", "decode", None),
                                                ("minicpm3", "prefill", None)])
def test_mla_rewrite_numerics_cpu(family, mode, rope):
    """The rewritten graph gives the graph's logits and both are near float32 eager (fp16 attention: logits
    up to 8, both graphs within 0.1 of eager); a softmax scale off by 20% would move them by more than four
    times the tolerance (the test can tell). With YaRN the scale is DeepSeek's qk_head_dim ** -0.5 *
    mscale ** 2, read off the graph."""
    extra = dict(rope_parameters=rope) if rope else {}
    model = _mla_model(family, "eager", std=0.1, **extra)
    layer = model.model.layers[0].self_attn
    imp = _mla_import(model, mode)
    (site, _) = offload_report(imp.mod)
    assert site.scale == pytest.approx(layer.scaling, rel=1e-3)
    if rope:
        assert layer.scaling > 1.2 * MLA_FAMILIES[family][2] ** -0.5  # mscale ** 2 is in it
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args, rtol=5e-2, atol=0.1)
    want = imp.reference(*inputs)
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=0.1)
    for block in model.model.layers:
        block.self_attn.scaling *= 1.2
    assert np.abs(imp.reference(*inputs) - want).max() > 4 * 0.1


def test_mla_standard_path_limits():
    """Pinned, so that a TVM upgrade that lifts one shows up. Plain ``from_exported_program`` +
    ``ToMixedPrecision`` (no convert map): DeepSeek-V3's key assembly (``new_empty`` then ``copy_`` into two
    slices) imports as ``R.slice_scatter``, whose bounds ToMixedPrecision takes for tensors; DeepSeek-V2's
    rotary embedding is complex arithmetic (``view_as_complex``, ``polar``), which the frontend does not
    convert at all."""
    from tvm.error import InternalError

    with pytest.raises(InternalError, match="Expected TensorType, but got T.int64"):
        hf.import_hf(_mla_model("deepseek_v3", "eager"), mode="prefill", seq_len=12, convert="standard",
                     mixed_precision=True)
    v2 = dict(MLA_FAMILIES["deepseek_v3"][1], q_lora_rank=None)
    with pytest.raises(AssertionError, match="view_as_complex"):
        hf.import_hf(_mla_model("DeepseekV2Config", "eager", **v2), mode="prefill", seq_len=12, convert="standard")


def _fp32_import_matches_eager(model, mode):
    """The model imported in float32 through the fixes convert map computes eager's logits (to float32
    rounding), so the converters are exact; returns the example inputs, their args and eager's logits."""
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes")
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    want = imp.reference(*inputs)
    np.testing.assert_allclose(G.run_llvm(imp.mod, args), want, rtol=1e-4, atol=1e-4)
    return args, want


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_deepseek_v2_complex_rotary_imports_and_is_offloaded(mode):
    """DeepSeek-V2's rotary embedding is complex arithmetic (``view_as_complex``, ``polar``, a complex product,
    ``view_as_real``): through the fixes convert map it imports as its real and imaginary parts and computes
    eager's logits; every layer is then offloaded as multi-head latent attention (V padded) and the rewritten
    graph stays near eager."""
    model = _mla_model("DeepseekV2Config", "eager", std=0.1, **dict(MLA_FAMILIES["deepseek_v3"][1], q_lora_rank=None))
    args, want = _fp32_import_matches_eager(model, mode)
    imp = _mla_import(model, mode)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS and all(s.offloaded and (s.head_dim, s.head_dim_v) == (192, 128) for s in report)
    np.testing.assert_allclose(G.rewritten_on_cpu(imp.mod, args, rtol=5e-2, atol=0.1), want, rtol=5e-2, atol=0.1)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_llama4_imports_and_its_chunked_layers_are_offloaded(mode):
    """Llama 4 (text): complex rotary embedding, ``position // attention_chunk_size`` on int64 positions, an MoE
    router's ``full_like(.., -inf)`` (three frontend failures the fixes convert map converts, exactly: the
    float32 import computes eager's logits). Its chunked layers' prefill mask (causal within blocks of
    ``attention_chunk_size``) is offloaded as causal attention on its blocks (12 positions in blocks of 8: a whole
    block and a short last one, two calls); the global layer (no RoPE, temperature-tuned queries) is offloaded causal; a decode step within one
    block is plain attention and offloaded on every layer. The rewritten graph computes eager's logits."""
    cfg = transformers.Llama4TextConfig(**{**_SIZES, "num_hidden_layers": 4}, head_dim=HEAD_DIM, num_local_experts=2,
                                        num_experts_per_tok=1, intermediate_size_mlp=256, attention_chunk_size=8,
                                        experts_implementation="batched_mm")
    cfg._attn_implementation = "eager"
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    model = hf.build_hf_model(cfg, std=0.1)
    args, want = _fp32_import_matches_eager(model, mode)
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes", mixed_precision=True)
    report = offload_report(imp.mod)
    assert len(report) == 4 and all(s.num_kv_heads == KV_HEADS for s in report)
    if mode == "prefill":
        assert all(s.offloaded and s.chunk == 8 and "2 causal kernel calls" in s.note for s in report[:3]), \
            [(s.reason, s.note) for s in report]
        assert report[3].offloaded and report[3].causal == "BottomRight" and report[3].chunk is None, report[3]
    else:
        assert all(s.offloaded for s in report), [s.reason for s in report]
    np.testing.assert_allclose(G.rewritten_on_cpu(imp.mod, args, rtol=5e-2, atol=0.1), want, rtol=5e-2, atol=0.1)


def test_sparse_mla_top_k_mask_is_rejected_as_data_dependent():
    """DeepSeek-V3.2's sparse attention: an indexer scores the keys from the hidden states and each query
    attends to its top k only. That mask is data-dependent: every layer is reported, and stays."""
    cfg = dict(MLA_FAMILIES["minicpm3"][1], mlp_layer_types=["dense"] * LAYERS, index_topk=4, index_n_heads=2,
               index_head_dim=32)
    report = offload_report(_mla_import(_mla_model("DeepseekV32Config", "eager", **cfg), "prefill").mod)
    assert len(report) == LAYERS
    for site in report:
        assert not site.offloaded and "data-dependent" in site.reason, site.reason
        # the indexer's weight and the selection are named (not the first weight a walk meets, a norm's)
        assert "R.topk" in site.reason and "indexer" in site.reason and "layernorm" not in site.reason, site.reason


@pytest.mark.parametrize("convert", ["native", "fixes"])
def test_fp16_model_with_qkv_biases_imports_and_is_offloaded(convert):
    """An fp16 Qwen2 (biased q/k/v projections: ``addmm(bias, x, w)`` after torch.export's decompositions)
    imports through the convert maps (the plain frontend adds the fp16 bias to its float32 matmul and fails);
    with the native map every attention and every GEMM is offloaded, and the rewritten graph computes the
    graph's logits, near the model's own."""
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.compiler.graph import gemm

    model = _peaked(_model("qwen2", "eager")).half()
    wrapper = hf.export_wrapper(model, "prefill", LAYERS, use_cache=False)
    with torch.no_grad():
        ep = torch.export.export(wrapper, (torch.zeros(1, 12, dtype=torch.long),))
    with pytest.raises(TypeError, match="same datatype"):
        from_exported_program(ep)
    imp = hf.import_hf(model, mode="prefill", batch=1, seq_len=12, use_cache=False, convert=convert)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    if convert == "fixes":  # the frontend's float32 matmuls: float32 attention, which FA2 does not take
        assert all(not s.offloaded and "float32" in s.reason for s in report)
        return
    assert all(s.offloaded and s.dtype == "float16" for s in report), [s.reason for s in report]
    projections = [g for g in gemm.gemm_report(imp.mod) if g.k == _SIZES["hidden_size"]]  # not attention's
    assert projections and all(g.offloaded for g in projections), [(g.n, g.k, g.reason) for g in projections]
    assert sum(g.composite == "cublaslt.matmul_transposed_bias" for g in projections) == 3 * LAYERS
    inputs = hf.example_inputs(model, mode="prefill", seq_len=12, seed=1)
    got = G.rewritten_on_cpu(imp.mod, [*inputs, *imp.params])
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


#: families whose linears carry biases (``addmm`` after torch.export's decompositions), as config class
#: and sizes: what an fp16 model imported through the native map failed on before its ``addmm`` converter
BIASED = {
    "gpt2": ("GPT2Config", dict(n_embd=256, n_head=HEADS, n_layer=LAYERS, vocab_size=128)),
    "phi": ("PhiConfig", dict(_SIZES)),
    "starcoder2": ("Starcoder2Config", dict(_SIZES, sliding_window=None)),
    "gpt_neox": ("GPTNeoXConfig", {k: v for k, v in _SIZES.items() if k != "num_key_value_heads"}),
}


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("family", list(BIASED))
def test_fp16_models_with_biases_through_the_native_map(family, mode):
    """An fp16 model with biased projections through ``import_hf``'s native map (matmuls in fp16): every
    attention and every projection GEMM offloaded, the biases as cuBLASLt epilogues."""
    from mqa_byoc.compiler.graph import gemm

    cls_name, kw = BIASED[family]
    cfg = getattr(transformers, cls_name)(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().half()
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="native")
    report = offload_report(imp.mod)
    assert len(report) == LAYERS and all(s.offloaded and s.dtype == "float16" for s in report), \
        [s.reason for s in report]
    projections = [g for g in gemm.gemm_report(imp.mod) if g.k >= 64 and g.n >= 64]  # not attention's
    assert projections and all(g.offloaded for g in projections), [(g.n, g.k, g.reason) for g in projections]
    assert any("bias" in g.composite for g in projections)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_ministral3_position_scaled_queries_import_and_are_offloaded(mode):
    """Ministral 3 scales its queries by ``1 + beta * log(1 + floor(positions / n))``: on int64 positions the
    frontend divides as integers and fails on ``log`` of an integer tensor; through the fixes convert map the
    float32 import computes eager's logits, and every layer is offloaded (the scaling is on Q, before the
    scores), the rewritten graph near eager."""
    cls = getattr(transformers, "Ministral3Config", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Ministral3Config")
    cfg = cls(**_SIZES)
    cfg.head_dim, cfg._attn_implementation = HEAD_DIM, "eager"
    model = hf.build_hf_model(cfg, std=0.1)
    args, want = _fp32_import_matches_eager(model, mode)
    imp = hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes", mixed_precision=True)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS and all(s.offloaded and s.num_kv_heads == KV_HEADS for s in report), \
        [s.reason for s in report]
    np.testing.assert_allclose(G.rewritten_on_cpu(imp.mod, args, rtol=5e-2, atol=0.1), want, rtol=5e-2, atol=0.1)


def _drawn_model(cls_name, kw, std):
    """A model of transformers' ``cls_name`` config with the test sizes and ``kw``, eager attention, experts as
    batched matmuls (TVM's frontend has no converter for the default grouped_mm), weights drawn with ``std``."""
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    cfg = cls(**{**_SIZES, **kw, "experts_implementation": "batched_mm"})
    cfg._attn_implementation = "eager"
    return hf.build_hf_model(cfg, std=std)


#: mixture-of-experts routers that pick their experts with ``topk(sorted=False)`` (which the frontend refuses)
MOE_ROUTERS = {
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=HEAD_DIM, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=64, first_k_dense_replace=1, n_group=2, topk_group=1)),
    "deepseek_v3_moe": ("DeepseekV3Config", dict(MLA_FAMILIES["deepseek_v3"][1], first_k_dense_replace=1,
                                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                                 n_group=2, topk_group=1)),
}


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("family", list(MOE_ROUTERS))
def test_moe_routers_with_unsorted_topk_import_and_are_offloaded(family, mode):
    """GLM-4 MoE and DeepSeek-V3 with their routed experts (group-limited top-k routing: ``topk(sorted=False)``):
    through the fixes convert map the float32 import computes eager's logits, and every attention is offloaded."""
    model = _drawn_model(*MOE_ROUTERS[family], std=0.1)
    _fp32_import_matches_eager(model, mode)
    report = offload_report(hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes",
                                         mixed_precision=True).mod)
    assert len(report) == LAYERS and all(s.offloaded for s in report), [s.reason for s in report]


#: hybrid decoders: attention layers between Mamba / linear-attention ones (the harness's cached export
#: returns K/V per layer, which their recurrent layers do not hold, so they are imported cache-less)
HYBRIDS = {
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=4, head_dim=HEAD_DIM, num_experts=2, num_experts_per_tok=1,
                                           moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    "granite_moe_hybrid": ("GraniteMoeHybridConfig", dict(layer_types=["mamba", "attention"], num_local_experts=2,
                                                          num_experts_per_tok=1)),
    "bamba": ("BambaConfig", dict(attn_layer_indices=[1])),
    "jamba": ("JambaConfig", dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1, use_mamba_kernels=False)),
    # gated delta-rule layers (Qwen3.5, LaraMini) and short convolutions (LFM3) before the attention layer
    "qwen3_5": ("Qwen3_5TextConfig", dict(head_dim=HEAD_DIM, layer_types=["linear_attention", "full_attention"])),
    "lfm3": ("Lfm3Config", dict(layer_types=["conv", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "lara_mini": ("LaraMiniConfig", dict(layer_types=["linear_attention", "full_attention"], eos_token_id=2)),
}


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_decoders_attention_layers_offloaded(family):
    """Qwen3-Next, Granite 4 (MoE hybrid), Bamba, Jamba, Qwen3.5, LFM3, LaraMini through the fixes convert map
    (prefill without a cache):
    the float32 import computes eager's logits; the one attention layer is reported and offloaded on its 2 K/V
    heads, the recurrent layers stay TVM's, and the rewritten graph computes the fp16 graph's logits."""
    model = _drawn_model(*HYBRIDS[family], std=0.05)
    inputs = hf.example_inputs(model, mode="prefill", seq_len=12, seed=1)
    imp = hf.import_hf(model, mode="prefill", batch=1, seq_len=12, use_cache=False, convert="fixes")
    want = imp.reference(*inputs)
    np.testing.assert_allclose(G.run_llvm(imp.mod, [inputs[0], *imp.params]), want, rtol=1e-4, atol=1e-4)
    imp = hf.import_hf(model, mode="prefill", batch=1, seq_len=12, use_cache=False, convert="fixes",
                       mixed_precision=True)
    report = offload_report(imp.mod)
    assert [(s.offloaded, s.num_q_heads, s.num_kv_heads, s.causal) for s in report] == [
        (True, HEADS, KV_HEADS, "BottomRight")], [s.reason for s in report]
    # the rewrite computes what the fp16 graph does (Qwen3-Next's own fp16 graph is ~1 off eager's logits:
    # its gated delta rule in fp16, not the attention)
    G.rewritten_on_cpu(imp.mod, [inputs[0], *imp.params], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_hybrid_decoder_with_a_cache_fails_naming_the_fix(mode):
    """With a cache (the default, and any decode) a hybrid's recurrent cache layers hold no K/V: import_hf
    says so and names the cache-less prefill, instead of failing inside transformers' cache."""
    model = _drawn_model("Qwen3_5TextConfig", dict(head_dim=HEAD_DIM, layer_types=["linear_attention", "full_attention"]),
                         std=0.05)
    with pytest.raises(ValueError, match=r"hybrid decoder: its cache layers 0 \(LinearAttentionLayer\).*use_cache=False"):
        hf.import_hf(model, mode=mode, batch=1, seq_len=12, past_len=6, convert="fixes")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_xglm_score_clamp_at_the_type_minimum_is_offloaded(mode):
    """XGLM clamps the scores with ``torch.max(w, torch.full((), finfo.min))``, which TVM's frontend imports
    as ``maximum(scores, full((), -3.4e38))``: the clamp at a large negative constant changes no score the
    kernels see, so the site is offloaded (multi-head: 8 heads, no expansion), with the graph's numbers."""
    cfg = transformers.XGLMConfig(d_model=256, attention_heads=HEADS, num_layers=LAYERS, ffn_dim=256, vocab_size=128,
                                  max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _peaked(transformers.AutoModelForCausalLM.from_config(cfg).eval())
    imp = _import(model, mode)
    assert "R.full(R.shape([])" in imp.mod["main"].script(show_meta=False)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS and all(s.offloaded for s in report), [s.reason for s in report]
    assert all((s.num_q_heads, s.num_kv_heads) == (HEADS, HEADS) for s in report)
    inputs = hf.example_inputs(model, mode=mode, seq_len=12, past_len=6, seed=1)
    args = [inputs[0], *[x.astype("float32") for x in inputs[1:]], *imp.params]
    got = G.rewritten_on_cpu(imp.mod, args)
    np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=5e-2)


def test_gpt1_multiplicative_mask_is_rejected_naming_it():
    """GPT-1 (``OpenAIGPTLMHeadModel``) masks with ``w * b + -1e4 * (1 - b)``: the scores multiplied by a 0/1
    tensor, which no single softmax scale is; the reason says what to write instead."""
    cfg = transformers.OpenAIGPTConfig(n_embd=256, n_head=HEADS, n_layer=LAYERS, vocab_size=128, n_positions=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    imp = hf.import_hf(model, mode="prefill", batch=1, seq_len=12, past_len=6, convert="standard", use_cache=False,
                       mixed_precision=True)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    assert all(not s.offloaded and "0/1 mask multiplied in" in s.reason for s in report), [s.reason for s in report]


def _deepseek_v4(layer_types, head_dim=HEAD_DIM):
    """A small DeepSeek-V4: one shared K=V head (MQA), a learned sink per head, the given attention layers
    (a 8-key sliding window; the compressed layers pool every 4 / 8 positions), its clamped SwiGLU."""
    cls = getattr(transformers, "DeepseekV4Config", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4Config")
    cfg = cls(hidden_size=128, num_attention_heads=HEADS, num_key_value_heads=1, head_dim=head_dim, q_lora_rank=64,
              o_groups=2, o_lora_rank=32, vocab_size=128, num_hidden_layers=len(layer_types), layer_types=layer_types,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              sliding_window=WINDOW, index_n_heads=4, index_head_dim=16, index_topk=3, n_routed_experts=2,
              num_experts_per_tok=1, moe_intermediate_size=64, intermediate_size=128, qk_rope_head_dim=16,
              max_position_embeddings=256, num_nextn_predict_layers=0, experts_implementation="batched_mm")
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # sinks that move the softmax (HF initializes them to zero)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    return model


def test_deepseek_v4_sliding_layers_offloaded_with_sinks_compressed_layers_rejected():
    """DeepSeek-V4 through the standard path (float32 model, fixes map, ``ToMixedPrecision``; the map's
    ``clamp`` lets mixed precision through its clamped SwiGLU): the sliding-window layer (one K=V head, sinks)
    is offloaded as the sink composite on its one K/V head with its window; the compressed sparse layer's
    keys are picked by its indexer's top-k (rejected naming the selection and the indexer's weight); the
    heavily compressed layer appends pooled entries under a block mask (rejected: not a causal, window or
    chunked mask). A 24-token prompt, longer than the window and several pooling blocks: the rewritten graph
    computes the graph's and eager's logits."""
    model = _deepseek_v4(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    imp = hf.import_hf(model, mode="prefill", seq_len=24, use_cache=False, convert="fixes", mixed_precision=True)
    sliding, sparse, pooled = offload_report(imp.mod)
    assert (sliding.offloaded, sliding.composite, sliding.num_q_heads, sliding.num_kv_heads, sliding.window) == (
        True, COMPOSITE_MQA_SINK, HEADS, 1, WINDOW), sliding.reason
    assert not sparse.offloaded and "R.topk" in sparse.reason and "indexer" in sparse.reason, sparse.reason
    assert not pooled.offloaded and "not a causal, sliding-window or chunked mask" in pooled.reason, pooled.reason
    ids = np.random.default_rng(1).integers(0, 128, (1, 24))
    got = G.rewritten_on_cpu(imp.mod, [ids, *imp.params], rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(got, imp.reference(ids), rtol=5e-2, atol=5e-2)


def test_deepseek_v4_head_dim_512_rejected_with_the_reason():
    """DeepSeek-V4's released head dim (512) is beyond every provider's kernels: its sliding layer is reported
    and stays in the graph with a reason naming the head dim."""
    model = _deepseek_v4(["sliding_attention"], head_dim=512)
    imp = hf.import_hf(model, mode="prefill", seq_len=12, use_cache=False, convert="fixes", mixed_precision=True)
    (site,) = offload_report(imp.mod)
    assert not site.offloaded and site.head_dim == 512 and "head dim 512" in site.reason, site.reason


def test_hidden_state_relative_bias_is_rejected_as_a_bias_not_a_selection():
    """Inkling adds a relative-position bias conditioned on the hidden states: each token mixes a learned bank
    of bias-by-distance profiles (``rel_logits_proj``) and the scores gather it by query-key distance. That is a
    data-dependent score bias, which no kernel takes: through the fixes map (its ``amax``, its short convolutions'
    cache-less prefill) every layer is reported and stays, the reason naming the
    gather and the weight, and not calling it a key selection (sparse attention's top-k)."""
    model = _drawn_model("InklingTextConfig", dict(
        head_dim=HEAD_DIM, swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM,
        sliding_window_size=WINDOW, d_rel=4, rel_extent=16, layer_types=["hybrid_sliding", "hybrid"],
        mlp_layer_types=["sparse"] * LAYERS, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        moe_intermediate_size=64), std=0.02)
    imp = hf.import_hf(model, mode="prefill", seq_len=12, use_cache=False, convert="fixes", mixed_precision=True)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for layer, site in enumerate(report):
        assert not site.offloaded and "data-dependent" in site.reason, site.reason
        assert "read per query and key position (R.gather_elements)" in site.reason, site.reason
        assert f"layers_{layer}_self_attn_rel_logits_proj" in site.reason and "selects keys" not in site.reason


def _gemma4(num_kv_shared_layers=2, global_head_dim=64):
    """A small Gemma 4: sliding (8-key window, GQA 8/2, head dim 32) and global layers (K = V, one K/V head,
    their own head dim), RMS-normed q / k / v and a softmax scale of 1; the last ``num_kv_shared_layers``
    layers reuse the K/V of the last earlier layer of their type and cache nothing. Its MLP on SiLU (the
    attention is what is tested): TVM's CPU build of the fp16 GELU-tanh MLPs does not finish in minutes."""
    cls = getattr(transformers, "Gemma4TextConfig", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma4TextConfig")
    cfg = cls(**{**_SIZES, "num_hidden_layers": 4}, head_dim=HEAD_DIM, sliding_window=WINDOW,
              layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=global_head_dim,
              num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=num_kv_shared_layers,
              hidden_size_per_layer_input=0, pad_token_id=0, hidden_activation="silu")
    cfg._attn_implementation = "eager"
    return hf.build_hf_model(cfg, std=0.05)


def test_gemma4_kv_shared_layers_export_and_are_offloaded():
    """Gemma 4 with KV sharing: the cached exports take and return the K/V of the two layers that compute
    them (the sharing layers cache nothing), and a decode step after a prompt longer than the window gives
    a longer prefill's last logits. Every layer is offloaded on its own heads, window and scale 1, the
    sharing ones on the K/V of the layer they reuse, prefill and decode."""
    model = _gemma4()
    assert hf.cached_layers(model) == [0, 1]
    seen = 12
    lens = hf.decode_past_lengths(model.config, seen)
    ids = torch.randint(0, 128, (1, seen + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        past = hf.export_wrapper(model, "prefill", 4, True)(ids[:, :seen])[1:]
        assert [tuple(p.shape) for p in past] == [(1, KV_HEADS, WINDOW - 1, HEAD_DIM)] * 2 + [(1, 1, seen, 64)] * 2
        step = hf.export_wrapper(model, "decode", 4, True)(ids[:, seen:], *past)[0]
        longer = hf.export_wrapper(model, "prefill", 4, True)(ids)[0][:, -1:]
    np.testing.assert_allclose(step.numpy(), longer.numpy(), rtol=1e-5, atol=1e-5)
    for mode in ("prefill", "decode"):  # decode: the sliding layers' 7 past keys and the new one fit the window
        window = WINDOW if mode == "prefill" else None
        want = [(True, HEADS, KV_HEADS, HEAD_DIM, window, 1.0), (True, HEADS, 1, 64, None, 1.0)] * 2
        imp = hf.import_hf(model, mode=mode, seq_len=seen, past_len=lens, convert="fixes", mixed_precision=True)
        report = offload_report(imp.mod)
        assert [(s.offloaded, s.num_q_heads, s.num_kv_heads, s.head_dim, s.window, s.scale) for s in report] == want, \
            [s.reason for s in report]
        assert len(imp.mod["main"].params) == 1 + (4 if mode == "decode" else 0) + len(imp.params)
        inputs = [ids[:, :seen].numpy()] if mode == "prefill" else [ids[:, seen:].numpy(), *[p.numpy() for p in past]]
        got = G.rewritten_on_cpu(imp.mod, [*inputs, *imp.params], rtol=5e-2, atol=0.1)
        np.testing.assert_allclose(got, imp.reference(*inputs), rtol=5e-2, atol=0.15)


def test_gemma4_global_head_dim_512_rejected_with_the_reason():
    """Gemma 4's released global layers have head dim 512, beyond every provider's kernels: they stay in the
    graph with the reason; its sliding layers (head dim 32 here, 256 released) are offloaded."""
    imp = hf.import_hf(_gemma4(num_kv_shared_layers=0, global_head_dim=512), mode="prefill", seq_len=12,
                       convert="fixes", mixed_precision=True)
    report = offload_report(imp.mod)
    assert [s.offloaded for s in report] == [True, False] * 2, [s.reason for s in report]
    assert all("head dim 512" in s.reason for s in report[1::2]), [s.reason for s in report]
