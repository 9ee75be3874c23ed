"""Tensor parallelism: NCCL for TVM's disco on the stock wheel, and Llama-family decoders sharded over it.

- :mod:`~mqa_byoc.tp.ccl`: build and load our ``runtime.disco.nccl.*`` library (needs no ``tvm.relax``).
- :mod:`~mqa_byoc.tp.sharding`: the per-shard shapes of a decoder and its weights cut per shard.
- :mod:`~mqa_byoc.tp.disco_worker`: the worker entry point of a ``disco.ProcessSession`` with our NCCL.

See docs/tensor_parallel.md.
"""

from __future__ import annotations

from .ccl import (
    CCL_FUNCTIONS,
    LIBRARY_ENV,
    DiscoNcclUnavailable,
    build_disco_nccl,
    disco,
    load_disco_nccl,
    nccl_dirs,
    process_session,
    threaded_session,
)
from .sharding import (
    TP_SHARDS,
    ShardingError,
    ShardPlan,
    is_sharded,
    plan_for,
    scatter_shards,
    shard_config,
    shard_params,
    shard_weight,
)

__all__ = [
    "CCL_FUNCTIONS",
    "TP_SHARDS",
    "ShardPlan",
    "ShardingError",
    "LIBRARY_ENV",
    "DiscoNcclUnavailable",
    "build_disco_nccl",
    "disco",
    "load_disco_nccl",
    "is_sharded",
    "nccl_dirs",
    "plan_for",
    "process_session",
    "scatter_shards",
    "shard_config",
    "shard_params",
    "shard_weight",
    "threaded_session",
]
