"""The JSON sidecar next to an exported decoder library (``<lib>.so.json``): what the run half needs
to feed the library (parameter shapes, cache shape, vocabulary) and which mode it is.

Written at compile time (:mod:`mqa_byoc.models.decoder_libs`), read at run time
(:mod:`mqa_byoc.runtime.runner`); neither side needs TVM for it.
"""

from __future__ import annotations

import json


def sidecar_path(lib_path: str) -> str:
    return lib_path + ".json"


def write_sidecar(lib_path: str, config, param_spec, dtype: str, extra: dict | None = None) -> str:
    """Write ``<lib_path>.json`` from a decoder config and its parameter spec.

    Returns
    -------
    str
        The sidecar's path.
    """
    meta = {
        "dtype": dtype,
        "num_layers": config.num_layers,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "params": [[p.name, list(p.shape), p.dtype] for p in param_spec],
        **(extra or {}),
    }
    path = sidecar_path(lib_path)
    with open(path, "w") as f:
        json.dump(meta, f)
    return path


def read_sidecar(lib_path: str) -> dict:
    """The sidecar of ``lib_path`` as a dict."""
    with open(sidecar_path(lib_path)) as f:
        return json.load(f)
