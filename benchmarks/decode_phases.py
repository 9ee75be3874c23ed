"""Where the decode kernel's time goes (its classic blocks or SharedTiles on TVM's pages): every CTA's
timestamps at seven points of its work, from a build with ``-DMQA_BYOC_DECODE_PHASES``, next to the kernel time of the
build without them. Says how much of a call is the key/value stream and how much the fixed steps around
it (the CSR lookups, the first tile's latency, the merges): what bounds a call that reads few bytes.

    python benchmarks/decode_phases.py measure --lib PLAIN.so --phase-lib PHASES.so --out OUT.json [--cases 71/1/64:8:mixed:shared16 ...]
    python benchmarks/decode_phases.py report OUT.json --out OUT.md --commit C --date D --command CMD

Both libraries: ``mqa_byoc.testing.decode_kernel.build_command(out)`` (``phases=True`` for the second).
A case's plan: the kernel's rule (``rule``, the default), the classic blocks (``classic``), SharedTiles with
its own plan (``shared``), with N splits a slot (``sharedN``, as ``decode_shared_tiles.py`` sizes them) or
with packed splits (``packed``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from decode_builds import add_report_command, gpu_tbps, gpu_words, lib_measure_parser, write_report  # noqa: E402
from decode_shared_tiles import set_splits  # noqa: E402

from mqa_byoc.testing import decode_kernel as dk  # noqa: E402

PAGES = {128: 128, 64: 256}  # the decoders' pages by head dim
COLD_BYTES = 256 << 20  # the copies a call takes turns over: about five times the H200's L2
CALLS = 60
TRACED_CALLS = 8  # timestamped calls, the first two dropped
#: (H, H_kv, D, batch, keys of every sequence or "mixed": spread over 1k-16k, paged_attention.mixed_lengths,
#: plan: "rule", "classic", "shared", "sharedN" or "packed")
CASES = ((64, 8, 128, 1, 1024, "rule"), (64, 8, 128, 1, 2048, "rule"), (64, 8, 128, 1, 4096, "rule"),
         (64, 8, 128, 1, 16384, "rule"), (32, 8, 128, 1, 16384, "rule"), (64, 8, 128, 8, 2048, "rule"))
#: spans between the timestamps (mqa_byoc.testing.decode_kernel.PHASES), as the report names them
SPANS = ("sequence range", "prologue", "first tile", "loop", "CTA merge", "split merge")


def phases_of(words: list, ctas: int) -> dict:
    """One call's phases from its buffer (dk.PHASE_WORDS words a CTA): the span from the first CTA's start
    to the last one's end, the start spread, and per span between two timestamps the CTAs' median (µs,
    from clock64 over each CTA's own clock rate)."""
    rows = [words[c * dk.PHASE_WORDS:(c + 1) * dk.PHASE_WORDS] for c in range(ctas)]
    rows = [r for r in rows if all(r[i] for i in range(7))]  # CTAs that ran every step (a split with keys)
    if not rows:
        raise ValueError("no CTA wrote all its timestamps")
    first = min(r[0] for r in rows)
    out = {"ctas": len(rows), "sms": len({r[7] for r in rows}), "span_us": (max(r[6] for r in rows) - first) / 1e3,
           "start_spread_us": (max(r[0] for r in rows) - first) / 1e3,
           "loop_end_spread_us": (max(r[4] for r in rows) - min(r[4] for r in rows)) / 1e3,
           # from the first CTA's first loads issued to the last CTA's last tile (warp 0's): the K/V stream
           "stream_us": (max(r[4] for r in rows) - min(r[2] for r in rows)) / 1e3}
    for i, name in enumerate(SPANS):
        us = []
        for r in rows:
            ns = r[6] - r[0]
            ghz = (r[14] - r[8]) / ns if ns > 0 else 0.0
            if ghz > 0:
                us.append((r[9 + i] - r[8 + i]) / ghz / 1e3)
        out[name] = statistics.median(us) if us else float("nan")
    return out


def measure(lib_path: str, phase_lib_path: str, out_path: str, cases=CASES) -> list:
    import torch

    from decode_kernel import kernel_us
    from paged_attention import cold_decode_case, mixed_lengths
    from mqa_byoc.testing.header import row_gpu

    gpu = row_gpu(torch)

    libs = {"plain": dk.load_library(lib_path), "phases": dk.load_library(phase_lib_path)}
    rows = []
    for h, hk, d, batch, keys, plan_name in cases:
        lengths = mixed_lengths(batch) if keys == "mixed" else [int(keys)] * batch
        page = PAGES[d]
        inputs, copies, q, out, st, meta = cold_decode_case(torch, lengths, h, hk, d, page, sum(lengths) + batch,
                                                            COLD_BYTES)
        kv_bytes = 2 * sum(lengths) * hk * d * 2
        rec = {"shape": f"{h}/{hk}/{d}", "batch": batch, "keys": keys, "page": page, "asked": plan_name,
               **gpu, "bytes_us": kv_bytes / (gpu["hbm_tbps"] * 1e12) * 1e6}
        row_tiles = {"rule": 0, "classic": 1}.get(plan_name, dk.SHARED_TILES)
        outputs = {}
        for name, lib in libs.items():
            calls = [dk.Decode(q, p[:, 0], p[:, 1], out, None, k_stride=st, v_stride=st, seqlen_k=0, num_heads_k=hk,
                               pages=meta, lib=lib, row_tiles=row_tiles) for p in copies]
            if plan_name == "packed":
                for c in calls:
                    c.set_packed()
            if plan_name.startswith("shared") and plan_name != "shared":
                for c in calls:
                    set_splits(c, lengths, int(plan_name[len("shared"):]))
            turns = itertools.cycle(calls)
            rec[f"{name}_us"] = kernel_us(lambda: next(turns)(), CALLS)
            plan = calls[0].plan
            rec["plan"] = {"splits": plan.splits, "kps": plan.keys_per_split, "warps": plan.warps,
                           "row_groups": plan.row_groups, "shared_tiles": plan.shared_tiles}
            calls[0]()
            torch.cuda.synchronize()
            outputs[name] = out.clone()
            if name == "phases":
                ctas = plan.splits * hk * batch * plan.row_groups
                buf = torch.zeros(ctas * dk.PHASE_WORDS, dtype=torch.int64, device="cuda")
                traced = []
                for _ in range(TRACED_CALLS):
                    buf.zero_()
                    dk.set_phase_buffer(lib, buf)
                    next(turns)()
                    torch.cuda.synchronize()
                    dk.set_phase_buffer(lib, None)
                    traced.append(phases_of(buf.cpu().tolist(), ctas))
                traced = traced[2:]
                rec["calls"] = traced
                rec["phases"] = {k: statistics.median(c[k] for c in traced) for k in traced[0]}
                rec["stream_tbps"] = kv_bytes / (rec["phases"]["stream_us"] * 1e-6) / 1e12
        rec["max_diff"] = (outputs["plain"].float() - outputs["phases"].float()).abs().max().item()
        print(json.dumps({k: v for k, v in rec.items() if k != "calls"}), flush=True)
        rows.append(rec)
        Path(out_path).write_text(json.dumps(rows, indent=1))
        del inputs, copies, calls
        torch.cuda.empty_cache()
    return rows


def report(rows: list, meta: dict) -> str:
    lines = ["# Where the decode kernel's time goes: phases of its CTAs", "",
             f"- commit {meta.get('commit', '?')}; date {meta.get('date', '?')}; {gpu_words(rows)}",
             f"- command: `{meta.get('command', '?')}`",
             "- pages of 128 keys at head dim 128, 256 at 64; fp16; every sequence `keys` long, or `mixed`: lengths "
             "spread over 1k-16k; `kernel`: GPU time per call of the build "
             f"without timestamps (CUPTI, {CALLS} calls taking turns over copies of the pages that exceed L2), "
             "`timed build`: the same with them; `bytes`: the K/V bytes at "
             f"{gpu_tbps(rows)} TB/s. Phases: medians over the "
             f"CTAs of one call, then over {TRACED_CALLS - 2} calls (µs, each CTA's clock64 over its own clock "
             "rate): `range` the sequence's CSR entries, `prologue` Q and the first page looked up and the "
             "first loads issued, `first tile` until warp 0's first tile landed (SharedTiles: the CTA's), `loop` "
             "warp 0's tiles, `CTA merge` the warps' states merged (waiting for the CTA's slowest warp; "
             "SharedTiles: its rows normalized), `split merge` the "
             "splits merged and the output written (waiting for the slowest split). `span`: the first CTA's "
             "start to the last one's end. `stream`: from the first CTA's first loads issued to the last CTA's "
             "last tile (warp 0's), and `stream rate` the K/V bytes over it. `kernel − stream`: what the call "
             "costs beyond its stream. `diff`: the output with timestamps against the one without.", "",
             "| shape | batch | keys | plan | CTAs | bytes µs | kernel µs | timed build µs | span µs | range | "
             "prologue | first tile | loop | CTA merge | split merge | stream µs | stream rate TB/s | "
             "kernel − stream µs | kernel / bytes | diff |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, pl = r["phases"], r["plan"]
        kind = {1: ", SharedTiles", 2: ", SharedTiles packed"}.get(pl.get("shared_tiles", 0), "")
        asked = "" if r.get("asked", "rule") == "rule" else f"{r['asked']}: "
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['keys']} | {asked}{pl['splits']} x {pl['kps']} ({pl['warps']}{kind}) | "
            f"{p['ctas']:.0f} | {r['bytes_us']:.1f} | {r['plain_us']:.1f} | {r['phases_us']:.1f} | "
            f"{p['span_us']:.1f} | " + " | ".join(f"{p[s]:.2f}" for s in SPANS)
            + f" | {p['stream_us']:.1f} | {r['stream_tbps']:.2f} | {r['plain_us'] - p['stream_us']:.1f} | "
            f"{r['plain_us'] / r['bytes_us']:.2f} | "
            f"{r['max_diff']:.2g} |")
    return "\n".join(lines) + "\n"


def parse_case(text: str) -> tuple:
    """``H/H_KV/D:BATCH:KEYS[:PLAN]`` (KEYS an integer or ``mixed``; PLAN ``rule``, the default, ``classic``,
    ``shared``, ``sharedN`` or ``packed``) as a CASES entry."""
    try:
        shape, batch, keys, *plan = text.split(":")
        h, hk, d = (int(x) for x in shape.split("/"))
        plan_name = plan[0] if plan else "rule"
        if len(plan) > 1 or not re.fullmatch(r"rule|classic|packed|shared(\d+)?", plan_name):
            raise ValueError(f"plan {':'.join(plan)!r}: rule, classic, shared, sharedN or packed")
        return (h, hk, d, int(batch), keys if keys == "mixed" else int(keys), plan_name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not H/H_KV/D:BATCH:KEYS[:PLAN] ({e})") from None


def main(argv=None) -> int:
    ap, sub, m = lib_measure_parser(__doc__)
    m.add_argument("--phase-lib", required=True, help="the same source built with -DMQA_BYOC_DECODE_PHASES")
    m.add_argument("--cases", nargs="+", type=parse_case, default=None, metavar="H/H_KV/D:BATCH:KEYS[:PLAN]",
                   help="KEYS: every sequence's, or mixed; PLAN: rule (default), classic, shared, sharedN or packed "
                        "(default cases: GQA at batch 1 and 8)")
    add_report_command(sub)
    args = ap.parse_args(argv)
    if args.command == "measure":
        measure(args.lib, args.phase_lib, args.out, cases=tuple(args.cases) if args.cases else CASES)
    else:
        write_report(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
