"""Import first in a GPU artifact builder: puts this checkout's ``src`` (mqa_byoc, the GPU test cases and
manifest format of ``mqa_byoc.testing``) ahead of any installed copy, and this folder (``bundle``) on
``sys.path``. Nothing of ``tests/`` or ``benchmarks/``: what a builder and a test share lives in the package."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "src", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
