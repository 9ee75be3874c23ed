"""The GEMMs of a profiled decoder, kernel by kernel, against the GPU's limits.

A ``mqa-byoc profile run`` record knows the model's shapes (the sidecar: layers, heads, hidden and MLP
sizes, vocabulary, projections, the prefill's logits), so it knows every GEMM a step runs and its M, N
and K: per layer ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` (or HF's separate q/k/v and
gate/up), then ``lm_head``. :func:`gemm_table` maps the recorded GPU kernels onto them:

- from the launch order (``launches`` of a phase, recorded since the GEMM table exists): the GEMM
  kernels of a step (cuBLASLt's ``nvjet``/``gemm``/``gemv`` kernels, TVM's ``NT_matmul``/``matmul``
  ones) run in the model's order, so the i-th is GEMM ``i mod G``; a cuBLASLt split-K reduction kernel
  is counted with the GEMM it follows;
- from the per-kernel totals alone (older records): each kernel name (TVM's fused variants of one
  ``NT_matmulN`` PrimFunc together) runs some GEMMs; the assignment is the one whose instance counts
  add up and whose rates are the most even, and a kernel shared by several GEMMs gives each the share of
  its time that their minimum times have. Split-K reductions are then a row of their own.

Per GEMM: the bytes it must move (x, W and the output once, 2 bytes an element for fp16/bf16) and its
FLOPs (2 M N K), its time per call, TB/s and TFLOP/s, and the fraction of the limit it reaches: the
time at the limit (bytes at :data:`HBM_TBPS` or FLOPs at :data:`DENSE_TFLOPS`, whichever is longer) over
the time it took. Decode GEMMs are bound by the bytes (the weight), prefill GEMMs by the FLOPs. The
limits are those of the GPU the record was measured on (:mod:`.gpu_limits`: the record's own, else its
GPU's data sheet); :data:`HBM_TBPS` and :data:`DENSE_TFLOPS` (the H200's) only for a record naming none.

Run time and report only: no TVM, no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..testing.cupti import is_attention_kernel
from .gpu_limits import DEFAULT, GpuLimits, record_limits

#: the H200's HBM bandwidth (TB/s) and dense fp16/bf16 tensor-core rate (TFLOP/s): the limits of a record
#: that names no GPU
HBM_TBPS = DEFAULT.hbm_tbps
DENSE_TFLOPS = DEFAULT.dense_tflops

GEMM_KERNEL = re.compile(r"nvjet|gemm|gemv|xmma|matmul", re.IGNORECASE)
SPLIT_K_REDUCE = re.compile(r"splitKreduce|splitK_reduce", re.IGNORECASE)
_TVM_GEMM = re.compile(r"(NT_matmul\d*|(?<![A-Za-z])matmul\d*)")
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def is_gemm_kernel(name: str) -> bool:
    """A GEMM kernel (cuBLASLt's or TVM's), not attention, not a split-K reduction."""
    return bool(GEMM_KERNEL.search(name)) and not is_attention_kernel(name) and not SPLIT_K_REDUCE.search(name)


def kernel_group(name: str) -> str:
    """The GEMM a kernel name stands for when only totals are known: TVM names one PrimFunc per GEMM
    shape (``NT_matmul3``), also inside its fused variants (``fused_NT_matmul3_add2_strided_slice``);
    a cuBLASLt kernel name is a tile configuration, its own group."""
    m = _TVM_GEMM.search(name)
    return m.group(1) if m and "nvjet" not in name else name


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a step: ``count`` calls of an (M, K) x (K, N) product."""

    name: str
    m: int
    n: int
    k: int
    count: int
    elem_bytes: int = 2

    @property
    def flop(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def bytes(self) -> float:
        return float(self.elem_bytes * (self.m * self.k + self.n * self.k + self.m * self.n))

    def _limit_times_us(self, limits: GpuLimits) -> tuple[float, float]:
        """(the bytes at the GPU's HBM bandwidth, the FLOPs at its dense rate), µs."""
        return self.bytes / (limits.hbm_tbps * 1e6), self.flop / (limits.dense_tflops * 1e6)

    def limit_us(self, limits: GpuLimits = DEFAULT) -> float:
        """Time of one call at the limit, µs: the bytes at the GPU's HBM bandwidth or the FLOPs at its
        dense rate, whichever is longer."""
        return max(self._limit_times_us(limits))

    def bound(self, limits: GpuLimits = DEFAULT) -> str:
        """``bytes`` or ``FLOPs``: which of the two limits is the longer time."""
        bytes_us, flop_us = self._limit_times_us(limits)
        return "bytes" if bytes_us >= flop_us else "FLOPs"


def model_gemms(rec: dict, phase: str, prompt_len: int, batch: int = 1) -> list[Gemm]:
    """The GEMMs of one step of ``phase`` ("prefill" / "decode") in launch order, from a record's
    shapes (``profile run``'s per-library record, or a sidecar). Prefill: ``batch`` sequences of
    ``prompt_len`` tokens, ``lm_head`` on every position when the record's ``logits`` is ``all`` (the
    paged model) and on the last one per sequence otherwise; decode: ``batch`` rows."""
    need = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size")
    missing = [k for k in need if k not in rec]
    if missing:
        raise ValueError(f"the record has no {', '.join(missing)}: cannot know its GEMMs")
    L, h, hkv, d = rec["num_layers"], rec["num_heads"], rec["num_kv_heads"], rec["head_dim"]
    hidden, inter, vocab = rec["hidden_size"], rec["intermediate_size"], rec["vocab_size"]
    eb = _BYTES.get(rec.get("dtype", "float16"), 2)
    m = batch * prompt_len if phase == "prefill" else batch
    head_m = m if (phase == "decode" or rec.get("logits", "last") == "all") else batch
    if rec.get("fused_projections", True):
        per_layer = [("qkv_proj", (h + 2 * hkv) * d, hidden), ("o_proj", hidden, h * d),
                     ("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)]
    else:
        per_layer = [("q_proj", h * d, hidden), ("k_proj", hkv * d, hidden), ("v_proj", hkv * d, hidden),
                     ("o_proj", hidden, h * d), ("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                     ("down_proj", hidden, inter)]
    return [Gemm(n_, m, n, k, L, eb) for n_, n, k in per_layer] + [Gemm("lm_head", head_m, vocab, hidden, 1, eb)]


def _row(g: Gemm, kernels: list[str], calls: float, total_us: float, lim_of: GpuLimits, *, shared_with=(),
         how: str) -> dict:
    per_call = total_us / calls if calls else float("nan")
    lim = g.limit_us(lim_of)
    return {"gemm": g.name, "M": g.m, "N": g.n, "K": g.k, "calls_per_step": g.count, "kernels": kernels,
            "us_per_call": round(per_call, 2), "us_per_step": round(per_call * g.count, 2),
            "tbps": round(g.bytes / per_call / 1e6, 3), "tflops": round(g.flop / per_call / 1e6, 1),
            "bound": g.bound(lim_of),
            "limit_us_per_call": round(lim, 2), "fraction_of_limit": round(lim / per_call, 3),
            "shared_with": list(shared_with), "mapped_by": how}


def _from_launches(phase: dict, gemms: list[Gemm], limits: GpuLimits) -> list[dict] | None:
    names = [k["name"] for k in phase["kernels"]]
    seq = []  # [gemm launch: [kernel names], µs]
    for idx, ns in phase["launches"]:
        name = names[idx]
        if is_gemm_kernel(name):
            seq.append([[name], ns / 1e3])
        elif SPLIT_K_REDUCE.search(name) and seq:
            seq[-1][0].append(name)
            seq[-1][1] += ns / 1e3
    step = []  # one step's launches: the per-layer GEMMs layer after layer, then those run once
    layers = max(g.count for g in gemms)
    per_layer = [g for g in gemms if g.count == layers]
    once = [g for g in gemms if g.count != layers]
    for _ in range(layers):
        step += per_layer
    step += once
    if not seq or len(seq) % len(step):
        return None
    acc = {g.name: [set(), 0.0, 0] for g in gemms}
    for i, (kn, us) in enumerate(seq):
        a = acc[step[i % len(step)].name]
        a[0].update(kn)
        a[1] += us
        a[2] += 1
    return [_row(g, sorted(acc[g.name][0]), acc[g.name][2], acc[g.name][1], limits, how="launch order")
            for g in gemms]


def _assign(groups: list[tuple[str, float, float]], gemms: list[Gemm], limits: GpuLimits):
    """Best assignment of GEMMs to kernel groups (name, calls per step, µs per step): counts add up,
    rates as even as possible. Returns {gemm name: group index} or None."""
    best, best_score = None, math.inf
    caps = [c for _, c, _ in groups]

    def rec(i, left, chosen):
        nonlocal best, best_score
        if i == len(gemms):
            if any(abs(x) > 1e-6 for x in left):
                return
            effs = []
            for j, (_, _, us) in enumerate(groups):
                lim = sum(g.limit_us(limits) * g.count for g, c in zip(gemms, chosen) if c == j)
                effs.append(math.log(lim / us))
            mean = sum(effs) / len(effs)
            score = sum((e - mean) ** 2 for e in effs)
            if score < best_score:
                best, best_score = list(chosen), score
            return
        g = gemms[i]
        for j in range(len(groups)):
            if left[j] + 1e-6 >= g.count:
                left[j] -= g.count
                chosen.append(j)
                rec(i + 1, left, chosen)
                chosen.pop()
                left[j] += g.count

    rec(0, list(caps), [])
    return None if best is None else {g.name: j for g, j in zip(gemms, best)}


def _from_totals(phase: dict, gemms: list[Gemm], limits: GpuLimits) -> list[dict] | None:
    steps = max(phase.get("steps", 1), 1)
    grouped: dict[str, list] = {}
    for k in phase["kernels"]:
        if is_gemm_kernel(k["name"]):
            g = grouped.setdefault(kernel_group(k["name"]), [[], 0.0, 0.0])
            g[0].append(k["name"])
            g[1] += k["instances"] / steps
            g[2] += k["total_ns"] / 1e3 / steps
    groups = [(key, calls, us) for key, (_, calls, us) in grouped.items()]
    chosen = _assign(groups, gemms, limits)
    if chosen is None:
        return None
    rows = []
    for g in gemms:
        j = chosen[g.name]
        mates = [o for o in gemms if chosen[o.name] == j]
        share = g.limit_us(limits) * g.count / sum(o.limit_us(limits) * o.count for o in mates)
        kernels = sorted(grouped[groups[j][0]][0])
        rows.append(_row(g, kernels, g.count, groups[j][2] * share, limits, how="kernel totals",
                         shared_with=[o.name for o in mates if o is not g]))
    return rows


def gemm_table(rec: dict, phase: str, prompt_len: int, batch: int = 1, limits: GpuLimits | None = None
               ) -> dict | None:
    """The GEMM rows of one phase of a ``profile run`` record, with the totals; ``None`` when the
    phase has no kernels or its kernels cannot be mapped onto the model's GEMMs (the counts do not
    match). ``limits``: the GPU's (default: :func:`~.gpu_limits.record_limits` of ``rec``)."""
    limits = limits or record_limits(rec)
    ph = rec["phases"][phase]
    if not ph.get("kernels"):
        return None
    gemms = model_gemms(rec, phase, prompt_len, batch)
    rows = (_from_launches(ph, gemms, limits) if ph.get("launches") else None) or _from_totals(ph, gemms, limits)
    if rows is None:
        return None
    steps = max(ph.get("steps", 1), 1)
    reduce_us = 0.0
    if rows[0]["mapped_by"] == "kernel totals":
        reduce_us = sum(k["total_ns"] for k in ph["kernels"] if SPLIT_K_REDUCE.search(k["name"])) / 1e3 / steps
    total = sum(r["us_per_step"] for r in rows) + reduce_us
    limit = sum(r["limit_us_per_call"] * r["calls_per_step"] for r in rows)
    return {"phase": phase, "prompt_len": prompt_len, "batch": batch, "limits": limits.as_dict(), "rows": rows,
            "split_k_reduce_us_per_step": round(reduce_us, 2),
            "gemm_us_per_step": round(total, 2), "limit_us_per_step": round(limit, 2),
            "fraction_of_limit": round(limit / total, 3) if total else None,
            "kernel_us_per_step": round(ph["kernel_ms_per_step"] * 1e3, 2)}


def format_gemm_table(table: dict) -> str:
    """The table as text: one line per GEMM, then the totals."""
    if not table:
        return "(GEMMs: the kernels could not be mapped onto the model's GEMMs)"
    decode = table["phase"] == "decode"
    lim = table.get("limits") or {}
    lim_text = (GpuLimits(**lim).describe() if {"gpu", "hbm_tbps", "dense_tflops", "source"} <= set(lim)
                else f"{lim.get('hbm_tbps', HBM_TBPS)} TB/s, {lim.get('dense_tflops', DENSE_TFLOPS):.0f} TFLOP/s dense")
    head = (f"GEMMs, {table['phase']} (M = {table['rows'][0]['M']}; limits {lim_text}; "
            f"mapped by {table['rows'][0]['mapped_by']}):")
    lines = [head, f"  {'GEMM':<13}{'M':>7}{'N':>7}{'K':>7}{'calls':>6}{'us/call':>10}{'TB/s':>8}{'TFLOP/s':>9}"
                   f"{'of limit':>9}  kernels"]
    for r in table["rows"]:
        ks = ", ".join(k[:48] for k in r["kernels"])
        if r["shared_with"]:
            ks += f" (shared with {', '.join(r['shared_with'])})"
        lines.append(f"  {r['gemm']:<13}{r['M']:>7}{r['N']:>7}{r['K']:>7}{r['calls_per_step']:>6}"
                     f"{r['us_per_call']:>10.1f}{r['tbps']:>8.2f}{r['tflops']:>9.1f}"
                     f"{100 * r['fraction_of_limit']:>8.0f}%  {ks}")
    if table["split_k_reduce_us_per_step"]:
        lines.append(f"  split-K reductions (cuBLASLt): {table['split_k_reduce_us_per_step']:.1f} us/step")
    what = "bytes" if decode else "FLOPs"
    lines.append(f"  all GEMMs: {table['gemm_us_per_step']:.1f} us/step of {table['kernel_us_per_step']:.1f} us of "
                 f"kernels; at the limit ({what}) {table['limit_us_per_step']:.1f} us: "
                 f"{100 * table['fraction_of_limit']:.0f}% of it")
    return "\n".join(lines)
