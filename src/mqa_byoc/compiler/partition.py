"""``partition_for_cutlass(mod, mqa=True)``: offload attention to FA2 with native K/V heads.

A ``tvm.transform.Sequential`` of module passes, each usable alone:

0. :class:`~.graph.lowered_matmul.RestoreLoweredMatmul`: matmuls TVM already lowered (``FuseTransposeMatmul``'s
   ``NT_matmul``, ``LegalizeOps``' ``matmul``) become ``R.matmul`` again, so that the steps below see them;
   :class:`~.graph.dataflow.EnterDataflow` moves sites written outside ``R.dataflow()`` into dataflow blocks,
   the only ones ``FuseOpsByPattern`` groups;
1. :class:`~.canonicalize.CanonicalizeAttention`: every attention site that FA2 computes exactly
   (see :mod:`.analysis`) becomes ``R.nn.attention`` on the pre-expansion K/V (with ``mqa=True``);
   rejected sites are left alone;
2. ``FuseOpsByPattern`` with the pattern table of :mod:`.patterns` groups each into a composite
   (``flash_attn.attention_mqa`` or ``flash_attn.attention``) and annotates ``Codegen="flash_attn"``;
3. :class:`~.graph.sink_attention.OffloadSinkAttention` makes each attention with sinks (rewritten by
   step 1 into a function of its own) its composite (``flash_attn.attention_mqa_sink``);
4. :class:`AnnotateProvider` records the kernel provider, when one is asked for;
5. :class:`~.gqa_legalize.LegalizeGroupedAttention` makes any attention left with fewer K/V heads
   (or a window) correct for TVM's own lowering;
6. (``gemm=True``) :class:`~.graph.gemm.PartitionGemm` groups the GEMM sites into ``cublaslt`` composites;
7. when step 0 restored an ``NT_matmul``, ``FuseTransposeMatmul`` again, for the sites nothing offloaded.

:func:`offload_report` runs the same analysis and says what happens to each site, and why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import tvm
from tvm import relax

from mqa_byoc.contract import PROVIDER_ATTR, check_provider, composite_name

from mqa_byoc.compiler.graph import varlen
from mqa_byoc.compiler.graph.dataflow import EnterDataflow
from mqa_byoc.compiler.graph.canonicalize import CanonicalizeAttention, analyze_module, canonicalize_attention
from mqa_byoc.compiler.graph.exprs import dead_once_rebound, is_flash_attn_function
from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
from mqa_byoc.compiler.graph.lowered_matmul import RestoreLoweredMatmul, has_lowered_nt_matmul
from mqa_byoc.compiler.graph.patterns import flash_attn_patterns
from mqa_byoc.compiler.graph.sink_attention import OffloadSinkAttention
from mqa_byoc.compiler.graph.site import (FUSED_FORMS, chunk_calls, chunked_note, require_flag, require_module,
                                          sequence_first_note, value_padding_note)
from mqa_byoc.compiler.graph.trace import Bindings
from mqa_byoc.compiler.graph.log_softmax import ExpOfLogSoftmax
from mqa_byoc.compiler.graph.views import CollapseViewChains, UnfoldMatmulRows

__all__ = [
    "AnnotateProvider",
    "CanonicalizeAttention",
    "OffloadSite",
    "canonicalize_attention",
    "offload_report",
    "partition_for_cutlass",
]


@dataclass
class OffloadSite:
    """One attention found in the module, as reported to the user."""

    function: str
    output: str  # name of the variable the attention result is bound to
    form: str
    offloaded: bool
    num_q_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    dtype: str | None
    causal: str | None  # "BottomRight" / "TopLeft" / None
    window: int | None
    scale: float | None
    expansion: str | None  # how K/V were expanded in the graph: repeat / broadcast / tile / None
    expansion_ops_removed: int
    composite: str | None
    reason: str | None  # why not offloaded; None when offloaded
    note: str | None = None  # e.g. why an expansion was kept although the site is offloaded
    provider: str | None = None  # the kernel provider the build will use (offloaded sites)
    kernel: str | None = None  # what the site runs on with that provider
    kernel_options: str | None = None  # the library's kernel choices (linked providers), see kernel_options.py
    softcap: float | None = None  # logit soft-cap c (scores = c * tanh(scores / c)); None: none
    head_dim_v: int | None = None  # V's head dim (``head_dim`` is Q's and K's); smaller: V is padded to head_dim
    chunk: int | None = None  # chunked attention: causal within blocks of this many key positions; None: not chunked
    composite_calls: int = 0  # composite calls the site becomes: 1, with ``chunk`` 1 to 3 (site.chunk_calls); 0: rejected

    def as_dict(self) -> dict:
        """Returns
        -------
        dict
            The fields as a plain dict (JSON-ready).
        """
        return asdict(self)


def _causal_name(site):
    if site.form in FUSED_FORMS and site.causal_attr is not None:
        return str(site.causal_attr)
    return "BottomRight" if site.mask.causal else None


def offload_report(mod: tvm.IRModule, mqa: bool = True, *, target=None, provider: str | None = None,
                   kernel_options=None, gemm: bool = False) -> list:
    """What :func:`partition_for_cutlass` would do with every attention in ``mod``.

    Parameters
    ----------
    mod : IRModule
        The module :func:`partition_for_cutlass` would get.
    mqa : bool
        As for :func:`partition_for_cutlass`.
    target, provider
        As for :func:`mqa_byoc.build`: each offloaded site then names its ``provider`` and ``kernel``
        (e.g. on an sm_90 target the hopper provider's FA4 kernel, or why a site stays on FA2).
        Without either, the provider of the default rule for ``Target.current()``.
    kernel_options
        As for :func:`mqa_byoc.build`: the ``kernel`` of each site says what runs with them, and
        ``kernel_options`` records them (sites of the linked providers).

    gemm : bool
        Append one :class:`~.graph.gemm.GemmSite` per matmul (what ``partition_for_cutlass(gemm=True)``
        runs on cuBLASLt and what stays on TVM, with the reason), read off the partitioned module.

    Returns
    -------
    list of OffloadSite (then GemmSite with ``gemm=True``)
        One entry per attention, computed by the same analysis the partition uses: ``offloaded``
        sites become ``composite`` functions, the others keep their original graph and say why in
        ``reason``.

    Raises
    ------
    TypeError
        When ``mod`` is not an IRModule.
    """
    report = []
    require_module(mod, "offload_report")
    mqa = require_flag(mqa, "offload_report(mqa=)")
    gemm = require_flag(gemm, "offload_report(gemm=)")
    if target is not None:
        from mqa_byoc.compiler.provider import cuda_target

        target = cuda_target(target, "offload_report", "what runs where is decided for the GPU the library is built for")
    # as the partition reads it
    mod = UnfoldMatmulRows()(CollapseViewChains()(ExpOfLogSoftmax()(RestoreLoweredMatmul()(mod))))
    from mqa_byoc.compiler.codegen import hopper as hopper_codegen
    from mqa_byoc.compiler.provider import build_provider, target_arch
    from mqa_byoc.compiler.kernel_options import KernelOptions

    chosen = build_provider(provider, target)
    arch = target_arch(target)
    options = KernelOptions.of(kernel_options)
    for gv, sites in analyze_module(mod, mqa).items():
        # what the rewrite of every offloaded site of the function leaves unread
        dead = dead_once_rebound(mod[gv], [s.root for s in sites if s.reason is None]) if mqa else set()
        for s in sites:
            ok = s.reason is None
            removes = mqa and ok and s.k is not None and s.k.expansion is not None
            expansion = set(s.expansion_ops) if removes else set()
            composite = None
            if ok:
                composite = composite_name(s.num_q_heads, s.num_kv_heads if mqa else s.num_q_heads,
                                           sinks=s.sinks is not None, softcap=s.softcap is not None)
                composite = varlen.COMPOSITE if s.form == varlen.FORM else composite
            report.append(OffloadSite(
                function=s.function, output=s.root.name, form=s.form, offloaded=ok,
                num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                dtype=s.dtype, causal=_causal_name(s), window=s.mask.window,
                scale=_resolved_scale(s), expansion=s.k.expansion if s.k is not None else None,
                expansion_ops_removed=len(expansion & dead),
                composite=composite, reason=s.reason, note=_note(s, ok, sorted(op.name for op in expansion - dead)),
                provider=chosen if ok else None,
                kernel=hopper_codegen.describe_kernel(
                    chosen, dtype=s.dtype, head_dim=s.head_dim, num_q_heads=s.num_q_heads,
                    num_kv_heads=s.num_kv_heads if mqa else s.num_q_heads, causal=bool(s.mask.causal),
                    window=s.mask.window, var_len=s.form == varlen.FORM, options=options,
                    sinks=s.sinks is not None, softcap=s.softcap is not None, arch=arch) if ok else None,
                kernel_options=options.describe() if ok and chosen != "python" else None,
                softcap=s.softcap, head_dim_v=s.head_dim_v, chunk=s.mask.chunk,
                composite_calls=(len(chunk_calls(s)) if s.mask.chunk is not None else 1) if ok else 0,
            ))
    report = varlen.explain_unlowerable(report)
    if gemm:
        from mqa_byoc.compiler.graph.gemm import gemm_report

        report = report + gemm_report(partition_for_cutlass(mod, mqa=mqa, gemm=False))
    return report


def _note(site, offloaded: bool, kept=()) -> str | None:
    """The site's note, and for an offloaded site whose V is padded or whose operands are sequence-first
    what that costs; ``kept``: the K/V expansion ops the rewritten graph still computes."""
    kept_note = (f"the graph still computes the K/V expansion ({', '.join(kept)}): something outside this "
                 "attention reads it or what it feeds (the scores, say); the kernel reads the K/V heads "
                 "natively") if kept else None
    parts = [getattr(site, "note", None), kept_note, value_padding_note(site) if offloaded else None,
             sequence_first_note(site) if offloaded else None, chunked_note(site) if offloaded else None]
    return "; ".join(p for p in parts if p) or None


def _resolved_scale(site):
    if site.scale is None and site.head_dim:
        return 1.0 / math.sqrt(site.head_dim)
    return site.scale


# ----------------------------------------------------------------------------- the public entry
@tvm.transform.module_pass(opt_level=0, name="AnnotateProvider")
class AnnotateProvider:
    """Module pass: record the kernel provider on every ``flash_attn`` function.

    Parameters
    ----------
    provider : "native" | "hopper" | "python" | None
        Stored as the function attribute :data:`mqa_byoc.contract.PROVIDER_ATTR`, which the codegen
        reads first; None leaves the module unchanged (the codegen's default rule decides).
    """

    def __init__(self, provider: str | None):
        self.provider = None if provider is None else check_provider(provider, "partition_for_cutlass(provider=)")

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if self.provider is None:
            return mod
        for gv, func in list(mod.functions.items()):
            if is_flash_attn_function(func):
                mod[gv] = func.with_attr(PROVIDER_ATTR, self.provider)
        return mod


def _mqa_switch(mqa: bool | None, use_flash_mqa: bool | None) -> bool:
    require_flag(mqa, "partition_for_cutlass(mqa=)", allow_none=True)
    require_flag(use_flash_mqa, "partition_for_cutlass(use_flash_mqa=)", allow_none=True)
    if mqa is not None and use_flash_mqa is not None and bool(mqa) != bool(use_flash_mqa):
        raise ValueError(f"partition_for_cutlass: mqa={mqa!r} and use_flash_mqa={use_flash_mqa!r} disagree; they "
                         "are the same switch (use_flash_mqa is upstream TVM's name): pass one of them")
    chosen = mqa if mqa is not None else use_flash_mqa
    return True if chosen is None else bool(chosen)


def partition_for_cutlass(
    mod: tvm.IRModule,
    mqa: bool | None = None,
    annotate_codegen: bool = True,
    provider: str | None = None,
    bind_constants: bool = False,
    gemm: bool = True,
    *,
    use_flash_mqa: bool | None = None,
) -> tvm.IRModule:
    """Partition ``mod`` so that attention runs in Flash Attention v2 and GEMMs on cuBLASLt.

    The passes, in a ``tvm.transform.Sequential`` like upstream's CUTLASS partition:
    :class:`~mqa_byoc.compiler.graph.lowered_matmul.RestoreLoweredMatmul`,
    :class:`~mqa_byoc.compiler.graph.dataflow.EnterDataflow`, :class:`CanonicalizeAttention` (view chains
    collapsed first, :mod:`~mqa_byoc.compiler.graph.views`), ``FuseOpsByPattern`` with :func:`flash_attn_patterns`,
    :class:`OffloadSinkAttention`, :class:`AnnotateProvider`, :class:`LegalizeGroupedAttention`, then
    (``gemm=True``) :class:`~mqa_byoc.compiler.graph.gemm.PartitionGemm`.

    Parameters
    ----------
    mod : IRModule
        Any Relax module; attention may be ``R.nn.attention`` or an explicit matmul/softmax chain,
        with K/V expanded by repeat / broadcast_to / expand_dims+broadcast_to+reshape, or not.
    mqa : bool, default True
        True: K/V expansions are removed and FA2 gets the K/V heads natively
        (``flash_attn.attention_mqa``). False (the A/B baseline): expansions stay in the graph and
        attention is offloaded on the expanded K/V as plain MHA (``flash_attn.attention``).
    annotate_codegen : bool
        Wrap each composite in a function with ``Codegen="flash_attn"`` for ``RunCodegen``.
    provider : "native" | "hopper" | "python" | None
        Kernel provider recorded on each offloaded function (see :mod:`mqa_byoc.compiler.provider`);
        None leaves the choice to the codegen's default rule.
    bind_constants : bool
        Passed to the attention's ``FuseOpsByPattern`` (GEMM composites always take their weight as a
        parameter).
    gemm : bool
        Also offload the matmul sites with a 2-D or batched weight (nn.Linear and friends, with bias / relu /
        gelu_tanh / residual epilogues) to cuBLASLt (``cublaslt.*`` composites, ``Codegen="cublaslt"``),
        like upstream's partition offloads matmuls to CUTLASS, static decode rows too (the measured choice,
        docs/gemm.md). :func:`mqa_byoc.compiler.graph.gemm.gemm_report` (or ``offload_report(..., gemm=True)``)
        says what each GEMM runs on and why. False: attention only.
    use_flash_mqa : bool, optional
        Upstream TVM's name of the same switch (``tvm.relax.backend.cuda.cutlass.partition_for_cutlass``);
        give ``mqa`` or ``use_flash_mqa``, or both with the same value.

    Returns
    -------
    IRModule
        The partitioned module. Sites FA2 would compute differently are left unchanged
        (:func:`offload_report` says why); attention left with fewer K/V heads than query heads is
        made correct for TVM's own lowering.

    Raises
    ------
    TypeError
        When ``mod`` is not an IRModule.
    ValueError
        For an unknown ``provider``, or ``mqa`` and ``use_flash_mqa`` that disagree.
    """
    from mqa_byoc.compiler.codegen import cublaslt, dispatch  # noqa: F401 - register relax.ext.cublaslt, .flash_attn

    mqa = _mqa_switch(mqa, use_flash_mqa)
    for flag, name in ((annotate_codegen, "annotate_codegen"), (bind_constants, "bind_constants"), (gemm, "gemm")):
        require_flag(flag, f"partition_for_cutlass({name}=)")

    require_module(mod, "partition_for_cutlass")
    # the pattern check sees one call, not its function: it gets the match_cast length facts of
    # the module's functions (shape variables are unique per function) in its closure
    facts = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            facts.update(Bindings(func).length_facts)
    passes = [
        RestoreLoweredMatmul(),
        EnterDataflow(),
        CanonicalizeAttention(mqa=mqa),
        relax.transform.FuseOpsByPattern(flash_attn_patterns(length_facts=facts), bind_constants=bind_constants,
                                         annotate_codegen=annotate_codegen),
        OffloadSinkAttention(annotate_codegen),
        AnnotateProvider(provider if annotate_codegen else None),
        LegalizeGroupedAttention(),
    ]
    if gemm:
        from mqa_byoc.compiler.graph.gemm import PartitionGemm

        # after the attention, whose offloaded matmuls (batched products) are then no longer in the graph
        passes.append(PartitionGemm(annotate_codegen=annotate_codegen))
    if has_lowered_nt_matmul(mod):
        # the module had been through FuseTransposeMatmul: what neither offload took becomes NT_matmul again
        passes.append(relax.transform.FuseTransposeMatmul())
    return tvm.transform.Sequential(passes, name="PartitionForFlashAttention")(mod)
