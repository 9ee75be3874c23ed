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

    from ..compiler.codegen.sites import find_site

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


def _options_text(kernel_options) -> str:
    from ..compiler.kernel_options import KernelOptions

    return KernelOptions.of(kernel_options).describe()


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
    tensor_parallel_shards: int = 1,
    gemm: bool = True,
    kernel_options=None,
) -> list[str]:
    """Build ``config`` (batch 1) once per mode in ``modes``; returns the exported library paths.

    ``gemm``: passed to :func:`mqa_byoc.partition_for_cutlass` (GEMMs on cuBLASLt; False: on TVM's kernels).
    ``kernel_options``: compiled into each library (:func:`mqa_byoc.build`'s; sidecar ``kernel_options``).

    Both modes are partitions of one graph, so they share its KV cache (``kv_cache``: "inplace",
    TVM's in-place cache objects, or "functional", K/V tensors concatenated per step; see
    :func:`mqa_byoc.models.llama.build_decoder`). Each library ``out_dir/<config.name>.{mqa,repeat}.so``
    gets a sidecar ``<lib>.json`` with the parameter shapes plus ``mqa``, ``provider``, ``kv_expand``,
    ``kv_cache``, ``fused_projections`` (``config``'s: qkv_proj / gate_up_proj, or separate
    projections), ``functions``, ``arch``, ``logits``, ``num_heads``, ``offloaded`` (composite name ->
    count), ``tensor_parallel_shards`` and ``extra``.

    ``tensor_parallel_shards`` N > 1 builds the library of one shard (every shard runs the same library,
    with its own weights: :func:`mqa_byoc.tp.shard_params`), with all-reduces for TVM's disco; the
    sidecar's parameter shapes, ``num_heads`` and ``intermediate_size`` are then the shard's.
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
                              functions=tuple(functions), kv_cache=kv_cache,
                              tensor_parallel_shards=tensor_parallel_shards)
    if tensor_parallel_shards > 1:
        from ..tp.sharding import shard_config

        config = shard_config(config, tensor_parallel_shards)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for mqa in modes:
        part = partition_for_cutlass(mod, mqa=mqa, gemm=gemm)
        offloaded = offloaded_composites(part)
        ex = build(part, target, mqa=None, provider=provider, pipeline=cuda_decoder_pipeline(target),
                   kernel_options=kernel_options)
        path = os.path.join(out_dir, library_name(config.name, mqa))
        export_library(ex, path, arch=arch)  # a plain export without native kernels
        write_sidecar(path, config, spec, dtype, {
            "mqa": bool(mqa), "provider": provider, "kv_expand": kv_expand, "kv_cache": kv_cache,
            "fused_projections": config.fused_projections, "functions": list(functions),
            "arch": arch, "logits": logits, "num_heads": config.num_heads, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "offloaded": offloaded,
            "tensor_parallel_shards": tensor_parallel_shards, "kernel_options": _options_text(kernel_options),
            **(extra or {}),
        })
        progress(f"built {path} (mqa={mqa}, {provider} provider, {kv_cache} KV cache, "
                 f"{'fused' if config.fused_projections else 'separate'} projections, offloaded: "
                 + (", ".join(f"{n} x {c}" for c, n in offloaded.items()) or "nothing") + ")")
        paths.append(path)
    return paths


# -- the PagedKVCache pair (``profile build --kv-cache paged``) -------------------------------------------

#: which attention kernels a paged library runs: ours (mqa=True) or TVM's TIR ones (mqa=False)
PAGED_ATTENTION = {True: "fa2", False: "tir"}
#: the page size TVM 0.27 generates its TIR cache kernels for (the TIR library's cache must use it)
TVM_TIR_PAGE_SIZE = 16
#: the TVM kernels UseFlashAttentionForPagedKVCache must serve for the FA2 library to be the pair's "mqa=True"
PAGED_SERVED = ("batch_decode_paged_kv", "batch_prefill_paged_kv", "batch_prefill_ragged_kv",
                "tir_attention_merge_state")


def paged_library_name(config_name: str, mqa: bool) -> str:
    """``<config>.paged-fa2.so`` / ``<config>.paged-tir.so``."""
    return f"{config_name}.paged-{PAGED_ATTENTION[bool(mqa)]}.so"


def paged_config_of(config, dtype: str):
    """The :class:`~mqa_byoc.models.paged_llama.PagedLlamaConfig` with ``config``'s shapes (a
    :class:`~mqa_byoc.models.presets.DecoderConfig`); RoPE applied by the cache on append (mode NORMAL).

    Raises
    ------
    ValueError
        ``config`` has a sliding window: the paged model has none, and TVM's sliding-window entries
        stay on TIR, generated for page size 16 only (docs/paged_kv_cache.md).
    """
    from .paged_llama import PagedLlamaConfig

    if config.sliding_window is not None:
        raise ValueError(f"{config.name}: the paged decoder has no sliding window (this config's is "
                         f"{config.sliding_window}); TVM's sliding-window paged attention has no FA2 kernel")
    return PagedLlamaConfig(num_q_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                            head_dim=config.head_dim, hidden=config.hidden_size,
                            intermediate=config.intermediate_size, layers=config.num_layers,
                            vocab=config.vocab_size, dtype=dtype, rope_theta=config.rope_theta)


#: the largest decode batch of a ``cuda_graph=True`` paged library (its buffers are planned for it)
CUDA_GRAPH_MAX_BATCH = 128


def _capture_decode_batch(mod):
    """``mod`` with its ``decode`` function marked to be captured per value of its batch variable."""
    fn = mod["decode"]
    name = getattr(fn.params[0].ty.shape[0], "name", None)  # a symbolic batch (a TIR variable)
    if name is None:
        return mod
    fn = fn.with_attr("relax.rewrite_cuda_graph.capture_symbolic_vars", [name])
    # static memory planning (what a captured region needs) sizes the step's buffers for this many rows
    fn = fn.with_attr("tir_var_upper_bound", {name: CUDA_GRAPH_MAX_BATCH})
    mod.update_func(mod.get_global_var("decode"), fn)
    return mod


def build_paged_decoder_libraries(
    config,
    out_dir: str,
    *,
    dtype: str = "float16",
    arch: str = "sm_90",
    modes: Sequence[bool] = (True, False),
    extra: dict | None = None,
    progress: Callable[[str], None] | None = print,
    gemm: bool = True,
    cuda_graph: bool = False,
    logits: str = "last",
    provider: str = "native",
    kernel_options=None,
) -> list[str]:
    """Build ``config`` as :class:`~mqa_byoc.models.paged_llama.PagedLlama` (``relax.frontend.nn`` on TVM's
    PagedKVCache) once per mode; returns the exported library paths.

    ``mqa=True``: the cache's attention on our FA2 kernels with native K/V heads
    (:class:`~mqa_byoc.compiler.paged.UseFlashAttentionForPagedKVCache`, page size = FA2's split-KV tile
    of the head dim), exported with :func:`mqa_byoc.export_library`; ``mqa=False``: TVM's TIR kernels as
    TVM builds them (page size 16). Both use the decoder pipeline (FuseTransposeMatmul). Each library
    ``out_dir/<config.name>.paged-{fa2,tir}.so`` gets a sidecar with the fields of
    :func:`build_decoder_libraries` (``kv_cache="paged"``; ``functions``: ``prefill`` (every position's
    logits), ``batch_prefill`` (each sequence's last position's) and ``decode``; ``logits``: which prefill
    :class:`~mqa_byoc.runtime.paged_driver.PagedDecoderRunner` serves a prompt with, "last" (the default,
    as a server does) or "all") plus ``paged_attention`` ("fa2" / "tir"), ``page_size``, ``paged_config`` (what
    :class:`mqa_byoc.runtime.paged_driver.PagedModel` needs) and ``paged_served`` (TVM kernels on FA2).
    ``gemm``: both libraries run their GEMMs on cuBLASLt (:func:`mqa_byoc.compiler.build.offload_gemms`;
    ``gemm_offloaded`` in the sidecar counts the sites); False: on TVM's kernels. ``kernel_options``: compiled
    into each library (:class:`~mqa_byoc.compiler.link.AttachKernelLibraries`; sidecar ``kernel_options``). ``cuda_graph``: TVM's
    ``relax.backend.use_cuda_graph`` (RewriteCUDAGraph captures the static regions between the cache's
    calls), with ``decode``'s batch as a symbolic variable captured per value
    (``relax.rewrite_cuda_graph.capture_symbolic_vars`` and ``tir_var_upper_bound``, as mlc-llm marks its
    decode: at most :data:`CUDA_GRAPH_MAX_BATCH` sequences per decode step); sidecar ``cuda_graph``.

    Raises
    ------
    ValueError
        A sliding-window config (:func:`paged_config_of`), or ``logits`` neither "last" nor "all".
    RuntimeError
        The pass does not serve every attention entry of the cache (its report in the message).
    """
    import dataclasses
    from types import SimpleNamespace

    import tvm

    from ..compiler.export import export_library
    from ..compiler.paged.transform import (UseFlashAttentionForPagedKVCache, format_paged_report, page_unit,
                                            paged_kv_cache_report)
    from ..compiler.pipeline import cuda_decoder_pipeline
    from ..sidecar import write_sidecar
    from .paged_llama import export_paged_llama

    progress = progress or (lambda _msg: None)
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    if provider not in ("native", "hopper", "auto"):
        raise ValueError(f"provider must be 'native', 'hopper' or 'auto' for the paged decoder, got {provider!r}")
    pcfg = paged_config_of(config, dtype)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    mod, params, _ext = export_paged_llama(pcfg, target)
    if cuda_graph:
        mod = _capture_decode_batch(mod)
    fa2_page = page_unit(pcfg.head_dim)
    if provider == "auto":  # the pass's rule, resolved here so that the sidecar names what was built
        from ..compiler.paged.codegen import PagedConfig
        from ..compiler.paged.transform import fa4_ragged_reason

        geometry = PagedConfig(pcfg.num_q_heads, pcfg.num_kv_heads, pcfg.head_dim, pcfg.dtype, fa2_page)
        provider = "hopper" if fa4_ragged_reason(geometry, "auto", arch) is None else "native"
    report = paged_kv_cache_report(mod, fa2_page, provider=provider, arch=arch)
    served = sorted(d.kernel for d in report if d.offloaded)
    if served != sorted(PAGED_SERVED):
        raise RuntimeError(f"{config.name}: UseFlashAttentionForPagedKVCache serves {served}, not "
                           f"{sorted(PAGED_SERVED)}:\n{format_paged_report(report)}")
    spec = [SimpleNamespace(name=n, shape=[int(s) for s in p.shape], dtype=str(p.dtype)) for n, p in params]
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for mqa in modes:
        path = os.path.join(out_dir, paged_library_name(config.name, mqa))
        if mqa:
            with target:
                lib_mod = UseFlashAttentionForPagedKVCache(page_size=fa2_page, provider=provider)(mod)
        else:
            lib_mod = mod
        gemm_sites = 0
        if gemm:
            from tvm import relax

            from ..compiler.codegen import cublaslt  # noqa: F401 - registers relax.ext.cublaslt
            from ..compiler.graph.gemm import PartitionGemm
            from ..contract import GEMM_CODEGEN

            lib_mod = PartitionGemm()(lib_mod)
            gemm_sites = sum(1 for f in lib_mod.functions.values() if getattr(f, "attrs", None) is not None
                             and str(f.attrs.get("Codegen", "")) == GEMM_CODEGEN)
            with target:
                lib_mod = relax.transform.RunCodegen()(lib_mod)
        if kernel_options is not None:
            from ..compiler.link import AttachKernelLibraries

            lib_mod = AttachKernelLibraries(arch, kernel_options)(lib_mod)
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True} if cuda_graph else {}):
            ex = tvm.compile(lib_mod, target=target, relax_pipeline=cuda_decoder_pipeline(target))
        export_library(ex, path, arch=arch)  # links FA2 + fa2_paged for the FA2 library; a plain export for TIR
        write_sidecar(path, config, spec, dtype, {
            "mqa": bool(mqa), "kv_cache": "paged", "paged_attention": PAGED_ATTENTION[bool(mqa)],
            "page_size": fa2_page if mqa else TVM_TIR_PAGE_SIZE, "paged_config": dataclasses.asdict(pcfg),
            "paged_served": served if mqa else [], **({"provider": provider} if mqa else {}),
            "gemm_offloaded": gemm_sites, **({"cuda_graph": True} if cuda_graph else {}),
            "kernel_options": _options_text(kernel_options),
            "functions": ["prefill", "batch_prefill", "decode"], "arch": arch, "logits": logits,
            "num_heads": config.num_heads,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size, **(extra or {}),
        })
        progress(f"built {path} (mqa={mqa}, paged KV cache, page size "
                 f"{fa2_page if mqa else TVM_TIR_PAGE_SIZE}, attention on "
                 + (f"FA2{' (ragged prefill on FA4, hopper provider)' if provider == 'hopper' else ''}: "
                    f"{', '.join(served)})" if mqa else "TVM's TIR kernels)"))
        paths.append(path)
    return paths
