"""The invariants checked on one generated graph.

1. ``report``: offload_report and partition_for_cutlass agree: a site reported offloaded is in a
   ``flash_attn`` composite after the partition, and no other attention is;
2. ``build-native`` / ``build-python``: a module with offloaded sites goes through RunCodegen and
   ``relax.build`` for sm_90 with both providers;
3. ``truth``: reported (and composite) heads, K/V heads, head dim, dtype, causal kind, window, chunk (and
   how many composites a chunked mask's site becomes) and scale equal the generator's;
4. ``numerics``: the canonicalized graph (LegalizeGroupedAttention, built for llvm) equals a NumPy
   reference of the generated graph (query head h reads K/V head h // group);
5. ``verdict`` / ``reason``: offloaded exactly when the generator says FA2 computes the site, and a
   rejection names one of its real causes;
6. ``exception``: nothing raises out of report / partition / codegen / build.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax, te, tirx, topi

import mqa_byoc
from mqa_byoc.compiler.codegen.dispatch import spec_of
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
from mqa_byoc.compiler.partition import canonicalize_attention
from mqa_byoc.contract import CODEGEN

from . import build as B
from .gen import GraphSpec
from .oracle import expect

CUDA = {"kind": "cuda", "arch": "sm_90"}
TOLERANCE = {"float16": 2.5e-2, "bfloat16": 8e-2, "float32": 2e-3}


@dataclass
class Violation:
    invariant: str
    key: str  # what makes two violations the same bug (for the summary)
    message: str
    site: int | None = None


@dataclass
class GraphResult:
    spec: GraphSpec
    sites: int = 0
    offloaded: int = 0
    rejected: dict = field(default_factory=dict)  # reason -> count
    violations: list = field(default_factory=list)
    infos: list = field(default_factory=list)  # not product bugs (TVM limits, generator gaps)
    built: bool = False

    def add(self, invariant, key, message, site=None):
        self.violations.append(Violation(invariant, key, message, site))


def _first_line(err):
    text = f"{type(err).__name__}: {err}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # TVM errors put the message last
    return (lines[0] if len(lines) < 3 else lines[0] + " ... " + lines[-1])[:300]


def _error_key(err) -> str:
    """An error message without the names and numbers that differ between graphs."""
    import re

    text = _first_line(err)
    text = re.sub(r"\(fused_\w+\)", "(...)", text)
    text = re.sub(r"\(\d+(, \d+)*\)", "(...)", text)
    return re.sub(r"\d+", "N", text)[:120]


def reason_key(reason: str) -> str:
    """A rejection reason without what differs between graphs (quoted op names, parenthesized details), for
    counting; never empty for a non-empty reason (one that starts with an op's name keeps its words)."""
    import re

    key = re.sub(r"'[^']*'", "'…'", reason).split("(")[0].strip()[:70]
    return key or reason.strip()[:70]


# ----------------------------------------------------------------------------- partition mapping
def _ancestor_params(func, expr):
    values = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
    out, stack, seen = set(), [expr], set()
    while stack:
        e = stack.pop()
        if isinstance(e, relax.Var):
            if e in seen:
                continue
            seen.add(e)
            if e in values:
                stack.append(values[e])
            else:
                out.add(e.name)
        elif isinstance(e, relax.Call):
            stack.extend(a for a in e.args if isinstance(a, relax.Expr))
        elif isinstance(e, relax.Tuple):
            stack.extend(e.fields)
        elif isinstance(e, relax.TupleGetItem):
            stack.append(e.tuple_value)
    return out


def offloaded_calls(mod):
    """[(set of site indices whose query reaches the call, codegen function)] for main's calls of attention
    functions (``Codegen`` flash_attn; the GEMMs a rejected site's matmuls became are not attention)."""
    codegen = {gv: f for gv, f in mod.functions.items()
               if isinstance(f, relax.Function) and f.attrs is not None and str(f.attrs.get("Codegen", "")) == CODEGEN}
    main = mod["main"]
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op in codegen:
            names = _ancestor_params(main, e)
            sites = {int(n[1:]) for n in names if n.startswith("q") and n[1:].isdigit()}
            found.append((sites, codegen[e.op]))

    relax.analysis.post_order_visit(main.body, visit)
    return found


# ----------------------------------------------------------------------------- CPU lowering
def _attention_te(q, k, v, bias, scale, causal, window):
    """R.nn.attention as its documentation means it, in float32: query head h reads K/V head
    h // (H / H_kv); TopLeft / BottomRight causal; a window of ``window`` keys (TVM 0.27 legalizes
    neither windows nor K/V lengths that are expressions such as ``p + n``)."""
    b, s, h, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    r = int(h) // int(hkv)
    f32 = "float32"
    rd = te.reduce_axis((0, d), "rd")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(int(d))
    logits = te.compute((b, h, s, skv), lambda bi, hi, i, j: te.sum(
        q[bi, i, hi, rd].astype(f32) * k[bi, j, hi // r, rd].astype(f32) * tirx.const(sc, f32), axis=rd))
    if bias is not None:
        logits = topi.add(logits, topi.cast(bias, f32))

    def visible(i, j):
        diag = i if causal == "TopLeft" else i + skv - s
        conds = [j <= diag] if causal is not None or window is not None else []
        if window is not None:
            conds.append(j > diag - window)
        return tirx.all(*conds) if conds else tirx.const(True, "bool")

    masked = te.compute(logits.shape, lambda bi, hi, i, j: tirx.Select(
        visible(i, j), logits[bi, hi, i, j], tirx.const(-math.inf, f32)))
    p = topi.nn.softmax(masked, axis=-1)
    rj = te.reduce_axis((0, skv), "rj")
    out = te.compute((b, s, h, dv), lambda bi, i, hi, dd: te.sum(
        p[bi, hi, i, rj] * v[bi, rj, hi // r, dd].astype(f32), axis=rj))
    return topi.cast(out, q.dtype)


def _legalize_attention(bb, call):
    bias = call.args[3] if len(call.args) > 3 else None
    window = int(call.attrs.window_size) if call.attrs.window_size is not None else None
    return bb.call_te(_attention_te, call.args[0], call.args[1], call.args[2], bias, call.attrs.scale,
                      call.attrs.causal_mask, window, primfunc_name_hint="reference_attention")


def cpu_module(mod):
    """What the CPU runs: grouped attention repeated by the product's pass, then every attention
    lowered by :func:`_attention_te`."""
    mod = LegalizeGroupedAttention()(mod)
    table = {"relax.nn.attention": _legalize_attention, "relax.nn.attention_bias": _legalize_attention}
    return relax.transform.LegalizeOps(table)(mod)


# ----------------------------------------------------------------------------- the checks
def check_graph(spec: GraphSpec, do_build: bool = True, do_numerics: bool = True, seed: int = 0) -> GraphResult:
    res = GraphResult(spec, sites=len(spec.sites))
    built = B.build_module(spec)  # a failure here is a generator bug: let it raise
    mod = built.mod
    try:
        report = mqa_byoc.offload_report(mod, mqa=spec.mqa)
    except Exception as err:  # noqa: BLE001
        res.add("exception", f"offload_report: {type(err).__name__}", _first_line(err))
        return res
    by_root = {}
    for r in report:
        if not r.output.startswith("root") or r.output in by_root:
            res.add("report", "unknown or duplicate report entry", f"report entry {r.output}: {r}")
            continue
        by_root[r.output] = r
    expects = [expect(spec, i) for i in range(len(spec.sites))]
    reported_off = set()
    for i, site in enumerate(spec.sites):
        # a sink applied after attention: the site's root is the multiply when it is a sink site
        r = by_root.get(f"root{i}_sink") or by_root.get(f"root{i}")
        if r is None:
            res.add("report", f"{site.form} site not reported", f"site {i} ({site.form}) missing from the report", i)
            continue
        if r.offloaded:
            res.offloaded += 1
            reported_off.add(i)
        else:
            key = reason_key(r.reason or "")
            res.rejected[key] = res.rejected.get(key, 0) + 1
        _check_verdict(res, i, spec, expects[i], r)
    try:
        part = mqa_byoc.partition_for_cutlass(mod, mqa=spec.mqa)
    except Exception as err:  # noqa: BLE001
        res.add("exception", f"partition_for_cutlass: {type(err).__name__}", _first_line(err))
        return res
    _check_partition(res, spec, expects, reported_off, part)
    if do_build and reported_off:
        res.built = True
        left_to_tvm = bool(reported_off - {i for sites, _ in offloaded_calls(part) for i in sites})
        for provider in ("native", "python"):
            _check_build(res, spec, mod, provider, left_to_tvm)
    if do_numerics:
        _check_numerics(res, spec, built, seed)
    return res


def _check_verdict(res, i, spec, e, r):
    site = spec.sites[i]
    if e.offload is None:
        return
    if r.offloaded and not e.offload:
        causes = "; ".join(label for label, _ in e.causes)
        res.add("verdict", f"offloaded although {e.causes[0][0]}", f"site {i}: offloaded, but {causes}", i)
        return
    if not r.offloaded and e.offload:
        key = e.known_bug or f"rejected: {reason_key(r.reason)} ({site.form})"
        res.add("verdict", key, f"site {i} ({site.form}, {site.expand}, mask {site.mask_op}) rejected: {r.reason}", i)
        return
    if not r.offloaded:
        reason = r.reason or ""
        if e.known_bug and "large negative constant" in reason:
            # the mask-before-scale rejection comes first and hides the real cause
            res.add("reason", e.known_bug, f"site {i}: reason {reason!r}; real causes: "
                    + ", ".join(label for label, _ in e.causes), i)
            return
        if not any(any(kw in reason for kw in kws) for _, kws in e.causes):
            causes = ", ".join(label for label, _ in e.causes)
            res.add("reason", f"reason '{reason_key(reason)}' for {e.causes[0][0]}",
                    f"site {i}: reason {reason!r}; real causes: {causes}", i)
        return
    # offloaded, as expected: the reported parameters
    got = dict(num_q_heads=r.num_q_heads, num_kv_heads=r.num_kv_heads, head_dim=r.head_dim, dtype=r.dtype,
               causal=r.causal, window=r.window, chunk=r.chunk, composite_calls=r.composite_calls)
    want = dict(num_q_heads=e.num_q_heads, num_kv_heads=e.num_kv_heads, head_dim=e.head_dim, dtype=e.dtype,
                causal=e.causal, window=e.window, chunk=e.chunk, composite_calls=e.composite_calls)
    for name in got:
        if got[name] != want[name]:
            res.add("truth", f"report {name} ({site.form}, {site.expand})",
                    f"site {i}: report {name}={got[name]!r}, generator {want[name]!r}", i)
    if not math.isclose(r.scale, e.scale, rel_tol=1e-6):
        res.add("truth", f"report scale ({site.form}{', astype' if site.scale_cast else ''})",
                f"site {i}: report scale={r.scale!r}, the graph multiplies by {e.scale!r}", i)
    if e.note_tile and not (r.note and "tile" in r.note):
        res.add("truth", "tile kept without a note", f"site {i}: note {r.note!r}", i)


def _check_partition(res, spec, expects, reported_off, part):
    calls = offloaded_calls(part)
    part_off = set()
    for sites, func in calls:
        if len(sites) != 1:
            res.add("report", "composite not mapped to one site", f"composite reads queries of sites {sorted(sites)}")
            continue
        (i,) = sites
        part_off.add(i)
        e = expects[i]
        try:
            s = spec_of(func)
        except Exception as err:  # noqa: BLE001
            res.add("exception", f"spec_of: {type(err).__name__}", _first_line(err), i)
            continue
        if i in reported_off and e.offload:
            got = (s.num_q_heads, s.num_kv_heads, s.head_dim, s.dtype, s.causal, s.window_left)
            want = (e.num_q_heads, e.composite_kv_heads, e.head_dim, e.dtype, e.causal is not None or
                    e.window is not None, -1 if e.window is None else e.window - 1)
            if got != want:
                res.add("truth", f"composite parameters ({spec.sites[i].form})",
                        f"site {i}: composite (h, kv, d, dtype, causal, window_left)={got}, generator {want}", i)
            if not math.isclose(s.softcap, e.softcap or 0.0, rel_tol=1e-6):
                res.add("truth", "composite softcap", f"site {i}: composite softcap {s.softcap!r}, generator "
                        f"{e.softcap!r}", i)
            if (s.sinks_dtype is not None) != e.sinks:
                res.add("truth", "composite sinks", f"site {i}: composite sinks {s.sinks_dtype!r}, generator "
                        f"{'sinks' if e.sinks else 'none'}", i)
            if not math.isclose(s.scale, e.scale, rel_tol=1e-6):
                res.add("truth", f"composite scale ({spec.sites[i].form}"
                        f"{', astype' if spec.sites[i].scale_cast else ''})",
                        f"site {i}: composite scale {s.scale!r}, the graph multiplies by {e.scale!r}", i)
    for i in sorted(reported_off - part_off):
        site = spec.sites[i]
        res.add("report", f"reported offloaded, not partitioned ({site.form}"
                f"{', window without causal' if site.window_without_causal else ''})",
                f"site {i}: reported offloaded, but no flash_attn composite computes it", i)
    for i in sorted(part_off - reported_off):
        res.add("report", "partitioned, not reported offloaded", f"site {i}: in a composite, report says rejected", i)
    for i in sorted(part_off):  # one composite a site; a chunked mask's site one to three (oracle.chunk_calls)
        made, want = sum(1 for s, _ in calls if s == {i}), expects[i].composite_calls if expects[i].offload else 1
        if made != want:
            res.add("report", "site in two composites" if want == 1 else "chunked site's composites",
                    f"site {i}: {made} composites, expected {want}", i)


def _check_build(res, spec, mod, provider, left_to_tvm=False):
    target = tvm.target.Target(CUDA)
    try:
        part = mqa_byoc.partition_for_cutlass(mod, mqa=spec.mqa, provider=provider)
        with target:
            part = relax.transform.RunCodegen()(part)
    except Exception as err:  # noqa: BLE001
        res.add(f"build-{provider}", f"RunCodegen: {_error_key(err)}", _first_line(err))
        return
    try:
        with target:
            relax.build(part, target=target)
    except Exception as err:  # noqa: BLE001
        msg = _first_line(err)
        try:  # the same graph without the partition: if TVM cannot build that either, it is TVM's
            with target:
                relax.build(LegalizeGroupedAttention()(mod), target=target)
        except Exception:  # noqa: BLE001
            if left_to_tvm:  # a site reported offloaded was left to TVM, which cannot build it
                res.add(f"build-{provider}", f"relax.build of a reported-offloaded site left to TVM: {_error_key(err)}",
                        msg)
            else:
                res.infos.append(f"TVM cannot build the unpartitioned graph for CUDA either: {msg}")
            return
        res.add(f"build-{provider}", f"relax.build: {_error_key(err)}", msg)


def _compare(res, spec, outs, refs, what):
    bad = []
    for i, (got, want) in enumerate(zip(outs, refs)):
        if want is None:
            continue
        dt = spec.groups[spec.sites[i].group].dtype
        tol = TOLERANCE[dt] * (2 if not spec.sites[i].softmax_f32 else 1)
        defined = np.isfinite(want)
        err = np.abs(got - want)
        ok = (err <= tol + tol * np.abs(want)) | ~defined
        if not ok.all():
            worst = float(np.nanmax(np.where(defined, err, 0)))
            bad.append((i, worst))
    return bad


def _check_numerics(res, spec, built, seed):
    if any(s.form == "varlen" for s in spec.sites):
        return  # TVM 0.27 cannot lower R.nn.attention_var_len on the CPU (no legalization)
    rng = np.random.default_rng(seed)
    values = B.concrete(built, rng)
    inputs = B.make_inputs(built, values, rng)
    refs = B.reference(built, inputs, values)
    if all(r is None for r in refs):
        return
    try:
        rewritten = canonicalize_attention(built.mod, mqa=spec.mqa)
    except Exception as err:  # noqa: BLE001
        res.add("exception", f"canonicalize_attention: {type(err).__name__}", _first_line(err))
        return
    try:
        outs = B.run_llvm(cpu_module(rewritten), built, inputs)
    except Exception as err:  # noqa: BLE001
        try:
            B.run_llvm(cpu_module(built.mod), built, inputs)
        except Exception as err2:  # noqa: BLE001
            res.infos.append(f"original graph does not run on llvm either: {_first_line(err2)}")
            return
        res.add("numerics", f"rewritten graph fails on llvm: {_first_line(err)[:80]}", _first_line(err))
        return
    bad = _compare(res, spec, outs, refs, "rewritten")
    if not bad:
        return
    # triage: does the original graph agree with the reference? if not, the generator is wrong
    try:
        orig = B.run_llvm(cpu_module(built.mod), built, inputs)
        orig_bad = {i for i, _ in _compare(res, spec, orig, refs, "original")}
    except Exception as err:  # noqa: BLE001
        orig_bad = set()
        res.infos.append(f"original graph does not run on llvm: {_first_line(err)}")
    for i, worst in bad:
        site = spec.sites[i]
        if i in orig_bad:
            res.infos.append(f"site {i}: the original graph differs from the NumPy reference too "
                             f"(generator/TVM, not the rewrite): max error {worst:.3g}")
            continue
        res.add("numerics", f"rewrite changes the result ({site.form}, {site.expand}, mask {site.mask_op})",
                f"site {i}: values {n_sym(values)}: max abs error {worst:.3g} vs the reference", i)


def n_sym(values):
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items())) or "static"

