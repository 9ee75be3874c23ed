"""HF's ``StaticCache`` through ``torch.export`` and TVM's frontend (``import_hf(..., cache="static")``).

``StaticCache`` preallocates ``(B, H_kv, max_cache_len, D)`` K/V per layer and writes each call's new
rows in place (``keys.index_copy_(2, cache_position, k)``, a 0-d ``cumulative_length.add_``). What
torch.export (2.13, ``strict=False``) and TVM 0.27's ``from_exported_program`` make of it (the
observations are pinned in ``tests/test_hf_static_cache.py``; the story is in ``docs/hf_kv_caches.md``):

- The cache tensors live in a plain Python object, not a module: non-strict export lifts them (and
  ``cumulative_length``) as *constants*, and ``run_decompositions`` (which the frontend runs) fails
  on the mutated constants. Handed in as inputs (or registered buffers), the writes are
  functionalized into ``aten.index_put(cache, [None, None, pos], k)`` plus mutation outputs.
- TVM's ``index_put`` converter turns the ``None`` entries into ``arange`` columns but leaves the
  trailing head-dim axis out, and ``R.index_put`` rejects the 3 index tensors of a 4-D cache
  (:func:`index_put_converter` fixes it).
- The frontend keeps USER outputs only: the mutation outputs (the updated caches) are dropped.
  The wrapper here therefore returns the updated caches as ordinary outputs: a functional static
  cache, ``main(input_ids, cache_position, k_0, v_0, ..., *weights) -> (logits, k_0', v_0', ...)``.
- Attention then runs over all ``max_cache_len`` rows with HF's mask built from ``cache_position``
  (a graph input), so S_kv = max_cache_len and the mask is only known at run time.
"""

from __future__ import annotations

from .hf_config import cache_heads_and_dim


def index_put_converter(node, importer):
    """``aten.index_put`` with ``None`` ("all of this axis") entries and one 1-D index tensor.

    That is ``index_copy`` along one axis, what a functionalized ``StaticCache`` write becomes:
    ``index_put(cache (B, H, M, D), [None, None, pos (S,)], k (B, H, S, D))``. Every axis of the
    data gets its own index column (``arange`` for the ``None`` and the omitted trailing axes),
    broadcasting to the values' shape. Other forms go to TVM's own converter.
    """
    from tvm import relax

    args = importer.retrieve_args(node)
    data, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else node.kwargs.get("accumulate", False)
    given = [i for i, x in enumerate(indices) if x is not None]
    n = data.ty.ndim
    if not (len(given) == 1 and indices[given[0]].ty.ndim == 1 and len(indices) <= n):
        return importer._index_put(node)
    axis = given[0]
    bb = importer.block_builder
    shape = importer.shape_of(data)
    cols = []
    for i in range(n):
        if i == axis:
            col, size = indices[i], -1
        else:
            col = bb.emit(relax.op.arange(relax.prim_value(0), shape[i], relax.prim_value(1), "int64"))
            size = shape[i]
        cols.append(bb.emit(relax.op.reshape(col, [1] * i + [size] + [1] * (n - i - 1))))
    return bb.emit(relax.op.index_put(data, relax.Tuple(cols), values, bool(accumulate)))


def static_wrapper(model, num_layers: int):
    """The exported function: ``(input_ids (B, S), cache_position (S,), k_0, v_0, ...) -> (logits,
    k_0', v_0', ...)`` through a ``StaticCache`` whose tensors are the inputs (their in-place
    writes become ``index_put`` in the graph; returning them keeps them, see the module doc)."""
    import torch
    from transformers import StaticCache

    class StaticStep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, cache_position, *kv):
            cache = StaticCache(config=self.model.config, max_cache_len=kv[0].shape[2])
            for i, layer in enumerate(cache.layers):
                layer.lazy_initialization(kv[2 * i], kv[2 * i + 1])
                layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
                # a graph value, not a lifted constant (export cannot mutate constants)
                layer.cumulative_length = cache_position[0].clone()
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                             position_ids=cache_position.unsqueeze(0), cache_position=cache_position)
            return (out.logits, *[t for layer in cache.layers[:num_layers] for t in (layer.keys, layer.values)])

    return StaticStep()


def static_example_inputs(model, *, mode: str = "decode", batch: int = 1, seq_len: int = 16,
                          past_len: int = 8, max_cache_len: int = 32, dynamic: bool = False,
                          seed: int = 0) -> list:
    """Numpy inputs of :func:`static_wrapper`'s step: ids ``(B, S)`` (S = ``seq_len`` for
    ``mode="prefill"`` at position 0, 1 for ``"decode"`` at ``past_len``), ``cache_position`` and
    random caches ``(B, H_kv, max_cache_len, D)`` in the model dtype (rows past the fill are
    masked, their values do not matter)."""
    import numpy as np

    cfg = model.config
    if dynamic:
        raise NotImplementedError("cache='static' is exported with static shapes only")
    if getattr(cfg, "sliding_window", None) is not None:
        # HF's StaticSlidingWindowLayer rolls its buffer with data-dependent control flow
        raise NotImplementedError("cache='static' does not support sliding-window models")
    start, n_tok = (0, seq_len) if mode == "prefill" else (past_len, 1)
    if start + n_tok > max_cache_len:
        raise ValueError(f"positions up to {start + n_tok} exceed max_cache_len={max_cache_len}")
    rng = np.random.default_rng(seed)
    hkv, d = cache_heads_and_dim(cfg)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    shape = (batch, hkv, max_cache_len, d)
    return [rng.integers(0, cfg.vocab_size, (batch, n_tok)).astype("int64"),
            np.arange(start, start + n_tok, dtype="int64"),
            *[rng.standard_normal(shape).astype(dtype) for _ in range(2 * cfg.num_hidden_layers)]]


# --------------------------------------------------------------------------- the in-place route
def decoder_config_from_hf(hf_config, name: str = "hf"):
    """The :class:`~mqa_byoc.models.presets.DecoderConfig` of an HF Llama / Mistral config, so that
    ``build_decoder(config, kv_cache="inplace")`` + :func:`.hf.params_from_hf` runs the HF weights on
    TVM's in-place cache (what no torch.export of an HF cache reaches). Only plain RoPE is modelled. The
    decoder gets the config's default fused ``qkv_proj`` / ``gate_up_proj`` (``params_from_hf`` stacks HF's
    weights into them); ``.replace(fused_projections=False)`` keeps HF's separate projections."""
    from .presets import DecoderConfig

    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"RoPE scaling {rope.get('rope_type')!r}: build_decoder has plain RoPE only")
    heads = hf_config.num_attention_heads
    return DecoderConfig(
        name, hidden_size=hf_config.hidden_size, num_heads=heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        intermediate_size=hf_config.intermediate_size, vocab_size=hf_config.vocab_size,
        num_layers=hf_config.num_hidden_layers,
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        rms_eps=hf_config.rms_norm_eps, sliding_window=getattr(hf_config, "sliding_window", None))
