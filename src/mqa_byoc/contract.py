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
#: Attention with a learned sink logit per query head (GPT-OSS): a 4th operand ``sinks`` (H,), float32 or
#: the model's dtype; fewer K/V heads than query heads, and as many.
COMPOSITE_MQA_SINK = "flash_attn.attention_mqa_sink"
COMPOSITE_MHA_SINK = "flash_attn.attention_sink"
SINK_COMPOSITES = (COMPOSITE_MQA_SINK, COMPOSITE_MHA_SINK)
#: Attention with logit soft-capping (Gemma 2: scores = c * tanh(scores / c) before the mask and softmax):
#: operands (q, k, v), the cap c in :data:`SOFTCAP_ATTR`; fewer K/V heads than query heads, and as many.
COMPOSITE_MQA_SOFTCAP = "flash_attn.attention_mqa_softcap"
COMPOSITE_MHA_SOFTCAP = "flash_attn.attention_softcap"
SOFTCAP_COMPOSITES = (COMPOSITE_MQA_SOFTCAP, COMPOSITE_MHA_SOFTCAP)
#: The composites whose attention is a function of its own (its body the reference computation).
FUNCTION_COMPOSITES = SINK_COMPOSITES + SOFTCAP_COMPOSITES
#: Every composite name the codegen accepts; a new composite is added here and in the pattern table.
COMPOSITES = ATTENTION_COMPOSITES + (COMPOSITE_VAR_LEN,) + FUNCTION_COMPOSITES
#: Function attribute of an attention that is a function of its own (sinks or soft-capping; its value: the
#: composite name) before and after the partition; its mask and scale are the attributes below (the body is
#: the reference computation).
SINK_ATTR = "mqa_byoc.attention_sinks"
#: The soft-cap c of a soft-capped attention's function (float64; absent: no soft-capping).
SOFTCAP_ATTR = "mqa_byoc.softcap"
SINK_SCALE_ATTR = "mqa_byoc.scale"
SINK_CAUSAL_ATTR = "mqa_byoc.causal"
SINK_WINDOW_ATTR = "mqa_byoc.window"  # keys a row sees including its own, 0: no window
SINK_LAYOUTS_ATTR = "mqa_byoc.layouts"  # "q,k,v" layouts (BSNH / BNSH); the output is BSNH

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
#: Global function the python provider's sink-attention forwarders call (``mqa_byoc.runtime.providers``).
PY_SINK_FORWARD_FUNC = "mqa_byoc.flash_attn_sink_forward"
#: Global function the python provider's soft-capped attention forwarders call (``mqa_byoc.runtime.providers``).
PY_SOFTCAP_FORWARD_FUNC = "mqa_byoc.flash_attn_softcap_forward"


def composite_name(num_q_heads: int, num_kv_heads: int, sinks: bool = False, softcap: bool = False) -> str:
    """The composite an attention with these head counts is offloaded as.

    Returns
    -------
    str
        :data:`COMPOSITE_MQA` when K/V have fewer heads than the query, else :data:`COMPOSITE_MHA`;
        with ``sinks`` :data:`COMPOSITE_MQA_SINK` / :data:`COMPOSITE_MHA_SINK`; with ``softcap``
        :data:`COMPOSITE_MQA_SOFTCAP` / :data:`COMPOSITE_MHA_SOFTCAP`.

    Raises
    ------
    ValueError
        For sinks together with soft-capping (no composite computes both).
    """
    if sinks and softcap:
        raise ValueError("no composite computes attention sinks together with soft-capping")
    if softcap:
        return COMPOSITE_MQA_SOFTCAP if num_kv_heads != num_q_heads else COMPOSITE_MHA_SOFTCAP
    if sinks:
        return COMPOSITE_MQA_SINK if num_kv_heads != num_q_heads else COMPOSITE_MHA_SINK
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


# ----------------------------------------------------------------------------- GEMMs (cuBLASLt)
#: ``Codegen`` attribute of the offloaded GEMMs; ``RunCodegen`` calls ``relax.ext.<GEMM_CODEGEN>``.
GEMM_CODEGEN = "cublaslt"
#: The epilogues cuBLASLt applies to ``A @ B + bias`` (``CUBLASLT_EPILOGUE_{BIAS,RELU_BIAS,GELU_BIAS}``).
#: cuBLASLt's GELU is the tanh approximation, so only ``R.nn.gelu_tanh`` is fused; silu has no epilogue.
GEMM_ACTIVATIONS = {"relu": "relax.nn.relu", "gelu_tanh": "relax.nn.gelu_tanh"}


def gemm_composite_name(transposed: bool, bias: bool, activation: str | None = None,
                        residual: bool = False, cast: bool = False) -> str:
    """The composite of a GEMM site: ``cublaslt.matmul[_transposed][_bias[_<activation>]][_residual][_cast]``.

    ``transposed``: the weight is given as (N, K) (``R.matmul(x, R.permute_dims(w))``, nn.Linear);
    ``activation``: a key of :data:`GEMM_ACTIVATIONS` (needs ``bias``); ``residual``: ``+ r`` with ``r``
    of the output's shape, added by cuBLASLt as ``beta * C`` with beta = 1 (not with an activation,
    which cuBLASLt would apply after the sum); ``cast``: ``R.astype`` of a float32 matmul result to the
    operands' type right after the matmul (what ``ToMixedPrecision``'s default ``out_dtype`` makes):
    cuBLASLt accumulates in float32 and writes the operands' type, rounding once, as the cast does.

    Raises
    ------
    ValueError
        For a combination cuBLASLt does not compute in one call.
    """
    if activation is not None and (activation not in GEMM_ACTIVATIONS or not bias or residual):
        raise ValueError(f"no cuBLASLt epilogue for activation={activation!r}, bias={bias}, residual={residual}")
    if cast and (bias or residual):
        raise ValueError("the cast is fused only right after the matmul (no bias or residual before it)")
    return (f"{GEMM_CODEGEN}.matmul" + ("_transposed" if transposed else "") + ("_bias" if bias else "")
            + (f"_{activation}" if activation else "") + ("_residual" if residual else "") + ("_cast" if cast else ""))


#: (bias, activation, residual, cast) of each epilogue form, largest pattern first.
GEMM_EPILOGUE_FORMS = ((True, None, True, False), (True, "gelu_tanh", False, False), (True, "relu", False, False),
                       (True, None, False, False), (False, None, True, False), (False, None, False, True),
                       (False, None, False, False))
#: Every GEMM composite, largest pattern first (the order of the pattern table).
GEMM_COMPOSITES = tuple(gemm_composite_name(t, *form) for t in (True, False) for form in GEMM_EPILOGUE_FORMS)


def parse_gemm_composite(name: str) -> dict:
    """The fields of :func:`gemm_composite_name` read back from ``name``.

    Raises
    ------
    ValueError
        When ``name`` is not one of :data:`GEMM_COMPOSITES`.
    """
    for t in (True, False):
        for b, a, r, c in GEMM_EPILOGUE_FORMS:
            if gemm_composite_name(t, b, a, r, c) == name:
                return {"transposed": t, "bias": b, "activation": a, "residual": r, "cast": c}
    raise ValueError(f"unknown GEMM composite {name!r}; expected one of {GEMM_COMPOSITES}")
