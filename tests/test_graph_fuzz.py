"""The fuzzer's short profile: random attention graphs, every invariant.

One property test per invariant family, all drawing the same seeded examples (their checks are
computed once and shared), the graphs of every bug found so far first. The long run is ``tools/fuzz.py``.

Profiles (environment variable ``MQA_FUZZ_PROFILE``): ``mqa-fuzz-ci`` (the default: the known-bug
graphs below plus 10 seeded random graphs, no shrinking, sm_90 builds for every 2nd random graph) and
``mqa-fuzz-dev`` (200 graphs drawn through hypothesis, shrunk on failure, every graph built).
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

from mqa_byoc.testing.fuzz.gen import GraphSpec, HypothesisChooser, KVGroup, RandomChooser, Site, draw_graph
from mqa_byoc.testing.fuzz.invariants import check_graph

_COMMON = dict(deadline=None, database=None, derandomize=False, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
settings.register_profile("mqa-fuzz-ci", max_examples=10, phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.register_profile("mqa-fuzz-dev", max_examples=200, **_COMMON)
PROFILE = os.environ.get("MQA_FUZZ_PROFILE", "mqa-fuzz-ci")
BUILD_EVERY = 2 if PROFILE == "mqa-fuzz-ci" else 1
SEED = 20261130

_RESULTS = {}  # spec -> GraphResult, shared by the tests below


def _specs():
    """CI: a seed per example, the graph drawn from it with ``random.Random`` (the whole
    distribution from the first example on; hypothesis' own draws start from the simplest graphs).
    dev: the graph drawn through hypothesis, which then shrinks a failing one."""
    if PROFILE == "mqa-fuzz-ci":
        return st.integers(0, 2**32 - 1).map(lambda s: draw_graph(RandomChooser(random.Random(s))))
    return st.composite(lambda draw: draw_graph(HypothesisChooser(draw)))()


def _result(spec):
    if spec not in _RESULTS:
        index = len(_RESULTS)
        _RESULTS[spec] = check_graph(spec, do_build=spec in KNOWN or index % BUILD_EVERY == 0, seed=index)
    return _RESULTS[spec]


# The shrunk graphs of the bugs the first long runs found (src/mqa_byoc/testing/fuzz/known_violations.md, all fixed),
# checked first by every property test so that none comes back.
KNOWN = (
    # native RunCodegen: composite parameters (2, 0, 1) when only V is BNSH
    GraphSpec(groups=(KVGroup(hkv=1, v_layout="BNSH", s_kv=4),), sites=(Site(h=2, s_q=4),)),
    # an R.nn.attention and a 3-D chain on the same BNSH K/V: reported offloaded, neither partitioned
    GraphSpec(groups=(KVGroup(k_layout="BNSH", v_layout="BNSH"),),
              sites=(Site(expand="none", h=2), Site(form="chain3d", expand="none", h=2, scale=0.125))),
    # window_size without causal, S_q <= S_kv not provable: reported offloaded, not partitioned
    GraphSpec(groups=(KVGroup(lengths="indep"),), sites=(Site(s_q="n", window=4, window_without_causal=True),)),
    # float32 scale astype'd to fp16: reported / passed unrounded
    GraphSpec(groups=(KVGroup(hkv=1, s_kv=4),),
              sites=(Site(form="chain4d", h=2, s_q=4, scale=0.35355339059327373, scale_cast=True),)),
    # where() mask before the 1/8 scale: rejected
    GraphSpec(sites=(Site(form="chain4d", causal="BottomRight", scale=0.125, mask_first=True, mask_op="where"),)),
    # tile-expanded site with S_q > S_kv causal: the reason names the tile
    GraphSpec(groups=(KVGroup(hkv=4, s_kv=4),), sites=(Site(expand="tile", s_q=9, causal="BottomRight"),)),
    # runtime bias with S_q > S_kv: the reason is "no sample sequence lengths", not the runtime bias
    GraphSpec(groups=(KVGroup(s_kv=4),), sites=(Site(form="chain4d", s_q=6, scale=0.125, mask_op="runtime_bias"),)),
    # constant bias with static S_q > S_kv (long run, seed 7, graph 508): the reason named the lengths, not the bias
    GraphSpec(groups=(KVGroup(hkv=1, s_kv=4), KVGroup(hkv=1, s_kv=4)),
              sites=(Site(group=1, form="chain3d", h=2, s_q=11, scale=0.125, mask_op="const_bias", fill="-inf",
                          mask_dims=3),)),
    # attention with sinks: its Codegen function had no global_symbol (RunCodegen failed with both providers)
    GraphSpec(groups=(KVGroup(k_layout="BNSH", v_layout="BNSH", s_kv=8),),
              sites=(Site(form="chain4d", expand="hf", causal="BottomRight", mask_op="add", scale=0.125,
                          score_mod="sinks"),)),
    # soft-capping and an op no form explains on the scores: reported, rejected with their reasons
    GraphSpec(sites=(Site(form="chain4d", scale=0.125, score_mod="softcap"),
                     Site(form="chain3d", scale=0.125, score_mod="unknown"))),
    # soft-capping in Gemma 2's order (scale, tanh, then the causal mask): offloaded with its cap; the
    # soft-cap of the masked scores (the mask inside the tanh): rejected naming it
    GraphSpec(groups=(KVGroup(k_layout="BNSH", v_layout="BNSH", s_kv=8),),
              sites=(Site(form="chain4d", expand="hf", causal="BottomRight", mask_op="add", scale=0.125,
                          score_mod="softcap"),
                     Site(form="chain4d", expand="hf", causal="BottomRight", mask_op="where", scale=0.125,
                          score_mod="softcap", softcap_first=False))),
    # sites written outside an R.dataflow() block: reported offloaded, none partitioned (FuseOpsByPattern
    # groups dataflow bindings only)
    GraphSpec(sites=(Site(form="chain4d", causal="BottomRight", mask_op="add", scale=0.125),
                     Site(expand="hf", h=8)), dataflow=False),
    # a sink applied after attention on tile-expanded K/V (offloaded with the expansion kept): the retry on the
    # expanded K/V found the site at the multiply, the first pass at P @ V, and the site stayed rejected
    GraphSpec(groups=(KVGroup(hkv=4, s_kv=17),),
              sites=(Site(form="chain4d", expand="tile", h=16, s_q=1, causal="BottomRight", scale=0.125,
                          mask_op="where", score_mod="sinks", sink_at="output"),)),
)


def _property(*invariants):
    def check(spec):
        res = _result(spec)
        bad = [v for v in res.violations if v.invariant in invariants]
        assert not bad, "\n".join(f"[{v.invariant}] {v.key}: {v.message}" for v in bad) + f"\nrepro: {res.spec!r}"

    test = given(_specs())(check)
    for spec in reversed(KNOWN):
        test = example(spec)(test)
    return seed(SEED)(settings(settings.get_profile(PROFILE))(test))


def test_report_and_partition_agree():
    _property("report")()


def test_offloaded_sites_build_with_native_provider():
    _property("build-native")()


def test_offloaded_sites_build_with_python_provider():
    _property("build-python")()


def test_reported_parameters_equal_the_generators():
    _property("truth")()


def test_rewrite_numerics_equal_the_reference():
    _property("numerics")()


def test_verdicts_and_reasons_are_accurate():
    _property("verdict", "reason")()


def test_no_exception_escapes():
    _property("exception")()


def test_reason_keys_count_reasons_by_their_words():
    """The run's rejection counts key each reason by its words: without the quoted op names and the details in
    parentheses that differ between graphs, and never empty (a reason that starts with an op's name)."""
    from mqa_byoc.testing.fuzz.invariants import reason_key

    softcap = ("'relax.where' inside the soft-capping tanh (only constant scales of the scores: the kernels "
               "soft-cap before the mask)")
    assert reason_key(softcap) == "'…' inside the soft-capping tanh"
    assert reason_key(softcap.replace("relax.where", "relax.add")) == reason_key(softcap)
    assert reason_key("unsupported op 'relax.cumsum' in the chain") == "unsupported op '…' in the chain"
    assert reason_key("head dim 12: FA2 needs a multiple of 8 up to 256") == "head dim 12: FA2 needs a multiple of 8 up to 256"
    assert reason_key("(B, S) operands") == "(B, S) operands"
    assert reason_key("") == ""
