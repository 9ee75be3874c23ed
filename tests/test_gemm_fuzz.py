"""The GEMM fuzzer (``mqa_byoc.testing.fuzz.gemm``) on the CPU: a seeded profile of random matmul graphs
holds every invariant, and each invariant catches the fault it is there for (the analysis' checks
switched off one at a time). The long run is ``tools/fuzz.py --gemm``."""

from __future__ import annotations

import dataclasses

import pytest

from mqa_byoc.compiler.graph import gemm as gemm_analysis
from mqa_byoc.testing.fuzz import gemm

SEED = 0


@pytest.fixture(scope="module")
def profile():
    return gemm.run(40, SEED)


def test_random_gemm_graphs_hold_every_invariant(profile):
    assert profile["violations"] == [], gemm.summary_text(profile)


def test_the_profile_draws_both_offloaded_sites_and_each_kind_of_rejection(profile):
    assert 0 < profile["offloaded"] < profile["sites"]
    reasons = " | ".join(profile["reasons"])
    for kind in ("int8 GEMM", "float32 GEMM", "K = # is not a multiple of # elements", "N = # is not a multiple",
                 "x is #-D"):
        assert kind in reasons, reasons


@pytest.mark.parametrize("pipeline", ["fuse_transpose_matmul", "legalize"])
def test_the_same_graphs_lowered_by_tvm_before_the_partition_hold_every_invariant(pipeline):
    # the sites are reported and offloaded alike after TVM's passes, and compute the graph as written
    for graph in range(8):
        spec = dataclasses.replace(gemm.draw(SEED, graph), pipeline=pipeline)
        res = gemm.check_gemm_graph(spec, seed=graph)
        assert not res.violations, (graph, res.violations)
        assert res.sites == len(spec.sites)


def _violations(graph, monkeypatch, name):
    monkeypatch.setattr(gemm_analysis, name, lambda *args, **kwargs: None)
    res = gemm.check_gemm_graph(gemm.draw(SEED, graph), seed=graph)
    return {v.invariant for v in res.violations}


@pytest.mark.parametrize("graph", [1, 39])
def test_a_residual_taken_whatever_its_shape_is_caught_by_the_library_model(graph, monkeypatch):
    assert not gemm.check_gemm_graph(gemm.draw(SEED, graph), seed=graph).violations
    assert "library" in _violations(graph, monkeypatch, "_residual_reason")


@pytest.mark.parametrize("graph", [2, 12, 25])
def test_a_bias_taken_whatever_its_shape_is_caught_by_the_library_model(graph, monkeypatch):
    assert "library" in _violations(graph, monkeypatch, "_bias_reason")


@pytest.mark.parametrize("graph", [0, 9])
def test_a_site_offloaded_that_cublaslt_cannot_take_is_caught(graph, monkeypatch):
    assert "eligibility" in _violations(graph, monkeypatch, "gemm_reason")


def test_broadcast_and_library_shapes():
    assert gemm.broadcast((2, "n"), (1,)) == (2, "n")
    assert gemm.matmul_shape((5, "n", 3), (1, "n"), 8) == (5, "n", 3, 8)
    assert gemm.matmul_shape((), (4,), 8) == (4, 8)
    with pytest.raises(ValueError, match="do not broadcast"):
        gemm.broadcast((2, 3), (4,))
    site = gemm.GemmSiteSpec("float16", 64, 32)
    assert gemm.expected_offload(site, ("n",)) is True
    assert gemm.expected_offload(gemm.GemmSiteSpec("float16", 12, 32), ("n",)) is False
    assert gemm.expected_offload(gemm.GemmSiteSpec("float16", 64, 32, batch=(2,)), (1, "n")) is False
    assert gemm.expected_offload(gemm.GemmSiteSpec("float16", 64, 32, batch=(2,)), (2, "n")) is True
    assert gemm.expected_offload(site, ()) is None


@pytest.mark.parametrize("graph", [2, 7, 16])
def test_an_epilogue_left_lowered_is_caught_by_the_lowering_invariant(graph, monkeypatch):
    # the graph after LegalizeOps holds every invariant; with LegalizeOps' epilogues not read back, its sites
    # are offloaded without the epilogue the graph as written fuses, and the fuzzer says so
    from mqa_byoc.compiler.graph import lowered_matmul

    spec = dataclasses.replace(gemm.draw(SEED, graph), pipeline="legalize")
    assert not gemm.check_gemm_graph(spec, seed=graph, numerics=False).violations
    monkeypatch.setattr(lowered_matmul, "legalized_epilogue_of", lambda *args, **kwargs: None)
    res = gemm.check_gemm_graph(spec, seed=graph, numerics=False)
    assert "lowering" in {v.invariant for v in res.violations}, res.violations
