"""``python benchmarks/attention.py build | run | report | check-llm``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import BENCHMARKS

DESCRIPTION = """Attention microbenchmarks: our FA2 offload (mqa=True) vs the repeat path (mqa=False), stock TVM,
FA2 called directly, PyTorch SDPA with enable_gqa and TVM's own paged-KV-cache attention kernels
(``tvm.relax.frontend.nn.llm``, the TIR kernels MLC-LLM runs without FlashInfer), measured side by
side in one run.

Three steps, on two machines (the GPU machine may have TVM's runtime only: ``mqa-byoc runtime-kit``):

    python benchmarks/attention.py build --suite presets --out .bench-artifacts/presets     # compile machine
    source kit/setup.sh && python3 -m tvm_runtime_kit benchmarks/attention.py run \
        --artifacts .bench-artifacts/presets --json attention-presets.json       # GPU machine (copy the kit and
                                                                                # .bench-artifacts/presets there)
    python benchmarks/attention.py report attention-presets.json [rerun.json ...]   # benchmarks/results/

``build`` writes the libraries plus ``cases.json``. Suites ``smoke`` / ``full`` build one library per
(case, variant) with static shapes. Suite ``presets`` (every distinct (H, H_kv, D) of the model
presets x fp16/bf16 x prefill {1k, 4k, 16k} causal x decode S_kv {1k, 4k, 16k, 32k}) builds
*symbolic* sequence lengths, so one library serves every length: per dtype one Relax library holding
all shapes x {prefill, decode} x {mqa, repeat, stock} (the FA2 kernels of a (head dim, dtype) are
linked once, not once per variant), one library of TVM's paged-KV TIR kernels, and the CUDA of both
compiled to fatbins here (``cuda-cache/``) so the GPU does not JIT-compile TVM's kernels at load.

``run`` loads them with the runtime-only TVM, checks every variant's output against FA2 called
directly, times each with CUDA events over back-to-back calls (the steady state a decode loop sees:
CPU overhead per call counts when it exceeds the kernel time; iterations are sized to a time budget
per variant) and writes JSON records; each variant runs in its own try/except, a failure is recorded
and the run goes on; the JSON is rewritten after every case. ``report`` turns the JSON into
``benchmarks/results/<date>-attention-<suite>.{json,md}`` and ``-fp16.png`` / ``-bf16.png`` (needs
matplotlib; ``run`` does not); given several run JSONs, later ones replace earlier (case, variant)
records (reruns with ``--cases`` / ``--skip-variants``). ``check-llm`` repeats the build's CPU check of
the TVM kernels' calling convention.
"""

def main(argv=None):
    from .build import build
    from .paged_kv import check_llm_cpu
    from .report import report
    from .run import run
    from .suites import GROUPED_SUITES, SUITES

    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the libraries (here)")
    b.add_argument("--out", default=".bench-artifacts")
    b.add_argument("--suite", default="smoke", choices=sorted(SUITES) + sorted(GROUPED_SUITES))
    b.add_argument("--providers", default=None, help="comma list; default python (smoke/full), native (presets)")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--shapes", default=None, help="grouped suites: only these shape ids, e.g. h64-kv8-d128")
    b.add_argument("--skip-llm", action="store_true", help="grouped suites: no TVM paged-KV kernels")
    b.add_argument("--no-precompile", action="store_true", help="grouped suites: leave TVM's CUDA to load-time JIT")
    b.add_argument("--kernel-options", default=None,
                   help="grouped suites: kernel options compiled into the libraries, e.g. split_combine=fa2 or "
                        "hopper_fa4=always (docs/build-options.md)")
    r = sub.add_parser("run", help="measure (GPU machine)")
    r.add_argument("--artifacts", default=".bench-artifacts")
    r.add_argument("--json", default="attention-results.json")
    r.add_argument("--iters", type=int, default=200, help="at most this many timed calls per variant")
    r.add_argument("--budget-ms", type=float, default=250.0, help="timed loop length per variant")
    r.add_argument("--max-call-s", type=float, default=5.0, help="a first call slower than this is not repeated")
    r.add_argument("--cases", default=None, help="regex on case names")
    r.add_argument("--idle-s", type=float, default=0.0,
                   help="seconds idle before the timed loop and the kernel timing of each call of 300 us or more "
                        "(every variant then starts at the same clock; the board's power limit lowers it in long loops)")
    r.add_argument("--skip-variants", default=None, help="comma list of glob patterns, e.g. 'tvm-llm-*,stock-tvm'")
    r.add_argument("--kernel-time", action="store_true",
                   help="also record each variant's GPU kernel time per call (CUPTI, torch.profiler)")
    r.add_argument("--fp32-reference", action="store_true",
                   help="also check every variant against an fp32 reference computed on the GPU")
    r.add_argument("--verbose", action="store_true")
    r.add_argument("--setup", action="append", default=None, metavar="MODULE",
                   help="import MODULE first (a runtime-only TVM's set-up; default $MQA_BYOC_RUNTIME_SETUP)")
    c = sub.add_parser("report", help="markdown table + plots from a run's JSON (here)")
    c.add_argument("json", nargs="+", help="run JSON(s); later ones replace earlier (case, variant) records")
    c.add_argument("--out-dir", default=os.path.join(BENCHMARKS, "results"))
    c.add_argument("--name", default=None, help="file name prefix (default <date>-attention-<suite>)")
    c.add_argument("--no-plots", action="store_true")
    sub.add_parser("check-llm", help="CPU check of TVM's paged-KV kernels' calling convention (here)")
    args = p.parse_args(argv)
    t0 = time.time()
    if args.cmd == "check-llm":
        res = check_llm_cpu()
        ok = all(x["ok"] for x in res)
        print("ok" if ok else "MISMATCH")
        sys.exit(0 if ok else 1)
    {"build": build, "run": run, "report": report}[args.cmd](args)
    print(f"{args.cmd} took {time.time() - t0:.0f} s")
