"""GPU test artifact manifests and their random inputs: numpy and the standard library only.

Written by the artifact builders (``tools/gpu/build_forms.py``), read by the GPU tests (which also have
torch) and by ``tests/gpu/native_standalone_child.py``, which runs in a process where torch and
mqa_byoc cannot be imported and loads this file by its path: so it imports neither (nor anything of
the package), and must stay that way.

Inputs: input ``i`` of a case is ``numpy.random.default_rng([seed, crc32(case name), i])
.standard_normal(shape, float32)`` rounded to the case dtype (round to nearest even). float16 inputs
are ``numpy.float16`` arrays; bfloat16 inputs are their bit patterns as ``numpy.uint16`` arrays, so
that no bfloat16-aware numpy extension is needed to make identical inputs in every process.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

MANIFEST_FORMAT = 2


def load_manifests(root: Path) -> list[dict]:
    """Every ``<root>/<case>/manifest.json`` (case manifests only: other folders, e.g. prebuilt FA2
    kernels, may hold a manifest.json too), with ``dir`` set to the case folder."""
    out = []
    for path in sorted(Path(root).glob("*/manifest.json")):
        m = json.loads(path.read_text())
        if not isinstance(m, dict) or "case" not in m:
            continue
        m["dir"] = str(path.parent)
        out.append(m)
    return out


def module_path(m: dict, key: str) -> str:
    """Absolute path of the library of variant ``key`` (paths in the manifest are relative to it)."""
    return os.path.normpath(os.path.join(m["dir"], m["modules"][key]))


def function_name(m: dict, key: str) -> str:
    """VM function of variant ``key``: ``main``, or the case's function in a shared (bundled) library."""
    return m.get("functions", {}).get(key, "main")


def input_seed(m: dict, index: int) -> list[int]:
    return [int(m["seed"]), zlib.crc32(m["case"]["name"].encode()), int(index)]


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even; finite inputs), as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def make_input(m: dict, index: int) -> np.ndarray:
    """Input ``index`` of case ``m``: float16 array, or uint16 bit patterns for bfloat16."""
    spec = m["inputs"][index]
    x = np.random.default_rng(input_seed(m, index)).standard_normal(spec["shape"], dtype=np.float32)
    if spec["dtype"] == "float16":
        return x.astype(np.float16)
    if spec["dtype"] == "bfloat16":
        return float32_to_bfloat16_bits(x)
    if spec["dtype"] == "float32":  # attention sinks as GPT-OSS keeps them
        return x
    raise ValueError(f"{m['case']['name']}: unsupported input dtype {spec['dtype']!r}")


def make_inputs(m: dict) -> list[np.ndarray]:
    return [make_input(m, i) for i in range(len(m["inputs"]))]


def as_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of an array made by :func:`make_input` (or a device output in the same form)."""
    if dtype == "bfloat16" and arr.dtype == np.uint16:
        return bfloat16_bits_to_float32(arr)
    return np.asarray(arr, dtype=np.float32)
