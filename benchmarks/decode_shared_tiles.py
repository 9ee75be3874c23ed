"""SharedTiles (``native/gqa_decode.cu``: a large group's 16-row tiles as the warps of one CTA) against
the decode kernel's classic blocks at few sequences, one build, one run: MQA 71/1/64 (or ``--shape``) on
TVM's pages of 256, fp16, batch 8/16/24 (or ``--batches``; mixed 1k-16k, every sequence 16k); SharedTiles
asked for (``row_tiles=SHARED_TILES``) with its own plan (``asked``) and with g splits a slot (a typical
sequence's keys over g, whole 64-key tiles, at least 256), the classic blocks (``row_tiles=1``) and the
plan's rule (``row_tiles=0``); with ``--key-groups 2`` SharedTiles' plans with one key group and with two.
GPU kernel time per call from CUPTI; every output compared with the classic blocks'. What the plan's
SharedTiles threshold, split cap and key groups were set from.

    python benchmarks/decode_shared_tiles.py measure --lib LIB.so --out OUT.json [--shape 40/2/64] [--batches 8 12] [--key-groups 2]
    python benchmarks/decode_shared_tiles.py report OUT.json --out OUT.md --commit C --date D --command CMD
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_builds import add_report_command, gpu_words, lib_measure_parser, write_report  # noqa: E402

GRIDS = (8, 12, 16, 24, 32, 48)


def measure(lib_path: str, out_path: str, batches=(8, 16, 24), grids=GRIDS, shape=(71, 1, 64), key_groups=1) -> list:
    import torch

    from decode_kernel import kernel_us
    from paged_attention import MAX_LEN, PagedInputs, mixed_lengths
    from mqa_byoc.testing import decode_kernel as dk
    from mqa_byoc.testing.header import row_gpu

    gpu = row_gpu(torch)
    lib = dk.load_library(lib_path)
    (h, hk, d), page = shape, 256
    rows = []
    for batch in batches:
        for kind in ("mixed", "uniform16k"):
            lengths = mixed_lengths(batch) if kind == "mixed" else [MAX_LEN] * batch
            inputs = PagedInputs(torch, lengths, hk, d, torch.float16, (page,), seed=batch + 7 * h)
            paged = inputs.paged[page]
            pages = paged["pages"]
            q = torch.randn(batch, h, d, device="cuda").half()
            out = torch.empty_like(q)
            st = (pages.stride(0), pages.stride(3), pages.stride(2))

            def make(row_tiles):
                return dk.Decode(q, pages[:, 0], pages[:, 1], out, None, k_stride=st, v_stride=st, seqlen_k=0,
                                 num_heads_k=hk, pages=(paged["indptr"], paged["values"], paged["last"], page),
                                 lib=lib, row_tiles=row_tiles)
            classic, rule = make(1), make(0)
            asked = make(dk.SHARED_TILES)
            rec = {"shape": f"{h}/{hk}/{d}", "batch": batch, "lengths": kind, "gpu": gpu["gpu"], "rule_shared_tiles": rule.plan.shared_tiles,
                   "rule_warps": rule.plan.warps, "classic": kernel_us(classic, 30), "rule": kernel_us(rule, 30),
                   "asked": kernel_us(asked, 30), "asked_shared_tiles": asked.plan.shared_tiles, "max_diff": 0.0}
            classic()
            torch.cuda.synchronize()
            ref = out.clone()

            def check(call):
                call()
                torch.cuda.synchronize()
                rec["max_diff"] = max(rec["max_diff"], (out.float() - ref.float()).abs().max().item())

            check(rule)
            packed = make(dk.SHARED_TILES)
            packed.set_packed()
            rec["packed"] = kernel_us(packed, 30)
            check(packed)
            if key_groups == 2:  # SharedTiles' own plan with one key group, then with two
                asked.set_key_groups(1)
                rec["asked"] = kernel_us(asked, 30)
            check(asked)
            if key_groups == 2:
                asked.set_key_groups(2)
                rec["asked_k2"] = kernel_us(asked, 30)
                check(asked)
            for g in grids:
                call = make(dk.SHARED_TILES)
                set_splits(call, lengths, g)
                if key_groups == 2:
                    call.set_key_groups(1)
                rec[f"g{g}"] = kernel_us(call, 30)
                check(call)
                if key_groups == 2:
                    call.set_key_groups(2)
                    rec[f"g{g}k2"] = kernel_us(call, 30)
                    check(call)
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            del inputs, paged, pages
    Path(out_path).write_text(json.dumps(rows, indent=1))
    return rows


def set_splits(call, lengths, g: int) -> None:
    """A SharedTiles call's plan in ``g`` splits a slot: a typical sequence's keys over g, whole 64-key
    tiles, at least 256 keys a split."""
    typical = sum(lengths) // len(lengths)
    call.set_keys_per_split(max(256, -(-typical // (g * 64)) * 64))
    call.plan.splits = min(g, call.plan.splits)  # the grid: g splits (the workspace fits 64)


def report(rows: list, meta: dict) -> str:
    gs = [k for k in rows[0] if re.fullmatch(r"g\d+(k2)?", k)]
    k2 = "asked_k2" in rows[0]
    packed = "packed" in rows[0]  # (results from before the column: none)
    lines = ["# SharedTiles at few sequences: split counts against the classic blocks", "",
             f"- commit {meta.get('commit', '?')}; date {meta.get('date', '?')}; {gpu_words(rows)}",
             f"- command: `{meta.get('command', '?')}`",
             "- TVM's pages of 256, fp16; GPU kernel time per call (µs, CUPTI, 30 calls); `classic`: the classic "
             "blocks; `rule`: the plan's choice (its `shared_tiles`: 0 the classic blocks, 1 SharedTiles, 2 "
             "SharedTiles with packed splits); `asked`: SharedTiles asked for, its own plan; `gN`: SharedTiles "
             "asked for in N splits a slot; `packed`: SharedTiles' packed splits asked for (as the rule plans "
             "them where a slot's splits would not merge in a cluster)"
             + ("; `asked` and `gN` with one key group, `k2`: the same with two (twice the warps, each group on "
                "one of a tile's two 32-key steps)" if k2 else "") + "; `max diff`: against the classic blocks' output.", "",
             "| shape | batch | lengths | classic µs | rule µs (shared_tiles) | asked µs (shared_tiles) | "
             + ("asked k2 µs | " if k2 else "") + ("packed µs | " if packed else "")
             + " | ".join(f"{g} µs" for g in gs) + " | best g / classic | rule / classic | asked / classic | max diff |",
             "|---|---:|---|---:|---:|---:|" + ("---:|" if k2 else "") + ("---:|" if packed else "") + "---:|" * len(gs) + "---:|---:|---:|---:|"]

    for r in rows:
        best = min(r[g] for g in gs)
        has = "asked" in r
        asked_us = f"{r['asked']:.1f} ({r['asked_shared_tiles']})" if has else "–"
        asked_q = f"{r['asked'] / r['classic']:.2f}" if has else "–"
        lines.append(f"| {r.get('shape', '71/1/64')} | {r['batch']} | {r['lengths']} | {r['classic']:.1f} | "
                     f"{r['rule']:.1f} ({r['rule_shared_tiles']}) | {asked_us} | "
                     + (f"{r['asked_k2']:.1f} | " if k2 else "") + (f"{r['packed']:.1f} | " if packed else "")
                     + " | ".join(f"{r[g]:.1f}" for g in gs)
                     + f" | {best / r['classic']:.2f} | {r['rule'] / r['classic']:.2f} | {asked_q} | {r['max_diff']:.2g} |")
    if "g16" in rows[0]:
        lines += ["", "g16 / classic: " + ", ".join(f"batch {r['batch']} {r['lengths']} {r['g16'] / r['classic']:.2f}"
                                                    for r in rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap, sub, m = lib_measure_parser(__doc__)
    m.add_argument("--shape", default="71/1/64", metavar="H/H_KV/D", help="a head dim 64 grouping (default 71/1/64)")
    m.add_argument("--batches", nargs="+", type=int, default=[8, 16, 24], help="sequences a call (default 8 16 24)")
    m.add_argument("--key-groups", type=int, choices=(1, 2), default=1,
                   help="2: also time SharedTiles' plans with two key groups")
    add_report_command(sub)
    args = ap.parse_args(argv)
    if args.command == "measure":
        measure(args.lib, args.out, batches=tuple(args.batches), shape=tuple(int(x) for x in args.shape.split("/")),
                key_groups=args.key_groups)
    else:
        write_report(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
