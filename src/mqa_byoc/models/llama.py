"""A Llama-family decoder and a single attention block in Relax, with selectable K/V expansion.

Built with the ``tvm.relax.frontend.nn`` Module API. The decoder is RMSNorm -> GQA attention with
RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual, repeated, then RMSNorm and the LM head; its
parameter names follow Hugging Face's (``layers.0.self_attn.o_proj.weight``, ...) except for the fused
projections.

Projections (``DecoderConfig.fused_projections``). Fused (default; mlc-llm's and TVM nn.llm's Llama),
x ``(B, S, hidden)``::

    qkv = R.matmul(x, R.permute_dims(qkv_proj.weight))           # (B, S, (H + 2 H_kv) * D)
    q, k, v = R.split(qkv, [H * D, (H + H_kv) * D], axis=-1)
    q = R.reshape(q, (B, S, H, D)); k = R.reshape(k, (B, S, H_kv, D)); v = ...
    gate, up = R.split(R.matmul(x, R.permute_dims(gate_up_proj.weight)), 2, axis=-1)
    mlp = down_proj(R.nn.silu(gate) * up)

With ``build_decoder(fused_rope=True)`` (the default) the split, the reshapes and RoPE on q and k are
one TIR kernel instead (:func:`mqa_byoc.models.rope.split_rope`, the same values)::

    q, k, v = R.call_tir(split_rope, (qkv, inv_freq, past_len), out=[(B, S, H, D), (B, S, H_kv, D), ...])

``qkv_proj.weight`` stacks HF's q, k, v weights by rows (in that order), ``gate_up_proj.weight`` gate's
then up's (:data:`FUSED_PROJECTIONS`, :func:`params_by_name`). Separate (``fused_projections=False``,
Hugging Face's form): ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``, one matmul each.

Functions of the module from :func:`build_decoder` (weights trail the inputs, ``num_input`` attr):

- ``prefill(input_ids: (B, S) int32, *weights) -> (logits, caches)``
- ``decode(input_id: (B, 1) int32, past: caches, *weights) -> (logits, caches)``
- ``extend(input_ids: (B, S) int32, past: caches, *weights) -> (logits, caches)`` (only when asked:
  a chunk of S tokens after S_past cached ones)

``caches`` is a Relax tuple of 2 * num_layers tensors ``(k_0, v_0, k_1, v_1, ...)``, each
``(B, S_kv, H_kv, D)`` (BSNH, native K/V heads, RoPE already applied to K); functional: a call
returns new tensors with ``S_kv = S_past + S``. ``logits`` is float32, ``(B, S, V)`` with
``logits="all"``, ``(B, 1, V)`` (last position) with ``logits="last"``. B is the symbolic
``batch`` unless ``batch=`` is an int; S (``seq_len``) and S_past (``past_len``) are symbolic.

K/V expansion forms (``kv_expand=``); r = H / H_kv, q ``(B, S, H, D)``, k/v ``(B, S_kv, H_kv, D)``
after the cache concat (``R.concat((past_k, k), axis=1)``; in decode / extend the ``repeat`` and
``native`` forms then bind ``k = R.match_cast(k, R.Tensor((B, kv_len, H_kv, D)))`` to a fresh
symbolic ``kv_len``, see ``fresh_kv_len`` of :func:`build_decoder`); every form returns
``(B, S, H, D)``, then the layer does ``R.reshape(o, (B, S, H * D))`` and the o projection. RoPE
(HF's non-interleaved ``rotate_half``) is applied to q and k in BSNH before all of this, with
cos/sin tables ``(1, S, 1, D)`` computed in float32 from ``R.arange(S_past, S_past + S)`` and cast
to the model dtype (or inside ``split_rope``, the same way).

``"repeat"`` (K/V repeated to H heads in BSNH, then TVM's fused attention op)::

    k = R.repeat(k, r, axis=2)                    # (B, S_kv, H, D), skipped when r == 1
    v = R.repeat(v, r, axis=2)
    o = R.nn.attention(q, k, v, scale=None, causal_mask="BottomRight", window_size=w)

``"native"`` (the target of the rewrite; no expansion, R.nn.attention with H_kv K/V heads)::

    o = R.nn.attention(q, k, v, scale=None, causal_mask="BottomRight", window_size=w)

  TVM's stock legalization of a grouped ``R.nn.attention`` is wrong (it does not group h // r):
  run ``mqa_byoc.LegalizeGroupedAttention()`` before building anything that is not offloaded.

``"repeat-chain"`` (mlc-llm 2023 Llama)::

    k = R.repeat(k, r, axis=2); v = R.repeat(v, r, axis=2)          # BSNH, skipped when r == 1
    q = R.permute_dims(q, [0, 2, 1, 3]); k = ...; v = ...            # BNSH (B, H, S, D)
    s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))                 # (B, H, S, S_kv)
    s = R.divide(s, R.const(sqrt(D), dtype))
    s = R.maximum(s, R.const(min_value(dtype), dtype))
    s = R.minimum(s, mask)                                           # mask (B, 1, S, S_kv)
    s = R.astype(s, "float32")                                       # only when dtype != f32
    p = R.nn.softmax(s, axis=-1)
    p = R.astype(p, dtype)                                           # only when dtype != f32
    o = R.matmul(p, v)                                               # (B, H, S, D)
    o = R.permute_dims(o, [0, 2, 1, 3])                              # (B, S, H, D)

  ``mask`` is built once per function: ``m = R.call_tir(make_causal_mask, [], (S, S_kv),
  tir_vars=...)`` with ``m[i, j] = min_value if j > i + S_kv - S (or, with a window w,
  j <= i + S_kv - S - w) else max_value``, then ``R.reshape(m, (1, 1, S, S_kv))`` and
  ``R.broadcast_to(.., (B, 1, S, S_kv))``.

``"hf-broadcast"`` (Hugging Face eager attention with ``repeat_kv``, as TVM's torch frontend emits
it, see :mod:`mqa_byoc.models.hf`)::

    q = R.permute_dims(q, [0, 2, 1, 3]); k = ...; v = ...            # BNSH
    k = R.expand_dims(k, axis=[2])                                   # (B, H_kv, 1, S_kv, D)
    k = R.broadcast_to(k, (B, H_kv, r, S_kv, D))
    k = R.reshape(k, (B, H, S_kv, D))                                # same for v; skipped r == 1
    kt = R.permute_dims(k, [0, 1, 3, 2])                             # (B, H, D, S_kv)
    a = R.reshape(R.broadcast_to(q, (B, H, S, D)), (B * H, S, D))    # aten.matmul -> bmm
    b = R.reshape(R.broadcast_to(kt, (B, H, D, S_kv)), (B * H, D, S_kv))
    s = R.reshape(R.matmul(a, b), (B, H, S, S_kv))
    s = R.multiply(s, R.const(D ** -0.5, dtype))
    s = R.add(s, mask)                                               # mask (1, 1, S, S_kv)
    s = R.astype(s, "float32")                                       # only when dtype != f32
    p = R.nn.softmax(s, axis=-1)
    p = R.astype(p, dtype)                                           # only when dtype != f32
    a = R.reshape(R.broadcast_to(p, (B, H, S, S_kv)), (B * H, S, S_kv))
    b = R.reshape(R.broadcast_to(v, (B, H, S_kv, D)), (B * H, S_kv, D))
    o = R.reshape(R.matmul(a, b), (B, H, S, D))
    o = R.permute_dims(o, [0, 2, 1, 3])                              # (B, S, H, D)

  ``mask`` is built once per function from ``R.arange`` positions: ``qp = arange(S_kv - S, S_kv)``,
  ``kp = arange(0, S_kv)`` (int64), ``ok = less_equal(kp[None, :], qp[:, None])`` (and, with a
  window, ``logical_and(ok, greater(kp[None, :], qp[:, None] - w))``), then
  ``R.where(R.reshape(ok, (1, 1, S, S_kv)), R.const(0, dtype), R.const(min_value(dtype), dtype))``.

All four forms compute the same function: causal attention aligned bottom-right (query i is
position ``S_kv - S + i``), softmax scale 1/sqrt(D), query head h reads K/V head h // r, and with
a sliding window w each query sees the w most recent keys including itself. ``window_size`` is
only emitted when the model has a sliding window (mistral-7b); TVM cannot legalize a windowed
``R.nn.attention`` on CPU (it asserts), so CPU runs of windowed models need an explicit-mask form
or ``sliding_window=False``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .attention_forms import KV_EXPAND_FORMS, attention, build_mask, emit_expr, nn_frontend, simplify_index  # noqa: F401
from .kv_caches import FRESH_LEN_FORMS, FunctionalKV
from .presets import DecoderConfig
from .rope import heads_with_rope, rope_ops, rope_tables, split_rope

KV_CACHES = ("functional", "inplace")


@dataclass(frozen=True)
class ParamInfo:
    """One weight of a built module: its name, shape and dtype (in the functions' argument order)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


# --------------------------------------------------------------------------------------------
# the decoder
# --------------------------------------------------------------------------------------------


def _make_module_classes(tensor_parallel_shards: int = 1):
    """The decoder's ``nn.Module`` classes; with ``tensor_parallel_shards > 1`` each is one shard's (its
    config already cut by :func:`mqa_byoc.tp.sharding.shard_config`): the outputs of the row-parallel
    o_proj and down_proj are summed over the shards by ``op.ccl_allreduce``."""
    nn, op = nn_frontend()

    def reduce_shards(x):
        return op.ccl_allreduce(x, "sum") if tensor_parallel_shards > 1 else x

    def linear(n_in, n_out, dtype):
        return nn.Linear(n_in, n_out, bias=False, dtype=dtype)

    class Attention(nn.Module):
        def __init__(self, cfg: DecoderConfig, dtype: str):
            self.cfg = cfg
            if cfg.fused_projections:
                self.qkv_proj = linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, dtype)
            else:
                self.q_proj = linear(cfg.hidden_size, cfg.q_size, dtype)
                self.k_proj = linear(cfg.hidden_size, cfg.kv_size, dtype)
                self.v_proj = linear(cfg.hidden_size, cfg.kv_size, dtype)
            self.o_proj = linear(cfg.q_size, cfg.hidden_size, dtype)

        def forward(self, x, rope_in, kv, mask, kv_expand, window):
            """``rope_in``: the (cos, sin) tables, or the first row's position for :func:`rope.split_rope`."""
            cfg = self.cfg
            b, s, _ = x.shape
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if not cfg.fused_projections:
                q, k, v = heads_with_rope(self.q_proj(x), self.k_proj(x), self.v_proj(x), rope_in, *heads)
            elif isinstance(rope_in, tuple):
                q, k, v = rope_ops(self.qkv_proj(x), rope_in, *heads)
            else:
                q, k, v = split_rope(self.qkv_proj(x), rope_in, *heads, cfg.rope_theta)
            k, v, k_out, v_out = kv.update(self, k, v)
            o = attention(q, k, v, kv_expand=kv_expand, mask=mask, window=window)
            o = op.reshape(o, (b, s, cfg.q_size))
            return reduce_shards(self.o_proj(o)), k_out, v_out

    class MLP(nn.Module):
        def __init__(self, cfg: DecoderConfig, dtype: str):
            self.fused = cfg.fused_projections
            if self.fused:
                self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size, dtype)
            else:
                self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, dtype)
                self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, dtype)
            self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, dtype)

        def forward(self, x):
            if self.fused:
                gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return reduce_shards(self.down_proj(op.multiply(op.silu(gate), up)))

    class Layer(nn.Module):
        def __init__(self, cfg: DecoderConfig, dtype: str):
            self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_eps, bias=False, dtype=dtype)
            self.self_attn = Attention(cfg, dtype)
            self.post_attention_layernorm = nn.RMSNorm(
                cfg.hidden_size, -1, cfg.rms_eps, bias=False, dtype=dtype
            )
            self.mlp = MLP(cfg, dtype)

        def forward(self, x, rope_in, kv, mask, kv_expand, window):
            a, k, v = self.self_attn(self.input_layernorm(x), rope_in, kv, mask, kv_expand, window)
            x = op.add(x, a)
            x = op.add(x, self.mlp(self.post_attention_layernorm(x)))
            return x, k, v

    class Decoder(nn.Module):
        def __init__(
            self, cfg: DecoderConfig, dtype: str, kv_expand: str, window, logits: str, fresh_kv_len,
            fused_rope: bool = True,
        ):
            self.cfg = cfg
            self.fused_rope = fused_rope and cfg.fused_projections
            self.fresh_kv_len = fresh_kv_len
            self.dtype = dtype
            self.kv_expand = kv_expand
            self.window = window
            self.logits_mode = logits
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList([Layer(cfg, dtype) for _ in range(cfg.num_layers)])
            self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_eps, bias=False, dtype=dtype)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

        def _run(self, input_ids, kv):
            """Logits and the per-layer cache outputs of ``kv.update`` (see :class:`FunctionalKV`)."""
            cfg = self.cfg
            b, s = input_ids.shape
            x = self.embed_tokens(input_ids)
            if self.fused_rope:
                rope_in = kv.past_len
            else:
                rope_in = rope_tables(kv.past_len, s, cfg.head_dim, cfg.rope_theta, self.dtype)
            mask = build_mask(
                self.kv_expand, b, s, kv.kv_len(s), self.dtype, "BottomRight", self.window
            )
            caches = []
            for layer in self.layers:
                x, k, v = layer(x, rope_in, kv, mask, self.kv_expand, self.window)
                caches += [k, v]
            if self.logits_mode == "last":
                from tvm import relax

                x = emit_expr(
                    relax.op.strided_slice(
                        x._expr, axes=[1], begin=[s - 1], end=[s], assume_inbound=True
                    ),
                    "last_hidden",
                )
            logits = self.lm_head(self.norm(x))
            if logits.dtype != "float32":
                logits = op.astype(logits, "float32")
            return logits, tuple(caches)

        def _functional(self, past):
            return FunctionalKV(past, self.fresh_kv_len and self.kv_expand in FRESH_LEN_FORMS)

        def prefill(self, input_ids):
            return self._run(input_ids, self._functional(None))

        def decode(self, input_id, past):
            return self._run(input_id, self._functional(past))

        def extend(self, input_ids, past):
            return self._run(input_ids, self._functional(past))

    class AttentionBlock(nn.Module):
        def __init__(self, kv_expand, causal_mask, window):
            self.kv_expand = kv_expand
            self.causal_mask = causal_mask
            self.window = window

        def forward(self, q, k, v):
            b, s, _, _ = q.shape
            mask = build_mask(
                self.kv_expand, b, s, k.shape[1], q.dtype, self.causal_mask, self.window
            )
            return attention(
                q,
                k,
                v,
                kv_expand=self.kv_expand,
                mask=mask,
                causal_mask=self.causal_mask,
                window=self.window,
            )

    return Decoder, AttentionBlock


def _check_common(kv_expand: str, dtype: str):
    if kv_expand not in KV_EXPAND_FORMS:
        raise ValueError(f"kv_expand must be one of {KV_EXPAND_FORMS}, got {kv_expand!r}")
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")


def build_decoder(
    config: DecoderConfig,
    *,
    dtype: str = "float16",
    kv_expand: str = "repeat",
    batch: int | None = None,
    num_layers: int | None = None,
    sliding_window: bool | int | None = True,
    logits: str = "last",
    functions: Sequence[str] = ("prefill", "decode"),
    fresh_kv_len: bool = True,
    kv_cache: str = "functional",
    tensor_parallel_shards: int = 1,
    fused_rope: bool = True,
):
    """Build the decoder as an IRModule; returns ``(mod, param_spec)``.

    ``param_spec`` is a list of :class:`ParamInfo` in the order the weights trail the inputs of
    every function (see the module docstring for the functions and the graph forms). The projections
    are fused (``qkv_proj``, ``gate_up_proj``) or separate as ``config.fused_projections`` says.

    - ``batch``: None for a symbolic batch, or a static int.
    - ``num_layers``: overrides ``config.num_layers`` (e.g. ``config.max_layers_default``).
    - ``sliding_window``: True uses the config's window, False/None drops it, an int sets one.
    - ``logits``: "last" (prefill returns the last position only) or "all".
    - ``functions``: any of "prefill", "decode", "extend".
    - ``fresh_kv_len``: for the ``repeat`` / ``native`` forms in decode / extend, bind each
      concatenated cache to a fresh symbolic length ``kv_len`` with
      ``R.match_cast(R.concat((past, new), axis=1), R.Tensor((B, kv_len, H_kv, D)))`` (what a
      KV-cache view gives in mlc-llm); the caches are still returned from the concat, with
      length ``past_len + S``. Without it, S_kv is the expression ``past_len + S`` and
      TVM's TE legalization of ``R.nn.attention`` (CPU, or any non-offloaded build) fails with
      "shapes of x and y are inconsistent". The explicit-mask forms never need it.
    - ``kv_cache``: "functional" (K/V tensors in and out, above) or "inplace" (TVM's in-place
      cache objects, batch 1, plus a ``create_kv_cache`` function; see
      :mod:`mqa_byoc.models.kv_caches`; ``fresh_kv_len`` then binds each cache view).
    - ``tensor_parallel_shards``: N > 1 builds the graph of one of N tensor-parallel shards (the same
      graph for every shard; :mod:`mqa_byoc.tp.sharding`): ``H / N`` query and ``H_kv / N`` K/V heads,
      ``intermediate_size / N`` MLP width, an all-reduce (``op.ccl_allreduce``, run by TVM's disco) after
      o_proj and after down_proj; ``param_spec`` then has the shard's shapes, the caches its K/V heads.
      Raises :class:`mqa_byoc.tp.ShardingError` for a model that cannot be cut so (e.g. H_kv < N).
    - ``fused_rope``: with fused projections, split qkv and apply RoPE in one TIR kernel a layer
      (:func:`mqa_byoc.models.rope.split_rope`; default), or with Relax ops (``R.split``, reshapes,
      ``x * cos + rotate_half(x) * sin`` with tables computed per call; the module docstring's form).
      Both compute the same values; the kernel saves four launches a layer and three a call.
    """
    _check_common(kv_expand, dtype)
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    if kv_cache == "inplace" and batch not in (None, 1):
        raise ValueError(f"the in-place cache has no batch axis: batch must be 1, got {batch}")
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    bad = set(functions) - {"prefill", "decode", "extend"}
    if bad or not functions:
        raise ValueError(f"unknown functions {sorted(bad)}; use prefill / decode / extend")
    if num_layers is not None:
        config = config.replace(num_layers=num_layers)
    from ..tp.sharding import shard_config

    config = shard_config(config, tensor_parallel_shards)
    if sliding_window is True:
        window = config.sliding_window
    elif sliding_window is False or sliding_window is None:
        window = None
    else:
        window = int(sliding_window)
    nn, _ = nn_frontend()
    Decoder, _ = _make_module_classes(tensor_parallel_shards)
    if kv_cache == "inplace":
        from . import kv_caches

        model = kv_caches.inplace_decoder_class(Decoder)(
            config, dtype, kv_expand, window, logits, fresh_kv_len, fused_rope
        )
        kv_caches.attach_caches(model, config, dtype)
        mod, params = model.export_tvm(spec=kv_caches.method_specs(functions))
        mod = kv_caches.with_create_function(
            mod, config.num_layers, config.num_kv_heads, config.head_dim, dtype
        )
        return mod, [ParamInfo(n, tuple(int(x) for x in p.shape), str(p.dtype)) for n, p in params]
    model = Decoder(config, dtype, kv_expand, window, logits, fresh_kv_len, fused_rope)
    bdim = "batch" if batch is None else int(batch)
    cache = nn.spec.Tensor([bdim, "past_len", config.num_kv_heads, config.head_dim], dtype)
    past = [cache] * (2 * config.num_layers)
    specs = {
        "prefill": {"input_ids": nn.spec.Tensor([bdim, "seq_len"], "int32")},
        "decode": {"input_id": nn.spec.Tensor([bdim, 1], "int32"), "past": past},
        "extend": {"input_ids": nn.spec.Tensor([bdim, "seq_len"], "int32"), "past": past},
    }
    mod, params = model.export_tvm(spec={f: specs[f] for f in functions})
    spec = [ParamInfo(name, tuple(int(x) for x in p.shape), str(p.dtype)) for name, p in params]
    return mod, spec


def build_attention_block(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    kv_expand: str = "repeat",
    dtype: str = "float16",
    mode: str = "prefill",
    batch: int | None = None,
    seq_len: int | None = None,
    kv_len: int | None = None,
    causal_mask: str | None = "BottomRight",
    sliding_window: int | None = None,
    func_name: str = "main",
):
    """One attention in form ``kv_expand`` with q/k/v as inputs; returns an IRModule.

    ``func_name(q: (B, S, H, D), k: (B, S_kv, H_kv, D), v: (B, S_kv, H_kv, D)) -> (B, S, H, D)``,
    no weights. Shapes by ``mode``:

    - ``"prefill"``: S_kv = S (one symbolic ``seq_len``, or ``seq_len=`` int);
    - ``"decode"``: S = 1, S_kv symbolic ``kv_len`` (or ``kv_len=`` int);
    - ``"extend"``: S (``seq_len``) and S_kv (``kv_len``) independent, S <= S_kv at run time.

    ``causal_mask``: "BottomRight" (default), "TopLeft" or None; ``sliding_window``: None or w.
    For the explicit-mask forms the mask is built inside the function (see the module docstring).
    """
    _check_common(kv_expand, dtype)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if causal_mask not in (None, "BottomRight", "TopLeft"):
        raise ValueError(f"causal_mask must be None, 'BottomRight' or 'TopLeft', got {causal_mask!r}")
    nn, _ = nn_frontend()
    _, AttentionBlock = _make_module_classes()
    bdim = "batch" if batch is None else int(batch)
    sdim = "seq_len" if seq_len is None else int(seq_len)
    kdim = "kv_len" if kv_len is None else int(kv_len)
    if mode == "prefill":
        q_s, kv_s = sdim, sdim
    elif mode == "decode":
        q_s, kv_s = 1, kdim
    elif mode == "extend":
        q_s, kv_s = sdim, kdim
    else:
        raise ValueError(f"mode must be prefill, decode or extend, got {mode!r}")
    block = AttentionBlock(kv_expand, causal_mask, sliding_window)
    spec = {
        "forward": {
            "q": nn.spec.Tensor([bdim, q_s, num_heads, head_dim], dtype),
            "k": nn.spec.Tensor([bdim, kv_s, num_kv_heads, head_dim], dtype),
            "v": nn.spec.Tensor([bdim, kv_s, num_kv_heads, head_dim], dtype),
        }
    }
    mod, _ = block.export_tvm(spec=spec)
    if func_name != "forward":
        import tvm

        # keep the GlobalVar objects: the calls of the mask PrimFunc refer to them
        funcs = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "forward"}
        funcs[tvm.ir.GlobalVar(func_name)] = mod["forward"].with_attr("global_symbol", func_name)
        mod = tvm.IRModule(funcs, attrs=mod.attrs)
    return mod


# --------------------------------------------------------------------------------------------
# weights, caches, a numpy reference
# --------------------------------------------------------------------------------------------


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


#: each fused projection and the separate (Hugging Face) weights it stacks by rows, in this order
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def params_by_name(param_spec: Sequence[ParamInfo], get: Callable[[str], np.ndarray]) -> list[np.ndarray]:
    """The weights of ``param_spec``, in order and in its dtypes, from ``get(name)``, which knows the
    separate-projection names (Hugging Face's: ``layers.0.self_attn.q_proj.weight``, ...): a fused
    weight (``...qkv_proj.weight``) is its parts' rows stacked (:data:`FUSED_PROJECTIONS`). So one set of
    weights runs both graph forms. Raises ValueError on a shape that does not match the spec."""
    out = []
    for p in param_spec:
        module, _, leaf = p.name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        if proj in FUSED_PROJECTIONS:
            x = np.concatenate([np.asarray(get(f"{prefix}.{part}.{leaf}")) for part in FUSED_PROJECTIONS[proj]])
        else:
            x = np.asarray(get(p.name))
        if tuple(x.shape) != tuple(p.shape):
            raise ValueError(f"{p.name}: weight shape {tuple(x.shape)} != spec shape {p.shape}")
        out.append(x.astype(_np_dtype(p.dtype)))
    return out


def random_params(
    param_spec: Sequence[ParamInfo], *, seed: int = 0, std: float = 0.02
) -> list[np.ndarray]:
    """Seeded random weights for ``param_spec``, in order, as numpy arrays of each weight's dtype.

    Matrices ~ N(0, std^2) (std 0.02, the HF init: fp16 stays far from overflow even at real
    widths); RMSNorm weights (names ending in ``norm.weight``) ~ 1 + N(0, std^2). bfloat16 arrays
    use ``ml_dtypes.bfloat16``. One seed gives the fused and the separate projections different
    weights; to run both forms on the same ones, draw the separate form's and map them with
    :func:`params_by_name`.
    """
    rng = np.random.default_rng(seed)
    out = []
    for p in param_spec:
        x = rng.standard_normal(p.shape, dtype=np.float32)
        x *= std
        if p.name.endswith("norm.weight"):
            x += 1.0
        out.append(x.astype(_np_dtype(p.dtype)))
    return out


def random_caches(
    config: DecoderConfig,
    batch: int,
    past_len: int,
    *,
    dtype: str = "float16",
    seed: int = 0,
    std: float = 1.0,
    num_layers: int | None = None,
) -> list[np.ndarray]:
    """``2 * num_layers`` random cache tensors ``(batch, past_len, H_kv, D)`` for ``decode``."""
    rng = np.random.default_rng(seed)
    n = config.num_layers if num_layers is None else num_layers
    shape = (batch, past_len, config.num_kv_heads, config.head_dim)
    return [
        (rng.standard_normal(shape, dtype=np.float32) * std).astype(_np_dtype(dtype))
        for _ in range(2 * n)
    ]


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal_mask: str | None = "BottomRight",
    window: int | None = None,
    scale: float | None = None,
) -> np.ndarray:
    """Numpy (float64) attention with native K/V heads: q ``(B, S, H, D)``, k/v ``(B, S_kv, H_kv, D)``.

    Query head h uses K/V head ``h // (H / H_kv)``; BottomRight: query i is position
    ``S_kv - S + i`` and sees keys ``j <= that``; a window w also requires ``j > position - w``.
    Returns ``(B, S, H, D)`` float32.
    """
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    _, s, h, d = q64.shape
    skv, hkv = k64.shape[1], k64.shape[2]
    r = h // hkv
    kh = k64[:, :, np.arange(h) // r, :]  # (B, S_kv, H, D)
    vh = v64[:, :, np.arange(h) // r, :]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = np.einsum("bshd,bthd->bhst", q64, kh) * scale
    if causal_mask is not None:
        offset = skv - s if causal_mask == "BottomRight" else 0
        pos = np.arange(s)[:, None] + offset
        j = np.arange(skv)[None, :]
        allowed = j <= pos
        if window is not None:
            allowed &= j > pos - window
        scores = np.where(allowed[None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhst,bthd->bshd", p, vh).astype(np.float32)
