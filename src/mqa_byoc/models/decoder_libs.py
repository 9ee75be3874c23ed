"""Build a Llama-family decoder for CUDA twice, ``mqa=True`` and ``mqa=False``, and export both.

The compile half of ``mqa-byoc profile`` (``profile build``): each library gets a JSON
sidecar (:func:`mqa_byoc.sidecar.write_sidecar`) so that the run half, on a machine with only
TVM's runtime, knows the parameters to make and which mode it is running.

Needs the full apache-tvm (``tvm.relax``); the native provider also needs nvcc and the FA2 kernel
objects (``mqa-byoc build-kernels``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence

from ..contract import CODEGEN

MODES = {True: "mqa", False: "repeat"}


def library_name(config_name: str, mqa: bool) -> str:
    """``<config>.mqa.so`` / ``<config>.repeat.so``."""
    return f"{config_name}.{MODES[bool(mqa)]}.so"


def offloaded_composites(mod) -> dict[str, int]:
    """How many attention calls each composite (``flash_attn.attention_mqa`` / ``flash_attn.attention``)
    serves in a partitioned module (before ``RunCodegen``): calls, not functions (identical sites share
    one offloaded function)."""
    from tvm import relax

    from ..compiler.codegen import find_site

    offloaded = {}
    for gv, func in mod.functions.items():
        attrs = getattr(func, "attrs", None)
        if attrs is not None and "Codegen" in attrs and str(attrs["Codegen"]) == CODEGEN:
            offloaded[gv.name_hint] = find_site(func).composite_name
    counts = Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar) and expr.op.name_hint in offloaded:
            counts[offloaded[expr.op.name_hint]] += 1

    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and gv.name_hint not in offloaded:
            relax.analysis.post_order_visit(func.body, visit)
    return dict(sorted(counts.items()))


def build_decoder_libraries(
    config,
    out_dir: str,
    *,
    functions: Sequence[str] = ("prefill", "decode"),
    dtype: str = "float16",
    kv_expand: str = "repeat",
    kv_cache: str = "inplace",
    provider: str = "native",
    arch: str = "sm_90",
    logits: str = "last",
    modes: Sequence[bool] = (True, False),
    extra: dict | None = None,
    progress: Callable[[str], None] | None = print,
) -> list[str]:
    """Build ``config`` (batch 1) once per mode in ``modes``; returns the exported library paths.

    Both modes are partitions of one graph, so they share its KV cache (``kv_cache``: "inplace",
    TVM's in-place cache objects, or "functional", K/V tensors concatenated per step; see
    :func:`mqa_byoc.models.llama.build_decoder`). Each library ``out_dir/<config.name>.{mqa,repeat}.so``
    gets a sidecar ``<lib>.json`` with the parameter shapes plus ``mqa``, ``provider``, ``kv_expand``,
    ``kv_cache``, ``fused_projections`` (``config``'s: qkv_proj / gate_up_proj, or separate
    projections), ``functions``, ``arch``, ``logits``, ``num_heads``, ``offloaded`` (composite name ->
    count) and ``extra``.
    """
    import tvm

    from ..compiler.build import build
    from ..compiler.export import export_library
    from ..compiler.partition import partition_for_cutlass
    from ..compiler.pipeline import cuda_decoder_pipeline
    from ..sidecar import write_sidecar
    from .llama import build_decoder

    progress = progress or (lambda _msg: None)
    from ..contract import check_provider

    provider = check_provider(provider, "build_decoder_libraries(provider=)")
    mod, spec = build_decoder(config, dtype=dtype, kv_expand=kv_expand, batch=1, logits=logits,
                              functions=tuple(functions), kv_cache=kv_cache)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for mqa in modes:
        part = partition_for_cutlass(mod, mqa=mqa)
        offloaded = offloaded_composites(part)
        ex = build(part, target, mqa=None, provider=provider, pipeline=cuda_decoder_pipeline(target))
        path = os.path.join(out_dir, library_name(config.name, mqa))
        export_library(ex, path, arch=arch)  # a plain export without native kernels
        write_sidecar(path, config, spec, dtype, {
            "mqa": bool(mqa), "provider": provider, "kv_expand": kv_expand, "kv_cache": kv_cache,
            "fused_projections": config.fused_projections, "functions": list(functions),
            "arch": arch, "logits": logits, "num_heads": config.num_heads, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "offloaded": offloaded, **(extra or {}),
        })
        progress(f"built {path} (mqa={mqa}, {provider} provider, {kv_cache} KV cache, "
                 f"{'fused' if config.fused_projections else 'separate'} projections, offloaded: "
                 + (", ".join(f"{n} x {c}" for c, n in offloaded.items()) or "nothing") + ")")
        paths.append(path)
    return paths
