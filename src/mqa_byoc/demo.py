"""``mqa-byoc demo``: partition a real GQA decoder, show what was offloaded, build it for CUDA.

The decoder has real attention shapes (default: CodeLlama-34B, 64 query heads, 8 K/V heads, head
dim 128) and a few layers with random weights; K/V are expanded with ``R.repeat`` before attention
as real compiled graphs do. Building needs no GPU; running needs a CUDA GPU and a kernel provider.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager


@contextmanager
def step(label: str):
    """Print a progress line for a step and how long it took."""
    print(f"... {label}", flush=True)
    t0 = time.perf_counter()
    yield
    print(f"    done in {time.perf_counter() - t0:.1f} s", flush=True)


def format_report(sites) -> str:
    """The offload report as a table plus totals."""
    rows = [("function", "output", "form", "offloaded", "q/kv heads", "D", "dtype", "mask", "composite / reason")]
    for s in sites:
        mask = s.causal or "none"
        if s.window:
            mask += f" w={s.window}"
        what = s.composite if s.offloaded else f"REJECTED: {s.reason}"
        if s.note:
            what += f" ({s.note})"
        rows.append((s.function, s.output, s.form, "yes" if s.offloaded else "no",
                     f"{s.num_q_heads}/{s.num_kv_heads}", str(s.head_dim), str(s.dtype), mask, what))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    offloaded = [s for s in sites if s.offloaded]
    removed = sum(s.expansion_ops_removed for s in sites)
    lines.append("")
    lines.append(f"attention sites found: {len(sites)}; offloaded: {len(offloaded)} "
                 f"({sum(s.composite == 'flash_attn.attention_mqa' for s in offloaded)} with native K/V heads); "
                 f"rejected: {len(sites) - len(offloaded)}; K/V expansion ops removed: {removed}")
    return "\n".join(lines)


def _gpu_present() -> bool:
    import tvm

    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no CUDA runtime at all
        return False


def run_demo(args) -> int:
    import tvm
    from tvm import relax

    from . import offload_report, partition_for_cutlass
    from .compiler import codegen
    from .compiler.pipeline import cuda_decoder_pipeline
    from .models.llama import build_decoder
    from .models.presets import get_preset, scaled

    preset = get_preset(args.preset)
    config = scaled(preset, num_layers=args.layers, vocab_size=args.vocab)
    print(f"mqa-byoc demo: {preset.name} attention ({config.num_heads} query heads, "
          f"{config.num_kv_heads} K/V heads, head dim {config.head_dim}), {config.num_layers} layers, "
          f"hidden {config.hidden_size}, vocab {config.vocab_size}, {args.dtype}, K/V expanded by "
          f"'{args.kv_expand}'")
    with step("building the Relax decoder (prefill + decode with a KV cache)"):
        mod, param_spec = build_decoder(config, dtype=args.dtype, kv_expand=args.kv_expand, batch=1, logits="all")
    with step("partition_for_cutlass(mod, mqa=True)"):
        report = offload_report(mod, mqa=True)
        part = partition_for_cutlass(mod, mqa=True, provider=None if args.provider == "auto" else args.provider)
    print()
    print(format_report(report))
    print()
    if args.no_build:
        return 0

    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    provider = args.provider if args.provider != "auto" else codegen.default_provider(target)
    print(f"kernel provider: {provider}")
    with step(f"RunCodegen + relax.build for {args.arch}"):
        with target, codegen.use_provider(provider):
            part = relax.transform.RunCodegen()(part)
            ex = relax.build(part, target=target, relax_pipeline=cuda_decoder_pipeline(target))
    out_dir = args.out or tempfile.mkdtemp(prefix="mqa-byoc-demo-")
    os.makedirs(out_dir, exist_ok=True)
    lib_path = os.path.join(out_dir, f"{preset.name}-mqa.so")
    with step(f"export_library -> {lib_path}"):
        if provider == "native":
            from .compiler.export import export_library

            export_library(ex, lib_path, arch=args.arch)
        else:
            ex.export_library(lib_path)
    if not _gpu_present():
        print("\nNo CUDA GPU here: the library is built and exported, not run. "
              "On a GPU machine the same command also runs prefill + decode and prints the kernels.")
        return 0
    from .runtime.runner import run_and_profile

    run_and_profile(lib_path, config, param_spec, args)
    return 0
