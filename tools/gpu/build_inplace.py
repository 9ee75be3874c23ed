"""Build the in-place KV cache decoders for tests/gpu/test_gpu_inplace_decoder.py.

    MQA_BYOC_KERNEL_DIR=.gpu-artifacts/fa2 python tools/gpu/build_inplace.py [--out .gpu-artifacts/inplace]

For each case: the decoder with ``kv_cache="inplace"`` (batch 1, prefill + decode, the form the
presets, ``mqa-byoc demo`` and ``mqa-byoc profile`` build) partitioned with ``mqa=True`` and the
native provider, and the same decoder unpartitioned, lowered by TVM's own CUDA pipeline; the
reference splits qkv and applies RoPE with Relax ops (``build_decoder(fused_rope=False)``), so that
the comparison also checks the one-kernel ``split_rope`` of the offloaded build on the GPU. The test
runs both with the same random weights and compares prefill and decode logits and the caches. The
decoders have mlc-llm's fused ``qkv_proj`` / ``gate_up_proj`` (the default); one case keeps Hugging
Face's separate projections (``DecoderConfig.fused_projections=False``).

The build also proves, on the lowered decode of the mqa=True library, that nothing but the
offloaded attention reads the cache (its views go through zero-copy reshapes into FA2 only:
:func:`mqa_byoc.models.kv_caches.cache_readers`), and records the PrimFuncs the decode calls, so
that the test can check under CUPTI that every kernel it launches is one of them or FA2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builder_paths  # noqa: E402,F401 - sys.path for mqa_byoc
from bundle import decoder_builder_main, decoder_manifest, export_decoder_variants, vm_calls  # noqa: E402

CASES = {
    # name: (preset, kv_expand form, fused projections: qkv_proj / gate_up_proj split, or HF's separate ones)
    "llama3-inplace-repeat": ("llama3-8b", "repeat", True),  # R.nn.attention on repeated views, as profile builds
    "llama3-inplace-hf-broadcast": ("llama3-8b", "hf-broadcast", True),  # an explicit chain: TVM's reference lowering
    "llama3-inplace-repeat-separate": ("llama3-8b", "repeat", False),  # HF's q/k/v and gate/up projections
}


def _lowered_cache_readers(part, target, fname: str) -> dict:
    """:func:`cache_readers` of ``fname`` after the decoders' CUDA pipeline (no kernel compiled)."""
    from mqa_byoc.compiler.build import run_codegen
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.models.kv_caches import cache_readers

    symbols = {str(f.attrs["global_symbol"]) for f in part.functions.values()
               if f.attrs is not None and "Codegen" in f.attrs}
    low = run_codegen(part, target, provider="native")
    with target:
        low = cuda_decoder_pipeline(target)(low)
    return cache_readers(low[fname], symbols)


def build(out: Path, arch: str, names=None) -> None:
    import tvm

    import mqa_byoc
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.models.presets import scaled

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    out.mkdir(parents=True, exist_ok=True)
    manifest_path, manifest = decoder_manifest(out, CASES)
    for name, (preset, form, fused) in CASES.items():
        if names and name not in names:
            continue
        t0 = time.time()
        cfg = scaled(preset, num_layers=2, vocab_size=256, hidden_size=256, intermediate_size=512
                     ).replace(fused_projections=fused)
        mod, spec = build_decoder(cfg, kv_expand=form, logits="all", functions=("prefill", "decode"),
                                  batch=1, kv_cache="inplace")
        # the reference: RoPE as Relax ops (the same weights; mod's split_rope kernel is checked against it)
        ref_mod, _ = build_decoder(cfg, kv_expand=form, logits="all", functions=("prefill", "decode"),
                                   batch=1, kv_cache="inplace", fused_rope=False)
        report = mqa_byoc.offload_report(mod)
        bad = [s for s in report if not s.offloaded or s.composite != "flash_attn.attention_mqa"]
        if bad or len(report) != 2 * cfg.num_layers:
            raise SystemExit(f"{name}: not offloaded as expected: {bad or report}")
        part = mqa_byoc.partition_for_cutlass(mod, mqa=True)
        n = 2 * cfg.num_layers
        readers = _lowered_cache_readers(part, target, "decode")
        if readers != {"reshape": n, "attention": n}:
            raise SystemExit(f"{name}: the mqa=True decode reads the cache outside attention: {readers}")
        files, executables = export_decoder_variants(
            out, name, target, arch, cfg, spec, part, ref_mod, mqa=None,
            meta={"kv_cache": "inplace", "functions": ["prefill", "decode"]})
        decode_calls = {variant: vm_calls(ex)["decode"] for variant, ex in executables.items()}
        manifest[name] = {"preset": preset, "form": form, "fused_projections": fused, "files": files,
                          "num_layers": cfg.num_layers,
                          "mqa_decode_cache_readers": readers, "decode_calls": decode_calls,
                          "sites": [{"function": s.function, "causal": s.causal, "num_kv_heads": s.num_kv_heads,
                                     "composite": s.composite} for s in report]}
        print(f"{name}: {len(report)} sites offloaded; mqa=True decode cache readers {readers}; built in "
              f"{time.time() - t0:.0f}s", flush=True)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv=None) -> int:
    return decoder_builder_main(__doc__, "inplace", CASES, build, argv)


if __name__ == "__main__":
    os.environ.setdefault("TVM_NUM_THREADS", "2")
    sys.exit(main())
