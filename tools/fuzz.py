"""Long fuzz run of the attention partition (or, with --gemm, of the GEMM offload).

    python tools/fuzz.py --graphs 1000 --seed 1 --json fuzz.json
    python tools/fuzz.py --gemm --graphs 1000 --seed 1 --json gemm-fuzz.json

draws random attention graphs (``src/mqa_byoc/testing/fuzz/gen.py``), checks every invariant of
``src/mqa_byoc/testing/fuzz/invariants.py`` on each (building every graph with offloaded sites for sm_90 with both
providers unless ``--build-every N``), shrinks the first graph of each distinct violation and prints
a summary: graphs, sites, offloaded, rejections by reason, violations by invariant with a repro
(``GraphSpec``; ``src/mqa_byoc/testing/fuzz/build.py::build_module(spec).mod`` is the module). Exit status 1 when
there is a violation. Graph ``i`` of seed ``s`` is the same on every machine: ``--only i`` reruns it.
``--gemm`` draws matmul graphs instead (``src/mqa_byoc/testing/fuzz/gemm.py``: every matmul reported, offloaded
exactly where cuBLASLt can take it, and the partitioned graph, each offloaded call replaced by a model of
the cuBLASLt call, computing on llvm what the graph does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]  # mqa_byoc from this checkout when it is not installed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gemm", action="store_true", help="fuzz the GEMM offload instead of attention")
    ap.add_argument("--graphs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--build-every", type=int, default=1, help="build every Nth graph for sm_90 (0: never)")
    ap.add_argument("--no-numerics", action="store_true", help="skip the CPU numerics check")
    ap.add_argument("--no-shrink", action="store_true", help="do not shrink violating graphs")
    ap.add_argument("--no-varlen", dest="varlen", action="store_false",
                    help="draw no R.nn.attention_var_len sites (drawn by default)")
    ap.add_argument("--only", type=int, help="check graph number ONLY of this seed and print it")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--markdown", type=Path, help="with --from-json: write the distinct violations as Markdown")
    ap.add_argument("--from-json", type=Path, help="read a run's summary instead of running")
    args = ap.parse_args(argv)

    from mqa_byoc.testing.fuzz import runner
    from mqa_byoc.testing.fuzz.build import build_module
    from mqa_byoc.testing.fuzz.invariants import check_graph

    if args.from_json is not None:
        text = runner.markdown(json.loads(args.from_json.read_text()))
        if args.markdown:
            args.markdown.write_text(text)
        else:
            print(text)
        return 0

    if args.gemm:
        return _gemm(args)

    if args.only is not None:
        spec = runner.draw(args.seed, args.only, args.varlen)
        print(spec)
        print(build_module(spec).mod)
        res = check_graph(spec, do_build=args.build_every > 0, do_numerics=not args.no_numerics,
                          seed=runner.graph_seed(args.seed, args.only))
        for v in res.violations:
            print(f"[{v.invariant}] {v.key}: {v.message}")
        for m in res.infos:
            print(f"(info) {m}")
        return 1 if res.violations else 0

    def progress(index, res, summary):
        if args.json and index % 10 == 9:  # a checkpoint: a long run can be read while it goes
            data = summary.as_json()
            data.update(seed=args.seed, build_every=args.build_every, varlen=args.varlen, partial=True)
            args.json.write_text(json.dumps(data, indent=1))
        if args.quiet:
            return
        mark = " ".join(sorted({v.invariant for v in res.violations}))
        print(f"graph {index}: {res.sites} sites, {res.offloaded} offloaded {mark}", flush=True)

    summary = runner.run(args.graphs, args.seed, build_every=args.build_every, numerics=not args.no_numerics,
                         varlen=args.varlen, shrink_violations=not args.no_shrink, progress=progress)
    print(summary.text())
    if args.json:
        data = summary.as_json()
        data.update(seed=args.seed, build_every=args.build_every, varlen=args.varlen)
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if summary.total_violations() else 0


def _gemm(args) -> int:
    from mqa_byoc.testing.fuzz import gemm

    if args.only is not None:
        spec = gemm.draw(args.seed, args.only)
        print(spec)
        print(gemm.build_gemm_module(spec, args.only).mod)
        res = gemm.check_gemm_graph(spec, seed=args.only, numerics=not args.no_numerics)
        for v in res.violations:
            print(f"[{v.invariant}] {v.message}")
        return 1 if res.violations else 0

    def progress(index, res):
        if not args.quiet:
            mark = " ".join(sorted({v.invariant for v in res.violations}))
            print(f"graph {index}: {res.sites} sites, {res.offloaded} offloaded {mark}", flush=True)

    summary = gemm.run(args.graphs, args.seed, numerics=not args.no_numerics, progress=progress)
    print(gemm.summary_text(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
