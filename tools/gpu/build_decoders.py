"""Build the decoders whose attention masks are built in the graph from symbolic lengths, for
tests/gpu/test_gpu_decoder_masks.py.

    python tools/gpu/build_decoders.py [--out .gpu-artifacts/decoders]

For each case: the decoder (prefill + decode, symbolic batch and lengths) partitioned with
``mqa=True`` and the native provider, and the same graph unpartitioned, lowered by TVM's own CUDA
pipeline (an explicit matmul/softmax chain: no grouped R.nn.attention for TVM to get wrong); the
reference splits qkv and applies RoPE with Relax ops (``build_decoder(fused_rope=False)``), so that the
comparison also checks the offloaded build's ``split_rope`` kernel at a symbolic batch on the GPU. The
test runs both with the same random weights and compares prefill and decode logits and caches.
The windowed case uses a window (24) shorter than the test's prompt, so the window matters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builder_paths  # noqa: E402,F401 - sys.path for mqa_byoc
from bundle import decoder_builder_main, decoder_manifest, export_decoder_variants  # noqa: E402

CASES = {
    # name: (preset, kv_expand form, sliding window)
    "llama3-hf-broadcast": ("llama3-8b", "hf-broadcast", None),
    # not "repeat-chain": TVM 0.27's dlight gpu.Reduction rule fails (reverse_compute_at) on the
    # unpartitioned windowed chain, so it has no TVM reference on CUDA
    "mistral-w24-hf-broadcast": ("mistral-7b", "hf-broadcast", 24),
}


def build(out: Path, arch: str, names=None) -> None:
    import tvm

    import mqa_byoc
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    out.mkdir(parents=True, exist_ok=True)
    manifest_path, manifest = decoder_manifest(out, CASES)
    for name, (preset, form, window) in CASES.items():
        if names and name not in names:
            continue
        t0 = time.time()
        cfg = scaled(preset, num_layers=2, vocab_size=256, hidden_size=256, intermediate_size=512,
                     sliding_window=window if window is not None else False)
        mod, spec = build_decoder(cfg, kv_expand=form, logits="all", functions=("prefill", "decode"))
        ref_mod, _ = build_decoder(cfg, kv_expand=form, logits="all", functions=("prefill", "decode"), fused_rope=False)
        report = mqa_byoc.offload_report(mod)
        bad = [s for s in report if not s.offloaded or s.window != window]
        if bad:
            raise SystemExit(f"{name}: not offloaded as expected: {bad}")
        files, _ = export_decoder_variants(out, name, target, arch, cfg, spec, mod, ref_mod, mqa=True)
        manifest[name] = {"preset": preset, "form": form, "window": window,
                          "fused_projections": cfg.fused_projections, "files": files,
                          "sites": [{"function": s.function, "causal": s.causal, "window": s.window,
                                     "composite": s.composite} for s in report]}
        print(f"{name}: {len(report)} sites offloaded, built in {time.time() - t0:.0f}s", flush=True)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv=None) -> int:
    return decoder_builder_main(__doc__, "decoders", CASES, build, argv)


if __name__ == "__main__":
    os.environ.setdefault("TVM_NUM_THREADS", "2")
    sys.exit(main())
