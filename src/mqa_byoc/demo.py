"""``mqa-byoc demo``: partition a real GQA decoder, show what was offloaded, build it for CUDA.

The decoder has real attention shapes (default: CodeLlama-34B, 64 query heads, 8 K/V heads, head
dim 128) and a few layers with random weights; K/V are expanded with ``R.repeat`` before attention
as real compiled graphs do, and live in TVM's in-place KV cache between steps (``--kv-cache
functional``: K/V tensors in and out, concatenated every step).

What runs depends on the machine, and the demo says what it skipped and the command that does it:

- with a CUDA GPU: build with the native provider (compiling missing FA2 kernels), export, run
  prefill + decode and print the GPU kernels;
- without one: build and export with the native provider only when its FA2 kernels are already
  built (``mqa-byoc build-kernels``) or ``--build-kernels`` / ``--provider native`` asks for it
  (minutes per kernel file); otherwise with the python provider, which needs no kernels here.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager

from .contract import COMPOSITE_MQA


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
        if getattr(s, "softcap", None):
            mask += f" softcap={s.softcap:g}"
        if getattr(s, "chunk", None):
            mask += f" chunk={s.chunk}"
        what = s.composite if s.offloaded else f"REJECTED: {s.reason}"
        if s.note:
            what += f" ({s.note})"
        if s.kernel:
            what += f" -> {s.kernel}"
        rows.append((s.function, s.output, s.form, "yes" if s.offloaded else "no",
                     f"{s.num_q_heads}/{s.num_kv_heads}", str(s.head_dim), str(s.dtype), mask, what))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    offloaded = [s for s in sites if s.offloaded]
    removed = sum(s.expansion_ops_removed for s in sites)
    lines.append("")
    lines.append(f"attention sites found: {len(sites)}; offloaded: {len(offloaded)} "
                 f"({sum(s.composite == COMPOSITE_MQA for s in offloaded)} with native K/V heads); "
                 f"rejected: {len(sites) - len(offloaded)}; K/V expansion ops removed: {removed}")
    return "\n".join(lines)


def _gpu_present() -> bool:
    import tvm

    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no CUDA runtime at all
        return False


def choose_provider(requested: str, *, gpu: bool, build_kernels: bool, missing_kernels) -> tuple:
    """``(provider, compile missing kernels?, what was not done or None)`` for the demo.

    ``requested``: "python" / "native" / "hopper" (asked for), or what the provider rule gives when the
    user did not ask ("auto-native": nvcc found; "auto-hopper": also an sm_90 target with FA4 objects at
    hand; "auto-python": no nvcc). Both linked providers need FA2 kernels.
    ``missing_kernels``: a callable giving the FA2 kernels the native library needs that are not
    built (called only when it decides: it runs the native codegen).
    """
    if requested in ("python", "auto-python"):
        return "python", False, None if requested == "python" else (
            "native provider: not selected here (no nvcc); built with the python provider")
    linked = requested.removeprefix("auto-")
    if requested in ("native", "hopper") or build_kernels or gpu:
        return linked, True, None
    missing = missing_kernels()
    if not missing:
        return linked, False, None
    return "python", False, (
        f"{linked} provider: {len(missing)} FA2 kernel file(s) not built ({', '.join(k.label for k in missing)}; "
        "minutes each on a small machine, and no GPU here to run them), so the library uses the python "
        "provider. For the native library: `mqa-byoc demo --build-kernels` (or `mqa-byoc build-kernels` first, "
        "see the README)")


def run_demo(args) -> int:
    import tvm

    from . import build, export_library, offload_report, partition_for_cutlass
    from .compiler.build import native_kernel_keys
    from .compiler.export import NativeKernelsUnavailable
    from .compiler.graph.gemm import format_gemm_report, gemm_report
    from .compiler.pipeline import cuda_decoder_pipeline
    from .compiler.provider import build_provider
    from .models.llama import build_decoder
    from .models.presets import get_preset, scaled

    preset = get_preset(args.preset)
    config = scaled(preset, num_layers=args.layers, vocab_size=args.vocab)
    print(f"mqa-byoc demo: {preset.name} attention ({config.num_heads} query heads, "
          f"{config.num_kv_heads} K/V heads, head dim {config.head_dim}), {config.num_layers} layers, "
          f"hidden {config.hidden_size}, vocab {config.vocab_size}, {args.dtype}, K/V expanded by "
          f"'{args.kv_expand}', {args.kv_cache} KV cache")
    with step("building the Relax decoder (prefill + decode with a KV cache)"):
        mod, param_spec = build_decoder(config, dtype=args.dtype, kv_expand=args.kv_expand, batch=1, logits="all",
                                        kv_cache=args.kv_cache)
    with step("partition_for_cutlass(mod, mqa=True)"):
        report = offload_report(mod, mqa=True, target={"kind": "cuda", "arch": args.arch}, provider=args.provider)
        gemms = gemm_report(partition_for_cutlass(mod, mqa=True, gemm=False))
        part = partition_for_cutlass(mod, mqa=True)
    print()
    print(format_report(report))
    print(f"\nGEMM sites: {len(gemms)}; on cuBLASLt: {sum(s.offloaded for s in gemms)}")
    print(format_gemm_report(gemms))
    print()
    if args.no_build:
        return 0

    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    gpu = _gpu_present()
    not_done = []
    requested = args.provider if args.provider != "auto" else f"auto-{build_provider(None, target)}"

    def missing_kernels():
        from .compiler.link import installed_kernel_config
        from .kernels import find_kernels, normalize_arch

        keys = native_kernel_keys(part)
        arch = normalize_arch(args.arch)
        found = find_kernels(keys, arch, installed_kernel_config(arch))
        return [k for k in keys if k not in found]

    provider, compile_kernels, why = choose_provider(requested, gpu=gpu, build_kernels=args.build_kernels,
                                                     missing_kernels=missing_kernels)
    if why:
        not_done.append(why)
    print(f"kernel provider: {provider}")
    with step(f"mqa_byoc.build (RunCodegen + relax.build for {args.arch})"):
        ex = build(part, target, mqa=None, provider=provider, pipeline=cuda_decoder_pipeline(target))
    out_dir = args.out or tempfile.mkdtemp(prefix="mqa-byoc-demo-")
    os.makedirs(out_dir, exist_ok=True)
    lib_path = os.path.join(out_dir, f"{preset.name}-mqa.so")
    with step(f"mqa_byoc.export_library -> {lib_path}"):
        try:
            export_library(ex, lib_path, arch=args.arch, build=compile_kernels)
        except NativeKernelsUnavailable as err:  # kernels cached, the dispatcher not: rebuild for python
            if compile_kernels:
                raise
            not_done.append(f"native provider: {err}; built with the python provider")
            ex = build(part, target, mqa=None, provider="python", pipeline=cuda_decoder_pipeline(target))
            export_library(ex, lib_path)
    if not gpu:
        not_done.append("run: no CUDA GPU here. On a GPU machine the same command also runs prefill + decode "
                        "and prints the GPU kernels")
    if not_done:
        print("\nNot done here:")
        for line in not_done:
            print(f"- {line}")
    if not gpu:
        return 0
    from .runtime.runner import run_and_profile

    run_and_profile(lib_path, config, param_spec, args)
    return 0
