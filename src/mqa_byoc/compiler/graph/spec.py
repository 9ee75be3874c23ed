"""What the codegen needs to know about one offloaded attention, read off its composite function."""

from __future__ import annotations

import math
from dataclasses import dataclass

# FA2 forward kernels exist for these dtypes only.
SUPPORTED_DTYPES = ("float16", "bfloat16")
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionSpec:
    """Static parameters of one FA2 forward call; B, S_q and S_kv are read at run time."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str  # "float16" | "bfloat16"
    scale: float  # softmax scale, already resolved (1/sqrt(D) when the graph gave none)
    causal: bool  # FA2 causal: bottom-right aligned
    window_left: int = -1  # -1: unbounded
    window_right: int = -1
    # Memory layout of each composite parameter / of the output: "BSNH" (FA2's own) or "BNSH".
    # A BNSH tensor reaches FA2 as strides, so no transpose kernel copies K/V.
    q_layout: str = "BSNH"
    k_layout: str = "BSNH"
    v_layout: str = "BSNH"
    out_layout: str = "BSNH"
    # attention with sinks: the dtype of the 4th operand, one logit per query head (H,); None: no sinks
    sinks_dtype: str | None = None
    # logit soft-capping: scores = softcap * tanh(qk * scale / softcap) before mask and softmax; 0: none
    softcap: float = 0.0

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @staticmethod
    def default_scale(head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)


def spec_from_composite(func) -> AttentionSpec:
    """Read an :class:`AttentionSpec` off a ``flash_attn.*`` composite (see docs/design.md).

    Returns
    -------
    AttentionSpec
        What :func:`read_composite` reads, without the operand positions.
    """
    return read_composite(func)[0]


def read_composite(func) -> tuple[AttentionSpec, tuple[int, int, int]]:
    """Walk a ``flash_attn.*`` composite once: its attention parameters and where q, k, v come in.

    The composite body is ``R.nn.attention`` on BSNH operands; an operand may be
    ``permute_dims(param, [0, 2, 1, 3])`` (a BNSH parameter) and the result may be permuted
    the same way (a BNSH output).

    Returns
    -------
    spec : AttentionSpec
        Heads, head dim, dtype, scale, mask and the layout of each operand and of the output.
    operand_params : tuple of int
        For q, k, v: the index of the composite parameter each one is. ``FuseOpsByPattern`` orders
        parameters by first use and passes an operand used twice once, so this is not always (0, 1, 2).

    Raises
    ------
    ValueError
        When the body is not one such attention, or FA2 cannot compute it.
    """
    from tvm import relax  # compile time only

    from mqa_byoc.compiler.graph.exprs import binding_values, op_name, value_of

    if not isinstance(func, relax.Function):
        raise ValueError(f"expected a flash_attn.* composite relax.Function, got {type(func).__name__}")
    values = binding_values(func)
    out_layout = "BSNH"
    call = value_of(func.body.body, values)
    if op_name(call) == "relax.permute_dims":
        _require_swap_13(call)
        out_layout = "BNSH"
        call = value_of(call.args[0], values)
    if op_name(call) != "relax.nn.attention":
        raise ValueError(f"composite body is not a single R.nn.attention call:\n{func}")

    layouts, operand_params = [], []
    params = list(func.params)
    for name, arg in zip("qkv", call.args[:3]):
        a = value_of(arg, values)
        layouts.append("BSNH")
        if op_name(a) == "relax.permute_dims":
            _require_swap_13(a)
            layouts[-1] = "BNSH"
            a = a.args[0]
        index = next((j for j, p in enumerate(params) if p.same_as(a)), None)
        if index is None:
            raise ValueError(f"attention operand {name} is `{arg}`, not a composite parameter "
                             "(optionally through permute_dims)")
        operand_params.append(index)
    q, k, v = (a.ty for a in call.args[:3])
    _, _, h, d = static_shape(q, "q")
    _, _, hkv, dk = static_shape(k, "k")
    _, _, hv, dv = static_shape(v, "v")
    dtypes = [str(t.dtype) for t in (q, k, v)]
    if len(set(dtypes)) != 1:
        raise ValueError(f"q, k, v dtypes differ: {dtypes}; FA2 needs one dtype")
    dtype = dtypes[0]
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by FA2 (supported: {', '.join(SUPPORTED_DTYPES)})")
    if dk != d or dv != d:
        raise ValueError(f"head dims differ: q {d}, k {dk}, v {dv}; FA2 needs one head dim")
    if d > MAX_HEAD_DIM or d % 8 != 0:
        raise ValueError(f"head dim {d} is not supported by FA2 (needs D <= {MAX_HEAD_DIM} and D % 8 == 0)")
    if hv != hkv:
        raise ValueError(f"k has {hkv} heads but v has {hv}")
    if hkv < 1 or hkv > h or h % hkv != 0:
        raise ValueError(f"{h} query heads cannot share {hkv} K/V heads (need H % H_kv == 0, H_kv <= H)")
    attrs = call.attrs
    scale = float(attrs.scale.value) if attrs.scale is not None else AttentionSpec.default_scale(d)
    causal = attrs.causal_mask is not None
    window = attrs.window_size
    if window is not None and int(window) < 1:
        raise ValueError(f"window_size must be >= 1, got {int(window)}")
    wl, wr = (-1, -1) if window is None else (int(window) - 1, 0)
    spec = AttentionSpec(h, hkv, d, dv, dtype, scale, causal, wl, wr, *layouts, out_layout)
    return spec, tuple(operand_params)


def _require_swap_13(call):
    axes = [int(a) for a in call.attrs.axes] if call.attrs.axes is not None else None
    if axes != [0, 2, 1, 3]:
        raise ValueError(f"composite permutes with axes {axes}; only [0, 2, 1, 3] is a layout change")


def static_shape(ty, what):
    """The 4-D BSNH shape of a tensor type with static heads and head dim (None for a symbolic
    batch or length); ValueError naming ``what`` otherwise."""
    from tvm import relax, tirx

    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        raise ValueError(f"{what}: needs a tensor type with a known shape, got {ty}")
    out = list(ty.shape.values)
    if len(out) != 4:
        raise ValueError(f"{what}: must be 4-D BSNH, got shape {out}")
    for i in (2, 3):
        if not isinstance(out[i], tirx.IntImm):
            raise ValueError(f"{what}: heads and head dim must be static, got shape {out}")
    return [int(x) if isinstance(x, tirx.IntImm) else None for x in out]
