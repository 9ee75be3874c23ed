"""CUDA-event timing: the GPU time of back-to-back calls, as a decode loop sees it (CPU overhead
per call counts when it exceeds the kernel time)."""

from __future__ import annotations

from collections.abc import Callable


def time_call_us(fn: Callable):
    """One call of ``fn`` between two CUDA events (the stream synchronized before).

    Returns
    -------
    tuple
        ``(fn's result, microseconds)``.
    """
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) * 1e3


def cuda_time_us(fn: Callable, iters: int, warmup: int = 3) -> float:
    """``warmup`` calls, then ``iters`` calls back to back between two CUDA events.

    Returns
    -------
    float
        Microseconds per call (mean over ``iters``).
    """
    import torch

    for _ in range(warmup):
        fn()

    def loop():
        for _ in range(iters):
            fn()

    torch.cuda.synchronize()
    _, us = time_call_us(loop)
    return us / max(iters, 1)
