"""Which decode calls (one query row) our grouped-query decode kernel (``native/gqa_decode.cu``) serves:
the rule the dispatcher applies at run time (``own_decode_fits`` in ``fa2_dispatch.cc``: the kernel's
head dims, and a K/V head's query rows within one CTA), stated here for ``offload_report``.
``tests/test_decode_plan.py`` checks it against the compiled kernel's own plan."""

from __future__ import annotations

#: head dims the decode kernel is compiled for
DECODE_HEAD_DIMS = (64, 128)


def rows_per_cta(head_dim: int) -> int:
    """Query rows one CTA holds (two 16-row MMA blocks for head dim 64, one for 128)."""
    return 32 if head_dim <= 64 else 16


def decode_kernel_serves(head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether a decode call with these heads runs on our decode kernel (else FA2's split-KV)."""
    if head_dim not in DECODE_HEAD_DIMS or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return False
    return num_q_heads // num_kv_heads <= rows_per_cta(head_dim)
