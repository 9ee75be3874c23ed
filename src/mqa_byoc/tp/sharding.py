"""Tensor-parallel sharding of the Llama-family decoders: per-shard shapes and per-shard weights.

Megatron-style, as mlc-llm shards Llama: each of N shards (``tensor_parallel_shards``) holds

- column-parallel projections: the rows of q/k/v (or the fused ``qkv_proj``) of its heads and the rows
  of gate/up (or the fused ``gate_up_proj``) of its slice of the MLP width;
- row-parallel projections: the columns of ``o_proj`` and ``down_proj`` (the paged decoder: ``down``)
  for the same heads / MLP slice; their outputs are partial sums, added across shards by an all-reduce
  (``op.ccl_allreduce``, i.e. ``R.call_dps_packed("runtime.disco.allreduce", ...)``) right after each;
- everything else whole: embeddings, RMSNorm weights, the LM head (every shard computes the same
  logits).

Heads are cut so that each shard keeps whole K/V groups: shard r has query heads
``[r * H / N, (r + 1) * H / N)`` and K/V heads ``[r * H_kv / N, (r + 1) * H_kv / N)``, which are exactly
the K/V heads its query heads read (query head h reads K/V head ``h // (H / H_kv)``). So the attention of
every shard is the model's GQA with ``H / N`` query and ``H_kv / N`` K/V heads, offloaded with native K/V
heads like the unsharded one (llama2-70b: 64/8 -> 32/4 at N=2, 16/2 at N=4, 8/1 at N=8: MQA per shard).

``H_kv < N`` (e.g. 4 K/V heads on 8 shards) is rejected with :class:`ShardingError`: mlc-llm instead
replicates K/V heads so that several shards hold copies of one; we do not (a replicated K/V head costs
its cache and its projection on every shard that holds it, and the offload works unchanged on the
shards' graphs once a model is built that way). Use N <= H_kv.

The graph of every shard is the same (SPMD); only the weights differ (:func:`shard_params`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the shard counts the presets are built and tested for
TP_SHARDS = (1, 2, 4, 8)


class ShardingError(ValueError):
    """A model cannot be cut into the asked number of shards; the message says which size and the fix."""


@dataclass(frozen=True)
class ShardPlan:
    """What is cut, and by how much: the full model's head counts, head dim and MLP width, and N."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    shards: int
    name: str = "model"

    def __post_init__(self):
        n = self.shards
        if not isinstance(n, int) or n < 1:
            raise ShardingError(f"{self.name}: tensor_parallel_shards must be an int >= 1, got {n!r}")
        if self.num_kv_heads < n:
            raise ShardingError(
                f"{self.name}: {self.num_kv_heads} K/V heads cannot be split over {n} shards (each shard "
                f"must keep whole K/V groups; K/V heads are not replicated): use tensor_parallel_shards "
                f"<= {self.num_kv_heads}, a divisor of {self.num_kv_heads}")
        for what, size in (("K/V heads", self.num_kv_heads), ("query heads", self.num_heads),
                           ("MLP width (intermediate_size)", self.intermediate_size)):
            if size % n:
                ok = [d for d in TP_SHARDS if d <= self.num_kv_heads and not self.num_kv_heads % d
                      and not self.num_heads % d and not self.intermediate_size % d]
                raise ShardingError(f"{self.name}: {what} {size} is not a multiple of tensor_parallel_shards "
                                    f"{n}; shard counts that divide this model: {ok}")

    @property
    def heads(self) -> int:
        """Query heads per shard."""
        return self.num_heads // self.shards

    @property
    def kv_heads(self) -> int:
        """K/V heads per shard."""
        return self.num_kv_heads // self.shards

    @property
    def inter(self) -> int:
        """MLP width per shard."""
        return self.intermediate_size // self.shards


def plan_for(config, shards: int) -> ShardPlan:
    """The :class:`ShardPlan` of a :class:`~mqa_byoc.models.presets.DecoderConfig` or a
    :class:`~mqa_byoc.models.paged_llama.PagedLlamaConfig` cut into ``shards``.

    Raises
    ------
    ShardingError
        The model cannot be cut so (see the module docstring).
    """
    if hasattr(config, "num_q_heads"):  # PagedLlamaConfig
        return ShardPlan(config.num_q_heads, config.num_kv_heads, config.head_dim, config.intermediate,
                         shards, "paged-llama")
    return ShardPlan(config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                     shards, config.name)


def shard_config(config, shards: int):
    """The config one shard is built with: query / K/V heads and MLP width divided by ``shards``, the rest
    (hidden size, vocabulary, depth, RoPE) unchanged. ``shards == 1`` returns ``config`` itself.

    Raises
    ------
    ShardingError
        As :func:`plan_for`.
    """
    p = plan_for(config, shards)
    if shards == 1:
        return config
    if hasattr(config, "num_q_heads"):
        import dataclasses

        return dataclasses.replace(config, num_q_heads=p.heads, num_kv_heads=p.kv_heads, intermediate=p.inter)
    return config.replace(num_heads=p.heads, num_kv_heads=p.kv_heads, intermediate_size=p.inter,
                          name=f"{config.name}-tp{shards}")


# ------------------------------------------------------------------------------------------ weights

def _rows(x, start, stop):
    return x[start:stop]


def _heads_rows(x, first, count, d):
    return x[first * d:(first + count) * d]


#: the projections cut per shard (the last-but-one part of a weight's name): column-parallel, row-parallel
COLUMN_PARALLEL = ("qkv_proj", "q_proj", "k_proj", "v_proj", "gate_up_proj", "gate_up", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj", "down")


def is_sharded(name: str) -> bool:
    """Whether the weight ``name`` is cut per shard (else every shard holds it whole)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in COLUMN_PARALLEL + ROW_PARALLEL


def shard_weight(name: str, weight: np.ndarray, plan: ShardPlan, rank: int) -> np.ndarray:
    """Shard ``rank``'s part of one full weight (``nn.Linear`` layout: ``(out, in)``), by its name's last
    two parts (see the module docstring); weights of no projection are returned whole."""
    if not 0 <= rank < plan.shards:
        raise ShardingError(f"rank {rank} is not in [0, {plan.shards})")
    if plan.shards == 1:
        return weight
    d, h, g, i = plan.head_dim, plan.heads, plan.kv_heads, plan.inter
    q_first, kv_first = rank * h, rank * g
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else name
    x = np.asarray(weight)
    q_rows = plan.num_heads * d
    kv_rows = plan.num_kv_heads * d
    if proj == "qkv_proj":
        q, k, v = x[:q_rows], x[q_rows:q_rows + kv_rows], x[q_rows + kv_rows:]
        return np.concatenate([_heads_rows(q, q_first, h, d), _heads_rows(k, kv_first, g, d),
                               _heads_rows(v, kv_first, g, d)])
    if proj == "q_proj":
        return _heads_rows(x, q_first, h, d)
    if proj in ("k_proj", "v_proj"):
        return _heads_rows(x, kv_first, g, d)
    if proj == "o_proj":
        return x[:, q_first * d:(q_first + h) * d]
    if proj in ("gate_up_proj", "gate_up"):
        full = plan.intermediate_size
        return np.concatenate([x[rank * i:(rank + 1) * i], x[full + rank * i:full + (rank + 1) * i]])
    if proj in ("gate_proj", "up_proj"):
        return _rows(x, rank * i, (rank + 1) * i)
    if proj in ("down_proj", "down"):
        return x[:, rank * i:(rank + 1) * i]
    return x


def shard_params(names: Sequence[str], weights: Sequence[np.ndarray], plan: ShardPlan, rank: int,
                 expect: Sequence | None = None) -> list[np.ndarray]:
    """Shard ``rank``'s weights, in order, from the full model's (``names`` and ``weights`` in the full
    build's parameter order, which is the shard build's). ``expect``: the shard build's parameter spec
    (objects with ``name`` and ``shape``), checked name by name and shape by shape.

    Raises
    ------
    ShardingError
        A name or shape differs from ``expect``.
    """
    out = [np.ascontiguousarray(shard_weight(n, w, plan, rank)) for n, w in zip(names, weights)]
    if expect is not None:
        if [p.name for p in expect] != list(names):
            raise ShardingError("the shard build's parameters are not the full build's, in the same order")
        for p, w in zip(expect, out):
            if tuple(int(s) for s in p.shape) != tuple(w.shape):
                raise ShardingError(f"{p.name}: shard weight {tuple(w.shape)} != the shard build's {tuple(p.shape)}")
    return out


def scatter_shards(sess, names: Sequence[str], weights: Sequence[np.ndarray], plan: ShardPlan) -> list:
    """Put each shard's weights on its worker of a disco session (NCCL initialized, one worker per shard):
    a cut weight is stacked ``(N, ...)`` and scattered from worker 0 (``sess.scatter``: worker r gets shard
    r), a whole one broadcast. Returns the DRefs, in order, to pass to the shard library's functions.

    Raises
    ------
    ShardingError
        The session's worker count is not ``plan.shards``.
    """
    if sess.num_workers != plan.shards:
        raise ShardingError(f"the session has {sess.num_workers} workers, the plan {plan.shards} shards")
    out = []
    for name, w in zip(names, weights):
        if is_sharded(name):
            parts = np.stack([np.ascontiguousarray(shard_weight(name, w, plan, r)) for r in range(plan.shards)])
            out.append(sess.scatter(parts))
        else:
            out.append(sess.broadcast(np.ascontiguousarray(w)))
    return out
