"""Attention microbenchmarks: our FA2 offload (mqa=True) vs the repeat path (mqa=False), stock TVM,
FA2 called directly and PyTorch SDPA with enable_gqa, measured side by side in one run.

Two steps, on two machines (the GPU machine has only TVM's runtime):

    python benchmarks/attention.py build --out .bench-artifacts [--suite issue4|full] [--providers python,native]
    python3 benchmarks/attention.py run --artifacts .bench-artifacts --json results.json   # on the GPU

``build`` writes one library per (case, variant) plus ``cases.json``; ``run`` loads them with the
runtime-only TVM, times each with CUDA events over back-to-back calls (the steady state a decode
loop sees: CPU overhead per call counts when it exceeds the kernel time) and writes JSON records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

SUITES = {
    # the shapes the issues ask about: H=64, H_kv=8, D=128 fp16
    "issue4": [
        dict(name="decode-16k", mode="decode", h=64, hkv=8, d=128, dtype="float16", s_q=1, s_kv=16384, causal=False),
        dict(name="prefill-2k-causal", mode="prefill", h=64, hkv=8, d=128, dtype="float16", s_q=2048, s_kv=2048,
             causal=True),
    ],
}
SUITES["full"] = SUITES["issue4"] + [
    dict(name=f"{mode}-{label}-{dt}", mode=mode, h=64, hkv=8, d=128, dtype=dt, s_q=(1 if mode == "decode" else n),
         s_kv=n, causal=mode == "prefill")
    for dt in ("float16", "bfloat16")
    for mode, sizes in (("prefill", (1024, 4096, 16384)), ("decode", (1024, 4096, 16384, 32768)))
    for n in sizes
    for label in [f"{n // 1024}k"]
    if not (dt == "float16" and ((mode, n) in (("prefill", 2048), ("decode", 16384))))
]

# stock TVM lowers attention ~580x slower than FA2: only where it finishes in reasonable time
STOCK_MAX_WORK = 2048 * 2048


def _module(case):
    from mqa_byoc.models.llama import build_attention_block

    return build_attention_block(
        case["h"], case["hkv"], case["d"], kv_expand="repeat", dtype=case["dtype"], mode="extend",
        batch=1, seq_len=case["s_q"], kv_len=case["s_kv"],
        causal_mask="BottomRight" if case["causal"] else None,
    )


def build(args):
    import tvm
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler import codegen
    from mqa_byoc.compiler.gqa_legalize import LegalizeGroupedAttention

    os.makedirs(args.out, exist_ok=True)
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    cases = []
    for case in SUITES[args.suite]:
        mod = _module(case)
        variants = {}
        for provider in args.providers.split(","):
            for mqa in (True, False):
                name = f"{'mqa' if mqa else 'repeat'}-{provider}"
                part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
                with target, codegen.use_provider(provider):
                    ex = relax.build(relax.transform.RunCodegen()(part), target=target)
                path = os.path.join(args.out, f"{case['name']}.{name}.so")
                if provider == "native":
                    mqa_byoc.export_library(ex, path, arch=args.arch)
                else:
                    ex.export_library(path)
                variants[name] = os.path.basename(path)
                print(f"built {path}", flush=True)
        if case["s_q"] * case["s_kv"] <= STOCK_MAX_WORK:
            with target:
                ex = relax.build(LegalizeGroupedAttention()(mod), target=target)
            path = os.path.join(args.out, f"{case['name']}.stock-tvm.so")
            ex.export_library(path)
            variants["stock-tvm"] = os.path.basename(path)
        cases.append({**case, "variants": variants})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"arch": args.arch, "cases": cases}, f, indent=1)


def _time(fn, iters, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # microseconds


def run(args):
    import torch
    import tvm
    import tvm.runtime.vm  # noqa: F401 - not loaded by tvm.runtime itself

    try:
        import boot  # noqa: F401 - runtime-only TVM on the GPU machine (see ../shared/device)
    except ImportError:
        pass
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import mqa_byoc.runtime.providers  # noqa: F401 - registers the python provider's entry point
    with open(os.path.join(args.artifacts, "cases.json")) as f:
        meta = json.load(f)
    dev = tvm.cuda(0)
    records = []
    gpu = torch.cuda.get_device_name(0)
    for case in meta["cases"]:
        dt = getattr(torch, case["dtype"])
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, case["s_q"], case["h"], case["d"], device="cuda", dtype=dt, generator=g)
        k = torch.randn(1, case["s_kv"], case["hkv"], case["d"], device="cuda", dtype=dt, generator=g)
        v = torch.randn(1, case["s_kv"], case["hkv"], case["d"], device="cuda", dtype=dt, generator=g)
        scale = 1.0 / math.sqrt(case["d"])
        iters = args.iters if case["s_q"] * case["s_kv"] < 64 * 2048 * 2048 else max(5, args.iters // 10)
        results = {}

        def fa2_direct():
            return torch.ops.aten._flash_attention_forward(
                q, k, v, None, None, case["s_q"], case["s_kv"], 0.0, case["causal"], False, scale=scale)[0]

        results["fa2-direct"] = _time(fa2_direct, iters)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=case["causal"] and case["s_q"] > 1, enable_gqa=True)

        results["torch-sdpa-gqa"] = _time(sdpa, iters)
        ref = fa2_direct().float()
        args_tvm = [tvm.runtime.from_dlpack(x) for x in (q, k, v)]
        errors = {}
        for variant, lib in case["variants"].items():
            vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(os.path.join(args.artifacts, lib)), dev)
            f = vm["main"]
            out = torch.from_dlpack(f(*args_tvm)).float()
            errors[variant] = float((out - ref).abs().max())
            n = iters if variant != "stock-tvm" else max(2, iters // 20)
            results[variant] = _time(lambda: f(*args_tvm), n, warmup=1)
        base = results["fa2-direct"]
        kv_bytes = 2 * case["s_kv"] * case["hkv"] * case["d"] * q.element_size()
        flops = 4 * case["s_q"] * case["s_kv"] * case["h"] * case["d"] * (0.5 if case["causal"] else 1.0)
        for variant, us in results.items():
            rec = {
                "benchmark": "attention", "case": case["name"], "mode": case["mode"], "dtype": case["dtype"],
                "num_q_heads": case["h"], "num_kv_heads": case["hkv"], "head_dim": case["d"],
                "seq_q": case["s_q"], "seq_kv": case["s_kv"], "causal": case["causal"], "variant": variant,
                "us": round(us, 2), "ratio_vs_fa2_direct": round(us / base, 3),
                "max_abs_err_vs_fa2": errors.get(variant),
            }
            if case["mode"] == "decode":
                rec["hbm_tb_s"] = round(kv_bytes / (us * 1e-6) / 1e12, 3)
            else:
                rec["tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
            records.append(rec)
            print(f"{case['name']:24s} {variant:16s} {us:12.1f} us  x{us / base:7.3f} vs FA2"
                  + (f"  err {errors[variant]:.2e}" if variant in errors else ""), flush=True)
        if case["mode"] == "prefill":
            # a tensor-core GEMM of the Q@K^T shape, the honest ceiling for prefill throughput
            a = torch.randn(case["h"], case["s_q"], case["d"], device="cuda", dtype=dt)
            b = torch.randn(case["h"], case["d"], case["s_kv"], device="cuda", dtype=dt)
            us = _time(lambda: torch.bmm(a, b), iters)
            records.append({"benchmark": "attention", "case": case["name"], "variant": "cublas-qk-gemm",
                            "dtype": case["dtype"], "us": round(us, 2),
                            "tflops": round(2 * case["h"] * case["s_q"] * case["s_kv"] * case["d"] / (us * 1e-6) / 1e12, 1)})
    out = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "gpu": gpu, "records": records}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", default=".bench-artifacts")
    b.add_argument("--suite", default="issue4", choices=sorted(SUITES))
    b.add_argument("--providers", default="python")
    b.add_argument("--arch", default="sm_90")
    r = sub.add_parser("run")
    r.add_argument("--artifacts", default=".bench-artifacts")
    r.add_argument("--json", default="attention-results.json")
    r.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    t0 = time.time()
    (build if args.cmd == "build" else run)(args)
    print(f"{args.cmd} took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
