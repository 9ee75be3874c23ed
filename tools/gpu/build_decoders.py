"""Build the decoders whose attention masks are built in the graph from symbolic lengths, for
tests/gpu/test_gpu_decoder_masks.py.

    python tools/gpu/build_decoders.py [--out .gpu-artifacts/decoders]

For each case: the decoder (prefill + decode, symbolic batch and lengths) partitioned with
``mqa=True`` and the native provider, and the same graph unpartitioned, lowered by TVM's own CUDA
pipeline (an explicit matmul/softmax chain: no grouped R.nn.attention for TVM to get wrong). The
test runs both with the same random weights and compares prefill and decode logits and caches.
The windowed case uses a window (24) shorter than the test's prompt, so the window matters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from builder_paths import ROOT  # noqa: E402 - sys.path for mqa_byoc

CASES = {
    # name: (preset, kv_expand form, sliding window)
    "llama3-hf-broadcast": ("llama3-8b", "hf-broadcast", None),
    # not "repeat-chain": TVM 0.27's dlight gpu.Reduction rule fails (reverse_compute_at) on the
    # unpartitioned windowed chain, so it has no TVM reference on CUDA
    "mistral-w24-hf-broadcast": ("mistral-7b", "hf-broadcast", 24),
}


def build(out: Path, arch: str, names=None) -> None:
    import tvm
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled
    from mqa_byoc.sidecar import write_sidecar

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest = {k: v for k, v in manifest.items() if k in CASES}
    for name, (preset, form, window) in CASES.items():
        if names and name not in names:
            continue
        t0 = time.time()
        cfg = scaled(preset, num_layers=2, vocab_size=256, hidden_size=256, intermediate_size=512,
                     sliding_window=window if window is not None else False)
        mod, spec = build_decoder(cfg, kv_expand=form, logits="all", functions=("prefill", "decode"))
        report = mqa_byoc.offload_report(mod)
        bad = [s for s in report if not s.offloaded or s.window != window]
        if bad:
            raise SystemExit(f"{name}: not offloaded as expected: {bad}")
        files = {}
        for variant in ("mqa", "reference"):
            path = out / f"{name}.{variant}.so"
            if variant == "mqa":
                ex = mqa_byoc.build(mod, target, mqa=True, provider="native", pipeline=cuda_decoder_pipeline(target))
                mqa_byoc.export_library(ex, str(path), arch=arch)
            else:
                with target:
                    ex = relax.build(mod, target=target, relax_pipeline=cuda_decoder_pipeline(target))
                ex.export_library(str(path))
            write_sidecar(str(path), cfg, spec, "float16", {"case": name, "variant": variant})
            files[variant] = path.name
        manifest[name] = {"preset": preset, "form": form, "window": window, "files": files,
                          "sites": [{"function": s.function, "causal": s.causal, "window": s.window,
                                     "composite": s.composite} for s in report]}
        print(f"{name}: {len(report)} sites offloaded, built in {time.time() - t0:.0f}s", flush=True)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".gpu-artifacts" / "decoders"))
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--cases", nargs="*", help=f"build only these (of {', '.join(CASES)})")
    args = p.parse_args(argv)
    build(Path(args.out), args.arch, args.cases)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TVM_NUM_THREADS", "2")
    sys.exit(main())
