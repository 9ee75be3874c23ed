"""Suites, their cases and variants, and the conventions of the report (pure logic, no TVM)."""

from __future__ import annotations

import re

SUITES = {
    # two cases of the largest GQA preset: H=64, H_kv=8, D=128 fp16
    "smoke": [
        dict(name="decode-16k", mode="decode", h=64, hkv=8, d=128, dtype="float16", s_q=1, s_kv=16384, causal=False),
        dict(name="prefill-2k-causal", mode="prefill", h=64, hkv=8, d=128, dtype="float16", s_q=2048, s_kv=2048,
             causal=True),
    ],
}

SUITES["full"] = SUITES["smoke"] + [
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
    "presets": dict(dtypes=("float16", "bfloat16"), prefill=(1024, 4096, 16384), decode=(1024, 4096, 16384, 32768)),
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
    "fa2-direct", "mqa-hopper", "mqa-native", "mqa-python", "repeat-native", "repeat-python", "torch-sdpa-gqa",
    "tvm-llm-ragged", "tvm-llm-paged", "stock-tvm", "cublas-qk-gemm",
]

VARIANT_DOC = {
    "fa2-direct": "FA2 called directly (PyTorch's `aten._flash_attention_forward`, native K/V heads); the reference",
    "mqa-native": "ours: `partition_for_cutlass(mqa=True)`, native provider (FA2 linked into the library; decode: our "
                  "grouped-query decode kernel, `native/gqa_decode.cu`), via TVM's VM",
    "mqa-python": "ours, Python provider (FA2 through a Python bridge)",
    "mqa-hopper": "ours, hopper provider: FA4's sm90 kernel (flash-attn-4, compiled ahead of time and linked) for "
                  "prefill-sized calls, our grouped-query decode kernel for decode, as `mqa-native` "
                  "(kernel option hopper_fa4=\"always\": FA4 for every call, decode through our split-KV around it)",
    "mqa-native-fa2-combine": "`mqa-native` built with the kernel option `split_combine=\"fa2\"`: FA2's own split-KV and combine kernel "
                              "for batch-1 decode instead of ours (artifacts built with `build --kernel-options split_combine=fa2`)",
    "mqa-hopper-fa4-decode": "`mqa-hopper` built with the kernel option `hopper_fa4=\"always\"`: batch-1 decode through our split-KV around "
                             "FA4's sm90 kernel (artifacts built with `build --kernel-options hopper_fa4=always`)",
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


def preset_shapes(presets=None):
    """The distinct (H, H_kv, D) of the model presets, in preset order, each naming its presets.

    ``presets``: name -> DecoderConfig (default ``mqa_byoc.models.presets.PRESETS``).
    """
    if presets is None:
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
                        name=f"{sh['shape']}-{DT_SHORT[dt]}-{mode}-{seq_label(n)}", suite=name, group=dt,
                        shape=sh["shape"], presets=list(sh["presets"]), mode=mode, h=sh["h"], hkv=sh["hkv"],
                        d=sh["d"], dtype=dt, s_q=s_q, s_kv=n, causal=mode == "prefill",
                        stock=s_q * n <= STOCK_MAX_WORK, notes=list(sh["notes"]),
                    ))
    return cases

def seq_label(n):
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
