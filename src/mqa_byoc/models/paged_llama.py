"""A small Llama-style decoder written TVM's way: ``relax.frontend.nn`` with a ``PagedKVCache``.

The model the paged-attention pass (:mod:`mqa_byoc.compiler.paged`) is shown on: embedding, ``layers``
x (RMSNorm, fused QKV projection, attention through ``PagedKVCache.attention_with_fused_qkv``
(RoPE applied by the cache on append, TVM's ``RopeMode.NORMAL``), output projection, RMSNorm, SwiGLU
MLP), final RMSNorm, LM head. The K/V live in TVM's pages; the cache is made by
``create_paged_kv_cache`` (a :class:`TIRPagedKVCache`, i.e. ``vm.builtin.paged_attention_kv_cache_create``
with TVM's TIR attention kernels, which the pass may swap for FA2).

Exported functions (:func:`export_paged_llama`): ``create_paged_kv_cache``, ``prefill`` (tokens of all
sequences as (1, total_len); logits of every position), ``batch_prefill`` (the same tokens and each
sequence's last position: the logits of those positions only, as mlc-llm's ``batch_prefill`` serves a
prompt), ``decode`` ((batch, 1)), ``attend`` (layer 0's attention on a given
fused QKV: what the numerics tests compare) — driven like mlc-llm does, with
``vm.builtin.kv_state_add_sequence`` / ``kv_state_begin_forward`` / ``kv_state_end_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache


@dataclass(frozen=True)
class PagedLlamaConfig:
    """Shapes of :class:`PagedLlama` (defaults: CodeLlama-34B heads, GQA 64/8, d=128, 2 layers)."""

    num_q_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 1024
    intermediate: int = 2048
    layers: int = 2
    vocab: int = 1024
    dtype: str = "float16"
    rope_theta: float = 10000.0
    rope_mode: int = int(RopeMode.NORMAL)

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5


def _reduce_shards(x: nn.Tensor, shards: int) -> nn.Tensor:
    """The sum over the tensor-parallel shards of a row-parallel projection's partial output."""
    return op.ccl_allreduce(x, "sum") if shards > 1 else x


class _Attention(nn.Module):
    def __init__(self, c: PagedLlamaConfig, shards: int = 1):
        self.c = c
        self.shards = shards
        self.qkv_proj = nn.Linear(c.hidden, (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_q_heads * c.head_dim, c.hidden, bias=False)

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer_id: int):
        c = self.c
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, c.num_q_heads + 2 * c.num_kv_heads, c.head_dim))
        out = cache.attention_with_fused_qkv(layer_id, qkv, c.num_q_heads, sm_scale=c.sm_scale)
        return _reduce_shards(self.o_proj(op.reshape(out, (b, s, c.num_q_heads * c.head_dim))), self.shards)


class _Layer(nn.Module):
    def __init__(self, c: PagedLlamaConfig, shards: int = 1):
        self.shards = shards
        self.attn_norm = nn.RMSNorm(c.hidden, -1, 1e-5, bias=False)
        self.attn = _Attention(c, shards)
        self.mlp_norm = nn.RMSNorm(c.hidden, -1, 1e-5, bias=False)
        self.gate_up = nn.Linear(c.hidden, 2 * c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer_id: int):
        x = x + self.attn(self.attn_norm(x), cache, layer_id)
        gate, up = op.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
        return x + _reduce_shards(self.down(op.silu(gate) * up), self.shards)


class PagedLlama(nn.Module):
    """Llama-style decoder over a TVM ``PagedKVCache`` (see the module docstring); with ``shards > 1``
    one tensor-parallel shard of it, ``c`` being the shard's config
    (:func:`mqa_byoc.tp.sharding.shard_config`): an all-reduce after ``o_proj`` and after ``down``."""

    def __init__(self, c: PagedLlamaConfig, shards: int = 1):
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList([_Layer(c, shards) for _ in range(c.layers)])
        self.norm = nn.RMSNorm(c.hidden, -1, 1e-5, bias=False)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def _hidden(self, ids: nn.Tensor, cache: PagedKVCache):
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i)
        return x

    def _run(self, ids: nn.Tensor, cache: PagedKVCache):
        return self.lm_head(self.norm(self._hidden(ids, cache)))

    def prefill(self, ids: nn.Tensor, cache: PagedKVCache):
        """Logits of every token; ``ids`` (1, total_len): the new tokens of all sequences, concatenated."""
        return self._run(ids, cache), cache

    def batch_prefill(self, ids: nn.Tensor, logit_positions: nn.Tensor, cache: PagedKVCache):
        """Logits of the positions ``logit_positions`` ((batch,) int32 indices into the total_len tokens,
        each sequence's last) only: (1, batch, vocab). The LM head and the final norm run on those rows
        alone, so a prompt of n tokens costs one GEMV of the LM head instead of an n-row GEMM."""
        x = op.take(self._hidden(ids, cache), logit_positions, axis=1)
        return self.lm_head(self.norm(x)), cache

    def decode(self, ids: nn.Tensor, cache: PagedKVCache):
        """Logits of one new token per sequence; ``ids`` (batch, 1)."""
        return self._run(ids, cache), cache

    def attend(self, qkv: nn.Tensor, cache: PagedKVCache):
        """Layer 0's paged attention alone: ``qkv`` (b, s, H + 2 H_kv, D) -> (b, s, H, D)."""
        c = self.c
        return cache.attention_with_fused_qkv(0, qkv, c.num_q_heads, sm_scale=c.sm_scale), cache

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                              support_sliding_window: tirx.Var) -> PagedKVCache:
        c = self.c
        return TIRPagedKVCache(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, c.layers]), num_hidden_layers=c.layers,
            num_attention_heads=c.num_q_heads, num_key_value_heads=c.num_kv_heads, qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
            rope_mode=RopeMode(c.rope_mode), rope_scale=1, rope_theta=c.rope_theta, rope_scaling={},
            rope_ext_factors=rx.prim_value(0), rotary_dim=c.head_dim, enable_disaggregation=False,
            dtype=c.dtype, target=tvm.target.Target.current(),
        )


def export_paged_llama(c: PagedLlamaConfig, target=None, *, tensor_parallel_shards: int = 1):
    """``(IRModule, named parameters)`` of :class:`PagedLlama` (``nn.Module.export_tvm``), built under
    ``target`` (default cuda sm_90; TVM's paged kernels are generated for it).

    ``tensor_parallel_shards`` N > 1: the graph of one of N shards (:mod:`mqa_byoc.tp.sharding`; the same
    for every shard): its cache has ``H / N`` query and ``H_kv / N`` K/V heads, its projections the
    shard's rows / columns, and the outputs of ``o_proj`` and ``down`` are all-reduced. Raises
    :class:`mqa_byoc.tp.ShardingError` for a config that cannot be cut so."""
    from ..tp.sharding import shard_config

    shards = tensor_parallel_shards
    c = shard_config(c, shards)
    if target is None:
        target = {"kind": "cuda", "arch": "sm_90"}
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    cache = nn.spec.Object(object_type=PagedKVCache)
    qkv_heads = c.num_q_heads + 2 * c.num_kv_heads
    spec = {
        "prefill": {"ids": nn.spec.Tensor([1, "total_len"], "int32"), "cache": cache},
        "batch_prefill": {"ids": nn.spec.Tensor([1, "total_len"], "int32"),
                          "logit_positions": nn.spec.Tensor(["batch"], "int32"), "cache": cache},
        "decode": {"ids": nn.spec.Tensor(["batch", 1], "int32"), "cache": cache},
        "attend": {"qkv": nn.spec.Tensor(["b", "s", qkv_heads, c.head_dim], c.dtype), "cache": cache},
        "create_paged_kv_cache": {
            "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int, "page_size": int,
            "support_sliding_window": int, "$": {"param_mode": "none", "effect_mode": "none"},
        },
    }
    for name in ("prefill", "batch_prefill", "decode"):
        spec[name]["$"] = {"param_mode": "packed", "effect_mode": "none"}
    spec["attend"]["$"] = {"param_mode": "none", "effect_mode": "none"}
    model = PagedLlama(c, shards)
    model.to(c.dtype)
    with target:
        return model.export_tvm(spec=spec, allow_extern=True)
