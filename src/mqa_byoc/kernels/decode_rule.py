"""Which decode calls (one query row) our grouped-query decode kernel (``native/gqa_decode.cu``) serves:
the rule the dispatcher applies at run time (``own_decode_fits`` in ``fa2_dispatch.cc``: the kernel's
head dims and whole head groups), stated here for ``offload_report``.
``tests/test_kernels_decode_plan.py`` checks it against the compiled kernel's own plan."""

from __future__ import annotations

#: head dims the decode kernel is compiled for
DECODE_HEAD_DIMS = (64, 128)


def rows_per_cta(head_dim: int) -> int:
    """Query rows one CTA of the classic blocks holds (one 16-row MMA block); a larger group takes several
    CTAs per split. (SharedTiles, which the plan takes for large groups at head dim 64 and many sequences,
    holds up to 128: fewer CTAs, so the grid bound below holds for it too.)"""
    return 16


#: the oldest arch the decode kernel runs on (its plans take Hopper's clusters and shared memory; the
#: dispatcher asks the device's compute capability and runs decode on FA2's split-KV below it)
DECODE_MIN_ARCH = 90


def decode_kernel_serves(head_dim: int, num_q_heads: int, num_kv_heads: int, arch: str | None = None) -> bool:
    """Whether a decode call with these heads runs on our decode kernel (else FA2's split-KV); ``arch``
    (``sm_80``): the target's, None when not known (then as on sm_90)."""
    if head_dim not in DECODE_HEAD_DIMS or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return False
    digits = "".join(ch for ch in (arch or "")[3:] if ch.isdigit())
    if digits and int(digits) < DECODE_MIN_ARCH:
        return False
    row_groups = -(-(num_q_heads // num_kv_heads) // rows_per_cta(head_dim))
    return num_kv_heads * row_groups <= 65535  # the grid's y (batch, its z, is checked at run time)
