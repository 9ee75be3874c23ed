"""Attention microbenchmarks: ``python benchmarks/attention.py build | run | report | check-llm``.

The code is the package ``benchmarks/attention_bench`` (suites, TVM paged-KV harness, build, CUDA
precompile, run, report, CLI); ``--help`` describes the three steps and their two machines.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
