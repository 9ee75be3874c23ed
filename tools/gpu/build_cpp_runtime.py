"""Build the decoder library the C++-runtime test runs (tests/gpu/test_gpu_cpp_runtime.py).

    python tools/gpu/build_cpp_runtime.py [--out .gpu-artifacts/cpp-runtime] [--arch sm_90]

A two-layer llama3-8b-shaped decoder (H=32, H_kv=8, D=128, fp16) through ``mqa_byoc.build`` with the
native provider and ``cuda_binary=True``, exported with TVM's own ``ex.export_library`` (the kernel
objects are attached as static-library modules by the build); its random weights (``params.txt``,
``params.bin``) and a prompt (``prompt.txt``) in the layout ``tools/cpp/run_decoder.cc`` reads; and
``build.json`` saying what the library holds (no CUDA source, the kernel options, the FA2 symbols).

Also ``options/<name>.so``: one grouped decode attention (H=32, H_kv=8, D=128, fp16, S_q=1, symbolic
S_kv) built with each of :data:`OPTION_VARIANTS` as ``kernel_options`` (the GPU test checks the kernels
each runs and that the environment does not change them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builder_paths  # noqa: E402,F401 - sys.path for mqa_byoc

PRESET = "llama3-8b"
LAYERS, VOCAB, HIDDEN, INTERMEDIATE = 2, 512, 256, 512
PROMPT_LEN, SEED = 12, 0
LIBRARY = "decoder.so"
#: what TVM's generated CUDA source holds (each kernel), and no compiled code does
CUDA_SOURCE = b'extern "C" __global__'
#: kernel_options of the single-attention libraries
OPTION_VARIANTS = {
    "default": None,
    "fa2-decode": {"decode_kernel": "fa2"},
    "fa2-decode-fa2-combine": {"decode_kernel": "fa2", "split_combine": "fa2"},
}


def build_option_variants(out: Path, arch: str) -> dict:
    import tvm

    from mqa_byoc.testing import graphs
    import mqa_byoc

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    (out / "options").mkdir(parents=True, exist_ok=True)
    files = {}
    for name, options in OPTION_VARIANTS.items():
        mod = graphs.attention_repeat_bsnh(h=32, hkv=8, d=128, s=1, s_kv="m", b=1)
        ex = mqa_byoc.build(mod, target, provider="native", kernel_options=options, cuda_binary=True)
        path = out / "options" / f"{name}.so"
        ex.export_library(str(path))
        files[name] = {"library": f"options/{name}.so", "kernel_options": options or {}}
    return files


def build(out: Path, arch: str) -> dict:
    import numpy as np
    import tvm

    import mqa_byoc
    from mqa_byoc.compiler.cuda_binary import cuda_source_modules
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    cfg = scaled(PRESET, num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                 sliding_window=False)
    mod, spec = build_decoder(cfg, kv_expand="hf-broadcast", batch=1, logits="last", functions=("prefill", "decode"))
    sites = mqa_byoc.offload_report(mod)
    if not sites or not all(s.offloaded for s in sites):
        raise SystemExit(f"not every attention is offloaded: {sites}")
    ex = mqa_byoc.build(mod, target, provider="native", pipeline=cuda_decoder_pipeline(target), cuda_binary=True,
                        progress=print)
    left = cuda_source_modules(ex)
    if left:
        raise SystemExit(f"{len(left)} CUDA source module(s) left after cuda_binary=True")
    path = out / LIBRARY
    ex.export_library(str(path))  # TVM's own export: the attached kernel objects link

    rng = np.random.default_rng(SEED)
    with open(out / "params.txt", "w") as txt, open(out / "params.bin", "wb") as blob:
        for p in spec:
            w = (rng.standard_normal(p.shape) * 0.05).astype(p.dtype)
            if p.name.endswith("norm.weight"):
                w = (1.0 + rng.standard_normal(p.shape) * 0.05).astype(p.dtype)
            txt.write(" ".join([p.dtype, *map(str, p.shape)]) + "\n")
            blob.write(w.tobytes())
    (out / "prompt.txt").write_text(" ".join(map(str, rng.integers(0, VOCAB, PROMPT_LEN))) + "\n")

    syms = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    info = {
        "library": LIBRARY, "arch": arch, "preset": PRESET, "layers": LAYERS, "vocab": VOCAB,
        "heads": [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim],
        "sites": len(sites), "seconds": round(time.time() - t0, 1),
        "cuda_source_in_library": CUDA_SOURCE in path.read_bytes(),
        "defines_dispatcher": " mqa_byoc_fa2_forward" in syms,
        "fa2_kernels_linked": sorted(set(l.split()[-1] for l in syms.splitlines() if "mqa_byoc_fa2_fwd_" in l)),
    }
    info["options"] = build_option_variants(out, arch)
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), flush=True)
    return info


def main(argv=None) -> int:
    import argparse

    from builder_paths import ROOT

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".gpu-artifacts" / "cpp-runtime"))
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args(argv)
    build(Path(args.out), args.arch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
