"""PagedKVCache attention and decoder speed: FA2 (UseFlashAttentionForPagedKVCache) vs TVM's TIR kernels.

Runs on the GPU machine with the artifacts of ``python tools/gpu/build_paged.py`` (runtime-only TVM):

    source kit/setup.sh && python3 benchmarks/paged_attention.py --out paged_attention.json   # kit: mqa-byoc runtime-kit

Per case and implementation (``tir.so`` page 16, ``fa2.so`` page = FA2's tile): layer 0's paged
attention call (``attend``: append of the new K/V + attention; the same work in both) at decode with
16k context and at a 4k prefill, batch 1 and 8; and whole-decoder decode tokens/s (GQA case) at 4k
context. Times are medians of CUDA-synchronised wall times per call (``--iters``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from mqa_byoc.testing.cupti import ATTENTION_KERNEL  # noqa: E402  (our attention kernels' names)
ARTIFACTS = ROOT / ".gpu-artifacts" / "paged"
# the attention work of a call on either side: ours (FA2, our decode kernel) and our bridging kernels; TVM's
# TIR attention kernels and its LSE merge. The K/V append and RoPE kernels are the same on both sides.
ATTENTION_KERNELS = re.compile(ATTENTION_KERNEL.pattern + r"|csr_to_block_table|finish_rows|batch_(prefill|decode)_(paged|ragged)_kv"
                               r"|merge_state", re.IGNORECASE)


def _timed(torch, fn, iters):
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _fill(model, cache, seqs, context, qkv_of):
    """Prefill each sequence to ``context`` tokens, one sequence per forward (chunked to 8k). The host waits
    for each forward, as a serving loop that reads its logits does: back-to-back forwards without it faulted
    in TVM's TIR kernels at batch 8 x 16k on the H200 (cudaErrorInvalidAddressSpace; never with the wait)."""
    import torch

    for s in seqs:
        done = 0
        while done < context:
            n = min(8192, context - done)
            model.begin(cache, [s], [n])
            model.attend(cache, qkv_of(1, n))
            model.end(cache)
            torch.cuda.synchronize()
            done += n


def bench_attention(tvm, torch, model, batch, context, prefill, iters):
    cfg = model.cfg
    heads = cfg["num_q_heads"] + 2 * cfg["num_kv_heads"]
    dtype = getattr(torch, cfg["dtype"])

    def qkv_of(b, s):
        return torch.randn(b, s, heads, cfg["head_dim"], device=model.device, dtype=torch.float32).to(dtype)

    seqs = list(range(batch))
    if prefill:
        cache = model.new_cache(batch, 2 * batch * context, batch * context)  # each step frees its sequences
        qkv = qkv_of(1, batch * context)
        state = {"next": 0}

        def step():
            ids = [state["next"] + i for i in seqs]
            state["next"] += batch
            model.add(cache, ids)
            model.begin(cache, ids, [context] * batch)
            model.attend(cache, qkv)
            model.end(cache)
            model.remove(cache, ids)
    else:
        cache = model.new_cache(batch, batch * (context + iters + 4), 8192)
        model.add(cache, seqs)
        _fill(model, cache, seqs, context, qkv_of)
        qkv = qkv_of(batch, 1)

        def step():
            model.begin(cache, seqs, [1] * batch)
            model.attend(cache, qkv)
            model.end(cache)
    step()  # warm-up
    wall = _timed(torch, step, iters)
    from mqa_byoc.testing.cupti import capture_kernels

    with capture_kernels() as cap:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for name, us in cap.events:
        kernels[name] = kernels.get(name, 0.0) + us
    attn = sum(us for name, us in kernels.items() if ATTENTION_KERNELS.search(name))
    return {"wall_us": wall * 1e6, "attention_kernels_us": attn, "kernels_us": kernels}


def bench_decoder(tvm, torch, model, batch, context, iters):
    cfg = model.cfg
    model.set_params(seed=0)
    seqs = list(range(batch))
    cache = model.new_cache(batch, batch * (context + iters + 4), 8192)
    model.add(cache, seqs)
    for s in seqs:
        ids = torch.randint(0, cfg["vocab"], (1, context), device=model.device, dtype=torch.int32)
        for start in range(0, context, 4096):
            n = min(4096, context - start)
            model.begin(cache, [s], [n])
            model.logits("prefill", cache, ids[:, start:start + n].contiguous())
            model.end(cache)
            torch.cuda.synchronize()  # as in _fill
    ids = torch.randint(0, cfg["vocab"], (batch, 1), device=model.device, dtype=torch.int32)

    def step():
        model.begin(cache, seqs, [1] * batch)
        model.logits("decode", cache, ids)
        model.end(cache)
    step()
    t = _timed(torch, step, iters)
    return {"seconds_per_step": t, "tokens_per_second": batch / t}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results"
                    / "paged_attention.json")
    ap.add_argument("--cases", nargs="*", default=["gqa64_8_d128", "mqa71_1_d64"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--impls", nargs="*", default=["fa2", "tir"],
                    help="run only these (a CUDA fault poisons the process: run TVM's kernels in a call of their own)")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--kinds", nargs="*", default=["decode", "prefill", "decoder"],
                    help="which measurements: decode, prefill (one attention call), decoder (tokens/s)")
    ap.add_argument("--decode-context", type=int, default=16384)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--decoder-context", type=int, default=4096)
    args = ap.parse_args(argv)

    import torch
    if os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        from mqa_byoc.deploy import prepare_runtime

        prepare_runtime()  # the runtime kit's set-up: CUDA runtime + nvcc hook
    import tvm
    import tvm.runtime.vm  # noqa: F401

    import tvm_ffi

    from mqa_byoc.runtime.paged_driver import PagedModel
    from mqa_byoc.testing.cuda_compile import HOOK, memoized_cuda_compile

    previous = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    if previous is not None:  # tir.so and fa2.so share most kernels: compile each once at load
        tvm_ffi.register_global_func(HOOK, memoized_cuda_compile(previous), override=True)

    manifest = json.loads((ARTIFACTS / "manifest.json").read_text())
    # measurements of earlier runs into the same --out are kept (one file for separate --impls runs)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.update({"device": torch.cuda.get_device_name(0), "iters": args.iters})
    results.setdefault("cases", {})

    def write():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    for name in args.cases:
        case = manifest[name]
        rows = results["cases"].setdefault(name, {"page_size": case["page_size"]})
        for impl in args.impls:
            model = PagedModel(tvm, torch, ARTIFACTS / case["libraries"][impl], case, impl)
            for batch in args.batches:
                for kind, n in (("decode", args.decode_context), ("prefill", args.prefill_len)):
                    if kind not in args.kinds:
                        continue
                    key = f"{kind}{n}_b{batch}"
                    r = bench_attention(tvm, torch, model, batch, n, kind == "prefill", args.iters)
                    rows.setdefault(key, {})[impl] = r
                    print(f"{name} {impl} {key}: call {r['wall_us']:.1f} us, attention kernels "
                          f"{r['attention_kernels_us']:.1f} us", flush=True)
                    write()
            if name.startswith("gqa") and "decoder" in args.kinds:
                for batch in args.batches:
                    key = f"decoder_decode{args.decoder_context}_b{batch}"
                    r = bench_decoder(tvm, torch, model, batch, args.decoder_context, args.iters)
                    rows.setdefault(key, {})[impl] = r
                    print(f"{name} {impl} {key}: {r['tokens_per_second']:.1f} tokens/s", flush=True)
                    write()
            del model
        for key, v in rows.items():
            if key != "page_size" and "fa2" in v and "tir" in v:
                f, t = v["fa2"], v["tir"]
                if "attention_kernels_us" in f:
                    v["tir_over_fa2"] = {"attention_kernels": t["attention_kernels_us"] / max(f["attention_kernels_us"], 1e-9),
                                         "call": t["wall_us"] / f["wall_us"]}
                else:
                    v["fa2_over_tir_tokens_per_second"] = f["tokens_per_second"] / t["tokens_per_second"]
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
