"""The ``mqa-byoc`` command."""

from __future__ import annotations

import argparse
import sys


def _demo_parser(sub):
    p = sub.add_parser("demo", help="partition a real GQA decoder, print the offload report, build it "
                                    "for CUDA (and run it when a GPU is present)")
    p.add_argument("--preset", default="codellama-34b",
                   help="attention shapes: llama2-70b, codellama-34b, llama3-8b, mistral-7b, falcon-7b-mqa")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (smaller than the model's "
                                                           "to keep random weights small)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--kv-expand", default="repeat",
                   choices=["repeat", "repeat-chain", "hf-broadcast", "native"],
                   help="how the graph expands K/V before attention")
    p.add_argument("--arch", default="sm_90", help="CUDA arch to build for")
    p.add_argument("--provider", default="auto", choices=["auto", "native", "python"],
                   help="FA2 kernel provider (auto: native when nvcc is found, else python)")
    p.add_argument("--out", default=None, help="directory for the exported library")
    p.add_argument("--no-build", action="store_true", help="stop after the offload report")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mqa-byoc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    kb = sub.add_parser("build-kernels", add_help=False,
                        help="compile FA2 forward kernels for the native provider (needs nvcc)")
    kb.add_argument("rest", nargs=argparse.REMAINDER)
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from .demo import run_demo

        return run_demo(args)
    if args.command == "build-kernels":
        from .runtime.kernels import main as build_main

        return build_main(list(args.rest) + extra)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
