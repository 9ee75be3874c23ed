"""``mqa_byoc.build``: partition, generate the FA2 calls and build, in one call.

The long form, for scripts that need a step in between::

    mod = mqa_byoc.partition_for_cutlass(mod, mqa=True, provider=provider)
    with target:
        mod = relax.transform.RunCodegen()(mod)
        ex = relax.build(mod, target=target, relax_pipeline=pipeline)

:func:`build` is exactly that, with the provider resolved once, here (see
``mqa_byoc.compiler.codegen`` for the rule), and handed to the codegen as its option.
"""

from __future__ import annotations

import tvm
from tvm import relax

from mqa_byoc.contract import CODEGEN

from . import codegen


def resolve_build_provider(provider: str | None, target) -> str:
    """The provider a build uses: ``provider`` when given ("native" / "python"; "auto" = the
    default rule), else the process-wide setting, ``MQA_BYOC_PROVIDER`` or the default rule for
    ``target`` (``codegen.resolve_provider``)."""
    return codegen.resolve_provider(None, {codegen.PROVIDER_OPTION: provider, "target": target})


def build(mod: tvm.IRModule, target, *, mqa: bool | None = True, provider: str | None = None, pipeline=None,
          gemm: bool = True):
    """Offload the attention of ``mod`` to Flash Attention 2 (and its GEMMs to cuBLASLt) and build it for ``target``.

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
    provider : "native" | "python" | "auto" | None
        FA2 kernel provider of the offloaded functions that do not name one themselves
        (``partition_for_cutlass(provider=...)``). None: the process-wide setting
        (``codegen.use_provider``), ``MQA_BYOC_PROVIDER``, else native when nvcc is found.
    gemm : bool
        Passed to :func:`mqa_byoc.partition_for_cutlass`: GEMMs on cuBLASLt (False: on TVM's kernels).
    pipeline : str | tvm.transform.Pass | None
        ``relax.build``'s ``relax_pipeline``; None is TVM's default for the target. Whole decoders:
        ``mqa_byoc.compiler.pipeline.cuda_decoder_pipeline(target)``.

    Returns
    -------
    tvm.runtime.Executable
        The built executable. Export it with :func:`mqa_byoc.export_library`, which links the native
        provider's FA2 kernels and the cuBLASLt dispatcher of offloaded GEMMs.
    """
    from .partition import partition_for_cutlass

    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    provider = resolve_build_provider(provider, target)
    if mqa is not None:
        mod = partition_for_cutlass(mod, mqa=mqa, gemm=gemm)
    with target:
        mod = relax.transform.RunCodegen({CODEGEN: {codegen.PROVIDER_OPTION: provider}})(mod)
        return relax.build(mod, target=target, relax_pipeline="default" if pipeline is None else pipeline)


def native_kernel_keys(mod: tvm.IRModule) -> tuple:
    """The FA2 kernel families (:class:`~mqa_byoc.kernels.KernelKey`) the native provider's
    library of the partitioned ``mod`` links: what ``mqa-byoc build-kernels`` must have built, known
    before the (slow) ``relax.build``.

    Returns
    -------
    tuple of KernelKey
        Sorted, without duplicates; empty when nothing is offloaded.
    """
    from .export import collect_kernel_keys

    generated = relax.transform.RunCodegen({CODEGEN: {codegen.PROVIDER_OPTION: "native"}})(mod)
    keys = set()
    for m in (generated.attrs or {}).get("external_mods", []):
        keys.update(collect_kernel_keys(m))
    return tuple(sorted(keys))
