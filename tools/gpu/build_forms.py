#!/usr/bin/env python3
"""Build the GPU test artifacts on a machine with the full apache-tvm (no GPU needed).

Every case (see CASES, ``--list``) is one graph from ``mqa_byoc.testing.graphs`` in one of the forms
``partition_for_cutlass`` matches (README "What is matched"), small shapes with realistic head counts.
Written into ``--out`` (default ``.gpu-artifacts/tests``, git-ignored; its own folder, so that it can be
copied alone, without what else lives in ``.gpu-artifacts``):

- ``<case>/reference.so``: the unpartitioned graph built by plain TVM for CUDA (grouped attention made
  correct with :class:`LegalizeGroupedAttention` first). Not for sliding-window cases: TVM 0.27
  cannot lower a windowed ``R.nn.attention`` (the manifest records the error); those are checked
  against the fp32 PyTorch reference only;
- ``<case>/manifest.json``: inputs (name, shape, dtype, layout BSNH/BNSH), output (shape, layout,
  whether heads are merged into (B, S, H*D)), the attention semantics the fp32 reference needs (heads,
  causal, window, scale), the seed, the library and VM function of each variant, offload reports, the
  ops left in the partitioned function, skip reasons, sizes;
- ``_<provider>-<group>/<provider>.so`` (+ ``bundle.json``): for each provider ("python"; "native"
  with ``--native``) and each kernel group (dtype, FA2 head dim: ``fp16-hdim128``), ONE library with
  the VM functions ``<case>__mqa`` and ``<case>__nomqa`` of every case of the group, each exactly
  ``partition_for_cutlass(<case graph>, mqa=True/False, provider=...)`` with ``main`` renamed. Native
  libraries embed FA2 kernels (MBs): sharing links them once per group instead of twice per case, so
  every case gets native variants within 64 MiB.

``--build-native-kernels`` allows compiling missing FA2 kernel objects (minutes each); otherwise a
group whose kernels are missing gets no native library, and its cases' manifests say why.

Run ``tests/gpu/test_gpu_attention.py`` and ``tests/gpu/test_native_standalone.py`` on the GPU
machine (see README.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from builder_paths import ROOT  # noqa: E402 - sys.path for mqa_byoc, the graphs and the manifest format
from bundle import (TARGET, add_functions, build_library, check_exports, codegen_symbols,  # noqa: E402
                    main_ops, unique_symbols)
from gpu_inputs import MANIFEST_FORMAT  # noqa: E402
from mqa_byoc.contract import LINKED_PROVIDERS, composite_name  # noqa: E402

DEFAULT_OUT = ROOT / ".gpu-artifacts" / "tests"
EXPANSION_OPS = {"relax.repeat", "relax.broadcast_to", "relax.tile", "relax.concat", "relax.expand_dims"}

# Layouts of each builder's inputs and output; "merged": the output is (B, S, H*D).
BUILDERS = {
    "attention_repeat_bsnh": {"inputs": "BSNH", "output": "BSNH", "merged": False},
    "attention_repeat_bnsh": {"inputs": "BNSH", "output": "BNSH", "merged": False},
    "upstream_3d_chain": {"inputs": "BSNH", "output": "BSNH", "merged": False, "reference_matmul_rule": False},
    "mlc_4d_chain": {"inputs": "BSNH", "output": "BSNH", "merged": True, "reference_matmul_rule": False},
    "hf_repeat_kv_chain": {"inputs": "BNSH", "output": "BSNH", "merged": True, "reference_matmul_rule": False},
    # per-input layouts from the case's kwargs (Case.layouts)
    "attention_mixed_layouts": {"inputs": None, "output": None, "merged": False},
    # (B, S, D) in and out: one head, no head axis ("merged" (B, S, 1*D))
    "bsh_chain": {"inputs": "BSH", "output": "BSNH", "merged": True, "reference_matmul_rule": False,
                  "single_head": True},
    # torch's SDPA decomposition (enable_gqa, the safe softmax's dead-row guard), BNSH in and out
    "safe_softmax_chain": {"inputs": "BNSH", "output": "BNSH", "merged": False, "reference_matmul_rule": False},
    # TVM's ONNX frontend on an exported decoder's attention (static shapes), BNSH in and out
    "onnx_gqa_chain": {"inputs": "BNSH", "output": "BNSH", "merged": False, "reference_matmul_rule": False},
    # GPT-OSS's eager attention with sinks (HF repeat_kv, BNSH in, (B, S, H*D) out); input "sinks" (H,)
    "sink_chain": {"inputs": "BNSH", "output": "BSNH", "merged": True, "reference_matmul_rule": False,
                   "sinks": "H"},
    # Gemma 2's eager attention with logit soft-capping (HF repeat_kv, BNSH in, (B, S, H*D) out)
    "softcap_chain": {"inputs": "BNSH", "output": "BSNH", "merged": True, "reference_matmul_rule": False},
}
# TVM 0.27's dlight gpu.Matmul rule on the explicit chains' fp16 score matmuls: with apache-tvm-ffi
# 0.1.15 it segfaulted at build time; with 0.1.14 it builds a kernel that faults at run time
# (fused_matmul_divide_where_cast: CUDA misaligned address, mlc-4d chain, S_q 64, S_kv 192). A CUDA
# fault poisons the whole test process, so these references leave that one rule out.


@dataclass(frozen=True)
class Case:
    """One graph: ``mqa_byoc.testing.graphs.<builder>(**kwargs)``. Symbolic dims (str) get their values from ``run``."""

    name: str
    form: str  # README "What is matched" number and a word
    builder: str
    kwargs: dict
    run: dict = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return self.kwargs.get("dtype", "float16")

    @property
    def h(self) -> int:
        return 1 if BUILDERS[self.builder].get("single_head") else self.kwargs["h"]

    @property
    def hkv(self) -> int:
        return 1 if BUILDERS[self.builder].get("single_head") else self.kwargs["hkv"]

    @property
    def d(self) -> int:
        return self.kwargs["d"]

    def layouts(self) -> dict:
        """Per-input and output layouts where the builder takes them as arguments (else {})."""
        if self.builder != "attention_mixed_layouts":
            return {}
        q, k, v = self.kwargs.get("layouts", "BSNH,BNSH,BNSH").split(",")
        return {"q": q, "k": k, "v": v, "output": self.kwargs.get("out_layout", "BSNH")}

    def attention(self) -> dict:
        """What the graph computes, in R.nn.attention's terms (for the fp32 PyTorch reference)."""
        kw, default_scale = self.kwargs, 1.0 / math.sqrt(self.d)
        causal, window, scale = None, None, default_scale
        if self.builder == "attention_repeat_bsnh":
            causal, window = kw.get("causal", "BottomRight"), kw.get("window")
            scale = default_scale if kw.get("scale") is None else kw["scale"]
        elif self.builder in ("attention_repeat_bnsh", "attention_mixed_layouts"):
            causal = kw.get("causal", "BottomRight")
        elif self.builder == "upstream_3d_chain":
            scale = default_scale if kw.get("scale") is None else kw["scale"]
        elif self.builder == "mlc_4d_chain":
            assert kw.get("mask_const") is None and kw.get("mask", "minimum") != "runtime"
            causal = None if kw.get("mask", "minimum") == "none" else "BottomRight"  # causal_mask_np
        elif self.builder == "hf_repeat_kv_chain":
            assert not kw.get("outer")
            causal = "BottomRight"  # key j > query i masked, S_q == S_kv
        elif self.builder == "safe_softmax_chain":
            assert kw.get("cond", "torch") in ("torch", "all", "ne")
            causal = "BottomRight" if kw.get("masked") else None
        elif self.builder == "onnx_gqa_chain":
            causal = "BottomRight" if kw.get("causal", True) else None
        elif self.builder == "sink_chain":
            assert kw.get("score_mod") is None
            window = kw.get("window")
            causal = "BottomRight" if kw.get("causal", True) or window else None
        elif self.builder == "softcap_chain":
            assert kw.get("form", "gemma") in ("gemma", "reciprocal")
            window = kw.get("window")
            causal = "BottomRight" if kw.get("causal", True) or window else None
            scale = default_scale if kw.get("scale") is None else kw["scale"]
        elif self.builder == "bsh_chain":
            assert kw.get("mask", "none") != "runtime"
            causal = None if kw.get("mask", "none") == "none" else "BottomRight"
            scale = default_scale if kw.get("scale") is None else kw["scale"]
        else:
            raise ValueError(self.builder)
        return {"num_q_heads": self.h, "num_kv_heads": self.hkv, "head_dim": self.d, "causal": causal,
                "window": window, "scale": scale, "sinks": self.builder == "sink_chain",
                "softcap": kw.get("cap", 50.0) if self.builder == "softcap_chain" else None}


H, HKV, D = 16, 4, 128  # realistic head counts; shapes are small (the reference is TVM's naive attention)
GQA = dict(h=H, hkv=HKV, d=D)
CASES = [
    # form 1: R.nn.attention(q, R.repeat(k), R.repeat(v)), BSNH
    Case("repeat_gqa_f16_causal_prefill_sym", "1 repeat", "attention_repeat_bsnh",
         dict(GQA, b=2, s="s", causal="TopLeft"), run={"s": 192}),
    Case("repeat_mqa_bf16_causal_chunked", "1 repeat", "attention_repeat_bsnh",
         dict(h=H, hkv=1, d=D, b=1, s=32, s_kv=160, dtype="bfloat16")),
    Case("repeat_gqa_bf16_decode", "1 repeat", "attention_repeat_bsnh",
         dict(GQA, b=2, s=1, s_kv=256, causal=None, dtype="bfloat16")),
    # batch-1 decode: the hopper provider's FA4 split-KV decode path (its test libraries are built with hopper_fa4="always")
    Case("repeat_gqa_f16_decode_b1", "1 repeat", "attention_repeat_bsnh", dict(GQA, b=1, s=1, s_kv=1000)),
    Case("mixed_kv_bnsh_mqa_f16_hdim64_decode_b1", "1+5 mixed layouts", "attention_mixed_layouts",
         dict(h=H, hkv=1, d=64, b=1, s=1, s_kv=640, layouts="BSNH,BNSH,BNSH", causal=None)),
    # form 6: R.nn.attention with fewer K/V heads
    Case("fewer_gqa_bf16_noncausal_prefill", "6 fewer", "attention_repeat_bsnh",
         dict(h=H, hkv=2, d=D, b=1, s=128, causal=None, dtype="bfloat16", expand="none")),
    # BottomRight with S_q, S_kv both symbolic is (rightly) not offloaded: S_q <= S_kv is not provable.
    Case("fewer_gqa_f16_causal_chunked", "6 fewer", "attention_repeat_bsnh",
         dict(GQA, b=2, s=64, s_kv=256, expand="none")),
    Case("fewer_mqa_f16_decode_sym", "6 fewer", "attention_repeat_bsnh",
         dict(h=H, hkv=1, d=D, b=4, s=1, s_kv="skv", causal=None, expand="none"), run={"skv": 200}),
    # form 2: TVM upstream's explicit 3-D chain (non-causal)
    Case("upstream3d_gqa_f16_prefill", "2 upstream-3d", "upstream_3d_chain", dict(GQA, b=2, s=128)),
    Case("upstream3d_gqa_bf16_prefill_plainscale", "2 upstream-3d", "upstream_3d_chain",
         dict(GQA, b=1, s=96, dtype="bfloat16", cast_scale=False)),
    # form 3: mlc-llm 2023 Llama 4-D chain, output (B, S, H*D)
    Case("mlc4d_gqa_f16_minimum_causal", "3 mlc-4d", "mlc_4d_chain", dict(GQA, b=1, s=128, mask="minimum")),
    Case("mlc4d_gqa_bf16_add_chunked", "3 mlc-4d", "mlc_4d_chain",
         dict(GQA, b=1, s=32, s_kv=160, mask="add", divide=False, dtype="bfloat16")),
    Case("mlc4d_gqa_f16_where_chunked", "3 mlc-4d", "mlc_4d_chain", dict(GQA, b=2, s=64, s_kv=192, mask="where")),
    Case("mlc4d_gqa_f16_decode", "3 mlc-4d", "mlc_4d_chain", dict(GQA, b=4, s=1, s_kv=256, mask="none")),
    # form 4: TVM's PyTorch frontend on HF repeat_kv + eager attention, BNSH in, (B, S, H*D) out
    Case("hf_gqa_f16_causal", "4 hf-repeat-kv", "hf_repeat_kv_chain", dict(GQA, b=2, s=128)),
    Case("hf_gqa_bf16_causal", "4 hf-repeat-kv", "hf_repeat_kv_chain", dict(GQA, b=1, s=96, dtype="bfloat16")),
    Case("hf_mqa_f16_causal", "4+7 hf-repeat-kv mqa", "hf_repeat_kv_chain",
         dict(h=H, hkv=1, d=D, b=1, s=128, mqa_broadcast=True)),
    # form 5: relax.repeat on axis 1 in BNSH, BNSH out
    Case("bnsh_gqa_f16_causal_sym", "5 repeat-bnsh", "attention_repeat_bnsh", dict(GQA, b=2, s="n"), run={"n": 160}),
    Case("bnsh_gqa_bf16_noncausal", "5 repeat-bnsh", "attention_repeat_bnsh",
         dict(GQA, b=1, s=128, causal=None, dtype="bfloat16")),
    # form 7: MQA, broadcast_to of a size-1 head axis
    Case("broadcast_mqa_f16_causal", "7 mqa-broadcast", "attention_repeat_bsnh",
         dict(h=H, hkv=1, d=D, b=2, s=128, expand="broadcast")),
    Case("broadcast_mqa_bf16_causal_chunked", "7 mqa-broadcast", "attention_repeat_bsnh",
         dict(h=H, hkv=1, d=D, b=1, s=48, s_kv=176, dtype="bfloat16", expand="broadcast")),
    # Falcon-7B-like: 71 query heads, 1 K/V head, head dim 64 (fp16)
    Case("broadcast_mqa_f16_hdim64_decode", "7 mqa-broadcast", "attention_repeat_bsnh",
         dict(h=71, hkv=1, d=64, b=2, s=1, s_kv=300, causal=None, expand="broadcast")),
    # sliding window (form 1 with window_size): fp32 PyTorch reference only
    Case("window_gqa_f16_causal", "1 repeat+window", "attention_repeat_bsnh", dict(GQA, b=1, s=256, window=64)),
    Case("window_gqa_bf16_chunked", "1 repeat+window", "attention_repeat_bsnh",
         dict(GQA, b=1, s=64, s_kv=192, window=48, dtype="bfloat16")),
    Case("window_gqa_f16_decode", "1 repeat+window", "attention_repeat_bsnh",
         dict(GQA, b=2, s=1, s_kv=300, window=128)),
    # mixed layouts: composite parameters in any order, BNSH operands as strides
    Case("mixed_q_bsnh_kv_bnsh_f16_causal", "1+5 mixed layouts", "attention_mixed_layouts",
         dict(GQA, b=2, s=128, layouts="BSNH,BNSH,BNSH")),
    Case("mixed_q_bsnh_kv_bnsh_out_bnsh_bf16_chunked", "1+5 mixed layouts", "attention_mixed_layouts",
         dict(GQA, b=1, s=48, s_kv=160, layouts="BSNH,BNSH,BNSH", out_layout="BNSH", dtype="bfloat16")),
    Case("mixed_v_bnsh_f16_noncausal", "1+5 mixed layouts", "attention_mixed_layouts",
         dict(GQA, b=1, s=96, layouts="BSNH,BSNH,BNSH", causal=None)),
    Case("mixed_k_bnsh_mqa_f16_decode", "1+5 mixed layouts", "attention_mixed_layouts",
         dict(h=H, hkv=1, d=D, b=2, s=1, s_kv=200, layouts="BNSH,BNSH,BSNH", causal=None)),
    Case("mixed_q_bnsh_v_bnsh_fewer_f16_causal", "6 fewer mixed layouts", "attention_mixed_layouts",
         dict(GQA, b=1, s=64, layouts="BNSH,BSNH,BNSH", out_layout="BNSH", expand="none")),
    # the 3-D single-head chain (upstream's BSH form): (B, S, D) operands, divide by an astype'd
    # constant, causal where-mask with S_q < S_kv, float32 softmax
    Case("bsh_f16_causal_chunked", "8 bsh single-head", "bsh_chain",
         dict(d=D, b=2, s=64, s_kv=192, mask="where", divide=True)),
    # torch SDPA exported (enable_gqa=True): the safe softmax's guard, decode without a mask, and a chunk
    # after a cache under an additive -inf causal mask
    Case("sdpa_gqa_f16_decode_b1", "10 torch sdpa", "safe_softmax_chain", dict(GQA, b=1, s=1, s_kv=300)),
    Case("sdpa_gqa_bf16_causal_chunked", "10 torch sdpa", "safe_softmax_chain",
         dict(GQA, b=2, s=32, s_kv=160, masked=True, dtype="bfloat16")),
    # relax.frontend.nn: the unit axis of the expansion added by a reshape (TopLeft: nn.op's causal mask)
    Case("nn_reshape_broadcast_gqa_f16_causal_sym", "11 frontend.nn", "attention_repeat_bsnh",
         dict(GQA, b=2, s="s", causal="TopLeft", expand="reshape_broadcast"), run={"s": 160}),
    Case("nn_reshape_broadcast_gqa_bf16_decode_b1", "11 frontend.nn", "attention_repeat_bsnh",
         dict(GQA, b=1, s=1, s_kv=700, causal=None, dtype="bfloat16", expand="reshape_broadcast")),
    # TVM's ONNX frontend: Unsqueeze -> Expand -> Reshape, Transpose, MatMul, Div, additive mask, Softmax
    Case("onnx_gqa_f16_causal_chunked", "12 onnx", "onnx_gqa_chain", dict(GQA, b=2, s=64, s_kv=192)),
    Case("onnx_gqa_f16_decode_b1", "12 onnx", "onnx_gqa_chain", dict(GQA, b=1, s=1, s_kv=500, causal=False)),
    # attention with sinks (GPT-OSS: 64 query heads, 8 K/V heads, head dim 64, full and 128-key sliding
    # layers, float32 sinks): FA2 + the sink epilogue; decode on our decode kernel (its base-2 LSE), and on
    # FA2 split-KV (the LSE of its combine) with the kernel option decode_kernel=fa2
    Case("sink_gptoss_f16_hdim64_causal_prefill", "13 sinks", "sink_chain",
         dict(h=64, hkv=8, d=64, b=1, s=192)),
    Case("sink_gptoss_f16_hdim64_window_chunked", "13 sinks", "sink_chain",
         dict(h=64, hkv=8, d=64, b=2, s=64, s_kv=320, window=128, shift="max")),
    Case("sink_gptoss_bf16_hdim64_decode_b1", "13 sinks", "sink_chain",
         dict(h=64, hkv=8, d=64, b=1, s=1, s_kv=1000, dtype="bfloat16", causal=False)),
    Case("sink_gptoss_f16_hdim64_window_decode", "13 sinks", "sink_chain",
         dict(h=64, hkv=8, d=64, b=3, s=1, s_kv=300, window=128, sinks_dtype="float16")),
    Case("sink_gqa_bf16_causal_prefill_sinks_bf16", "13 sinks", "sink_chain",
         dict(h=H, hkv=HKV, d=64, b=2, s=96, dtype="bfloat16", sinks_dtype="bfloat16")),
    # logit soft-capping (Gemma 2-2b: 8 query heads, 4 K/V heads, head dim 256, cap 50 with its
    # query_pre_attn_scalar 256 scale, 4096-key sliding layers; smaller caps where the cap must bend the
    # scores of these inputs): FA2's soft-capping families, decode on FA2 split-KV (batch 1: our chunked
    # split-KV and combine)
    Case("softcap_gemma2_bf16_hdim256_causal_prefill", "14 soft-capping", "softcap_chain",
         dict(h=8, hkv=4, d=256, b=1, s=192, dtype="bfloat16", cap=50.0, scale=256 ** -0.5)),
    Case("softcap_gemma2_bf16_hdim256_window_chunked_cap2", "14 soft-capping", "softcap_chain",
         dict(h=8, hkv=4, d=256, b=2, s=64, s_kv=320, window=128, dtype="bfloat16", cap=2.0)),
    Case("softcap_gemma2_bf16_hdim256_decode_b1_cap1", "14 soft-capping", "softcap_chain",
         dict(h=8, hkv=4, d=256, b=1, s=1, s_kv=1000, causal=False, dtype="bfloat16", cap=1.0)),
    Case("softcap_gemma2_bf16_hdim256_window_decode_cap2", "14 soft-capping", "softcap_chain",
         dict(h=8, hkv=4, d=256, b=3, s=1, s_kv=300, window=128, dtype="bfloat16", cap=2.0, form="reciprocal")),
]


# ---------------------------------------------------------------------------------------------
# graphs


def build_graph(case: Case):
    from mqa_byoc.testing import graphs

    return getattr(graphs, case.builder)(**case.kwargs)


def _concrete(shape, case: Case) -> list[int]:
    out = []
    for x in shape:
        if hasattr(x, "value"):
            out.append(int(x.value))
        else:
            name = getattr(x, "name", None) or str(x)
            if name not in case.run:
                raise SystemExit(f"{case.name}: symbolic dim {name} has no value in run={case.run}")
            out.append(int(case.run[name]))
    return out


def _seq_len(spec: dict) -> int:
    """Sequence length of an input described by :func:`describe_io` (BNSH: axis 2; BSNH, BSH: axis 1)."""
    return spec["shape"][2 if spec["layout"] == "BNSH" else 1]


def describe_io(case: Case, mod) -> tuple[list[dict], dict]:
    """Input specs (with layout) and output spec, checked against the heads / head dim of the case."""
    lay = dict(BUILDERS[case.builder], **case.layouts())
    func = mod["main"]
    inputs = []
    for p in func.params:
        shape = _concrete(p.ty.shape, case)
        layout = lay.get(p.name, lay["inputs"])
        spec = {"name": p.name, "shape": shape, "dtype": str(p.ty.dtype), "layout": layout}
        if p.name == "sinks" and lay.get("sinks") == "H":  # one logit per query head
            if shape != [case.h]:
                raise SystemExit(f"{case.name}: sinks {spec}, expected ({case.h},)")
            inputs.append(dict(spec, layout="H"))
            continue
        heads = case.h if p.name == "q" else case.hkv
        bsnh = shape[:2] + [1] + shape[2:] if layout == "BSH" else shape  # BSH: one head
        hax = 1 if layout == "BNSH" else 2
        if p.name not in ("q", "k", "v") or len(bsnh) != 4 or bsnh[hax] != heads or bsnh[3] != case.d:
            raise SystemExit(f"{case.name}: input {spec} does not match {layout} with {heads} heads, "
                             f"head dim {case.d}")
        inputs.append(spec)
    q = next(i for i in inputs if i["name"] == "q")
    k = next(i for i in inputs if i["name"] == "k")
    b, sq, skv = q["shape"][0], _seq_len(q), _seq_len(k)
    want = [b, sq, case.h * case.d] if lay["merged"] else (
        [b, sq, case.h, case.d] if lay["output"] == "BSNH" else [b, case.h, sq, case.d])
    shape = _concrete(func.ret_ty.shape, case)
    if shape != want:
        raise SystemExit(f"{case.name}: output shape {shape}, expected {want} for layout {lay}")
    output = {"shape": shape, "dtype": str(func.ret_ty.dtype), "layout": lay["output"],
              "heads_merged": lay["merged"], "seq_q": sq, "seq_kv": skv, "batch": b}
    return inputs, output


def partition_checked(case: Case, mod, mqa: bool, provider: str, function: str = "main"):
    """``partition_for_cutlass`` + its offload report; every site must be offloaded as expected."""
    import mqa_byoc

    part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
    report = [s.as_dict() for s in mqa_byoc.offload_report(mod, mqa=mqa)]
    want = composite_name(case.h, case.hkv if mqa else case.h, sinks=case.attention()["sinks"],
                          softcap=bool(case.attention()["softcap"]))
    if not report or not all(s["offloaded"] and s["composite"] == want for s in report):
        raise SystemExit(f"{case.name}/mqa={mqa}: expected every site offloaded as {want}, report: {report}")
    att = case.attention()
    for s in report:
        if bool(s["causal"]) != bool(att["causal"]) or s["window"] != att["window"] or \
                not math.isclose(s["scale"], att["scale"], rel_tol=2e-3):
            raise SystemExit(f"{case.name}/mqa={mqa}: report {s} disagrees with the case semantics {att}")
    ops = main_ops(part, function)
    if mqa:
        left = sorted(set(ops) & EXPANSION_OPS)
        if left:
            raise SystemExit(f"{case.name}: mqa=True left K/V expansion ops in {function}: {left}\n{part[function]}")
    return part, report, ops


# ---------------------------------------------------------------------------------------------
# building


def build_case(case: Case, out_dir: Path, args) -> dict:
    """``<out>/<case>/``: the TVM reference library (where TVM can lower the graph) and the manifest."""
    import tvm

    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention

    target = tvm.target.Target(TARGET)
    case_dir = out_dir / case.name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    mod = build_graph(case)
    inputs, output = describe_io(case, mod)
    attention = case.attention()
    manifest = {
        "format": MANIFEST_FORMAT,
        "case": asdict(case),
        "target": TARGET,
        "tvm_version": tvm.__version__,
        "seed": args.seed,
        "input_generation": "numpy default_rng([seed, crc32(case name), input index]).standard_normal(shape, "
                            "float32) rounded to dtype (tests/gpu/gpu_inputs.py)",
        "inputs": inputs,
        "output": output,
        "attention": attention,
        "kv_expanded_in_graph": case.hkv < case.h and case.kwargs.get("expand") != "none",
        "nomqa_expands_kv": case.hkv < case.h,  # mqa=False: K/V expanded by TVM kernels before FA2
        "reference": {},
        "modules": {},  # variant -> library, relative to this folder
        "functions": {},  # variant -> VM function in it (default "main")
        "bundles": {},  # provider -> shared library folder
        "skipped": {},  # provider -> why its variants were not built
        "reports": {},
        "ops_after_partition": {},
        "sizes": {},
    }

    t0 = time.time()
    matmul_rule = BUILDERS[case.builder].get("reference_matmul_rule", True)
    pipeline = "default" if matmul_rule else reference_pipeline_without_matmul_rule(target)
    try:
        # LegalizeGroupedAttention is a no-op without grouped attention
        ex = tvm.compile(LegalizeGroupedAttention()(mod), target=target, relax_pipeline=pipeline)
    except Exception as err:  # noqa: BLE001
        if attention["window"] is None and not attention["sinks"]:
            raise
        why = str(err).strip().splitlines()[-1]
        manifest["reference"] = {"kind": "fp32-torch-only",
                                 "reason": f"TVM {tvm.__version__} cannot lower "
                                           f"{'the sink chain' if attention['sinks'] else 'R.nn.attention with window_size'}"
                                           f": {type(err).__name__}: {why}"}
    else:
        ex.export_library(str(case_dir / "reference.so"))
        manifest["modules"]["reference"] = "reference.so"
        manifest["sizes"]["reference"] = (case_dir / "reference.so").stat().st_size
        manifest["reference"] = {"kind": "tvm", "reason": "unpartitioned graph, LegalizeGroupedAttention, "
                                                           "TVM's own CUDA lowering" + (
            "" if matmul_rule else " (default CUDA pipeline without dlight gpu.Matmul: its kernel for the "
                                   "explicit chains' fp16 score matmuls faults (misaligned address) in TVM 0.27)")}
    write_manifest(case_dir, manifest)
    print(f"{case.name}: reference {manifest['reference']['kind']} in {time.time() - t0:.1f}s", flush=True)
    return manifest


def reference_pipeline_without_matmul_rule(target):
    """TVM's default CUDA pipeline with dlight's ``gpu.Matmul`` rule left out of the default schedule."""
    import tvm
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.s_tir import dlight as dl

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        legalize = cuda.legalize_passes(target)[:-1] + [
            dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())]
        with target:
            return tvm.transform.Sequential(cuda.library_dispatch_passes(target) + legalize +
                                            cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target))(mod)

    return _pipeline


def write_manifest(case_dir: Path, manifest: dict) -> None:
    manifest = {k: v for k, v in manifest.items() if k != "dir"}
    (case_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def kernel_group(case: Case) -> str:
    """Cases that need the same FA2 kernels share a library: ``fp16-hdim128``."""
    from mqa_byoc.kernels import kernel_head_dim, normalize_dtype

    return f"{normalize_dtype(case.dtype)}-hdim{kernel_head_dim(case.d)}"


def _renamed_partition(case: Case, variant: str, mqa: bool, provider: str):
    """The case partitioned for ``provider``, main renamed ``<case>__<variant>`` and its offloaded
    functions given unique symbols, so that several cases share one library."""
    import tvm

    fname = f"{case.name}__{variant}"
    mod = build_graph(case)  # fresh Relax vars per function
    mod = tvm.IRModule({fname: mod["main"].with_attr("global_symbol", fname)})
    part, report, ops = partition_checked(case, mod, mqa, provider, fname)
    return unique_symbols(part, fname), fname, report, ops


def fa4_keys(part) -> list[str | None]:
    """The FA4 object of each offloaded function (None: the hopper provider keeps it on FA2)."""
    from mqa_byoc.compiler.codegen import hopper as hopper_codegen
    from mqa_byoc.compiler.codegen.dispatch import spec_of

    keys = [hopper_codegen.kernel_key(spec_of(f)) for f in part.functions.values()
            if f.attrs is not None and "Codegen" in f.attrs]
    return [k.label if k is not None else None for k in keys]


def build_bundle(provider: str, group: str, cases: list[Case], out_dir: Path, args) -> tuple[dict, str | None]:
    """``<out>/_<provider>-<group>/<provider>.so``: ``<case>__mqa`` and ``<case>__nomqa`` of every case
    of one kernel group, each exactly ``partition_for_cutlass(<case graph>, mqa=..., provider=...)``
    (main renamed). Native: FA2 kernels linked once per group, not twice per case."""
    from mqa_byoc.compiler.export import collect_hopper_keys, collect_kernel_keys

    t0 = time.time()
    name = f"_{provider}-{group}"
    bundle_dir = out_dir / name
    if bundle_dir.exists():
        shutil.rmtree(bundle_dir)
    bundle_dir.mkdir(parents=True)
    funcs, entries, symbols = {}, {}, []
    for case in cases:
        for variant, mqa in (("mqa", True), ("nomqa", False)):
            part, fname, report, ops = _renamed_partition(case, variant, mqa, provider)
            symbols += codegen_symbols(part)
            add_functions(funcs, part, f"bundle {name}")
            entries[fname] = {"case": case.name, "variant": f"{variant}_{provider}", "report": report,
                              "ops_after_partition": ops, "fa4_keys": fa4_keys(part) if provider == "hopper" else []}
    path = bundle_dir / f"{provider}.so"
    try:
        ex, _seconds = build_library(funcs, path, provider, args)
    except Exception as err:  # noqa: BLE001 - native kernels may be unavailable here
        if provider not in LINKED_PROVIDERS:
            raise
        shutil.rmtree(bundle_dir)
        why = f"{name} not built: {type(err).__name__}: {err}"
        print(f"  {why}", flush=True)
        return {}, why
    keys = collect_kernel_keys(ex)
    fa4 = collect_hopper_keys(ex)
    info = {
        "provider": provider,
        "group": group,
        "library": path.name,
        "size": path.stat().st_size,
        "cases": [c.name for c in cases],
        "functions": {f: {k: v for k, v in e.items() if k != "report"} for f, e in entries.items()},
        "exports": check_exports(path, symbols, ([k.entry_symbol for k in keys] + [f"__tvm_ffi_{k.symbol}" for k in fa4])
                                 if provider in LINKED_PROVIDERS else None),
        "fa2_kernels_linked": [k.label for k in keys] if provider in LINKED_PROVIDERS else [],
        "fa4_kernels_linked": [k.label for k in fa4],
        "note": f"each function is partition_for_cutlass(<case graph>, mqa=..., provider={provider!r}) with main "
                "renamed; the cases of one kernel group share one library",
    }
    (bundle_dir / "bundle.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"{name}: {len(entries)} functions, {info['size'] / 2**20:.2f} MiB in {time.time() - t0:.1f}s", flush=True)
    info["entries"], info["dir"] = entries, bundle_dir
    return info, None


def attach_bundles(provider: str, manifests: dict[str, dict], out_dir: Path, args) -> None:
    groups: dict[str, list[Case]] = {}
    for case in CASES:
        if case.name in manifests:
            groups.setdefault(kernel_group(case), []).append(case)
    for group, cases in sorted(groups.items()):
        info, why = build_bundle(provider, group, cases, out_dir, args)
        for case in cases:
            m = manifests[case.name]
            if why:
                m["skipped"][provider] = why
            else:
                rel = os.path.relpath(info["dir"] / info["library"], m["dir"])
                for variant in ("mqa", "nomqa"):
                    fname = f"{case.name}__{variant}"
                    entry, key = info["entries"][fname], f"{variant}_{provider}"
                    m["modules"][key] = rel
                    m["functions"][key] = fname
                    m["ops_after_partition"][key] = entry["ops_after_partition"]
                    if provider == "hopper":
                        # FA4 runs the call when every site has an object and no causal row lacks a key
                        # (the test libraries are built with the kernel option hopper_fa4="always")
                        out = m["output"]
                        m.setdefault("fa4_expected", {})[key] = bool(entry["fa4_keys"]) and all(
                            entry["fa4_keys"]) and (not m["attention"]["causal"] or out["seq_q"] <= out["seq_kv"])
                    m["reports"].setdefault(variant, entry["report"])
                m["bundles"][provider] = {"folder": info["dir"].name, "size": info["size"],
                                          "shared_with": [c.name for c in cases if c.name != case.name]}
            write_manifest(Path(m["dir"]), m)


def _ours(d: Path) -> bool:
    """A folder this script wrote (case or bundle), not e.g. a prebuilt-kernel folder."""
    if (d / "bundle.json").exists() or d.name.startswith(("_python-", "_native-", "_hopper-")):
        return True
    try:
        return "case" in json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        files = list(d.iterdir())  # an interrupted format-1 case: reference/mqa/nomqa libraries only
        return bool(files) and all(f.name == "reference.so" or re.fullmatch(r"(no)?mqa_\w+\.so", f.name)
                                   for f in files)


def artifact_files(out_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(out_dir)): p.stat().st_size for d in out_dir.iterdir() if d.is_dir() and _ours(d)
            for p in sorted(d.rglob("*")) if p.is_file()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="artifact folder (default .gpu-artifacts/tests)")
    ap.add_argument("--cases", nargs="*", help="build only these cases (the folder then holds only them)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--native", action="store_true", help="also build the native-provider libraries")
    ap.add_argument("--hopper", action="store_true",
                    help="also build the hopper-provider libraries (FA4 sm90 objects: prebuilt, or compiled "
                         "here in seconds when flash-attn-4 is installed; FA2 kernels as for --native)")
    ap.add_argument("--build-native-kernels", action="store_true",
                    help="with --native: compile missing FA2 kernel objects (minutes each)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs for native kernels")
    ap.add_argument("--seed", type=int, default=0, help="seed for the random inputs (stored in the manifests)")
    args = ap.parse_args(argv)

    if args.list:
        for c in CASES:
            print(f"{c.name}: form {c.form}, {c.builder}({', '.join(f'{k}={v!r}' for k, v in c.kwargs.items())})"
                  + (f" run={c.run}" if c.run else ""))
        return 0
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}")
    selected = [c for c in CASES if not args.cases or c.name in args.cases]
    args.out.mkdir(parents=True, exist_ok=True)
    for d in args.out.iterdir():  # libraries are shared between cases: rebuild all of them
        if d.is_dir() and _ours(d):
            shutil.rmtree(d)
    t0 = time.time()
    manifests = {}
    for case in selected:
        m = build_case(case, args.out, args)
        m["dir"] = str(args.out / case.name)
        manifests[case.name] = m
    attach_bundles("python", manifests, args.out, args)
    for provider, flag in (("native", args.native), ("hopper", args.hopper)):
        if flag:
            attach_bundles(provider, manifests, args.out, args)
        else:
            for m in manifests.values():
                m["skipped"][provider] = f"built without --{provider}"
                write_manifest(Path(m["dir"]), m)
    files = artifact_files(args.out)
    total = sum(files.values())
    folder = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"total {total / 2**20:.1f} MiB in {len(files)} files ({time.time() - t0:.0f}s); the folder {args.out} "
          f"holds {folder / 2**20:.1f} MiB in all (copied to the GPU machine with the runtime kit)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
