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
kernel), in one run; rates against the H200's 4.8 TB/s and 989 TFLOP/s (dense fp16). Writes
``<out>.json`` and ``<out>.md`` (commit, command, date, GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HBM_TBPS = 4.8
PEAK_TFLOPS = 989.0


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
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mqa_byoc.deploy import prepare_runtime

    prepare_runtime()  # the runtime kit's set-up where TVM is runtime-only
    import torch
    import tvm
    import tvm.runtime.vm

    from mqa_byoc.testing.timing import cuda_time_us

    bench = args.artifacts / "bench"
    manifest = json.loads((bench / "manifest.json").read_text())
    dev = tvm.cuda(0)
    vms = {name: tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(bench / f"{name}.so")), dev)
           for name in ("ours", "tvm_sym", "tvm_static")}
    rows = []
    for name, n, k in manifest["shapes"]:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        tw = tvm.runtime.from_dlpack(w)
        for m in manifest["m"]:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            tx = tvm.runtime.from_dlpack(x)
            flops = 2.0 * m * n * k
            nbytes = 2.0 * (m * k + n * k + m * n)
            iters = args.iters or max(3, min(200, int(2e5 / max(flops / 700e6, nbytes / 4.0e6))))
            ref = torch.matmul(x, w.T)
            row = {"gemm": name, "M": m, "N": n, "K": k, "flop": flops, "bytes": nbytes, "iters": iters}
            calls = {
                "ours": lambda: vms["ours"][name](tx, tw),
                "tvm_static": lambda: vms["tvm_static"][f"{name}_m{m}"](tx, tw),
                "tvm_sym": lambda: vms["tvm_sym"][name](tx, tw),
                "torch": lambda: torch.matmul(x, w.T),
            }
            if "forms" in manifest:
                calls["ours_cast"] = lambda: vms["ours"][f"{name}_cast"](tx, tw)
                calls["ours_cast_unfused"] = lambda: vms["ours"][f"{name}_cast_unfused"](tx, tw)[0]
            # the cast forms are timed twice, in the order fused, unfused, unfused, fused (the mean of both):
            # the GPU's clock drifts over a run, and the pair is what is compared
            order = [*calls, *(["ours_cast_unfused", "ours_cast"] if "ours_cast" in calls else [])]
            for variant in order:
                fn = calls[variant]
                try:
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
        del w, tw
        torch.cuda.empty_cache()
    result = {
        "benchmark": "gemm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or _commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "limits": {"hbm_tbps": HBM_TBPS,
                                                                                     "dense_tflops": PEAK_TFLOPS},
        "rows": rows,
    }
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
    lines = [f"# GEMMs of CodeLlama-34B (fp16, x @ W^T): cuBLASLt through TVM vs TVM vs torch",
             "", f"{result['date']}, commit {result['commit']}, {result['gpu']}, torch {result['torch']}; "
             f"`{result['command']}`", "",
             f"Limits: {HBM_TBPS} TB/s HBM, {PEAK_TFLOPS:.0f} TFLOP/s dense fp16. Rates: bytes (x, W, out once) per "
             "second for M <= 32, FLOP/s above.", "",
             "| GEMM | M | ours (cuBLASLt) | TVM static M | TVM symbolic M | torch.matmul | ours / torch |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        decode = r["M"] <= 32
        ratio = r["ours"].get("vs_torch")
        lines.append(f"| {r['gemm']} {r['N']}x{r['K']} | {r['M']} | {_cell(r['ours'], decode)} | "
                     f"{_cell(r['tvm_static'], decode)} | {_cell(r['tvm_sym'], decode)} | {_cell(r['torch'], decode)} | "
                     f"{ratio if ratio is not None else '-'} |")
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
