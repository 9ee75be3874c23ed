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

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @staticmethod
    def default_scale(head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)


def spec_from_composite(func) -> AttentionSpec:
    """Read an :class:`AttentionSpec` off a ``flash_attn.*`` composite (see docs/design.md)."""
    from tvm import relax  # compile time only

    call = func.body.blocks[0].bindings[-1].value if func.body.blocks else func.body.body
    if not (isinstance(call, relax.Call) and call.op.name == "relax.nn.attention"):
        # the composite body is `R.nn.attention(...)`, possibly returned directly
        call = func.body.body
    if isinstance(call, relax.Var):
        call = _binding_of(func, call)
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", "") == "relax.nn.attention"):
        raise ValueError(f"composite body is not a single R.nn.attention call:\n{func}")
    q, k, v = (a.ty for a in call.args[:3])
    _, _, h, d = (int(x) for x in _static(q.shape.values, "q"))
    _, _, hkv, dk = (int(x) for x in _static(k.shape.values, "k"))
    dv = int(v.shape.values[3])
    if dk != d:
        raise ValueError(f"q head dim {d} != k head dim {dk}")
    attrs = call.attrs
    scale = float(attrs.scale.value) if attrs.scale is not None else AttentionSpec.default_scale(d)
    causal = attrs.causal_mask is not None
    window = attrs.window_size
    wl, wr = (-1, -1) if window is None else (int(window) - 1, 0)
    return AttentionSpec(h, hkv, d, dv, str(q.dtype), scale, causal, wl, wr)


def _static(values, what):
    from tvm import tirx

    out = list(values)
    for i in (2, 3):
        if not isinstance(out[i], tirx.IntImm):
            raise ValueError(f"{what}: heads and head dim must be static, got shape {out}")
    return [int(x) if isinstance(x, tirx.IntImm) else 0 for x in out]


def _binding_of(func, var):
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var.same_as(var):
                return b.value
    return None
