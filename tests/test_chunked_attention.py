"""Chunked attention (Llama 4's chunked layers: each query sees the earlier keys of its own block of c
positions): the mask is proven from the graph like a causal one, and the site runs as causal attentions on
blocks: the whole blocks as one call on a batch of blocks (Q, K and V reshaped), a block entered midway or
a short last block as a call of its own, the outputs concatenated. Checked on the CPU against the
unrewritten graph and a NumPy reference, for blocks that split the sequence evenly or not, with queries
that start inside a block (a prefill after a past), and rejected with the reason where the blocks are not
known when compiling."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import tirx

from mqa_byoc import offload_report, partition_for_cutlass
from mqa_byoc.demo import format_report
from mqa_byoc.compiler.graph import masks
from mqa_byoc.testing import graphs as G

F16_MIN = float(np.finfo(np.float16).min)


def chunked_allowed(s_q, s_kv, chunk):
    return G.mask_allowed(s_q, s_kv, "BottomRight", chunk=chunk)


@pytest.mark.parametrize("s_q, s_kv, chunk", [(24, 24, 8), (20, 20, 8), (5, 13, 8), (12, 30, 7), (1, 19, 8),
                                              (9, 9, 3)])
def test_classify_finds_the_block_size(s_q, s_kv, chunk):
    allowed = chunked_allowed(s_q, s_kv, chunk)
    kind = masks.classify_allowed(allowed)
    # a row that sees every key from its block's start: a window where that equals it (one query row)
    if s_q == 1:
        assert kind == masks.MaskKind(True, int(allowed.sum())), kind
    else:
        assert kind == masks.MaskKind(True, None, chunk), kind
    np.testing.assert_array_equal(masks.mask_allows(kind, s_q, s_kv), allowed)


def test_a_mask_one_key_off_a_chunked_one_is_rejected():
    allowed = chunked_allowed(16, 16, 8)
    allowed[12, 3] = True  # a key of the block before
    with pytest.raises(masks.MaskError, match="not a causal, sliding-window or chunked mask"):
        masks.classify_allowed(allowed)


def test_within_one_block_a_chunked_mask_is_causal():
    assert masks.classify_allowed(chunked_allowed(8, 8, 8)) == masks.MaskKind(True, None)


@pytest.mark.parametrize("mask", ["where", "add", "minimum"])
@pytest.mark.parametrize("s_q, s_kv, chunk, calls", [
    (24, 24, 8, 1),  # three whole blocks: one call on a batch of 3 blocks, Q/K/V reshaped
    (20, 20, 8, 2),  # two whole blocks, then a block of 4
    (5, 13, 8, 1),  # the queries start at a block boundary: one short block
    (12, 30, 7, 3),  # a block entered midway, a whole one, a short last one
    (16, 24, 8, 1),  # queries from a boundary after a past: K/V from there, two whole blocks
    (3, 21, 8, 1),  # within one block, entered midway (a prefill's continuation)
])
def test_chunked_chain_runs_the_blocks_as_few_causal_attentions(mask, s_q, s_kv, chunk, calls):
    mod = G.mlc_4d_chain(h=8, hkv=2, d=64, s=s_q, s_kv=s_kv, b=2, mask=mask, chunk=chunk)
    (site,) = offload_report(mod)
    assert site.offloaded and site.chunk == chunk and site.causal == "BottomRight" and site.window is None, site
    assert site.num_kv_heads == 2 and site.expansion_ops_removed == 2
    assert f"{calls} causal kernel call" in site.note and site.composite_calls == calls, site
    part = partition_for_cutlass(mod, gemm=False)
    assert len(G.composites(part)) == calls and G.count_ops(part, "relax.repeat") == 0
    assert G.report_partition_disagreement(mod) == []
    assert f"BottomRight chunk={chunk}" in format_report([site])
    rng = np.random.default_rng(s_q + s_kv)
    q = rng.normal(size=(2, s_q, 8, 64)).astype("float16")
    k = rng.normal(size=(2, s_kv, 2, 64)).astype("float16")
    v = rng.normal(size=(2, s_kv, 2, 64)).astype("float16")
    got = G.rewritten_on_cpu(mod, [q, k, v])  # against the unrewritten graph on the CPU
    want = G.reference_attention(q, k, v, out_layout="merged", causal="BottomRight", chunk=chunk)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_chunked_mask_with_symbolic_lengths_is_rejected_saying_why():
    mod = G.symbolic_mask_chain(lambda i, j, n: tirx.Or(j > i, tirx.floordiv(j, 8) != tirx.floordiv(i, 8)))
    (site,) = offload_report(mod)
    assert not site.offloaded and "chunked attention mask" in site.reason and "block of 8" in site.reason
    assert "symbolic lengths" in site.reason and "static sequence lengths" in site.reason, site.reason
    assert site.composite_calls == 0 and G.composites(partition_for_cutlass(mod, gemm=False)) == []


def test_whole_blocks_of_a_symbolic_batch_run_as_one_call():
    """The batch may stay symbolic (only the lengths must be static): the whole blocks become a batch of
    b * n blocks, and the output permutes the caller wrote around the attention still cancel."""
    b = tirx.Var("b", "int64")
    mod = G.mlc_4d_chain(h=8, hkv=2, d=64, s=48, b=b, mask="where", chunk=16)
    (site,) = offload_report(mod)
    assert site.offloaded and site.chunk == 16 and site.composite_calls == 1, site
    assert "3 whole blocks as one batch" in site.note, site.note
    part = partition_for_cutlass(mod, gemm=False)
    assert len(G.composites(part)) == 1 and G.count_ops(part, "relax.permute_dims") == 0
    assert G.count_ops(part, "relax.strided_slice") == 0  # the blocks span the sequence: reshapes only
    rng = np.random.default_rng(48)
    q = rng.normal(size=(3, 48, 8, 64)).astype("float16")
    k = rng.normal(size=(3, 48, 2, 64)).astype("float16")
    v = rng.normal(size=(3, 48, 2, 64)).astype("float16")
    got = G.rewritten_on_cpu(mod, [q, k, v])
    want = G.reference_attention(q, k, v, out_layout="merged", causal="BottomRight", chunk=16)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
