"""Run the shards of a tensor-parallel build on the CPU, without disco or NCCL: one thread per shard, and
``runtime.disco.allreduce`` replaced, while :func:`lockstep_allreduce` is active, by a sum across the
threads (each waits for the others at every all-reduce, adds the N partial sums in float64, and copies the
total into its output).

What a sharded graph computes can so be checked against the unsharded one on any machine::

    with lockstep_allreduce(n) as ar:
        outs = ar.run(lambda rank: shard_vm(rank)["prefill"](ids, *shard_weights[rank]))

Create the VMs inside the ``with``: a VM looks its packed functions up when it is made.
Nothing here imports ``tvm.relax``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from mqa_byoc.runtime.ffi_globals import replaced_global_func

ALLREDUCE = "runtime.disco.allreduce"
_REDUCE = {0: np.sum, 1: np.prod, 2: np.min, 3: np.max, 4: np.mean}


class LockstepAllReduce:
    """The stand-in for ``runtime.disco.allreduce`` of :func:`lockstep_allreduce` (``ar.calls`` counts
    the all-reduces of shard 0)."""

    def __init__(self, shards: int, timeout: float = 600.0):
        self.shards = shards
        self.calls = 0
        self._barrier = threading.Barrier(shards, timeout=timeout)
        self._parts: list = [None] * shards
        self._local = threading.local()

    def __call__(self, send, kind, in_group, recv):
        rank = self._local.rank
        self._parts[rank] = send.numpy().astype(np.float64)
        self._barrier.wait()
        total = _REDUCE[int(kind[0])](np.stack(self._parts), axis=0)
        self._barrier.wait()  # all have read the parts before any shard writes the next ones
        if rank == 0:
            self.calls += 1
        recv.copyfrom(total.astype(recv.dtype))

    def run(self, fn: Callable[[int], object]) -> list:
        """``[fn(0), ..., fn(N - 1)]``, each call on its own thread with its rank set for the all-reduce.
        An exception on any shard breaks the others' waits and is raised here."""
        results: list = [None] * self.shards
        errors: list = []

        def body(rank):
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.shards)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            raise first
        return results


def lockstep_allreduce(shards: int, timeout: float = 600.0):
    """Replace ``runtime.disco.allreduce`` by a :class:`LockstepAllReduce` of ``shards`` for the block
    (``with ... as ar``); the previous function (disco's) is put back after it."""
    return replaced_global_func(ALLREDUCE, lambda _previous: LockstepAllReduce(shards, timeout))
