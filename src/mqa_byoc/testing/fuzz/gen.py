"""Random attention graph specs.

A ``GraphSpec`` is plain data (its ``repr`` is a repro): K/V groups (the K/V tensors, possibly shared
by several sites) and attention sites reading them. ``draw_graph(chooser)`` draws one; the chooser is
either :class:`RandomChooser` (``random.Random``, for ``tools/fuzz.py``) or
:class:`HypothesisChooser` (``st.data()``, for pytest, so hypothesis can shrink). Options are listed
simplest first: hypothesis shrinks towards the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPES = ("float16", "bfloat16", "float32")
# head dims FA2 supports, then ones it does not (not a multiple of 8, above 256)
GOOD_HEAD_DIMS = (64, 128, 32, 8, 16, 40, 80, 96, 160, 192, 256)
BAD_HEAD_DIMS = (12, 260, 320, 512)


def _compact_repr(self):
    """Only the fields that differ from the defaults: a short, eval-able repro."""
    from dataclasses import fields

    parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
             if getattr(self, f.name) != f.default]
    return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(frozen=True, repr=False)
class KVGroup:
    """K and V tensors of ``hkv`` heads, read by one or more sites.

    ``lengths``: "static" (S_kv = ``s_kv``), "same" (S_q = S_kv = n), "concat" (K/V are
    ``concat(past, new)`` of lengths p and n: S_kv = p + n, S_q = n), "concat1" (the same with one
    new token: decode), "indep" (S_kv = m, unrelated to S_q)."""

    hkv: int = 2
    d: int = 64
    dtype: str = "float16"
    k_layout: str = "BSNH"  # "BSNH" | "BNSH"
    v_layout: str = "BSNH"
    lengths: str = "static"
    s_kv: int = 8
    share_expansion: bool = False  # sites with the same expansion reuse one expansion op

    __repr__ = _compact_repr


@dataclass(frozen=True, repr=False)
class Site:
    """One attention. ``form``: "fused" (R.nn.attention), "chain4d", "chain3d" ((B*H, S, D) batched
    matmuls), "varlen" (R.nn.attention_var_len; ``varlen=False`` leaves it out).

    ``expand``: how K/V reach the query head count: "repeat", "hf" (expand_dims -> 5-D
    broadcast_to -> reshape), "hf_reshape" (the same, the unit axis added by a reshape), "broadcast"
    (size-1 head), "tile", "none" (fused: fewer heads given
    directly), "matmul_bcast" (chain4d, one K/V head broadcast by the matmul)."""

    group: int = 0
    form: str = "fused"
    expand: str = "repeat"
    h: int = 8
    q_layout: str = "BSNH"
    out_layout: str = "BSNH"  # "BSNH" | "BNSH" | "merged" (B, S, H*D)
    s_q: int | str = 8  # static int, or "n" (symbolic), or 1 with symbolic S_kv (decode)
    causal: str | None = None  # None | "TopLeft" | "BottomRight"
    window: int | None = None
    window_without_causal: bool = False  # fused only: window_size with causal_mask=None
    chunk: int | None = None  # chains, BottomRight without a window: causal within blocks of this many positions
    scale: float | None = None  # fused: the scale attribute; chains: the softmax scale (1/sqrt(d))
    q_prescale: float | None = None  # fused: q multiplied by a constant first
    scale_op: str = "multiply"  # chains: "multiply" by scale | "divide" by 1/scale
    scale_cast: bool = False  # chains: the constant is float32, astype'd to the dtype
    mask_first: bool = False  # chains: the mask is applied before the scale
    mask_op: str = "none"  # "none" | "where" | "add" | "minmax" | "runtime_mask" | "runtime_bias" | "const_bias"
    mask_src: str = "positions"  # "positions" (arange, comparisons) | "const" (a constant tensor)
    where_drop: bool = False  # where(not(cond), fill, scores) instead of where(cond, scores, fill)
    fill: str = "min"  # "min" (dtype's lowest finite) | "-inf"
    mask_dims: int = 4  # chain3d: mask applied to a 4-D view (HF) or directly to 3-D scores
    softmax_f32: bool = True  # astype float32 around the softmax
    # chains: where(cond, 0, softmax) after the softmax: "safe" (torch's safe softmax: rows whose scores
    # are all -inf, compared on a second astype of the scores as ToMixedPrecision leaves it) | "any" (rows
    # with any -inf score: not what the kernels do) | "probs": where(not(scores == -inf), p, 0), a mask applied
    # to the probabilities after the softmax (zero where a score is -inf; all-masked rows become 0, not NaN)
    row_guard: str = "none"
    # chains: what happens to the logits before softmax besides scale and mask: "sinks" (chain4d: GPT-OSS's
    # per-head sink logit concatenated on the key axis, the row maximum subtracted, the column sliced off
    # after softmax), "softcap" (tanh(x / 30) * 30, Gemma 2), "unknown" (sin(x): nothing the kernels compute)
    score_mod: str = "none"
    sinks_dtype: str = "float32"
    # "sinks": "logits" (GPT-OSS's extra column) | "output" (GraniteSWA: the attention output times
    # sigmoid(logsumexp(scores) - sink), the log-sum-exp of the softmax's input)
    sink_at: str = "logits"
    # "softcap": applied to the scaled scores before the mask (Gemma 2's order, what the kernels compute),
    # else to the masked scores (tanh turns a masked score into -30: not what the kernels compute)
    softcap_first: bool = True

    __repr__ = _compact_repr


@dataclass(frozen=True, repr=False)
class GraphSpec:
    groups: tuple = (KVGroup(),)
    sites: tuple = (Site(),)
    batch: int | str = 1  # int or "b" (symbolic)
    mqa: bool = True
    dataflow: bool = True  # False: the sites written outside an R.dataflow() block (plain TVMScript)

    __repr__ = _compact_repr


# ----------------------------------------------------------------------------- choosers
class RandomChooser:
    def __init__(self, rng):
        self.rng = rng

    def choice(self, options):
        return self.rng.choice(list(options))

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)

    def chance(self, p):
        return self.rng.random() < p


class HypothesisChooser:
    """``draw``: the draw function of ``st.composite`` (or ``st.data()``'s ``.draw``)."""

    def __init__(self, draw):
        from hypothesis import strategies as st

        self.draw, self.st = getattr(draw, "draw", draw), st

    def choice(self, options):
        return self.draw(self.st.sampled_from(list(options)))

    def integer(self, lo, hi):
        return self.draw(self.st.integers(lo, hi))

    def chance(self, p):
        # shrinks towards False (the simpler graph)
        return self.draw(self.st.integers(0, 999)) >= 1000 - int(p * 1000)


# ----------------------------------------------------------------------------- drawing
def _draw_group(c) -> KVGroup:
    dtype = "float16" if c.chance(0.55) else c.choice(("bfloat16", "float32"))
    d = c.choice(GOOD_HEAD_DIMS) if not c.chance(0.12) else c.choice(BAD_HEAD_DIMS)
    hkv = c.choice((1, 2, 4, 1, 3, 8))
    k_layout = c.choice(("BSNH", "BNSH"))
    v_layout = k_layout if not c.chance(0.25) else c.choice(("BSNH", "BNSH"))
    lengths = "static" if c.chance(0.5) else c.choice(("same", "concat", "concat1", "indep"))
    s_kv = c.integer(1, 24)
    return KVGroup(hkv, d, dtype, k_layout, v_layout, lengths, s_kv, c.chance(0.3))


def _draw_site(c, gi, g: KVGroup, varlen: bool) -> Site:
    forms = ("fused", "chain4d", "chain3d") + (("varlen",) if varlen else ())
    form = c.choice(forms)
    if g.hkv == 1:
        expands = ("broadcast", "repeat", "hf", "hf_reshape", "none", "tile") + (("matmul_bcast",) if form == "chain4d" else ())
    else:
        expands = ("repeat", "hf", "hf_reshape", "none", "tile")
    expand = c.choice(expands)
    r = c.choice((2, 4, 1, 8, 3))
    if expand == "broadcast" and g.hkv != 1:
        expand = "repeat"
    if form != "fused" and expand == "none":
        r = 1  # an explicit chain cannot multiply Q by fewer K/V heads without an expansion
    # (H not a multiple of H_kv cannot be written: R.nn.attention's type inference refuses it, and
    # a chain's matmul does not broadcast it)
    h = max(1, min(g.hkv * r, 64))
    if expand in ("broadcast", "matmul_bcast") and h == 1:
        expand = "none"
    # sequence lengths
    if g.lengths == "static":
        if c.chance(0.4):
            s_q = g.s_kv
        elif c.chance(0.85):
            s_q = c.integer(1, g.s_kv)
        else:
            s_q = c.integer(g.s_kv + 1, g.s_kv + 8)
    elif g.lengths == "concat1":
        s_q = 1
    elif g.lengths == "indep":
        s_q = "n" if c.chance(0.6) else 1
    else:
        s_q = "n"
    causal = c.choice((None, "BottomRight", "TopLeft", "BottomRight"))
    window = c.integer(1, 40) if c.chance(0.25) else None
    window_without_causal = False
    if window is not None:
        if form == "fused" and causal is None and c.chance(0.3):
            window_without_causal = True
        elif causal != "BottomRight":
            causal = "BottomRight"  # a window is bottom-right aligned
    d = g.d
    default = 1.0 / math.sqrt(d)
    site = dict(group=gi, form=form, expand=expand, h=h, s_q=s_q, causal=causal, window=window,
                window_without_causal=window_without_causal,
                q_layout=c.choice(("BSNH", "BNSH")), out_layout=c.choice(("BSNH", "BNSH", "merged")))
    if form != "varlen" and c.chance(0.12):
        site["q_layout"] = "SBNH"  # sequence first (nn.MultiheadAttention's), transposed by the rewrite
    if form in ("fused", "varlen"):
        site["scale"] = c.choice((None, default, 0.1, 1.0, -0.2)) if c.chance(0.5) else None
        if form == "fused" and c.chance(0.15):
            site["q_prescale"] = c.choice((0.5, 2.0, 0.3))
        if form == "fused" and causal is None and window is None and c.chance(0.12):
            site["mask_op"] = "runtime_bias"
        return Site(**site)
    site["scale"] = default if not c.chance(0.15) else c.choice((0.1, 1.0, 0.3))
    site["scale_op"] = c.choice(("multiply", "divide"))
    site["scale_cast"] = c.chance(0.3)
    site["mask_first"] = c.chance(0.3)
    if causal is not None or window is not None:
        site["mask_op"] = c.choice(("where", "add", "minmax")) if not c.chance(0.1) else "runtime_mask"
        if site["mask_op"] == "runtime_mask":  # the runtime mask is the only mask
            site.update(causal=None, window=None)
    else:
        site["mask_op"] = "none" if c.chance(0.7) else c.choice(("runtime_mask", "runtime_bias", "const_bias"))
        if site["mask_op"] == "const_bias" and g.lengths != "static":
            site["mask_op"] = "runtime_bias"
    static = g.lengths == "static"
    site["mask_src"] = "const" if static and c.chance(0.35) else "positions"
    site["where_drop"] = c.chance(0.3)
    site["fill"] = c.choice(("min", "-inf"))
    site["mask_dims"] = c.choice((4, 3)) if form == "chain3d" else 4
    site["softmax_f32"] = c.chance(0.7)
    if causal == "BottomRight" and window is None and site["mask_op"] in ("where", "add", "minmax") \
            and c.chance(0.2):
        site["chunk"] = c.integer(2, 12)  # Llama 4's chunked layers
    site["row_guard"] = "none" if c.chance(0.7) else c.choice(("safe", "safe", "any", "probs"))
    # a chunked site with a score modification is rejected: keep most of them plain, so that the rewrite of
    # the blocks (batched whole blocks, a block entered midway, a short last block) is drawn often
    plain = 0.85 if site.get("chunk") else 0.6
    site["score_mod"] = "none" if c.chance(plain) else c.choice(("sinks", "sinks", "sinks", "softcap", "unknown"))
    site["softcap_first"] = c.chance(0.7)
    if site["score_mod"] == "sinks":
        if form == "chain3d":  # GPT-OSS's sinks are 4-D
            site["score_mod"] = c.choice(("none", "softcap"))
        else:
            site["row_guard"] = "none"  # the sink keeps every row defined
            site["sinks_dtype"] = "float32" if c.chance(0.6) else g.dtype
            site["sink_at"] = "output" if c.chance(0.35) else "logits"
    return Site(**site)


def draw_graph(c, varlen: bool = True) -> GraphSpec:
    """One random graph: 1-2 K/V groups, 1-3 sites."""
    groups = [_draw_group(c)]
    if c.chance(0.3):
        groups.append(_draw_group(c))
    n_sites = 1 if c.chance(0.55) else c.integer(2, 3)
    sites = []
    for _ in range(n_sites):
        gi = c.integer(0, len(groups) - 1)
        sites.append(_draw_site(c, gi, groups[gi], varlen))
    batch = c.choice((1, 2, 1, 3, 4)) if not c.chance(0.15) else "b"
    mqa = not c.chance(0.15)
    return GraphSpec(tuple(groups), tuple(sites), batch, mqa=mqa, dataflow=not c.chance(0.15))
