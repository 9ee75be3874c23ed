"""Decode attention kernels alone on the GPU (no TVM): our grouped-query decode kernel
(``native/gqa_decode.cu``) vs cuDNN (PyTorch SDPA, ``enable_gqa``) and FA2 (PyTorch's flash forward,
native GQA), batch 1, one query row, K/V in the in-place cache's (B, S, H_kv, D) layout. GPU kernel time
per call from CUPTI, every output checked against fp32. Ours as the plan runs it (the splits merging in
a thread-block cluster where they fit one) and with the same plan merged through the workspace;
``--sweep`` also times both merges at fixed keys-per-split values (how the plan's split rule was chosen).

    PYTHONPATH=src python benchmarks/decode_kernel.py --out benchmarks/results/DATE-decode-kernel
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mqa_byoc.testing.header import hbm_bytes_per_s  # noqa: E402

SHAPES = [(64, 8, 128), (32, 8, 128), (71, 1, 64)]  # the attention benchmark's presets (H, H_kv, D)
LENGTHS = [1024, 4096, 16384, 32768]


def kernel_us(fn, iters: int) -> float:
    """Summed CUPTI kernel time per call of ``fn`` (every kernel it launches)."""
    import torch

    from mqa_byoc.testing.cupti import capture_kernels

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with capture_kernels() as cap:
        for _ in range(iters):
            fn()
    return sum(t for _, t in cap.events) / iters


def run_case(h: int, hk: int, d: int, n: int, dtype, iters: int, sweep: bool, floor: bool = False) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mqa_byoc.testing import decode_kernel as dk

    gen = torch.Generator(device="cuda").manual_seed(n + h)
    q = torch.randn(1, h, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(1, n, hk, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(1, n, hk, d, generator=gen, device="cuda").to(dtype)
    out = torch.empty_like(q)
    ours = dk.Decode(q, k, v, out, None, k_stride=k.stride()[:3], v_stride=v.stride()[:3], seqlen_k=n,
                     num_heads_k=hk)
    ref, _ = dk.reference(q, k, v, [n], hk)
    ours()
    torch.cuda.synchronize()
    rec = {"shape": f"{h}/{hk}/{d}", "dtype": str(dtype).removeprefix("torch."), "keys": n,
           "splits": ours.plan.splits, "keys_per_split": ours.plan.keys_per_split, "warps": ours.plan.warps,
           "hbm_us": 2 * n * hk * d * q.element_size() / hbm_bytes_per_s() * 1e6,
           "max_err_ours": (out.float() - ref).abs().max().item()}
    rec["ours_us"] = kernel_us(ours, iters)
    if floor:
        from mqa_byoc.testing.read_floor import read_floor_us

        kv = torch.cat([k.flatten(), v.flatten()])  # the bytes a decode reads, in one buffer
        rec.update(read_floor_us(kv, lambda fn: kernel_us(fn, iters)))
        # ours reading copies of K/V in turn that together exceed L2: every call from HBM
        copies = [ours] + [dk.Decode(q, kc, vc, out, None, k_stride=k.stride()[:3], v_stride=v.stride()[:3],
                                     seqlen_k=n, num_heads_k=hk)
                           for kc, vc in ((k.clone(), v.clone()) for _ in range(-(-(100 << 20) // kv.nbytes)))]
        turns = itertools.cycle(copies)
        rec["ours_cold_us"] = kernel_us(lambda: next(turns)(), iters)
        del copies, kv
    workspace = dk.Decode(q, k, v, out, None, k_stride=k.stride()[:3], v_stride=v.stride()[:3], seqlen_k=n,
                          num_heads_k=hk, merge="global")
    rec["ours_workspace_merge_us"] = kernel_us(workspace, iters)
    q4, k4, v4 = q.view(1, h, 1, d), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)
        rec["max_err_cudnn"] = (o.view(1, h, d).float() - ref).abs().max().item()
        rec["cudnn_us"] = kernel_us(lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True), iters)

    def fa2():
        return torch.ops.aten._flash_attention_forward(q.view(1, 1, h, d), k, v, None, None, 1, n, 0.0, False,
                                                       False, scale=1.0 / math.sqrt(d))[0]

    rec["max_err_fa2"] = (fa2().view(1, h, d).float() - ref).abs().max().item()
    rec["fa2_us"] = kernel_us(fa2, iters)
    if sweep:
        rec["sweep_us"] = {}  # keys per split -> {"auto": cluster merge where it fits, "workspace": ...}
        for kps in (128, 256, 512, 1024, 2048, 4096):
            if -(-n // kps) <= 128 and kps <= 2 * n:
                rec["sweep_us"][kps] = {}
                for name, call in (("auto", ours), ("workspace", workspace)):
                    call.set_keys_per_split(kps)
                    rec["sweep_us"][kps][name] = kernel_us(call, iters)
    return rec


def markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"# Decode kernels alone, {header['gpu']} ({header['date']})", "",
             f"`{header['command']}`; batch 1, one query row; GPU kernel time per call (CUPTI, µs); "
             f"`x HBM` = time / (K and V bytes at {hbm_bytes_per_s(header) / 1e12:g} TB/s).", "",
             "| H/H_kv/D | dtype | keys | ours | ours, workspace merge | cuDNN | FA2 | ours / cuDNN | ours x HBM | "
             "cuDNN x HBM | splits x keys (warps a CTA) | max err ours / cuDNN |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['keys']} | {r['ours_us']:.2f} | "
                     f"{r['ours_workspace_merge_us']:.2f} | {r['cudnn_us']:.2f} | "
                     f"{r['fa2_us']:.2f} | {r['ours_us'] / r['cudnn_us']:.2f} | {r['ours_us'] / r['hbm_us']:.2f} | "
                     f"{r['cudnn_us'] / r['hbm_us']:.2f} | {r['splits']} x {r['keys_per_split']} ({r['warps']}) | "
                     f"{r['max_err_ours']:.1e} / {r['max_err_cudnn']:.1e} |")
    floors = [r for r in rows if "read_floor_warm_us" in r]
    if floors:
        lines += ["", "## The read floor", "",
                  "The fastest a kernel of ours that only reads the K/V bytes (`testing/read_floor.cu`, the best of "
                  "its launch shapes) takes: `warm` reads the same buffer every call, as the loop above reads its "
                  "cache (a cache smaller than L2 stays there); `cold` takes turns over copies that together "
                  "exceed L2, so every read is from HBM, and `ours, cold` does the same for our decode. "
                  "`empty` is a kernel that does nothing.", "",
                  "| H/H_kv/D | dtype | keys | HBM time | read floor, warm | read floor, cold | ours | ours, cold | "
                  "empty | cold floor x HBM |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in floors:
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['keys']} | {r['hbm_us']:.2f} | "
                         f"{r['read_floor_warm_us']:.2f} | {r['read_floor_cold_us']:.2f} | {r['ours_us']:.2f} | "
                         f"{r['ours_cold_us']:.2f} | {r['empty_kernel_us']:.2f} | "
                         f"{r['read_floor_cold_us'] / r['hbm_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--sweep", action="store_true", help="also time fixed keys-per-split values")
    ap.add_argument("--read-floor", action="store_true",
                    help="also time the read floor (testing/read_floor.cu) and ours with K/V out of L2")
    args = ap.parse_args(argv)
    import torch

    from mqa_byoc.testing.header import run_header

    header = run_header()
    rows = []
    for h, hk, d in SHAPES:
        for dt in args.dtypes:
            for n in args.lengths:
                r = run_case(h, hk, d, n, getattr(torch, dt), args.iters, args.sweep, args.read_floor)
                rows.append(r)
                print(f"{r['shape']} {r['dtype']} {n:6d}: ours {r['ours_us']:7.2f}  cuDNN {r['cudnn_us']:7.2f}  "
                      f"FA2 {r['fa2_us']:7.2f}  ours/cuDNN {r['ours_us'] / r['cudnn_us']:.2f}  "
                      f"x HBM {r['ours_us'] / r['hbm_us']:.2f}  err {r['max_err_ours']:.1e}"
                      + (f"  sweep {r['sweep_us']}" if args.sweep else ""), flush=True)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps({**header, "cases": rows}, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(markdown(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
