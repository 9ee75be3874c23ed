"""Errors of the kernel build."""

from __future__ import annotations


class NativeKernelsUnavailable(RuntimeError):
    """The native FA2 kernels cannot be built or found here (no nvcc, no sources, not built)."""


class FlashAttnSourceUnavailable(NativeKernelsUnavailable):
    """flash-attn's pinned sources could not be fetched or do not match their sha256."""
