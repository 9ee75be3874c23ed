"""Decoder shapes of real GQA / MQA models, and a helper to shrink them for tests.

The presets carry the *real* attention shapes (query heads, K/V heads, head dim), which is what
the partitioner and the FA2 kernels care about. :func:`scaled` keeps those and shrinks everything
else (depth, vocabulary, hidden and MLP width) so that a test or a benchmark can build the model
without tens of GB of random weights.

Presets (real shapes; H = query heads, H_kv = K/V heads, D = head dim):

=============  ====  ====  ===  ======  =====  ======  ======  ==========  ======
name           H     H_kv  D    hidden  inter  vocab   layers  rope_theta  window
=============  ====  ====  ===  ======  =====  ======  ======  ==========  ======
llama2-70b     64    8     128  8192    28672  32000   80      1e4         -
codellama-34b  64    8     128  8192    22016  32000   48      1e6         -
llama3-8b      32    8     128  4096    14336  128256  32      5e5         -
mistral-7b     32    8     128  4096    14336  32000   32      1e4         4096
falcon-7b-mqa  71    1     64   4544    18176  65024   32      1e4         -
=============  ====  ====  ===  ======  =====  ======  ======  ==========  ======

falcon-7b-mqa is multi-query attention (one K/V head shared by 71 query heads). We build it with the
Llama block structure (RMSNorm, SwiGLU MLP, sequential residuals) and Falcon's attention shapes;
Falcon's real block (parallel attention + MLP, LayerNorm, GELU) is not reproduced, which does not
change the attention subgraph that the partitioner and FA2 see.

This module needs nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderConfig:
    """Shapes of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    ``hidden_size`` need not equal ``num_heads * head_dim``: the q/o projections map between the
    two (that is what lets :func:`scaled` shrink the width while keeping the attention shapes).

    ``sliding_window``: None, or w >= 1 — each query sees the w most recent keys including
    itself (Mistral; FA2 ``window_left = w - 1``).

    ``max_layers_default``: how many layers the demo and the benchmarks build unless told
    otherwise; full depth with random weights is tens of GB (llama2-70b does not fit one GPU
    in fp16).

    ``fused_projections``: the graph form of the projections, not a shape. True (default, the form
    of mlc-llm's and TVM ``nn.llm``'s Llama): one ``qkv_proj`` Linear (out ``q_size + 2 * kv_size``)
    split into q, k, v and one ``gate_up_proj`` (out ``2 * intermediate_size``) split into gate and
    up: two matmuls per layer where the separate form has five. False: Hugging Face's separate
    ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``.
    """

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    sliding_window: int | None = None
    max_layers_default: int = 4
    fused_projections: bool = True

    def __post_init__(self):
        for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                      "num_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{self.name}: {field} must be an integer of at least 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: RoPE needs an even head_dim, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.name}: sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (r = H / H_kv); query head h uses K/V head h // r."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_mqa(self) -> bool:
        return self.num_kv_heads == 1

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)


LLAMA2_70B = DecoderConfig(
    name="llama2-70b",
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=32000,
    num_layers=80,
    rope_theta=10000.0,
    rms_eps=1e-5,
    max_layers_default=4,
)

CODELLAMA_34B = DecoderConfig(
    name="codellama-34b",
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=22016,
    vocab_size=32000,
    num_layers=48,
    rope_theta=1e6,
    rms_eps=1e-5,
    max_layers_default=4,
)

LLAMA3_8B = DecoderConfig(
    name="llama3-8b",
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    num_layers=32,
    rope_theta=5e5,
    rms_eps=1e-5,
    max_layers_default=8,
)

MISTRAL_7B = DecoderConfig(
    name="mistral-7b",
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=32000,
    num_layers=32,
    rope_theta=10000.0,
    rms_eps=1e-5,
    sliding_window=4096,
    max_layers_default=8,
)

FALCON_7B_MQA = DecoderConfig(
    name="falcon-7b-mqa",
    hidden_size=4544,
    num_heads=71,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=18176,
    vocab_size=65024,
    num_layers=32,
    rope_theta=10000.0,
    rms_eps=1e-5,
    max_layers_default=8,
)

#: Falcon-7B's attention shapes (71 query heads, a single K/V head, D = 64: multi-query attention)
#: with its hidden / MLP / vocabulary sizes. The real Falcon block differs (parallel attention and
#: MLP, LayerNorm, GELU MLP); we build it with the Llama block structure, which does not
#: change the attention subgraph the partitioner sees.
FALCON_NOTE = (
    "falcon-7b-mqa: real attention shapes (71 heads, 1 K/V head, D 64) on the Llama block "
    "structure (RMSNorm, SwiGLU, sequential residual); Falcon's parallel LayerNorm/GELU block "
    "is not reproduced."
)

PRESETS: dict[str, DecoderConfig] = {
    c.name: c for c in (LLAMA2_70B, CODELLAMA_34B, LLAMA3_8B, MISTRAL_7B, FALCON_7B_MQA)
}


def attention_shapes() -> set[tuple[int, int]]:
    """``{(head dim, query heads per K/V head)}`` of the presets' attention: what
    ``mqa-byoc build-kernels --hopper`` builds by default."""
    return {(c.head_dim, c.num_heads // c.num_kv_heads) for c in PRESETS.values()}


def get_preset(name: str) -> DecoderConfig:
    """The preset called ``name`` (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def scaled(
    config: DecoderConfig | str,
    *,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    sliding_window: int | None | bool = True,
    name: str | None = None,
) -> DecoderConfig:
    """A smaller copy of ``config`` that keeps its attention shapes (H, H_kv, D) and RoPE.

    Each size keyword that is given replaces the field; ``None`` keeps it. ``sliding_window``: True
    (default) keeps the preset's window, False or None drops it, an int replaces it. ``name`` defaults to
    ``"<name>-scaled"``.

    Example — a two-layer llama2-70b attention stack that builds in a second::

        scaled("llama2-70b", num_layers=2, vocab_size=512, hidden_size=256, intermediate_size=512)
    """
    if isinstance(config, str):
        config = get_preset(config)
    changes = {
        k: v
        for k, v in dict(
            num_layers=num_layers,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
        ).items()
        if v is not None
    }
    if sliding_window is False or sliding_window is None:
        changes["sliding_window"] = None
    elif sliding_window is not True:
        changes["sliding_window"] = sliding_window
    changes["name"] = name or f"{config.name}-scaled"
    changes["max_layers_default"] = min(
        config.max_layers_default, changes.get("num_layers", config.num_layers)
    )
    return dataclasses.replace(config, **changes)
