"""Packed SharedTiles splits (``native/gqa_decode.cu``, the plan's ``shared_tiles`` 2) on TVM's pages (of 256 keys,
``--page`` for another size), one build, one run: the grid's CTAs an SM (1 to 4 times the SMs) x the least keys a
split (64 to 512), against the classic blocks (``row_tiles=1``) and the plan's rule (``row_tiles=0``, timed twice:
before and after the sweep). MQA 71/1/64 by default (``--shape``), batches 4-32 (``--batches``), lengths mixed over
1k-16k and every sequence at 16k, fp16 (and bf16 at 8 sequences). GPU kernel time per call from CUPTI; every output
compared with the classic blocks'. What the packed plan's grid, least split and threshold for CTAs of 5 row tiles
were set from.

    python benchmarks/decode_packed_grid.py measure --lib LIB.so --out OUT.json [--shape 71/1/64] [--batches 4 8 16]
        [--page 16]
    python benchmarks/decode_packed_grid.py report OUT.json --out OUT.md --commit C --date D --command CMD
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_builds import add_report_command, gpu_words, lib_measure_parser, write_report  # noqa: E402

CTAS_PER_SM = (1, 2, 3, 4)
MIN_KEYS = (64, 128, 192, 256, 320, 384, 512)
PAGE = 256  #: keys a page unless --page says otherwise


def packed(call, grid: int, min_keys: int, batch: int, hk: int, d: int):
    """``call``'s plan as packed splits over a grid's x of ``grid`` CTAs (at least one a sequence), splits of at
    least ``min_keys`` keys (the kernel sizes them), its scratch resized to match."""
    import torch

    call.set_packed()
    p = call.plan
    rows = 16 * p.warps
    p.splits, p.keys_per_split = max(grid, batch), min_keys
    ys = hk * p.row_groups
    p.o_part_floats = ys * p.splits * rows * d
    p.workspace_bytes = (p.o_part_floats + ys * p.splits * rows) * 4 + batch * ys * 8
    call.ws = torch.empty(p.workspace_bytes, dtype=torch.uint8, device="cuda")
    return call


def measure(lib_path: str, out_path: str, batches=(4, 6, 8, 10, 12, 16, 32), shape=(71, 1, 64), page=PAGE) -> list:
    import torch

    from decode_kernel import kernel_us
    from paged_attention import MAX_LEN, PagedInputs, mixed_lengths
    from mqa_byoc.testing import decode_kernel as dk
    from mqa_byoc.testing.header import row_gpu

    gpu = row_gpu(torch)
    lib = dk.load_library(lib_path)
    h, hk, d = shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in batches:
        for kind in ("mixed", "uniform16k"):
            lengths = mixed_lengths(batch) if kind == "mixed" else [MAX_LEN] * batch
            for dtype in ((torch.float16, torch.bfloat16) if batch == 8 else (torch.float16,)):
                inputs = PagedInputs(torch, lengths, hk, d, dtype, (page,), seed=batch + 7 * h)
                paged = inputs.paged[page]
                pages = paged["pages"]
                q = torch.randn(batch, h, d, device="cuda").to(dtype)
                out = torch.empty_like(q)
                st = (pages.stride(0), pages.stride(3), pages.stride(2))

                def make(row_tiles):
                    return dk.Decode(q, pages[:, 0], pages[:, 1], out, None, k_stride=st, v_stride=st, seqlen_k=0,
                                     num_heads_k=hk, pages=(paged["indptr"], paged["values"], paged["last"], page),
                                     lib=lib, row_tiles=row_tiles)

                classic, rule = make(1), make(0)
                classic()
                torch.cuda.synchronize()
                ref = out.clone()
                rec = {"shape": f"{h}/{hk}/{d}", "batch": batch, "lengths": kind, "dtype": str(dtype)[6:],
                       "gpu": gpu["gpu"], "sms": sms, "page": page, "rule_shared": rule.plan.shared_tiles,
                       "rule_splits": rule.plan.splits, "rule_kps": rule.plan.keys_per_split,
                       "rule_warps": rule.plan.warps, "classic": kernel_us(classic, 40), "rule": kernel_us(rule, 40),
                       "diff": 0.0}

                def check(call):
                    call()
                    torch.cuda.synchronize()
                    rec["diff"] = max(rec["diff"], (out.float() - ref.float()).abs().max().item())

                check(rule)
                for per_sm in CTAS_PER_SM:
                    for kps in MIN_KEYS:
                        call = packed(make(dk.SHARED_TILES), per_sm * sms, kps, batch, hk, d)
                        rec[f"g{per_sm * sms}k{kps}"] = kernel_us(call, 40)
                        check(call)
                rec["rule2"] = kernel_us(rule, 40)
                print(json.dumps(rec), flush=True)
                rows.append(rec)
                del inputs, paged, pages
    Path(out_path).write_text(json.dumps(rows, indent=1))
    return rows


def _grid_keys(rows):
    """The (grid, least keys) columns of the rows, in order."""
    cols = [tuple(int(x) for x in re.fullmatch(r"g(\d+)k(\d+)", k).groups()) for k in rows[0] if re.fullmatch(r"g\d+k\d+", k)]
    return sorted(set(cols))


def _pages(rows) -> str:
    """The page sizes of the rows (runs before ``--page`` recorded none: 256)."""
    return " and ".join(str(p) for p in sorted({r.get("page", PAGE) for r in rows}))


def report(rows: list, meta: dict) -> str:
    cols = _grid_keys(rows)
    grids = sorted({g for g, _ in cols})
    sms = rows[0].get("sms") or grids[0]
    lines = ["# Packed SharedTiles splits: grid x least keys a split, against the rule", "",
             f"- commit {meta.get('commit', '?')}; date {meta.get('date', '?')}; {gpu_words(rows)}",
             f"- command: `{meta.get('command', '?')}`",
             f"- TVM's pages of {_pages(rows)}; GPU kernel time per call (µs, CUPTI, 40 calls); `classic`: the classic blocks; "
             "`rule`: the plan's choice (the better of two timings, before and after the sweep; its plan: "
             "`shared_tiles` 0 the classic blocks, 2 packed splits, the grid's x and the least keys a split); "
             "`N/SM`: packed splits over N CTAs an SM, the best of the least keys a split and, in brackets, at "
             "128 and 256 keys; `max diff`: every output against the classic blocks'.", "",
             "| shape | batch | lengths | dtype | classic µs | rule µs (plan) | "
             + " | ".join(f"{g // sms}/SM µs (k128, k256)" for g in grids) + " | 2/SM k128 / rule | max diff |",
             "|---|---:|---|---|---:|---:|" + "---:|" * len(grids) + "---:|---:|"]
    ratios = []
    for r in rows:
        rule = min(r["rule"], r.get("rule2", r["rule"]))
        plan = (f"{r['rule_shared']}: {r['rule_splits']} x {r['rule_kps']}" if r["rule_shared"] == 2
                else f"{r['rule_shared']}")
        cells = []
        for g in grids:
            best = min(r[f"g{g}k{k}"] for gg, k in cols if gg == g)
            cells.append(f"{best:.1f} ({r.get(f'g{g}k128', float('nan')):.1f}, {r.get(f'g{g}k256', float('nan')):.1f})")
        two = r.get(f"g{2 * sms}k128")
        ratios.append(two / rule if two else float("nan"))
        lines.append(f"| {r.get('shape', '71/1/64')} | {r['batch']} | {r['lengths']} | {r['dtype']} | {r['classic']:.1f} | "
                     f"{rule:.1f} ({plan}) | " + " | ".join(cells) + f" | {ratios[-1]:.2f} | {r['diff']:.2g} |")
    lines += ["", f"2 CTAs an SM, splits of at least 128 keys, against the rule: {min(ratios):.2f}-{max(ratios):.2f}x "
                  f"over {len(rows)} cases."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap, sub, m = lib_measure_parser(__doc__)
    m.add_argument("--shape", default="71/1/64", metavar="H/H_KV/D", help="a head dim 64 grouping (default 71/1/64)")
    m.add_argument("--batches", nargs="+", type=int, default=[4, 6, 8, 10, 12, 16, 32],
                   help="sequences a call (default 4 6 8 10 12 16 32)")
    m.add_argument("--page", type=int, default=PAGE, help=f"keys a page of TVM's cache, a multiple of 16 (default {PAGE})")
    add_report_command(sub)
    args = ap.parse_args(argv)
    if args.command == "measure":
        measure(args.lib, args.out, batches=tuple(args.batches), shape=tuple(int(x) for x in args.shape.split("/")),
                page=args.page)
    else:
        write_report(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
