"""Hugging Face decoders with random weights, exported with ``torch.export`` and imported into Relax.

Nothing is downloaded: the model is built from a ``LlamaConfig`` / ``MistralConfig`` with random
weights. Needs ``torch`` and ``transformers`` (the ``hf`` extra); tested with torch 2.13 and
transformers 5.x.

Pipeline (what :func:`import_hf` does; a user with a real checkpoint runs the same steps)::

    model = LlamaForCausalLM.from_pretrained(..., torch_dtype=torch.float16,
                                             attn_implementation="eager")   # or "sdpa"
    ep = torch.export.export(Wrapper(model), (input_ids,), dynamic_shapes=...)
    mod = from_exported_program(ep, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                custom_convert_map=native_dtype_convert_map())
    #   (native_dtype_convert_map() includes fixes_convert_map(): cat / cumsum frontend fixes)
    mod, params = relax.frontend.detach_params(mod)
    mod = mqa_byoc.partition_for_cutlass(mod, mqa=True)

The standard path (no convert map of ours; ``import_hf(..., convert="standard", mixed_precision=True)``)
--------------------------------------------------------------------------------------------------------
A user who knows nothing of this module exports the model, imports it with plain
``from_exported_program(ep)`` and runs ``relax.transform.ToMixedPrecision(out_dtype="float16")``
(the reject reason of a float32 attention names it). Every layer's attention is then offloaded
(Llama GQA / Mistral MQA, eager / sdpa, prefill / decode, static / dynamic shapes), with two
limits of TVM's frontend that no partition can lift, since the import itself fails:

- HF's ``DynamicCache`` starts each layer from a 1-D ``torch.tensor([])``; torch.cat skips it,
  the frontend's concat rejects it ("Concat expects all input tensors to have same ndim"). Export
  without a cache (``use_cache=False``, prefill only) or store each layer's first K/V without the
  concat (:func:`_seed_cache`, what ``convert="standard"`` does; a zero-length 4-D start imports
  but its zero-extent loops fail TVM's CUDA build).
- An fp16 model gets float32 matmuls, so its new K/V are float32 and concatenating them onto an fp16
  past fails ("Concat expects all input tensors to have the same dtype"): an fp16 model takes the
  standard path for prefill only; export the float32 model for decode.

Multi-head latent attention (DeepSeek-V3, MiniCPM3) writes its key slice by slice, which imports as
``R.slice_scatter``, and ``ToMixedPrecision`` fails on that op: import with ``convert="fixes"`` (the
standard path plus :func:`fixes_convert_map`, which makes it a ``concat``). DeepSeek-V2's and Llama 4's
complex rotary embeddings import only through that map too (complex tensors as their real and imaginary parts).

Without a cache HF's mask adds packed-sequence detection, whose ``cumsum`` of bools the frontend
types bool (LLVM cannot compile it; the original graph does not build); the mask evaluator computes
it (it checks the input is all False, where every reading of a bool cumsum agrees) and the offloaded
graph no longer contains it. A dynamic ``Dim.AUTO`` that torch.export pins (a sliding-window
decode's past length) reaches TVM as a variable named after its value; :func:`import_hf` binds it.

fp16: what the frontend emits, and how to get fp16 attention
-------------------------------------------------------------
``from_exported_program`` converts ``aten.mm`` / ``bmm`` / ``matmul`` / ``linear`` to
``R.matmul(.., out_dtype="float32")`` whatever the input dtype. In an fp16 model every projection
therefore returns float32, the frontend's dtype promotion inserts ``R.astype(.., "float32")`` on the
other operands, and the whole attention chain (q, k, v, scores, softmax, p @ v, o_proj) runs in
float32 until the next explicit ``.to(fp16)`` (the RMSNorm's ``to(input_dtype)``). FA2 needs
fp16/bf16 inputs, so that graph cannot be offloaded as is. Two ways out:

1. (recommended) ``custom_convert_map=native_dtype_convert_map()``: ``mm``/``bmm``/``matmul``/
   ``linear`` keep their input dtype (``out_dtype=None``), so the Relax graph has exactly torch's
   dtypes: q/k/v, RoPE, repeat_kv, ``q @ k^T``, scale, mask add in fp16, then
   ``astype(f32) -> softmax -> astype(f16)`` (eager: HF's ``softmax(dtype=float32).to(q.dtype)``),
   ``p @ v`` in fp16. Caveat: the non-attention matmuls are then fp16 in, fp16 out (the accumulator
   precision is up to TVM's lowering / cuBLAS).
2. Import as is and run ``relax.transform.ToMixedPrecision(out_dtype="float16")``: the matmuls
   become fp16 in / fp16 out, but the elementwise ops only follow their inputs, so the RoPE (its
   cos/sin tables are float32 in the float32-compute graph) keeps q and k in float32: K is
   expanded (expand_dims / broadcast_to / reshape) in float32 while V is expanded in fp16, and
   ``R.astype(.., "float16")`` appears right before each attention matmul; softmax stays float32
   with an ``astype`` in front of ``p @ v``. It works numerically but the attention chain is
   interleaved with casts, so the pattern canonicalizer would have to look through them.
   See ``docs/hf_graph_forms.md`` for the printed IR.

For ``attn_implementation="sdpa"`` the picture differs: ``run_decompositions`` (on by default in
``from_exported_program``) lowers ``aten.scaled_dot_product_attention`` with a boolean mask into
its math form and, for fp16 on CPU, that decomposition itself upcasts q/k/v to float32 (so even
with the native-dtype map the sdpa chain is float32 between ``astype`` casts; exporting on a CUDA
device may decompose differently — not checked here, no GPU used). With
``run_ep_decomposition=False`` the import fails (``to.device``, and without a cache ``diff.default``,
have no converter), and the frontend's own sdpa converter (which would emit ``R.nn.attention``
with a bias) asserts on HF's boolean mask: it only takes float masks.

The graph forms (one layer; B batch, S query length, S_kv = S_past + S, H heads, H_kv K/V heads,
r = H / H_kv, D head dim, dt the model dtype with the native-dtype map; printed IR in
docs/hf_graph_forms.md)
----------------------------------------------------------------------------------------------

Mask, built once per forward and shared by all layers (``masking_utils.create_causal_mask``), with
the default ``use_cache=True`` (prefill through a fresh ``DynamicCache``, and decode)::

    q_idx = expand_dims(arange(S_past, S_past + S) ...)       # (1, 1, S, 1) int64
    kv_idx = expand_dims(arange(0, S_kv) ...)                 # (1, 1, 1, S_kv) int64
    ok = R.less_equal(kv_idx, q_idx)                          # (1, 1, S, S_kv) bool
    # Mistral (window w): ok = bitwise_and(bitwise_and(True, greater(kv_idx, q_idx - w)),
    #                                      less_equal(kv_idx, q_idx))
    ok = R.broadcast_to(ok, (B, 1, S, S_kv))
    eager: mask = R.where(ok, R.full((), 0, dt), R.const(finfo(dt).min, dt))   # (B, 1, S, S_kv)
    sdpa:  the bool ``ok`` goes into each layer's attention, which starts with
           mask = R.where(ok, R.const(0, dt), R.const(-inf, dt))

With ``use_cache=False`` HF also detects packed sequences from the position ids (``diff``,
``cumsum``, ``index_tensor``, ``equal``, ``bitwise_and`` on top of the above). Either way the mask
is an opaque tensor to the attention: proving it causal means matching this preamble (or
trusting that the model is a causal decoder).

repeat_kv (both implementations; q/k/v are BNSH after ``view -> transpose(1, 2)`` and RoPE)::

    k = R.expand_dims(k, axis=[2])                      # (B, H_kv, 1, S_kv, D)
    k = R.broadcast_to(k, R.shape([B, H_kv, r, S_kv, D]))
    k = R.reshape(k, R.shape([B, H, S_kv, D]))          # same for v; absent when r == 1

  In decode, ``R.concat((past_k, k_new), axis=-2)`` (BNSH caches) comes first.

eager attention (``eager_attention_forward``)::

    kt = R.permute_dims(k, axes=[0, 1, 3, 2])                            # (B, H, D, S_kv)
    a  = R.reshape(R.broadcast_to(q, (B, H, S, D)), (B*H, S, D))        # aten.matmul -> bmm
    b  = R.reshape(R.broadcast_to(kt, (B, H, D, S_kv)), (B*H, D, S_kv))
    s  = R.reshape(R.matmul(a, b), (B, H, S, S_kv))
    s  = R.multiply(s, R.const(D ** -0.5, dt))
    s  = R.add(s, mask)                                                  # (B, 1, S, S_kv)
    s  = R.astype(s, "float32")            # fp16 only
    p  = R.nn.softmax(s, axis=-1)
    p  = R.astype(p, dt)                   # fp16 only
    a  = R.reshape(R.broadcast_to(p, (B, H, S, S_kv)), (B*H, S, S_kv))
    b  = R.reshape(R.broadcast_to(v, (B, H, S_kv, D)), (B*H, S_kv, D))
    o  = R.reshape(R.matmul(a, b), (B, H, S, D))
    o  = R.permute_dims(o, axes=[0, 2, 1, 3])                            # transpose(1, 2)
    o  = R.reshape(o, (B, S, H*D))                                       # -> o_proj

  (dropout(p=0) vanishes; with the frontend's default float32 matmuls, dt is float32 from the q/k/v
  projections on, the mask gets an ``astype(f32)``, and the softmax is followed by
  ``astype(f16)`` then ``astype(f32)`` again before ``p @ v``.)

sdpa attention (``aten.scaled_dot_product_attention(q, k, v, ok, scale=D**-0.5)`` decomposed by
``run_decompositions``; the scale is applied as sqrt(scale) on each side)::

    mask = R.where(ok, R.const(0, dt), R.const(-inf, dt))            # (B, 1, S, S_kv)
    q = R.astype(q, "float32"); k = ...; v = ...       # fp16: the CPU math decomposition upcasts
    qs = R.multiply(q, R.const(D ** -0.25, "float32"))
    kt = R.multiply(R.permute_dims(k, [0, 1, 3, 2]), R.const(D ** -0.25, "float32"))
    s  = bmm(qs, kt) as above -> (B, H, S, S_kv)
    s  = R.add(s, R.astype(mask, "float32"))
    p  = R.nn.softmax(s, axis=-1)
    # fully-masked-row fix-up:
    alive = R.astype(R.max(R.astype(R.logical_not(R.equal(s, -inf)), "int8"), axis=[-1],
                           keepdims=True), "bool")
    p  = R.where(R.logical_not(alive), R.full_like(p, 0), p)
    o  = bmm(p, v) -> (B, H, S, D)
    o  = R.astype(o, dt)                               # fp16 only
    o  = R.permute_dims(o, [2, 0, 1, 3]); o = R.permute_dims(o, [1, 2, 0, 3])  # (identity)
    o  = R.permute_dims(o, [0, 2, 1, 3]); o = R.reshape(o, (B, S, H*D))

Decode step: exported with past K/V as explicit inputs, ``(B, H_kv, S_past, D)`` each (HF's
BNSH cache layout), in the order ``k_0, v_0, k_1, v_1, ...``; the wrapper fills a fresh
``DynamicCache`` with them and returns ``(logits, k_0', v_0', ...)``, S_past + 1 positions each
(for Mistral, HF's sliding-window cache layers keep only the last w - 1 positions, so the
returned caches are cropped). A hybrid model (GPT-OSS, Gemma 2: sliding-window and full-attention
layers) takes per-layer past lengths, w - 1 for its sliding layers after a longer prompt
(:func:`decode_past_lengths`); its new token's position is the full layers' past length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .convert_maps import fixes_convert_map, native_dtype_convert_map
from .presets import DecoderConfig


def _torch():
    import torch

    return torch


# how import_hf calls from_exported_program (see its docstring)
CONVERTS = ("native", "fixes", "standard")


class HFImport(NamedTuple):
    """What :func:`import_hf` returns (unpacks as ``mod, params, reference``)."""

    mod: object  # tvm.IRModule, function "main"; weights trail the inputs (attr num_input)
    params: list  # numpy arrays, in the order of main's weight parameters
    reference: Callable[..., np.ndarray]  # torch eager logits for the same inputs (numpy)


def make_hf_config(
    kind: str = "llama",
    *,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    num_layers: int = 2,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-6,
    sliding_window: int | None = None,
    max_position_embeddings: int = 4096,
    attn_implementation: str = "eager",
):
    """A ``LlamaConfig`` (``kind="llama"``) or ``MistralConfig`` (``kind="mistral"``)."""
    from transformers import LlamaConfig, MistralConfig

    common = dict(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        rms_norm_eps=rms_eps,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        if sliding_window is not None:
            raise ValueError("LlamaConfig has no sliding window; use kind='mistral'")
        cfg = LlamaConfig(rope_theta=rope_theta, **common)
    elif kind == "mistral":
        cfg = MistralConfig(rope_theta=rope_theta, sliding_window=sliding_window, **common)
    else:
        raise ValueError(f"kind must be 'llama' or 'mistral', got {kind!r}")
    # rope_theta moved into rope_parameters in transformers 5; set both spellings
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = rope_theta
    cfg._attn_implementation = attn_implementation
    return cfg


def hf_config_from_decoder(config: DecoderConfig, *, attn_implementation: str = "eager"):
    """The HF config with the shapes of a :class:`DecoderConfig` (Mistral when it has a window)."""
    return make_hf_config(
        "mistral" if config.sliding_window is not None else "llama",
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        rope_theta=config.rope_theta,
        rms_eps=config.rms_eps,
        sliding_window=config.sliding_window,
        attn_implementation=attn_implementation,
    )


def build_hf_model(hf_config, *, dtype: str = "float32", seed: int = 0, std: float = 0.02):
    """``LlamaForCausalLM`` / ``MistralForCausalLM`` with seeded random weights, in eval mode."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hf_config, attn_implementation=hf_config._attn_implementation
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.eval().to(getattr(torch, dtype))


def params_from_hf(model, param_spec) -> list[np.ndarray]:
    """The weights of an HF Llama / Mistral model in :func:`mqa_byoc.models.llama.build_decoder`'s
    ``param_spec`` order, as numpy arrays of the spec's dtypes: HF's names without the ``model.``
    prefix; the fused ``qkv_proj`` / ``gate_up_proj`` weights are HF's q, k, v (gate, up) weights
    stacked by rows (:func:`~mqa_byoc.models.llama.params_by_name`). Lets the Relax decoder run a real
    (or this module's random) checkpoint. Raises ValueError on a shape that does not match."""
    from .llama import params_by_name

    sd = model.state_dict()

    def get(name):
        return sd[name if name.startswith("lm_head.") else f"model.{name}"].detach().float().numpy()

    return params_by_name(param_spec, get)


def _require_kv_cache_layers(model):
    """A clear error for a hybrid decoder (Qwen3-Next, Qwen3.5, LFM3, Bamba, Jamba, Granite 4): its cache
    holds recurrent state for its Mamba / linear-attention / convolution layers, not K/V, so the cached
    export (K/V in and out per layer) cannot be made; its prefill imports without a cache."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config this cache cannot read: the export says what is wrong
        return
    recurrent = [f"{i} ({type(layer).__name__})" for i, layer in enumerate(layers) if not hasattr(layer, "keys")]
    if recurrent:
        raise ValueError(
            f"{type(model).__name__} is a hybrid decoder: its cache layers {', '.join(recurrent[:4])}"
            f"{' ...' if len(recurrent) > 4 else ''} hold recurrent state, not K/V, which import_hf's cached "
            "export (K/V in and out per layer) cannot carry; import its prefill without a cache: "
            "import_hf(model, mode='prefill', use_cache=False, convert='fixes')")


def _seed_cache(cache):
    """Make the first ``update`` of every layer of a fresh ``DynamicCache`` store the given K/V as
    they are, instead of concatenating them onto HF's lazy 1-D ``torch.tensor([])``: TVM's frontend
    rejects that concat ("Concat expects all input tensors to have same ndim"), and a zero-length 4-D
    start instead leaves zero-extent loops that TVM's CUDA scheduling (dlight) cannot build. Later
    updates are HF's own. A sliding-window layer keeps the last w - 1 positions, as HF's does."""
    for layer in cache.layers:
        def first_update(key_states, value_states, *args, layer=layer, **kwargs):
            del layer.update  # HF's update from now on
            layer.lazy_initialization(key_states, value_states)
            if getattr(layer, "is_sliding", False):
                keep = layer.sliding_window - 1
                layer.cumulative_length += key_states.shape[-2]
                layer.keys, layer.values = key_states[:, :, -keep:, :], value_states[:, :, -keep:, :]
            else:
                layer.keys, layer.values = key_states, value_states
            return key_states, value_states

        layer.update = first_update


def cache_layer_shapes(model) -> list[tuple[tuple[int, int], tuple[int, int]] | None]:
    """Per layer, ``((heads, head dim) of its keys, (heads, head dim) of its values)`` as the model's
    ``DynamicCache`` holds them, read off a one-token forward: :func:`.hf_config.cache_heads_and_dim`
    twice for most decoders; what multi-head latent attention caches (DeepSeek-V3, MiniCPM3: one head of
    the compressed latent and one of the rotary key part, of different widths) is the model's own choice.
    None for a layer whose cache holds nothing: it attends to another layer's K/V (Gemma 4's KV-shared
    layers, ``num_kv_shared_layers``), which the exports then neither take nor return."""
    torch = _torch()
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    return [None if getattr(layer, "keys", None) is None else
            ((layer.keys.shape[1], layer.keys.shape[3]), (layer.values.shape[1], layer.values.shape[3]))
            for layer in cache.layers[:model.config.num_hidden_layers]]


def cached_layers(model, layer_shapes=None) -> list[int]:
    """The layers whose K/V the cached exports take and return (:func:`cache_layer_shapes` not None), in
    order: every layer but those that reuse another layer's K/V (``layer_shapes``: what
    :func:`cache_layer_shapes` returned, read off the model when None)."""
    if layer_shapes is None:
        layer_shapes = cache_layer_shapes(model)
    return [i for i, shapes in enumerate(layer_shapes) if shapes is not None]


def _past_shapes(model, batch: int, past_lens, layer_shapes=None) -> list[tuple[int, int, int, int]]:
    """The decode inputs' cache shapes, (B, heads, S_past, D), K then V of each cached layer
    (``layer_shapes``: :func:`cache_layer_shapes`, read off the model when None)."""
    if layer_shapes is None:
        layer_shapes = cache_layer_shapes(model)
    return [(batch, heads, past_lens[i], dim) for i, layer in enumerate(layer_shapes)
            if layer is not None for heads, dim in layer]


def sliding_layers(config) -> list[int | None]:
    """Per layer, the sliding window of the layer's HF ``DynamicCache`` layer (it keeps the last
    ``w - 1`` positions), or None for a full-attention layer: how HF lays out this config's cache."""
    from transformers import DynamicCache

    return [layer.sliding_window if getattr(layer, "is_sliding", False) else None
            for layer in DynamicCache(config=config).layers]


def hybrid_full_layer(config) -> int | None:
    """The first full-attention layer of a config whose layers mix sliding-window and full attention
    (GPT-OSS, Gemma 2/3: HF's hybrid cache); None otherwise."""
    windows = sliding_layers(config)
    if all(w is None for w in windows) or all(w is not None for w in windows):
        return None
    return windows.index(None)


def decode_past_lengths(config, seen: int) -> list[int]:
    """Per layer, the past length HF's ``DynamicCache`` holds after ``seen`` tokens: ``seen`` for a
    full-attention layer, ``min(seen, w - 1)`` for a sliding one (what a prefill of ``seen`` tokens
    returns, and what :func:`import_hf`'s decode mode takes as ``past_len``)."""
    return [seen if w is None else min(seen, w - 1) for w in sliding_layers(config)]


def export_wrapper(model, mode: str, num_layers: int, use_cache: bool, seed_cache: bool = False,
                   cached: list[int] | None = None):
    """The exported function (see :func:`import_hf`); ``seed_cache``: :func:`_seed_cache` first;
    ``cached``: the layers whose K/V a decode takes and returns (:func:`cached_layers`, read off the model
    with a one-token forward when None).

    Decode: the new token's position is the past's length. A hybrid model's cache (sliding-window and
    full-attention layers) holds the last ``w - 1`` positions in its sliding layers and every position in
    its full ones: the position is then a full layer's past length, and the sliding layers are told that
    many tokens were seen (their mask offsets, as after HF's own prefill)."""
    torch = _torch()
    from transformers import DynamicCache

    full = hybrid_full_layer(model.config)
    # decode takes the cached layers' K/V only (a KV-shared layer reads another's); a prefill returns those
    stored = None if mode != "decode" else cached_layers(model) if cached is None else list(cached)
    if stored is not None:
        stored = [i for i in stored if i < num_layers]
        if full is not None:  # a cached full-attention layer gives the tokens seen
            windows = sliding_layers(model.config)
            full = next((j for j, i in enumerate(stored) if windows[i] is None), None)

    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            if not use_cache:
                return self.model(input_ids=input_ids, use_cache=False).logits
            cache = DynamicCache(config=self.model.config)
            if seed_cache:
                _seed_cache(cache)
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
            res = [out.logits]
            for i in range(num_layers):
                if cache.layers[i].keys is not None:  # None: a KV-shared layer, which caches nothing
                    res += [cache.layers[i].keys, cache.layers[i].values]
            return tuple(res)

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, *past):
            cache = DynamicCache(config=self.model.config)
            if seed_cache:
                _seed_cache(cache)
            for j, i in enumerate(stored):
                cache.update(past[2 * j], past[2 * j + 1], i)
            past_len = past[0].shape[2]
            if full is not None:  # hybrid: the tokens seen are a full-attention layer's cache length
                past_len = past[2 * full].shape[2]
                for layer in cache.layers:
                    if getattr(layer, "is_sliding", False):
                        layer.cumulative_length = past_len
            pos = torch.arange(past_len, past_len + input_ids.shape[1]).unsqueeze(0)
            out = self.model(
                input_ids=input_ids, past_key_values=cache, position_ids=pos, use_cache=True
            )
            res = [out.logits]
            for i in stored:
                res += [cache.layers[i].keys, cache.layers[i].values]
            return tuple(res)

    return Prefill() if mode == "prefill" else Decode()


def _bind_specialized_dims(func):
    """A dimension torch.export specialized (a ``Dim.AUTO`` pinned by a guard, e.g. the past length
    of a sliding-window decode) reaches TVM's frontend as a symbolic variable NAMED after its value
    ("6"): nothing relates it to 6, so shapes computed from it cannot be proven equal to the real
    ones (the K/V expansion would then be kept). Bind such variables to their values."""
    from tvm import relax

    named = {v: int(v.name) for v in relax.analysis.free_symbolic_vars(func) if v.name.isdigit()}
    named.update({v: int(v.name) for v in relax.analysis.defined_symbolic_vars(func) if v.name.isdigit()})
    return func.bind_symbolic_vars(named) if named else func


def _one_past_length_per_layer(func, n_past: int):
    """A layer's K and V caches hold the same past length, but torch.export gives each cache tensor a
    ``Dim.AUTO`` of its own where no guard ties them (a sliding-window layer slices K and V apart): one
    variable for each layer's pair instead (``k_i``, ``v_i``: the decode function's cache inputs in order),
    bounded below by the larger of their lower bounds (the graph holds from there on for each). Without it K
    and V of one attention have unrelated lengths, which TVM's own attention lowering rejects ("shapes of x
    and y are inconsistent"). Layers stay apart: a hybrid model's sliding layers return fewer positions than
    its full ones, which the next step's inputs then hold."""
    from tvm import tirx

    def past_var(p):
        dims = getattr(getattr(p.ty, "shape", None), "values", None)
        return dims[2] if dims is not None and len(dims) == 4 and isinstance(dims[2], tirx.Var) else None

    caches = func.params[1:1 + n_past]
    for k, v in zip(caches[0::2], caches[1::2]):
        a, b = past_var(k), past_var(v)
        if a is None or b is None or a.same_as(b):
            continue
        attrs = func.attrs
        func = func.bind_symbolic_vars({b: a})
        for key, pick in (("tir_var_lower_bound", max), ("tir_var_upper_bound", min)):
            bounds = dict(attrs.get(key) or {}) if attrs is not None else {}
            values = [int(bounds[n]) for n in (a.name, b.name) if n in bounds]
            if values:
                bounds = {n: x for n, x in bounds.items() if str(n) not in (a.name, b.name)}
                bounds[a.name] = pick(values)
                func = func.with_attr(key, bounds)
    return func


def import_hf(
    model,
    *,
    mode: str = "prefill",
    batch: int = 1,
    seq_len: int = 16,
    past_len: int | list[int] = 8,
    dynamic: bool = False,
    use_cache: bool = True,
    max_batch: int = 8,
    max_seq_len: int = 1024,
    matmul_dtype: str = "native",
    mixed_precision: bool = False,
    seed: int = 0,
    convert: str | None = None,
    cache: str = "dynamic",
    max_cache_len: int = 32,
) -> HFImport:
    """Export ``model`` with ``torch.export`` and import it with ``from_exported_program``.

    - ``mode="prefill"``: ``main(input_ids: (B, S) int64, *weights) -> logits (B, S, V)``.
    - ``mode="decode"``: ``main(input_ids: (B, 1) int64, k_0, v_0, ..., *weights) ->
      (logits (B, 1, V), k_0', v_0', ...)``, caches ``(B, H_kv, S_past, D)``. ``past_len``: one length
      for every layer, or a sequence of per-layer lengths (a hybrid model's sliding layers hold fewer
      positions than its full ones: :func:`decode_past_lengths`). A layer that reuses another layer's K/V
      (Gemma 4's ``num_kv_shared_layers``) caches nothing and has no cache input or output
      (:func:`cached_layers`); ``past_len`` still has one entry per layer.
    - ``dynamic``: export with symbolic B and S (prefill) / S_past (decode) via
      ``torch.export.Dim``; otherwise the example sizes are baked in. A sliding-window decode with
      ``past_len`` below the window has its past length pinned by torch.export (bound to its value here);
      with ``past_len`` of at least the window it stays symbolic, bounded below by the window (HF's
      sliding cache keeps the last window - 1 keys through a ``torch.sym_max``, which imports with the
      fixes map only: not with ``convert="standard"``), and the mask is proven over that range. The frontend records the
      Dims' ranges as ``tir_var_upper_bound`` and TVM's memory planning then allocates for the
      upper bounds (B * S * S_kv masks and scores!), hence the small ``max_batch`` /
      ``max_seq_len`` defaults.
    - ``use_cache``: prefill through a fresh ``DynamicCache`` and return ``(logits, k_0, v_0,
      ...)`` (default, what generation does). With False the model runs cache-less and returns
      the logits only; HF then adds its packed-sequence detection to the mask
      (``diff``/``cumsum``/``index_tensor``), whose shapes the frontend cannot infer with
      ``dynamic=True`` ("non-symbolic shape is not supported" at build).
    - ``convert``: how ``from_exported_program`` is called.

      - ``"native"`` (default): ``custom_convert_map=native_dtype_convert_map()`` (matmuls keep
        torch's dtypes; includes the frontend fixes);
      - ``"fixes"``: ``custom_convert_map=fixes_convert_map()`` only (the frontend's float32 matmuls);
      - ``"standard"``: no custom convert map, what a user who knows none of this module runs.
        The frontend's bugs then stay: with a cache the wrapper stores each layer's first K/V as
        they are (:func:`_seed_cache`; HF's lazy 1-D ``torch.tensor([])`` fails the import), and
        without one (``use_cache=False``) the mask keeps a ``cumsum`` of bools typed bool, which
        LLVM cannot compile: the model builds only once the mask is gone, i.e. after every site
        is offloaded. The attention is float32 (the frontend's matmuls return float32 even in an
        fp16 model): use ``mixed_precision=True``. An fp16 model's decode does not import.

      ``matmul_dtype`` is the older spelling: "native" -> ``convert="native"``, "float32" ->
      ``"fixes"`` (ignored when ``convert`` is given).
    - ``cache="static"``: through HF's ``StaticCache`` instead (:mod:`.hf_static`): ``main(input_ids
      (B, S), cache_position (S,) int64, k_0, v_0, ..., *weights) -> (logits, k_0', v_0', ...)``,
      caches ``(B, H_kv, max_cache_len, D)``; ``mode`` picks S (and ``past_len`` the example
      position); static shapes only, no sliding window.
    - ``mixed_precision``: apply ``ToMixedPrecision(out_dtype="float16")`` after the import.

    Returns :class:`HFImport` ``(mod, params, reference)``; ``reference(*inputs)`` runs the torch
    model eagerly on numpy inputs (the same ones ``main`` takes before the weights) and returns
    the logits as a float32 numpy array. The module's weights are detached (``params``).
    """
    torch = _torch()
    from tvm import relax
    from tvm.relax.frontend import detach_params
    from tvm.relax.frontend.torch import from_exported_program

    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if matmul_dtype not in ("native", "float32"):
        raise ValueError(f"matmul_dtype must be 'native' or 'float32', got {matmul_dtype!r}")
    if convert is None:
        convert = "native" if matmul_dtype == "native" else "fixes"
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    if cache not in ("dynamic", "static"):
        raise ValueError(f"cache must be 'dynamic' or 'static', got {cache!r}")
    if (use_cache or mode == "decode") and cache == "dynamic":
        _require_kv_cache_layers(model)
    # one forward reads the cache layout: which layers cache K/V, in which shapes (decode's inputs)
    layer_shapes = cache_layer_shapes(model) if mode == "decode" and cache == "dynamic" else None
    cached = None if layer_shapes is None else cached_layers(model, layer_shapes)
    wrapper = export_wrapper(model, mode, n_layers, use_cache, seed_cache=convert == "standard",
                             cached=cached).eval()
    past_lens = [past_len] * n_layers if isinstance(past_len, int) else [int(n) for n in past_len]
    if len(past_lens) != n_layers:
        raise ValueError(f"past_len: {len(past_lens)} lengths for a model of {n_layers} layers")
    if len(set(past_lens)) > 1 and (dynamic or cache == "static"):
        raise ValueError("per-layer past lengths need static shapes and cache='dynamic'")
    past_len = past_lens[0]
    if dynamic:  # an example size of 1 would be specialized
        batch, seq_len, past_len = max(batch, 2), max(seq_len, 2), max(past_len, 2)
        past_lens = [past_len] * n_layers
    gen = torch.Generator().manual_seed(seed)
    n_tok = seq_len if mode == "prefill" else 1
    ids = torch.randint(0, cfg.vocab_size, (batch, n_tok), generator=gen)
    args = [ids]
    dyn = None
    if mode == "decode" and cache == "dynamic":
        dtype = next(model.parameters()).dtype
        args += [torch.randn(*shape, generator=gen).to(dtype)
                 for shape in _past_shapes(model, batch, past_lens, layer_shapes)]
    if cache == "static":
        from .hf_static import static_example_inputs, static_wrapper

        wrapper = static_wrapper(model, n_layers).eval()
        args = [torch.from_numpy(x) for x in static_example_inputs(
            model, mode=mode, batch=batch, seq_len=seq_len, past_len=past_len,
            max_cache_len=max_cache_len, dynamic=dynamic, seed=seed)]
    elif dynamic:
        bdim = torch.export.Dim("batch", min=1, max=max_batch)
        if mode == "prefill":
            dyn = ({0: bdim, 1: torch.export.Dim("seq_len", min=2, max=max_seq_len)},)
        else:
            pdim = torch.export.Dim.AUTO
            dyn = ({0: bdim}, tuple({0: bdim, 2: pdim} for _ in range(len(args) - 1)))
    with torch.no_grad():
        ep = torch.export.export(wrapper, tuple(args), dynamic_shapes=dyn)
    convert_map = {"native": native_dtype_convert_map, "fixes": fixes_convert_map,
                   "standard": lambda: None}[convert]()
    mod = from_exported_program(
        ep, keep_params_as_input=True, unwrap_unit_return_tuple=True, custom_convert_map=convert_map
    )
    mod, params = detach_params(mod)
    mod["main"] = _bind_specialized_dims(mod["main"])
    if mode == "decode" and cache == "dynamic" and dynamic:
        mod["main"] = _one_past_length_per_layer(mod["main"], len(args) - 1)
    if mixed_precision:
        mod = relax.transform.ToMixedPrecision(out_dtype="float16")(mod)
    np_params = [p.numpy() for p in params["main"]]

    def reference(*inputs) -> np.ndarray:
        # ids / positions stay int64; caches get the model dtype, copied (a StaticCache writes them)
        dt = next(model.parameters()).dtype
        t = [torch.from_numpy(np.ascontiguousarray(x)).long() if np.asarray(x).dtype.kind in "iu"
             else torch.tensor(np.asarray(x, dtype=np.float32)).to(dt) for x in inputs]
        with torch.no_grad():
            out = wrapper(*t)
        logits = out[0] if isinstance(out, tuple) else out
        return logits.float().numpy()

    return HFImport(mod, np_params, reference)


def example_inputs(
    model, *, mode: str = "prefill", batch: int = 1, seq_len: int = 16, past_len: int = 8, seed: int = 0
) -> list[np.ndarray]:
    """Random numpy inputs for ``main`` of :func:`import_hf` (ids int64; caches in the model dtype)."""
    rng = np.random.default_rng(seed)
    cfg = model.config
    n_tok = seq_len if mode == "prefill" else 1
    out = [rng.integers(0, cfg.vocab_size, (batch, n_tok)).astype("int64")]
    if mode == "decode":
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        out += [rng.standard_normal(shape).astype(dtype)
                for shape in _past_shapes(model, batch, [past_len] * cfg.num_hidden_layers)]
    return out


def kv_expansions_left(mod, func: str = "main", head_dims=None) -> list[str]:
    """The K/V head expansions left in ``func``: ``broadcast_to`` / ``repeat`` / ``tile`` ops that
    grow a tensor of rank >= 4 (HF's ``repeat_kv`` broadcasts (B, H_kv, r, S, D)). The others an HF
    import keeps are not K/V's: the frontend's no-op ``broadcast_to`` before a batched matmul,
    in sdpa graphs the o_proj weight broadcast to (B, K, N), and interleaved RoPE's cos / sin grown on
    the last axis (GLM, Cohere: (..., D/2, 1) -> (..., D/2, 2); a K/V expansion never grows the head dim),
    and a tensor whose last axis is 1 before and after (Llama 4's query temperature per position).
    ``head_dims``: the model's head dims, when known: an expansion whose last axis is none of them is not
    K/V's (DeepSeek-V4's hyper-connections copy the hidden state (B, S, 1, hidden) into 4 streams)."""
    from tvm import relax

    left = []
    head_dims = None if head_dims is None else set(head_dims)

    def dims(ty):  # None: unknown, so not provably a no-op
        return None if ty.shape is None else [int(x) if hasattr(x, "value") else str(x) for x in ty.shape]

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) in (
                "relax.broadcast_to", "relax.repeat", "relax.tile"):
            src, dst = dims(e.args[0].ty), dims(e.ty)
            grows_last_only = src is not None and dst is not None and len(src) == len(dst) and \
                src[:-1] == dst[:-1] and src[-1] == 1 and e.op.name == "relax.broadcast_to"
            # K/V's last axis is the head dim, never 1 (Llama 4 broadcasts its per-position query
            # temperature (1, S, 1, 1) over the batch)
            per_position = bool(src) and bool(dst) and src[-1] == 1 and dst[-1] == 1
            not_head_dim = head_dims is not None and bool(dst) and isinstance(dst[-1], int) and \
                dst[-1] not in head_dims
            if e.ty.ndim >= 4 and (src is None or src != dst) and not grows_last_only and not per_position \
                    and not not_head_dim:
                left.append(f"{e.op.name} {src} -> {dst}")

    relax.analysis.post_order_visit(mod[func].body, visit)
    return left


def attention_ir_snippet(mod, *, layer: int = 0, func: str = "main") -> tuple[str, str]:
    """``(preamble, attention)``: printed Relax bindings for docs and debugging.

    ``preamble``: everything before the first layer's RMSNorm input (embedding, the mask
    builder, RoPE tables); ``attention``: the bindings of layer ``layer`` from its q projection
    up to (excluding) its o projection.
    """
    lines = [ln.strip() for ln in mod[func].script(show_meta=False).splitlines()]
    body = next(i for i, ln in enumerate(lines) if ln.startswith("with R.dataflow()")) + 1
    tag = f"layers_{layer}_self_attn_"

    def find(pred):
        return next(i for i in range(body, len(lines)) if pred(lines[i]))

    first = find(lambda ln: tag + "q_proj_weight" in ln)
    last = find(lambda ln: tag + "o_proj_weight" in ln)
    norm0 = find(lambda ln: "R.power(" in ln)
    return "\n".join(lines[body:norm0]), "\n".join(lines[first:last])
