"""The GPU test's harness on the CPU: PagedLlama built for llvm (TVM's CPU paged kernels), driven by
mqa_byoc.runtime.paged_driver exactly as tests/gpu/test_gpu_paged.py drives the CUDA libraries, against
the driver's fp32 Reference. Proves the harness (cache calls, qkv layout, causal rule, a new sequence
in a second prefill chunk, decode layout, decoder calls) before any GPU time is spent."""

from __future__ import annotations

import dataclasses

import pytest
import tvm

from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama
from mqa_byoc.runtime.paged_driver import DecoderReference, PagedModel, Reference, last_positions

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model():
    cfg = PagedLlamaConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, hidden=32, intermediate=64, layers=2,
                           vocab=32, rope_mode=0, dtype="float32")
    mod, params, _ = export_paged_llama(cfg, {"kind": "llvm"})
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    case = {"config": dataclasses.asdict(cfg), "page_size": {"tir": 16},
            "params": [[n, [int(x) for x in p.shape], str(p.dtype)] for n, p in params]}
    return PagedModel(tvm, torch, ex.mod, case, "tir", device="cpu")


def test_driver_and_reference_agree_with_tvm_kernels(model):
    cfg = model.cfg
    ref = Reference(torch, cfg)
    heads = cfg["num_q_heads"] + 2 * cfg["num_kv_heads"]
    seqs, seqs2 = [0, 1, 2], [0, 1, 2, 3]
    steps = [("prefill", seqs, [1, 7, 20]), ("chunk2", seqs2, [3, 1, 5, 4])]
    steps += [(f"decode{i}", seqs2, [1] * 4) for i in range(2)]
    cache = model.new_cache(4, 200, 64)
    model.add(cache, seqs2)
    gen = torch.Generator().manual_seed(0)
    for name, ids, lengths in steps:
        shape = (len(ids), 1) if name.startswith("decode") else (1, sum(lengths))
        qkv = torch.randn(*shape, heads, cfg["head_dim"], generator=gen)
        want = ref.step(ids, lengths, qkv)
        model.begin(cache, ids, lengths)
        got = model.attend(cache, qkv).clone()
        model.end(cache)
        assert got.shape == want.shape == (*shape, cfg["num_q_heads"], cfg["head_dim"])
        assert float((got - want).abs().max()) < 1e-4, name


def test_decoder_calls(model):
    model.set_params(seed=0)
    cache = model.new_cache(2, 64, 32)
    model.add(cache, [0, 1])
    model.begin(cache, [0, 1], [5, 3])
    prefill = model.logits("prefill", cache, torch.randint(0, 32, (1, 8), dtype=torch.int32))
    model.end(cache)
    model.begin(cache, [0, 1], [1, 1])
    decode = model.logits("decode", cache, torch.randint(0, 32, (2, 1), dtype=torch.int32))
    model.end(cache)
    assert prefill.shape == (1, 8, 32) and decode.shape == (2, 1, 32)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all() and prefill.abs().max() > 0


def test_batch_prefill_gives_each_sequences_last_position(model):
    """batch_prefill over three sequences of a step: the rows of prefill's logits at their last tokens."""
    model.set_params(seed=2)
    lengths = [4, 1, 6]
    ids = torch.randint(0, 32, (1, sum(lengths)), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    got = {}
    for fn in ("prefill", "batch_prefill"):
        cache = model.new_cache(3, 64, 32)
        model.add(cache, [0, 1, 2])
        model.begin(cache, [0, 1, 2], lengths)
        pos = torch.tensor(last_positions(lengths), dtype=torch.int32)
        got[fn] = model.logits(fn, cache, ids, pos if fn == "batch_prefill" else None)
        model.end(cache)
    assert last_positions(lengths) == [3, 4, 10]
    assert got["batch_prefill"].shape == (1, 3, 32)
    want = got["prefill"][:, [3, 4, 10]]
    assert float((got["batch_prefill"] - want).abs().max()) < 1e-5 * float(want.abs().max())
    assert float((got["prefill"][:, [0, 1, 2]] - want).abs().max()) > 1e-3  # other rows differ: it can fail
    with pytest.raises(ValueError, match="needs logit_positions"):
        model.call("batch_prefill", None, None)
    with pytest.raises(ValueError, match="every sequence of a prefill step needs a token"):
        last_positions([3, 0])


def _rope_model():
    cfg = PagedLlamaConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, hidden=32, intermediate=64, layers=2,
                           vocab=32, rope_mode=1, rope_theta=500.0, dtype="float32")
    mod, params, _ = export_paged_llama(cfg, {"kind": "llvm"})
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    case = {"config": dataclasses.asdict(cfg), "page_size": {"tir": 16},
            "params": [[n, [int(x) for x in p.shape], str(p.dtype)] for n, p in params]}
    return PagedModel(tvm, torch, ex.mod, case, "tir", device="cpu")


@pytest.mark.parametrize("rope", [False, True], ids=["rope_none", "rope_normal"])
def test_decoder_reference_matches_tvm_decoder(model, rope):
    """The fp32 decoder oracle of the GPU tests: the llvm build's logits over a prefill, a second chunk
    that starts a sequence, and decode steps (RoPE applied by the cache: mode NORMAL, theta 500)."""
    model = _rope_model() if rope else model
    cfg = model.cfg
    model.set_params(seed=1)
    ref = DecoderReference(torch, cfg, model.weights)
    cache = model.new_cache(3, 96, 32)
    model.add(cache, [0, 1, 2])
    gen = torch.Generator().manual_seed(3)
    steps = [([0, 1], [5, 3]), ([0, 1, 2], [2, 1, 4]), ([0, 1, 2], [1, 1, 1]), ([0, 1, 2], [1, 1, 1])]
    for i, (seqs, lengths) in enumerate(steps):
        decode = all(n == 1 for n in lengths) and i >= 2
        ids = torch.randint(0, cfg["vocab"], (len(seqs), 1) if decode else (1, sum(lengths)), generator=gen,
                            dtype=torch.int32)
        model.begin(cache, seqs, lengths)
        got = model.logits("decode" if decode else "prefill", cache, ids)
        model.end(cache)
        want = ref.step(seqs, lengths, ids)
        assert got.shape == want.shape
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4, f"step {i}"
