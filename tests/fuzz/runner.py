"""Many graphs: run the invariants, shrink the first graph of each distinct violation, summarize."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter, defaultdict

from .gen import GraphSpec, KVGroup, RandomChooser, Site, draw_graph
from .invariants import check_graph


def graph_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def draw(seed: int, index: int, varlen: bool = False) -> GraphSpec:
    return draw_graph(RandomChooser(random.Random(graph_seed(seed, index))), varlen=varlen)


def _keys(result):
    return {(v.invariant, v.key) for v in result.violations}


# ----------------------------------------------------------------------------- shrinking
def _only_site(spec: GraphSpec, i: int) -> GraphSpec:
    site = spec.sites[i]
    return dataclasses.replace(spec, groups=(spec.groups[site.group],), sites=(dataclasses.replace(site, group=0),))


def _candidates(spec: GraphSpec):
    """Simpler variants of a one-site spec, one field at a time (a variant that is not a valid
    graph fails to build and is skipped)."""
    g, s = spec.groups[0], spec.sites[0]
    yield dataclasses.replace(spec, batch=1)
    yield dataclasses.replace(spec, mqa=True)
    for field, value in (("lengths", "static"), ("dtype", "float16"), ("d", 64), ("k_layout", "BSNH"),
                         ("v_layout", g.k_layout), ("share_expansion", False), ("s_kv", 4)):
        yield dataclasses.replace(spec, groups=(dataclasses.replace(g, **{field: value}),))
    default = Site()
    for f in dataclasses.fields(Site):
        if f.name in ("group", "h"):
            continue
        value = getattr(default, f.name)
        if f.name == "s_q" and g.lengths == "static":
            value = g.s_kv
        yield dataclasses.replace(spec, sites=(dataclasses.replace(s, **{f.name: value}),))
    if s.h > g.hkv:
        yield dataclasses.replace(spec, sites=(dataclasses.replace(s, h=g.hkv * 2 if g.hkv * 2 < s.h else s.h),))
    if g.hkv > 1:
        r = s.h // g.hkv
        yield dataclasses.replace(spec, groups=(dataclasses.replace(g, hkv=1),),
                                  sites=(dataclasses.replace(s, h=r if s.expand != "none" else 1),))


def shrink(spec: GraphSpec, key, budget: int = 40, **kw) -> GraphSpec:
    """A smaller spec that still shows the violation ``key`` (invariant, key)."""
    def shows(candidate):
        try:
            return key in _keys(check_graph(candidate, **kw))
        except Exception:  # noqa: BLE001 - an invalid variant
            return False

    tries = 0
    if len(spec.sites) > 1:
        for i in range(len(spec.sites)):
            tries += 1
            cand = _only_site(spec, i)
            if shows(cand):
                spec = cand
                break
    if len(spec.sites) != 1:
        return spec
    spec = _only_site(spec, 0)
    improved = True
    while improved and tries < budget:
        improved = False
        for cand in _candidates(spec):
            if cand == spec:
                continue
            tries += 1
            if tries > budget:
                break
            if shows(cand):
                spec, improved = cand, True
                break
    return spec


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Summary:
    graphs: int = 0
    sites: int = 0
    offloaded: int = 0
    built: int = 0
    rejected: Counter = dataclasses.field(default_factory=Counter)
    violations: dict = dataclasses.field(default_factory=lambda: defaultdict(dict))  # invariant -> key -> info
    infos: Counter = dataclasses.field(default_factory=Counter)
    generator_errors: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def as_json(self):
        return {
            "graphs": self.graphs, "sites": self.sites, "offloaded": self.offloaded, "built": self.built,
            "rejected_by_reason": dict(self.rejected.most_common()),
            "violations": {inv: {k: v for k, v in keys.items()} for inv, keys in self.violations.items()},
            "infos": dict(self.infos.most_common()),
            "generator_errors": self.generator_errors, "seconds": round(self.seconds, 1),
        }

    def total_violations(self):
        return sum(v["count"] for keys in self.violations.values() for v in keys.values())

    def text(self) -> str:
        lines = [f"graphs {self.graphs}, sites {self.sites}, offloaded {self.offloaded}, "
                 f"graphs built for sm_90 {self.built}, {self.seconds:.0f} s"]
        lines.append("rejected by reason:")
        lines += [f"  {n:5d}  {r}" for r, n in self.rejected.most_common()]
        lines.append(f"violations: {self.total_violations()}")
        for inv in sorted(self.violations):
            for key, info in sorted(self.violations[inv].items(), key=lambda kv: -kv[1]["count"]):
                lines.append(f"  [{inv}] {key}: {info['count']} (first: graph {info['graph']})")
                lines.append(f"      {info['message']}")
                lines.append(f"      repro: {info.get('repro', info['spec'])}")
        if self.infos:
            lines.append("not violations (TVM limits, generator/reference gaps):")
            lines += [f"  {n:5d}  {m}" for m, n in self.infos.most_common(10)]
        if self.generator_errors:
            lines.append(f"generator errors: {len(self.generator_errors)} (first: {self.generator_errors[0]})")
        return "\n".join(lines)


def run(graphs: int, seed: int, build_every: int = 1, numerics: bool = True, varlen: bool = False,
        shrink_violations: bool = True, progress=None) -> Summary:
    summary = Summary()
    t0 = time.time()
    for index in range(graphs):
        spec = draw(seed, index, varlen)
        do_build = build_every > 0 and index % build_every == 0
        try:
            res = check_graph(spec, do_build=do_build, do_numerics=numerics, seed=graph_seed(seed, index))
        except Exception as err:  # noqa: BLE001 - the generator built an invalid graph
            summary.generator_errors.append(f"graph {index}: {type(err).__name__}: {str(err)[:200]}")
            continue
        summary.graphs += 1
        summary.sites += res.sites
        summary.offloaded += res.offloaded
        summary.built += int(res.built)
        summary.rejected.update(res.rejected)
        summary.infos.update(m[:140] for m in res.infos)
        for v in res.violations:
            slot = summary.violations[v.invariant]
            if v.key in slot:
                slot[v.key]["count"] += 1
                continue
            info = {"count": 1, "graph": index, "message": v.message, "spec": repr(spec)}
            if shrink_violations:
                small = shrink(spec, (v.invariant, v.key), do_build=do_build, do_numerics=numerics,
                               seed=graph_seed(seed, index))
                info["repro"] = repr(small)
            slot[v.key] = info
        if progress:
            progress(index, res, summary)
    summary.seconds = time.time() - t0
    return summary


__all__ = ["GraphSpec", "KVGroup", "Site", "Summary", "draw", "run", "shrink"]
