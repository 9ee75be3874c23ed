"""The scripts of benchmarks/ as modules, for the tests of their pure parts (no GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(script: str, module_name: str):
    """``benchmarks/<script>`` executed as the module ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
