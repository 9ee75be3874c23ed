"""The decode kernel's grid for small groups (RowsAsN: GQA 64/8/128, 32/8/128) on TVM's pages at the
lengths a decoder meets (every sequence 1k-16k keys, or mixed over 1k-16k) and batch 1-64: the plan's
choice against fixed keys-per-split values with CTAs of 4 and of 8 warps in grids sized for a typical
sequence, for twice it, and for the longest sequence the call's pages could hold (each sequence cuts its
keys into at most the grid's splits; merged in a cluster where the grid's clusters are co-resident).
Each call reads its K/V from HBM, as a decoder layer does (other layers' weights pass through L2 in
between): calls take turns over copies of the pages that together exceed L2. GPU kernel time per call
from CUPTI; every variant's output is compared with the plan's, the plan's with fp32. What the plan's
grid for these groups was set from.

    python benchmarks/decode_grid.py measure --lib LIB.so --out OUT.json [--shape 64/8/128] [--batches 1 8 32] [--lengths 2048]
    python benchmarks/decode_grid.py report OUT.json --out OUT.md --commit C --date D --command CMD
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_builds import add_report_command, gpu_tbps, gpu_words, lib_measure_parser, write_report  # noqa: E402

PAGE = 128  # the decoders' pages at head dim 128
KPS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
COLD_BYTES = 256 << 20  # the copies a call takes turns over: about five times the H200's L2
CALLS = 30


def variants(typical: int, grid_longest, max_splits: int = 128, extra_kps=()):
    """(keys a split, warps, grid's x, merge) worth timing for a typical sequence of ``typical`` keys: splits
    of at most twice it, CTAs of 4 and 8 warps, the grid sized for the typical sequence and for twice it
    (merged as the plan would: in a cluster where the grid's clusters are co-resident; and through the
    workspace), and for the longest sequence the call's pages could hold (``grid_longest(kps)``, the grid
    before: as the plan would merge it)."""
    for kps in sorted(set(KPS) | set(extra_kps)):
        if kps > 2 * typical or 64 * kps < typical:
            continue
        for warps in (4, 8):
            seen = set()
            for grid, merge in ((-(-typical // kps), "auto"), (-(-typical // kps), "global"),
                                (-(-2 * typical // kps), "auto"), (-(-2 * typical // kps), "global"),
                                (grid_longest(kps), "auto")):
                if grid <= max_splits and (grid, merge) not in seen:
                    seen.add((grid, merge))
                    yield kps, warps, grid, merge


def measure(lib_path: str, out_path: str, shape=(64, 8, 128), batches=(1, 4, 8, 16, 32, 64),
            lengths=("1024", "2048", "4096", "16384", "mixed")) -> list:
    import torch

    from decode_kernel import kernel_us
    from paged_attention import cold_decode_case, mixed_lengths
    from mqa_byoc.testing import decode_kernel as dk
    from mqa_byoc.testing.header import row_gpu

    gpu = row_gpu(torch)

    lib = dk.load_library(lib_path)
    h, hk, d = shape
    rows = []
    for length, batch in itertools.product(lengths, batches):
        if length == "mixed" and batch == 1:
            continue  # one sequence: the uniform cases
        seq = mixed_lengths(batch) if length == "mixed" else [int(length)] * batch
        inputs, copies, q, out, st, meta = cold_decode_case(torch, seq, h, hk, d, PAGE, batch + 7 * len(length),
                                                            COLD_BYTES)
        paged = inputs.paged[PAGE]

        def make(merge="auto"):
            return [dk.Decode(q, p[:, 0], p[:, 1], out, None, k_stride=st, v_stride=st, seqlen_k=0, num_heads_k=hk,
                              pages=meta, lib=lib, merge=merge) for p in copies]

        def timed(calls):
            turns = itertools.cycle(calls)
            return kernel_us(lambda: next(turns)(), CALLS)

        rule = make()
        plan = rule[0].plan
        typical = -(-paged["values"].numel() * PAGE // batch)  # the plan's: an even share of the pages
        rec = {"shape": f"{h}/{hk}/{d}", "batch": batch, "keys": length, "typical": typical, "copies": len(copies),
               **gpu, "bytes_us": 2 * sum(seq) * hk * d * 2 / (gpu["hbm_tbps"] * 1e12) * 1e6,
               "rule": {"splits": plan.splits, "kps": plan.keys_per_split, "warps": plan.warps, "us": timed(rule)},
               "variants": [], "max_diff": 0.0}
        rule[0]()
        torch.cuda.synchronize()
        ref = out.clone()
        starts = inputs.kv_indptr
        exact, _ = dk.reference(q, [inputs.k[starts[i]:starts[i + 1]] for i in range(batch)],
                                [inputs.v[starts[i]:starts[i + 1]] for i in range(batch)], seq, hk)
        rec["rule_err"] = (ref.float() - exact).abs().max().item()
        longest = paged["values"].numel() * PAGE  # the plan's bound: every page of the call
        for kps, warps, grid, merge in variants(typical, lambda kps: -(-longest // kps), extra_kps=(plan.keys_per_split,)):
            calls = make(merge)
            for c in calls:
                c.set_grid(kps, grid)
                c.plan.warps = warps
            calls[0]()
            torch.cuda.synchronize()
            rec["max_diff"] = max(rec["max_diff"], (out.float() - ref.float()).abs().max().item())
            rec["variants"].append({"kps": kps, "warps": warps, "splits": grid, "merge": merge,
                                    "grid": "longest" if grid == -(-longest // kps) else "typical", "us": timed(calls)})
        print(json.dumps({k: v for k, v in rec.items() if k != "variants"}), flush=True)
        rows.append(rec)
        Path(out_path).write_text(json.dumps(rows, indent=1))  # after every case: a cut-short run keeps its rows
        del inputs, paged, copies, rule
        torch.cuda.empty_cache()
    return rows


def best(rec: dict, **match) -> dict | None:
    """The fastest variant whose fields equal ``match``'s (None: no such variant)."""
    vs = [v for v in rec["variants"] if all(v.get(k) == x for k, x in match.items())]
    return min(vs, key=lambda v: v["us"]) if vs else None


def _plan(v: dict) -> str:
    merge = f", {v['merge']}" if "merge" in v else ""
    return f"{v['splits']} x {v['kps']} ({v['warps']}{merge})"


def report(rows: list, meta: dict) -> str:
    lines = ["# The decode kernel's grid for small groups on TVM's pages", "",
             f"- commit {meta.get('commit', '?')}; date {meta.get('date', '?')}; {gpu_words(rows)}",
             f"- command: `{meta.get('command', '?')}`",
             f"- pages of {PAGE} keys, fp16; GPU kernel time per call (µs, CUPTI, {CALLS} calls taking turns over "
             "copies of the pages that exceed L2); `bytes`: the K/V bytes at "
             f"{gpu_tbps(rows)} TB/s; `mixed`: lengths spread "
             "over 1k-16k, else every sequence that long. `rule`: the plan's choice (the grid's splits a slot x "
             "keys a split, warps a CTA). Variants: fixed split sizes and warps with each sequence cutting its "
             "keys into at most the grid's splits; `longest`: grids sized for the longest sequence the call's "
             "pages could hold (the plan before), merged as the plan would (in a cluster where the grid's "
             "clusters are co-resident, else through the workspace); `typical`: grids of a typical sequence's "
             "splits or twice them, merged either way. `max diff`: every variant's output against the rule's; "
             "`err`: the rule's against fp32.", "",
             "| shape | batch | keys | bytes µs | rule µs | rule plan | rule / bytes | best `longest` µs | its plan | "
             "best `typical` µs | its plan | rule / best `longest` | rule / best | rule / its split, grid of the "
             "longest | rule / its split, grid of one typical sequence | max diff | err |",
             "|---|---:|---:|---:|---:|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    def cells(v):
        return (f"{v['us']:.1f}", _plan(v)) if v else ("–", "–")

    for r in rows:
        ru, old, new = r["rule"], best(r, grid="longest"), best(r, grid="typical")
        b = min((v for v in (old, new) if v), key=lambda v: v["us"])
        vs_old = f"{ru['us'] / old['us']:.2f}" if old else "–"
        same = dict(kps=ru["kps"], warps=ru["warps"], merge="auto")
        ratios = []
        for v in (best(r, grid="longest", **same),
                  best(r, splits=-(-r.get("typical", 0) // ru["kps"]), **same) if "typical" in r else None):
            ratios.append(f"{ru['us'] / v['us']:.2f}" if v else "–")
        lines.append(f"| {r['shape']} | {r['batch']} | {r['keys']} | {r['bytes_us']:.1f} | {ru['us']:.1f} | "
                     f"{_plan(ru)} | {ru['us'] / r['bytes_us']:.2f} | " + " | ".join(cells(old) + cells(new))
                     + f" | {vs_old} | {ru['us'] / b['us']:.2f} | " + " | ".join(ratios)
                     + f" | {r['max_diff']:.2g} | {r['rule_err']:.2g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap, sub, m = lib_measure_parser(__doc__)
    m.add_argument("--shape", default="64/8/128", metavar="H/H_KV/D", help="a group of at most 8 (default 64/8/128)")
    m.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64])
    m.add_argument("--lengths", nargs="+", default=["1024", "2048", "4096", "16384", "mixed"],
                   help="keys of every sequence, or mixed (spread over 1k-16k)")
    add_report_command(sub)
    args = ap.parse_args(argv)
    if args.command == "measure":
        measure(args.lib, args.out, shape=tuple(int(x) for x in args.shape.split("/")), batches=tuple(args.batches),
                lengths=tuple(args.lengths))
    else:
        write_report(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
