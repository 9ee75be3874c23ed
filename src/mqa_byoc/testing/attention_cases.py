"""The graph-form GPU test cases, each defined once: the graph (a builder of
:mod:`mqa_byoc.testing.graphs` and its arguments), what ``partition_for_cutlass`` must make of it and the
tolerances its outputs are checked with.

``tools/gpu/build_forms.py`` builds the artifacts of every case of :data:`CASES` (and fails unless each
site is offloaded as :meth:`Case.expected_composite` says); ``tests/gpu/test_gpu_attention.py`` and
``test_native_standalone.py`` check the outputs with :meth:`Case.tolerances` and the kernels against
:attr:`Case.nomqa_expands_kv`, reading the case by name from here. Adding a case is one entry of
:data:`CASES`.

Importable with a runtime-only TVM (the GPU tests read it there): the graph functions import
``tvm.relax`` when called.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from mqa_byoc.contract import composite_name

# Tolerances of a case's outputs, by dtype: against the fp32 PyTorch reference and between two runs of
# FA2 kernels ("fp32"), and against TVM's naive reference, which computes in the input dtype
# (fp16/bf16 accumulation), so it gets the looser one ("tvm_reference"). "same_kernel": the same FA2
# kernel on both sides (the native library in a process of its own vs the python provider): only
# accumulation order / split-KV choices may differ.
TOLERANCES = {
    "fp32": {"float16": dict(atol=1e-2, rtol=1e-2), "bfloat16": dict(atol=3e-2, rtol=3e-2)},
    "tvm_reference": {"float16": dict(atol=4e-2, rtol=4e-2), "bfloat16": dict(atol=1.2e-1, rtol=1e-1)},
    "same_kernel": {"float16": dict(atol=5e-3, rtol=5e-3), "bfloat16": dict(atol=2e-2, rtol=2e-2)},
}

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
    # the query viewed as (B, H_kv, G, S, D) against K/V with a unit group axis, BNSH in and out
    "grouped_5d_chain": {"inputs": "BNSH", "output": "BNSH", "merged": False, "reference_matmul_rule": False},
    # torch.einsum in a user's module through torch.export (float32 result); layouts from the case's kwargs
    "einsum_chain": {"inputs": None, "output": None, "merged": False, "reference_matmul_rule": False},
    # multi-head latent attention: V's head dim (kwarg dv) smaller than Q/K's, BNSH in, (B, S, H*dv) out
    "mla_chain": {"inputs": "BNSH", "output": "BSNH", "merged": True, "reference_matmul_rule": False},
    # nn.MultiheadAttention: (S, B, H*D) in and out, sequence first
    "multihead_seq_first_chain": {"inputs": "SBE", "output": "SBE", "merged": True, "reference_matmul_rule": False,
                                  "mha": True},
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
    # {"fp32" | "tvm_reference" | "same_kernel": {"atol": .., "rtol": ..}}: where this case needs other
    # tolerances than TOLERANCES gives its dtype
    tolerance: dict | None = None

    @property
    def dtype(self) -> str:
        return self.kwargs.get("dtype", "float16")

    @property
    def h(self) -> int:
        return 1 if BUILDERS[self.builder].get("single_head") else self.kwargs["h"]

    @property
    def hkv(self) -> int:
        if self.builder in ("mla_chain", "multihead_seq_first_chain"):  # as many K/V heads as query heads
            return self.kwargs["h"]
        return 1 if BUILDERS[self.builder].get("single_head") else self.kwargs["hkv"]

    @property
    def d(self) -> int:
        return self.kwargs["d"]

    @property
    def dv(self) -> int:
        """V's (and the output's) head dim: ``d`` but in multi-head latent attention."""
        return self.kwargs.get("dv", self.d)

    def layouts(self) -> dict:
        """Per-input and output layouts where the builder takes them as arguments (else {})."""
        if self.builder == "einsum_chain":
            layout = self.kwargs.get("layout", "bhsd")
            lay = "BSNH" if layout == "bshd" else "BNSH"
            kv = "BSH" if layout == "palm" else lay  # PaLM-style K/V: (B, S, D), no head axis
            return {"q": lay, "k": kv, "v": kv, "output": lay, "inputs": lay}
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
            causal = None if kw.get("mask", "minimum") == "none" else "BottomRight"  # causal_mask_np or chunked
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
        elif self.builder == "grouped_5d_chain":
            assert not kw.get("outer") and kw.get("inputs", "4d") == "4d"
            causal = "BottomRight" if kw.get("causal", True) else None  # S_q == S_kv
        elif self.builder == "einsum_chain":
            causal = "BottomRight" if kw.get("causal", True) else None
        elif self.builder == "mla_chain":
            causal = "BottomRight" if kw.get("causal", True) else None  # S_q == S_kv
            scale = default_scale if kw.get("scale") is None else kw["scale"]
        elif self.builder == "multihead_seq_first_chain":
            causal = "BottomRight" if kw.get("causal") else None  # S_q == S_kv where causal
        elif self.builder == "bsh_chain":
            assert kw.get("mask", "none") != "runtime"
            causal = None if kw.get("mask", "none") == "none" else "BottomRight"
            scale = default_scale if kw.get("scale") is None else kw["scale"]
        else:
            raise ValueError(self.builder)
        return {"num_q_heads": self.h, "num_kv_heads": self.hkv, "head_dim": self.d, "head_dim_v": self.dv,
                "causal": causal,
                "window": window, "chunk": kw.get("chunk"), "scale": scale, "sinks": self.builder == "sink_chain",
                "softcap": kw.get("cap", 50.0) if self.builder == "softcap_chain" else None}


    def tolerances(self) -> dict:
        """``{"fp32": .., "tvm_reference": .., "same_kernel": ..}``, each ``dict(atol=, rtol=)``."""
        out = {kind: by_dtype[self.dtype] for kind, by_dtype in TOLERANCES.items()}
        out.update(self.tolerance or {})
        return out

    def expected_composite(self, mqa: bool) -> str:
        """The composite every attention site of the graph is offloaded as (``mqa=False``: the K/V
        expansion is kept, FA2 runs with as many K/V heads as query heads)."""
        att = self.attention()
        return composite_name(self.h, self.hkv if mqa else self.h, sinks=att["sinks"], softcap=bool(att["softcap"]))

    @property
    def kv_expanded_in_graph(self) -> bool:
        """Does the graph expand K/V to the query heads (an op ``mqa=True`` removes)?"""
        return self.hkv < self.h and self.kwargs.get("expand") != "none"

    @property
    def nomqa_expands_kv(self) -> bool:
        """``mqa=False`` runs TVM kernels that expand K/V before FA2."""
        return self.hkv < self.h

    def as_dict(self) -> dict:
        return asdict(self)



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
    Case("repeat_gqa_bf16_causal_q_heads_innermost", "1 repeat, query viewed heads-innermost", "attention_repeat_bsnh",
         dict(GQA, b=2, s=96, dtype="bfloat16", q_view="heads_innermost")),
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
    # a chunked mask (Llama 4's chunked layers): whole blocks batched in one call (prefill: two, then a short
    # block; whole_blocks: after a past of one block), a block entered midway alone (past)
    Case("mlc4d_gqa_f16_where_chunked_mask_prefill", "3 mlc-4d chunked mask", "mlc_4d_chain",
         dict(GQA, b=2, s=160, mask="where", chunk=64)),
    Case("mlc4d_gqa_bf16_add_chunked_mask_past", "3 mlc-4d chunked mask", "mlc_4d_chain",
         dict(GQA, b=1, s=80, s_kv=176, mask="add", chunk=64, dtype="bfloat16")),
    Case("mlc4d_gqa_f16_minimum_chunked_mask_whole_blocks", "3 mlc-4d chunked mask", "mlc_4d_chain",
         dict(GQA, b=2, s=128, s_kv=192, mask="minimum", chunk=64)),
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
    # the same sinks applied after attention (GraniteSWA: o * sigmoid(logsumexp(s) - sink), torch's
    # log-sum-exp decomposition): the same composite, rooted at the multiply
    Case("sinkout_granite_f16_hdim64_window_chunked", "13 sinks", "sink_chain",
         dict(h=64, hkv=8, d=64, b=2, s=64, s_kv=320, window=128, sink_at="output")),
    Case("sinkout_granite_bf16_hdim64_decode", "13 sinks", "sink_chain",
         dict(h=H, hkv=HKV, d=64, b=3, s=1, s_kv=700, dtype="bfloat16", causal=False, sink_at="output",
              lse="plain")),
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
    # 15 torch.einsum in a user's module (torch.export, ToMixedPrecision; the result cast to float32)
    Case("einsum_bhsd_gqa_f16_causal_prefill", "15 einsum", "einsum_chain", dict(GQA, b=2, s=128)),
    Case("einsum_bshd_gqa_f16_causal_chunked", "15 einsum", "einsum_chain",
         dict(GQA, b=2, s=64, s_kv=192, layout="bshd")),
    Case("einsum_bshd_gqa_f16_decode_b1", "15 einsum", "einsum_chain",
         dict(GQA, b=1, s=1, s_kv=300, layout="bshd", causal=False)),
    Case("einsum_palm_mqa_f16_causal_prefill", "15 einsum (heads folded into rows)", "einsum_chain",
         dict(h=H, hkv=1, d=D, b=2, s=128, layout="palm")),
    Case("einsum_palm_mqa_f16_decode_b1", "15 einsum (heads folded into rows)", "einsum_chain",
         dict(h=H, hkv=1, d=D, b=1, s=1, s_kv=300, layout="palm", causal=False)),
    # 16 the query viewed as (B, H_kv, G, S, D), K/V broadcast over the groups by the matmuls
    Case("grouped5d_gqa_f16_causal_prefill", "16 grouped 5-D", "grouped_5d_chain", dict(GQA, b=2, s=128)),
    Case("grouped5d_gqa_bf16_noncausal", "16 grouped 5-D", "grouped_5d_chain",
         dict(GQA, b=1, s=96, dtype="bfloat16", causal=False)),
    # 17 multi-head latent attention: V's head dim smaller than Q/K's (V padded with zeros to d)
    Case("mla_f16_d128_dv64_causal_prefill", "17 mla", "mla_chain", dict(h=H, d=D, dv=64, b=2, s=128)),
    Case("mla_bf16_d128_dv64_causal_scale", "17 mla", "mla_chain",
         dict(h=H, d=D, dv=64, b=1, s=96, dtype="bfloat16", scale=0.1)),
    Case("mla_f16_d64_dv32_noncausal_sym", "17 mla", "mla_chain",
         dict(h=H, d=64, dv=32, b=1, s="n", causal=False), run={"n": 80}),
    # 18 nn.MultiheadAttention (docs/graph_forms.md): sequence-first (S, B, H*D) operands, transposed to
    # batch-first for the kernels
    Case("multihead_seq_first_f16_noncausal_cross", "18 multihead seq-first", "multihead_seq_first_chain",
         dict(h=8, d=64, b=2, s=96, s_kv=160)),
    Case("multihead_seq_first_f16_causal_prefill", "18 multihead seq-first", "multihead_seq_first_chain",
         dict(h=16, d=64, b=3, s=128, causal=True)),
    Case("multihead_seq_first_f16_hdim128_decode", "18 multihead seq-first", "multihead_seq_first_chain",
         dict(h=8, d=128, b=4, s=1, s_kv=300)),
]

def case(name: str) -> Case:
    """The case called ``name`` (KeyError names the known ones)."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no graph-form case {name!r}; known: {', '.join(c.name for c in CASES)}")


# ---------------------------------------------------------------------------------------------
# the graphs (full TVM)


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
                raise ValueError(f"{case.name}: symbolic dim {name} has no value in run={case.run}")
            out.append(int(case.run[name]))
    return out


def _seq_len(spec: dict) -> int:
    """Sequence length of an input described by :func:`describe_io` (BNSH: axis 2; BSNH, BSH: axis 1;
    SBE, sequence first: axis 0)."""
    return spec["shape"][{"BNSH": 2, "SBE": 0}.get(spec["layout"], 1)]


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
                raise ValueError(f"{case.name}: sinks {spec}, expected ({case.h},)")
            inputs.append(dict(spec, layout="H"))
            continue
        heads = case.h if p.name == "q" else case.hkv
        head_dim = case.dv if p.name == "v" else case.d
        bsnh = shape[:2] + [1] + shape[2:] if layout == "BSH" else shape  # BSH: one head
        if layout == "SBE":  # (S, B, H*D): the heads merged, sequence first
            spec["heads"] = heads
            bsnh = [shape[1], shape[0], heads, shape[2] // heads] if shape[2] % heads == 0 else shape
        hax = 1 if layout == "BNSH" else 2
        if p.name not in ("q", "k", "v") or len(bsnh) != 4 or bsnh[hax] != heads or bsnh[3] != head_dim:
            raise ValueError(f"{case.name}: input {spec} does not match {layout} with {heads} heads, "
                             f"head dim {head_dim}")
        inputs.append(spec)
    q = next(i for i in inputs if i["name"] == "q")
    k = next(i for i in inputs if i["name"] == "k")
    b, sq, skv = q["shape"][1 if q["layout"] == "SBE" else 0], _seq_len(q), _seq_len(k)
    want = [sq, b, case.h * case.dv] if lay["output"] == "SBE" else [b, sq, case.h * case.dv] if lay["merged"] else (
        [b, sq, case.h, case.dv] if lay["output"] == "BSNH" else [b, case.h, sq, case.dv])
    shape = _concrete(func.ret_ty.shape, case)
    if shape != want:
        raise ValueError(f"{case.name}: output shape {shape}, expected {want} for layout {lay}")
    output = {"shape": shape, "dtype": str(func.ret_ty.dtype), "layout": lay["output"],
              "heads_merged": lay["merged"], "seq_q": sq, "seq_kv": skv, "batch": b}
    return inputs, output

