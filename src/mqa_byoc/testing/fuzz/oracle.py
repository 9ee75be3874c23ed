"""The generator's ground truth: what the partition should decide for each site, and why.

Independent of the code under test: it is derived from the ``Site`` fields and FA2's contract
(README "What is matched" / "Rejected"), not from the analysis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .build import allowed_np, lowest, rounded, softcap_before_mask
from .gen import GraphSpec, KVGroup, Site

# keyword alternatives a rejection reason must contain one of, per cause
DTYPE = ("dtype",)
HEAD_DIM = ("head dim",)
HEADS = ("not a multiple", "cannot share")
RUNTIME = ("runtime input",)
BIAS = ("neither 0 nor", "bias")
TOP_LEFT = ("TopLeft", "top-left", "same causal", "no sample", "S_q <= S_kv")
SQ_LE_SKV = ("S_q <= S_kv", "no sample", "hides every key")
MASK_BEFORE_SCALE = "mask applied before a scale that brings its fill above -1e4"
ROW_GUARD = ("every score of the row is -inf",)
PROB_MASK = ("masked after the softmax",)
SOFTCAP = ("soft-capping",)
UNKNOWN_MOD = ("unsupported op", "cannot prove")
SCALE = ("positive, finite scale",)
SEQ_FIRST = ("sequence-first",)
CHUNK_SYMBOLIC = ("symbolic lengths", "same causal", "no sample")
CHUNK_WITH_MOD = ("chunked attention mask",)


@dataclass
class Expect:
    offload: bool | None  # None: no expectation (a form whose meaning is not settled)
    causes: list = field(default_factory=list)  # (label, keyword alternatives) of each rejection cause
    num_q_heads: int | None = None
    num_kv_heads: int | None = None  # as offload_report gives it
    composite_kv_heads: int | None = None  # as the composite passes them to FA2
    head_dim: int | None = None
    dtype: str | None = None
    softcap: float | None = None  # the soft-cap an offloaded site reports (the generator's 30)
    causal: str | None = None  # report's causal
    window: int | None = None
    chunk: int | None = None  # report's chunk: the smallest block size whose chunked mask is the graph's
    composite_calls: int = 1  # composites an offloaded site becomes (a chunked one: chunk_calls)
    scale: float | None = None
    note_tile: bool = False  # offloaded with the expansion kept (tile)
    sinks: bool = False  # offloaded as attention with sinks
    known_bug: str | None = None  # a known issue that makes the analysis disagree with this truth


def _lengths(site: Site, g: KVGroup):
    """(static S_q or None, static S_kv or None, S_q == S_kv provable, S_q <= S_kv provable)."""
    if g.lengths == "static":
        sq, skv = site.s_q, g.s_kv
        return sq, skv, sq == skv, sq <= skv
    if g.lengths == "same":
        return None, None, True, True
    if g.lengths == "concat":
        return None, None, False, True
    if g.lengths == "concat1":
        return 1, None, False, True
    # indep: S_kv = m unrelated (m >= 1, so one query row is never more than the keys)
    return (1, None, False, True) if site.s_q == 1 else (None, None, False, False)


def _chain_mask_kind(site: Site, g: KVGroup, sq, skv):
    """(report causal, report window, report chunk) of a chain mask that FA2 can compute."""
    if site.mask_op in ("none", "runtime_bias", "runtime_mask", "const_bias"):
        return None, None, None
    if sq is not None and skv is not None:
        a = allowed_np(site, sq, skv)
        if a.all():
            return None, None, None
        i = np.arange(sq)[:, None]
        j = np.arange(skv)[None, :]
        diag = i + (skv - sq)
        if np.array_equal(a, j <= diag):
            return "BottomRight", None, None
        if site.chunk is not None:
            if sq == 1:  # one row: the keys from its block's start, a window of that many
                return "BottomRight", int(a.sum()), None
            # the smallest block size with the same mask (at these lengths a larger one can be the same)
            chunk = next(c for c in range(1, skv + 1) if np.array_equal(a, (j <= diag) & (j // c == diag // c)))
            return "BottomRight", None, chunk
        return "BottomRight", site.window, None
    if sq == 1:  # one query row over a symbolic S_kv
        return ("BottomRight", site.window, None) if site.window is not None else (None, None, None)
    return "BottomRight", site.window, None


def chunk_calls(sq: int, skv: int, chunk: int) -> int:
    """Causal attentions a chunked site runs as: of the blocks of ``chunk`` keys that hold a query position
    (row + S_kv - S_q), those whose every position is a query's (c queries on c keys) together in one call,
    each other one (entered midway, or shorter) alone."""
    first = skv - sq
    held = [(start, min(start + chunk, skv)) for start in range(0, skv, chunk) if min(start + chunk, skv) > first]
    whole = [b for b in held if b[0] >= first and b[1] - b[0] == chunk]
    return len(held) - len(whole) + (1 if whole else 0)


def expect(spec: GraphSpec, i: int) -> Expect:
    site = spec.sites[i]
    g = spec.groups[site.group]
    mqa = spec.mqa
    e = Expect(offload=True, num_q_heads=site.h, head_dim=g.d, dtype=g.dtype)
    sink_after, plain_attention = site.score_mod == "sinks" and site.sink_at == "output", False
    sq, skv, eq, le = _lengths(site, g)
    if g.dtype not in ("float16", "bfloat16"):
        e.causes.append(("dtype", DTYPE))
    if g.d % 8 or g.d > 256:
        e.causes.append(("head dim", HEAD_DIM))
    if site.h % g.hkv:
        e.causes.append(("heads not a multiple", HEADS))
    fused = site.form in ("fused", "varlen")
    if site.mask_op in ("runtime_mask", "runtime_bias"):
        e.causes.append(("runtime mask/bias", RUNTIME))
    if site.mask_op == "const_bias":
        e.causes.append(("constant bias", BIAS))
    if site.causal == "TopLeft" and not eq:
        e.causes.append(("TopLeft with S_q != S_kv", TOP_LEFT))
    masked = site.causal is not None or site.window is not None
    if fused and site.scale is not None and not (site.scale > 0 and math.isfinite(site.scale)):
        # the kernels take the running max of the unscaled scores: a negative scale would overflow it
        e.causes.append(("a softmax scale that is not positive", SCALE))
    if fused:
        if masked and site.causal != "TopLeft" and not le:
            e.causes.append(("causal where S_q <= S_kv is not provable", SQ_LE_SKV))
    elif site.mask_op in ("where", "add", "minmax"):
        if not le and not (sq == 1 and site.window is None and site.causal == "BottomRight"):
            e.causes.append(("causal where S_q <= S_kv is not provable", SQ_LE_SKV))
    if site.row_guard == "any":
        e.causes.append(("rows zeroed where any score is -inf", ROW_GUARD))
    elif site.row_guard == "probs":
        e.causes.append(("probabilities masked after the softmax", PROB_MASK))
    # soft-capping is offloaded (FA2's soft-capping families) when nothing but constant scales is inside the
    # tanh: the mask after it, as in Gemma 2
    if site.score_mod == "softcap" and site.mask_op != "none" and not (site.softcap_first and not site.mask_first):
        e.causes.append(("a mask inside the soft-capping tanh", SOFTCAP))
    if site.score_mod == "softcap" and site.row_guard != "none" and not softcap_before_mask(site):
        # the generator's guard then compares the scores before the tanh, not the softmax's input: not provable
        e.causes.append(("a row guard on the scores before the soft-cap", ROW_GUARD))
    elif site.score_mod == "unknown":
        e.causes.append(("unknown score modification", UNKNOWN_MOD))
    if site.chunk is not None and site.mask_op in ("where", "add", "minmax"):
        if sq is None or skv is None:  # sampled at lengths past the block size: chunked there
            e.causes.append(("a chunked mask with symbolic lengths", CHUNK_SYMBOLIC))
        elif _chain_mask_kind(site, g, sq, skv)[2] is not None and site.score_mod in ("sinks", "softcap"):
            if sink_after:
                plain_attention = True
            else:
                e.causes.append(("a chunked mask with sinks or soft-capping", CHUNK_WITH_MOD))
    if site.q_layout == "SBNH" and site.score_mod in ("sinks", "softcap"):
        if sink_after:
            plain_attention = True
        else:
            # the sinks' and soft-capping's kernels take batch-first operands only
            e.causes.append(("sinks or soft-capping on a sequence-first query", SEQ_FIRST))
    e.offload = not e.causes
    if site.form == "varlen":
        # being added: only the rejections FA2 itself forces are expected
        e.causes = [c for c in e.causes if c[0] in ("dtype", "head dim")]
        e.offload = False if e.causes else None
    if site.window_without_causal:
        e.offload = None  # window_size without a causal mask: what it means is not settled
    # what an offloaded site reports
    expanded_op = site.expand in ("repeat", "hf", "hf_reshape", "broadcast", "tile") and site.h != g.hkv
    tile_kept = site.expand == "tile" and g.hkv > 1 and site.h != g.hkv
    if mqa and not tile_kept:
        e.num_kv_heads = g.hkv
    else:
        e.num_kv_heads = site.h if expanded_op else g.hkv
    e.composite_kv_heads = e.num_kv_heads if mqa else site.h
    e.note_tile = mqa and tile_kept
    # a sink applied after attention that no sink kernel can take: the softmax chain is offloaded as plain
    # attention and the scaling stays in the graph
    e.sinks = site.score_mod == "sinks" and not plain_attention
    e.softcap = 30.0 if site.score_mod == "softcap" else None
    if fused:
        e.causal = site.causal if site.causal is not None else ("BottomRight" if site.window else None)
        e.window = site.window
        s = site.scale if site.scale is not None else 1.0 / math.sqrt(g.d)
        if site.q_prescale is not None:
            s *= rounded(site.q_prescale, g.dtype)
        e.scale = s
    else:
        e.causal, e.window, e.chunk = _chain_mask_kind(site, g, sq, skv)
        if e.chunk is not None:
            e.composite_calls = chunk_calls(sq, skv, e.chunk)
        if site.scale_op == "multiply":
            e.scale = rounded(site.scale, g.dtype)
        else:
            e.scale = 1.0 / rounded(1.0 / site.scale, g.dtype)
        finite_fill = site.fill == "min" or site.mask_op == "minmax"  # minmax also clamps at the lowest
        if site.mask_first and site.mask_op in ("where", "add", "minmax") and finite_fill \
                and lowest(g.dtype) * e.scale > -1.0e4:
            e.known_bug = MASK_BEFORE_SCALE
    return e

