"""Two or more builds of our decode kernel (``native/gqa_decode.cu``, the same C API) side by side on
TVM's pages in one run: MQA 71/1/64 (pages of 256 and 16) and GQA 64/8/128, 32/8/128 (pages of 128
and 16), fp16, batch 1 (one 16k sequence), 8, 32 and 64 with lengths mixed over 1k-16k and every
sequence at 16k. GPU kernel time per call from CUPTI, each build with its own plan; the outputs of
the builds compared with each other (the decode kernel's GPU tests check one build against fp32).
Build each library as ``testing/decode_kernel.library`` does (nvcc ... -shared gqa_decode.cu).

    python benchmarks/decode_builds.py measure --out OUT.json before=OLD.so after=NEW.so [--shapes 71/1/64] [--batches 1 4 8] [--dtypes float16 bfloat16]
    python benchmarks/decode_builds.py report OUT.json --out OUT.md --commit C --date D --command CMD
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ((71, 1, 64), (64, 8, 128), (32, 8, 128))
BATCHES = (1, 8, 32, 64)


def measure(out_path: str, libs_args: list[str], shapes=SHAPES, batches=BATCHES, dtypes=("float16",)) -> list:
    import torch

    from decode_kernel import kernel_us
    from paged_attention import MAX_LEN, PagedInputs, mixed_lengths
    from mqa_byoc.testing import decode_kernel as dk
    from mqa_byoc.testing.header import row_gpu

    gpu = row_gpu(torch)

    libs = {n: dk.load_library(p) for n, p in (a.split("=") for a in libs_args)}
    res = []
    for (h, hk, d) in shapes:
        for page in ((256, 16) if d == 64 else (128, 16)):
            for batch, kind, dtype_name in ((b, k, t) for b in batches for k in ("mixed", "uniform16k") for t in dtypes):
                if kind == "uniform16k" and batch == 1:
                    continue
                dtype = getattr(torch, dtype_name)
                lengths = mixed_lengths(batch) if kind == "mixed" else [MAX_LEN] * batch
                inputs = PagedInputs(torch, lengths, hk, d, dtype, (page,), seed=batch + 7 * h)
                paged = inputs.paged[page]
                q = torch.randn(batch, h, d, device="cuda").to(dtype)
                out = torch.empty_like(q)
                pages = paged["pages"]
                st = (pages.stride(0), pages.stride(3), pages.stride(2))
                rec = {"shape": f"{h}/{hk}/{d}", "page": page, "batch": batch, "kind": kind, "dtype": dtype_name, **gpu,
                       "bytes_us": 2 * sum(lengths) * hk * d * 2 / (gpu["hbm_tbps"] * 1e12) * 1e6, "us": {}}
                outs = {}
                for name, lib in libs.items():
                    call = dk.Decode(q, pages[:, 0], pages[:, 1], out, None, k_stride=st, v_stride=st,
                                     seqlen_k=0, num_heads_k=hk,
                                     pages=(paged["indptr"], paged["values"], paged["last"], page), lib=lib)
                    call()
                    torch.cuda.synchronize()
                    outs[name] = out.clone()
                    rec["us"][name] = kernel_us(call, 30)
                ref = next(iter(outs.values()))
                rec["max_diff"] = max((o.float() - ref.float()).abs().max().item() for o in outs.values())
                print(json.dumps(rec), flush=True)
                res.append(rec)
                del inputs, paged, pages
    Path(out_path).write_text(json.dumps(res, indent=1))
    return res


def gpu_words(rows: list) -> str:
    """The GPU the rows ran on (:func:`mqa_byoc.testing.header.rows_gpu`)."""
    from mqa_byoc.testing.header import rows_gpu

    return rows_gpu(rows)[0]


def gpu_tbps(rows: list) -> str:
    """The HBM TB/s the rows' bytes limits are taken at."""
    from mqa_byoc.testing.header import rows_gpu

    return f"{rows_gpu(rows)[1]:g}"


def report(rows: list, meta: dict) -> str:
    """Markdown of a ``measure`` run: per case each build's µs, the later builds against the first, the
    bytes limit (the K and V bytes read once at the GPU's own bandwidth (`mqa_byoc.runtime.gpu_limits`; the H200's 4.8 TB/s for rows that record none))."""
    names = list(rows[0]["us"])
    base, others = names[0], names[1:]
    lines = ["# Decode kernel builds on TVM's pages, one run", "",
             f"- commit {meta.get('commit', '?')}; date {meta.get('date', '?')}; {gpu_words(rows)}",
             f"- command: `{meta.get('command', '?')}`",
             "- GPU kernel time per call (µs, CUPTI, 30 calls), each build with its own plan; `max diff`: the "
             "largest |difference| between the builds' outputs.", "",
             "| shape (H/H_kv/D) | page | batch | lengths | dtype | " + " | ".join(f"{n} µs" for n in names) + " | "
             + " | ".join(f"{n} / {base}" for n in others) + " | bytes limit µs | "
             + " | ".join(f"{n} / bytes" for n in names) + " | max diff |",
             "|---|---:|---:|---|---|" + "---:|" * (2 * len(names) + len(others) + 1) + "---:|"]
    for r in rows:
        u = r["us"]
        lines.append(f"| {r['shape']} | {r['page']} | {r['batch']} | {r['kind']} | {r.get('dtype', 'float16')} | "
                     + " | ".join(f"{u[n]:.1f}" for n in names) + " | "
                     + " | ".join(f"{u[n] / u[base]:.3f}" for n in others) + f" | {r['bytes_us']:.1f} | "
                     + " | ".join(f"{u[n] / r['bytes_us']:.2f}" for n in names) + f" | {r['max_diff']:.2g} |")
    lines += ["", "## Per shape", ""]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for n in others:
            q = [r["us"][n] / r["us"][base] for r in rows if r["shape"] == shape]
            lines.append(f"- {shape}: {n} / {base} {min(q):.2f}-{max(q):.2f} over {len(q)} cases")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the builds (GPU)")
    m.add_argument("--out", required=True, help="results JSON")
    m.add_argument("libs", nargs="+", metavar="NAME=LIB", help="the builds; the first is the baseline")
    m.add_argument("--shapes", nargs="+", metavar="H/H_KV/D", default=[f"{h}/{hk}/{d}" for h, hk, d in SHAPES],
                   help="the shapes to time (default: all three)")
    m.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="sequences a call (default 1 8 32 64)")
    m.add_argument("--dtypes", nargs="+", choices=("float16", "bfloat16"), default=["float16"])
    add_report_command(sub)
    args = ap.parse_args(argv)
    if args.command == "measure":
        measure(args.out, args.libs, [tuple(int(x) for x in s.split("/")) for s in args.shapes], args.batches,
                args.dtypes)
    else:
        write_report(args, report)
    return 0


def lib_measure_parser(doc: str):
    """The command line of a benchmark of one decode-kernel build: (parser, its subparsers, the ``measure``
    subparser with --lib and --out); the caller adds its own options and ``add_report_command``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the variants (GPU)")
    m.add_argument("--lib", required=True, help="a build of gqa_decode.cu (testing/decode_kernel.library's command)")
    m.add_argument("--out", required=True, help="results JSON")
    return ap, sub, m


def add_report_command(sub) -> None:
    """The ``report`` subcommand of a decode benchmark: its results JSON, the markdown out, the run's facts."""
    r = sub.add_parser("report", help="markdown of a measure run")
    r.add_argument("results", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--commit", required=True)
    r.add_argument("--date", required=True)
    r.add_argument("--command", dest="run_command", required=True)


def write_report(args, report_fn) -> None:
    rows = json.loads(args.results.read_text())
    args.out.write_text(report_fn(rows, {"commit": args.commit, "date": args.date, "command": args.run_command}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
