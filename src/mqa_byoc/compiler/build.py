"""``mqa_byoc.build``: partition, generate the FA2 calls and build, in one call.

The long form, for scripts that need a step in between (:func:`run_codegen` is the middle step)::

    mod = mqa_byoc.partition_for_cutlass(mod, mqa=True, provider=provider)
    with target:
        mod = relax.transform.RunCodegen()(mod)
        mod = mqa_byoc.compiler.link.AttachKernelLibraries(arch, kernel_options)(mod)
        ex = relax.build(mod, target=target, relax_pipeline=pipeline)
    mqa_byoc.compiler.cuda_binary.compile_cuda_modules(ex, arch)  # with cuda_binary=True

:func:`build` is exactly that, with the provider resolved once, here (see
:mod:`mqa_byoc.compiler.provider` for the rule), and handed to the codegen as its option. The attach
step adds the kernel options and kernel objects as modules, so that ``ex.export_library(path)`` links
them (:mod:`mqa_byoc.compiler.link`).
"""

from __future__ import annotations

import tvm
from tvm import relax

from mqa_byoc import kernels as _kernels
from mqa_byoc.contract import CODEGEN

from mqa_byoc.compiler.codegen import cublaslt  # noqa: F401 - registers relax.ext.cublaslt
from mqa_byoc.compiler.codegen import dispatch  # noqa: F401 - registers relax.ext.flash_attn
from mqa_byoc.compiler.cuda_binary import compile_cuda_modules
from mqa_byoc.compiler.graph.site import require_flag
from mqa_byoc.compiler.kernel_options import KernelOptions
from mqa_byoc.compiler.link import AttachKernelLibraries
from mqa_byoc.compiler.provider import PROVIDER_OPTION, build_provider, cuda_target, target_arch


def build(mod: tvm.IRModule, target, *, mqa: bool | None = True, provider: str | None = None, pipeline=None,
          gemm: bool = True, kernel_options=None, link_kernels: bool = True, cuda_binary: bool = False,
          progress=None):
    """Offload the attention of ``mod`` to Flash Attention (and its GEMMs to cuBLASLt) and build it for ``target``.

    Parameters
    ----------
    mod : IRModule
        A Relax module (TVMScript, ``nn.Module`` export, PyTorch frontend).
    target : Target | dict | str
        The CUDA target, e.g. ``{"kind": "cuda", "arch": "sm_90"}``.
    mqa : bool | None
        Passed to :func:`mqa_byoc.partition_for_cutlass` (True: FA2 with native K/V heads; False:
        the A/B baseline on expanded K/V). None: ``mod`` is already partitioned (several
        partitions merged into one library, say) and only the codegen and the build run.
    provider : "native" | "hopper" | "python" | "auto" | None
        Kernel provider of the offloaded functions that do not name one themselves
        (``partition_for_cutlass(provider=...)``). None or "auto": the default rule of
        :mod:`mqa_byoc.compiler.provider` for ``target`` (native when nvcc is found, hopper on
        sm_90 when FA4 objects can be had, else python).
    gemm : bool
        Passed to :func:`mqa_byoc.partition_for_cutlass`: GEMMs on cuBLASLt (False: on TVM's kernels).
    pipeline : str | tvm.transform.Pass | None
        ``relax.build``'s ``relax_pipeline``; None is TVM's default for the target. Whole decoders:
        ``mqa_byoc.compiler.pipeline.cuda_decoder_pipeline(target)``.

    kernel_options : KernelOptions | dict | str | None
        Kernel choices compiled into the library (:class:`mqa_byoc.compiler.kernel_options.KernelOptions`,
        e.g. ``{"hopper_fa4": "always"}``); None: the defaults. Nothing in the environment changes
        them later; the library's ``mqa_byoc_kernel_options()`` returns them.
    link_kernels : bool
        Attach the kernel objects the native / hopper wrappers need as static-library modules
        (:class:`mqa_byoc.compiler.link.AttachKernelLibraries`), so that a plain
        ``ex.export_library(path)`` links them; kernel families not built yet are left to
        :func:`mqa_byoc.export_library`, which builds them.
    cuda_binary : bool
        Compile TVM's own generated CUDA kernels to fatbins for the target arch now
        (:mod:`mqa_byoc.compiler.cuda_binary`), so the exported library loads with TVM's C++ runtime
        alone (no ``tvm_callback_cuda_compile`` hook, no nvcc where it runs). Needs nvcc and g++.
    progress : callable | None
        Reports the compiles of the last two steps.

    Returns
    -------
    tvm.runtime.Executable
        The built executable. ``ex.export_library(path)`` links the kernel objects attached here
        (FA2, FA4, the cuBLASLt dispatcher); :func:`mqa_byoc.export_library` also builds and links those
        that were missing.
    """
    from mqa_byoc.compiler.partition import partition_for_cutlass

    target = cuda_target(target, "mqa_byoc.build", "for a CPU build use relax.build without the partition")
    _check_pipeline(pipeline)
    mqa = require_flag(mqa, "mqa_byoc.build(mqa=)", allow_none=True)
    for flag, name in ((gemm, "gemm"), (link_kernels, "link_kernels"), (cuda_binary, "cuda_binary")):
        require_flag(flag, f"mqa_byoc.build({name}=)")
    _warn_unserved_paged_caches(mod)
    if mqa is not None:
        mod = partition_for_cutlass(mod, mqa=mqa, gemm=gemm)
    options = KernelOptions.of(kernel_options)
    arch = target_arch(target) or _kernels.detect_arch()
    mod = run_codegen(mod, target, provider=provider)
    with target:
        if link_kernels:
            mod = AttachKernelLibraries(arch, options, progress=progress)(mod)
        ex = relax.build(mod, target=target, relax_pipeline="default" if pipeline is None else pipeline)
    if cuda_binary:
        compile_cuda_modules(ex, arch, progress=progress)
    return ex


def _check_pipeline(pipeline):
    """``relax.build`` takes a pipeline name or a Pass; anything else fails deep inside it."""
    if pipeline is not None and not isinstance(pipeline, (str, tvm.transform.Pass)):
        raise TypeError(f"mqa_byoc.build(pipeline=) takes None, a pipeline name (\"default\") or a tvm.transform.Pass "
                        f"(e.g. mqa_byoc.compiler.pipeline.cuda_decoder_pipeline(target)), got {pipeline!r} "
                        f"({type(pipeline).__name__})")


def _warn_unserved_paged_caches(mod: tvm.IRModule):
    """A PagedKVCache's attention is no partition site: the paged pass serves it, with a page size the
    run-time cache must be created with, so it is never applied behind the user's back; say so when a
    cache it would serve is left on TVM's kernels."""
    import warnings

    from mqa_byoc.compiler.paged.transform import paged_kv_cache_report

    pending = sorted({d.kernel for d in paged_kv_cache_report(mod) if d.offloaded and d.note != "already rewritten"})
    if pending:
        warnings.warn(f"mqa_byoc.build: the module's PagedKVCache attention ({', '.join(pending)}) stays on TVM's "
                      "TIR kernels; apply mqa_byoc.compiler.paged.UseFlashAttentionForPagedKVCache(page_size=...) "
                      "first and create the cache with that page size (docs/paged_kv_cache.md)", stacklevel=3)


def run_codegen(mod: tvm.IRModule, target, *, provider: str | None = None) -> tvm.IRModule:
    """``RunCodegen`` of a partitioned ``mod`` under ``target``, the provider resolved once (as
    :func:`build` does it, which calls this): for scripts that inspect or lower the module between
    the codegen and ``relax.build``.

    Returns
    -------
    IRModule
        ``mod`` with each ``flash_attn`` function replaced by a call of its generated kernel
        (the generated modules in the ``external_mods`` attribute).
    """
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    provider = build_provider(provider, target)
    with target:
        return relax.transform.RunCodegen({CODEGEN: {PROVIDER_OPTION: provider}})(mod)


def native_kernel_keys(mod: tvm.IRModule) -> tuple:
    """The FA2 kernel families (:class:`~mqa_byoc.kernels.KernelKey`) the native provider's
    library of the partitioned ``mod`` links: what ``mqa-byoc build-kernels`` must have built, known
    before the (slow) ``relax.build``.

    Returns
    -------
    tuple of KernelKey
        Sorted, without duplicates; empty when nothing is offloaded.
    """
    from mqa_byoc.compiler.export import collect_kernel_keys

    generated = relax.transform.RunCodegen({CODEGEN: {PROVIDER_OPTION: "native"}})(mod)  # no target needed
    keys = set()
    for m in (generated.attrs or {}).get("external_mods", []):
        keys.update(collect_kernel_keys(m))
    return tuple(sorted(keys))


def offload_gemms(mod: tvm.IRModule, target) -> tvm.IRModule:
    """:class:`~mqa_byoc.compiler.graph.gemm.PartitionGemm` then ``RunCodegen`` under ``target``: for
    modules that skip ``partition_for_cutlass`` (the PagedKVCache decoders, whose attention is served by
    the cache pass). Export the built result with ``export_library``."""
    from mqa_byoc.compiler.graph.gemm import PartitionGemm

    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    part = PartitionGemm()(mod)
    with target:
        return relax.transform.RunCodegen()(part)
