"""How long partition_for_cutlass takes on a full-depth Llama-2-70B-shaped decoder (80 layers).

    python benchmarks/partition_speed.py [--preset llama2-70b] [--kv-expand repeat] [--json out.json]

Goal: <= 2 s on a 2-core machine. Reports the graph build time separately (not ours to speed up).
"""

import argparse
import datetime
import json
import os
import platform
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="llama2-70b")
    p.add_argument("--kv-expand", default="repeat", choices=["repeat", "repeat-chain", "hf-broadcast", "native"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from mqa_byoc import offload_report, partition_for_cutlass
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import get_preset

    config = get_preset(args.preset)
    t0 = time.perf_counter()
    mod, _ = build_decoder(config, kv_expand=args.kv_expand)
    build_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = partition_for_cutlass(mod, mqa=True)
        times.append(time.perf_counter() - t0)
    report = offload_report(mod)
    offloaded = sum(s.offloaded for s in report)
    best = min(times)
    print(f"{config.name}: {config.num_layers} layers, {len(report)} attention sites, {offloaded} offloaded; "
          f"graph built in {build_s:.2f} s; partition_for_cutlass best of {args.repeat}: {best:.2f} s "
          f"(all: {', '.join(f'{t:.2f}' for t in times)}) on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "partition_speed", "command": "python benchmarks/partition_speed.py",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                       "preset": config.name, "kv_expand": args.kv_expand, "layers": config.num_layers,
                       "sites": len(report), "offloaded": offloaded, "graph_build_s": round(build_s, 3),
                       "partition_s": [round(t, 3) for t in times], "goal_s": 2.0}, f, indent=1)
    codegen = {gv for gv, f in out.functions.items() if f.attrs is not None and "Codegen" in f.attrs}
    calls = sum(1 for fn in ("prefill", "decode") for b in out[fn].body.blocks for x in b.bindings
                if getattr(x.value, "op", None) in codegen)
    assert calls == offloaded, (calls, offloaded)


if __name__ == "__main__":
    main()
