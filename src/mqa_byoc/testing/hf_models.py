"""The random-weight HF decoders of the HF GPU tests, defined once: each model's config (:class:`HFModel`,
:data:`MODELS`), its weights from a seed (:func:`build_models`) and the PyTorch eager reference run through
the same wrapper ``import_hf`` exports (:func:`eager`).

``tools/gpu/build_hf.py`` (and ``build_hf_standard.py``) build libraries and references from them;
``tests/gpu/test_hf_reference_cpu.py`` rebuilds a model from its manifest and checks the stored
weights and references. Needs torch and transformers (CPU is enough).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

SCORE_STD = 2.5  # std of q.k / sqrt(D) for unit-RMS inputs: q/k projection std = sqrt(SCORE_STD / hidden)
INIT_STD = 0.02  # build_hf_model's default
SINK_STD = 4.0  # std of GPT-OSS's sink logits (a fresh model's are zeros): moves the decode logits beyond 2x the tolerance
#: the HF config class of each ``HFModel.kind`` besides llama / mistral (mqa_byoc.models.hf.make_hf_config)
FAMILY_CONFIGS = {"gpt_oss": "GptOssConfig", "gemma2": "Gemma2Config", "llama4": "Llama4TextConfig",
                  "granite_swa": "GraniteSWAConfig", "gemma4": "Gemma4TextConfig", "deepseek_v4": "DeepseekV4Config"}


@dataclass(frozen=True)
class HFModel:
    name: str
    kind: str  # "llama" | "mistral" | "gpt_oss" | "gemma2" | "llama4" | "granite_swa" | "gemma4" | "deepseek_v4"
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    window: int | None
    rope_theta: float
    batch: int
    seq_len: int
    note: str
    # GPT-OSS / Gemma 2 (defaults: what Llama / Mistral have)
    layer_types: tuple | None = None  # per layer "sliding_attention" | "full_attention"; None: all alike
    sinks: bool = False  # learned sink logits (GPT-OSS, GraniteSWA), drawn with SINK_STD
    softcap: float | None = None  # attn_logit_softcapping (Gemma 2)
    final_softcap: float | None = None  # final_logit_softcapping (Gemma 2)
    query_pre_attn_scalar: int | None = None  # Gemma 2: the scale is query_pre_attn_scalar ** -0.5
    experts: int = 0  # GPT-OSS's experts and how many each token takes
    experts_per_tok: int = 0
    score_std: float = SCORE_STD  # Gemma 2: scores large enough that its soft-cap bends them
    chunk: int | None = None  # Llama 4: attention_chunk_size (its chunked layers: causal within blocks)
    attention_multiplier: float | None = None  # GraniteSWA: the softmax scale (None: what the others have)
    # Gemma 4: full-attention layers with K = V on global_kv_heads heads of global_head_dim; the last
    # kv_shared layers reuse the K/V of the last earlier layer of their type (and cache nothing)
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    kv_shared: int = 0

    def site_heads(self, mqa: bool) -> list[tuple[int, int, int]]:
        """Per layer, (query heads, K/V heads, head dim) of its offloaded site (mqa=False: FA2 sees the
        expanded K/V, as many heads as the query)."""
        types = self.layer_types or (None,) * self.layers
        out = []
        for t in types:
            kv, d = ((self.global_kv_heads, self.global_head_dim) if t == "full_attention" and self.global_head_dim
                     else (self.kv_heads, self.head_dim))
            out.append((self.heads, kv if mqa else self.heads, d))
        return out

    @property
    def scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def site_windows(self, mode: str) -> list:
        """The window every layer's site is offloaded with: a sliding layer's in prefill (the prompt is
        longer); none in decode (the sliding cache holds w - 1 keys, all of which the new token sees)."""
        if mode != "prefill" or self.window is None:
            return [None] * self.layers
        types = self.layer_types or ("sliding_attention",) * self.layers
        return [self.window if t == "sliding_attention" else None for t in types]

    def site_chunks(self, mode: str) -> list:
        """The block size every layer's site is offloaded with: Llama 4's chunked layers' in prefill (the
        prompt spans more than one block); None elsewhere."""
        if mode != "prefill" or self.chunk is None:
            return [None] * self.layers
        return [self.chunk if t == "chunked_attention" else None for t in self.config().layer_types]

    def composite(self, mqa: bool) -> str:
        """The composite every site must be offloaded as."""
        from mqa_byoc.contract import (COMPOSITE_MHA, COMPOSITE_MHA_SINK, COMPOSITE_MHA_SOFTCAP, COMPOSITE_MQA,
                                       COMPOSITE_MQA_SINK, COMPOSITE_MQA_SOFTCAP)

        if self.sinks:
            return COMPOSITE_MQA_SINK if mqa else COMPOSITE_MHA_SINK
        if self.softcap:
            return COMPOSITE_MQA_SOFTCAP if mqa else COMPOSITE_MHA_SOFTCAP
        return COMPOSITE_MQA if mqa else COMPOSITE_MHA

    def config(self):
        if self.kind in FAMILY_CONFIGS:
            return self._family_config()
        from mqa_byoc.models import hf

        return hf.make_hf_config(self.kind, hidden_size=self.hidden, num_heads=self.heads,
                                 num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 intermediate_size=self.intermediate, vocab_size=self.vocab,
                                 num_layers=self.layers, rope_theta=self.rope_theta, sliding_window=self.window,
                                 attn_implementation="eager")

    def _family_config(self):
        import transformers

        kw = dict(hidden_size=self.hidden, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                  head_dim=self.head_dim, intermediate_size=self.intermediate, vocab_size=self.vocab,
                  num_hidden_layers=self.layers, max_position_embeddings=4096, sliding_window=self.window,
                  layer_types=list(self.layer_types) if self.layer_types else None)
        if self.kind == "gpt_oss":
            # all experts per token: top-k routing of random weights flips between fp16 and fp32 at near-ties
            # (a discontinuity no tolerance covers); batched_mm: TVM's frontend has no converter for the
            # default grouped_mm
            kw.update(num_local_experts=self.experts, num_experts_per_tok=self.experts_per_tok,
                      experts_implementation="batched_mm")
        elif self.kind == "llama4":
            # one routed expert (always taken: no top-k flips between fp16 and fp32) beside the shared one;
            # batched_mm as for GPT-OSS; layer_types from the config (every 4th layer global, no RoPE)
            kw.pop("sliding_window"), kw.pop("layer_types")
            kw.update(num_local_experts=max(self.experts, 1), num_experts_per_tok=max(self.experts_per_tok, 1),
                      intermediate_size_mlp=self.intermediate, attention_chunk_size=self.chunk,
                      experts_implementation="batched_mm")
        elif self.kind == "gemma4":
            # scale 1 (RMS-normed q and k: attention_multiplier records it); no per-layer inputs (their
            # embedding table is the size of the vocabulary times every layer)
            kw.update(global_head_dim=self.global_head_dim, num_global_key_value_heads=self.global_kv_heads,
                      attention_k_eq_v=True, num_kv_shared_layers=self.kv_shared, hidden_size_per_layer_input=0,
                      final_logit_softcapping=self.final_softcap, pad_token_id=0)
        elif self.kind == "deepseek_v4":
            # sliding-window layers only (the compressed ones are rejected); every routed expert taken (top-k
            # of random weights flips between fp16 and fp32 at near-ties); batched_mm as for GPT-OSS
            kw.update(q_lora_rank=self.hidden // 2, o_groups=2, o_lora_rank=self.hidden // 4, qk_rope_head_dim=16,
                      n_routed_experts=max(self.experts, 1), num_experts_per_tok=max(self.experts_per_tok, 1),
                      moe_intermediate_size=self.intermediate, index_n_heads=4, index_head_dim=16, index_topk=3,
                      num_nextn_predict_layers=0, experts_implementation="batched_mm")
        elif self.kind == "granite_swa":
            # head dim = hidden / heads; its own scale; token ids inside the small vocabulary
            kw.pop("head_dim")
            kw.update(attention_multiplier=self.scale, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        else:
            kw.update(attn_logit_softcapping=self.softcap, final_logit_softcapping=self.final_softcap,
                      query_pre_attn_scalar=self.query_pre_attn_scalar)
        cfg = getattr(transformers, FAMILY_CONFIGS[self.kind])(**kw)
        rp = getattr(cfg, "rope_parameters", None)
        if isinstance(rp, dict):
            rp["rope_theta"] = self.rope_theta
        cfg._attn_implementation = "eager"
        return cfg


MODELS = [
    HFModel("llama3_gqa", "llama", heads=32, kv_heads=8, head_dim=128, hidden=256, intermediate=512, vocab=1024,
            layers=2, window=None, rope_theta=500000.0, batch=2, seq_len=256,
            note="Llama-3-8B attention (32 query heads, 8 K/V heads, head dim 128), small hidden/MLP/vocab"),
    HFModel("mistral_mqa_window", "mistral", heads=32, kv_heads=1, head_dim=128, hidden=128, intermediate=256,
            vocab=1024, layers=2, window=64, rope_theta=10000.0, batch=2, seq_len=256,
            note="Mistral architecture with MQA (1 K/V head) and a 64-token sliding window"),
]


def build_models(spec: HFModel, seed: int):
    """(fp16 model, float32 copy with the same fp16-rounded weights, q/k projection std)."""
    import torch

    from mqa_byoc.models import hf

    m16 = hf.build_hf_model(spec.config(), dtype="float16", seed=seed, std=INIT_STD)
    qk_std = math.sqrt(spec.score_std / spec.hidden)
    with torch.no_grad():
        for name, p in m16.named_parameters():
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                p.copy_((p.float() * (qk_std / INIT_STD)).to(p.dtype))
        if spec.sinks:
            gen = torch.Generator().manual_seed(seed + 1)
            for layer in m16.model.layers:
                s = layer.self_attn.sinks
                s.copy_((SINK_STD * torch.randn(s.shape, generator=gen)).to(s.dtype))
    m32 = copy.deepcopy(m16).float()
    return m16, m32, qk_std


def eager(model, mode: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """``model`` run by import_hf's own export wrapper (so exactly the exported function), float32
    numpy outputs: ``[logits, k_0, v_0, ...]``."""
    import torch

    from mqa_byoc.models import hf

    wrapper = hf.export_wrapper(model, mode, model.config.num_hidden_layers, True).eval()
    dt = next(model.parameters()).dtype
    args = [torch.from_numpy(np.ascontiguousarray(inputs[0]))]
    args += [torch.from_numpy(np.ascontiguousarray(a)).to(dt) for a in inputs[1:]]
    with torch.no_grad():
        out = wrapper(*args)
    return [o.float().numpy() for o in out]


def eager_deterministic(model, mode, inputs) -> list[np.ndarray]:
    a, b = eager(model, mode, inputs), eager(model, mode, inputs)
    if not all(np.array_equal(x, y) for x, y in zip(a, b)):
        raise RuntimeError(f"{mode}: two eager runs of the same model on the same inputs differ")
    return a
