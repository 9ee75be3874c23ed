"""Tensor-parallel shards of the Llama decoder on the CPU: each shard's graph, run in lockstep with the
all-reduce done as an in-process sum over the shards (mqa_byoc.tp.lockstep), gives the unsharded graph's
logits and, head block by head block, its K/V caches; every shard's attention is offloaded with its
native K/V heads; models that cannot be cut are rejected with a typed error naming the fix."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from mqa_byoc import offload_report  # noqa: E402
from mqa_byoc.models.llama import build_decoder, random_params  # noqa: E402
from mqa_byoc.models.presets import PRESETS, DecoderConfig, scaled  # noqa: E402
from mqa_byoc.tp import ShardingError, plan_for, shard_params  # noqa: E402
from mqa_byoc.tp.lockstep import ALLREDUCE, lockstep_allreduce  # noqa: E402

CPU = tvm.target.Target({"kind": "llvm", "opt-level": 0})

# GQA 16/8 (r = 2), small enough for CPU builds, cut 1, 2, 4 and 8 ways (8/4, 4/2, 2/1 per shard)
TINY = DecoderConfig(name="tiny-gqa", hidden_size=32, num_heads=16, num_kv_heads=8, head_dim=16,
                     intermediate_size=64, vocab_size=48, num_layers=2)


def _allreduces(mod) -> int:
    n = 0

    def visit(e):
        nonlocal n
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.ccl.allreduce":
            n += 1

    for _, f in mod.functions.items():
        if isinstance(f, relax.Function):
            relax.analysis.post_order_visit(f.body, visit)
    return n


@pytest.mark.parametrize("preset", ["llama2-70b", "codellama-34b", "llama3-8b"])
@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_every_shard_offloads_with_native_kv_heads(preset, shards):
    cfg = scaled(preset, num_layers=2, vocab_size=64, hidden_size=64, intermediate_size=256,
                 sliding_window=False)
    mod, spec = build_decoder(cfg, kv_cache="inplace", batch=1, tensor_parallel_shards=shards)
    full = PRESETS[preset]
    h, g = full.num_heads // shards, full.num_kv_heads // shards
    report = offload_report(mod)
    assert len(report) == 2 * cfg.num_layers  # prefill + decode, per layer
    for site in report:
        assert site.offloaded, site.reason
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (h, g, full.head_dim)
        assert site.composite == "flash_attn.attention_mqa"
    qkv = next(p for p in spec if p.name == "layers.0.self_attn.qkv_proj.weight")
    assert qkv.shape == ((h + 2 * g) * full.head_dim, cfg.hidden_size)
    # two all-reduces per layer and function (after o_proj, after down_proj) when sharded
    assert _allreduces(mod) == (0 if shards == 1 else 2 * 2 * cfg.num_layers)


def test_llama2_70b_heads_per_shard():
    got = {n: (plan_for(PRESETS["llama2-70b"], n).heads, plan_for(PRESETS["llama2-70b"], n).kv_heads)
           for n in (1, 2, 4, 8)}
    assert got == {1: (64, 8), 2: (32, 4), 4: (16, 2), 8: (8, 1)}


@pytest.mark.parametrize("cfg, shards, match", [
    (TINY.replace(num_kv_heads=4, name="kv4"), 8, r"4 K/V heads cannot be split over 8 shards.*<= 4"),
    (PRESETS["falcon-7b-mqa"], 2, r"1 K/V heads cannot be split over 2"),
    (TINY.replace(intermediate_size=60, name="odd-mlp"), 8, r"MLP width.*60.*multiple.*\[1, 2, 4\]"),
    (TINY, 0, r"int >= 1"),
])
def test_unshardable_models_are_rejected(cfg, shards, match):
    with pytest.raises(ShardingError, match=match):
        build_decoder(cfg, tensor_parallel_shards=shards)


def test_shard_weights_check_the_shard_build():
    _, full_spec = build_decoder(TINY, functions=("prefill",))
    _, shard_spec = build_decoder(TINY, functions=("prefill",), tensor_parallel_shards=2)
    names = [p.name for p in full_spec]
    full = random_params(full_spec, seed=0)
    parts = [shard_params(names, full, plan_for(TINY, 2), r, expect=shard_spec) for r in range(2)]
    i = names.index("layers.0.self_attn.o_proj.weight")
    np.testing.assert_array_equal(np.concatenate([parts[0][i], parts[1][i]], axis=1), full[i])
    with pytest.raises(ShardingError, match="shard weight"):
        shard_params(names, full, plan_for(TINY, 4), 0, expect=shard_spec)


# ------------------------------------------------------------------------------------- numerics

def _vm(mod):
    return relax.VirtualMachine(tvm.compile(mod, target=CPU), tvm.cpu())


def _t(xs):
    return [tvm.runtime.tensor(np.ascontiguousarray(x)) for x in xs]


def _run_functional(vm, ids, nxt, params):
    logits, caches = vm["prefill"](tvm.runtime.tensor(ids), *params)
    step, caches2 = vm["decode"](tvm.runtime.tensor(nxt), caches, *params)
    return logits.numpy(), step.numpy(), [c.numpy() for c in caches2]


@pytest.fixture(scope="module")
def reference():
    mod, spec = build_decoder(TINY, dtype="float32", logits="all")
    names = [p.name for p in spec]
    full = random_params(spec, seed=3, std=0.1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY.vocab_size, (2, 7)).astype("int32")
    nxt = rng.integers(0, TINY.vocab_size, (2, 1)).astype("int32")
    return names, full, ids, nxt, _run_functional(_vm(mod), ids, nxt, _t(full))


@pytest.mark.slow
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_shards_in_lockstep_equal_the_unsharded_decoder(reference, shards):
    names, full, ids, nxt, (logits, step, caches) = reference
    mod, spec = build_decoder(TINY, dtype="float32", logits="all", tensor_parallel_shards=shards)
    ex = tvm.compile(mod, target=CPU)
    plan = plan_for(TINY, shards)
    weights = [_t(shard_params(names, full, plan, r, expect=spec)) for r in range(shards)]
    with lockstep_allreduce(shards) as ar:
        vms = [relax.VirtualMachine(ex, tvm.cpu()) for _ in range(shards)]
        outs = ar.run(lambda r: _run_functional(vms[r], ids, nxt, weights[r]))
    assert ar.calls == 2 * 2 * TINY.num_layers  # prefill + decode, two per layer
    for r, (lg, st, cs) in enumerate(outs):
        np.testing.assert_allclose(lg, logits, rtol=1e-4, atol=1e-5, err_msg=f"prefill logits, shard {r}")
        np.testing.assert_allclose(st, step, rtol=1e-4, atol=1e-5, err_msg=f"decode logits, shard {r}")
    g = plan.kv_heads
    for i, c in enumerate(caches):  # (B, S_kv, H_kv, D): shard r holds K/V heads [r g, (r + 1) g)
        for r in range(shards):
            np.testing.assert_allclose(outs[r][2][i], c[:, :, r * g:(r + 1) * g], rtol=1e-4, atol=1e-5)
    assert tvm.get_global_func(ALLREDUCE) is not None  # disco's function is back


@pytest.mark.slow
def test_inplace_cache_shards_in_lockstep():
    cfg = TINY.replace(num_layers=1)
    mod, spec = build_decoder(cfg, dtype="float32", logits="all", kv_cache="inplace")
    names = [p.name for p in spec]
    full = random_params(spec, seed=5, std=0.1)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 6)).astype("int32")

    def run(vm, params):
        caches = vm["create_kv_cache"](tvm.runtime.ShapeTuple([16]))
        logits, caches = vm["prefill"](tvm.runtime.tensor(ids[:, :5]), caches, *params)
        step, _ = vm["decode"](tvm.runtime.tensor(ids[:, 5:]), tvm.runtime.ShapeTuple([5]), caches, *params)
        return logits.numpy(), step.numpy()

    want = run(_vm(mod), _t(full))
    smod, sspec = build_decoder(cfg, dtype="float32", logits="all", kv_cache="inplace", tensor_parallel_shards=2)
    ex = tvm.compile(smod, target=CPU)
    weights = [_t(shard_params(names, full, plan_for(cfg, 2), r, expect=sspec)) for r in range(2)]
    with lockstep_allreduce(2) as ar:
        vms = [relax.VirtualMachine(ex, tvm.cpu()) for _ in range(2)]
        outs = ar.run(lambda r: run(vms[r], weights[r]))
    for got in outs:
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ the paged decoder

@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_paged_shards_serve_fa2_with_native_kv_heads(shards):
    from mqa_byoc.compiler.paged import paged_kv_cache_report, page_unit
    from mqa_byoc.models.decoder_libs import PAGED_SERVED
    from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama

    c = PagedLlamaConfig(hidden=64, intermediate=256, layers=1, vocab=64)  # llama2-70b heads 64/8, D 128
    mod, params, _ = export_paged_llama(c, tensor_parallel_shards=shards)
    h, g = 64 // shards, 8 // shards
    served = [d for d in paged_kv_cache_report(mod, page_unit(128)) if d.offloaded]
    assert sorted(d.kernel for d in served) == sorted(PAGED_SERVED)
    assert all(f"_h{h}kv{g}d128" in d.symbol for d in served), [d.symbol for d in served]
    shapes = dict((n, tuple(p.shape)) for n, p in params)
    assert shapes["layers.0.attn.qkv_proj.weight"] == ((h + 2 * g) * 128, 64)
    assert shapes["layers.0.down.weight"] == (64, 256 // shards)
    assert _allreduces(mod) == (0 if shards == 1 else 3 * 2)  # prefill, batch_prefill, decode; one layer


@pytest.mark.slow
@pytest.mark.parametrize("shards", [2, 4])
def test_paged_shards_in_lockstep_equal_the_unsharded_decoder(shards):
    import dataclasses

    torch = pytest.importorskip("torch")
    from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama
    from mqa_byoc.runtime.paged_driver import PagedModel

    cfg = PagedLlamaConfig(num_q_heads=8, num_kv_heads=4, head_dim=16, hidden=32, intermediate=64, layers=2,
                           vocab=32, rope_mode=0, dtype="float32")
    llvm = {"kind": "llvm"}

    def model(n):
        mod, params, _ = export_paged_llama(cfg, llvm, tensor_parallel_shards=n)
        ex = tvm.compile(mod, target=tvm.target.Target(llvm))
        case = {"config": dataclasses.asdict(cfg), "page_size": {"tir": 16},
                "params": [[k, [int(x) for x in p.shape], str(p.dtype)] for k, p in params]}
        return ex, case, [k for k, _ in params]

    rng = np.random.default_rng(2)
    ex1, case1, names = model(1)
    full = [(rng.standard_normal(shape) * 0.1 + (1.0 if "norm" in k else 0.0)).astype("float32")
            for k, shape, _ in case1["params"]]
    ids = rng.integers(0, cfg.vocab, (1, 9)).astype("int32")
    nxt = rng.integers(0, cfg.vocab, (2, 1)).astype("int32")

    def run(ex, case, weights):
        m = PagedModel(tvm, torch, ex.mod, case, "tir", device="cpu")
        m.params = [tvm.runtime.tensor(w) for w in weights]
        cache = m.new_cache(2, 64, 16)
        m.add(cache, [0, 1])
        m.begin(cache, [0, 1], [5, 4])
        pre = m.call("prefill", cache, tvm.runtime.tensor(ids)).numpy()
        m.end(cache)
        m.begin(cache, [0, 1], [1, 1])
        dec = m.call("decode", cache, tvm.runtime.tensor(nxt)).numpy()
        m.end(cache)
        return pre, dec

    want = run(ex1, case1, full)
    ex, case, snames = model(shards)
    assert snames == names
    plan = plan_for(cfg, shards)
    weights = [shard_params(names, full, plan, r) for r in range(shards)]
    with lockstep_allreduce(shards) as ar:
        outs = ar.run(lambda r: run(ex, case, weights[r]))
    assert ar.calls == 2 * 2 * cfg.layers
    for r, (pre, dec) in enumerate(outs):
        np.testing.assert_allclose(pre, want[0], rtol=1e-4, atol=1e-5, err_msg=f"prefill, shard {r}")
        np.testing.assert_allclose(dec, want[1], rtol=1e-4, atol=1e-5, err_msg=f"decode, shard {r}")


def test_scatter_shards_stacks_cut_weights_and_broadcasts_the_rest():
    from mqa_byoc.tp import scatter_shards, shard_weight

    class Session:  # what scatter_shards uses of a disco session
        num_workers = 4

        def __init__(self):
            self.calls = []

        def scatter(self, x):
            self.calls.append(("scatter", x))
            return len(self.calls)

        def broadcast(self, x):
            self.calls.append(("broadcast", x))
            return len(self.calls)

    _, spec = build_decoder(TINY, functions=("prefill",))
    names = [p.name for p in spec]
    full = random_params(spec, seed=1)
    plan = plan_for(TINY, 4)
    sess = Session()
    assert scatter_shards(sess, names, full, plan) == list(range(1, len(names) + 1))
    for (kind, x), name, w in zip(sess.calls, names, full):
        if name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            assert kind == "scatter" and x.shape[0] == 4
            for r in range(4):
                np.testing.assert_array_equal(x[r], shard_weight(name, w, plan, r))
        else:
            assert kind == "broadcast" and x.shape == w.shape
    with pytest.raises(ShardingError, match="4 workers, the plan 2 shards"):
        scatter_shards(sess, names, full, plan_for(TINY, 2))


@pytest.mark.slow
def test_separate_projections_shard_in_lockstep():
    cfg = TINY.replace(fused_projections=False, num_layers=1, name="tiny-separate")
    mod, spec = build_decoder(cfg, dtype="float32", logits="all", functions=("prefill",))
    names = [p.name for p in spec]
    assert "layers.0.self_attn.k_proj.weight" in names and "layers.0.mlp.up_proj.weight" in names
    full = random_params(spec, seed=9, std=0.1)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 5)).astype("int32")
    want = _vm(mod)["prefill"](tvm.runtime.tensor(ids), *_t(full))[0].numpy()
    smod, sspec = build_decoder(cfg, dtype="float32", logits="all", functions=("prefill",), tensor_parallel_shards=2)
    ex = tvm.compile(smod, target=CPU)
    weights = [_t(shard_params(names, full, plan_for(cfg, 2), r, expect=sspec)) for r in range(2)]
    with lockstep_allreduce(2) as ar:
        vms = [relax.VirtualMachine(ex, tvm.cpu()) for _ in range(2)]
        outs = ar.run(lambda r: vms[r]["prefill"](tvm.runtime.tensor(ids), *weights[r])[0].numpy())
    for got in outs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
