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


def draw(seed: int, index: int, varlen: bool = True) -> GraphSpec:
    return draw_graph(RandomChooser(random.Random(graph_seed(seed, index))), varlen=varlen)


def _keys(result):
    return {(v.invariant, v.key) for v in result.violations}


# ----------------------------------------------------------------------------- shrinking
def _only_sites(spec: GraphSpec, keep) -> GraphSpec:
    """The spec with the sites ``keep`` (indices) and the groups they read."""
    groups = sorted({spec.sites[i].group for i in keep})
    sites = tuple(dataclasses.replace(spec.sites[i], group=groups.index(spec.sites[i].group)) for i in keep)
    return dataclasses.replace(spec, groups=tuple(spec.groups[g] for g in groups), sites=sites)


def _replace_group(spec, gi, **kw):
    groups = list(spec.groups)
    groups[gi] = dataclasses.replace(groups[gi], **kw)
    return dataclasses.replace(spec, groups=tuple(groups))


def _replace_site(spec, si, **kw):
    sites = list(spec.sites)
    sites[si] = dataclasses.replace(sites[si], **kw)
    return dataclasses.replace(spec, sites=tuple(sites))


def _candidates(spec: GraphSpec):
    """Simpler variants of a spec, one change at a time (invalid ones are skipped by the caller)."""
    n = len(spec.sites)
    for i in range(n):  # fewer sites
        if n > 1:
            yield _only_sites(spec, [j for j in range(n) if j != i])
    yield dataclasses.replace(spec, batch=1)
    yield dataclasses.replace(spec, mqa=True)
    for gi, g in enumerate(spec.groups):
        for field, value in (("lengths", "static"), ("dtype", "float16"), ("d", 64), ("k_layout", "BSNH"),
                             ("v_layout", g.k_layout), ("share_expansion", False), ("s_kv", 4)):
            yield _replace_group(spec, gi, **{field: value})
        if g.lengths != "static":  # static lengths, S_q = S_kv
            cand = _replace_group(spec, gi, lengths="static")
            for si, s in enumerate(spec.sites):
                if s.group == gi:
                    cand = _replace_site(cand, si, s_q=g.s_kv)
            yield cand
        if g.hkv > 1:  # fewer K/V heads, the same group size
            cand = _replace_group(spec, gi, hkv=1)
            for si, s in enumerate(spec.sites):
                if s.group == gi:
                    cand = _replace_site(cand, si, h=max(1, s.h // g.hkv))
            yield cand
    default = Site()
    for si, s in enumerate(spec.sites):
        g = spec.groups[s.group]
        for f in dataclasses.fields(Site):
            if f.name in ("group", "h"):
                continue
            value = getattr(default, f.name)
            if f.name == "s_q":
                value = g.s_kv if g.lengths == "static" else s.s_q
            yield _replace_site(spec, si, **{f.name: value})
        if s.h > 2 * g.hkv:
            yield _replace_site(spec, si, h=2 * g.hkv)


def valid(spec: GraphSpec) -> bool:
    """Whether the fields are consistent (the generator only draws consistent specs)."""
    for s in spec.sites:
        g = spec.groups[s.group]
        masked = s.causal is not None or s.window is not None
        if s.mask_op in ("where", "add", "minmax") and not masked:
            return False
        if s.mask_op in ("runtime_mask", "runtime_bias", "const_bias") and masked and s.form != "fused":
            return False
        if s.form == "fused" and s.mask_op not in ("none", "runtime_bias"):
            return False
        if s.form == "fused" and s.mask_op == "runtime_bias" and masked:
            return False
        if s.mask_src == "const" and g.lengths != "static" or s.mask_op == "const_bias" and g.lengths != "static":
            return False
        if s.h % g.hkv or (s.form != "fused" and s.expand == "none" and s.h != g.hkv):
            return False
        if s.expand in ("broadcast", "matmul_bcast") and g.hkv != 1 or s.expand == "matmul_bcast" and s.form != "chain4d":
            return False
        if s.window is not None and s.causal != "BottomRight" and not s.window_without_causal:
            return False
        if s.window_without_causal and (s.form != "fused" or s.causal is not None or s.window is None):
            return False
        if s.chunk is not None and (s.form == "fused" or s.causal != "BottomRight" or s.window is not None
                                    or s.mask_op not in ("where", "add", "minmax")):
            return False
        want_sq = {"concat1": 1, "same": "n", "concat": "n"}.get(g.lengths)
        if want_sq is not None and s.s_q != want_sq or g.lengths == "static" and not isinstance(s.s_q, int):
            return False
        if g.lengths == "indep" and s.s_q not in ("n", 1):
            return False
    return True


def shrink(spec: GraphSpec, key, budget: int = 20, **kw) -> GraphSpec:
    """A smaller spec that still shows the violation ``key`` (invariant, key)."""
    def shows(candidate):
        if not valid(candidate):
            return False
        try:
            return key in _keys(check_graph(candidate, **kw))
        except Exception:  # noqa: BLE001 - an invalid variant
            return False

    tries = 0
    improved = True
    while improved and tries < budget:
        improved = False
        for cand in _candidates(spec):
            if cand == spec or not valid(cand):
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


def run(graphs: int, seed: int, build_every: int = 1, numerics: bool = True, varlen: bool = True,
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
                small = shrink(spec, (v.invariant, v.key), do_build=do_build and v.invariant.startswith("build"),
                               do_numerics=numerics and v.invariant == "numerics", seed=graph_seed(seed, index))
                info["repro"] = repr(small)
            slot[v.key] = info
        if progress:
            progress(index, res, summary)
    summary.seconds = time.time() - t0
    return summary


__all__ = ["GraphSpec", "KVGroup", "Site", "Summary", "draw", "run", "shrink"]


def markdown(data: dict) -> str:
    """The distinct violations of a run (``Summary.as_json()``) with their shrunk graphs as TVMScript."""
    from .build import build_module

    out = [f"Run: {data.get('graphs')} graphs (seed {data.get('seed')}), {data.get('sites')} sites, "
           f"{data.get('offloaded')} offloaded.", ""]
    for inv, keys in sorted(data["violations"].items()):
        for key, info in sorted(keys.items(), key=lambda kv: -kv[1]["count"]):
            spec_text = info.get("repro", info["spec"])
            spec = eval(spec_text, {"GraphSpec": GraphSpec, "KVGroup": KVGroup, "Site": Site})  # noqa: S307
            out += [f"### [{inv}] {key}", "", f"{info['count']} times; first in graph {info['graph']}: "
                    f"{info['message']}", "", "```python", f"spec = {spec_text}", "```", "", "```python",
                    build_module(spec).mod.script(show_meta=False).strip(), "```", ""]
    return "\n".join(out)
