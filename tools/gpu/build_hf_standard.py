#!/usr/bin/env python3
"""Build the artifacts of ``tests/gpu/test_gpu_hf_standard.py`` on the build machine.

The standard HF path, as a user who knows nothing of ``mqa_byoc.models.hf``'s convert maps runs it:
a float32 ``LlamaForCausalLM`` / ``MistralForCausalLM`` (random weights from a config) exported with
``torch.export``, imported with plain ``from_exported_program`` (no custom convert map), made fp16 with
``relax.transform.ToMixedPrecision(out_dtype="float16")``, partitioned and built for sm_90::

    import_hf(model, mode=..., convert="standard", mixed_precision=True)
    partition_for_cutlass(mod, mqa=True, provider="native")       # and not partitioned at all ("tvm")
    mqa_byoc.build(target sm_90, cuda_decoder_pipeline) + mqa_byoc.export_library (tools/gpu/bundle.py)

Models (``MODELS``), 2 layers (Llama 4: 4, its fourth the global one), hidden 256 (GraniteSWA: 512), vocab 512:

- ``llama_gqa``: Llama, 8 query heads, 2 K/V heads, head dim 64, ``attn_implementation="eager"``;
- ``llama_gqa_default_mp``: the same Llama through TVM's default ``ToMixedPrecision()`` (out_dtype float32:
  every matmul fp16 x fp16 -> fp32; the GEMMs write float32 on cuBLASLt);
- ``mistral_mqa``: Mistral, 8 query heads, ONE K/V head, head dim 64, a sliding window of 16 (shorter
  than the 48-token prompt, so it matters), ``attn_implementation="sdpa"``;
- ``gpt_oss_sinks``: GPT-OSS, 8 / 2 heads, head dim 64, learned sinks (drawn large enough to matter), a
  16-key sliding layer and a full one, 2 experts both taken per token (top-k routing of random weights
  flips between fp16 and fp32 at near-ties); offloaded as ``flash_attn.attention_mqa_sink``;
- ``gemma2_softcap``: Gemma 2, 8 / 4 heads, head dim 256 (FA2's soft-capping kernels: hdim 256 fp16),
  attention soft-cap 50, final soft-cap 30, ``query_pre_attn_scalar`` 144, a 16-key sliding layer and a
  full one, scores large enough that the cap bends them; ``flash_attn.attention_mqa_softcap``;
- ``llama4_chunked``: Llama 4 (text), 8 / 2 heads, head dim 64, three chunked layers (blocks of 18) and a
  global one without RoPE, one routed expert and the shared one, imported with ``convert="fixes"`` (the
  plain frontend cannot import it), prefill only: in each chunked layer the prompt of 48 is two whole blocks
  (one call on a batch of blocks) and a short one (a second call);
- ``granite_swa_sinks``: GraniteSWA, 8 / 2 heads, head dim 64 (hidden 512), learned sinks applied after
  attention (``o * sigmoid(logsumexp(s) - sink)``), attention multiplier 0.25, a 16-key sliding layer and a
  full one, imported with ``convert="fixes"`` (the plain frontend has no converter for ``amax``);
  ``flash_attn.attention_mqa_sink``.

- ``gemma4_kv_shared``: Gemma 4 (text), 4 layers: 16-key sliding layers (8 / 2 heads, head dim 64) and full ones
  (K = V on one K/V head of head dim 128), RMS-normed q / k / v, scale 1; the last two layers reuse the first
  two's K/V (they cache nothing: the decode step takes two layers' K/V), imported with ``convert="fixes"``;
- ``deepseek_v4_sinks``: DeepSeek-V4's sliding-window layers (8 query heads on one K = V head, head dim 64, a
  learned sink per head, a 16-key window, hyper-connection streams, 2 routed experts both taken), imported with
  ``convert="fixes"`` (its clamped SwiGLU), prefill only.

Each: prefill (B=2, S=48, returns logits and K/V caches) and one decode step whose past is the
float32 eager prefill's caches (float32: the exported function takes the fp32 model's dtypes; per
layer: a sliding layer keeps the last w - 1 positions) and whose token is the greedy next token. The
q/k projections are scaled as in ``build_hf`` (peaked attention).

Written into ``--out`` (default ``.gpu-artifacts/hf-standard``): ``hf_standard.so`` (VM functions
``<model>__<prefill|decode>__<mqa|tvm>``), per model ``weights.npz`` (the functions take float32; ToMixedPrecision casts
them in the graph), ``inputs.npz``, ``reference.npz`` (float32 eager logits; fp16 eager top-1), and
``manifest.json`` (shapes, reports, tolerances derived like build_hf.tolerances(), feature effects,
provenance). Weights are stored fp16 where that is exact (all of them: fp16-rounded).

Checks here (the build fails otherwise): every site of every function is offloaded as the model's
composite (``HFModel.composite``) with its heads / causal / per-layer window / scale / soft-cap; no K/V
expansion op is left and each attention call gets H_kv heads; the decode step's float32 logits equal a
one-token-longer prefill's last ones (unless every layer is sliding: its positions restart); without
its window, sinks or soft-cap a model's float32 logits move by more than twice the GPU test's max-abs
tolerance (so the test can tell); the library exports its attention functions.

    MQA_BYOC_KERNEL_DIR=<fa2 objects>:<fa2 soft-capping objects> nice python tools/gpu/build_hf_standard.py
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "src", ROOT / "tools" / "gpu"):  # this checkout's mqa_byoc; build_hf, bundle beside
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import build_hf as bh  # noqa: E402
import bundle as ba  # noqa: E402
from mqa_byoc.contract import CODEGEN  # noqa: E402
from mqa_byoc.testing import hf_models as hm  # noqa: E402

DEFAULT_OUT = ROOT / ".gpu-artifacts" / "hf-standard"
LIBRARY = "hf_standard.so"
VARIANTS = ("mqa", "tvm")
MODES = ("prefill", "decode")
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class StandardModel(bh.HFModel):
    impl: str = "eager"
    mixed_out: str = "float16"  # ToMixedPrecision's out_dtype ("float32": TVM's default, float32 matmul outputs)
    convert: str = "standard"  # import_hf's convert: "fixes" for a model the plain frontend cannot import
    modes: tuple = MODES
    # modes whose unpartitioned graph TVM's own CUDA pipeline cannot build, with the error: no "tvm" variant
    tvm_fails: tuple = ()
    tvm_error: str = ""

    def variants(self, mode):
        return tuple(v for v in VARIANTS if v != "tvm" or mode not in self.tvm_fails)

    def config(self):
        cfg = super().config()
        cfg._attn_implementation = self.impl
        return cfg


HYBRID = ("sliding_attention", "full_attention")  # GPT-OSS's and Gemma 2's alternation, layer 0 sliding

MODELS = [
    StandardModel("llama_gqa", "llama", heads=8, kv_heads=2, head_dim=64, hidden=256, intermediate=256, vocab=512,
                  layers=2, window=None, rope_theta=10000.0, batch=2, seq_len=48, impl="eager",
                  note="Llama, GQA 8/2, head dim 64, eager attention"),
    StandardModel("llama_gqa_default_mp", "llama", heads=8, kv_heads=2, head_dim=64, hidden=256, intermediate=256,
                  vocab=512, layers=2, window=None, rope_theta=10000.0, batch=2, seq_len=48, impl="eager",
                  mixed_out="float32",
                  note="Llama, GQA 8/2, head dim 64, eager attention; TVM's default ToMixedPrecision() (float32 "
                       "matmul outputs: every GEMM fp16 x fp16 -> fp32 on cuBLASLt)"),
    StandardModel("mistral_mqa", "mistral", heads=8, kv_heads=1, head_dim=64, hidden=256, intermediate=256,
                  vocab=512, layers=2, window=16, rope_theta=10000.0, batch=2, seq_len=48, impl="sdpa",
                  note="Mistral, MQA (1 K/V head), head dim 64, window 16, sdpa attention"),
    StandardModel("gpt_oss_sinks", "gpt_oss", heads=8, kv_heads=2, head_dim=64, hidden=256, intermediate=128,
                  vocab=512, layers=2, window=16, rope_theta=150000.0, batch=2, seq_len=48, impl="eager",
                  layer_types=HYBRID, sinks=True, experts=2, experts_per_tok=2,
                  note="GPT-OSS, GQA 8/2, head dim 64, learned sinks, a 16-key sliding layer and a full one, "
                       "2 experts (both taken), eager attention"),
    StandardModel("gemma2_softcap", "gemma2", heads=8, kv_heads=4, head_dim=256, hidden=256, intermediate=256,
                  vocab=512, layers=2, window=16, rope_theta=10000.0, batch=2, seq_len=48, impl="eager",
                  layer_types=HYBRID, softcap=50.0, final_softcap=30.0, query_pre_attn_scalar=144, score_std=80.0,
                  note="Gemma 2, GQA 8/4, head dim 256, attention soft-cap 50, final soft-cap 30, scale "
                       "144 ** -0.5, a 16-key sliding layer and a full one, eager attention; scores of std ~100 "
                       "(q/k projections scaled) so that the cap of 50 bends them"),
    StandardModel("llama4_chunked", "llama4", heads=8, kv_heads=2, head_dim=64, hidden=256, intermediate=256,
                  vocab=512, layers=4, window=None, rope_theta=500000.0, batch=2, seq_len=48, impl="eager",
                  chunk=18, convert="fixes", modes=("prefill",),
                  note="Llama 4 (text), GQA 8/2, head dim 64, three chunked layers (blocks of 18: a prompt of 48 "
                       "is two whole blocks, one call on a batch of blocks, and a short block of 12, a second "
                       "call) and a global one without RoPE, one routed expert and the shared one, eager "
                       "attention; imported with the fixes convert map; prefill only"),
    StandardModel("granite_swa_sinks", "granite_swa", heads=8, kv_heads=2, head_dim=64, hidden=512, intermediate=256,
                  vocab=512, layers=2, window=16, rope_theta=10000.0, batch=2, seq_len=48, impl="eager",
                  layer_types=HYBRID, sinks=True, attention_multiplier=0.25, score_std=1.5, convert="fixes",
                  tvm_fails=("decode",), tvm_error="TVM 0.27's CUDA pipeline fails on the unpartitioned decode "
                  "graph: dlight's GEMV rule asserts in its normalize (a log-sum-exp reduction over one query row)",
                  note="GraniteSWA, GQA 8/2, head dim 64, learned sinks applied after attention (o * "
                       "sigmoid(logsumexp(s) - sink)), attention multiplier 0.25 (not 64 ** -0.5), a 16-key "
                       "sliding layer and a full one, eager attention; imported with the fixes convert map "
                       "(the plain frontend has no converter for logsumexp's amax)"),
    StandardModel("gemma4_kv_shared", "gemma4", heads=8, kv_heads=2, head_dim=64, hidden=256, intermediate=256,
                  vocab=512, layers=4, window=16, rope_theta=10000.0, batch=2, seq_len=48, impl="eager",
                  layer_types=HYBRID * 2, global_head_dim=128, global_kv_heads=1, kv_shared=2,
                  attention_multiplier=1.0, convert="fixes",
                  note="Gemma 4 (text), GQA 8/2 head dim 64 in its 16-key sliding layers, K = V on one K/V head of "
                       "head dim 128 in its full ones, RMS-normed q / k / v and a softmax scale of 1; its last two "
                       "layers reuse the K/V of the first two (KV sharing: they cache nothing, the decode step "
                       "takes two layers' K/V), eager attention; imported with the fixes convert map"),
    StandardModel("deepseek_v4_sinks", "deepseek_v4", heads=8, kv_heads=1, head_dim=64, hidden=256, intermediate=128,
                  vocab=512, layers=2, window=16, rope_theta=10000.0, batch=2, seq_len=48, impl="eager",
                  layer_types=("sliding_attention",) * 2, sinks=True, experts=2, experts_per_tok=2, convert="fixes",
                  modes=("prefill",),
                  note="DeepSeek-V4's sliding-window layers: 8 query heads on ONE shared K = V head of head dim 64 "
                       "(RMS-normed, a rotary part of 16), a learned sink per head, a 16-key window, a low-rank "
                       "query and grouped low-rank output, 2 routed experts (both taken) and the shared one, its "
                       "clamped SwiGLU, eager attention; imported with the fixes convert map (its clamp); prefill "
                       "only (its compressed layers are rejected, tests/test_hf_families.py)"),
]


def standard_import(model, mode: str, spec, past_len: int):
    from mqa_byoc.models import hf

    from tvm import relax

    imp = hf.import_hf(model, mode=mode, batch=spec.batch, seq_len=spec.seq_len, past_len=past_len,
                       convert=spec.convert, mixed_precision=spec.mixed_out == "float16")
    if spec.mixed_out == "float16":
        return imp
    return imp._replace(mod=relax.transform.ToMixedPrecision(out_dtype=spec.mixed_out)(imp.mod))


def _stored(a: np.ndarray) -> np.ndarray:
    """fp16 where that is exact (the weights are fp16-rounded; the test casts back to the parameter's dtype)."""
    h = a.astype(np.float16)
    return h if a.dtype == np.float32 and np.array_equal(h.astype(np.float32), a) else a


def decode_matches_longer_prefill(spec, m32, ids, next_ids, d32) -> dict | None:
    """The decode step against the last position of a prefill of the prompt plus the new token: equal where
    the step's position and keys are the real ones (no cache cropped, or a hybrid cache); None for a model
    whose every layer is sliding (its cache keeps w - 1 positions: the step's RoPE positions restart)."""
    from mqa_byoc.models import hf

    if spec.window is not None and hf.hybrid_full_layer(m32.config) is None:
        return None
    longer = bh.eager_deterministic(m32, "prefill", [np.concatenate([ids, next_ids], axis=1)])[0][:, -1:]
    st = bh.error_stats(d32[0], longer)
    if not st["max_abs"] <= 1e-4 * max(1.0, st["ref_max_abs"]):
        raise SystemExit(f"{spec.name}: the decode step's logits differ from a {ids.shape[1] + 1}-token prefill's "
                         f"last ones: {st} (the decode step's past or position is wrong)")
    return st


def feature_effects(spec, m32, ids, next_ids, past, refs, tol) -> dict:
    """How far float32 eager logits move when the model loses its window / sinks / soft-cap / blocks: each must move
    them beyond the GPU test's max_abs tolerance (else offloading without it would pass unnoticed)."""
    import copy

    import torch

    variants = {}
    if spec.window is not None:  # prefill only: in decode the sliding cache holds no key outside the window
        m = copy.deepcopy(m32)
        m.config.sliding_window = 1 << 20
        for layer in m.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 1 << 20
        variants["window"] = (m, ("prefill",))
    if spec.sinks:
        m = copy.deepcopy(m32)
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.fill_(-float("inf"))
        variants["sinks"] = (m, MODES)
    if spec.softcap:
        m = copy.deepcopy(m32)
        for layer in m.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        variants["softcap"] = (m, MODES)
    if spec.chunk is not None:  # prefill only: the prompt spans blocks
        m = copy.deepcopy(m32)
        m.config.attention_chunk_size = 1 << 20
        variants["chunk"] = (m, ("prefill",))
    out = {}
    for feature, (m, modes) in variants.items():
        for mode in (x for x in modes if x in spec.modes):
            got = hm.eager(m, mode, [ids] if mode == "prefill" else [next_ids, *past])[0]
            effect = float(np.abs(got - refs[mode]).max())
            bound = tol[mode]["vs_fp32"]["logits"]["max_abs"]
            out.setdefault(feature, {})[mode] = {"max_abs": effect, "tolerance_max_abs": bound}
            if not (np.isfinite(got).all() and effect > 2 * bound):
                raise SystemExit(f"{spec.name}/{mode}: without its {feature} the float32 logits move by {effect:.3g}, "
                                 f"not beyond 2x the GPU test's tolerance {bound:.3g}: the test could not tell")
    return out


def prepare_model(spec, out_dir: Path, seed: int):
    """Weights, inputs, eager references and standard imports of one model."""
    from mqa_byoc.models import hf

    t0 = time.time()
    model_dir = out_dir / spec.name
    model_dir.mkdir(parents=True)
    m16, m32, qk_std = bh.build_models(spec, seed)
    rng = np.random.default_rng([seed, spec.vocab, spec.seq_len])
    ids = rng.integers(0, spec.vocab, (spec.batch, spec.seq_len)).astype(np.int64)
    p32 = bh.eager_deterministic(m32, "prefill", [ids])
    p16 = bh.eager_deterministic(m16, "prefill", [ids])
    next_ids = p32[0][:, -1].argmax(-1)[:, None].astype(np.int64)
    past = [c.astype(np.float32) for c in p32[1:]]
    refs, e16 = {"prefill": p32[0]}, {"prefill": {"logits": bh.error_stats(p16[0], p32[0], logits=True)}}
    # a hybrid cache: w - 1 in sliding layers; a KV-shared layer (Gemma 4) caches nothing, its length unused
    past_len = hf.decode_past_lengths(m32.config, spec.seq_len)
    if [past_len[i] for i in hf.cached_layers(m32)] != [p.shape[2] for p in past[::2]]:
        raise SystemExit(f"{spec.name}: the eager prefill's caches are {[p.shape for p in past]}, not the past "
                         f"lengths {past_len} of the decode export")
    if "decode" in spec.modes:
        d32 = bh.eager_deterministic(m32, "decode", [next_ids, *past])
        d16 = bh.eager_deterministic(m16, "decode", [next_ids, *past])
        refs["decode"] = d32[0]
        e16["decode"] = {"logits": bh.error_stats(d16[0], d32[0], logits=True)}

    mains, funcs, params = {}, {}, None
    for mode in spec.modes:
        imp = standard_import(m32, mode, spec, past_len)
        main = imp.mod["main"]
        n_in = 1 if mode == "prefill" else 1 + len(past)  # K and V of each layer that caches them
        wspec = [[p.name, bh._shape(p.ty), str(p.ty.dtype)] for p in main.params[n_in:]]
        if params is None:
            params = (wspec, imp.params)
        elif wspec != params[0]:
            raise SystemExit(f"{spec.name}: prefill and decode take different weights")
        reports = bh.check_reports(spec, f"{spec.name}/{mode}", mode, imp.mod)
        mains[mode] = main
        funcs[mode] = {
            "inputs": [[p.name, bh._shape(p.ty), str(p.ty.dtype)] for p in main.params[:n_in]],
            "outputs": [["logits", bh._shape(main.ret_ty.fields[0]), str(main.ret_ty.fields[0].dtype)]],
            "reports": reports, "fp16_eager_vs_fp32_eager": e16[mode],
            # attention kernel calls of the offloaded function: one a site, a chunked site's blocks one to three
            "attention_calls": sum(site["composite_calls"] for site in reports["mqa"]),
            "tolerances": bh.tolerances(e16[mode], ["logits"]),
            "vm": {v: f"{spec.name}__{mode}__{v}" for v in spec.variants(mode)},
            **({"tvm_not_built": spec.tvm_error} if mode in spec.tvm_fails else {}),
        }
    decode_check = decode_matches_longer_prefill(spec, m32, ids, next_ids, d32) if "decode" in spec.modes else None
    effects = feature_effects(spec, m32, ids, next_ids, past, refs,
                              {mode: funcs[mode]["tolerances"] for mode in spec.modes})
    wspec, warrays = params
    np.savez(model_dir / "weights.npz", **{n: _stored(a) for (n, _s, _d), a in zip(wspec, warrays)})
    np.savez(model_dir / "inputs.npz", prefill_input_ids=ids, decode_input_ids=next_ids,
             **{f"decode_past_{i}": a for i, a in enumerate(past)})
    top1 = {f"{mode}_top1_fp16_eager": (p16 if mode == "prefill" else d16)[0].argmax(-1).astype(np.int32)
            for mode in spec.modes}
    np.savez(model_dir / "reference.npz", **{f"{mode}_logits": refs[mode] for mode in spec.modes}, **top1)
    entry = {
        "spec": dataclasses.asdict(spec), "hf_class": type(m32).__name__, "seed": seed,
        "weights_init": f"build_hf.build_models (q/k projection std {qk_std:.4f}), fp16-rounded, "
                        "stored float32",
        "weights": f"{spec.name}/weights.npz", "params": wspec,
        "weights_stored": "fp16 where exact (all fp16-rounded weights), else as the parameter; cast to the "
                          "parameter's dtype at load",
        "inputs": f"{spec.name}/inputs.npz", "reference": f"{spec.name}/reference.npz",
        "input_keys": {mode: keys for mode, keys in (
            ("prefill", ["prefill_input_ids"]),
            ("decode", ["decode_input_ids"] + [f"decode_past_{i}" for i in range(len(past))])) if mode in spec.modes},
        "reference_kind": f"PyTorch eager ({spec.impl}) on CPU in float32, same weights; fp16 eager for its error",
        "functions": funcs, "past_len": past_len,
        "past_note": "the decode step's past: the float32 eager prefill's caches, per layer (a sliding layer keeps "
                     "the last w - 1 positions); the new token's position is the prompt length",
        "decode_vs_longer_prefill": decode_check,
        "feature_effects": effects,
    }
    print(f"{spec.name}: references and standard imports in {time.time() - t0:.0f}s", flush=True)
    return entry, mains


def variant_function(spec, mode: str, main, variant: str, provider: str):
    """``main`` as ``<model>__<mode>__<variant>``, partitioned (mqa) or not (tvm), checked."""
    import tvm
    from tvm import relax
    from tvm.relax.utils import copy_with_new_vars

    import mqa_byoc
    from mqa_byoc.models import hf

    fname = f"{spec.name}__{mode}__{variant}"
    mod = tvm.IRModule({fname: copy_with_new_vars(main).with_attr("global_symbol", fname)})
    if variant == "tvm":
        return fname, mod, {}
    expected = sum(site.composite_calls for site in mqa_byoc.offload_report(mod, mqa=True))
    mod = mqa_byoc.partition_for_cutlass(mod, mqa=True, provider=provider)
    attention = set()
    for gv, func in list(mod.functions.items()):
        if func.attrs is None or "Codegen" not in func.attrs:
            continue
        if str(func.attrs["Codegen"]) == CODEGEN:
            attention.add(gv.name_hint)
        mod[gv] = func.with_attr("global_symbol", f"{fname}__{gv.name_hint}")  # GEMMs on cuBLASLt too
    # the K/V each attention gets, at its call (a sink / soft-cap function has symbolic parameters)
    calls = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.GlobalVar) and e.op.name_hint in attention:
            # the composite's parameters come in the order its body first uses them (a K/V permuted
            # inside it may come before the query): tell them apart by their heads
            shapes = [bh._shape(a.ty) for a in e.args if getattr(a.ty, "ndim", None) == 4]
            calls.append({"function": e.op.name_hint, "q": [x for x in shapes if spec.heads in x[1:3]],
                          "kv": [x for x in shapes if spec.heads not in x[1:3]]})

    relax.analysis.post_order_visit(mod[fname].body, visit)
    kv_heads = {kv for _, kv, _ in spec.site_heads(True)}
    for c in calls:
        if len(c["q"]) != 1 or len(c["kv"]) not in (1, 2) or any(not kv_heads & set(x[1:3]) for x in c["kv"]):
            raise SystemExit(f"{fname}: FA2 call {c['function']} gets a query {c['q']} and K/V {c['kv']}; "
                             f"want one query of {spec.heads} heads and K/V of {sorted(kv_heads)} heads")
    ops = collections.Counter(ba.main_ops(mod, fname))
    n_fa2 = sum(c for name, c in ops.items() if name.startswith("call:") and name[len("call:"):] in attention)
    left = hf.kv_expansions_left(mod, fname, head_dims={d for _, _, d in spec.site_heads(True)})
    if n_fa2 != expected or len(calls) != expected or left:
        raise SystemExit(f"{fname}: {n_fa2} FA2 calls (want {expected}), at {len(calls)} call sites; "
                         f"K/V expansions left: {left}")
    mod = relax.transform.NormalizeGlobalVar()(mod)
    return fname, mod, {"fa2_calls": calls, "attention_calls": expected, "op_counts": dict(sorted(ops.items()))}


def build_library(specs, mains, out_dir: Path, provider: str) -> dict:
    from mqa_byoc.compiler.export import collect_kernel_keys
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline

    t0 = time.time()
    funcs, partition, symbols, attention = {}, {}, [], []
    for spec in specs:
        for mode in spec.modes:
            for variant in spec.variants(mode):
                fname, mod, info = variant_function(spec, mode, mains[spec.name][mode], variant, provider)
                partition[fname] = info
                symbols += ba.codegen_symbols(mod)
                attention += ba.codegen_symbols(mod, CODEGEN)
                ba.add_functions(funcs, mod, fname)
    path = out_dir / LIBRARY
    ex, _ = ba.build_library(funcs, path, provider, argparse.Namespace(build_native_kernels=False, jobs=None),
                             pipeline=cuda_decoder_pipeline)
    calls = ba.vm_calls(ex)
    pattern = re.compile(bh.KV_EXPANSION_KERNELS, re.IGNORECASE)
    named_like_expansion = {}
    for spec in specs:
        for mode in spec.modes:
            fname = f"{spec.name}__{mode}__mqa"
            n_fa2 = sum(c in set(attention) for c in calls.get(fname, []))
            if n_fa2 != partition[fname]["attention_calls"]:
                raise SystemExit(f"{fname} calls FA2 {n_fa2} times, want {partition[fname]['attention_calls']}")
            # TVM kernels named like an expansion that the Relax check above proved are not K/V's
            named_like_expansion[fname] = sorted({c for c in calls.get(fname, [])
                                                  if c not in symbols and pattern.search(c)})
    keys = collect_kernel_keys(ex)
    exports = ba.check_exports(path, symbols, [k.entry_symbol for k in keys])
    print(f"{LIBRARY}: {len(funcs)} functions, {path.stat().st_size / 2**20:.2f} MiB in {time.time() - t0:.0f}s",
          flush=True)
    return {"library": LIBRARY, "size": path.stat().st_size, "provider": provider,
            "fa2_kernels_linked": [k.label for k in keys], "exports": exports, "partition": partition,
            "not_kv_expansion_kernels": named_like_expansion}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", nargs="*", help="build only these models (default: all of MODELS)")
    args = ap.parse_args(argv)
    specs = bh.selected_models(ap, args.models, MODELS)
    if not os.environ.get("MQA_BYOC_KERNEL_DIR"):
        print("note: MQA_BYOC_KERNEL_DIR is not set; FA2 kernel objects must be in the default cache")

    import torch
    import transformers
    import tvm

    t0 = time.time()
    bh.fresh_dir(args.out)
    manifest = {
        "format": FORMAT,
        "what": "the standard HF path: float32 HF decoders, torch.export, plain from_exported_program, "
                "ToMixedPrecision(out_dtype='float16'), partition_for_cutlass(mqa=True, native); and unpartitioned",
        "pipeline": "mqa_byoc.models.hf.import_hf(model, mode, convert='standard', mixed_precision=True) -> "
                    "partition_for_cutlass(mod, mqa=True, provider='native') | none -> "
                    "mqa_byoc.build(sm_90, cuda_decoder_pipeline) -> mqa_byoc.export_library",
        "variants": {"mqa": "partition_for_cutlass(mqa=True): FA2 with native K/V heads",
                     "tvm": "not partitioned: TVM's own lowering"},
        "target": ba.TARGET,
        "provenance": {"command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                       "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "tvm": tvm.__version__, "torch": torch.__version__,
                       "transformers": transformers.__version__},
        "models": {},
    }
    mains = {}
    for spec in specs:
        manifest["models"][spec.name], mains[spec.name] = prepare_model(spec, args.out, args.seed)
    lib = build_library(specs, mains, args.out, "native")
    manifest["library"] = {k: v for k, v in lib.items() if k not in ("partition", "not_kv_expansion_kernels")}
    for spec in specs:
        for mode in spec.modes:
            f = manifest["models"][spec.name]["functions"][mode]
            f["partitioned"] = lib["partition"][f["vm"]["mqa"]]
            f["not_kv_expansion_kernels"] = lib["not_kv_expansion_kernels"][f["vm"]["mqa"]]
    files = {str(p.relative_to(args.out)): p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
    manifest["files"], manifest["total_bytes"] = files, sum(files.values())
    manifest["build_seconds"] = round(time.time() - t0, 1)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"total {total / 2**20:.1f} MiB in {args.out} ({time.time() - t0:.0f}s)")
    if total > 64 * 2**20:  # FA2 objects of two head dims and the soft-capping ones: ~28 MiB of library; xz: ~21 MiB in all
        raise SystemExit(f"artifacts are {total / 2**20:.1f} MiB, more than 64 MiB")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
