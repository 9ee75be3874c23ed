"""Whole decoders (CodeLlama-34B shapes, 4 layers, fp16) against the bytes and FLOP limits, and against
what a user would run instead (Hugging Face transformers on torch), in one run on the GPU.

    mqa-byoc profile build --kv-cache paged --preset codellama-34b --layers 4 --out DIR/paged-gemm            # build machine
    mqa-byoc profile build --kv-cache paged --preset codellama-34b --layers 4 --no-gemm --out DIR/paged-tvm
    mqa-byoc profile build --provider hopper --preset codellama-34b --layers 4 --out DIR/inplace-gemm
    mqa-byoc profile build --provider hopper --preset codellama-34b --layers 4 --no-gemm --out DIR/inplace-tvm
    python3 -m tvm_runtime_kit benchmarks/decoders.py tvm --lib DIR/paged-gemm --name paged-gemm --out parts/   # GPU, one process per part
    python3 benchmarks/decoders.py torch-gemm --out parts/                                                     # GPU, torch only
    python3 benchmarks/decoders.py hf --mode eager --out parts/                                                # GPU, transformers
    python benchmarks/decoders.py report parts/ --out benchmarks/results/<date>-decoders                       # anywhere

Parts (each writes ``<out>/<name>.json``; ``report`` merges them):

- ``tvm``: one exported decoder library (``mqa=True``'s: FA2 on the PagedKVCache, or the in-place
  cache's): prefill of one sequence (2k, 16k tokens; CUDA events around one step, median of runs) and
  decode back to back (CUDA events, no host sync per step) at each ``--decode`` case BATCHxCONTEXT
  (the paged cache holds BATCH sequences of CONTEXT tokens; the in-place cache one), then each case
  again under CUPTI for the kernel time per step and the GEMM table (:mod:`mqa_byoc.runtime.gemm_rates`).
  Also the logits of a fixed prompt and of the decode steps after it (``--logits``), to compare builds.
  The library's kernel options (its ``mqa_byoc_kernel_options()``: ``gemm_algorithm`` says whether
  cuBLASLt's small-M algorithms are measured or the heuristic's first choice) are recorded.
- ``torch-gemm``: ``torch.matmul(x, W^T)`` (``torch.addmm`` with the residual where our GEMM adds one) on
  the prefill GEMMs' shapes, CUDA events: cuBLAS's TFLOP/s on this GPU in the same run.
- ``hf``: ``LlamaForCausalLM`` from a config of the same shapes (random weights, fp16, SDPA): prefill
  of 2k tokens (a forward with the last position's logits), decode tokens/s at batch 1 and 8 after 2k
  through ``generate`` (CUDA events per generated token from a logits processor; eager with its
  dynamic cache, or ``--mode compile``: ``cache_implementation="static"``, which ``generate`` compiles
  with ``torch.compile``).

Limits (the GPU's own, :mod:`mqa_byoc.runtime.gpu_limits`: the H200's 4.8 TB/s and 989 TFLOP/s, the
H100 SXM's 3.35 TB/s and 989 TFLOP/s): decode: every weight the step multiplies by (6.06 GB) and the K/V
of every sequence once at the HBM bandwidth; prefill: the GEMM and causal-attention FLOPs at the dense
fp16 tensor rate. Each part records the limits of the GPU it ran on; ``report`` measures against them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HBM_TBPS = 4.8  # the H200's: the limits of parts that record none
DENSE_TFLOPS = 989.0
ROOT = Path(__file__).resolve().parents[1]

CODELLAMA = {"num_layers": 4, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128, "hidden_size": 8192,
             "intermediate_size": 22016, "vocab_size": 32000, "dtype": "float16"}


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip() or None
    except OSError:
        return None


def _header(torch, argv) -> dict:
    from mqa_byoc.runtime.gpu_limits import this_gpu_limits

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "limits": this_gpu_limits(torch).as_dict(), "command": " ".join(["decoders.py", *argv])}


# -- limits -----------------------------------------------------------------------------------
def weight_bytes(shapes: dict) -> float:
    """Bytes of every weight a decode step multiplies by (the GEMMs'; not the embedding table)."""
    from mqa_byoc.runtime.gemm_rates import model_gemms

    return sum(2.0 * g.n * g.k * g.count for g in model_gemms(shapes, "decode", 1))


def kv_bytes(shapes: dict, batch: int, context: int) -> float:
    return 2.0 * 2 * shapes["num_layers"] * shapes["num_kv_heads"] * shapes["head_dim"] * batch * context


def decode_limit_ms(shapes: dict, batch: int, context: int, hbm_tbps: float = HBM_TBPS) -> float:
    return (weight_bytes(shapes) + kv_bytes(shapes, batch, context)) / (hbm_tbps * 1e9)


def prefill_limit_ms(shapes: dict, tokens: int, logits: str = "all", tflops: float = DENSE_TFLOPS) -> float:
    from mqa_byoc.runtime.gemm_rates import model_gemms

    gemm = sum(g.flop * g.count for g in model_gemms({**shapes, "logits": logits}, "prefill", tokens))
    attn = 2.0 * tokens * tokens * shapes["num_heads"] * shapes["head_dim"] * shapes["num_layers"]
    return (gemm + attn) / (tflops * 1e9)


# -- TVM libraries ------------------------------------------------------------------------------
class PagedBatch:
    """A paged library's model and cache driven for ``batch`` sequences (mlc-llm's calls: add the
    sequences, then per step begin_forward / the model / end_forward)."""

    def __init__(self, runner):
        self.runner, self.model, self.torch = runner, runner.model, runner.torch

    def prefill(self, batch: int, context: int, steps: int, seed: int = 1):
        m, torch = self.model, self.torch
        cache = m.new_cache(batch, batch * (context + steps + 4), context)
        seqs = list(range(batch))
        m.add(cache, seqs)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for s in seqs:  # one sequence per prefill call: the chunk stays `context` tokens
            ids = torch.randint(0, self.runner.meta["vocab_size"], (1, context), generator=gen, device="cuda",
                                dtype=torch.int32)
            m.begin(cache, [s], [context])
            m.call("prefill", cache, self.runner.tvm.runtime.from_dlpack(ids))
            m.end(cache)
        return cache, seqs

    def decode_fn(self, cache, seqs, seed: int = 2):
        m, torch, tvm = self.model, self.torch, self.runner.tvm
        gen = torch.Generator(device="cuda").manual_seed(seed)
        toks = [tvm.runtime.from_dlpack(torch.randint(0, self.runner.meta["vocab_size"], (len(seqs), 1),
                                                      generator=gen, device="cuda", dtype=torch.int32))
                for _ in range(8)]
        state = {"i": 0, "last": None}
        ones = [1] * len(seqs)

        def step():
            m.begin(cache, seqs, ones)
            state["last"] = m.call("decode", cache, toks[state["i"] % len(toks)])
            m.end(cache)
            state["i"] += 1

        return step, state


def _cupti_phase(fn, steps: int):
    from mqa_byoc.runtime.profiling import phase_record
    from mqa_byoc.testing.cupti import capture_kernels

    with capture_kernels() as cap:
        for _ in range(steps):
            fn()
    return phase_record(cap.stats(), [], steps, cap.events)


def _gemm_summary(meta: dict, phase: dict, name: str, context: int, batch: int, limits) -> dict:
    from mqa_byoc.runtime.gemm_rates import gemm_table

    return gemm_table({**meta, "phases": {name: phase}}, name, context, batch, limits=limits)


def library_kernel_options(runner) -> str | None:
    """The kernel options the library was built with (its ``mqa_byoc_kernel_options()``), or None."""
    try:
        return str(runner.lib["mqa_byoc_kernel_options"]())
    except Exception:  # noqa: BLE001 - a library built without mqa_byoc.build has none
        return None


def run_tvm(args) -> dict:
    from mqa_byoc.deploy import prepare_runtime

    prepare_runtime()
    import torch

    from mqa_byoc.runtime.profiling import find_libraries, open_runner
    from mqa_byoc.sidecar import read_sidecar
    from mqa_byoc.testing.timing import cuda_time_us, time_call_us

    from mqa_byoc.runtime.gpu_limits import this_gpu_limits

    limits = this_gpu_limits(torch)
    lib = find_libraries(str(args.lib))[0]  # mqa=True's
    meta = read_sidecar(lib)
    runner = open_runner(lib, meta)
    paged = meta.get("kv_cache") == "paged"
    shapes = {k: meta[k] for k in (*CODELLAMA, "logits", "fused_projections") if k in meta}
    out = {"name": args.name, "library": os.path.basename(lib), "kv_cache": meta.get("kv_cache"),
           "gemm": meta.get("gemm", True), "provider": meta.get("provider"), "shapes": shapes,
           "kernel_options": library_kernel_options(runner), "prefill": [], "decode": []}

    # prefill: one sequence, one step between CUDA events, median of `reps` (after one warm-up)
    for tokens in args.prefill:
        times, phase = [], None
        for rep in range(args.prefill_reps + 1):
            caches = runner.new_caches(tokens + 1)
            ids = runner.make_ids(1, tokens)
            if rep == args.prefill_reps:  # the last one under CUPTI, for the kernels
                phase = _cupti_phase(lambda: runner.prefill(1, tokens, ids=ids, caches=caches), 1)
                continue
            _, us = time_call_us(lambda: runner.prefill(1, tokens, ids=ids, caches=caches))
            if rep:
                times.append(us / 1e3)
            del caches
        torch.cuda.empty_cache()
        ms = statistics.median(times)
        logits = shapes.get("logits", "last")
        rec = {"tokens": tokens, "ms": round(ms, 3), "runs_ms": [round(t, 3) for t in times],
               "kernel_ms": phase["kernel_ms_per_step"], "limit_ms": round(prefill_limit_ms(shapes, tokens, logits, limits.dense_tflops), 3),
               "gemms": _gemm_summary(shapes, phase, "prefill", tokens, 1, limits)}
        rec["vs_limit"] = round(ms / rec["limit_ms"], 3)
        out["prefill"].append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "gemms"}), flush=True)

    # decode: BATCHxCONTEXT cases, back to back, then under CUPTI
    for case in args.decode:
        batch, context = (int(x) for x in case.split("x"))
        if not paged and batch != 1:
            continue
        if paged:
            pb = PagedBatch(runner)
            cache, seqs = pb.prefill(batch, context, args.steps * 2 + 8)
            step, _ = pb.decode_fn(cache, seqs)
        else:
            caches = {"c": runner.prefill(1, context, max_new_tokens=args.steps * 2 + 8)[1]}
            tok = runner.make_ids(1, 1)

            def step():
                caches["c"] = runner.decode(caches["c"], 1, ids=tok)[1]
        ms = cuda_time_us(step, args.steps, warmup=3) / 1e3
        phase = _cupti_phase(step, max(args.steps // 2, 4))
        limit = decode_limit_ms(shapes, batch, context, limits.hbm_tbps)
        rec = {"batch": batch, "context": context, "ms_per_step": round(ms, 4),
               "tokens_per_s": round(batch * 1000 / ms, 1), "kernel_ms_per_step": phase["kernel_ms_per_step"],
               "limit_ms": round(limit, 4), "vs_limit": round(ms / limit, 3),
               "kernels_vs_limit": round(phase["kernel_ms_per_step"] / limit, 3),
               "gemms": _gemm_summary(shapes, phase, "decode", context, batch, limits),
               "top_kernels": [{"name": k["name"][:90], "us_per_step": round(k["total_ns"] / 1e3 / phase["steps"], 1)}
                               for k in phase["kernels"][:12]]}
        out["decode"].append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("gemms", "top_kernels")}), flush=True)
        if paged:
            del cache
        else:
            del caches
        torch.cuda.empty_cache()

    if args.logits:  # a fixed prompt, its last logits and those of 3 decode steps: to compare builds
        gen = torch.Generator(device="cuda").manual_seed(7)
        ids = torch.randint(0, meta["vocab_size"], (1, 256), generator=gen, device="cuda", dtype=torch.int32)
        caches = runner.new_caches(256 + 8)
        logits, caches = runner.prefill(1, 256, ids=runner.tvm.runtime.from_dlpack(ids), caches=caches)
        rows = [torch.from_dlpack(logits).float().reshape(-1, meta["vocab_size"])[-1].cpu()]
        for t in (11, 12, 13):
            tok = torch.full((1, 1), t, device="cuda", dtype=torch.int32)
            logits, caches = runner.decode(caches, 1, ids=runner.tvm.runtime.from_dlpack(tok))
            rows.append(torch.from_dlpack(logits).float().reshape(-1, meta["vocab_size"])[-1].cpu())
        torch.save(torch.stack(rows), Path(args.out) / f"{args.name}.logits.pt")
    return out


# -- torch.matmul -------------------------------------------------------------------------------
def run_torch_gemm(args) -> dict:
    import torch

    from mqa_byoc.runtime.gemm_rates import model_gemms
    from mqa_byoc.testing.timing import cuda_time_us

    rows = []
    for m in args.m:
        for g in model_gemms({**CODELLAMA, "logits": "all"}, "prefill", m):
            x = torch.randn(g.m, g.k, device="cuda", dtype=torch.float16)
            w = torch.randn(g.n, g.k, device="cuda", dtype=torch.float16) * 0.02
            residual = g.name in ("o_proj", "down_proj")  # our composites add the residual (C, beta = 1)
            r = torch.randn(g.m, g.n, device="cuda", dtype=torch.float16) if residual else None
            fn = (lambda: torch.addmm(r, x, w.T)) if residual else (lambda: torch.matmul(x, w.T))
            iters = max(3, int(3e4 / (g.flop / 700e6)))
            us = cuda_time_us(fn, iters, warmup=3)
            rows.append({"gemm": g.name, "M": g.m, "N": g.n, "K": g.k, "residual": residual, "us": round(us, 2),
                         "tflops": round(g.flop / us / 1e6, 1)})
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return {"name": "torch-gemm", "rows": rows}


# -- Hugging Face transformers ------------------------------------------------------------------
def hf_model(torch, shapes: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=shapes["hidden_size"], intermediate_size=shapes["intermediate_size"],
                      num_hidden_layers=shapes["num_layers"], num_attention_heads=shapes["num_heads"],
                      num_key_value_heads=shapes["num_kv_heads"], head_dim=shapes["head_dim"],
                      vocab_size=shapes["vocab_size"], max_position_embeddings=32768, rope_theta=1e6,
                      attn_implementation="sdpa")
    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _stamped_generate(torch, model, ids, new_tokens: int, **kw):
    """``generate`` with a CUDA event after each token's logits; (prefill ms, [ms per decode step])."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
            return scores

    stamp = Stamp()
    start = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    model.generate(ids, max_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([stamp]),
                   attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    ev = stamp.events
    steps = [ev[i].elapsed_time(ev[i + 1]) for i in range(len(ev) - 1)]
    return start.elapsed_time(ev[0]), steps


def run_hf(args, save=lambda _out: None) -> dict:
    import torch
    import transformers

    model = hf_model(torch, CODELLAMA)
    out = {"name": f"hf-{args.mode}", "mode": args.mode, "transformers": transformers.__version__, "prefill": [],
           "decode": []}
    kw = {"cache_implementation": "static"} if args.mode == "compile" else {}
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.inference_mode():
        for tokens in (args.prefill if args.mode == "eager" else []):  # the prompt, the last position's logits
            ids = torch.randint(0, CODELLAMA["vocab_size"], (1, tokens), generator=gen, device="cuda")
            times = []
            for rep in range(args.prefill_reps + 1):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                model(ids, logits_to_keep=1)
                b.record()
                b.synchronize()
                if rep:
                    times.append(a.elapsed_time(b))
            rec = {"tokens": tokens, "ms": round(statistics.median(times), 3), "runs_ms": [round(t, 3) for t in times],
                   "how": "model(ids, logits_to_keep=1), eager"}
            out["prefill"].append(rec)
            print(json.dumps(rec), flush=True)
            save(out)
        for case in args.decode:
            batch, context = (int(x) for x in case.split("x"))
            ids = torch.randint(0, CODELLAMA["vocab_size"], (batch, context), generator=gen, device="cuda")
            t0 = time.time()
            _stamped_generate(torch, model, ids, args.steps, **kw)  # warm-up (compiles with --mode compile)
            warm_s = time.time() - t0
            prefill_ms, steps = _stamped_generate(torch, model, ids, args.steps, **kw)
            ms = statistics.median(steps[2:])
            rec = {"batch": batch, "context": context, "ms_per_step": round(ms, 4),
                   "tokens_per_s": round(batch * 1000 / ms, 1), "generate_prefill_ms": round(prefill_ms, 3),
                   "warmup_s": round(warm_s, 1), "steps": len(steps)}
            out["decode"].append(rec)
            print(json.dumps(rec), flush=True)
            save(out)
            torch.cuda.empty_cache()
        if args.mode == "compile":  # the prompt through the compiled forward (torch.compile's default mode)
            forward = torch.compile(model.forward)
            for tokens in args.prefill:
                ids = torch.randint(0, CODELLAMA["vocab_size"], (1, tokens), generator=gen, device="cuda")
                t0 = time.time()
                forward(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                warm_s = time.time() - t0
                times = []
                for _ in range(args.prefill_reps):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    forward(ids, logits_to_keep=1)
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
                rec = {"tokens": tokens, "ms": round(statistics.median(times), 3), "runs_ms": [round(t, 3) for t in times],
                       "how": "torch.compile(model.forward)(ids, logits_to_keep=1)", "warmup_s": round(warm_s, 1)}
                out["prefill"].append(rec)
                print(json.dumps(rec), flush=True)
                save(out)
    return out


# -- report -------------------------------------------------------------------------------------
def _fmt(x, nd=3):
    return "-" if x is None else f"{x:,.{nd}f}"


def report(parts_dir: Path, out: Path, commit: str | None, command: str | None, notes=()) -> dict:
    found = {}
    for f in sorted(parts_dir.glob("*.json")):
        d = json.loads(f.read_text())
        if "name" in d:
            found[d["name"]] = d
    order = [*LABELS, "torch-gemm"]
    parts = {k: found[k] for k in sorted(found, key=lambda k: order.index(k) if k in order else len(order))}
    from mqa_byoc.runtime.gpu_limits import record_limits

    meta = next((p for p in parts.values() if "gpu" in p), {})
    limits = record_limits(meta)
    result = {"benchmark": "decoders", "date": meta.get("date"), "commit": commit, "gpu": meta.get("gpu"),
              "torch": meta.get("torch"), "command": command, "notes": list(notes),
              "limits": {**limits.as_dict(),
                         "weight_bytes": weight_bytes(CODELLAMA)}, "parts": parts}
    cmp = result["comparisons"] = {}
    torch_rows = {(r["gemm"], r["M"]): r for r in parts.get("torch-gemm", {}).get("rows", [])}
    for name, p in parts.items():
        for pre in p.get("prefill", []):
            for r in (pre.get("gemms") or {}).get("rows", []):
                t = torch_rows.get((r["gemm"], r["M"]))
                if t:
                    r["torch_tflops"] = t["tflops"]
                    r["vs_torch"] = round(r["tflops"] / t["tflops"], 3)
    for a, b in (("paged-gemm", "paged-tvm"), ("inplace-gemm", "inplace-tvm")):
        if a in parts and b in parts:
            for pa in parts[a]["prefill"]:
                pb = next((x for x in parts[b]["prefill"] if x["tokens"] == pa["tokens"]), None)
                if pb:
                    cmp[f"{a}_vs_{b}_prefill_{pa['tokens']}"] = round(pb["ms"] / pa["ms"], 3)
    for name, base in (("paged-gemm-measure", "paged-gemm"), ("paged-gemm-graph", "paged-gemm"),
                       ("inplace-gemm-graph", "inplace-gemm"), ("inplace-gemm", "inplace-tvm"),
                       ("paged-gemm", "paged-tvm"), ("paged", "paged-before"), ("paged-graph", "paged"),
                       ("paged-unsplit-warm", "paged-before"),
                       ("inplace-cublaslt", "inplace-dlight"), ("paged-grid", "paged-grid-before"),
                       ("paged-grid-2", "paged-grid-before-2")):
        if name in parts and base in parts:
            for da in parts[name]["decode"]:
                db = next((x for x in parts[base]["decode"]
                           if (x["batch"], x["context"]) == (da["batch"], da["context"])), None)
                if db:
                    cmp[f"{name}_vs_{base}_decode_b{da['batch']}_{da['context']}"] = round(db["ms_per_step"] /
                                                                                          da["ms_per_step"], 3)
    for hf in ("hf-eager", "hf-compile"):
        for ours in ("paged-gemm", "paged-gemm-graph", "inplace-gemm", "inplace-gemm-graph"):
            if hf in parts and ours in parts:
                for dh in parts[hf]["decode"]:
                    do = next((x for x in parts[ours]["decode"] if (x["batch"], x["context"]) ==
                               (dh["batch"], dh["context"])), None)
                    if do:
                        cmp[f"{ours}_vs_{hf}_decode_b{dh['batch']}_{dh['context']}"] = round(
                            dh["ms_per_step"] / do["ms_per_step"], 3)
                for ph in parts[hf]["prefill"]:
                    po = next((x for x in parts[ours]["prefill"] if x["tokens"] == ph["tokens"]), None)
                    if po:
                        cmp[f"{ours}_vs_{hf}_prefill_{ph['tokens']}"] = round(ph["ms"] / po["ms"], 3)
    logits = parts_dir / "logits.json"
    if logits.is_file():
        result["logits"] = json.loads(logits.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    try:
        plot(result, out.with_suffix(".png"))
    except (ImportError, ValueError) as e:
        print(f"no PNG ({e})")
    return result


LABELS = {"paged-gemm": "ours, PagedKVCache, GEMMs on cuBLASLt",
          "paged-gemm-measure": "same, cuBLASLt algorithm measured",
          "paged-gemm-graph": "ours, PagedKVCache, GEMMs on cuBLASLt, CUDA graphs (--cuda-graph)",
          "paged-tvm": "ours, PagedKVCache, GEMMs on TVM's kernels (--no-gemm)",
          "inplace-gemm": "ours, in-place cache, GEMMs on cuBLASLt (static M = 1: dlight's GEMV)",
          "inplace-gemm-graph": "ours, in-place cache, GEMMs on cuBLASLt, CUDA graphs (--cuda-graph)",
          "inplace-tvm": "ours, in-place cache, GEMMs on TVM's kernels (--no-gemm)",
          "paged-before": "ours, PagedKVCache, cuBLASLt: heuristic's algorithms timed back to back (the choice before)",
          "paged-unsplit-warm": "ours, PagedKVCache, cuBLASLt: with split-count-1 forms, timed back to back",
          "paged": "ours, PagedKVCache, cuBLASLt: with split-count-1 forms, from a cold L2 (the choice now)",
          "paged-graph": "same, CUDA graphs (--cuda-graph)",
          "inplace-dlight": "ours, in-place cache, static M = 1 on dlight's GEMV (the rule before)",
          "inplace-cublaslt": "ours, in-place cache, static M = 1 on cuBLASLt (the rule now)",
          "paged-grid-before": "ours, PagedKVCache: the decode kernel's grid sized for the longest sequence the pages hold "
                               "(before)",
          "paged-grid": "ours, PagedKVCache: the decode kernel's grid sized for twice a typical sequence (now)",
          "paged-grid-2": "the build now, timed again (third of four)",
          "paged-grid-before-2": "the build before, timed again (last)",
          "hf-eager": "HF transformers, eager (SDPA, dynamic cache)",
          "hf-compile": "HF transformers, torch.compile (static cache)"}


def markdown(result) -> str:
    parts, cmp = result["parts"], result["comparisons"]
    lim = result["limits"]
    whose = f" (the {lim['gpu']}'s: {lim['source']})" if "source" in lim else ""
    lines = ["# Whole decoders vs the bytes and FLOP limits, and vs HF transformers (CodeLlama-34B shapes, 4 layers, fp16)",
             "", f"{result['date']}, commit {result['commit']}, {result['gpu']}, torch {result['torch']}; "
             f"`{result['command']}`", "",
             f"Limits: decode: every weight the step multiplies by ({result['limits']['weight_bytes'] / 1e9:.2f} GB) and "
             f"the K/V once at {lim['hbm_tbps']} TB/s; prefill: the GEMM and causal attention FLOPs at "
             f"{lim['dense_tflops']:.0f} TFLOP/s{whose}. Ours: CUDA events around back-to-back steps (decode) or one step (prefill, median); kernels: "
             "CUPTI. HF: `generate`, a CUDA event per token.", "", *[f"- {n}" for n in result.get("notes", [])],
             *([""] if result.get("notes") else []),
             ]
    rows = [f"| {LABELS.get(name, name)} | {d['batch']} | {d['context']} | {d['ms_per_step']:.3f} | "
            f"{d['tokens_per_s']:,.1f} | {_fmt(d.get('kernel_ms_per_step'))} | {_fmt(d.get('limit_ms'))} | "
            + (f"{d['vs_limit']:.2f}x ({d['kernels_vs_limit']:.2f}x)" if "vs_limit" in d else "-") + " |"
            for name, p in parts.items() for d in p.get("decode", [])]
    if rows:
        lines += ["## Decode", "", "| | batch | context | ms/step | tokens/s | kernels ms/step | limit ms | "
                  "vs limit (kernels) |", "|---|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]
    rows = [f"| {LABELS.get(name, name)} | {d['tokens']} | {d['ms']:.2f} | {_fmt(d.get('kernel_ms'), 2)} | "
            f"{_fmt(d.get('limit_ms'), 2)} | " + (f"{d['vs_limit']:.2f}x" if "vs_limit" in d else "-") + " |"
            for name, p in parts.items() for d in p.get("prefill", [])]
    if rows:
        lines += ["## Prefill", "", "| | tokens | ms | kernels ms | limit ms | vs limit |", "|---|---:|---:|---:|---:|---:|",
                  *rows]
    rows = []
    for name, p in parts.items():
        for d in p.get("prefill", []):
            for r in (d.get("gemms") or {}).get("rows", []):
                rows.append(f"| {name} | {d['tokens']} | {r['gemm']} | {r['M']} x {r['N']} x {r['K']} | "
                            f"{r['us_per_call']:,.1f} | {r['tflops']:.0f} | {_fmt(r.get('torch_tflops'), 0)} | "
                            f"{_fmt(r.get('vs_torch'), 2)} |")
    if rows:
        lines += ["", "## Prefill GEMMs vs torch.matmul (same shapes, same run)", "",
                  "| build | tokens | GEMM | M x N x K | µs/call | TFLOP/s | torch TFLOP/s | ours / torch |",
                  "|---|---:|---|---|---:|---:|---:|---:|", *rows]
    rows = []
    for name, p in parts.items():
        for d in p.get("decode", []):
            for r in (d.get("gemms") or {}).get("rows", []):
                rows.append(f"| {name} | {d['batch']} | {d['context']} | {r['gemm']} | {r['us_per_call']:.1f} | "
                            f"{r['tbps']:.2f} | {100 * r['fraction_of_limit']:.0f}% | "
                            f"{', '.join(k[:40] for k in r['kernels'])} |")
    if rows:
        lines += ["", "## Decode GEMMs (TB/s of the bytes each must read)", "",
                  f"| build | batch | context | GEMM | µs/call | TB/s | of {lim['hbm_tbps']} TB/s | kernels |",
                  "|---|---:|---:|---|---:|---:|---:|---|", *rows]
    if cmp:
        lines += ["", "## Ratios (same run)", ""] + [f"- `{k}`: {v}x" for k, v in cmp.items()]
    if result.get("logits"):
        lines += ["", "## Logits between builds (same weights, same tokens)", ""]
        lines += [f"- {k}: max abs diff {v['max_abs']:.4g} (logits up to {v['ref_max_abs']:.3g}), argmax equal "
                  f"{v['argmax_equal']}" for k, v in result["logits"].items()]
    return "\n".join(lines) + "\n"


def _panel(ax, labels, bars, marks, bar_label, mark_label, color, title, ylim=None):
    """One bar panel with a black marker per bar (its limit, or its kernels' share): log scale, or a linear
    one from ``ylim[0]`` when given."""
    x = range(len(labels))
    ax.bar(x, bars, color=color, label=bar_label)
    ax.scatter(x, marks, color="black", marker="_", s=400, label=mark_label, zorder=3)
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    if ylim is None:
        ax.set_yscale("log")
    else:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.legend(fontsize=8)


def plot(result, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts, lim = result["parts"], result["limits"]
    if not any(p.get("decode") for p in parts.values()):
        raise ValueError("the plot needs decode rows")
    decode = [(f"{name}\nb{d['batch']} {d['context'] // 1024}k", d) for name, p in parts.items() for d in p.get("decode", [])]
    prefill = [(f"{name}\n{d['tokens'] // 1024}k", d) for name, p in parts.items() for d in p.get("prefill", [])]
    labels = [lb for lb, _ in decode]
    if not prefill:  # a decode-only run: each step against its limit
        fig, ax = plt.subplots(figsize=(12, 6))
        steps = [d.get("vs_limit", float("nan")) for _, d in decode]
        _panel(ax, labels, steps, [d.get("kernels_vs_limit", float("nan")) for _, d in decode],
               f"decode step / bytes limit ({lim['hbm_tbps']} TB/s)", "its kernels alone / limit", "tab:blue",
               "decode: time over the bytes limit", ylim=(1.0, max(v for v in steps if v == v) * 1.05))
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6))
        _panel(ax1, labels, [d["ms_per_step"] / d["batch"] for _, d in decode],
               [d.get("limit_ms", float("nan")) / d["batch"] for _, d in decode],
               "ms per token (step / batch)", f"bytes limit ({lim['hbm_tbps']} TB/s)", "tab:blue", "decode: ms per token")
        _panel(ax2, [lb for lb, _ in prefill], [d["ms"] for _, d in prefill],
               [d.get("limit_ms", float("nan")) for _, d in prefill],
               "prefill ms", f"FLOP limit ({lim['dense_tflops']:.0f} TFLOP/s)", "tab:orange", "prefill: ms")
    fig.suptitle(f"CodeLlama-34B shapes, 4 layers, fp16, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def compare_logits(parts_dir: Path, reference: str, prefix: str = "") -> dict:
    """Max abs difference of the logits (``<name>.logits.pt``) of each build whose name starts with
    ``prefix`` to ``reference``'s (same model, weights and tokens); added to ``logits.json``."""
    import torch

    ref = torch.load(parts_dir / f"{reference}.logits.pt")
    path = parts_dir / "logits.json"
    out = json.loads(path.read_text()) if path.is_file() else {}
    for f in sorted(parts_dir.glob(f"{prefix}*.logits.pt")):
        name = f.name.removesuffix(".logits.pt")
        if name == reference:
            continue
        got = torch.load(f)
        out[f"{name} vs {reference}"] = {"max_abs": float((got - ref).abs().max()), "ref_max_abs": float(ref.abs().max()),
                                         "argmax_equal": bool((got.argmax(-1) == ref.argmax(-1)).all())}
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def _prefill_args(parser, lengths: list[int]) -> None:
    """``--prefill [N ...]`` (the flag alone, or left out: ``lengths``) and ``--no-prefill`` (decode only)."""
    import argparse

    class Lengths(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            setattr(namespace, self.dest, values or list(lengths))

    parser.add_argument("--prefill", type=int, nargs="*", action=Lengths, default=list(lengths),
                        help=f"prompt lengths of the timed prefills (default, and the flag alone: {' '.join(map(str, lengths))})")
    parser.add_argument("--no-prefill", dest="prefill", action="store_const", const=[], help="time no prefill")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tvm", help="one exported decoder library (GPU)")
    t.add_argument("--lib", type=Path, required=True, help="a `mqa-byoc profile build` directory")
    t.add_argument("--name", required=True)
    _prefill_args(t, [2048, 16384])
    t.add_argument("--prefill-reps", type=int, default=3)
    t.add_argument("--decode", nargs="*", default=["1x2048", "1x16384", "8x2048", "32x2048"], help="BATCHxCONTEXT")
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--logits", action="store_true", help="also save logits of a fixed prompt (<name>.logits.pt)")
    t.add_argument("--out", type=Path, required=True, help="folder of the parts")
    g = sub.add_parser("torch-gemm", help="torch.matmul on the prefill GEMM shapes (GPU)")
    g.add_argument("--m", type=int, nargs="*", default=[2048, 16384])
    g.add_argument("--out", type=Path, required=True)
    h = sub.add_parser("hf", help="HF transformers LlamaForCausalLM of the same shapes (GPU)")
    h.add_argument("--mode", choices=["eager", "compile"], default="eager")
    _prefill_args(h, [2048])
    h.add_argument("--prefill-reps", type=int, default=3)
    h.add_argument("--decode", nargs="*", default=["1x2048", "8x2048"])
    h.add_argument("--steps", type=int, default=24)
    h.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("logits", help="compare the saved logits of the builds to one of them")
    c.add_argument("parts", type=Path)
    c.add_argument("--reference", default="paged-tvm")
    c.add_argument("--prefix", default="", help="compare the builds whose names start with this")
    r = sub.add_parser("report", help="merge the parts: JSON, markdown and PNG")
    r.add_argument("parts", type=Path)
    r.add_argument("--out", type=Path, required=True, help="path without suffix")
    r.add_argument("--commit", default=None)
    r.add_argument("--command", default=None, help="the command line of the run, for the record")
    r.add_argument("--note", action="append", default=[], help="a sentence for the markdown (repeatable)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    if args.cmd == "report":
        print(markdown(report(args.parts, args.out, args.commit or _commit(), args.command, args.note)))
        return 0
    if args.cmd == "logits":
        print(json.dumps(compare_logits(args.parts, args.reference, args.prefix), indent=1))
        return 0
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    header = _header(torch, argv)

    def save(part):
        (args.out / f"{part['name']}.json").write_text(json.dumps({**header, **part}, indent=1) + "\n")

    if args.cmd == "hf":
        save(run_hf(args, save))
    else:
        save({"tvm": run_tvm, "torch-gemm": run_torch_gemm}[args.cmd](args))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
