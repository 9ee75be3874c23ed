"""docs/configuration.md lists every ``MQA_BYOC_*`` environment variable the project reads.

A variable is read where its name is a string literal in Python (``os.environ.get("MQA_BYOC_X")``,
``PROVIDER_ENV = "MQA_BYOC_X"``) or an argument of ``getenv`` in C++/CUDA, in src/, tools/, tests/ and
benchmarks/. Preprocessor macros of the same prefix (``#define MQA_BYOC_...``) are not variables.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
_PY = re.compile(r"""["'](MQA_BYOC_[A-Z0-9_]*[A-Z0-9])["']""")
_C = re.compile(r"""getenv\(\s*"(MQA_BYOC_[A-Z0-9_]*[A-Z0-9])"\s*\)""")
_DEFINE = re.compile(r"#\s*(?:define|ifndef|ifdef)\s+(MQA_BYOC_[A-Z0-9_]+)")


def variables_read() -> dict[str, set[str]]:
    found, macros = {}, set()
    for top in ("src", "tools", "tests", "benchmarks"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".cc", ".cu", ".h") or "results" in path.parts or path == Path(__file__):
                continue
            text = path.read_text(errors="replace")
            macros |= set(_DEFINE.findall(text))
            for name in (_PY if path.suffix == ".py" else _C).findall(text):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return {k: v for k, v in found.items() if k not in macros}


def test_every_variable_is_documented():
    documented = set(re.findall(r"\| `(MQA_BYOC_[A-Z0-9_]+)` \|", PAGE.read_text()))
    read = variables_read()
    missing = {k: sorted(v) for k, v in read.items() if k not in documented}
    assert not missing, f"read but not in docs/configuration.md: {missing}"


def test_every_documented_variable_is_read():
    documented = set(re.findall(r"\| `(MQA_BYOC_[A-Z0-9_]+)` \|", PAGE.read_text()))
    stale = sorted(documented - set(variables_read()))
    assert not stale, f"in docs/configuration.md but read nowhere: {stale}"


def test_scan_finds_the_known_readers():
    read = variables_read()
    assert "src/mqa_byoc/native/nvtx_switch.h" in read["MQA_BYOC_NVTX"]
    assert "src/mqa_byoc/kernels/toolchain.py" in read["MQA_BYOC_NVCC"]
    assert "MQA_BYOC_CAUSAL" not in read  # a macro the kernel build defines (-DMQA_BYOC_CAUSAL=...)
