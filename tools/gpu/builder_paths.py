"""Import first in a GPU artifact builder: puts this checkout's ``src`` (mqa_byoc, its graph builders
``mqa_byoc.testing.graphs``) and ``tests/gpu`` (the manifest format the GPU tests read) on ``sys.path``."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "src", ROOT / "tests" / "gpu", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
