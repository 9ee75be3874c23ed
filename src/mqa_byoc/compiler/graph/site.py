"""An attention site (what the analysis found at one root) and the checks every form shares.

:class:`AttentionSite` is filled by the analysis of each form (:mod:`.analysis` for
``R.nn.attention`` and matmul-softmax chains, :mod:`.varlen` for ``R.nn.attention_var_len``);
:func:`common_checks` decides what is the same for all of them: operand layouts, the K/V expansion,
heads, head dim, dtype, batch and K/V lengths. A failed check becomes the site's ``reason``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from tvm import relax

from mqa_byoc.compiler.graph import masks
from mqa_byoc.compiler.graph.sinks import SinkLogits
from mqa_byoc.compiler.graph.spec import MAX_HEAD_DIM, SUPPORTED_DTYPES
from mqa_byoc.compiler.graph.trace import (BROADCAST, TILE, Traced, as_int, describe_axes, describe_stop, prove_equal,
                                          trace)

# fused attention ops: their K/V may have fewer heads than Q (no matmul broadcasting involved)
FUSED_FORMS = ("R.nn.attention", "R.nn.attention_var_len")


@dataclass
class AttentionSite:
    function: str
    root: relax.Var
    form: str  # "R.nn.attention" | "matmul-softmax chain"
    q: Traced | None = None
    k: Traced | None = None
    v: Traced | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None  # Q's and K's
    head_dim_v: int | None = None  # V's: smaller than head_dim when V is padded for the kernels
    dtype: str | None = None
    scale: float | None = None  # None: 1/sqrt(D)
    mask: masks.MaskKind = masks.NO_MASK
    causal_attr: str | None = None  # causal_mask attribute of an R.nn.attention root
    out_labels: list = field(default_factory=list)
    reason: str | None = None
    note: str | None = None
    # why FA2 cannot take K/V before their expansion (a tile of several heads, ...); None: it can
    expansion_problem: str | None = None
    # chain pieces kept for the rewrite
    mask_ops: list = field(default_factory=list)
    # a sink logit per query head appended to the scores (GPT-OSS), see graph.sinks
    sinks: SinkLogits | None = None
    # logit soft-capping (Gemma 2): the scores become softcap * tanh(scores / softcap); None: none
    softcap: float | None = None
    # a sink applied after attention (GraniteSWA): the root is the multiply, this the P @ V matmul before it
    chain_root: relax.Var | None = None

    @property
    def pads_value(self) -> bool:
        """Whether the rewrite pads V with zeros to ``head_dim`` and slices the output back to ``head_dim_v``."""
        return None not in (self.head_dim, self.head_dim_v) and self.head_dim_v < self.head_dim

    @property
    def expansion_ops(self):
        return [op for t in (self.k, self.v) if t is not None for op in t.expansion_ops]

    @property
    def expansion(self):
        return self.k.expansion if self.k is not None else None

    def reject(self, reason):
        if self.reason is None:
            self.reason = reason
        return self


def output_steps(labels) -> tuple[bool, bool]:
    """How the kernels' (B, S, H, D) result becomes a root whose axes are ``labels``: (permute it to
    (B, H, S, D) first, then reshape it to the root's shape), e.g. (True, True) for a 3-D (B*H, S, D) root
    or a grouped (B, Hkv, G, S, D) one, (False, True) for one head's (B, S, D)."""
    heads_first = labels[0] == "BH" or labels[1] in ("H", "H0")
    return heads_first, len(labels) != 4


def require_module(mod, what: str):
    """``what`` takes a whole module: a clear TypeError for anything else (a function, a path)."""
    import tvm

    if not isinstance(mod, tvm.IRModule):
        hint = " (wrap a function: tvm.IRModule({'main': func}))" if isinstance(mod, relax.Function) else ""
        raise TypeError(f"{what} expects a tvm.IRModule (a Relax module), got {type(mod).__name__}{hint}")



def require_flag(value, what: str, allow_none: bool = False):
    """A True/False switch: a clear TypeError for anything else (``mqa="yes"``, a string "False" would
    otherwise count as True); ``allow_none`` where None has a meaning of its own."""
    import numpy as np

    if (value is None and allow_none) or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    expected = "True, False or None" if allow_none else "True or False"
    raise TypeError(f"{what} takes {expected}, got {value!r} ({type(value).__name__})")


# ----------------------------------------------------------------------------- checks
def seq_len(t: Traced):
    return t.shape()[t.labels.index("S")]


def heads_of(t: Traced):
    if t.layout() == "BSH":
        return 1
    return t.shape()[t.labels.index("Hkv" if "Hkv" in t.labels else "H")]


def common_checks(site: AttentionSite) -> AttentionSite:
    """The checks every attention form shares (operand layouts and shapes, K/V expansion, heads,
    head dim, dtype, batch and K/V lengths): the first failing one becomes ``site.reason``."""
    q, k, v = site.q, site.k, site.v
    for name, t in (("K", k), ("V", v)):
        if t.problem:
            site.expansion_problem = f"{name}: {t.problem}"
            return site.reject(site.expansion_problem)
    for name, t in (("Q", q), ("K", k), ("V", v)):
        if t.layout() is None:
            return site.reject(layout_problem(name, t))
        if t.shape() is None:
            return site.reject(f"{name} has an unknown shape")
    # one K/V head without a head axis against a query with heads (PaLM-style multi-query: K/V (B, S, D)
    # shared by every query head through the matmul's broadcast) is MQA; any other mix is not read
    shared_kv = q.layout() != "BSH" and k.layout() == v.layout() == "BSH"
    if len({t.layout() == "BSH" for t in (q, k, v)}) > 1 and not shared_kv:
        return site.reject("Q, K and V mix (B, S, D) single-head operands with operands that have a head axis "
                           f"({', '.join(f'{n} {t.layout()}' for n, t in zip('QKV', (q, k, v)))})")
    if "Hkv" in q.labels:
        return site.reject("the query is expanded")
    if (site.sinks is not None or site.softcap is not None) and any(t.layout() == "SBNH" for t in (q, k, v)):
        return site.reject("sequence-first operands (sequence, batch, heads, head dim) with "
                           f"{'attention sinks' if site.sinks is not None else 'logit soft-capping'}: their "
                           "kernels take batch-first operands only")
    if (k.expansion, k.factor) != (v.expansion, v.factor):
        if None in (k.expansion, v.expansion):
            found, t, missing = ("K", k, "V") if k.expansion else ("V", v, "K")
            site.expansion_problem = (f"{found} is expanded ({t.expansion} x{t.factor}) but no expansion of {missing} "
                                      f"was found: its trace stops at an op it does not pass (e.g. a rotary "
                                      f"embedding applied after the expansion)")
        else:
            site.expansion_problem = (f"K and V are expanded differently ({k.expansion} x{k.factor} vs "
                                      f"{v.expansion} x{v.factor})")
        return site.reject(site.expansion_problem)
    qs, ks, vs = q.shape(), k.shape(), v.shape()
    dtypes = {t.kernel_dtype() for t in (q, k, v)}
    site.dtype = q.kernel_dtype() or str(q.entry_dtype)
    h = as_int(heads_of(q))
    hkv = as_int(heads_of(k))
    d = as_int(qs[q.labels.index("D")])
    dk = as_int(ks[k.labels.index("D")])
    dv = as_int(vs[v.labels.index("D")])
    site.num_q_heads, site.head_dim, site.head_dim_v = h, d, dv
    if k.expansion is None and h is not None and hkv == 1 and h != 1 and site.form not in FUSED_FORMS:
        k.expansion = v.expansion = BROADCAST  # MQA through matmul broadcasting
        k.factor = v.factor = h
    site.num_kv_heads = hkv
    site.expansion_problem = expansion_problem(k, h, hkv)
    if None in (h, hkv, d, dk, dv):
        return site.reject("the head count or head dim is symbolic")
    if None in dtypes or site.dtype not in SUPPORTED_DTYPES:
        return site.reject(f"dtype {site.dtype}: FA2 supports float16 and bfloat16 "
                           "(run relax.transform.ToMixedPrecision first for float32 graphs)")
    if len(dtypes) != 1:
        return site.reject(f"Q, K and V have different dtypes {sorted(dtypes)}")
    problem = head_dims_problem(d, dk, dv)
    if problem:
        return site.reject(problem)
    if k.expansion is None and hkv != h and site.form not in FUSED_FORMS:
        return site.reject(f"{h} query heads against {hkv} K/V heads without an expansion")
    if site.expansion_problem:
        return site.reject(site.expansion_problem)
    if h % hkv:
        return site.reject(f"{h} query heads are not a multiple of {hkv} K/V heads")
    b_q, b_k, b_v = (t.shape()[t.labels.index("B")] for t in (q, k, v))
    if not (prove_equal(b_q, b_k) and prove_equal(b_q, b_v)):
        return site.reject("Q, K and V batch sizes differ")
    if not prove_equal(seq_len(k), seq_len(v)):
        return site.reject("K and V sequence lengths differ")
    problem = scale_problem(site.scale)
    if problem:
        return site.reject(problem)
    return site


def layout_problem(name: str, t: Traced) -> str:
    """Why operand ``name`` traced to ``t`` has no layout the kernels take: its axes as the trace left
    them and where the trace stopped."""
    return (f"{name} reaches attention with axes {describe_axes(t.labels)} where the analysis stops following "
            f"it, at {describe_stop(t)}; the kernels take (batch, sequence, heads, head dim) or "
            f"(batch, heads, sequence, head dim) (or (sequence, batch, heads, head dim), transposed)")


def head_dims_problem(d: int, dk: int, dv: int) -> str | None:
    """Why FA2 cannot take Q, K, V of head dims ``d``, ``dk``, ``dv`` (None: it can). FA2 takes one head
    dim, a multiple of 8 up to :data:`~.spec.MAX_HEAD_DIM`, for all three; a smaller V (multi-head latent
    attention: DeepSeek's 192 for Q/K, 128 for V) is exact padded with zeros to ``d`` on its last axis,
    the output sliced back to ``dv`` (the rewrite does both, see :func:`value_padding_note`)."""
    if dk != d:
        return f"head dims differ (q {d}, k {dk}, v {dv}): FA2 needs one head dim for Q and K"
    if d > MAX_HEAD_DIM or d % 8:
        return f"head dim {d}: FA2 needs a multiple of 8 up to {MAX_HEAD_DIM}"
    if dv > d:
        return (f"head dims differ (q {d}, k {dk}, v {dv}): V's head dim is larger than Q's and K's "
                "(V is padded to theirs only when it is smaller)")
    if dv % 8:
        return (f"head dims differ (q {d}, k {dk}, v {dv}): V's head dim is not a multiple of 8 "
                f"(V is padded with zeros to {d} only from a multiple of 8)")
    return None


def value_padding_note(site: AttentionSite) -> str | None:
    """What padding V costs, for the report's note of a site whose V has the smaller head dim; None
    for the others."""
    if not site.pads_value:
        return None
    d, dv = site.head_dim, site.head_dim_v
    return (f"V is padded with zeros from head dim {dv} to {d} (FA2 takes one head dim for Q, K and V) and "
            f"the output sliced back to {dv}: a padded copy of V ({d / dv:.3g}x its size) before each call, and "
            f"P @ V computed over {d} columns instead of {dv}")


def sequence_first_note(site: AttentionSite) -> str | None:
    """What sequence-first operands cost, for the report's note of a site that has them; None for the others."""
    names = [n for n, t in (("Q", site.q), ("K", site.k), ("V", site.v)) if t is not None and t.layout() == "SBNH"]
    if not names:
        return None
    return (f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} sequence-first (sequence, batch, heads, head dim): "
            "transposed to batch-first before each call (a copy of each; the kernels read batch-first operands)")


def chunk_calls(site: AttentionSite) -> list[tuple[int, int, int, int, int]]:
    """The causal attentions a chunked mask's site runs as (static lengths, proven by the analysis), as
    (first query row, end query row, first key, end key, blocks) each; a query row's position is
    row + S_kv - S_q. The whole blocks of ``site.mask.chunk`` positions that start at or after the first
    query are one call on a batch of ``blocks`` blocks (their rows and keys coincide: each block is c queries
    on c keys); a block that the first query enters midway, and a last block shorter than c, one call each.
    So at most three calls, one when the queries start at a block boundary and end at one."""
    chunk, s_q, s_kv = site.mask.chunk, as_int(seq_len(site.q)), as_int(seq_len(site.k))
    offset = s_kv - s_q
    pos, calls = offset, []
    if pos % chunk:  # the first query's block began before it: its keys from the block's start
        end = min(pos - pos % chunk + chunk, s_kv)
        calls.append((0, end - offset, pos - pos % chunk, end, 1))
        pos = end
    whole = (s_kv - pos) // chunk
    if whole:
        calls.append((pos - offset, pos - offset + whole * chunk, pos, pos + whole * chunk, whole))
        pos += whole * chunk
    if pos < s_kv:
        calls.append((pos - offset, s_q, pos, s_kv, 1))
    return calls


def chunked_note(site: AttentionSite) -> str | None:
    """How a chunked mask's site runs, for the report's note; None for a site without one."""
    chunk = site.mask.chunk
    if chunk is None:
        return None
    calls = chunk_calls(site)
    offset = as_int(seq_len(site.k)) - as_int(seq_len(site.q))
    parts = []
    for _q0, _q1, k0, k1, blocks in calls:
        if blocks > 1:
            parts.append(f"{blocks} whole blocks as one batch (Q, K and V reshaped)")
        elif k0 < offset:
            parts.append("a block the queries enter midway")
        else:
            parts.append("a whole block" if k1 - k0 == chunk else "a short last block")
    n = len(calls)
    return (f"chunked attention (causal within blocks of {chunk} positions): {n} causal kernel "
            f"call{'s' if n != 1 else ''}: {', '.join(parts)}; rows that are not the whole sequence are slices "
            f"(copies){', the outputs concatenated' if n > 1 else ''}")


def scale_problem(scale) -> str | None:
    """Why the kernels cannot take a softmax scale (None: the default 1 / sqrt(D), or a positive one):
    FA2, FA4 and our decode kernel take the running max of the unscaled scores, which is the max of
    the scaled ones only for a positive scale."""
    if scale is None or (math.isfinite(scale) and scale > 0):
        return None
    return f"softmax scale {scale!r}: the kernels need a positive, finite scale"


def expansion_problem(k: Traced, h, hkv) -> str | None:
    if k.expansion is None or None in (h, hkv):
        return None
    if hkv * k.factor != h:
        return f"K/V expanded {hkv} x {k.factor} heads, but the query has {h}"
    if k.expansion == TILE and hkv != 1:
        how = "tile" if k.how is None else f"{k.how} (tile)"
        return f"K/V expanded with {how}: query head h would use K/V head h % H_kv, FA2 uses h // (H / H_kv)"
    return None


def trace_fused_operands(site: AttentionSite, call, bindings, allow_kv_expansion: bool) -> bool:
    """The part every fused attention op shares (``R.nn.attention``, ``R.nn.attention_var_len``): trace
    q, k, v (BSNH) back to their sources, read ``scale`` and ``causal_mask``, run :func:`common_checks`
    and fold a constant multiplied into the query into the scale.

    Returns
    -------
    bool
        False when the checks rejected the site (its ``reason`` says why).
    """
    bsnh = ["B", "S", "H", "D"]
    site.q = trace(call.args[0], bsnh, bindings, allow_expansion=False, fold_scale=True, query=True)
    if scale_problem(site.q.scale):  # a sign flip of the query stays in the graph, the scale positive
        site.q = trace(call.args[0], bsnh, bindings, allow_expansion=False, query=True)
    site.k = trace(call.args[1], bsnh, bindings, allow_expansion=allow_kv_expansion)
    site.v = trace(call.args[2], bsnh, bindings, allow_expansion=allow_kv_expansion)
    site.scale = float(call.attrs.scale.value) if call.attrs.scale is not None else None
    site.causal_attr = call.attrs.causal_mask
    common_checks(site)
    if site.reason:
        return False
    if site.q.scale != 1.0:  # a constant multiplied into the query scales the logits
        site.scale = (site.scale if site.scale is not None else 1.0 / site.head_dim ** 0.5) * site.q.scale
    return True

