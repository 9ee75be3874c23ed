"""Where the K/V of :func:`mqa_byoc.models.llama.build_decoder` live between calls (``kv_cache=``).

Each decoder call makes one cache-state object; every attention layer hands it its new K/V (after
RoPE) and gets back the K/V to attend over (``update``):

- :class:`FunctionalKV` (``"functional"``): K/V tensors in, ``R.concat((past, new), axis=1)`` out;
  every call copies the whole cache (see ``llama``'s module docstring for the signatures).
- :class:`InplaceKV` (``"inplace"``): TVM's in-place cache objects (``vm.builtin.attention_kv_cache_*``,
  the runtime's ``AttentionKVCacheLegacy``: a buffer reserved once, a fill count), as in mlc-llm's
  2023 Llama, the model the original MQA offload was profiled on. A call appends its new K/V rows
  in place and reads the cache through a zero-copy view: no op copies the cache. One cache object
  per layer and K/V, ``(capacity, H_kv, D)`` with no batch axis: batch 1.

In-place functions (weights trail the inputs, ``num_input`` attr; ``caches`` is a tuple of
``2 * num_layers`` cache objects ``(k_0, v_0, k_1, v_1, ...)``, returned by every call: the same
objects, appended to)::

    create_kv_cache(capacity: R.Shape([capacity])) -> caches      # empty, room for capacity tokens
    prefill(input_ids: (1, S) int32, caches, *weights) -> (logits, caches)           # empty caches
    decode(input_id: (1, 1) int32, past_len: R.Shape([past_len]), caches, *weights) -> (logits, caches)
    extend(input_ids: (1, S) int32, past_len: R.Shape([past_len]), caches, *weights) -> (logits, caches)

``past_len`` is the number of tokens already cached (mlc-llm passes the total length the same way,
as a shape). Per layer, after RoPE (k, v ``(1, S, H_kv, D)``)::

    k_cache = R.call_inplace_packed("vm.builtin.attention_kv_cache_append", k_cache,
                                    R.reshape(k, (S, H_kv, D)), inplace_indices=[0])
    k_view = R.call_pure_packed("vm.builtin.attention_kv_cache_view", k_cache,
                                R.shape([past_len + S, H_kv, D]), ty_args=R.Tensor((past_len + S, H_kv, D)))
    k_view = R.match_cast(k_view, R.Tensor((kv_len, H_kv, D)))      # decode / extend, repeat & native forms
    k = R.reshape(k_view, (1, kv_len, H_kv, D))                      # a view too (vm.builtin.reshape)

(the same for v), then the ``kv_expand`` form (repeat, attention, ...) as with the functional
cache. The view checks at run time that the cache holds ``past_len + S`` rows; the match_cast is the
KV-cache fact ``kv_len == past_len + S`` that proves S <= S_kv for the causal mask
(:func:`mqa_byoc.compiler.graph.trace._match_cast_lengths`). Appending past the reserved capacity makes
the runtime reallocate and copy the cache (correct, but a full copy): reserve prompt + new tokens.
"""

from __future__ import annotations

APPEND = "vm.builtin.attention_kv_cache_append"
VIEW = "vm.builtin.attention_kv_cache_view"
CREATE = "vm.builtin.attention_kv_cache_create"
CREATE_FUNCTION = "create_kv_cache"

# forms whose R.nn.attention needs S_kv as one symbolic variable (TVM's TE legalization of an
# attention with S_kv = past_len + S fails: "shapes of x and y are inconsistent")
FRESH_LEN_FORMS = ("repeat", "native")


def match_len(x, kv_len_var, name):
    """``R.match_cast(x, R.Tensor((..., kv_len, H_kv, D)))``: give a cache's K/V a fresh length."""
    from tvm import relax
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.core import BlockBuilder

    shape = list(x.shape)
    shape[-3] = kv_len_var
    ty = relax.TensorType(shape, x.dtype)
    return nn.Tensor(_expr=BlockBuilder.current().match_cast(x._expr, ty, name))


def _fresh_len():
    from tvm import tirx

    return tirx.Var("kv_len", "int64")


class FunctionalKV:
    """The functional cache of one decoder call: K/V tensors in, ``R.concat((past, new), axis=1)``
    out (the whole cache is copied per call).

    ``past``: the ``2 * num_layers`` cache tensors, or None (prefill). ``fresh_len``: bind the
    concatenated K/V to a fresh symbolic ``kv_len`` (``build_decoder(fresh_kv_len=)``).
    """

    def __init__(self, past, fresh_len: bool):
        self.past = list(past) if past is not None else None
        self.past_len = past[0].shape[1] if past is not None else 0
        self.kv_len_var = _fresh_len() if past is not None and fresh_len else None
        self._layer = 0

    def kv_len(self, seq_len):
        from .attention_forms import simplify_index

        return self.kv_len_var if self.kv_len_var is not None else simplify_index(self.past_len + seq_len)

    def update(self, attn, k, v):
        """(k, v for attention, k, v returned as the new cache) of the next layer."""
        from tvm.relax.frontend.nn import op

        i, self._layer = self._layer, self._layer + 1
        if self.past is not None:
            k = op.concat([self.past[2 * i], k], dim=1)
            v = op.concat([self.past[2 * i + 1], v], dim=1)
        k_cache, v_cache = k, v  # returned with the signature's length, past_len + S
        if self.kv_len_var is not None:
            k = match_len(k, self.kv_len_var, "k_all")
            v = match_len(v, self.kv_len_var, "v_all")
        return k, v, k_cache, v_cache


class InplaceKV:
    """The in-place cache state of one decoder call.

    ``past_len``: 0 (prefill) or the function's ``past_len`` shape variable. ``fresh_len``: bind
    each view to a fresh symbolic ``kv_len`` (decode / extend of the repeat and native forms).
    """

    def __init__(self, past_len, fresh_len: bool):
        self.past_len = past_len
        self.kv_len_var = _fresh_len() if fresh_len and not isinstance(past_len, int) else None

    kv_len = FunctionalKV.kv_len

    def update(self, attn, k, v):
        """Append k, v ``(1, S, H_kv, D)`` to the layer's caches; (k, v views for attention, None, None):
        the caches are the function's effects, returned by it, not per layer."""
        return self._append_view(attn.k_cache, k, "k"), self._append_view(attn.v_cache, v, "v"), None, None

    def _append_view(self, cache, x, name):
        from tvm.relax.frontend.nn import op

        from .attention_forms import simplify_index

        _, s, hkv, d = x.shape
        cache.append(op.reshape(x, (s, hkv, d)))
        view = cache.view(simplify_index(self.past_len + s))
        if self.kv_len_var is not None:
            view = match_len(view, self.kv_len_var, f"{name}_view")
        return op.reshape(view, (1, view.shape[0], hkv, d))


def attach_caches(model, config, dtype: str) -> None:
    """Give every attention of ``model`` its ``k_cache`` / ``v_cache`` (nn effects, in layer order)."""
    from tvm.relax.frontend import nn

    for layer in model.layers:
        # the reserve is set by create_kv_cache at run time, not by this effect's init
        layer.self_attn.k_cache = nn.KVCache(1, [config.num_kv_heads, config.head_dim], dtype)
        layer.self_attn.v_cache = nn.KVCache(1, [config.num_kv_heads, config.head_dim], dtype)


def inplace_decoder_class(decoder_class):
    """The decoder module with in-place caches: ``decoder_class`` (``llama``'s) with other signatures."""

    class InplaceDecoder(decoder_class):
        def _inplace(self, past_len):
            return InplaceKV(past_len, self.fresh_kv_len and self.kv_expand in FRESH_LEN_FORMS)

        def prefill(self, input_ids):
            return self._run(input_ids, self._inplace(0))[0]

        def decode(self, input_id, past_len):
            return self._run(input_id, self._inplace(past_len))[0]

        def extend(self, input_ids, past_len):
            return self._run(input_ids, self._inplace(past_len))[0]

    return InplaceDecoder


def method_specs(functions, vocab_dtype="int32") -> dict:
    """nn export specs of the in-place functions: the caches are the module's effects, passed packed
    as one tuple after the explicit inputs."""
    from tvm.relax.frontend import nn

    packed = {"$": {"param_mode": "plain", "effect_mode": "packed"}}
    specs = {
        "prefill": {"input_ids": nn.spec.Tensor([1, "seq_len"], vocab_dtype)},
        "decode": {"input_id": nn.spec.Tensor([1, 1], vocab_dtype), "past_len": nn.spec.Int()},
        "extend": {"input_ids": nn.spec.Tensor([1, "seq_len"], vocab_dtype), "past_len": nn.spec.Int()},
    }
    return {f: {**specs[f], **packed} for f in functions}


def with_create_function(mod, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str):
    """``mod`` with ``create_kv_cache(capacity)`` in place of nn's ``_initialize_effect`` (whose reserve
    is fixed at build time and which allocates it as a zeros tensor first)."""
    import tvm
    from tvm import relax, tirx

    funcs = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "_initialize_effect"}
    bb = relax.BlockBuilder(tvm.IRModule(funcs, attrs=mod.attrs))
    capacity = tirx.Var("capacity", "int64")
    param = relax.Var("capacity", relax.ShapeType([capacity]))
    # impure calls outside a dataflow block: 2L identical create calls must not be merged into one
    with bb.function(CREATE_FUNCTION, [param], attrs={"num_input": 1}, pure=False):
        row = bb.emit(relax.op.zeros(relax.ShapeExpr([1, num_kv_heads, head_dim]), dtype), "init_row")
        reserve = relax.ShapeExpr([capacity, num_kv_heads, head_dim])
        caches = []
        for i in range(2 * num_layers):
            # the one row is copied in and then marked free: fill count 0
            call = relax.Call(relax.ExternFunc(CREATE), [row, reserve, relax.prim_value(0)],
                              ty_args=[relax.ObjectType()])
            caches.append(bb.emit(call, f"{'kv'[i % 2]}_cache_{i // 2}"))
        bb.emit_func_output(relax.Tuple(caches))
    return bb.finalize()


def cache_readers(func, attention_symbols) -> dict:
    """What reads the cache of a function lowered for the VM (after ``relax.build``'s pipeline, before
    code generation), following its zero-copy views (``attention_kv_cache_view``, then
    ``vm.builtin.reshape`` / match_cast): {"reshape": n, "attention": n (calls of the offloaded
    functions named in ``attention_symbols``), "tir:<PrimFunc>": n (kernels reading the cache, e.g. a
    repeat or a copy), "other:<callee>": n}. A decode whose readers are reshapes and attention only
    launches no kernel that copies the cache."""
    from collections import Counter

    from tvm import relax

    views, readers = set(), Counter()
    for block in func.body.blocks:
        for b in block.bindings:
            value = b.value
            if isinstance(b, relax.MatchCast) or isinstance(value, relax.Var):
                if value in views:
                    views.add(b.var)
                continue
            if not isinstance(value, relax.Call):
                continue
            name = str(value.op.global_symbol) if isinstance(value.op, relax.ExternFunc) else ""
            if name == VIEW:
                views.add(b.var)
                continue
            read = [a for a in value.args if isinstance(a, relax.Var) and a in views]
            if not read:
                continue
            if name == "vm.builtin.reshape":
                views.add(b.var)
                readers["reshape"] += 1
            elif name in attention_symbols:
                readers["attention"] += len(read)
            elif isinstance(value.op, relax.GlobalVar):
                readers[f"tir:{value.op.name_hint}"] += len(read)
            elif getattr(value.op, "name", "") != "relax.vm.kill_object":
                readers[f"other:{name or value.op}"] += len(read)
    return dict(readers)
