"""Decoders on TVM's in-place KV cache (``build_decoder(kv_cache="inplace")``): signatures, what
``partition_for_cutlass`` offloads over the cache views, that no op but attention (or, with
mqa=False, the repeat) reads the cache after the CUDA pipeline, and CPU numerics against the
functional-cache decoder with the same weights. CPU only."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

import mqa_byoc  # noqa: E402
from mqa_byoc.contract import CODEGEN  # noqa: E402
from mqa_byoc.models import kv_caches  # noqa: E402
from mqa_byoc.models.decoder_libs import offloaded_composites  # noqa: E402
from mqa_byoc.models.llama import KV_EXPAND_FORMS, build_decoder, random_params  # noqa: E402
from mqa_byoc.models.presets import scaled  # noqa: E402
from mqa_byoc.testing import graphs as G  # noqa: E402

FUNCS = ("prefill", "decode", "extend")


def _tiny(name="llama3-8b", layers=2, **kw):
    return scaled(name, num_layers=layers, vocab_size=96, hidden_size=64, intermediate_size=96, **kw)


def _calls(func):
    """(op or packed-function name, call) of every call bound in ``func``, in order."""
    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if not isinstance(v, relax.Call):
                continue
            if isinstance(v.op, relax.ExternFunc):
                out.append((str(v.op.global_symbol), v))
            elif isinstance(v.op, tvm.ir.Op) and v.op.name in ("relax.call_pure_packed", "relax.call_inplace_packed"):
                out.append((str(v.args[0].global_symbol), v))
            elif isinstance(v.op, tvm.ir.Op):
                out.append((v.op.name, v))
            elif isinstance(v.op, relax.GlobalVar):
                out.append((f"call:{v.op.name_hint}", v))
    return out


def _names(func):
    return Counter(name for name, _ in _calls(func))


# ------------------------------------------------------------------------------------------ the graph


def test_inplace_decoder_functions_and_signatures():
    cfg = _tiny()
    mod, spec = build_decoder(cfg, kv_cache="inplace", functions=FUNCS)
    relax.analysis.well_formed(mod)  # raises on a violation
    relax_funcs = {gv.name_hint for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    assert relax_funcs == {"create_kv_cache", *FUNCS}  # nn's _initialize_effect gone
    assert {gv.name_hint for gv in mod.functions} - relax_funcs == {"split_rope"}  # qkv split + RoPE kernel
    n_caches = 2 * cfg.num_layers
    create = mod["create_kv_cache"]
    assert [type(p.ty) for p in create.params] == [relax.ShapeType] and not create.is_pure
    assert len(create.ret_ty.fields) == n_caches
    assert _names(create)[kv_caches.CREATE] == n_caches
    inputs = {"prefill": ["input_ids", "packed_effects"], "decode": ["input_id", "past_len", "packed_effects"],
              "extend": ["input_ids", "past_len", "packed_effects"]}
    for fname in FUNCS:
        func = mod[fname]
        n_in = int(func.attrs["num_input"])
        assert [str(p.name) for p in func.params[:n_in]] == inputs[fname]
        assert len(func.params) == n_in + len(spec)
        assert len(func.params[n_in - 1].ty.fields) == n_caches  # one tuple of cache objects in ...
        logits_ty, caches_ty = func.ret_ty.fields
        assert len(caches_ty.fields) == n_caches  # ... and out
        names = _names(func)
        assert names[kv_caches.APPEND] == names[kv_caches.VIEW] == n_caches
        # no concatenation of the cache: what is concatenated (RoPE's halves) is the new tokens only
        for name, call in _calls(func):
            if name == "relax.concat" and fname == "decode":
                assert all(isinstance(x, tvm.tirx.IntImm) for x in call.ty.shape.values), call.ty
    # the functional decode concatenates the whole cache, once per layer and K/V
    functional, _ = build_decoder(cfg, batch=1, functions=("decode",))
    cache_concats = [c for n, c in _calls(functional["decode"]) if n == "relax.concat"
                     and not all(isinstance(x, tvm.tirx.IntImm) for x in c.ty.shape.values)]
    assert len(cache_concats) == n_caches


def test_inplace_decoder_rejects_what_it_cannot_build():
    cfg = _tiny(layers=1)
    with pytest.raises(ValueError, match="batch must be 1"):
        build_decoder(cfg, kv_cache="inplace", batch=2)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        build_decoder(cfg, kv_cache="paged")


@pytest.mark.parametrize("form", KV_EXPAND_FORMS)
def test_offloaded_over_the_views_with_native_kv_heads(form):
    cfg = _tiny()
    mod, _ = build_decoder(cfg, kv_cache="inplace", kv_expand=form, functions=FUNCS)
    report = mqa_byoc.offload_report(mod, mqa=True)
    assert len(report) == 3 * cfg.num_layers
    for fname in FUNCS:
        sites = [s for s in report if s.function == fname]
        assert len(sites) == cfg.num_layers, fname
        for s in sites:
            assert s.offloaded and s.composite == "flash_attn.attention_mqa", (fname, s.reason)
            assert (s.num_q_heads, s.num_kv_heads, s.head_dim) == (32, 8, 128)
            # a mask proven from the graph: in decode, one query sees every key (no mask at all)
            assert s.causal == "BottomRight" or (fname == "decode" and s.causal is None), (fname, s.causal)
    part = mqa_byoc.partition_for_cutlass(mod, mqa=True)
    assert offloaded_composites(part) == {"flash_attn.attention_mqa": 3 * cfg.num_layers}
    for fname in FUNCS:
        names = _names(part[fname])
        assert not {"relax.repeat", "relax.broadcast_to", "relax.expand_dims"} & set(names), fname
        assert names[kv_caches.APPEND] == names[kv_caches.VIEW] == 2 * cfg.num_layers


def test_mqa_false_keeps_the_repeat_on_the_same_cache():
    cfg = _tiny()
    mod, _ = build_decoder(cfg, kv_cache="inplace", functions=FUNCS)
    report = mqa_byoc.offload_report(mod, mqa=False)
    assert [(s.composite, s.num_kv_heads) for s in report] == [("flash_attn.attention", 32)] * 3 * cfg.num_layers
    mqa, base = (mqa_byoc.partition_for_cutlass(mod, mqa=m) for m in (True, False))
    for fname in FUNCS:
        names = _names(base[fname])
        assert names["relax.repeat"] == 2 * cfg.num_layers
        for op in (kv_caches.APPEND, kv_caches.VIEW):
            assert names[op] == _names(mqa[fname])[op] == 2 * cfg.num_layers


@pytest.mark.parametrize("preset,window", [("falcon-7b-mqa", None), ("mistral-7b", 4096)])
def test_mqa_and_window_presets(preset, window):
    cfg = _tiny(preset, layers=1)
    mod, _ = build_decoder(cfg, kv_cache="inplace", functions=("prefill", "decode"))
    report = mqa_byoc.offload_report(mod, mqa=True)
    assert [(s.offloaded, s.num_kv_heads, s.window) for s in report] == [(True, cfg.num_kv_heads, window)] * 2


# ------------------------------------------------------------------------------------------ after the CUDA pipeline


def _lowered(mod, mqa: bool):
    """The partitioned ``mod`` through RunCodegen (python provider) and the decoders' CUDA pipeline (no
    kernel compiled): the VM-level functions, and the symbols of the offloaded attentions."""
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.compiler.provider import PROVIDER_OPTION

    part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa)
    symbols = {str(f.attrs["global_symbol"]) for f in part.functions.values()
               if f.attrs is not None and "Codegen" in f.attrs}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        part = relax.transform.RunCodegen({CODEGEN: {PROVIDER_OPTION: "python"}})(part)
        return cuda_decoder_pipeline(target)(part), symbols


@pytest.mark.parametrize("mqa", [True, False])
def test_only_attention_reads_the_cache_after_the_cuda_pipeline(mqa):
    """Every kernel the VM launches on the cache: mqa=True, FA2 alone (the view and its reshape are
    zero-copy builtins, no concatenate, no copy); mqa=False, the repeat that expands it."""
    cfg = _tiny()
    n = 2 * cfg.num_layers
    mod, _ = build_decoder(cfg, kv_cache="inplace", functions=("prefill", "decode"))
    low, symbols = _lowered(mod, mqa)
    for fname in ("prefill", "decode"):
        readers = Counter(kv_caches.cache_readers(low[fname], symbols))
        assert _names(low[fname])[kv_caches.APPEND] == n
        assert readers["reshape"] == n, readers
        if mqa:
            assert readers == Counter(reshape=n, attention=n), (fname, readers)
        else:
            tir = {k: c for k, c in readers.items() if k.startswith("tir:")}
            assert sum(tir.values()) == n and all("repeat" in k for k in tir), (fname, readers)
            assert set(readers) == {"reshape", *tir}, (fname, readers)


# ------------------------------------------------------------------------------------------ CPU numerics

CPU_TARGET = {"kind": "llvm", "opt-level": 0}
PROMPT, STEPS, TAIL = 5, 3, 2  # prefill 5, decode 3, extend 2


def _vm(mod):
    ex = tvm.compile(mod, target=tvm.target.Target(CPU_TARGET))
    return relax.VirtualMachine(ex, tvm.cpu())


def _shape(n):
    return tvm.runtime.ShapeTuple([n])


def _run_inplace(vm, ids, params, capacity):
    """prefill(PROMPT), STEPS decodes, extend(TAIL): logits per call and the cache contents at the end."""
    t = tvm.runtime.tensor
    caches = vm["create_kv_cache"](_shape(capacity))
    out = vm["prefill"](t(ids[:, :PROMPT]), caches, *params)
    logits = [out[0].numpy()]
    n = PROMPT
    for i in range(STEPS):
        out = vm["decode"](t(ids[:, n:n + 1]), _shape(n), out[1], *params)
        logits.append(out[0].numpy())
        n += 1
    out = vm["extend"](t(ids[:, n:]), _shape(n), out[1], *params)
    logits.append(out[0].numpy())
    n += TAIL
    view = tvm.get_global_func(kv_caches.VIEW)
    contents = [view(c).numpy() for c in out[1]]  # all filled rows
    assert all(c.shape[0] == n for c in contents)
    return np.concatenate(logits, axis=1), contents


@pytest.fixture(scope="module")
def references():
    """{dtype: the functional-cache decoder (repeat form, TVM's own attention) run as prefill + one decode
    step per further token: logits of every position and its final caches}, made on first use."""
    cfg = _tiny()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, PROMPT + STEPS + TAIL)).astype("int32")
    runs = {}

    def get(dtype):
        if dtype not in runs:
            mod, spec = build_decoder(cfg, dtype=dtype, logits="all", functions=("prefill", "decode"))
            params = [tvm.runtime.tensor(x) for x in random_params(spec, seed=1, std=0.05)]
            vm, t = _vm(mod), tvm.runtime.tensor
            out = vm["prefill"](t(ids[:, :PROMPT]), *params)
            logits = [out[0].numpy()]
            for i in range(PROMPT, ids.shape[1]):
                out = vm["decode"](t(ids[:, i:i + 1]), out[1], *params)
                logits.append(out[0].numpy())
            caches = [out[1][i].numpy()[0] for i in range(len(out[1]))]  # (S, H_kv, D): batch 1
            runs[dtype] = (spec, params, np.concatenate(logits, axis=1), caches)
        return runs[dtype]

    return cfg, ids, get


@pytest.mark.parametrize("dtype,variant", [("float32", "unpartitioned"), ("float16", "mqa-rewrite")])
def test_inplace_cache_matches_the_functional_cache(references, dtype, variant):
    """Same weights, same tokens: the in-place decoder's logits (prefill, decode steps, extend) and
    final caches equal the functional decoder's. ``mqa-rewrite``: the graph partition_for_cutlass
    offloads (attention on the views with native K/V heads; fp16, what FA2 takes), lowered by TVM on
    the CPU."""
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    from mqa_byoc.compiler.partition import canonicalize_attention

    cfg, ids, get = references
    spec, params, want_logits, want_caches = get(dtype)
    mod, spec2 = build_decoder(cfg, dtype=dtype, logits="all", kv_cache="inplace", functions=FUNCS)
    assert spec2 == spec
    if variant == "mqa-rewrite":
        rewritten = canonicalize_attention(mod, mqa=True)
        for fname in FUNCS:
            names = _names(rewritten[fname])
            assert "relax.repeat" not in names and names["relax.nn.attention"] == cfg.num_layers, fname
        mod = LegalizeGroupedAttention()(rewritten)
    got_logits, got_caches = _run_inplace(_vm(mod), ids, params, capacity=ids.shape[1])
    assert got_logits.shape == want_logits.shape == (1, ids.shape[1], cfg.vocab_size)
    if variant == "unpartitioned":
        tol = 1e-5 * float(np.abs(want_logits).max())
        np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=tol)
        for got, want in zip(got_caches, want_caches, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
        return
    # the rewrite lowers its masks through a bias (LegalizeGroupedAttention), the functional graph through
    # TVM's causal softmax: two fp16 roundings of one function, each held to the float32 graph's numbers
    _, _, exact_logits, exact_caches = get("float32")
    G.assert_as_accurate_as(got_logits, want_logits, exact_logits)
    for got, want, exact in zip(got_caches, want_caches, exact_caches, strict=True):
        G.assert_as_accurate_as(got, want, exact)


# ------------------------------------------------------------------------------------------ the commands


def test_cli_kv_cache_option():
    from mqa_byoc import cli

    p = cli.build_parser()
    assert p.parse_args(["profile", "build"]).kv_cache == "inplace"
    assert p.parse_args(["profile", "build", "--kv-cache", "functional"]).kv_cache == "functional"
    assert p.parse_args(["demo"]).kv_cache == "inplace"
    assert p.parse_args(["demo", "--kv-cache", "functional"]).kv_cache == "functional"
    assert p.parse_args(["profile", "build", "--kv-cache", "paged"]).kv_cache == "paged"  # the PagedKVCache pair
    with pytest.raises(SystemExit):  # the demo has no paged decoder
        p.parse_args(["demo", "--kv-cache", "paged"])
