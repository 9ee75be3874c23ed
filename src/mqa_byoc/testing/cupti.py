"""The GPU kernels a block of code launches, through CUPTI (``torch.profiler``, CUDA activity).

    with capture_kernels() as cap:
        run_step()
    cap.names()   # kernel / memcpy names in launch order
    cap.stats()   # [KernelStat(name, [us, ...]), ...] per distinct name
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

#: the GPU kernels our providers run attention with: FA2's (``flash_fwd_*``), FA4's sm90 kernel
#: (``...flash_fwd_sm90...``) and our grouped-query decode kernels (``native/gqa_decode.cu``: the classic
#: blocks, SharedTiles, and the merge of SharedTiles' splits)
ATTENTION_KERNEL = re.compile(r"flash|gqa_decode_(shared_|split_merge_)?kernel", re.IGNORECASE)
#: one per native attention call: FA2's forward (split-KV or not; not its combine) or our decode kernel
#: (the classic blocks or SharedTiles; not the merge)
ATTENTION_FORWARD = re.compile(r"flash_fwd(_splitkv)?_kernel|gqa_decode_(shared_)?kernel")


def is_attention_kernel(name: str) -> bool:
    """Whether a CUPTI kernel name is one of our attention kernels (:data:`ATTENTION_KERNEL`)."""
    return ATTENTION_KERNEL.search(name) is not None


@dataclass
class KernelStat:
    """Device times (µs) of every launch of one kernel."""

    name: str
    times_us: list

    @property
    def total(self):
        return sum(self.times_us)


def _is_cuda(evt) -> bool:
    return str(getattr(evt, "device_type", "")).endswith("CUDA")


def collect_kernels(prof) -> list[KernelStat]:
    """Per-kernel device times from a finished ``torch.profiler.profile``."""
    by_name = {}
    for evt in prof.events():
        if _is_cuda(evt) and evt.device_time > 0:
            by_name.setdefault(evt.name, []).append(evt.device_time)
    return [KernelStat(n, t) for n, t in by_name.items()]


@dataclass
class KernelCapture:
    """What :func:`capture_kernels` recorded (filled when its block exits)."""

    events: list = field(default_factory=list)  # (name, device µs) in launch order

    def names(self) -> list[str]:
        return [n for n, _ in self.events]

    def stats(self) -> list[KernelStat]:
        by_name = {}
        for n, t in self.events:
            if t > 0:
                by_name.setdefault(n, []).append(t)
        return [KernelStat(n, t) for n, t in by_name.items()]


@contextlib.contextmanager
def capture_kernels(cpu: bool = False):
    """Record the CUDA activity of the block (synchronized at its end); ``cpu`` also records
    the CPU side (for a trace, not needed for kernel tables).

    Returns
    -------
    KernelCapture
        As the ``with`` target; its ``events`` are filled when the block exits.
    """
    import torch
    import torch.profiler

    acts = [torch.profiler.ProfilerActivity.CUDA]
    if cpu:
        acts.insert(0, torch.profiler.ProfilerActivity.CPU)
    cap = KernelCapture()
    with torch.profiler.profile(activities=acts) as prof:
        yield cap
        torch.cuda.synchronize()
    cap.events = [(e.name, e.device_time) for e in prof.events() if _is_cuda(e)]
