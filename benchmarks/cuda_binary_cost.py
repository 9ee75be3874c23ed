"""What compiling TVM's own CUDA kernels at build time (``cuda_binary=True``) costs: the seconds nvcc adds
to a build + export, on the build machine (no GPU needed).

    python benchmarks/cuda_binary_cost.py [--layers 2] [--repeat 3] [--json out.json]

Builds a Llama-3-8B-shaped decoder (small width, ``--layers`` layers, native provider,
``cuda_decoder_pipeline``) once, exports it with TVM's CUDA kept as source (what the loading process
compiles through ``tvm_callback_cuda_compile``), then compiles that source to fatbins
(:func:`mqa_byoc.compiler.cuda_binary.compile_cuda_modules`, what ``cuda_binary=True`` runs) and exports
again; ``--repeat`` times from a fresh build. Records the seconds of each step per repeat and their
medians, the kernels and modules compiled, the library sizes, the machine's cores and load average (the
nvcc time scales with both).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _one(mqa_byoc, mod, target, arch, *, pipeline, compile_cuda_modules, cuda_source_modules) -> dict:
    """One build, export, nvcc of TVM's CUDA, export again: seconds of each, what was compiled, sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ex = mqa_byoc.build(mod, target, provider="native", pipeline=pipeline)
        t1 = time.perf_counter()
        ex.export_library(os.path.join(tmp, "source.so"))
        t2 = time.perf_counter()
        sources = [m.inspect_source("cuda") for m in cuda_source_modules(ex)]
        t3 = time.perf_counter()
        modules = compile_cuda_modules(ex, arch)
        t4 = time.perf_counter()
        ex.export_library(os.path.join(tmp, "fatbin.so"))
        t5 = time.perf_counter()
        return {"build_s": round(t1 - t0, 1), "export_s": round(t2 - t1, 1), "nvcc_s": round(t4 - t3, 1),
                "export_after_nvcc_s": round(t5 - t4, 1), "cuda_modules_compiled": modules,
                "cuda_modules_left": len(cuda_source_modules(ex)),
                "kernels": sum(src.count('extern "C" __global__') for src in sources),
                "library_bytes": {k: os.path.getsize(os.path.join(tmp, f"{k}.so")) for k in ("source", "fatbin")},
                "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import tvm

    import mqa_byoc
    from mqa_byoc.compiler.cuda_binary import compile_cuda_modules, cuda_source_modules
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled

    record = {"command": " ".join(["python", *sys.argv]), "commit": _commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": None, "machine": {"cpus": os.cpu_count(), "load_avg_1m_start": round(os.getloadavg()[0], 2),
                                       "python": platform.python_version(), "tvm": tvm.__version__}}
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    cfg = scaled("llama3-8b", num_layers=args.layers, vocab_size=512, hidden_size=256, intermediate_size=512,
                 sliding_window=False)
    mod, _ = build_decoder(cfg, kv_expand="hf-broadcast", batch=1, logits="last", functions=("prefill", "decode"))
    runs = [_one(mqa_byoc, mod, target, args.arch, pipeline=cuda_decoder_pipeline(target),
                 compile_cuda_modules=compile_cuda_modules, cuda_source_modules=cuda_source_modules)
            for _ in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("build_s", "export_s", "nvcc_s", "export_after_nvcc_s")}
    record["decoder"] = {
        "preset": "llama3-8b", "layers": args.layers, "provider": "native", "repeats": runs,
        **{f"median_{k}": round(v, 1) for k, v in med.items()},
        "cuda_modules_compiled": runs[0]["cuda_modules_compiled"], "kernels": runs[0]["kernels"],
        "median_nvcc_share_of_build_and_export": round(med["nvcc_s"] / (med["build_s"] + med["export_s"]), 2),
    }
    record["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    d = record["decoder"]
    print(f"{args.layers}-layer decoder, median of {args.repeat}: build {d['median_build_s']} s, export "
          f"{d['median_export_s']} s; nvcc of {d['kernels']} TVM kernels in {d['cuda_modules_compiled']} module(s) "
          f"{d['median_nvcc_s']} s ({d['median_nvcc_share_of_build_and_export']:.0%} of build + export)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
