"""Facts read off a Hugging Face decoder config, shared by the export routes (:mod:`.hf`,
:mod:`.hf_static`). No torch, transformers or TVM import."""

from __future__ import annotations


def cache_heads_and_dim(cfg) -> tuple[int, int]:
    """Heads and head dim of the K/V cache an HF decoder keeps: ``num_key_value_heads`` (Llama and most);
    one head with ``multi_query`` (Falcon-7B, GPTBigCode); else one per query head (Falcon's new decoder
    architecture broadcasts its ``num_kv_heads`` to every query head before it caches them)."""
    if getattr(cfg, "num_key_value_heads", None):
        hkv = cfg.num_key_value_heads
    elif getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        hkv = 1
    else:
        hkv = cfg.num_attention_heads
    return hkv, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
