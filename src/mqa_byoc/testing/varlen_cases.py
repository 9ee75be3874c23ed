"""The var-len GPU test cases, defined once: the graph (:func:`mqa_byoc.testing.varlen_graphs.var_len_attention`
arguments), the sequence lengths, where ``max_seqlen`` lives, and the inputs made from them.

``tools/gpu/build_varlen.py`` builds them, ``tests/gpu/test_gpu_varlen.py`` checks them (tolerances:
``attention_cases.TOLERANCES``) and ``tests/gpu/test_varlen_reference_cpu.py`` checks that test's
reference on them. Importable with a runtime-only TVM (the GPU tests collect the cases there); the
graph and input functions need the full TVM.
"""

from __future__ import annotations

import numpy as np

from mqa_byoc.testing.gpu_manifest import float32_to_bfloat16_bits

SEED = 20261130

CASES = [
    dict(name="gqa82_repeat_fp16_d128_causal_chunked", graph=dict(h=8, hkv=2, d=128, expand="repeat"),
         lens_q=[37, 128, 5], lens_k=[64, 130, 9], max_on="cpu"),
    dict(name="gqa82_native_bf16_d128_full", graph=dict(h=8, hkv=2, d=128, expand="none", causal=None,
                                                        dtype="bfloat16"),
         lens_q=[17, 200, 3], lens_k=[40, 7, 3], max_on="cuda"),
    dict(name="mqa_broadcast_fp16_d64_window16", graph=dict(h=8, hkv=1, d=64, expand="broadcast", window=16),
         lens_q=[70, 1, 33], lens_k=[70, 20, 40], max_on="cpu"),
    dict(name="gqa82_hfrepeat_bf16_d128_topleft", graph=dict(h=8, hkv=2, d=128, expand="hf", causal="TopLeft",
                                                             dtype="bfloat16", same_seqstart=True),
         lens_q=[50, 129, 2], lens_k=[50, 129, 2], max_on="cuda"),
    dict(name="mqa_repeat_fp16_d64_upstream_merged", graph=dict(h=8, hkv=1, d=64, expand="repeat", merged=True,
                                                               same_seqstart=True, scale=0.1),
         lens_q=[5, 3, 8], lens_k=[5, 3, 8], max_on="cpu"),
    dict(name="gqa82_repeat_fp16_d64_causal_more_queries", graph=dict(h=8, hkv=2, d=64, expand="repeat"),
         lens_q=[20, 4, 9], lens_k=[8, 4, 9], max_on="cpu"),
]


def case_graph(case):
    from mqa_byoc.testing.varlen_graphs import var_len_attention

    return var_len_attention(**case["graph"])


def case_attention(case) -> dict:
    g = case["graph"]
    d = g.get("d", 64)
    return {"num_q_heads": g["h"], "num_kv_heads": g["hkv"], "head_dim": d, "dtype": g.get("dtype", "float16"),
            "causal": g.get("causal", "BottomRight"), "window": g.get("window"),
            "scale": g.get("scale") if g.get("scale") is not None else 1.0 / d ** 0.5}


def case_inputs(case, mod) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Parameters of ``main`` in order with their values (shapes made concrete by the lengths)."""
    from tvm import tirx

    from mqa_byoc.testing.varlen_graphs import seqstarts

    rng = np.random.default_rng([SEED, len(case["name"]), sum(map(ord, case["name"]))])
    tq, tk = sum(case["lens_q"]), sum(case["lens_k"])
    sizes = {"tq": tq, "tk": tk, "nseq": len(case["lens_q"]) + 1}
    specs, values = [], {}
    for p in mod["main"].params:
        ty = p.ty
        shape = [int(x) if isinstance(x, tirx.IntImm) else sizes[str(x)] for x in ty.shape.values]
        name, dtype = p.name, str(ty.dtype)
        if name.startswith("seqstart"):
            arr = seqstarts(case["lens_q"] if name == "seqstart_q" else case["lens_k"])
            device = "cuda"
        elif name.startswith("max_seqlen"):
            arr = np.array(max(case["lens_q"] if name == "max_seqlen_q" else case["lens_k"]), dtype="int32")
            device = case["max_on"]
        else:
            x = rng.standard_normal(shape, dtype=np.float32)
            if dtype == "bfloat16":
                arr = float32_to_bfloat16_bits(x)
            else:
                arr = x.astype(dtype)
            device = "cuda"
        assert list(arr.shape) == shape, (name, arr.shape, shape)
        specs.append({"name": name, "shape": shape, "dtype": dtype, "device": device})
        values[f"{case['name']}/{name}"] = arr
    return specs, values
