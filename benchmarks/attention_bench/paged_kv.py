"""TVM's paged-KV attention kernels (``tvm.relax.frontend.nn.llm``, the TIR kernels MLC-LLM runs
without FlashInfer): page tables and arguments (numpy on the CPU check, torch on the GPU), the
kernels as TVM's KV cache builds them, and a CPU check of the calling convention."""

from __future__ import annotations

import math
import os
import re
import tempfile

from .suites import PAGE_SIZE

def _is_torch(x):
    return type(x).__module__.startswith("torch")

def page_permutation(num_pages, seed=0):
    """Physical page of each logical page: a seeded shuffle, so the kernels' page-table indirection
    is exercised (a wrong index gives wrong numbers, not a lucky identity)."""
    import random

    perm = list(range(num_pages))
    random.Random(seed).shuffle(perm)
    return perm

def paged_kv(k, v, page_size=PAGE_SIZE, perm=None):
    """K/V of one sequence in TVM's paged layout.

    k, v: ``(S_kv, H_kv, D)`` numpy arrays or torch tensors. Returns ``(pages, page_values,
    last_page_len)``: pages ``(num_pages, 2, H_kv, page_size, D)`` (index 0 of axis 1 is K, 1 is V;
    TVM's ``PagedAttentionKVCache`` layout), logical page j stored at physical page ``perm[j]``
    (``page_values``, a list), and the number of used slots of the last page.
    """
    s, hkv, d = k.shape
    n = -(-s // page_size)
    perm = page_permutation(n) if perm is None else list(perm)
    pad = n * page_size - s
    if _is_torch(k):
        import torch

        kv = torch.stack([k, v])
        if pad:
            kv = torch.cat([kv, kv.new_zeros((2, pad, hkv, d))], 1)
        ordered = kv.reshape(2, n, page_size, hkv, d).permute(1, 0, 3, 2, 4)
        pages = kv.new_zeros((n, 2, hkv, page_size, d))
        pages[torch.tensor(perm, device=k.device, dtype=torch.long)] = ordered
    else:
        import numpy as np

        kv = np.stack([k, v])
        if pad:
            kv = np.concatenate([kv, np.zeros((2, pad, hkv, d), kv.dtype)], 1)
        ordered = kv.reshape(2, n, page_size, hkv, d).transpose(1, 0, 3, 2, 4)
        pages = np.zeros((n, 2, hkv, page_size, d), kv.dtype)
        pages[np.asarray(perm)] = ordered
    return pages, perm, s - (n - 1) * page_size

def llm_kernel_args(kernel, q, k, v, causal, sm_scale, page_size=PAGE_SIZE, perm=None):
    """Arguments of a TVM ``relax.frontend.nn.llm`` attention kernel for one sequence.

    q ``(S_q, H, D)``, k/v ``(S_kv, H_kv, D)`` (numpy or torch, same library for all). Returns
    ``(args, out_index)``: the argument list in the kernel's order (arrays in q's library, then the
    scalars) and the position of the output buffer. The order is the one TVM's runtime
    (``src/runtime/vm/attn_backend.h``, ``TIR*Func::MHA``) passes; RoPE is off (rotary_mode 0), the
    positions are those of a sequence whose last query is its last key.
    """
    s_q, h, d = q.shape
    s_kv = k.shape[0]
    if _is_torch(q):
        import torch

        def ints(xs):
            return torch.tensor(xs, dtype=torch.int32, device=q.device)

        def out_like(shape, dtype=None):
            return torch.full(shape, float("nan"), dtype=dtype or q.dtype, device=q.device)

        f32 = torch.float32
    else:
        import numpy as np

        def ints(xs):
            return np.asarray(xs, dtype="int32")

        def out_like(shape, dtype=None):
            return np.full(shape, np.nan, dtype=dtype or q.dtype)

        f32 = "float32"
    out = out_like((s_q, h, d))
    lse = out_like((s_q, h), f32)
    q_pos = ints(list(range(s_kv - s_q, s_kv)))
    rope = [0, 1.0, 10000.0, float(sm_scale)]  # rotary_mode (0: off), rope_scale, rope_theta, sm_scale
    if kernel == "batch_prefill_ragged_kv":
        indptr_q, indptr_kv = ints([0, s_q]), ints([0, s_kv])
        args = [q, indptr_q, k, v, indptr_kv, q_pos, ints([0]), out, lse, int(bool(causal))] + rope
        return args, 7
    pages, values, last = paged_kv(k, v, page_size, perm)
    n = len(values)
    if kernel == "batch_prefill_paged_kv":
        args = [q, ints([0, s_q]), pages, ints([0, n]), ints(values), ints([last]), ints([0]), q_pos, out, lse,
                int(bool(causal))] + rope
        return args, 8
    if kernel == "batch_decode_paged_kv":
        if s_q != 1:
            raise ValueError("batch_decode_paged_kv takes one query per sequence")
        args = [q, pages, ints([0, n]), ints(values), ints([last]), ints([0]), q_pos, out, lse] + rope
        return args, 7
    raise ValueError(f"unknown TVM llm kernel {kernel!r}")

def llm_gpu_kernels(h, hkv, d, dtype, target):
    """kernel name -> PrimFunc: TVM's paged-KV attention kernels for CUDA, as ``TIRPagedKVCache`` builds
    them (``tvm/relax/frontend/nn/llm/kv_cache.py``: no sliding window, no RoPE scaling, page size 16)."""
    from tvm.relax.frontend.nn.llm import _decode_kernels as dk
    from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

    return {
        "batch_prefill_ragged_kv": pk._attention_prefill_ragged(hkv, h, d, d, dtype, {}, target),
        "batch_prefill_paged_kv": pk._attention_prefill(hkv, h, d, dtype, False, {}, target),
        "batch_decode_paged_kv": dk._attention_decode(hkv, h, d, dtype, False, {}, target),
    }

def llm_cpu_kernels(h, hkv, d, dtype):
    """The CPU (llvm) kernels of the same names and calling convention (TIR ``*_cpu`` variants)."""
    from tvm.relax.frontend.nn.llm import _decode_kernels as dk
    from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

    return {
        "batch_prefill_ragged_kv": pk._attention_prefill_ragged_cpu(hkv, h, d, d, dtype, {}),
        "batch_prefill_paged_kv": pk._attention_prefill_cpu(hkv, h, d, dtype, False, {}),
        "batch_decode_paged_kv": dk._attention_decode_cpu(hkv, h, d, dtype, False, {}),
    }

def decode_head_coverage(prim_func, h, hkv):
    """Query heads per K/V head that TVM's GPU decode kernel writes, read from its thread bindings
    (blockIdx.y = H_kv * gdz, threadIdx.y = bdy; heads by * group + bz * bdy + ty)."""
    text = prim_func.script()
    ext = {}
    for m in re.finditer(r"T\.thread_binding\((\d+), thread=\"(blockIdx\.y|threadIdx\.y)\"\)", text):
        ext.setdefault(m.group(2), int(m.group(1)))
    if len(ext) != 2:
        return None
    return (ext["blockIdx.y"] // hkv) * ext["threadIdx.y"]

def check_llm_cpu(configs=((8, 2, 16, 37), (6, 1, 16, 37), (4, 4, 8, 16)), verbose=True):
    """Run the CPU variants of TVM's paged-KV kernels through :func:`llm_kernel_args` and compare them
    with a numpy reference: checks the argument order, the page table we build and the scale.
    configs: (H, H_kv, D, S). Returns a list of dicts (kernel, config, max_abs_err)."""
    import numpy as np
    import tvm

    from mqa_byoc.models.llama import attention_reference

    results = []
    for h, hkv, d, s in configs:
        funcs = {name: f.with_attr("global_symbol", name) for name, f in llm_cpu_kernels(h, hkv, d, "float32").items()}
        ex = tvm.compile(tvm.IRModule(funcs), target="llvm")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "llm_cpu.so")
            ex.export_library(path)  # the same export -> load_module -> get-by-name path as on the GPU
            lib = tvm.runtime.load_module(path)
            rng = np.random.default_rng(h * 1000 + s)
            q = rng.standard_normal((1, s, h, d), dtype=np.float32)
            k = rng.standard_normal((1, s, hkv, d), dtype=np.float32)
            v = rng.standard_normal((1, s, hkv, d), dtype=np.float32)
            for kernel in funcs:
                s_q = 1 if kernel == "batch_decode_paged_kv" else s
                causal = kernel != "batch_decode_paged_kv"
                qq = np.ascontiguousarray(q[:, s - s_q:])
                ref = attention_reference(qq, k, v, causal_mask="BottomRight" if causal else None)
                args, oi = llm_kernel_args(kernel, qq[0], k[0], v[0], causal, 1.0 / math.sqrt(d))
                targs = [tvm.runtime.tensor(a) if isinstance(a, np.ndarray) else a for a in args]
                lib[kernel](*targs)
                out = targs[oi].numpy().reshape(ref.shape)
                err = float(np.abs(out - ref).max())
                results.append(dict(kernel=kernel, h=h, hkv=hkv, d=d, s_q=s_q, s_kv=s, causal=causal,
                                    num_pages=-(-s // PAGE_SIZE), max_abs_err=err, ok=bool(err < 1e-4)))
                if verbose:
                    print(f"  cpu check {kernel:24s} H={h} H_kv={hkv} D={d} S_q={s_q} S_kv={s}: "
                          f"max abs err {err:.2e} {'ok' if err < 1e-4 else 'MISMATCH'}", flush=True)
    return results
