"""Names shared by the partition, the codegen and the runtime: the composite contract's spelling.

Each name is written here once (docs/design.md, "The composite contract"). This module imports
nothing, so that the run-time packages can use it without TVM's compiler.
"""

from __future__ import annotations

#: ``Codegen`` attribute of the offloaded functions; ``RunCodegen`` calls ``relax.ext.<CODEGEN>``.
CODEGEN = "flash_attn"
#: The composite for attention whose K/V have fewer heads than the query (MQA / GQA).
COMPOSITE_MQA = "flash_attn.attention_mqa"
#: The composite for plain multi-head attention (as many K/V heads as query heads).
COMPOSITE_MHA = "flash_attn.attention"
#: The composites of fixed-length attention (``R.nn.attention``), one pattern check decides between them.
ATTENTION_COMPOSITES = (COMPOSITE_MQA, COMPOSITE_MHA)
#: The composite for ``R.nn.attention_var_len`` (FA2's var-len forward, any K/V head count).
COMPOSITE_VAR_LEN = "flash_attn.attention_var_len"
#: Every composite name the codegen accepts; a new composite is added here and in the pattern table.
COMPOSITES = ATTENTION_COMPOSITES + (COMPOSITE_VAR_LEN,)

#: Kernel providers of the codegen (the rule: :mod:`mqa_byoc.compiler.provider`): "native" links FA2,
#: "hopper" links FA4's sm90 kernel for prefill and FA2 for decode, "python" calls a registered function.
PROVIDERS = ("native", "hopper", "python")
#: The providers whose kernels are linked into the exported library.
LINKED_PROVIDERS = ("native", "hopper")
#: Function attribute recording the provider chosen at partition time.
PROVIDER_ATTR = "mqa_byoc.provider"
#: Global function the python provider's forwarders call (registered by ``mqa_byoc.runtime.providers``).
PY_FORWARD_FUNC = "mqa_byoc.flash_attn_forward"
#: Global function the python provider's var-len forwarders call (``mqa_byoc.runtime.varlen_provider``).
PY_VAR_LEN_FORWARD_FUNC = "mqa_byoc.flash_attn_varlen_forward"


def composite_name(num_q_heads: int, num_kv_heads: int) -> str:
    """The composite an attention with these head counts is offloaded as.

    Returns
    -------
    str
        :data:`COMPOSITE_MQA` when K/V have fewer heads than the query, else :data:`COMPOSITE_MHA`.
    """
    return COMPOSITE_MQA if num_kv_heads != num_q_heads else COMPOSITE_MHA


def check_provider(provider, where: str, allow_auto: bool = False) -> str:
    """Normalize a provider name; ``where`` names the setting in the error.

    Returns
    -------
    str
        One of :data:`PROVIDERS` (or ``"auto"`` when ``allow_auto``).

    Raises
    ------
    ValueError
        For any other value.
    """
    allowed = PROVIDERS + (("auto",) if allow_auto else ())
    name = str(provider).strip().lower()
    if name not in allowed:
        raise ValueError(f"{where}: unknown flash_attn provider {provider!r}; expected one of {allowed}")
    return name
