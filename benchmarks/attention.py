"""Attention microbenchmarks: our FA2 offload (mqa=True) vs the repeat path (mqa=False), stock TVM,
FA2 called directly, PyTorch SDPA with enable_gqa and TVM's own paged-KV-cache attention kernels
(``tvm.relax.frontend.nn.llm``, the TIR kernels MLC-LLM runs without FlashInfer), measured side by
side in one run.

Three steps, on two machines (the GPU machine has only TVM's runtime):

    python benchmarks/attention.py build --suite issue6 --out .bench-artifacts/issue6             # here
    source .devkit/setup.sh && python3 -m boot benchmarks/attention.py run \
        --artifacts .bench-artifacts/issue6 --json $OUT/attention-issue6.json    # on the GPU (carry .devkit and
                                                                                # .bench-artifacts/issue6)
    python benchmarks/attention.py report attention-issue6.json [rerun.json ...]   # here: benchmarks/results/

``build`` writes the libraries plus ``cases.json``. Suites ``issue4`` / ``full`` build one library per
(case, variant) with static shapes. Suite ``issue6`` (every distinct (H, H_kv, D) of the model
presets x fp16/bf16 x prefill {1k, 4k, 16k} causal x decode S_kv {1k, 4k, 16k, 32k}) builds
*symbolic* sequence lengths, so one library serves every length: per dtype one Relax library holding
all shapes x {prefill, decode} x {mqa, repeat, stock} (the FA2 kernels of a (head dim, dtype) are
linked once, not once per variant), one library of TVM's paged-KV TIR kernels, and the CUDA of both
compiled to fatbins here (``cuda-cache/``) so the GPU does not JIT-compile TVM's kernels at load.

``run`` loads them with the runtime-only TVM, checks every variant's output against FA2 called
directly, times each with CUDA events over back-to-back calls (the steady state a decode loop sees:
CPU overhead per call counts when it exceeds the kernel time; iterations are sized to a time budget
per variant) and writes JSON records; each variant runs in its own try/except, a failure is recorded
and the run goes on; the JSON is rewritten after every case. ``report`` turns the JSON into
``benchmarks/results/<date>-attention-<suite>.{json,md}`` and ``-fp16.png`` / ``-bf16.png`` (needs
matplotlib; ``run`` does not); given several run JSONs, later ones replace earlier (case, variant)
records (reruns with ``--cases`` / ``--skip-variants``). ``check-llm`` repeats the build's CPU check of
the TVM kernels' calling convention.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(_HERE, "..", "src")

SUITES = {
    # the shapes the issues ask about: H=64, H_kv=8, D=128 fp16
    "issue4": [
        dict(name="decode-16k", mode="decode", h=64, hkv=8, d=128, dtype="float16", s_q=1, s_kv=16384, causal=False),
        dict(name="prefill-2k-causal", mode="prefill", h=64, hkv=8, d=128, dtype="float16", s_q=2048, s_kv=2048,
             causal=True),
    ],
}
SUITES["full"] = SUITES["issue4"] + [
    dict(name=f"{mode}-{label}-{dt}", mode=mode, h=64, hkv=8, d=128, dtype=dt, s_q=(1 if mode == "decode" else n),
         s_kv=n, causal=mode == "prefill")
    for dt in ("float16", "bfloat16")
    for mode, sizes in (("prefill", (1024, 4096, 16384)), ("decode", (1024, 4096, 16384, 32768)))
    for n in sizes
    for label in [f"{n // 1024}k"]
    if not (dt == "float16" and ((mode, n) in (("prefill", 2048), ("decode", 16384))))
]

#: suites built per dtype with symbolic lengths (see the module docstring)
GROUPED_SUITES = {
    "issue6": dict(dtypes=("float16", "bfloat16"), prefill=(1024, 4096, 16384), decode=(1024, 4096, 16384, 32768)),
}

# stock TVM lowers attention ~580x slower than FA2: only where it finishes in reasonable time
STOCK_MAX_WORK = 2048 * 2048
#: TVM paged KV cache page size (MLC-LLM's default)
PAGE_SIZE = 16
#: H200 HBM3e peak bandwidth (NVIDIA's spec sheet: 4.8 TB/s) used for the decode bandwidth fraction
HBM_PEAK_TB_S = 4.8
#: relative tolerance (max |out - FA2| / max |FA2|) above which a variant's numerics are flagged
REL_TOL = {"float16": 2e-2, "bfloat16": 5e-2}
DT_SHORT = {"float16": "fp16", "bfloat16": "bf16"}

#: column order of the report; variants not listed come after, alphabetically
VARIANT_ORDER = [
    "fa2-direct", "mqa-native", "mqa-python", "repeat-native", "repeat-python", "torch-sdpa-gqa",
    "tvm-llm-ragged", "tvm-llm-paged", "stock-tvm", "cublas-qk-gemm",
]
VARIANT_DOC = {
    "fa2-direct": "FA2 called directly (PyTorch's `aten._flash_attention_forward`, native K/V heads); the reference",
    "mqa-native": "ours: `partition_for_cutlass(mqa=True)`, native provider (FA2 linked into the library), via TVM's VM",
    "mqa-python": "ours, Python provider (FA2 through a Python bridge)",
    "repeat-native": "`mqa=False`: K/V repeated to H heads by TVM, FA2 as plain MHA (native provider)",
    "repeat-python": "`mqa=False`, Python provider",
    "torch-sdpa-gqa": "`torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`",
    "tvm-llm-ragged": "TVM `relax.frontend.nn.llm` TIR `batch_prefill_ragged_kv` (what TVM's paged KV cache runs "
                      "for a fresh prefill), native GQA, called directly",
    "tvm-llm-paged": "TVM `relax.frontend.nn.llm` TIR paged-KV kernels (page size 16, shuffled page table): "
                     "`batch_prefill_paged_kv` (prefill: all K/V in pages, causal) / `batch_decode_paged_kv` (decode)",
    "stock-tvm": "TVM's own `R.nn.attention` lowering on repeated K/V (only where s_q*s_kv <= 2048^2)",
    "cublas-qk-gemm": "cuBLAS batched GEMM of the QK^T shape (H x S_q x D @ D x S_kv, case dtype, tensor cores)",
}


# ----------------------------------------------------------------------------------------------
# suites (pure logic)
# ----------------------------------------------------------------------------------------------


def preset_shapes(presets=None):
    """The distinct (H, H_kv, D) of the model presets, in preset order, each naming its presets.

    ``presets``: name -> DecoderConfig (default ``mqa_byoc.models.presets.PRESETS``).
    """
    if presets is None:
        if _SRC not in sys.path:
            sys.path.insert(0, _SRC)
        from mqa_byoc.models.presets import PRESETS as presets
    shapes = {}
    for name, c in presets.items():
        key = (c.num_heads, c.num_kv_heads, c.head_dim)
        sh = shapes.setdefault(key, dict(shape=f"h{key[0]}-kv{key[1]}-d{key[2]}", h=key[0], hkv=key[1], d=key[2],
                                         presets=[], notes=[]))
        sh["presets"].append(name)
        if getattr(c, "sliding_window", None):
            sh["notes"].append(f"{name} uses a {c.sliding_window}-token sliding window; measured without one")
    return list(shapes.values())


def expand_suite(name, presets=None, shapes=None):
    """The cases of suite ``name``: dicts with name, mode, h, hkv, d, dtype, s_q, s_kv, causal (and for
    grouped suites: suite, group (the library), shape, presets, stock, notes).

    ``shapes``: keep only these shape ids (e.g. ``["h64-kv8-d128"]``).
    """
    if name in SUITES:
        return [dict(c) for c in SUITES[name]]
    if name not in GROUPED_SUITES:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(sorted(SUITES) + sorted(GROUPED_SUITES))}")
    spec = GROUPED_SUITES[name]
    cases = []
    for sh in preset_shapes(presets):
        if shapes and sh["shape"] not in shapes:
            continue
        for dt in spec["dtypes"]:
            for mode in ("prefill", "decode"):
                for n in spec[mode]:
                    s_q = n if mode == "prefill" else 1
                    cases.append(dict(
                        name=f"{sh['shape']}-{DT_SHORT[dt]}-{mode}-{_seq_label(n)}", suite=name, group=dt,
                        shape=sh["shape"], presets=list(sh["presets"]), mode=mode, h=sh["h"], hkv=sh["hkv"],
                        d=sh["d"], dtype=dt, s_q=s_q, s_kv=n, causal=mode == "prefill",
                        stock=s_q * n <= STOCK_MAX_WORK, notes=list(sh["notes"]),
                    ))
    return cases


def _seq_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def function_name(shape, mode, variant):
    """Relax / TIR function name of a (shape, mode, variant) in a grouped library (a C identifier)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{shape}__{mode}__{variant}")


def llm_kernel_name(shape, kernel):
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{shape}__{kernel}")


#: the TVM paged-KV kernels a case runs: variant -> TIR kernel, per mode
LLM_KERNELS = {
    "prefill": {"tvm-llm-ragged": "batch_prefill_ragged_kv", "tvm-llm-paged": "batch_prefill_paged_kv"},
    "decode": {"tvm-llm-paged": "batch_decode_paged_kv"},
}


def case_variants(case, providers, lib, llm_lib):
    """variant -> how to call it, for one case of a grouped suite."""
    out = {}
    for provider in providers:
        for kind in ("mqa", "repeat"):
            v = f"{kind}-{provider}"
            out[v] = dict(kind="relax", lib=lib, func=function_name(case["shape"], case["mode"], v))
    if case.get("stock"):
        out["stock-tvm"] = dict(kind="relax", lib=lib, func=function_name(case["shape"], case["mode"], "stock-tvm"))
    if llm_lib:
        for v, kernel in LLM_KERNELS[case["mode"]].items():
            out[v] = dict(kind="tvm-llm", kernel=kernel, lib=llm_lib, func=llm_kernel_name(case["shape"], kernel))
    return out


# ----------------------------------------------------------------------------------------------
# TVM paged-KV kernels: page tables and arguments (numpy on the CPU check, torch on the GPU)
# ----------------------------------------------------------------------------------------------


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

    if _SRC not in sys.path:
        sys.path.insert(0, _SRC)
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


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------


def _module(case):
    from mqa_byoc.models.llama import build_attention_block

    return build_attention_block(
        case["h"], case["hkv"], case["d"], kv_expand="repeat", dtype=case["dtype"], mode="extend",
        batch=1, seq_len=case["s_q"], kv_len=case["s_kv"],
        causal_mask="BottomRight" if case["causal"] else None,
    )


def _symbolic_block(sh, dtype, mode, name):
    """q/k/v -> attention with K/V repeated to H heads (the graph a compile script hands us), symbolic
    lengths: prefill ``S_q = S_kv = seq_len`` causal, decode ``S_q = 1``, ``S_kv = kv_len``."""
    from mqa_byoc.models.llama import build_attention_block

    return build_attention_block(
        sh["h"], sh["hkv"], sh["d"], kv_expand="repeat", dtype=dtype, mode=mode, batch=1,
        causal_mask="BottomRight" if mode == "prefill" else None, func_name=name,
    )


def _codegen_functions(mod):
    from tvm import relax

    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "flash_attn"}


def _composite_of(func):
    from tvm import relax

    found = []

    def visit(e):
        if isinstance(e, relax.Function) and e.attrs is not None and "Composite" in e.attrs:
            found.append(str(e.attrs["Composite"]))

    relax.analysis.post_order_visit(func.body, visit)
    return found


def build_group_module(shapes, dtype, providers):
    """One IRModule holding, for every shape, ``{prefill, decode} x {mqa-<p>, repeat-<p> for p in
    providers} + stock-tvm``, partitioned, plus a summary of what was offloaded (checked)."""
    import tvm
    import tvm_ffi
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler.gqa_legalize import LegalizeGroupedAttention

    funcs, attrs = {}, None
    provider_of, summary, snapshot = {}, {}, {}

    shape_of = {}

    def add(variant):
        nonlocal attrs
        names = []
        for sh in shapes:
            for mode in ("prefill", "decode"):
                name = function_name(sh["shape"], mode, variant)
                blk = _symbolic_block(sh, dtype, mode, name)
                attrs = attrs if attrs is not None else blk.attrs
                funcs.update(dict(blk.functions_items()))
                names.append(name)
                shape_of[name] = sh
        return names

    mod = None
    for provider in providers:
        for kind, mqa in (("mqa", True), ("repeat", False)):
            variant = f"{kind}-{provider}"
            names = add(variant)
            mod = tvm.IRModule(funcs, attrs=attrs)
            sites = {s.function: s for s in mqa_byoc.offload_report(mod, mqa=mqa) if s.function in names}
            before = set(_codegen_functions(mod))
            # functions partitioned by an earlier variant hold no attention any more: untouched
            mod = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
            for n, f in _codegen_functions(mod).items():
                if n not in before:
                    provider_of[n] = provider
                    snapshot[n] = f
            funcs = dict(mod.functions_items())
            for n in names:
                s = sites.get(n)
                summary[n] = dict(variant=variant, offloaded=bool(s and s.offloaded),
                                  composite=s.composite if s else None, reason=s.reason if s else "no site",
                                  expansion_ops_removed=s.expansion_ops_removed if s else 0)
    # each partition run names its C symbols from scratch: make them unique, restore each provider
    for gv, f in list(mod.functions_items()):
        if gv.name_hint in provider_of:
            mod[gv] = f.with_attr("mqa_byoc.provider", provider_of[gv.name_hint]).with_attr(
                "global_symbol", gv.name_hint)
    # a later partition run must leave the flash_attn functions of earlier ones as they were
    changed = [n for n, f in _codegen_functions(mod).items()
               if not tvm_ffi.structural_equal(f.without_attr("global_symbol").without_attr("mqa_byoc.provider"),
                                              snapshot[n].without_attr("global_symbol").without_attr("mqa_byoc.provider"))]
    if changed:
        raise RuntimeError(f"flash_attn functions changed by a later partition run: {changed}")
    funcs = dict(mod.functions_items())
    # check: every mqa/repeat function calls exactly one flash_attn function of the right composite,
    # and only the repeat path keeps the K/V expansion
    cg = _codegen_functions(mod)
    for name, info in summary.items():
        f = mod[name]
        called = [gv.name_hint for gv in relax.analysis.all_global_vars(f) if gv.name_hint in cg]
        comps = [c for n in called for c in _composite_of(cg[n])]
        info["codegen_functions"] = called
        info["composites"] = comps
        info["keeps_repeat"] = "R.repeat" in f.script()
        want = "flash_attn.attention" if info["variant"].startswith("repeat") else None
        ok = len(called) == 1 and len(comps) == 1 and info["keeps_repeat"] == (want is not None)
        if want:
            ok = ok and comps[0] == want
        else:
            sh = shape_of[name]
            ok = ok and comps[0] == ("flash_attn.attention_mqa" if sh["hkv"] < sh["h"] else "flash_attn.attention")
        info["check"] = "ok" if ok else "UNEXPECTED"
        if not ok:
            raise RuntimeError(f"{name}: unexpected partition result {info}")
    stock = add("stock-tvm")
    for n in stock:
        summary[n] = dict(variant="stock-tvm", offloaded=False)
    mod = LegalizeGroupedAttention()(tvm.IRModule(funcs, attrs=attrs))
    return mod, summary


def _cuda_sources(executable):
    mod = getattr(executable, "mod", executable)
    seen, keep, stack, out = set(), [], [mod], []
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        keep.append(m)  # keep the wrappers alive: ids of freed ones are reused
        if m.kind == "cuda":
            # format "cuda" is the stored code itself, what the loader hands tvm_callback_cuda_compile
            for fmt in ("cuda", ""):
                try:
                    src = m.inspect_source(fmt)
                except Exception:  # noqa: BLE001
                    continue
                if src:
                    out.append(src)
                    break
        stack.extend(m.imports)
    return out


def cuda_cache_key(code: str, arch: str) -> str:
    return f"{hashlib.sha256(code.encode()).hexdigest()[:32]}-{arch}"


def precompile_cuda(executable, cache_dir, arch, nice=10):
    """Compile the CUDA source TVM keeps in ``executable`` (TVM 0.27 stores it and JIT-compiles at load)
    into fatbins under ``cache_dir``, keyed by the source's hash; ``run`` serves them to TVM's
    ``tvm_callback_cuda_compile`` (same nvcc flags as the kit's boot.py), falling back to nvcc."""
    os.makedirs(cache_dir, exist_ok=True)
    done = []
    for code in _cuda_sources(executable):
        key = cuda_cache_key(code, arch)
        out = os.path.join(cache_dir, key + ".fatbin")
        if not os.path.exists(out):
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.cu")
                with open(src, "w") as f:
                    f.write(code)
                t0 = time.time()
                cmd = ["nice", "-n", str(nice), "nvcc", "--fatbin", "-O3", f"-arch={arch}", "-w", "-o", out + ".tmp", src]
                subprocess.run(cmd, check=True)
                os.replace(out + ".tmp", out)
                print(f"  nvcc {key}: {time.time() - t0:.0f} s, {os.path.getsize(out) / 1e6:.2f} MB", flush=True)
        done.append(key)
    return done


def build_grouped(args):
    import tvm
    from tvm import relax

    import mqa_byoc

    providers = (args.providers or "native").split(",")
    shapes_filter = args.shapes.split(",") if args.shapes else None
    cases = expand_suite(args.suite, shapes=shapes_filter)
    os.makedirs(args.out, exist_ok=True)
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    shapes = {c["shape"]: dict(shape=c["shape"], h=c["h"], hkv=c["hkv"], d=c["d"], presets=c["presets"]) for c in cases}
    meta = {"format": 2, "suite": args.suite, "arch": args.arch, "providers": providers, "page_size": PAGE_SIZE,
            "build_command": " ".join(["python"] + sys.argv),
            "build_date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "tvm": getattr(tvm, "__version__", None), "groups": {}, "cases": []}
    t_all = time.time()
    if not args.skip_llm:
        print("checking TVM's paged-KV kernels' calling convention on the CPU (llvm) ...", flush=True)
        meta["llm_cpu_check"] = check_llm_cpu()
        if not all(r["ok"] for r in meta["llm_cpu_check"]):
            raise RuntimeError("TVM paged-KV CPU check failed: the argument builder does not match the kernels")
    for dtype in sorted({c["group"] for c in cases}, key=["float16", "bfloat16"].index):
        group_shapes = [shapes[s] for s in dict.fromkeys(c["shape"] for c in cases if c["group"] == dtype)]
        g = {"dtype": dtype, "shapes": group_shapes}
        t0 = time.time()
        mod, summary = build_group_module(group_shapes, dtype, providers)
        g["functions"] = summary
        g["partition_s"] = round(time.time() - t0, 1)
        print(f"[{dtype}] partitioned {len(summary)} functions in {g['partition_s']} s "
              f"({sum(1 for s in summary.values() if s['offloaded'])} offloaded)", flush=True)
        t0 = time.time()
        with target:
            ex = relax.build(relax.transform.RunCodegen()(mod), target=target)
        g["relax_build_s"] = round(time.time() - t0, 1)
        lib = f"attn-{DT_SHORT[dtype]}.so"
        t0 = time.time()
        mqa_byoc.export_library(ex, os.path.join(args.out, lib), arch=args.arch)
        g["export_s"] = round(time.time() - t0, 1)
        g["lib"] = lib
        print(f"[{dtype}] relax.build {g['relax_build_s']} s, export {g['export_s']} s -> {lib} "
              f"({os.path.getsize(os.path.join(args.out, lib)) / 1e6:.1f} MB)", flush=True)
        if not args.no_precompile:
            g["cuda_cache"] = precompile_cuda(ex, os.path.join(args.out, "cuda-cache"), args.arch)
        llm_lib = None
        if not args.skip_llm:
            t0 = time.time()
            prims, coverage = {}, {}
            for sh in group_shapes:
                for kernel, f in llm_gpu_kernels(sh["h"], sh["hkv"], sh["d"], dtype, target).items():
                    name = llm_kernel_name(sh["shape"], kernel)
                    prims[name] = f.with_attr("global_symbol", name)
                    if kernel == "batch_decode_paged_kv":
                        cov = decode_head_coverage(f, sh["h"], sh["hkv"])
                        coverage[sh["shape"]] = cov
                        if cov is not None and cov < sh["h"] // sh["hkv"]:
                            print(f"  WARNING {sh['shape']}: TVM's decode kernel writes {cov} of "
                                  f"{sh['h'] // sh['hkv']} query heads per K/V head", flush=True)
            llm_ex = tvm.compile(tvm.IRModule(prims), target=target)
            llm_lib = f"tvm-llm-{DT_SHORT[dtype]}.so"
            llm_ex.export_library(os.path.join(args.out, llm_lib))
            g["llm_lib"] = llm_lib
            g["llm_build_s"] = round(time.time() - t0, 1)
            g["llm_decode_heads_written_per_kv_head"] = coverage
            print(f"[{dtype}] TVM paged-KV kernels {g['llm_build_s']} s -> {llm_lib}", flush=True)
            if not args.no_precompile:
                g["cuda_cache"] = g.get("cuda_cache", []) + precompile_cuda(
                    llm_ex, os.path.join(args.out, "cuda-cache"), args.arch)
        meta["groups"][dtype] = g
        for c in cases:
            if c["group"] == dtype:
                meta["cases"].append({**c, "variants": case_variants(c, providers, lib, llm_lib)})
    meta["build_s"] = round(time.time() - t_all, 1)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(meta, f, indent=1)
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(args.out) for fn in fns)
    print(f"{len(meta['cases'])} cases; artifacts {total / 2**20:.1f} MiB in {args.out}")


def build(args):
    if args.suite in GROUPED_SUITES:
        return build_grouped(args)
    import tvm
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler import codegen
    from mqa_byoc.compiler.gqa_legalize import LegalizeGroupedAttention

    os.makedirs(args.out, exist_ok=True)
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    cases = []
    for case in SUITES[args.suite]:
        mod = _module(case)
        variants = {}
        for provider in (args.providers or "python").split(","):
            for mqa in (True, False):
                name = f"{'mqa' if mqa else 'repeat'}-{provider}"
                part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
                with target, codegen.use_provider(provider):
                    ex = relax.build(relax.transform.RunCodegen()(part), target=target)
                path = os.path.join(args.out, f"{case['name']}.{name}.so")
                if provider == "native":
                    mqa_byoc.export_library(ex, path, arch=args.arch)
                else:
                    ex.export_library(path)
                variants[name] = os.path.basename(path)
                print(f"built {path}", flush=True)
        if case["s_q"] * case["s_kv"] <= STOCK_MAX_WORK:
            with target:
                ex = relax.build(LegalizeGroupedAttention()(mod), target=target)
            path = os.path.join(args.out, f"{case['name']}.stock-tvm.so")
            ex.export_library(path)
            variants["stock-tvm"] = os.path.basename(path)
        cases.append({**case, "variants": variants})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"arch": args.arch, "suite": args.suite, "cases": cases}, f, indent=1)


# ----------------------------------------------------------------------------------------------
# run (GPU machine: runtime-only TVM, torch; no matplotlib, no tvm.relax)
# ----------------------------------------------------------------------------------------------


def _time(fn, iters, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # microseconds


def plan_iterations(first_us, budget_us, max_iters, warmup=3, max_call_us=None):
    """(iterations, warmup) for :func:`_time` from the time of one call: as many back-to-back calls as
    fit ``budget_us`` (at least 2, at most ``max_iters``); a call slower than the budget is timed once
    more after no warmup; (0, 0) past ``max_call_us``: keep the first call's time."""
    if max_call_us is not None and first_us > max_call_us:
        return 0, 0
    if first_us >= budget_us:
        return 1, 0
    n = int(budget_us // max(first_us, 1e-3))
    n = max(2, min(max_iters, n))
    return n, min(warmup, n)


def _build_summary(meta):
    """What ``build`` recorded: commands, the offload check per function, the CPU check of TVM's
    paged-KV kernels and how many query heads TVM's GPU decode kernel writes."""
    out = {k: meta.get(k) for k in ("build_command", "build_date", "build_s", "tvm", "arch", "providers", "page_size")}
    if meta.get("llm_cpu_check") is not None:
        out["llm_cpu_check"] = meta["llm_cpu_check"]
    for dtype, g in (meta.get("groups") or {}).items():
        out.setdefault("offload", {}).update({
            name: {k: f.get(k) for k in ("variant", "offloaded", "composites", "keeps_repeat", "check")}
            for name, f in (g.get("functions") or {}).items()})
        if g.get("llm_decode_heads_written_per_kv_head"):
            out.setdefault("llm_decode_heads_written_per_kv_head", {})[dtype] = g["llm_decode_heads_written_per_kv_head"]
    return out


def _install_cuda_cache(cache_dir, stats):
    """Serve TVM's load-time CUDA compile from the fatbins ``build`` made; anything else goes to the
    compiler registered before (the kit's nvcc hook)."""
    import tvm
    import tvm_ffi

    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    major, minor = tvm.cuda(0).compute_version.split(".")
    arch = f"sm_{major}{minor}"

    def compile_cuda(code, *rest):
        path = os.path.join(cache_dir, cuda_cache_key(str(code), arch) + ".fatbin")
        if os.path.exists(path):
            stats["hits"] += 1
            with open(path, "rb") as f:
                return bytearray(f.read())
        stats["misses"] += 1
        t0 = time.time()
        if previous is None:
            raise RuntimeError("no CUDA compiler registered (import boot first)")
        out = previous(code, *rest)
        stats["miss_compile_s"] += time.time() - t0
        return out

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def _short_error(ex):
    msg = f"{type(ex).__name__}: {ex}".strip()
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    if len(lines) > 6:
        lines = lines[:3] + ["..."] + lines[-2:]
    return "\n".join(lines)[:1500]


def compare_outputs(out, ref, dtype):
    """Numerics of ``out`` vs the FA2 reference (both ``(..., H, D)``, same element order)."""
    import torch

    o = out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)
    o = o.float().reshape(ref.shape)
    finite = torch.isfinite(o)
    nonfinite = int((~finite).sum())
    diff = (o - ref).abs()
    diff = torch.where(finite, diff, torch.full_like(diff, float("inf")))
    ref_max = float(ref.abs().max())
    finite_diff = diff[finite]
    max_abs = float(finite_diff.max()) if finite_diff.numel() else None
    tol = REL_TOL.get(dtype, 5e-2)
    per_head = diff.reshape(-1, ref.shape[-2], ref.shape[-1]).amax(dim=(0, 2))
    bad = [int(i) for i in torch.nonzero(per_head > tol * max(ref_max, 1e-6)).flatten().tolist()]
    rel = (max_abs / ref_max) if (max_abs is not None and ref_max > 0) else None
    return {
        "max_abs_err_vs_fa2": max_abs, "ref_max_abs": ref_max, "rel_err_vs_fa2": rel,
        "nonfinite_outputs": nonfinite, "bad_heads": bad[:16], "num_bad_heads": len(bad),
        "numerics_ok": bool(nonfinite == 0 and rel is not None and rel <= tol),
    }


def _case_list(meta):
    """Cases with their variants as dicts (format 1 stored ``variant -> library file``)."""
    out = []
    for c in meta["cases"]:
        vs = {}
        for name, v in c.get("variants", {}).items():
            vs[name] = v if isinstance(v, dict) else dict(kind="relax", lib=v, func="main")
        out.append({**c, "variants": vs})
    return out


def run(args):
    import torch
    import tvm
    import tvm.runtime.vm  # noqa: F401 - not loaded by tvm.runtime itself

    try:
        import boot  # noqa: F401 - runtime-only TVM on the GPU machine (see ../shared/device)
    except ImportError:
        pass
    sys.path.insert(0, _SRC)
    with open(os.path.join(args.artifacts, "cases.json")) as f:
        meta = json.load(f)
    cache_stats = {"hits": 0, "misses": 0, "miss_compile_s": 0.0}
    cache_dir = os.path.join(args.artifacts, "cuda-cache")
    if os.path.isdir(cache_dir):
        try:
            _install_cuda_cache(cache_dir, cache_stats)
        except Exception as ex:  # noqa: BLE001
            print(f"cuda cache not installed: {_short_error(ex)}", flush=True)
    provider_error = None
    if any(v.get("func", "").endswith("python") or "python" in name
           for c in _case_list(meta) for name, v in c["variants"].items()):
        try:
            import mqa_byoc.runtime.providers  # noqa: F401 - registers the python provider's entry point
        except Exception as ex:  # noqa: BLE001
            provider_error = _short_error(ex)
    dev = tvm.cuda(0)
    gpu = torch.cuda.get_device_name(0)
    t_start = time.time()
    out = {"benchmark": "attention", "suite": meta.get("suite"), "command": " ".join(sys.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "gpu": gpu,
           "torch": torch.__version__, "cuda": torch.version.cuda, "hbm_peak_tb_s": HBM_PEAK_TB_S,
           "rel_tol": REL_TOL, "budget_ms": args.budget_ms, "max_iters": args.iters,
           "build": _build_summary(meta),
           "flops_convention": "4*S_q*S_kv*H*D, halved for causal; GEMM: 2*H*S_q*S_kv*D",
           "hbm_bytes_convention": "K and V bytes: 2*S_kv*H_kv*D*sizeof(dtype)",
           "libraries": {}, "cuda_cache": cache_stats, "records": []}
    if provider_error:
        out["python_provider_error"] = provider_error
    libs, vms = {}, {}

    def library(name):
        if name not in libs:
            t0 = time.time()
            try:
                libs[name] = tvm.runtime.load_module(os.path.join(args.artifacts, name))
                out["libraries"][name] = {"load_s": round(time.time() - t0, 2)}
            except Exception as ex:  # noqa: BLE001
                libs[name] = ex
                out["libraries"][name] = {"error": _short_error(ex)}
            print(f"loaded {name} in {time.time() - t0:.1f} s", flush=True)
        if isinstance(libs[name], Exception):
            raise RuntimeError(f"library {name} failed to load: {out['libraries'][name]['error']}")
        return libs[name]

    def vm_function(lib, func):
        if lib not in vms:
            vms[lib] = tvm.runtime.vm.VirtualMachine(library(lib), dev)
        return vms[lib][func]

    def write():
        out["elapsed_s"] = round(time.time() - t_start, 1)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

    case_re = re.compile(args.cases) if args.cases else None
    skip = [s for s in (args.skip_variants or "").split(",") if s]
    cases = [c for c in _case_list(meta) if not case_re or case_re.search(c["name"])]
    budget_us = args.budget_ms * 1e3
    max_call_us = args.max_call_s * 1e6
    for ci, case in enumerate(cases):
        t_case = time.time()
        dt = getattr(torch, case["dtype"])
        s_q, s_kv, h, hkv, d = case["s_q"], case["s_kv"], case["h"], case["hkv"], case["d"]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, s_q, h, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(1, s_kv, hkv, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(1, s_kv, hkv, d, device="cuda", dtype=dt, generator=g)
        scale = 1.0 / math.sqrt(d)
        results = {}
        state = {"ref": None}

        def measure(variant, call, check=True, warmup=3, extra=None):
            if any(fnmatch.fnmatch(variant, p) for p in skip):
                return
            entry = dict(extra or {})
            try:
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                o = call()
                e.record()
                e.synchronize()
                first_us = s.elapsed_time(e) * 1e3
                if check and state["ref"] is not None:
                    entry.update(compare_outputs(o, state["ref"], case["dtype"]))
                del o
                est_us = first_us
                if 1e3 < first_us <= max_call_us:
                    # the first call may carry one-time costs (workspace allocation, module init):
                    # plan from a second one
                    s.record()
                    call()
                    e.record()
                    e.synchronize()
                    est_us = min(first_us, s.elapsed_time(e) * 1e3)
                n, w = plan_iterations(est_us, budget_us, args.iters, warmup, max_call_us)
                if n == 0:
                    us = first_us
                    entry["note"] = "one cold call (slower than --max-call-s)"
                else:
                    us = _time(call, n, warmup=w)
                entry.update(us=us, iters=n, first_call_us=round(first_us, 2))
            except Exception as ex:  # noqa: BLE001
                entry["error"] = _short_error(ex)
                if args.verbose:
                    traceback.print_exc()
            results[variant] = entry

        def fa2_direct():
            return torch.ops.aten._flash_attention_forward(
                q, k, v, None, None, s_q, s_kv, 0.0, case["causal"], False, scale=scale)[0]

        measure("fa2-direct", fa2_direct, check=False)
        if "error" not in results.get("fa2-direct", {"error": 1}):
            state["ref"] = fa2_direct().float()
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=case["causal"] and s_q > 1, scale=scale, enable_gqa=True).transpose(1, 2)

        measure("torch-sdpa-gqa", sdpa)
        gemm = None
        if case["mode"] == "prefill" and not any(fnmatch.fnmatch("cublas-qk-gemm", p) for p in skip):
            # a tensor-core GEMM of the Q@K^T shape, the ceiling the issue compares prefill with
            try:
                a = torch.randn(h, s_q, d, device="cuda", dtype=dt)
                b = torch.randn(h, d, s_kv, device="cuda", dtype=dt)
                c = torch.empty(h, s_q, s_kv, device="cuda", dtype=dt)
                measure("cublas-qk-gemm", lambda: torch.bmm(a, b, out=c), check=False)
                gemm = results.get("cublas-qk-gemm")
                del a, b, c
                if s_q * s_kv >= 4096 * 4096:
                    torch.cuda.empty_cache()  # the 16k GEMM output is tens of GB
            except Exception as ex:  # noqa: BLE001
                results["cublas-qk-gemm"] = {"error": _short_error(ex)}
        args_tvm = [tvm.runtime.from_dlpack(x) for x in (q, k, v)]
        relax_variants = [(n, vv) for n, vv in case["variants"].items() if vv.get("kind") == "relax"]
        # stock TVM last among the VM variants (slowest), TVM's paged kernels last of all (a CUDA fault
        # there would poison the context: everything measured before it is already recorded)
        relax_variants.sort(key=lambda nv: nv[0] == "stock-tvm")
        for variant, vv in relax_variants:
            try:
                f = vm_function(vv["lib"], vv["func"])
            except Exception as ex:  # noqa: BLE001
                results[variant] = {"error": _short_error(ex)}
                continue
            measure(variant, lambda f=f: f(*args_tvm), warmup=1 if variant == "stock-tvm" else 3)
        for variant, vv in case["variants"].items():
            if vv.get("kind") != "tvm-llm" or any(fnmatch.fnmatch(variant, p) for p in skip):
                continue
            try:
                f = library(vv["lib"])[vv["func"]]
                q3 = q.reshape(s_q, h, d)
                args_llm, oi = llm_kernel_args(vv["kernel"], q3, k.reshape(s_kv, hkv, d), v.reshape(s_kv, hkv, d),
                                               case["causal"], scale, meta.get("page_size", PAGE_SIZE))
                llm_out = args_llm[oi]
                targs = [tvm.runtime.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args_llm]
            except Exception as ex:  # noqa: BLE001
                results[variant] = {"error": _short_error(ex), "kernel": vv.get("kernel")}
                continue

            def call_llm(f=f, targs=targs, llm_out=llm_out):
                f(*targs)
                return llm_out

            measure(variant, call_llm, warmup=1,
                    extra={"kernel": vv["kernel"], "page_size": meta.get("page_size", PAGE_SIZE)})
            del args_llm, targs, llm_out
        base = results.get("fa2-direct", {}).get("us")
        elt = q.element_size()
        kv_bytes = 2 * s_kv * hkv * d * elt
        flops = 4 * s_q * s_kv * h * d * (0.5 if case["causal"] else 1.0)
        common = {
            "benchmark": "attention", "suite": case.get("suite", meta.get("suite")), "case": case["name"],
            "shape": case.get("shape", f"h{h}-kv{hkv}-d{d}"), "presets": case.get("presets"),
            "model": "/".join(case.get("presets") or []) or None, "mode": case["mode"], "dtype": case["dtype"],
            "num_q_heads": h, "num_kv_heads": hkv, "head_dim": d, "seq_q": s_q, "seq_kv": s_kv,
            "causal": case["causal"],
        }
        if case.get("notes"):
            common["notes"] = case["notes"]
        for variant, entry in results.items():
            rec = {**common, "variant": variant, **entry}
            us = entry.get("us")
            if us is not None:
                rec["us"] = round(us, 2)
                if base:
                    rec["ratio_vs_fa2_direct"] = round(us / base, 3)
                if variant == "cublas-qk-gemm":
                    rec["tflops"] = round(2 * h * s_q * s_kv * d / (us * 1e-6) / 1e12, 1)
                elif case["mode"] == "decode":
                    rec["hbm_tb_s"] = round(kv_bytes / (us * 1e-6) / 1e12, 3)
                    rec["hbm_fraction"] = round(kv_bytes / (us * 1e-6) / 1e12 / HBM_PEAK_TB_S, 3)
                else:
                    rec["tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
                    if gemm and gemm.get("us"):
                        rec["tflops_vs_cublas_qk_gemm"] = round(
                            (flops / us) / (2 * h * s_q * s_kv * d / gemm["us"]), 3)
            if variant == "fa2-direct":
                rec["max_abs_err_vs_fa2"] = 0.0
            out["records"].append(rec)
            err = entry.get("error")
            num = entry.get("rel_err_vs_fa2")
            print(f"{case['name']:30s} {variant:16s} "
                  + (f"{us:12.1f} us  x{us / base:8.3f} vs FA2" if (us is not None and base) else
                     f"{us:12.1f} us" if us is not None else f"{'FAILED':>12s}")
                  + (f"  rel err {num:.1e}" if num is not None else "")
                  + ("" if entry.get("numerics_ok", True) else "  NUMERICS")
                  + (f"  [{err.splitlines()[0][:100]}]" if err else ""), flush=True)
        del q, k, v, qt, kt, vt, args_tvm, state["ref"]
        if s_q * s_kv >= 4096 * 4096:
            torch.cuda.empty_cache()
        print(f"  [{ci + 1}/{len(cases)}] {case['name']} took {time.time() - t_case:.1f} s "
              f"(total {time.time() - t_start:.0f} s)", flush=True)
        write()
    write()
    print(f"wrote {args.json} ({len(out['records'])} records; cuda cache {cache_stats})")


# ----------------------------------------------------------------------------------------------
# report (here: markdown + matplotlib plots from the run's JSON)
# ----------------------------------------------------------------------------------------------


def _variant_key(v):
    return (VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER), v)


def _fmt_us(us):
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def _fmt_tflops(t):
    return f"{t:.0f}" if t >= 10 else f"{t:.2g}"


def format_cell(rec):
    """'µs (ratio vs FA2, TFLOP/s or % of HBM peak)' with a mark when the numerics are off."""
    if rec is None:
        return "–"
    if rec.get("error"):
        return "error"
    us = rec.get("us")
    if us is None:
        return "–"
    parts = []
    ratio = rec.get("ratio_vs_fa2_direct")
    if rec.get("variant") != "fa2-direct" and ratio is not None:
        parts.append(f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:,.0f}x")
    hbm = rec.get("hbm_fraction")
    if hbm is None and rec.get("hbm_tb_s") is not None:  # records of older runs
        hbm = rec["hbm_tb_s"] / HBM_PEAK_TB_S
    if hbm is not None:
        frac = 100 * hbm
        parts.append(f"{frac:.0f}% HBM" if frac >= 1 else f"{frac:.1g}% HBM")
    elif rec.get("tflops") is not None:
        parts.append(f"{_fmt_tflops(rec['tflops'])} TF/s")
    cell = _fmt_us(us) + (f" ({', '.join(parts)})" if parts else "")
    if rec.get("numerics_ok") is False:
        cell += " ✗"
    return cell


def _case_order(rec, shape_order):
    return (shape_order.get(rec.get("shape"), 99), ["float16", "bfloat16"].index(rec["dtype"])
            if rec.get("dtype") in ("float16", "bfloat16") else 9, rec.get("seq_kv", 0))


def _cell_legend(mode):
    if mode == "prefill":
        return ["ratio to FA2 direct", "attention TFLOP/s (cuBLAS column: the GEMM's own TFLOP/s)"]
    return ["ratio to FA2 direct", "K/V bytes per µs as % of the HBM peak"]


def render_markdown(data, plots=()):
    """Markdown report of one run's JSON (``run``'s output)."""
    recs = [r for r in data["records"] if r.get("benchmark", "attention") == "attention"]
    shape_order = {}
    for r in recs:
        shape_order.setdefault(r.get("shape"), len(shape_order))
    peak = data.get("hbm_peak_tb_s", HBM_PEAK_TB_S)
    lines = [f"# Attention microbenchmarks — suite `{data.get('suite')}`", ""]
    lines += [f"- GPU: {data.get('gpu')}; date (UTC): {data.get('date')}",
              f"- run: `{data.get('command')}`"]
    b = data.get("build") or {}
    if b.get("build_command"):
        lines.append(f"- build: `{b['build_command']}` ({b.get('build_date')}, TVM {b.get('tvm')}, {b.get('arch')})")
    off = b.get("offload") or {}
    if off:
        ours = [f for f in off.values() if (f.get("variant") or "").startswith("mqa")]
        rep_ = [f for f in off.values() if (f.get("variant") or "").startswith("repeat")]
        ok = all(f.get("check") == "ok" for f in ours + rep_)
        lines.append(f"- partition (symbolic lengths, one library per dtype): {len(ours)} `mqa=True` functions, each one "
                     f"`flash_attn.attention_mqa` call with the K/V `repeat` removed; {len(rep_)} `mqa=False` "
                     f"functions keep `repeat` and call `flash_attn.attention`"
                     + ("" if ok else " — CHECK FAILED, see the JSON"))
    cpu = b.get("llm_cpu_check") or []
    if cpu:
        worst = max(x["max_abs_err"] for x in cpu)
        lines.append(f"- TVM paged-KV kernels: argument order, page table and scale checked at build time on the CPU "
                     f"(llvm `*_cpu` kernels, same signatures) against numpy: max abs err {worst:.1e}")
    for dtype, cov in (b.get("llm_decode_heads_written_per_kv_head") or {}).items():
        for shape, n in cov.items():
            m = re.match(r"h(\d+)-kv(\d+)-", shape)
            if n is not None and m and n < int(m.group(1)) // int(m.group(2)):
                lines.append(f"- {shape} {DT_SHORT.get(dtype, dtype)}: TVM's `batch_decode_paged_kv` thread layout writes "
                             f"only {n} of the {int(m.group(1)) // int(m.group(2))} query heads of each K/V head "
                             f"(`bdy` is halved until it fits 512 threads; `group // bdy` drops the remainder)")
    lines += [
        f"- torch {data.get('torch')}, CUDA {data.get('cuda')}; timing: CUDA events over back-to-back calls "
        f"(per variant about {data.get('budget_ms')} ms, at most {data.get('max_iters')} calls)",
        "- cell: µs (ratio to FA2 direct; prefill: TFLOP/s with FLOPs = 4·S_q·S_kv·H·D, halved for causal; "
        f"decode: K/V bytes / time as a fraction of the H200's {peak} TB/s HBM3e peak)",
        "- ✗: output differs from FA2 direct by more than the tolerance (max |Δ| / max |FA2| > "
        + ", ".join(f"{v:g} {DT_SHORT.get(k, k)}" for k, v in (data.get("rel_tol") or REL_TOL).items())
        + "); `error`: the variant failed (see the JSON); –: not run",
        "",
        "Variants:", "",
    ]
    variants_all = sorted({r["variant"] for r in recs}, key=_variant_key)
    for v in variants_all:
        lines.append(f"- `{v}`: {VARIANT_DOC.get(v, '')}")
    lines.append("")
    for mode, title in (("prefill", "Prefill (causal, S_q = S_kv)"), ("decode", "Decode (S_q = 1)")):
        mrecs = [r for r in recs if r.get("mode") == mode or (r.get("variant") == "cublas-qk-gemm" and mode == "prefill"
                                                                and r.get("mode") in (None, "prefill"))]
        if not mrecs:
            continue
        variants = sorted({r["variant"] for r in mrecs}, key=_variant_key)
        cases = {}
        for r in mrecs:
            cases.setdefault(r["case"], {})[r["variant"]] = r
        lines += [f"## {title}", ""]
        seq = "S" if mode == "prefill" else "S_kv"
        lines.append(f"µs per call ({', '.join(_cell_legend(mode))}):")
        lines.append("")
        lines.append(f"| shape (presets) | dtype | {seq} | " + " | ".join(f"`{v}`" for v in variants) + " |")
        lines.append("|---|---|---:|" + "---:|" * len(variants))
        ordered = sorted(cases.values(), key=lambda vs: _case_order(next(iter(vs.values())), shape_order))
        for vs in ordered:
            r0 = vs.get("fa2-direct") or next(iter(vs.values()))
            shape = r0.get("shape") or f"h{r0.get('num_q_heads')}-kv{r0.get('num_kv_heads')}-d{r0.get('head_dim')}"
            model = r0.get("model")
            label = _seq_label(r0.get("seq_kv") or 0)
            dt = DT_SHORT.get(r0.get("dtype"), r0.get("dtype"))
            cells = " | ".join(format_cell(vs.get(v)) for v in variants)
            lines.append(f"| {shape}" + (f" ({model})" if model else "") + f" | {dt} | {label} | {cells} |")
        lines.append("")
    notes = sorted({n for r in recs for n in (r.get("notes") or [])})
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    bad = [r for r in recs if r.get("numerics_ok") is False]
    errs = [r for r in recs if r.get("error")]
    if bad or errs:
        lines += ["## Numerics and failures", ""]
        for r in bad:
            heads = r.get("bad_heads") or []
            rel = r.get("rel_err_vs_fa2")
            lines.append(
                f"- {r['case']} `{r['variant']}`: max |Δ| {r.get('max_abs_err_vs_fa2')} (max |FA2| "
                f"{r.get('ref_max_abs') or 0:.3g}, relative {'n/a' if rel is None else format(rel, '.2g')})"
                + (f", {r.get('nonfinite_outputs')} non-finite outputs" if r.get("nonfinite_outputs") else "")
                + (f", {r.get('num_bad_heads')} query heads off (first: {heads})" if heads else ""))
        for r in errs:
            first = r["error"].splitlines()[0][:200]
            lines.append(f"- {r['case']} `{r['variant']}` failed: {first}")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] + [""]
    return "\n".join(lines)


def render_plots(data, prefix):
    """PNG per dtype: µs vs sequence length per variant, log-log, one panel per shape x mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    recs = [r for r in data["records"] if r.get("us") is not None and r.get("shape")]
    paths = []
    for dtype in [d for d in ("float16", "bfloat16") if any(r.get("dtype") == d for r in recs)]:
        drecs = [r for r in recs if r.get("dtype") == dtype]
        shapes = list(dict.fromkeys(r["shape"] for r in drecs))
        modes = [m for m in ("prefill", "decode") if any(r.get("mode") == m for r in drecs)]
        fig, axes = plt.subplots(len(shapes), len(modes), figsize=(6.2 * len(modes), 3.8 * len(shapes)), squeeze=False)
        for i, shape in enumerate(shapes):
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                rs = [r for r in drecs if r["shape"] == shape and r.get("mode") == mode]
                for variant in sorted({r["variant"] for r in rs}, key=_variant_key):
                    pts = sorted((r["seq_kv"], r["us"], r.get("numerics_ok") is not False)
                                 for r in rs if r["variant"] == variant)
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    color = f"C{_variant_key(variant)[0] % 10}"
                    style = "--" if variant == "cublas-qk-gemm" else "-"
                    ax.plot(xs, ys, style, marker="o", ms=4, label=variant, color=color)
                    bad = [(x, y) for x, y, ok in pts if not ok]
                    if bad:
                        ax.plot([b[0] for b in bad], [b[1] for b in bad], "x", ms=11, mew=2, color=color)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ticks = sorted({r["seq_kv"] for r in rs})
                ax.set_xticks(ticks, [_seq_label(t) for t in ticks])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                model = next((r.get("model") for r in rs if r.get("model")), "")
                ax.set_title(f"{shape} ({model}) {DT_SHORT[dtype]} {mode}", fontsize=9)
                ax.set_xlabel("S (prefill, causal)" if mode == "prefill" else "S_kv (decode, S_q = 1)")
                ax.set_ylabel("µs per call")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(f"attention, {data.get('gpu')}, {DT_SHORT[dtype]} (x: numerics off vs FA2)", fontsize=10)
        fig.tight_layout()
        path = f"{prefix}-{DT_SHORT[dtype]}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def merge_runs(runs):
    """One run's JSON from several: the first one's metadata; records keyed by (case, variant), a later
    run replacing an earlier one's (e.g. a rerun of some cases or variants with ``--cases`` /
    ``--skip-variants``); the commands of all runs are kept."""
    data = dict(runs[0])
    recs = {}
    for r in runs:
        for rec in r.get("records", []):
            recs[(rec.get("case"), rec.get("variant"))] = rec
    data["records"] = list(recs.values())
    if len(runs) > 1:
        data["command"] = " ; ".join(str(r.get("command")) for r in runs)
        data["merged_runs"] = [{k: r.get(k) for k in ("command", "date", "gpu")} for r in runs]
    return data


def report(args):
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    data = merge_runs(runs)
    date = (data.get("date") or datetime.date.today().isoformat())[:10]
    name = args.name or f"{date}-attention-{data.get('suite') or 'run'}"
    os.makedirs(args.out_dir, exist_ok=True)
    prefix = os.path.join(args.out_dir, name)
    if len(args.json) > 1 or os.path.abspath(args.json[0]) != os.path.abspath(prefix + ".json"):
        with open(prefix + ".json", "w") as f:
            json.dump(data, f, indent=1)
    plots = [] if args.no_plots else render_plots(data, prefix)
    with open(prefix + ".md", "w") as f:
        f.write(render_markdown(data, plots))
    print("wrote", prefix + ".md", prefix + ".json", *plots)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the libraries (here)")
    b.add_argument("--out", default=".bench-artifacts")
    b.add_argument("--suite", default="issue4", choices=sorted(SUITES) + sorted(GROUPED_SUITES))
    b.add_argument("--providers", default=None, help="comma list; default python (issue4/full), native (issue6)")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--shapes", default=None, help="grouped suites: only these shape ids, e.g. h64-kv8-d128")
    b.add_argument("--skip-llm", action="store_true", help="grouped suites: no TVM paged-KV kernels")
    b.add_argument("--no-precompile", action="store_true", help="grouped suites: leave TVM's CUDA to load-time JIT")
    r = sub.add_parser("run", help="measure (GPU machine)")
    r.add_argument("--artifacts", default=".bench-artifacts")
    r.add_argument("--json", default="attention-results.json")
    r.add_argument("--iters", type=int, default=200, help="at most this many timed calls per variant")
    r.add_argument("--budget-ms", type=float, default=250.0, help="timed loop length per variant")
    r.add_argument("--max-call-s", type=float, default=5.0, help="a first call slower than this is not repeated")
    r.add_argument("--cases", default=None, help="regex on case names")
    r.add_argument("--skip-variants", default=None, help="comma list of glob patterns, e.g. 'tvm-llm-*,stock-tvm'")
    r.add_argument("--verbose", action="store_true")
    c = sub.add_parser("report", help="markdown table + plots from a run's JSON (here)")
    c.add_argument("json", nargs="+", help="run JSON(s); later ones replace earlier (case, variant) records")
    c.add_argument("--out-dir", default=os.path.join(_HERE, "results"))
    c.add_argument("--name", default=None, help="file name prefix (default <date>-attention-<suite>)")
    c.add_argument("--no-plots", action="store_true")
    sub.add_parser("check-llm", help="CPU check of TVM's paged-KV kernels' calling convention (here)")
    args = p.parse_args(argv)
    t0 = time.time()
    if args.cmd == "check-llm":
        res = check_llm_cpu()
        ok = all(x["ok"] for x in res)
        print("ok" if ok else "MISMATCH")
        sys.exit(0 if ok else 1)
    {"build": build, "run": run, "report": report}[args.cmd](args)
    print(f"{args.cmd} took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
