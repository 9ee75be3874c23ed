"""The GPU test flow's build step covers every GPU test that reads artifacts.

``python tools/gpu/build_all.py`` then ``pytest tests/gpu`` is the documented flow (docs/testing.md): a
test whose artifacts no builder of ``build_all`` writes would only skip there. ``tools/`` is not imported
from ``tests/`` (test_package_layers.py), so the builders are read from ``build_all.py --list``.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def _list_lines() -> tuple[str, ...]:
    """``build_all.py --list``: one line a builder, ``name script args  ->  tests/gpu/test files``."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "build_all.py"), "--list"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return tuple(r.stdout.splitlines())


def test_every_gpu_test_reading_artifacts_has_a_builder_in_build_all():
    listed = {t for line in _list_lines() for t in re.findall(r"test_\w+\.py", line.partition("->")[2])}
    readers = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_gpu_*.py")
                     if ".gpu-artifacts" in p.read_text())
    assert readers, "no GPU test reads .gpu-artifacts: the check would check nothing"
    missing = [t for t in readers if t not in listed]
    assert not missing, f"GPU tests whose artifacts build_all.py does not build: {missing}"


def test_every_listed_builder_script_exists():
    scripts = [line.split()[1] for line in _list_lines() if line.split()[1].endswith(".py")]
    assert scripts and all((ROOT / "tools" / "gpu" / s).is_file() for s in scripts), scripts
