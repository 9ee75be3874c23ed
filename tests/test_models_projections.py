"""The decoder's two projection forms (``DecoderConfig.fused_projections``): mlc-llm's fused ``qkv_proj`` /
``gate_up_proj`` split along the last axis (the default) and HF's separate q/k/v and gate/up. Their
weights and graphs, that ``partition_for_cutlass`` offloads every attention of both (both caches, every
kv_expand form), and CPU numerics: one set of weights (:func:`params_by_name`) gives both forms the same
logits, and the separate form's mqa rewrite keeps them. CPU only."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

import mqa_byoc  # noqa: E402
from mqa_byoc.models.decoder_libs import offloaded_composites  # noqa: E402
from mqa_byoc.models.llama import (  # noqa: E402
    FUSED_PROJECTIONS,
    KV_CACHES,
    KV_EXPAND_FORMS,
    build_decoder,
    params_by_name,
    random_params,
)
from mqa_byoc.models.presets import scaled  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

FUNCS = ("prefill", "decode", "extend")


def _tiny(fused: bool, layers: int = 2):
    # llama3-8b attention (32 heads, 8 K/V heads, D 128), tiny everything else
    return scaled("llama3-8b", num_layers=layers, vocab_size=96, hidden_size=64, intermediate_size=96).replace(
        fused_projections=fused)


def _op_counts(func) -> Counter:
    names = Counter()
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                names[b.value.op.name] += 1
    return names


# ------------------------------------------------------------------------------------------ weights and graphs


@pytest.mark.parametrize("fused", [True, False])
def test_projection_weights_and_matmuls(fused):
    cfg = _tiny(fused)
    h, hkv, d, hid, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    mod, spec = build_decoder(cfg, functions=("prefill",))
    layer0 = {p.name[len("layers.0."):]: p.shape for p in spec if p.name.startswith("layers.0.")}
    want = {"input_layernorm.weight": (hid,), "post_attention_layernorm.weight": (hid,),
            "self_attn.o_proj.weight": (hid, h * d), "mlp.down_proj.weight": (hid, inter)}
    if fused:
        want |= {"self_attn.qkv_proj.weight": ((h + 2 * hkv) * d, hid), "mlp.gate_up_proj.weight": (2 * inter, hid)}
    else:
        want |= {"self_attn.q_proj.weight": (h * d, hid), "self_attn.k_proj.weight": (hkv * d, hid),
                 "self_attn.v_proj.weight": (hkv * d, hid), "mlp.gate_proj.weight": (inter, hid),
                 "mlp.up_proj.weight": (inter, hid)}
    assert layer0 == want
    # the default: with fused projections, qkv's split and RoPE are one TIR kernel a layer
    ops = _op_counts(mod["prefill"])
    assert ops["relax.split"] == (1 if fused else 2) * cfg.num_layers  # gate_up | RoPE's halves of q and k
    assert _tir_calls(mod["prefill"]).get("split_rope", 0) == (cfg.num_layers if fused else 0)
    # with Relax ops instead (fused_rope=False; the separate form has no choice)
    mod, _ = build_decoder(cfg, functions=("prefill",), fused_rope=False)
    assert "split_rope" not in _tir_calls(mod["prefill"])
    ops = _op_counts(mod["prefill"])
    # per layer: (qkv | q, k, v), o, (gate_up | gate, up), down; then the LM head (kv_expand "repeat":
    # the attention is R.nn.attention, no matmul)
    assert ops["relax.matmul"] == (4 if fused else 7) * cfg.num_layers + 1
    # RoPE splits q and k in halves; the fused form splits qkv and gate_up too
    assert ops["relax.split"] == (4 if fused else 2) * cfg.num_layers
    if fused:  # where qkv and gate_up are cut (RoPE's splits have the head dim last)
        cuts = [_split_points(c.attrs.indices_or_sections) for c in _calls(mod["prefill"], "relax.split")
                if int(c.args[0].ty.shape.values[-1]) != d]
        assert cuts == [[h * d, (h + hkv) * d], 2] * cfg.num_layers, cuts  # per layer: qkv, then gate_up


def _tir_calls(func) -> Counter:
    """Callees of R.call_tir in ``func`` by name."""
    names = Counter()
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir":
                names[b.value.args[0].name_hint] += 1
    return names


def _calls(func, op_name):
    return [b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == op_name]


def _split_points(attr):
    """R.split's indices (a list) or number of sections (an int)."""
    return int(attr) if isinstance(attr, (int, tvm.tirx.IntImm)) else [int(i) for i in attr]

def test_params_by_name_stacks_rows_in_order():
    cfg = _tiny(True, layers=1)
    _, fused_spec = build_decoder(cfg, dtype="float32", functions=("prefill",))
    _, sep_spec = build_decoder(cfg.replace(fused_projections=False), dtype="float32", functions=("prefill",))
    sep = dict(zip((p.name for p in sep_spec), random_params(sep_spec, seed=5)))
    fused = dict(zip((p.name for p in fused_spec), params_by_name(fused_spec, sep.__getitem__)))
    parts = {f"layers.0.self_attn.{x}_proj.weight" for x in "qkv"} | {f"layers.0.mlp.{x}_proj.weight"
                                                                    for x in ("gate", "up")}
    stacked = {"layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight"}
    assert parts <= set(sep) and set(fused) == (set(sep) - parts) | stacked
    for fused_name, parts in FUSED_PROJECTIONS.items():
        module = "self_attn" if fused_name == "qkv_proj" else "mlp"
        got = fused[f"layers.0.{module}.{fused_name}.weight"]
        rows = 0
        for part in parts:
            want = sep[f"layers.0.{module}.{part}.weight"]
            np.testing.assert_array_equal(got[rows:rows + want.shape[0]], want)
            rows += want.shape[0]
        assert rows == got.shape[0]
    for name, x in sep.items():
        if name in fused:
            np.testing.assert_array_equal(fused[name], x)
    # the spec's dtype, and a wrong shape is an error that names the weight
    _, spec16 = build_decoder(cfg, dtype="float16", functions=("prefill",))
    assert {x.dtype for x in params_by_name(spec16, sep.__getitem__)} == {np.dtype("float16")}
    short = {**sep, "layers.0.self_attn.k_proj.weight": sep["layers.0.self_attn.k_proj.weight"][:-1]}
    with pytest.raises(ValueError, match="qkv_proj"):
        params_by_name(fused_spec, short.__getitem__)


# ------------------------------------------------------------------------------------------ offload


@pytest.mark.parametrize("form", KV_EXPAND_FORMS)
@pytest.mark.parametrize("kv_cache", KV_CACHES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_every_attention_offloaded(fused, kv_cache, form):
    cfg = _tiny(fused)
    mod, _ = build_decoder(cfg, kv_cache=kv_cache, kv_expand=form, functions=FUNCS)
    report = mqa_byoc.offload_report(mod, mqa=True)
    assert sorted(s.function for s in report) == sorted(FUNCS * cfg.num_layers)
    for s in report:
        assert s.offloaded and s.composite == "flash_attn.attention_mqa", (s.function, s.reason)
        assert (s.num_q_heads, s.num_kv_heads, s.head_dim) == (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    part = mqa_byoc.partition_for_cutlass(mod, mqa=True)
    assert offloaded_composites(part) == {"flash_attn.attention_mqa": len(FUNCS) * cfg.num_layers}
    for fname in FUNCS:
        ops = _op_counts(part[fname])
        assert not {"relax.repeat", "relax.broadcast_to", "relax.nn.softmax"} & set(ops), (fname, ops)
        assert ops["relax.split"] == (1 if fused else 2) * cfg.num_layers  # the projections stay TVM's


# ------------------------------------------------------------------------------------------ CPU numerics

CPU_TARGET = {"kind": "llvm", "opt-level": 0}
PROMPT, STEPS = 5, 2


def _vm(mod):
    return relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(CPU_TARGET)), tvm.cpu())


def _run(mod, kv_cache, ids, params):
    """prefill(PROMPT) then one decode step per further token: the logits of every position."""
    vm, t = _vm(mod), tvm.runtime.tensor
    if kv_cache == "inplace":
        out = vm["prefill"](t(ids[:, :PROMPT]), vm["create_kv_cache"](tvm.runtime.ShapeTuple([ids.shape[1]])),
                            *params)
    else:
        out = vm["prefill"](t(ids[:, :PROMPT]), *params)
    logits = [out[0].numpy()]
    for n in range(PROMPT, ids.shape[1]):
        past = (tvm.runtime.ShapeTuple([n]),) if kv_cache == "inplace" else ()
        out = vm["decode"](t(ids[:, n:n + 1]), *past, out[1], *params)
        logits.append(out[0].numpy())
    return np.concatenate(logits, axis=1)


@pytest.fixture(scope="module")
def separate_reference():
    """{dtype: (weights by separate name, logits)} of the separate-projection functional decoder (repeat
    form, TVM's own attention), made on first use."""
    cfg = _tiny(False)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, PROMPT + STEPS)).astype("int32")
    runs = {}

    def get(dtype):
        if dtype not in runs:
            mod, spec = build_decoder(cfg, dtype=dtype, logits="all", functions=("prefill", "decode"))
            params = random_params(spec, seed=1, std=0.05)
            logits = _run(mod, "functional", ids, [tvm.runtime.tensor(x) for x in params])
            runs[dtype] = (dict(zip((p.name for p in spec), params)), logits)
        return runs[dtype]

    return ids, get


@pytest.mark.parametrize("fused,kv_cache,dtype,mqa,fused_rope", [
    (True, "functional", "float32", False, True),  # the fused graph computes the separate graph's function
    (True, "functional", "float32", False, False),  # ... with qkv's split and RoPE as Relax ops too
    (True, "inplace", "float16", False, True),  # the in-place cache and the RoPE kernel in fp16
    (False, "inplace", "float16", True, True),  # the separate form's mqa rewrite on the in-place cache
], ids=["fused-functional-f32", "fused-functional-f32-rope-ops", "fused-inplace-f16",
        "separate-inplace-f16-mqa-rewrite"])
def test_forms_agree_on_one_set_of_weights(separate_reference, fused, kv_cache, dtype, mqa, fused_rope):
    """(The fused form's mqa rewrite on both caches: tests/test_models_inplace_cache.py, whose decoders are fused.)"""
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention

    ids, get = separate_reference
    weights, want = get(dtype)
    cfg = _tiny(fused)
    mod, spec = build_decoder(cfg, dtype=dtype, logits="all", kv_cache=kv_cache, functions=("prefill", "decode"),
                              fused_rope=fused_rope)
    if mqa:
        mod = canonicalize_attention(mod, mqa=True)
        for fname in ("prefill", "decode"):
            ops = _op_counts(mod[fname])
            assert "relax.repeat" not in ops and ops["relax.nn.attention"] == cfg.num_layers, fname
        mod = LegalizeGroupedAttention()(mod)
    got = _run(mod, kv_cache, ids, [tvm.runtime.tensor(x) for x in params_by_name(spec, weights.__getitem__)])
    assert got.shape == want.shape == (1, ids.shape[1], cfg.vocab_size)
    if mqa:  # a bias-masked softmax against TVM's causal one: both fp16, each held to the float32 graph
        G.assert_as_accurate_as(got, want, get("float32")[1])
        return
    tol = {"float32": 1e-5, "float16": 2e-3}[dtype] * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
