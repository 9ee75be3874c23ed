"""GEMMs of the CodeLlama-34B preset: ours (cuBLASLt through TVM) vs TVM's own kernels vs torch.matmul.

    python tools/gpu/build_gemm.py --out DIR          # where TVM's compiler is (writes DIR/bench)
    python benchmarks/gemm.py --artifacts DIR --out benchmarks/results/<date>-gemm   # on the GPU

Per shape (nn.Linear: x @ W^T, fp16; qkv fused 10240 x 8192, o_proj 8192 x 8192, gate_up fused
44032 x 8192, down 8192 x 22016) and M (rows = batch x tokens: 1, 8, 32 decode; 2048, 16384 prefill):

- ``ours``: the function with symbolic M partitioned with ``partition_for_cutlass(gemm=True)``, i.e.
  cuBLASLt through the TVM VM (what a decoder with a run-time batch runs);
- ``tvm_static``: TVM's decoder pipeline (FuseTransposeMatmul + dlight) for that static M: dlight's GEMV
  rule applies at M = 1 (what the in-place decoder's batch-1 decode runs);
- ``tvm_sym``: TVM's decoder pipeline with symbolic M (what the paged decoder ran before);
- ``torch``: ``torch.matmul(x, w.T)`` (cuBLAS) on the same tensors;
- ``ours_cast``: ``ToMixedPrecision``'s default form, ``astype(matmul(x, w.T, out_dtype="float32"),
  "float16")``, partitioned: one cuBLASLt call that writes fp16; ``ours_cast_unfused``: the same with the
  float32 result also returned, so the cast is not fused: a float32-output cuBLASLt call, then TVM's
  cast kernel (what that form ran before the cast was fused); these two are timed twice, in the order
  fused, unfused, unfused, fused, and their means reported.

Each is timed with CUDA events over back-to-back calls (host overhead included where it exceeds the
kernel), in one run; rates against the GPU's own limits (the H200's 4.8 TB/s and 989 TFLOP/s dense fp16,
``mqa_byoc.runtime.gpu_limits``). Writes
``<out>.json`` and ``<out>.md`` (commit, command, date, GPU).

``--cold``: each call multiplies by the next of copies of W that together exceed twice the L2 (as a
decoder's layers do: no call finds its weight in L2; back to back on one W, a weight under ~150 MB is
partly read from L2). ``--read-floor``: per shape, the least time a kernel that only reads W takes
(``testing/read_floor.cu``, the fastest of its launch shapes, from HBM), the bound under any GEMV of that
weight; the table then gives each decode GEMM against it. ``--max-m 32``: the decode rows only.

    python benchmarks/gemm.py --artifacts DIR --out OUT --cold --read-floor --max-m 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HBM_TBPS = 4.8  # the H200's: the limits of results that record none
PEAK_TFLOPS = 989.0
L2_BYTES = 50 << 20  # the H200's L2 (50 MB)


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--iters", type=int, default=0, help="calls per timing (0: by size)")
    ap.add_argument("--cold", action="store_true", help="each call takes the next of copies of W exceeding 2x L2")
    ap.add_argument("--read-floor", action="store_true", help="time a kernel that only reads W, per shape")
    ap.add_argument("--max-m", type=int, default=None, help="only the rows M up to this (32: decode)")
    args = ap.parse_args(argv)
    if args.max_m is not None and args.max_m < 1:
        ap.error("--max-m must be at least 1")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mqa_byoc.deploy import prepare_runtime

    prepare_runtime()  # the runtime kit's set-up where TVM is runtime-only
    import torch
    import tvm
    import tvm.runtime.vm
    from decode_kernel import kernel_us  # summed CUPTI kernel time per call

    from mqa_byoc.runtime.gpu_limits import this_gpu_limits
    from mqa_byoc.testing.read_floor import cold_copies, read_floor_us
    from mqa_byoc.testing.timing import cuda_time_us

    limits = this_gpu_limits(torch)

    bench = args.artifacts / "bench"
    manifest = json.loads((bench / "manifest.json").read_text())
    dev = tvm.cuda(0)
    vms = {name: tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(bench / f"{name}.so")), dev)
           for name in ("ours", "tvm_sym", "tvm_static")}
    rows, floors = [], {}
    for name, n, k in manifest["shapes"]:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        # --cold: copies of W taken in turns, together over twice the L2 (the first is w, the reference's)
        ws = cold_copies(w, L2_BYTES) if args.cold else [w]
        tws = [tvm.runtime.from_dlpack(c) for c in ws]
        turn = [0]  # the next copy; each variant starts again at w, the reference's weight

        def pick():
            i, turn[0] = turn[0] % len(ws), turn[0] + 1
            return ws[i], tws[i]

        if args.read_floor:
            floors[name] = read_floor_us(w, lambda fn: kernel_us(fn, 20))
            floors[name]["hbm_us"] = round(n * k * 2 / limits.hbm_tbps / 1e6, 2)
            print(json.dumps({"read_floor": name, **floors[name]}), flush=True)
        for m in manifest["m"]:
            if args.max_m is not None and m > args.max_m:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            tx = tvm.runtime.from_dlpack(x)
            flops = 2.0 * m * n * k
            nbytes = 2.0 * (m * k + n * k + m * n)
            iters = args.iters or max(3, min(200, int(2e5 / max(flops / 700e6, nbytes / 4.0e6))))
            ref = torch.matmul(x, w.T)
            row = {"gemm": name, "M": m, "N": n, "K": k, "flop": flops, "bytes": nbytes, "iters": iters}
            calls = {
                "ours": lambda: vms["ours"][name](tx, pick()[1]),
                "tvm_static": lambda: vms["tvm_static"][f"{name}_m{m}"](tx, pick()[1]),
                "tvm_sym": lambda: vms["tvm_sym"][name](tx, pick()[1]),
                "torch": lambda: torch.matmul(x, pick()[0].T),
            }
            if "forms" in manifest:
                calls["ours_cast"] = lambda: vms["ours"][f"{name}_cast"](tx, pick()[1])
                calls["ours_cast_unfused"] = lambda: vms["ours"][f"{name}_cast_unfused"](tx, pick()[1])[0]
            # the cast forms are timed twice, in the order fused, unfused, unfused, fused (the mean of both):
            # the GPU's clock drifts over a run, and the pair is what is compared
            order = [*calls, *(["ours_cast_unfused", "ours_cast"] if "ours_cast" in calls else [])]
            for variant in order:
                fn = calls[variant]
                try:
                    turn[0] = 0
                    out = fn()
                    got = torch.from_dlpack(out) if variant != "torch" else out
                    err = float((got.float() - ref.float()).abs().max())
                    us = cuda_time_us(fn, iters)
                    if "us" in row.get(variant, {}):
                        us = (row[variant]["us"] + us) / 2
                except Exception as e:  # noqa: BLE001 - a failed variant is recorded, the others still run
                    row[variant] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    continue
                row[variant] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                                "tbps": round(nbytes / us / 1e6, 3), "max_abs_err_vs_torch": round(err, 4)}
            for variant in ("ours", "tvm_static", "tvm_sym"):
                if "us" in row.get(variant, {}) and "us" in row["torch"]:
                    row[variant]["vs_torch"] = round(row["torch"]["us"] / row[variant]["us"], 3)
            if "us" in row.get("ours_cast", {}) and "us" in row.get("ours_cast_unfused", {}):
                row["ours_cast"]["speedup_vs_unfused"] = round(row["ours_cast_unfused"]["us"] / row["ours_cast"]["us"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del x, tx
        del w, ws, tws
        torch.cuda.empty_cache()
    result = {
        "benchmark": "gemm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or _commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "limits": limits.as_dict(),
        "cold": args.cold, "rows": rows,
    }
    if floors:
        result["read_floor"] = floors
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def _cell(v, decode):
    if "us" not in v:
        return "error"
    rate = f"{v['tbps']:.2f} TB/s" if decode else f"{v['tflops']:.0f} TF/s"
    return f"{v['us']:.1f} µs ({rate})"


def markdown(result) -> str:
    """The results as a markdown table (decode rows in TB/s, prefill rows in TFLOP/s)."""
    lim = result.get("limits") or {}
    lines = [f"# GEMMs of CodeLlama-34B (fp16, x @ W^T): cuBLASLt through TVM vs TVM vs torch",
             "", f"{result['date']}, commit {result['commit']}, {result['gpu']}, torch {result['torch']}; "
             f"`{result['command']}`", "",
             f"Limits: {lim.get('hbm_tbps', HBM_TBPS)} TB/s HBM, {lim.get('dense_tflops', PEAK_TFLOPS):.0f} TFLOP/s "
             "dense fp16. Rates: bytes (x, W, out once) per "
             "second for M <= 32, FLOP/s above.", "",
             "| GEMM | M | ours (cuBLASLt) | TVM static M | TVM symbolic M | torch.matmul | ours / torch |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        decode = r["M"] <= 32
        ratio = r["ours"].get("vs_torch")
        lines.append(f"| {r['gemm']} {r['N']}x{r['K']} | {r['M']} | {_cell(r['ours'], decode)} | "
                     f"{_cell(r['tvm_static'], decode)} | {_cell(r['tvm_sym'], decode)} | {_cell(r['torch'], decode)} | "
                     f"{ratio if ratio is not None else '-'} |")
    floors = result.get("read_floor")
    if floors:
        lines += ["", "The read floor: the least time a kernel that only reads W takes (`testing/read_floor.cu`, the "
                  "fastest of its launch shapes, W from HBM), against W's bytes at the HBM limit, and the decode "
                  "GEMMs against it" + (" (every call on a weight not in L2: `--cold`)" if result.get("cold") else "")
                  + ".", "",
                  "| GEMM | W MB | HBM limit µs | read floor µs | floor / limit | M | ours / floor | torch / floor |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["rows"]:
            f = floors.get(r["gemm"])
            if f is None or r["M"] > 32:
                continue
            fl = f["read_floor_cold_us"]
            ratio = {v: f"{r[v]['us'] / fl:.2f}" if "us" in r.get(v, {}) else "-" for v in ("ours", "torch")}
            lines.append(f"| {r['gemm']} {r['N']}x{r['K']} | {r['N'] * r['K'] * 2 / 1e6:.0f} | {f['hbm_us']:.1f} | "
                         f"{fl:.1f} | {fl / f['hbm_us']:.3f} | {r['M']} | {ratio['ours']} | {ratio['torch']} |")
    cast_rows = [r for r in result["rows"] if "ours_cast" in r]
    if cast_rows:
        lines += ["", "ToMixedPrecision's default form, `astype(matmul(x, W^T, out_dtype=\"float32\"), \"float16\")`: "
                  "the cast fused into the cuBLASLt call (fp16 written) vs not fused (a float32-output call, then "
                  "TVM's cast kernel). Rates count the fp16 output.", "",
                  "| GEMM | M | cast fused | not fused | fused speedup |", "|---|---:|---:|---:|---:|"]
        for r in cast_rows:
            decode = r["M"] <= 32
            speed = r["ours_cast"].get("speedup_vs_unfused")
            lines.append(f"| {r['gemm']} {r['N']}x{r['K']} | {r['M']} | {_cell(r['ours_cast'], decode)} | "
                         f"{_cell(r['ours_cast_unfused'], decode)} | {speed if speed is not None else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
