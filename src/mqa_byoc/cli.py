"""The ``mqa-byoc`` command."""

from __future__ import annotations

import argparse
import sys

from .contract import PROVIDERS
from .models.presets import PRESETS  # TVM-free


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _limits(text: str):
    """argparse type: ``TBPS,TFLOPS``, a GPU's HBM bandwidth and dense fp16 tensor rate."""
    from .runtime.gpu_limits import given

    try:
        tbps, tflops = (float(x) for x in text.split(","))
        return given(tbps, tflops)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected TBPS,TFLOPS (e.g. 3.35,989), got {text!r}: {e}") from None


_KV_INPLACE = ("inplace (TVM's in-place cache objects: append the new K/V, attend over a zero-copy view; "
               "batch 1)")
_KV_FUNCTIONAL = "functional (K/V tensors in and out, concatenated every step)"
KV_CACHE_HELP = f"where K/V live between steps: {_KV_INPLACE} or {_KV_FUNCTIONAL}"
PROFILE_KV_CACHE_HELP = (f"where K/V live between steps: {_KV_INPLACE}, {_KV_FUNCTIONAL}, or paged (TVM's "
                         "PagedKVCache: relax.frontend.nn's TIRPagedKVCache decoder; mqa=True runs its attention on "
                         "our FA2 kernels, page size FA2's tile (128 for head dim 128), mqa=False on TVM's TIR "
                         "kernels, page size 16; no sliding window); default inplace")


def _demo_parser(sub):
    p = sub.add_parser("demo", help="partition a real GQA decoder, print the offload report, build it "
                                    "for CUDA (and run it when a GPU is present)")
    p.add_argument("--preset", default="codellama-34b",
                   choices=list(PRESETS), help="attention shapes (the model's heads, head dim, sizes)")
    p.add_argument("--layers", type=_positive_int, default=2)
    p.add_argument("--vocab", type=_positive_int, default=4096, help="vocabulary size (smaller than the model's "
                                                           "to keep random weights small)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--kv-expand", default="repeat",
                   choices=["repeat", "repeat-chain", "hf-broadcast", "native"],
                   help="how the graph expands K/V before attention")
    p.add_argument("--kv-cache", default="inplace", choices=["inplace", "functional"], help=KV_CACHE_HELP)
    p.add_argument("--arch", default="sm_90", help="CUDA arch to build for")
    p.add_argument("--provider", default="auto", choices=["auto", *PROVIDERS],
                   help="kernel provider (auto: native on a GPU machine with nvcc, or where its kernels are "
                        "already built; else python; hopper: FA4's sm90 kernel for prefill, native's for "
                        "decode)")
    p.add_argument("--build-kernels", action="store_true",
                   help="compile the FA2 kernels the native library needs if missing (minutes per file)")
    p.add_argument("--out", default=None, help="directory for the exported library")
    p.add_argument("--no-build", action="store_true", help="stop after the offload report")
    p.add_argument("--decode-steps", type=_positive_int, default=8)
    p.add_argument("--prompt-len", type=_positive_int, default=512)


def _profile_parser(sub):
    p = sub.add_parser("profile", help="kernel summary (nsys cuda_gpu_kern_sum layout) of a decoder, mqa=True vs "
                                       "mqa=False: build here, run on the GPU",
                       description="Build a Llama-family decoder twice (mqa=True, mqa=False), then run prefill + N "
                                   "decode steps of both on a GPU and summarize their kernels (CUPTI via "
                                   "torch.profiler), with NVTX ranges for nsys.")
    ps = p.add_subparsers(dest="profile_command", required=True)
    b = ps.add_parser("build", help="compile and export both libraries with sidecars (needs apache-tvm; no GPU)")
    b.add_argument("--preset", default="codellama-34b",
                   choices=list(PRESETS), help="attention shapes (the model's heads, head dim, sizes)")
    b.add_argument("--layers", type=_positive_int, default=4)
    b.add_argument("--vocab", type=_positive_int, default=32000)
    b.add_argument("--hidden-size", type=_positive_int, default=None, help="default: the preset's")
    b.add_argument("--intermediate-size", type=_positive_int, default=None, help="default: the preset's")
    b.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    b.add_argument("--kv-expand", default=None, choices=["repeat", "repeat-chain", "hf-broadcast", "native"],
                   help="how the graph expands K/V before attention (default repeat; not with --kv-cache paged, "
                        "whose attention takes the cache's K/V heads)")
    b.add_argument("--kv-cache", default="inplace", choices=["inplace", "functional", "paged"],
                   help=PROFILE_KV_CACHE_HELP)
    b.add_argument("--projections", default="fused", choices=["fused", "separate"],
                   help="fused: one qkv_proj and one gate_up_proj matmul per layer, split (mlc-llm's Llama); "
                        "separate: q/k/v and gate/up projections (Hugging Face's); not with --kv-cache paged")
    b.add_argument("--provider", default="native", choices=list(PROVIDERS),
                   help="kernel provider (hopper: FA4's sm90 kernel for prefill, native's for decode; sm_90 "
                        "only; --kv-cache paged: native, or hopper for its ragged prefill on FA4)")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--logits", default=None, choices=["last", "all"],
                   help="prefill returns the last position's logits (serving; the default) or all of them "
                        "(--kv-cache paged: the runner calls batch_prefill or prefill)")
    b.add_argument("--out", default=".profile-artifacts", help="directory for the libraries and sidecars")
    b.add_argument("--no-gemm", action="store_true",
                   help="leave the GEMMs on TVM's kernels (default: on cuBLASLt, partition_for_cutlass(gemm=True))")
    b.add_argument("--kernel-options", default=None, metavar="NAME=VALUE,...", type=_kernel_options,
                   help="kernel choices compiled into the libraries (mqa_byoc.build's kernel_options, e.g. "
                        "gemm_gemv=off; default: the measured best)")
    b.add_argument("--cuda-graph", action="store_true",
                   help="build with TVM's relax.backend.use_cuda_graph: the regions of a step with static shapes are "
                        "captured once and replayed as CUDA graphs (--kv-cache paged: decode captured per batch "
                        "size, at most 128 sequences a step)")
    r = ps.add_parser("run", help="run the libraries of DIR on the GPU (runtime-only TVM is enough)")
    r.add_argument("dir", help="directory written by `mqa-byoc profile build`")
    r.add_argument("--prompt-len", type=_positive_int, default=2048,
                   help="context of the decode steps (e.g. 16384 for long-context decode tokens/s)")
    r.add_argument("--decode-steps", type=_positive_int, default=32)
    r.add_argument("--warmup", type=int, default=2, help="decode steps of the warm-up run (after its prefill)")
    r.add_argument("--json", default=None, help="output JSON (default: DIR/profile.json)")
    r.add_argument("--png", default=None, help="also draw the comparison chart (needs matplotlib)")
    r.add_argument("--top", type=_positive_int, default=15, help="kernels per panel in the PNG")
    r.add_argument("--no-nvtx", action="store_true",
                   help="no NVTX ranges (default: steps, and flash_attn calls via MQA_BYOC_NVTX=1)")
    r.add_argument("--no-cupti", action="store_true",
                   help="time the steps only, no torch.profiler run (use under nsys, which needs CUPTI itself)")
    r.add_argument("--kv-cache", default=None, choices=["inplace", "functional", "paged"],
                   help="run the libraries of this cache only (default: DIR's, which must hold one cache's)")
    r.add_argument("--limits", type=_limits, default=None, metavar="TBPS,TFLOPS",
                   help="HBM TB/s and dense fp16 TFLOP/s the GEMM tables measure against (default: this GPU's, "
                        "from its data sheet or the CUDA driver)")
    r.add_argument("--setup", action="append", default=None, metavar="MODULE",
                   help="import MODULE first, e.g. the set-up of a runtime-only TVM kit (default: "
                        "$MQA_BYOC_RUNTIME_SETUP, comma-separated)")
    g = ps.add_parser("gemms", help="the GEMMs of a `profile run` JSON kernel by kernel: TB/s, TFLOP/s and the "
                                    "fraction of the GPU's limits (no GPU, no TVM)")
    g.add_argument("json")
    g.add_argument("--limits", type=_limits, default=None, metavar="TBPS,TFLOPS",
                   help="HBM TB/s and dense fp16 TFLOP/s to measure against (default: those the JSON records, "
                        "else its GPU's)")
    pl = ps.add_parser("plot", help="draw the PNG from a `profile run` JSON (needs matplotlib only)")
    pl.add_argument("json")
    pl.add_argument("--png", required=True)
    pl.add_argument("--top", type=_positive_int, default=15)


def _kernel_options(value: str) -> str:
    from .compiler.kernel_options import KernelOptions

    try:
        return KernelOptions.of(value).describe()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _comma_list(convert):
    def parse(value: str) -> tuple:
        items = [x.strip() for x in value.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma separated list, got {value!r}")
        try:
            return tuple(convert(x) for x in items)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _both_yes_no(what: str):
    def parse(value: str) -> tuple[bool, ...]:
        v = value.lower()
        if v in ("both", "all"):
            return (False, True)
        if v in ("yes", "true", "on", "1", what):
            return (True,)
        if v in ("no", "false", "off", "0", "non" + what, "no-" + what):
            return (False,)
        raise argparse.ArgumentTypeError(f"expected both|yes|no, got {value!r}")

    return parse


def _build_kernels_parser(sub):
    p = sub.add_parser("build-kernels", help="compile FA2 forward kernels for the native provider (needs nvcc)",
                       description="Compile Flash Attention 2 forward kernels (from flash-attn's sources) for the "
                                   "native provider, into the cache (and --out DIR for MQA_BYOC_KERNEL_DIR).")
    p.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90 (default: $MQA_BYOC_ARCH, the GPU, or sm_90)")
    p.add_argument("--head-dims", type=_comma_list(int), default=(64, 128),
                   help="comma separated head dims; rounded up to 32,64,96,128,192,256 (default 64,128)")
    p.add_argument("--dtypes", type=_comma_list(str), default=("fp16", "bf16"),
                   help="comma separated: fp16,bf16 (default both)")
    p.add_argument("--causal", type=_both_yes_no("causal"), default=(False, True), help="both|yes|no")
    p.add_argument("--split", type=_both_yes_no("split"), default=(False, True), help="split-KV kernels: both|yes|no")
    p.add_argument("--softcap", action="store_true",
                   help="the families with logit soft-capping (Gemma 2) instead of the plain ones: compiled "
                        "without FLASHATTENTION_DISABLE_SOFTCAP, needed only by models that soft-cap")
    p.add_argument("--jobs", "-j", type=int, default=None, help="parallel nvcc processes")
    p.add_argument("--nice", type=int, nargs="?", const=10, default=0,
                   help="run nvcc under `nice -n N` (N defaults to 10 when omitted)")
    p.add_argument("--flash-attn-src", default=None,
                   help="extracted flash-attn tree or sdist (else $MQA_BYOC_FLASH_ATTN_SRC, else fetched with pip)")
    p.add_argument("--out", default=None, help="also copy dispatcher + objects to DIR (use with MQA_BYOC_KERNEL_DIR=DIR)")
    p.add_argument("--link-check", action="store_true",
                   help="link fa2_link_check (a Python-free test program; `fa2_link_check --run` needs a GPU) "
                        "against the objects; into --out DIR when given")
    p.add_argument("--print-dir", action="store_true", help="print the cache directory and exit")
    p.add_argument("--hopper", nargs="*", default=None, metavar="LABEL",
                   help="compile FA4 sm90 objects for the hopper provider instead (flash-attn-4 + nvidia-cutlass-dsl, "
                        "no GPU needed, seconds each): labels like 'fp16 h128 g8 causal' (dtype, head dim, query "
                        "heads per K/V head, none|causal|local); none given: what the model presets need")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (kernels, cache dir, nvcc commands) without compiling or fetching")


def _runtime_kit_parser(sub):
    p = sub.add_parser("runtime-kit", help="write a runtime-only TVM kit: run exported libraries on a machine "
                                           "without TVM's compiler (cross-compiling)",
                       description="Copy the installed tvm package without its compiler library, download the "
                                   "wheels it needs for the run machine's Python, and write setup.sh and the "
                                   "set-up module tvm_runtime_kit (CUDA backend + nvcc hook) into DIR.")
    p.add_argument("--out", required=True, help="the kit's folder (replaced if it exists)")
    p.add_argument("--python-version", default="3.12", help="the run machine's Python, X.Y (default 3.12)")
    p.add_argument("--platform", action="append", default=None,
                   help="pip platform tag of the run machine (repeatable; default: manylinux x86-64 tags)")
    p.add_argument("--no-wheels", action="store_true",
                   help="download no wheels: the run machine has apache-tvm-ffi and ml_dtypes installed")


def build_kernels_request(args: argparse.Namespace):
    """The :class:`mqa_byoc.kernels.BuildRequest` of parsed ``build-kernels`` arguments.

    Returns
    -------
    mqa_byoc.kernels.BuildRequest
    """
    from .kernels import BuildRequest  # TVM-free

    return BuildRequest(arch=args.arch, head_dims=args.head_dims, dtypes=args.dtypes, causal=args.causal,
                        split=args.split, softcap=(True,) if args.softcap else (False,), jobs=args.jobs, nice=args.nice, flash_attn_src=args.flash_attn_src,
                        out=args.out, link_check=args.link_check, print_dir=args.print_dir, dry_run=args.dry_run)


def build_parser() -> argparse.ArgumentParser:
    """The ``mqa-byoc`` parser: one subparser per command.

    Returns
    -------
    argparse.ArgumentParser
    """
    parser = argparse.ArgumentParser(prog="mqa-byoc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _build_kernels_parser(sub)
    _profile_parser(sub)
    _runtime_kit_parser(sub)
    return parser


def _paged_build_conflicts(args) -> list[str]:
    """The ``profile build`` options that do not apply to ``--kv-cache paged``, as given."""
    bad = [f"--provider {args.provider}"] if args.provider not in ("native", "hopper") else []
    bad += [f"--kv-expand {args.kv_expand}"] if args.kv_expand is not None else []
    bad += [f"--projections {args.projections}"] if args.projections != "fused" else []
    return bad


def _describe_build(args, config, what: str) -> str:
    return (f"mqa-byoc profile build: {config.name}, {config.num_layers} layers, H={config.num_heads} "
            f"H_kv={config.num_kv_heads} D={config.head_dim}, hidden {config.hidden_size}, MLP "
            f"{config.intermediate_size}, vocab {config.vocab_size}, {args.dtype}, {what}")


def _profile_build_paged(args, config) -> int:
    from .models.decoder_libs import build_paged_decoder_libraries

    bad = _paged_build_conflicts(args)
    if bad:
        print(f"mqa-byoc profile build: error: {', '.join(bad)} does not apply to --kv-cache paged (its "
              "entries are native code: --provider native or hopper; its attention takes the cache's K/V heads, "
              "its projections are fused)", file=sys.stderr)
        return 2
    on = "FA2" + (" (ragged prefill on FA4, hopper provider)" if args.provider == "hopper" else "")
    print(_describe_build(args, config, f"paged KV cache (TVM's PagedKVCache): attention on {on} (mqa=True) and "
                                        "on TVM's TIR kernels (mqa=False)"), flush=True)
    try:
        build_paged_decoder_libraries(config, args.out, dtype=args.dtype, arch=args.arch,
                                      extra={"preset": args.preset, "gemm": not args.no_gemm},
                                      progress=lambda m: print(m, flush=True), gemm=not args.no_gemm,
                                      cuda_graph=args.cuda_graph, logits=args.logits or "last",
                                      provider=args.provider, kernel_options=args.kernel_options)
    except ValueError as e:  # a sliding-window preset
        print(f"mqa-byoc profile build: error: {e}", file=sys.stderr)
        return 2
    return 0


def _profile_build(args) -> int:
    from .models.presets import get_preset, scaled


    config = scaled(get_preset(args.preset), num_layers=args.layers, vocab_size=args.vocab,
                    hidden_size=args.hidden_size, intermediate_size=args.intermediate_size)
    if args.kv_cache == "paged":
        rc = _profile_build_paged(args, config)
    else:
        from .models.decoder_libs import build_decoder_libraries

        config = config.replace(fused_projections=args.projections == "fused")
        print(_describe_build(args, config, f"{args.provider} provider, {args.kv_cache} KV cache, "
                                            f"{args.projections} projections"), flush=True)
        import tvm

        # TVM's RewriteCUDAGraph: the static regions of a step (those that do not depend on the cache's length)
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True} if args.cuda_graph else {}):
            build_decoder_libraries(config, args.out, functions=("prefill", "decode"), dtype=args.dtype,
                                    kv_expand=args.kv_expand or "repeat", kv_cache=args.kv_cache,
                                    provider=args.provider, arch=args.arch, logits=args.logits or "last",
                                    extra={"preset": args.preset, "gemm": not args.no_gemm,
                                           **({"cuda_graph": True} if args.cuda_graph else {})},
                                    progress=lambda m: print(m, flush=True), gemm=not args.no_gemm,
                                    kernel_options=args.kernel_options)
        rc = 0
    if rc == 0:
        print(f"next, on the GPU (a runtime-only TVM is enough; --setup MODULE imports its set-up first):\n"
              f"  python3 -m mqa_byoc.cli profile run {args.out} --prompt-len 2048 --decode-steps 32")
    return rc


def _profile(args, argv) -> int:
    if args.profile_command == "build":
        return _profile_build(args)
    if args.profile_command == "run":
        from .runtime.profiling import ProfileError, run_profile

        try:
            run_profile(args.dir, args.prompt_len, args.decode_steps, warmup=args.warmup, nvtx=not args.no_nvtx,
                        cupti=not args.no_cupti, json_path=args.json, png_path=args.png, top=args.top,
                        command="mqa-byoc " + " ".join(argv), setup=args.setup, kv_cache=args.kv_cache,
                        limits=args.limits)
        except (ProfileError, FileNotFoundError) as e:
            print(f"mqa-byoc profile run: error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.profile_command == "gemms":
        import json

        from .runtime.profiling import gemm_report

        with open(args.json) as f:
            print(gemm_report(json.load(f), limits=args.limits), end="")
        return 0
    if args.profile_command == "plot":
        from .runtime.kernel_plot import MatplotlibMissing, plot_file

        try:
            print(f"wrote {plot_file(args.json, args.png, top=args.top)}")
        except MatplotlibMissing as e:
            print(f"mqa-byoc profile plot: error: {e}; pip install matplotlib", file=sys.stderr)
            return 1
        return 0
    return 2


def main(argv=None) -> int:
    """Run ``mqa-byoc`` with ``argv`` (default ``sys.argv[1:]``).

    Modules needing TVM are imported only by the commands that use them: ``build-kernels`` and
    ``profile run`` / ``plot`` work without the TVM compiler.

    Returns
    -------
    int
        The exit status.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command == "profile":
        return _profile(args, argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "runtime-kit":
        from .deploy.runtime_kit import main_args

        return main_args(args)
    if args.command == "build-kernels" and args.hopper is not None:
        from .kernels import hopper
        from .models.presets import attention_shapes

        return hopper.run_build(args.hopper, shapes=attention_shapes(), arch=args.arch, out=args.out,
                                dry_run=args.dry_run)
    if args.command == "build-kernels":
        from .kernels import run_build_kernels

        return run_build_kernels(build_kernels_request(args))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
