#!/usr/bin/env python3
"""Build the artifacts of ``tests/gpu/test_gpu_hf_dynamic_decode.py`` on the build machine.

A serving loop's decode step: one graph whose batch and past length are symbolic, called at several
past lengths. Sliding-window models export it only with the past at least the window (HF's sliding
cache keeps the last w - 1 keys through ``torch.sym_max``, which the fixes convert map converts;
``torch.export`` records the lower bound, which the mask proof uses)::

    import_hf(model, mode="decode", dynamic=True, convert="fixes", mixed_precision=True)
    partition_for_cutlass(mod, mqa=True, gemm=False, provider="native")  # mqa=False ("nomqa"), none ("tvm")
    mqa_byoc.build(target sm_90, cuda_decoder_pipeline) + mqa_byoc.export_library (tools/gpu/bundle.py)

Models (``MODELS``; random weights, float32, 2 layers, hidden 256, vocab 512, head dim 64):

- ``mistral_sliding``: Mistral, 8 query heads on ONE K/V head, a 16-key window, sdpa attention; called
  at pasts of 15 (w - 1: what HF's sliding cache holds), 40 and 300 keys (the graph keeps the last 15);
- ``gpt_oss_sinks``: GPT-OSS, 8 / 2 heads, learned sinks, a 16-key sliding layer and a full one (each
  layer's K and V share one past length, the layers keep their own), eager attention; called at the
  pasts a serving loop hands it: the sliding layer's 15 and the full layer's 24, then 15 and 200.

Each call: batch 3, a random token and a random float32 past (the graph casts it to fp16); references:
float32 eager (``import_hf``'s ``reference``) and fp16 eager (the same wrapper on an fp16 copy of the
model, for the tolerances, as ``build_hf.tolerances``).

Variants: ``mqa`` (``partition_for_cutlass(mqa=True)``: FA2 on the K/V heads), ``nomqa`` (``mqa=False``: FA2 as
plain MHA on the expanded K/V) and ``tvm`` (not partitioned) where TVM builds it: TVM 0.27's own CUDA pipeline
fails on the unpartitioned graph of these sliding-window decodes (``FuseTIR``: "VarRemapGet(source) ==
nullptr"), which the manifest records (``tvm_not_built``; the test then compares ``mqa`` with ``nomqa``).
GEMMs stay on TVM in every variant (``gemm=False``): what differs is the attention.

Written into ``--out`` (default ``.gpu-artifacts/hf-dynamic-decode``): ``hf_dynamic_decode.so`` (VM functions
``<model>__decode__<mqa|nomqa>``), ``<model>__decode__tvm.so`` where TVM builds it, per model ``weights.npz``
and ``cases.npz`` (inputs and references of each call), and ``manifest.json``.

Checks here (the build fails otherwise): every site offloaded with the model's K/V heads (no K/V
expansion left), its past length symbolic; the rewrite on the CPU (llvm) gives the float32 reference at
every case's past within the CPU rewrite tolerance; the library exports its attention functions.

    MQA_BYOC_KERNEL_DIR=<fa2 objects> nice python tools/gpu/build_hf_dynamic_decode.py
"""

from __future__ import annotations

import argparse
import copy
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

DEFAULT_OUT = ROOT / ".gpu-artifacts" / "hf-dynamic-decode"
# mqa: partition_for_cutlass(mqa=True), FA2 on the K/V heads; nomqa: partition_for_cutlass(mqa=False), FA2 as
# plain MHA on the expanded K/V; tvm: not partitioned, where TVM builds it (the manifest records why not)
VARIANTS = ("mqa", "nomqa", "tvm")
FORMAT = 1
BATCH = 3
LIBRARY = "hf_dynamic_decode.so"
CPU_RTOL = CPU_ATOL = 5e-2  # the CPU rewrite against float32 eager (fp16 graph, sequential fp16 sums)


@dataclasses.dataclass(frozen=True)
class DynamicModel:
    name: str
    kind: str  # "mistral" | "gpt_oss"
    heads: int
    kv_heads: int
    window: int
    impl: str
    pasts: tuple  # per case: one past length a layer
    composite: str
    export_past: int  # the example past of torch.export (at least the window)
    note: str = ""


MODELS = [
    DynamicModel("mistral_sliding", "mistral", heads=8, kv_heads=1, window=16, impl="sdpa",
                 pasts=((15, 15), (40, 40), (300, 300)), composite="flash_attn.attention_mqa", export_past=20,
                 note="Mistral, MQA (1 K/V head), head dim 64, window 16, sdpa attention"),
    DynamicModel("gpt_oss_sinks", "gpt_oss", heads=8, kv_heads=2, window=16, impl="eager",
                 pasts=((15, 24), (15, 200)), composite="flash_attn.attention_mqa_sink", export_past=24,
                 note="GPT-OSS, GQA 8/2, head dim 64, learned sinks, a 16-key sliding layer and a full one, "
                      "2 experts (one taken), eager attention"),
]
HEAD_DIM, HIDDEN, VOCAB, LAYERS = 64, 256, 512, 2


def build_model(spec: DynamicModel, seed: int):
    """The float32 model, random weights (sinks large enough to matter)."""
    import torch
    import transformers

    from mqa_byoc.models import hf

    if spec.kind == "mistral":
        cfg = hf.make_hf_config("mistral", hidden_size=HIDDEN, num_heads=spec.heads, num_kv_heads=spec.kv_heads,
                                head_dim=HEAD_DIM, intermediate_size=256, vocab_size=VOCAB, num_layers=LAYERS,
                                attn_implementation=spec.impl, sliding_window=spec.window)
        return hf.build_hf_model(cfg, dtype="float32", seed=seed, std=0.05)
    cfg = transformers.GptOssConfig(
        hidden_size=HIDDEN, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=HEAD_DIM,
        intermediate_size=256, vocab_size=VOCAB, num_hidden_layers=LAYERS, max_position_embeddings=1024,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=spec.window,
        layer_types=["sliding_attention", "full_attention"],
        experts_implementation="batched_mm")  # TVM's frontend has no converter for grouped_mm
    cfg._attn_implementation = spec.impl
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def fp16_eager(model):
    """An fp16 copy of ``model`` called as the decode graph is: (ids, k_0, v_0, ...) -> float32 logits."""
    import torch

    from mqa_byoc.models import hf

    m16 = copy.deepcopy(model).half().eval()
    wrapper = hf.export_wrapper(m16, "decode", LAYERS, True).eval()

    def run(ids, *past):
        t = [torch.from_numpy(ids).long()] + [torch.from_numpy(p).half() for p in past]
        with torch.no_grad():
            out = wrapper(*t)
        return (out[0] if isinstance(out, tuple) else out).float().numpy()

    return run


def check_report(spec: DynamicModel, mod) -> list[dict]:
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.models import hf

    report = mqa_byoc.offload_report(mod, mqa=True)
    got = [(s.offloaded, s.composite, s.num_q_heads, s.num_kv_heads, s.head_dim) for s in report]
    want = [(True, spec.composite, spec.heads, spec.kv_heads, HEAD_DIM)] * LAYERS
    if got != want:
        raise SystemExit(f"{spec.name}: sites {got}, want {want}; reasons {[s.reason for s in report]}")
    if not relax.analysis.free_symbolic_vars(mod["main"]) and not relax.analysis.defined_symbolic_vars(mod["main"]):
        raise SystemExit(f"{spec.name}: the decode graph has no symbolic past length")
    part = mqa_byoc.partition_for_cutlass(mod, mqa=True, provider="native")
    left = hf.kv_expansions_left(part)
    if left:
        raise SystemExit(f"{spec.name}: K/V expansions left after the partition: {left}")
    return [{"composite": s.composite, "num_kv_heads": s.num_kv_heads, "window": s.window, "causal": s.causal,
             "reason": s.reason} for s in report]


def import_decode(spec: DynamicModel, model):
    from mqa_byoc.models import hf

    return hf.import_hf(model, mode="decode", batch=2, seq_len=1, past_len=spec.export_past, dynamic=True,
                        convert="fixes", mixed_precision=True)


def prepare_model(spec: DynamicModel, out_dir: Path, seed: int):
    from mqa_byoc.models import hf
    from mqa_byoc.testing import graphs as G

    t0 = time.time()
    model = build_model(spec, seed)
    imp = import_decode(spec, model)
    main = imp.mod["main"]
    lower = {str(k): int(v) for k, v in (main.attrs["tir_var_lower_bound"].items()
                                         if "tir_var_lower_bound" in (main.attrs or {}) else [])}
    reports = check_report(spec, imp.mod)
    rng = np.random.default_rng([seed, len(spec.name)])
    eager16 = fp16_eager(model)
    cases, arrays, e16 = [], {}, {"logits": {"max_abs": 0.0, "rel_l2": 0.0}}
    for i, pasts in enumerate(spec.pasts):
        ids = rng.integers(0, VOCAB, (BATCH, 1)).astype(np.int64)
        shapes = [(BATCH, spec.kv_heads, n, HEAD_DIM) for n in pasts for _ in ("k", "v")]
        past = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        want = imp.reference(ids, *past)
        got16 = eager16(ids, *[p.astype(np.float16) for p in past])
        st16 = bh.error_stats(got16, want, logits=True)
        for k in ("max_abs", "rel_l2"):
            e16["logits"][k] = max(e16["logits"][k], st16[k])
        cpu = G.rewritten_on_cpu(imp.mod, [ids, *past, *imp.params])  # the rewrite, llvm
        np.testing.assert_allclose(cpu, want, rtol=CPU_RTOL, atol=CPU_ATOL,
                                   err_msg=f"{spec.name}: the CPU rewrite at pasts {pasts}")
        arrays[f"case{i}_ids"] = ids
        arrays.update({f"case{i}_past{j}": p for j, p in enumerate(past)})
        arrays[f"case{i}_logits"] = want
        cases.append({"pasts": list(pasts), "inputs": [f"case{i}_ids"] + [f"case{i}_past{j}" for j in range(len(past))],
                      "reference": f"case{i}_logits", "fp16_eager_vs_fp32_eager": st16,
                      "cpu_rewrite_vs_fp32_eager": bh.error_stats(cpu, want, logits=True)})
    model_dir = out_dir / spec.name
    model_dir.mkdir(parents=True)
    n_in = 1 + 2 * LAYERS
    params = [[p.name, bh._shape(p.ty), str(p.ty.dtype)] for p in main.params[n_in:]]
    np.savez(model_dir / "weights.npz", **{n: a for (n, _s, _d), a in zip(params, imp.params)})
    np.savez(model_dir / "cases.npz", **arrays)
    entry = {"spec": dataclasses.asdict(spec), "hf_class": type(model).__name__, "seed": seed,
             "weights": f"{spec.name}/weights.npz", "cases_file": f"{spec.name}/cases.npz", "params": params,
             "lower_bounds": lower, "reports": reports, "cases": cases,
             "fp16_eager_vs_fp32_eager": e16, "tolerances": bh.tolerances(e16, ["logits"]),
             "vm": {v: f"{spec.name}__decode__{v}" for v in VARIANTS}}
    print(f"{spec.name}: import, references and CPU rewrite in {time.time() - t0:.0f}s", flush=True)
    return entry, main


def variant_function(spec: DynamicModel, main, variant: str):
    import tvm
    from tvm import relax
    from tvm.relax.utils import copy_with_new_vars

    import mqa_byoc

    fname = f"{spec.name}__decode__{variant}"
    mod = tvm.IRModule({fname: copy_with_new_vars(main).with_attr("global_symbol", fname)})
    if variant != "tvm":
        mod = ba.unique_symbols(mqa_byoc.partition_for_cutlass(mod, mqa=variant == "mqa", gemm=False,
                                                               provider="native"), fname)
    return fname, mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", nargs="*", help="build only these models (default: all of MODELS)")
    args = ap.parse_args(argv)
    specs = bh.selected_models(ap, args.models, MODELS)

    import torch
    import transformers
    import tvm

    from mqa_byoc.compiler.export import collect_kernel_keys
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline

    t0 = time.time()
    bh.fresh_dir(args.out)
    manifest = {
        "format": FORMAT,
        "what": "a serving loop's decode step: batch and past length symbolic (sliding-window models: the past at "
                "least the window), one graph called at several past lengths",
        "pipeline": "mqa_byoc.models.hf.import_hf(model, mode='decode', dynamic=True, convert='fixes', "
                    "mixed_precision=True) -> partition_for_cutlass(mod, mqa=True | False, gemm=False, "
                    "provider='native') | none -> "
                    "mqa_byoc.build(sm_90, cuda_decoder_pipeline) -> mqa_byoc.export_library",
        "target": ba.TARGET,
        "provenance": {"command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                       "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "tvm": tvm.__version__, "torch": torch.__version__,
                       "transformers": transformers.__version__},
        "models": {},
    }
    # the partitioned functions in one library; TVM's own build of each model's graph in a library of its own,
    # where it builds at all (TVM 0.27 fails on the unpartitioned graph of a sliding-window model's dynamic decode:
    # the manifest records the error, and the test compares with the nomqa build there)
    groups, symbols, attention = {LIBRARY: {}}, [], []
    for spec in specs:
        manifest["models"][spec.name], main_fn = prepare_model(spec, args.out, args.seed)
        for variant in VARIANTS:
            fname, mod = variant_function(spec, main_fn, variant)
            symbols += ba.codegen_symbols(mod)
            attention += ba.codegen_symbols(mod, CODEGEN)
            ba.add_functions(groups.setdefault(LIBRARY if variant != "tvm" else f"{fname}.so", {}), mod, fname)
    manifest["libraries"] = {}
    pattern = re.compile(bh.KV_EXPANSION_KERNELS, re.IGNORECASE)
    for group, funcs in groups.items():
        path = args.out / group
        print(f"building {path.name}", flush=True)
        try:
            ex, seconds = ba.build_library(funcs, path, "native",
                                           argparse.Namespace(build_native_kernels=False, jobs=None),
                                           pipeline=cuda_decoder_pipeline)
        except tvm.error.InternalError as err:  # TVM 0.27: FuseTIR (see above)
            if group == LIBRARY:
                raise
            model = group.split("__")[0]
            error = str(err).strip().splitlines()[-1]
            manifest["models"][model]["tvm_not_built"] = f"TVM's own CUDA pipeline fails on the unpartitioned graph: {error}"
            manifest["models"][model]["vm"].pop("tvm")
            print(f"{group}: TVM's own build fails: {error}", flush=True)
            continue
        calls = ba.vm_calls(ex)
        names = sorted(g.name_hint for g, f in funcs.items() if f.attrs is not None and "Codegen" not in f.attrs
                       and "global_symbol" in f.attrs and isinstance(f, tvm.relax.Function))
        for fname in names:
            model = fname.split("__")[0]
            manifest["models"][model].setdefault("library", {})[fname.rsplit("__", 1)[1]] = path.name
            if fname.endswith("__mqa"):
                n = sum(c in set(attention) for c in calls.get(fname, []))
                if n != LAYERS:
                    raise SystemExit(f"{fname} calls its attention {n} times, want {LAYERS}")
                # TVM kernels named like an expansion, which the partition check proved are not K/V's
                manifest["models"][model]["not_kv_expansion_kernels"] = sorted(
                    {c for c in calls.get(fname, []) if c not in symbols and pattern.search(c)})
        keys = collect_kernel_keys(ex)
        own = [s for s in symbols if any(s.startswith(n + "__") for n in names)]
        manifest["libraries"][path.name] = {
            "functions": names, "size": path.stat().st_size, "seconds": seconds,
            "fa2_kernels_linked": [k.label for k in keys],
            "exports": ba.check_exports(path, own, [k.entry_symbol for k in keys] if keys else None)}
    files = {str(p.relative_to(args.out)): p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
    manifest["files"], manifest["total_bytes"] = files, sum(files.values())
    manifest["build_seconds"] = round(time.time() - t0, 1)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    print(f"total {manifest['total_bytes'] / 2**20:.1f} MiB in {args.out} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
