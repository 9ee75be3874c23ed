"""End to end: decode tokens/s of a compiled GQA decoder at long context, mqa=True vs mqa=False,
with a kernel summary of each (CUPTI through torch.profiler, nsys cuda_gpu_kern_sum layout).

    python benchmarks/e2e_decode.py build --out .e2e-artifacts [--preset codellama-34b --layers 4]
    python3 benchmarks/e2e_decode.py run --artifacts .e2e-artifacts --json e2e.json   # on the GPU

The decoder keeps the preset's real hidden size, heads and MLP width; fewer layers (decode time is
per layer). The KV cache is filled with random values at the context length instead of prefilling
it (decode cost does not depend on the values).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys


def build(args):
    from mqa_byoc.models.decoder_libs import build_decoder_libraries
    from mqa_byoc.models.presets import get_preset, scaled

    config = scaled(get_preset(args.preset), num_layers=args.layers, vocab_size=args.vocab)
    build_decoder_libraries(config, args.out, functions=("decode",), dtype="float16", kv_expand=args.kv_expand,
                            provider=args.provider, arch=args.arch, logits="all", extra={"preset": args.preset},
                            progress=lambda m: print(m, flush=True))


def run(args):
    import torch

    try:
        import boot  # noqa: F401 - runtime-only TVM on the GPU machine
    except ImportError:
        pass
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import tvm

    from mqa_byoc.runtime.runner import DecoderRunner, kernel_summary

    records, summaries = [], {}
    libs = sorted(f for f in os.listdir(args.artifacts) if f.endswith(".so"))
    for lib in libs:
        runner = DecoderRunner(os.path.join(args.artifacts, lib))
        meta = runner.meta
        shape = (1, args.context, meta["num_kv_heads"], meta["head_dim"])
        caches = [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(2 * meta["num_layers"])]
        past = [tvm.runtime.from_dlpack(c) for c in caches]

        def steps(n, past=past):
            cur = past
            for _ in range(n):
                _, cur = runner.decode(cur)
            return cur

        steps(3)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        steps(args.steps)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / args.steps
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.cuda.nvtx.range("decode"):
                steps(4)
            torch.cuda.synchronize()
        from mqa_byoc.runtime.runner import collect_kernels

        stats = collect_kernels(prof)
        mode = "mqa" if meta["mqa"] else "repeat"
        summaries[mode] = kernel_summary(stats)
        records.append({"benchmark": "e2e_decode", "model": meta["preset"], "layers": meta["num_layers"],
                        "dtype": meta["dtype"], "mode": mode, "seq_kv": args.context,
                        "ms_per_token": round(ms, 4), "tokens_per_s": round(1000 / ms, 1),
                        "kernels": {s.name[:100]: round(s.total / 4, 1) for s in stats}})
        print(f"{lib}: {ms:.3f} ms/token, {1000 / ms:.1f} tokens/s at {args.context} context "
              f"({meta['num_layers']} layers)", flush=True)
        print(summaries[mode], flush=True)
    by = {r["mode"]: r for r in records}
    if "mqa" in by and "repeat" in by:
        ratio = by["mqa"]["tokens_per_s"] / by["repeat"]["tokens_per_s"]
        print(f"decode tokens/s, mqa=True / mqa=False: {ratio:.2f}x")
        for r in records:
            r["speedup_mqa_vs_repeat"] = round(ratio, 3)
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "records": records,
           "kernel_summaries": summaries}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", default=".e2e-artifacts")
    b.add_argument("--preset", default="codellama-34b")
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--vocab", type=int, default=32000)
    b.add_argument("--kv-expand", default="repeat")
    b.add_argument("--provider", default="native")
    b.add_argument("--arch", default="sm_90")
    r = sub.add_parser("run")
    r.add_argument("--artifacts", default=".e2e-artifacts")
    r.add_argument("--json", default="e2e-results.json")
    r.add_argument("--context", type=int, default=16384)
    r.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    (build if args.cmd == "build" else run)(args)


if __name__ == "__main__":
    main()
