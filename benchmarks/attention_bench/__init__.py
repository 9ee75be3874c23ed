"""The attention microbenchmarks of ``benchmarks/attention.py``, in modules:

- :mod:`.suites`: suites, shapes, variants and the report's conventions (pure logic);
- :mod:`.paged_kv`: TVM's paged-KV TIR kernels (``relax.frontend.nn.llm``): page tables, arguments,
  the CPU check of their calling convention;
- :mod:`.build`: the libraries (here, full TVM), through ``mqa_byoc.build``;
- :mod:`.run`: the measurement (GPU machine, runtime-only TVM, torch);
- :mod:`.report`: markdown and plots from a run's JSON;
- :mod:`.cli`: ``build | run | report | check-llm``.

Timing, the run header, the CUDA-compile hook and the fatbin cache (TVM's CUDA compiled to fatbins here,
served at load time there: :mod:`mqa_byoc.testing.fatbin_cache`) come from :mod:`mqa_byoc.testing`.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
SRC = os.path.join(BENCHMARKS, "..", "src")
if SRC not in sys.path:  # mqa_byoc from this checkout when it is not installed (the GPU machine)
    sys.path.insert(0, SRC)
