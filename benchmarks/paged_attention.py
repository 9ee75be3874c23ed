"""PagedKVCache attention: our kernels vs FlashInfer's (kernels alone) and vs TVM's TIR kernels (decoders).

Kernels side by side on the same pages (no TVM; FlashInfer is an optional dependency, ``pip install
"mqa-byoc[bench]"``): build our library here, run on the GPU, write the report here:

    python benchmarks/paged_attention.py build-native --out .bench-artifacts/paged-native
    python benchmarks/paged_attention.py kernels --native .bench-artifacts/paged-native --out paged-kernels.json
    python benchmarks/paged_attention.py report paged-kernels.json --out paged-kernels.md --commit C --date D --command CMD

``kernels``: decode, paged prefill (new tokens over the cached keys) and ragged prefill (causal) for GQA
64/8/128, 32/8/128 and MQA 71/1/64, fp16 and bf16, batch 1, 8, 32, 64, lengths mixed over 1k-16k (and
all 16k for decode): ours through the C API our cache wrappers call, FlashInfer's batch decode / prefill
wrappers with pages of 16 and of ours. GPU kernel time per call from CUPTI, the bytes limit of decode, TFLOP/s
of prefill, every output against fp32.

Decoders (TVM's PagedKVCache, ``tir.so`` page 16 vs ``fa2.so`` page = FA2's tile), with the artifacts of
``python tools/gpu/build_paged.py`` (runtime-only TVM):

    source kit/setup.sh && python3 benchmarks/paged_attention.py --out paged_attention.json   # kit: mqa-byoc runtime-kit

Per case and implementation: layer 0's paged
attention call (``attend``: append of the new K/V + attention; the same work in both) at decode with
16k context and at a 4k prefill, batch 1 and 8; and whole-decoder decode tokens/s (GQA case) at 4k
context. Times are medians of CUDA-synchronised wall times per call (``--iters``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from mqa_byoc.testing.cupti import ATTENTION_KERNEL  # noqa: E402  (our attention kernels' names)
from mqa_byoc.testing.header import hbm_bytes_per_s  # noqa: E402  (the bytes limit of decode: this GPU's)
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


def main_decoders(argv=None):
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


# ---------------------------------------------------------------------------------------------------------
# Kernels side by side: our paged attention and FlashInfer's, on the same pages (no TVM needed)
#
# FlashInfer (``flashinfer-python``, what mlc-llm runs TVM's PagedKVCache attention on by default on CUDA)
# takes pages in TVM's own layout, (num_pages, 2, H_kv, page_size, D) ("HND"), and the same CSR page list
# (indptr, indices, last_page_len), so both read one tensor. Ours is called through the C API the cache's
# wrappers call (``native/fa2_paged.h``), linked into one shared library by ``build-native``.

SHAPES = {"gqa64_8_d128": (64, 8, 128), "gqa32_8_d128": (32, 8, 128), "mqa71_1_d64": (71, 1, 64)}
BATCHES = (1, 8, 32, 64)
MIN_LEN, MAX_LEN = 1024, 16384
KERNEL_KEYS_OF_BENCH = ("split", "causal")  # FA2 families: paged prefill (split, not causal), ragged (causal)
NATIVE_LIB = "libmqa_paged_bench.so"
DECODE_LIB = "libgqa_decode.so"
FLASHINFER_VERSION = "0.7.2"
DEVICE = "cuda"  # where PagedInputs and the reference live (the CPU tests set "cpu")
MISSING_FLASHINFER = (
    "FlashInfer is not installed: it is an optional benchmark dependency, not one of mqa-byoc's. Install it with "
    f'pip install "mqa-byoc[bench]" (flashinfer-python=={FLASHINFER_VERSION}); it compiles its kernels with nvcc at '
    "first use. Run with --no-flashinfer to time our kernels alone.")

# exported names of the benchmark library (our wrappers are built with hidden visibility; this shim
# re-exports the two entries the cache's TVM-FFI wrappers call)
_SHIM = r"""
#include <stdint.h>
extern "C" int mqa_byoc_fa2_paged_forward(const void*, const int32_t*, const void*, const int32_t*, const int32_t*,
    const int32_t*, void*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*,
    const int64_t*, const int64_t*, int, float, int, int, void*);
extern "C" int mqa_byoc_fa2_ragged_forward(const void*, const void*, const void*, void*, float*, const int32_t*,
    const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*, const int64_t*,
    const int64_t*, const int64_t*, int, float, int, int, void*);
extern "C" const char* mqa_byoc_fa2_paged_last_error(void);
#define EXPORT extern "C" __attribute__((visibility("default")))
EXPORT int bench_paged_forward(const void* q, const int32_t* qo, const void* pages, const int32_t* indptr,
    const int32_t* values, const int32_t* last, void* out, float* lse, int64_t batch, int64_t total_q,
    int64_t nnz, int64_t page, int64_t h, int64_t hk, int64_t d, const int64_t* qs, const int64_t* ps,
    const int64_t* os, int bf16, float scale, int causal, int dev, void* stream) {
  return mqa_byoc_fa2_paged_forward(q, qo, pages, indptr, values, last, out, lse, batch, total_q, nnz, page, h, hk,
                                    d, qs, ps, os, bf16, scale, causal, dev, stream);
}
EXPORT int bench_ragged_forward(const void* q, const void* k, const void* v, void* out, float* lse,
    const int32_t* qo, const int32_t* kv, int64_t batch, int64_t total_q, int64_t total_k, int64_t h, int64_t hk,
    int64_t d, const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, int bf16, float scale,
    int causal, int dev, void* stream) {
  return mqa_byoc_fa2_ragged_forward(q, k, v, out, lse, qo, kv, batch, total_q, total_k, h, hk, d, qs, ks, vs, os,
                                     bf16, scale, causal, dev, stream);
}
EXPORT const char* bench_last_error(void) { return mqa_byoc_fa2_paged_last_error(); }
"""

# the FA4 part of the shim (build-native --fa4): the var-len objects by index, on the caller's stream
_FA4_SHIM = r"""
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>
typedef int (*ffi_fn)(void*, const TVMFFIAny*, int32_t, TVMFFIAny*);
@DECLS@
extern "C" int mqa_byoc_fa4_ragged_forward(ffi_fn, const void*, const void*, const void*, void*, float*,
    const int32_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*,
    const int64_t*, const int64_t*, const int64_t*, int, double, int, void*);
extern "C" const char* mqa_byoc_fa2_last_error(void);
static thread_local const char* fa4_error = "";
EXPORT int bench_fa4_ragged_forward(int which, const void* q, const void* k, const void* v, void* out, float* lse,
    const int32_t* qo, const int32_t* kv, int64_t batch, int64_t total_q, int64_t total_k, int64_t h, int64_t hk,
    int64_t d, const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, int bf16, double scale,
    int dev, void* stream) {
  static const ffi_fn table[@N@] = {@TABLE@};
  if (which < 0 || which >= @N@) { fa4_error = "no such FA4 object"; return 1; }
  TVMFFIStreamHandle before = nullptr;
  TVMFFIEnvSetStream(kDLCUDA, dev, stream, &before);
  const int rc = mqa_byoc_fa4_ragged_forward(table[which], q, k, v, out, lse, qo, kv, batch, total_q, total_k, h, hk,
                                             d, qs, ks, vs, os, bf16, scale, dev, stream);
  TVMFFIEnvSetStream(kDLCUDA, dev, before, nullptr);
  fa4_error = rc == -1 ? "FA4 raised a TVM-FFI error" : mqa_byoc_fa2_last_error();
  return rc;
}
EXPORT const char* bench_fa4_last_error(void) { return fa4_error; }
"""


def fa4_ragged_labels() -> list[str]:
    """The FA4 var-len objects the ragged prefill of every benchmark shape runs on (the hopper provider's
    ragged entry): both dtypes, causal and not, each shape's group; head dims FA4 has objects for."""
    from mqa_byoc.kernels import hopper

    return sorted({hopper.HopperKernelKey(dt, d, h // hkv, m).label for h, hkv, d in SHAPES.values()
                   if d in hopper.HEAD_DIMS for dt in ("fp16", "bf16") for m in hopper.VARLEN_MASKS})


def fa4_shim(labels) -> str:
    """C++ of the library's FA4 entry: ``bench_fa4_ragged_forward(which, ...)`` runs the ragged prefill
    (``native/fa4_ragged.cu``) on object ``labels[which]``, launching on ``stream`` (FA4 launches on
    TVM-FFI's environment stream, which it sets for the call)."""
    from mqa_byoc.kernels import hopper

    syms = [hopper.HopperKernelKey.parse(x).symbol for x in labels]
    decls = "".join(f'extern "C" int __tvm_ffi_{s}(void*, const TVMFFIAny*, int32_t, TVMFFIAny*);\n' for s in syms)
    table = ", ".join(f"&__tvm_ffi_{s}" for s in syms)
    return _FA4_SHIM.replace("@DECLS@", decls).replace("@TABLE@", table).replace("@N@", str(len(syms)))


def build_native(out_dir: Path, arch: str = "sm_90", fa4: bool = False, decode_only: bool = False) -> dict:
    """Links our paged-attention object (``native/fa2_paged.cu``: our decode kernel, FA2's split-KV and
    var-len kernels, the bridging kernels) with the FA2 kernel families the benchmark runs into one shared
    library, and builds our decode kernel alone (``native/gqa_decode.cu``, any page size that is a multiple
    of 16) as the decode-kernel benchmark does. Needs nvcc and the FA2 objects (prebuilt or buildable).
    ``fa4``: the library also holds the hopper provider's ragged prefill (FA4's var-len objects of
    :func:`fa4_ragged_labels`, compiled with flash-attn-4, and ``native/fa4_ragged.cu``); it then needs
    TVM-FFI's library at run time (``import tvm_ffi`` before loading it). ``decode_only``: our decode kernel
    alone (no FA2 objects, seconds to build): ``kernels --kinds decode`` then runs it at both page sizes
    with its own plan (the rule the cache's decode entry plans with)."""
    import shutil
    import subprocess

    from mqa_byoc.testing import decode_kernel as dk

    out_dir.mkdir(parents=True, exist_ok=True)

    def decode_lib():
        subprocess.run(["nvcc", f"-gencode=arch=compute_{arch[3:]}a,code={arch}a", "-O3", "-std=c++17", "-Xcompiler",
                        "-fPIC", "-shared", "-o", str(out_dir / DECODE_LIB), str(dk.NATIVE / "gqa_decode.cu")],
                       check=True)

    if decode_only:
        decode_lib()
        info = {"arch": arch, "decode_only": True, "libraries": [DECODE_LIB]}
        (out_dir / "native.json").write_text(json.dumps(info, indent=1) + "\n")
        return info

    from mqa_byoc.compiler import link as _link
    from mqa_byoc.compiler.paged.build import paged_object
    from mqa_byoc.kernels import KernelKey, hopper, static_cudart

    keys = tuple(KernelKey(hd, dt, causal, split) for hd in (64, 128) for dt in ("fp16", "bf16")
                 for causal, split in ((False, True), (True, False)))
    objects = [i.path for i in _link.fa2_inputs(keys, arch, build=True)] + [str(paged_object(arch))]
    labels = fa4_ragged_labels() if fa4 else []
    shim = out_dir / "bench_shim.cc"
    shim.write_text(_SHIM + (fa4_shim(labels) if fa4 else ""))
    cxx = shutil.which("g++") or "c++"
    extra, flags = [], []
    if fa4:
        import tvm_ffi.libinfo

        keys4 = [hopper.HopperKernelKey.parse(x) for x in labels]
        extra = [i.path for i in _link.fa4_inputs(keys4, arch)]
        lib = Path(tvm_ffi.libinfo.find_libtvm_ffi())
        flags = [f"-I{tvm_ffi.libinfo.find_include_path()}", f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}"]
        extra += [f"-L{lib.parent}", "-ltvm_ffi"]
    subprocess.run([cxx, "-shared", "-fPIC", "-O2", *flags, "-o", str(out_dir / NATIVE_LIB), str(shim), *objects,
                    *extra, *static_cudart(arch), "-lpthread", "-ldl", "-lrt"], check=True)
    decode_lib()
    shim.unlink()
    info = {"arch": arch, "fa2_families": [k.stem for k in keys], "libraries": [NATIVE_LIB, DECODE_LIB],
            "fa4_ragged": labels}
    (out_dir / "native.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def mixed_lengths(batch: int, seed: int = 0) -> list[int]:
    """Sequence lengths of a batch: 16k for batch 1; else spread over [1k, 16k], both ends included."""
    if batch == 1:
        return [MAX_LEN]
    import random

    rng = random.Random(seed * 1000 + batch)
    mid = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(batch - 2)]
    return [MAX_LEN, *mid, MIN_LEN]


def decode_bytes(lengths, hkv: int, d: int, elem: int) -> int:
    """K and V bytes a decode reads once (the bytes limit's numerator)."""
    return 2 * sum(lengths) * hkv * d * elem


def causal_flops(q_lens, k_lens, h: int, d: int) -> float:
    """FLOPs of causal attention (bottom-right aligned): 4 * H * D per (query, visible key) pair."""
    pairs = 0
    for lq, lk in zip(q_lens, k_lens):
        off = lk - lq
        pairs += lq * off + lq * (lq + 1) // 2  # row i sees off + i + 1 keys
    return 4.0 * h * d * pairs


def full_flops(q_lens, k_lens, h: int, d: int) -> float:
    return 4.0 * h * d * sum(lq * lk for lq, lk in zip(q_lens, k_lens))


def page_list(lengths, page_size: int, seed: int):
    """TVM's CSR page list for ``lengths`` over shuffled pages: (indptr, values, last_page_len, num_pages)."""
    import random

    counts = [-(-n // page_size) for n in lengths]
    total = sum(counts)
    order = list(range(total))
    random.Random(seed).shuffle(order)
    indptr = [0]
    for c in counts:
        indptr.append(indptr[-1] + c)
    last = [n - (c - 1) * page_size for n, c in zip(lengths, counts)]
    return indptr, order, last, total


class PagedInputs:
    """K/V of a batch in one dtype: per-sequence contiguous copies (the fp32 reference's), and the same
    keys in TVM's page layout for each page size asked for."""

    def __init__(self, torch, lengths, hkv, d, dtype, page_sizes, seed):
        self.torch, self.lengths, self.hkv, self.d, self.dtype = torch, list(lengths), hkv, d, dtype
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        total = sum(lengths)
        self.k = torch.randn(total, hkv, d, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)
        self.v = torch.randn(total, hkv, d, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)
        self.kv_indptr = [0]
        for n in lengths:
            self.kv_indptr.append(self.kv_indptr[-1] + n)
        self.paged = {p: self._pages(p, seed) for p in sorted(set(page_sizes))}

    def _pages(self, page_size, seed):
        torch = self.torch
        indptr, values, last, num_pages = page_list(self.lengths, page_size, seed + page_size)
        pages = torch.zeros(num_pages, 2, self.hkv, page_size, self.d, device=DEVICE, dtype=self.dtype)
        vals = torch.tensor(values, device=DEVICE, dtype=torch.int64)
        for b, n in enumerate(self.lengths):
            lo = self.kv_indptr[b]
            ids = vals[indptr[b]:indptr[b + 1]]
            pad = len(ids) * page_size - n
            for slot, src in ((0, self.k), (1, self.v)):
                x = torch.nn.functional.pad(src[lo:lo + n], (0, 0, 0, 0, 0, pad))  # (pages * page, H_kv, D)
                pages[ids, slot] = x.view(len(ids), page_size, self.hkv, self.d).transpose(1, 2)
        i32 = dict(device=DEVICE, dtype=torch.int32)
        return {"pages": pages, "indptr": torch.tensor(indptr, **i32), "values": torch.tensor(values, **i32),
                "last": torch.tensor(last, **i32), "page_size": page_size}


def cold_decode_case(torch, lengths, h, hkv, d, page, seed, cold_bytes):
    """A decode call's operands on TVM's pages for the decode-kernel benchmarks: (inputs, copies of the
    pages that together hold at least ``cold_bytes`` so that calls taking turns over them read K/V from HBM,
    q, out, the pages' (page, row, head) strides, the CSR (indptr, values, last, page size))."""
    inputs = PagedInputs(torch, lengths, hkv, d, torch.float16, (page,), seed=seed)
    paged = inputs.paged[page]
    pages = paged["pages"]
    copies = [pages] + [pages.clone() for _ in range(max(0, -(-cold_bytes // pages.nbytes) - 1))]
    q = torch.randn(len(lengths), h, d, device=DEVICE).half()
    strides = (pages.stride(0), pages.stride(3), pages.stride(2))
    return inputs, copies, q, torch.empty_like(q), strides, (paged["indptr"], paged["values"], paged["last"], page)


def reference_rows(torch, q, inputs, b, rows, q_offset, causal, scale, g):
    """fp32 attention of sequence ``b``'s query rows ``rows`` (absolute positions q_offset + row among
    its keys when causal): (len(rows), H, D)."""
    lo, n = inputs.kv_indptr[b], inputs.lengths[b]
    k = inputs.k[lo:lo + n].float().repeat_interleave(g, dim=1)  # (n, H, D)
    v = inputs.v[lo:lo + n].float().repeat_interleave(g, dim=1)
    s = torch.einsum("rhd,nhd->hrn", q.float(), k) * scale
    if causal:
        pos = torch.arange(n, device=q.device)
        limit = torch.tensor(rows, device=q.device) + q_offset  # the last key a row sees
        s = s.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
    return torch.einsum("hrn,nhd->rhd", torch.softmax(s, dim=-1), v)


def _profile_calls(torch, calls, iters):
    """GPU time per call of each callable (CUPTI through torch.profiler): one session, the callables' runs
    separated by a marker kernel; returns {name: (µs per call, kernel names)}."""
    import torch.profiler

    for fn in calls.values():  # warm-up (plans, first-launch costs)
        fn()
    torch.cuda.synchronize()
    marker = "spin_kernel"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for fn in calls.values():
            torch.cuda._sleep(1000)
            for _ in range(iters):
                fn()
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")),
                    key=lambda e: e.time_range.start)
    groups, cur = [], None
    for e in events:
        if marker in e.name:
            if cur is not None:
                groups.append(cur)
            cur = []
        elif cur is not None and not e.name.startswith("Memcpy HtoD"):
            cur.append((e.name, e.device_time))
    out = {}
    for name, group in zip(calls, groups):
        names = sorted({n for n, _ in group})
        out[name] = (sum(t for _, t in group) / iters, names)
    return out


class Ours:
    """Our kernels through the library ``build-native`` links (the C API the cache's wrappers call)."""

    def __init__(self, lib_dir: Path):
        import ctypes

        self.ct = ctypes
        info = json.loads((lib_dir / "native.json").read_text()) if (lib_dir / "native.json").is_file() else {}
        self.info = info  # what build-native wrote
        self.fa4_labels = list(info.get("fa4_ragged", []))
        from mqa_byoc.testing import decode_kernel as dk

        self.dk = dk
        self.decode_lib = dk.load_library(lib_dir / DECODE_LIB)
        self.lib = None  # build-native --decode-only: our decode kernel alone
        if info.get("decode_only"):
            return
        if self.fa4_labels:
            import tvm_ffi  # noqa: F401  (loads libtvm_ffi, which the FA4 objects call)
        self.lib = ctypes.CDLL(str(lib_dir / NATIVE_LIB))
        self.lib.bench_last_error.restype = ctypes.c_char_p
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.lib.bench_paged_forward.argtypes = [p] * 8 + [i64] * 7 + [p] * 3 + [i32, ctypes.c_float, i32, i32, p]
        self.lib.bench_ragged_forward.argtypes = [p] * 7 + [i64] * 6 + [p] * 4 + [i32, ctypes.c_float, i32, i32, p]
        if self.fa4_labels:
            self.lib.bench_fa4_last_error.restype = ctypes.c_char_p
            self.lib.bench_fa4_ragged_forward.argtypes = ([i32] + [p] * 7 + [i64] * 6 + [p] * 4
                                                          + [i32, ctypes.c_double, i32, p])

    def _strides(self, t):
        return (self.ct.c_int64 * t.dim())(*t.stride())

    def _launcher(self, torch, entry, args):
        """A call of the C entry ``entry(*args, stream)`` on torch's current stream; a non-zero return
        raises with the library's last error."""
        lib, c_void_p = self.lib, self.ct.c_void_p

        def call():
            if entry(*args, c_void_p(torch.cuda.current_stream().cuda_stream)):
                raise RuntimeError(lib.bench_last_error().decode())
        return call

    def paged(self, torch, q, paged, out, lse, qo_indptr, hkv, scale, causal):
        """``mqa_byoc_fa2_paged_forward``: decode (qo_indptr None: our decode kernel) or paged prefill; in a
        decode-only build, decode on our decode kernel alone."""
        if self.lib is None:
            if qo_indptr is not None:
                raise SystemExit(DECODE_ONLY)
            return self.decode_any_page(torch, q, paged, out, lse, hkv, scale)
        pages = paged["pages"]
        qs, ps, os_ = self._strides(q), self._strides(pages), self._strides(out)
        args = (q.data_ptr(), qo_indptr.data_ptr() if qo_indptr is not None else None, pages.data_ptr(),
                paged["indptr"].data_ptr(), paged["values"].data_ptr(), paged["last"].data_ptr(), out.data_ptr(),
                lse.data_ptr(), paged["indptr"].numel() - 1, q.shape[0], paged["values"].numel(), paged["page_size"],
                q.shape[1], hkv, q.shape[2], qs, ps, os_, int(q.dtype == torch.bfloat16), scale, int(causal),
                q.device.index or 0)
        return self._launcher(torch, self.lib.bench_paged_forward, args)

    def ragged(self, torch, q, k, v, out, lse, qo_indptr, kv_indptr, hkv, scale, causal):
        st = [self._strides(t) for t in (q, k, v, out)]
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), qo_indptr.data_ptr(),
                kv_indptr.data_ptr(), qo_indptr.numel() - 1, q.shape[0], k.shape[0], q.shape[1], hkv, q.shape[2], *st,
                int(q.dtype == torch.bfloat16), scale, int(causal), q.device.index or 0)
        return self._launcher(torch, self.lib.bench_ragged_forward, args)

    def fa4_label(self, dtype_name: str, h: int, hkv: int, d: int, causal: bool) -> str | None:
        """The FA4 var-len object for this call (None: the library has none; build-native --fa4)."""
        dt = {"float16": "fp16", "bfloat16": "bf16"}[dtype_name]
        label = f"{dt} h{d} g{h // hkv} {'varlen_causal' if causal else 'varlen'}"
        return label if label in self.fa4_labels else None

    def ragged_fa4(self, torch, label, q, k, v, out, lse, qo_indptr, kv_indptr, hkv, scale):
        """The hopper provider's ragged prefill: ``mqa_byoc_fa4_ragged_forward`` on object ``label``."""
        st = [self._strides(t) for t in (q, k, v, out)]
        args = (self.fa4_labels.index(label), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                qo_indptr.data_ptr(), kv_indptr.data_ptr(), qo_indptr.numel() - 1, q.shape[0], k.shape[0], q.shape[1],
                hkv, q.shape[2], *st, int(q.dtype == torch.bfloat16), scale, q.device.index or 0)
        lib, c_void_p = self.lib, self.ct.c_void_p

        def call():
            if lib.bench_fa4_ragged_forward(*args, c_void_p(torch.cuda.current_stream().cuda_stream)):
                raise RuntimeError(lib.bench_fa4_last_error().decode())
        return call

    def decode_any_page(self, torch, q, paged, out, lse, hkv, scale):
        """Our decode kernel alone (``gqa_decode.cu``) on pages of any multiple of 16."""
        pages = paged["pages"]
        k, v = pages[:, 0], pages[:, 1]  # (num_pages, H_kv, page, D)
        st = (pages.stride(0), pages.stride(3), pages.stride(2))  # (page, row in page, head)
        return self.dk.Decode(q, k, v, out, lse, k_stride=st, v_stride=st, seqlen_k=0, num_heads_k=hkv, scale=scale,
                              pages=(paged["indptr"], paged["values"], paged["last"], paged["page_size"]),
                              lib=self.decode_lib)


def flashinfer_or_none(required: bool):
    try:
        import flashinfer
    except ImportError as e:
        if required:
            raise SystemExit(f"{MISSING_FLASHINFER}\n({e})") from None
        return None
    return flashinfer


def _error_text(e: BaseException) -> str:
    """A variant's failure for the results: type and message, file paths cut to their file names."""
    return re.sub(r"(?:/[^/\s:]+)+/([^/\s:]+)", r"\1", f"{type(e).__name__}: {e}")[:400]


def _err(out, ref):
    return (out.float() - ref).abs().max().item()


#: largest |difference| of two var-len entries' base-2 LSEs (fp32 sums of the same scores, in other orders)
LSE_TOLERANCE = 1e-2


def _tolerance(dtype_name):
    return 2e-2 if dtype_name == "float16" else 6e-2


DECODE_ONLY = "this build (build-native --decode-only) holds our decode kernel alone: run kernels with --kinds decode"


def bench_kernels(args) -> dict:
    import torch

    fi = None if args.no_flashinfer else flashinfer_or_none(True)
    ours = Ours(args.native)
    if ours.lib is None and set(args.kinds) - {"decode"}:
        raise SystemExit(DECODE_ONLY)
    results = {"native_build": ours.info or None,
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "flashinfer": getattr(fi, "__version__", None), "hbm_bytes_per_s": hbm_bytes_per_s(),
               "iters": args.iters, "cases": []}
    if args.out.is_file():
        results["cases"] = json.loads(args.out.read_text()).get("cases", [])
    done = {(c["kind"], c["shape"], c["dtype"], c["batch"], c["lengths_kind"]) for c in results["cases"]}
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda") if fi else None

    def write():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")

    deadline = time.monotonic() + args.time_budget_s if args.time_budget_s else None
    for kind in args.kinds:  # every decode case first, then the prefills: the order of the goals
        for shape in args.shapes:
            h, hkv, d = SHAPES[shape]
            g, scale = h // hkv, 1.0 / math.sqrt(d)
            unit = 256 if d <= 64 else 128
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                for batch in args.batches:
                    for lengths_kind in args.lengths:
                        if batch == 1 and lengths_kind == "uniform16k":
                            continue  # batch 1 is one 16k sequence in both
                        if kind == "ragged_prefill" and batch > args.max_prefill_batch:
                            continue
                        if kind != "decode" and lengths_kind != "mixed":
                            continue
                        key = (kind, shape, dtype_name, batch, lengths_kind)
                        if key in done:
                            continue
                        if deadline is not None and time.monotonic() > deadline:
                            results["stopped_at_time_budget"] = True
                            write()
                            return results
                        lengths = mixed_lengths(batch) if lengths_kind == "mixed" else [MAX_LEN] * batch
                        inputs = PagedInputs(torch, lengths, hkv, d, dtype,
                                             (16, unit) if kind != "ragged_prefill" else (), seed=batch + 7 * h)
                        fn = {"decode": _case_decode, "paged_prefill": _case_paged_prefill,
                              "ragged_prefill": _case_ragged}[kind]
                        rec = fn(torch, fi, ours, inputs, h, hkv, d, g, scale, unit, workspace, args)
                        rec.update({"kind": kind, "shape": shape, "heads": [h, hkv, d], "dtype": dtype_name,
                                    "batch": batch, "lengths_kind": lengths_kind, "lengths": lengths})
                        results["cases"].append(rec)
                        print(_summary(rec), flush=True)
                        write()
                        del inputs, rec
                        torch.cuda.empty_cache()
    write()
    return results


def _summary(rec):
    t = rec["us"]
    best_fi = min((v for k, v in t.items() if k.startswith("flashinfer")), default=None)
    parts = [f"{rec['kind']} {rec['shape']} {rec['dtype']} b{rec['batch']} {rec['lengths_kind']}:"]
    parts += [f"{k} {v:.1f}" for k, v in t.items()]
    if best_fi:
        parts.append(f"ours/best-FI {t['ours'] / best_fi:.2f}")
    if "bytes_us" in rec:
        parts.append(f"ours/bytes {t['ours'] / rec['bytes_us']:.2f}")
    bad = [k for k, ok in rec["ok"].items() if not ok]
    return " ".join(parts) + (f" WRONG: {bad}" if bad else "")


def _check(rec, name, out, ref, dtype_name):
    e = _err(out, ref)
    rec["max_err"][name] = e
    rec["ok"][name] = bool(e <= _tolerance(dtype_name))


def _case_decode(torch, fi, ours, inputs, h, hkv, d, g, scale, unit, workspace, args):
    b = len(inputs.lengths)
    gen = torch.Generator(device=DEVICE).manual_seed(b)
    q = torch.randn(b, h, d, generator=gen, device=DEVICE, dtype=torch.float32).to(inputs.dtype)
    ref = torch.stack([reference_rows(torch, q[i:i + 1], inputs, i, [inputs.lengths[i] - 1], 0, False, scale, g)[0]
                       for i in range(b)])
    rec = {"us": {}, "kernels": {}, "max_err": {}, "ok": {},
           "bytes_us": decode_bytes(inputs.lengths, hkv, d, q.element_size()) / hbm_bytes_per_s() * 1e6}
    calls, outs = {}, {}
    lse = torch.empty(b, h, device=DEVICE, dtype=torch.float32)
    outs["ours"] = torch.empty_like(q)
    calls["ours"] = ours.paged(torch, q, inputs.paged[unit], outs["ours"], lse, None, hkv, scale, False)
    outs["ours_page16"] = torch.empty_like(q)
    lse16 = torch.empty_like(lse)
    calls["ours_page16"] = ours.decode_any_page(torch, q, inputs.paged[16], outs["ours_page16"], lse16, hkv, scale)
    if fi is not None:
        for page in sorted(inputs.paged):
            p = inputs.paged[page]
            for tc in (False, True):
                name = f"flashinfer_p{page}_{'tensor_cores' if tc else 'cuda_cores'}"
                try:
                    w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=tc, backend="fa2")
                    w.plan(p["indptr"], p["values"], p["last"], h, hkv, d, page, q_data_type=inputs.dtype,
                           kv_data_type=inputs.dtype, sm_scale=scale)
                    o = torch.empty_like(q)
                    outs[name] = o
                    calls[name] = (lambda w=w, o=o, pages=p["pages"]: w.run(q, pages, out=o))
                except Exception as e:  # noqa: BLE001  (a FlashInfer configuration it cannot run: say which)
                    rec.setdefault("errors", {})[name] = _error_text(e)
    _time_and_check(torch, rec, calls, outs, ref, inputs, args.iters)
    return rec


def _time_and_check(torch, rec, calls, outs, ref, inputs, iters, ref_rows=None):
    dtype_name = str(inputs.dtype).removeprefix("torch.")
    for name in list(calls):
        try:
            calls[name]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            rec.setdefault("errors", {})[name] = _error_text(e)
            del calls[name]
            continue
        got = outs[name] if ref_rows is None else outs[name][ref_rows]
        _check(rec, name, got, ref, dtype_name)
    for name, (us, names) in _profile_calls(torch, calls, iters).items():
        rec["us"][name] = us
        rec["kernels"][name] = names


def _prefill_q(torch, inputs, q_lens, h, d, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(sum(q_lens), h, d, generator=gen, device=DEVICE, dtype=torch.float32).to(inputs.dtype)


def _sample_rows(torch, q_lens, k_lens, per_seq=8):
    """Query rows checked against fp32 (every sequence's first and last rows and some between)."""
    rows, spec, start = [], [], 0
    for b, lq in enumerate(q_lens):
        local = sorted({0, lq - 1, *[(lq - 1) * i // (per_seq - 1) for i in range(per_seq)]})
        spec.append((b, local))
        rows += [start + r for r in local]
        start += lq
    return torch.tensor(rows, device=DEVICE), spec


def _ref_prefill(torch, q, inputs, spec, q_lens, causal, scale, g):
    start, parts = 0, []
    for (b, local), lq in zip(spec, q_lens):
        rows = q[start:start + lq][local]
        parts.append(reference_rows(torch, rows, inputs, b, local, inputs.lengths[b] - lq, causal, scale, g))
        start += lq
    return torch.cat(parts)


def _case_paged_prefill(torch, fi, ours, inputs, h, hkv, d, g, scale, unit, workspace, args):
    """New tokens (a chunk of --chunk per sequence) over the whole cached sequence, not causal: the part
    TVM runs with its paged prefill entry (the chunk's own keys are the ragged part, merged after)."""
    q_lens = [args.chunk] * len(inputs.lengths)
    q = _prefill_q(torch, inputs, q_lens, h, d, seed=11)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), device=DEVICE, dtype=torch.int32)
    rows, spec = _sample_rows(torch, q_lens, inputs.lengths)
    # not causal: every row sees all keys (the reference with q_offset = n)
    ref = _ref_prefill(torch, q, inputs, spec, q_lens, False, scale, g)
    rec = {"us": {}, "kernels": {}, "max_err": {}, "ok": {}, "chunk": args.chunk,
           "flops": full_flops(q_lens, inputs.lengths, h, d)}
    calls, outs = {}, {}
    lse = torch.empty(q.shape[0], h, device=DEVICE, dtype=torch.float32)
    outs["ours"] = torch.empty_like(q)
    calls["ours"] = ours.paged(torch, q, inputs.paged[unit], outs["ours"], lse, qo, hkv, scale, False)
    if fi is not None:
        for page in sorted(inputs.paged):
            p = inputs.paged[page]
            for backend in args.prefill_backends:
                name = f"flashinfer_p{page}_{backend}"
                try:
                    w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend=backend)
                    w.plan(qo, p["indptr"], p["values"], p["last"], h, hkv, d, page, causal=False,
                           q_data_type=inputs.dtype, kv_data_type=inputs.dtype, sm_scale=scale)
                    o = torch.empty_like(q)
                    outs[name] = o
                    calls[name] = (lambda w=w, o=o, pages=p["pages"]: w.run(q, pages, out=o))
                except Exception as e:  # noqa: BLE001
                    rec.setdefault("errors", {})[name] = _error_text(e)
    _time_and_check(torch, rec, calls, outs, ref, inputs, max(2, args.iters // 4), ref_rows=rows)
    for name, us in rec["us"].items():
        rec.setdefault("tflops", {})[name] = rec["flops"] / us / 1e6
    return rec


def _case_ragged(torch, fi, ours, inputs, h, hkv, d, g, scale, unit, workspace, args):
    """Causal self-attention of whole sequences (TVM's ragged prefill entry): q, k, v ragged."""
    q_lens = list(inputs.lengths)
    q = _prefill_q(torch, inputs, q_lens, h, d, seed=13)
    ind = torch.tensor(inputs.kv_indptr, device=DEVICE, dtype=torch.int32)
    rows, spec = _sample_rows(torch, q_lens, q_lens)
    ref = _ref_prefill(torch, q, inputs, spec, q_lens, True, scale, g)
    rec = {"us": {}, "kernels": {}, "max_err": {}, "ok": {}, "flops": causal_flops(q_lens, q_lens, h, d)}
    calls, outs = {}, {}
    lse = torch.empty(q.shape[0], h, device=DEVICE, dtype=torch.float32)
    outs["ours"] = torch.empty_like(q)
    calls["ours"] = ours.ragged(torch, q, inputs.k, inputs.v, outs["ours"], lse, ind, ind, hkv, scale, True)
    label = ours.fa4_label(str(inputs.dtype).removeprefix("torch."), h, hkv, d, True)
    lse4 = None
    if label is not None:  # the hopper provider's ragged entry
        lse4 = torch.empty_like(lse)
        outs["ours_fa4"] = torch.empty_like(q)
        calls["ours_fa4"] = ours.ragged_fa4(torch, label, q, inputs.k, inputs.v, outs["ours_fa4"], lse4, ind, ind, hkv,
                                            scale)
    if fi is not None:
        for backend in args.prefill_backends:
            name = f"flashinfer_{backend}"
            try:
                w = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
                w.plan(ind, ind, h, hkv, d, causal=True, q_data_type=inputs.dtype, kv_data_type=inputs.dtype,
                       sm_scale=scale)
                o = torch.empty_like(q)
                outs[name] = o
                calls[name] = (lambda w=w, o=o: w.run(q, inputs.k, inputs.v, out=o))
            except Exception as e:  # noqa: BLE001
                rec.setdefault("errors", {})[name] = _error_text(e)
    _time_and_check(torch, rec, calls, outs, ref, inputs, max(2, args.iters // 4), ref_rows=rows)
    if lse4 is not None and "ours_fa4" in rec["us"]:
        # both entries give TVM's base-2 LSE of every row (the cache merges by it): they must agree
        rec["lse_max_diff_fa4"] = float((lse4 - lse).abs().max())
        rec["ok"]["ours_fa4"] = rec["ok"]["ours_fa4"] and rec["lse_max_diff_fa4"] <= LSE_TOLERANCE
    for name, us in rec["us"].items():
        rec.setdefault("tflops", {})[name] = rec["flops"] / us / 1e6
    return rec


# ---------------------------------------------------------------------------------------------------------
# report: the markdown tables (and a plot) of a ``kernels`` run

def _best(us: dict, prefix: str, ok: dict | None = None):
    """The fastest variant named ``prefix...`` whose output passed the fp32 check."""
    cands = {k: v for k, v in us.items() if k.startswith(prefix) and (ok or {}).get(k, True)}
    return min(cands.items(), key=lambda kv: kv[1]) if cands else (None, None)


def goals(results: dict) -> dict:
    """The comparison's goals, from a ``kernels`` run: decode at every batch no slower than FlashInfer's
    fastest variant and within 1.25x of the K/V bytes time at 16k; ragged prefill at least FlashInfer's
    TFLOP/s (its fastest backend, and its FA2 backend, the one TVM's FlashInfer prefill is built on)."""
    dec = [c for c in results["cases"] if c["kind"] == "decode"]
    rag = [c for c in results["cases"] if c["kind"] == "ragged_prefill"]
    out = {"decode_cases": len(dec), "decode_not_slower": 0, "decode_at_16k": 0, "decode_16k_within_1_25x": 0,
           "ragged_cases": 0, "ragged_at_least_best": 0, "ragged_at_least_fa2": 0, "ragged_fa4_cases": 0,
           "ragged_fa4_at_least_best": 0, "ragged_fa4_worst_vs_flashinfer": None, "all_outputs_ok": True,
           "ours_outputs_ok": True, "wrong": [], "decode_worst_vs_flashinfer": None, "decode_16k_worst_vs_bytes": None,
           "decode_16k_worst_vs_bytes_by_shape": {}}
    for c in results["cases"]:
        out["all_outputs_ok"] &= all(c["ok"].values())
        out["ours_outputs_ok"] &= all(v for k, v in c["ok"].items() if k.startswith("ours"))
        out["wrong"] += [f"{c['kind']} {c['shape']} {c['dtype']} b{c['batch']}: {k}" for k, v in c["ok"].items() if not v]
    worst, worst_bytes = 0.0, 0.0
    for c in dec:
        _, fi = _best(c["us"], "flashinfer", c["ok"])
        if fi is not None:
            r = c["us"]["ours"] / fi
            worst = max(worst, r)
            out["decode_not_slower"] += r <= 1.0
        if all(n == MAX_LEN for n in c["lengths"]):  # batch 1 (one 16k sequence) and uniform16k
            rb = c["us"]["ours"] / c["bytes_us"]
            worst_bytes = max(worst_bytes, rb)
            by = out["decode_16k_worst_vs_bytes_by_shape"]
            by[c["shape"]] = max(by.get(c["shape"], 0.0), rb)
            out["decode_at_16k"] += 1
            out["decode_16k_within_1_25x"] += rb <= 1.25
    out["decode_worst_vs_flashinfer"] = worst or None
    out["decode_16k_worst_vs_bytes"] = worst_bytes or None
    for c in rag:  # only cases with a FlashInfer output that passed the check count
        t = {k: v for k, v in c["tflops"].items() if c["ok"].get(k, True)}
        best = max((v for k, v in t.items() if k.startswith("flashinfer")), default=None)
        if best is None:
            continue
        out["ragged_cases"] += 1
        out["ragged_at_least_best"] += t["ours"] >= best
        if "flashinfer_fa2" in t:
            out["ragged_at_least_fa2"] += t["ours"] >= t["flashinfer_fa2"]
        if "ours_fa4" in t:  # the hopper provider's ragged entry
            out["ragged_fa4_cases"] += 1
            out["ragged_fa4_at_least_best"] += t["ours_fa4"] >= best
            r = t["ours_fa4"] / best
            w = out["ragged_fa4_worst_vs_flashinfer"]
            out["ragged_fa4_worst_vs_flashinfer"] = r if w is None else min(w, r)
    return out


def _n(x, digits=1):
    return "–" if x is None else f"{x:,.{digits}f}"


def report(results: dict, meta: dict) -> str:
    """Markdown of a ``kernels`` run (``meta``: commit, date, command)."""
    lines = [f"# Paged attention: ours vs FlashInfer {results.get('flashinfer') or '(not run)'}", "",
             f"- GPU: {results['device']}; torch {results['torch']}; commit {meta.get('commit', '?')}; "
             f"date {meta.get('date', '?')}",
             f"- command: `{meta.get('command', '?')}`",
             "- GPU kernel time per call (µs; CUPTI through torch.profiler, every kernel a call launches, "
             f"{results['iters']} calls for decode, a quarter of that for prefill, after a warm-up); "
             f"bytes limit: the K and V bytes read once at {results.get('hbm_bytes_per_s', 4.8e12) / 1e12:g} TB/s.",
             ("- ours: our grouped-query decode kernel alone (`build-native --decode-only`: `native/gqa_decode.cu`, "
              "its own plan, the rule the cache's decode entry plans with), pages of 128 keys for head dim 128, 256 "
              "for 64; `ours p16`: the same decode "
              if (results.get("native_build") or {}).get("decode_only") else
              "- ours: the C API our PagedKVCache wrappers call (`native/fa2_paged.h`; decode: our grouped-query "
              "decode kernel, pages of 128 keys for head dim 128, 256 for 64); `ours p16`: the same decode ") +
             "kernel alone on pages of 16; `ours_fa4`: the hopper provider's ragged prefill (FA4's sm90 var-len "
             "forward through `native/fa4_ragged.cu`, its LSE checked against ours); FlashInfer: `BatchDecodeWithPagedKVCacheWrapper` (backend fa2, CUDA "
             "cores and tensor cores), `BatchPrefillWithPagedKVCacheWrapper` and "
             "`BatchPrefillWithRaggedKVCacheWrapper`, pages of 16 (mlc-llm's) and ours, the same pages in TVM's "
             "layout (`HND`). Variants timed: " + ", ".join(f"`{n}`" for n in sorted(
                 {k for c in results["cases"] for k in c["us"]})) + ".",
             "- every output checked against fp32 (decode: every row; prefill: 8 query rows of every sequence); "
             "✗ marks an output beyond tolerance.", ""]
    g = goals(results)
    goal_lines = []
    if g["decode_cases"]:
        goal_lines += [
            f"- decode no slower than FlashInfer's fastest variant: {g['decode_not_slower']} of "
            f"{g['decode_cases']} cases (worst ours / FlashInfer: {_n(g['decode_worst_vs_flashinfer'], 2)})",
            f"- decode at 16k (every sequence 16k) within 1.25x of the bytes limit: {g['decode_16k_within_1_25x']} of "
            f"{g['decode_at_16k']} (worst per shape: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in sorted(g["decode_16k_worst_vs_bytes_by_shape"].items())) + ")"]
    if g["ragged_cases"]:
        goal_lines.append(
            f"- ragged prefill at least FlashInfer's TFLOP/s: {g['ragged_at_least_best']} of {g['ragged_cases']} "
            f"against its fastest backend, {g['ragged_at_least_fa2']} of {g['ragged_cases']} against its fa2 backend "
            "(cases where a FlashInfer output passed the check)")
    if g["ragged_fa4_cases"]:
        goal_lines.append(
            f"- ragged prefill of the hopper provider (`ours_fa4`) at least FlashInfer's fastest TFLOP/s: "
            f"{g['ragged_fa4_at_least_best']} of {g['ragged_fa4_cases']} (lowest ours_fa4 / FlashInfer: "
            f"{_n(g['ragged_fa4_worst_vs_flashinfer'], 2)})")
    lines += ["## Goals", "", *goal_lines,
              f"- our outputs within tolerance: {'all' if g['ours_outputs_ok'] else 'NOT ALL'}; outputs beyond it "
              f"(not counted above): {'; '.join(g['wrong']) or 'none'}",
              "- a ratio compares only variants whose output passed the fp32 check.", ""]

    def cell(c, name, fmt=_n):
        if name not in c["us"]:
            return "–"
        return fmt(c["us"][name]) + ("" if c["ok"].get(name, True) else " ✗")

    dec = [c for c in results["cases"] if c["kind"] == "decode"]
    if dec:
        lines += ["## Decode (one query row per sequence)", "",
                  "| shape | dtype | lengths | batch | ours | ours p16 | FlashInfer fastest | ours / FlashInfer | "
                  "bytes limit | ours / bytes | FlashInfer / bytes |",
                  "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for c in dec:
            name, fi = _best(c["us"], "flashinfer", c["ok"])
            lines.append(f"| {c['shape']} | {c['dtype']} | {c['lengths_kind']} | {c['batch']} | {cell(c, 'ours')} | "
                         f"{cell(c, 'ours_page16')} | {_n(fi)} ({name.removeprefix('flashinfer_') if name else '–'}) | "
                         f"{_n(c['us']['ours'] / fi if fi else None, 2)} | {_n(c['bytes_us'])} | "
                         f"{_n(c['us']['ours'] / c['bytes_us'], 2)} | {_n(fi / c['bytes_us'] if fi else None, 2)} |")
        lines.append("")
    for kind, title in (("paged_prefill", "Paged prefill (a chunk of new tokens over the cached keys, not causal)"),
                        ("ragged_prefill", "Ragged prefill (causal self-attention of whole sequences)")):
        cases = [c for c in results["cases"] if c["kind"] == kind]
        if not cases:
            continue
        names = sorted({k for c in cases for k in c["us"]}, key=lambda k: (k != "ours", k))
        fa4 = "ours_fa4" in names
        lines += [f"## {title}", "", "TFLOP/s (µs per call in brackets).", "",
                  "| shape | dtype | batch | " + " | ".join(names) + " | ours / FlashInfer fastest |"
                  + (" ours_fa4 / FlashInfer fastest |" if fa4 else ""),
                  "|---|---|---:|" + "---:|" * (len(names) + 1 + fa4)]
        for c in cases:
            cells = []
            for k in names:
                cells.append(f"{_n(c['tflops'][k])} ({_n(c['us'][k], 0)})" + ("" if c["ok"].get(k, True) else " ✗")
                             if k in c["tflops"] else "–")
            best = max((v for k, v in c["tflops"].items() if k.startswith("flashinfer") and c["ok"].get(k, True)),
                       default=None)
            lines.append(f"| {c['shape']} | {c['dtype']} | {c['batch']} | " + " | ".join(cells)
                         + f" | {_n(c['tflops']['ours'] / best if best else None, 2)} |"
                         + (f" {_n(c['tflops']['ours_fa4'] / best if best and 'ours_fa4' in c['tflops'] else None, 2)} |"
                            if fa4 else ""))
        lines.append("")
    errors = [(c["kind"], c["shape"], c["dtype"], c["batch"], n, e) for c in results["cases"]
              for n, e in c.get("errors", {}).items()]
    if errors:
        lines += ["## Variants that did not run", ""]
        lines += [f"- {k} {s} {d} b{b} {n}: {e}" for k, s, d, b, n, e in errors]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Decode: ours and FlashInfer's fastest over the bytes limit, per batch (one panel per shape)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dec = [c for c in results["cases"] if c["kind"] == "decode" and c["lengths_kind"] == "mixed"]
    shapes = sorted({c["shape"] for c in dec})
    if not shapes:
        return False
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for dtype, style in (("float16", "-"), ("bfloat16", "--")):
            cs = sorted((c for c in dec if c["shape"] == shape and c["dtype"] == dtype), key=lambda c: c["batch"])
            if not cs:
                continue
            xs = [c["batch"] for c in cs]
            ax.plot(xs, [c["us"]["ours"] / c["bytes_us"] for c in cs], "o" + style, color="C0", label=f"ours {dtype}")
            ax.plot(xs, [_best(c["us"], "flashinfer", c["ok"])[1] / c["bytes_us"]
                         if _best(c["us"], "flashinfer", c["ok"])[1] else None for c in cs], "s" + style, color="C1", label=f"FlashInfer fastest {dtype}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"decode {shape}, mixed 1k-16k")
        ax.set_xlabel("batch")
        ax.set_ylabel("kernel time / bytes limit")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------------------------------------------------

COMMANDS = ("build-native", "kernels", "report")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        return main_decoders(argv)
    ap = argparse.ArgumentParser(prog="paged_attention.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-native", help="link our paged-attention library for the kernels comparison (no GPU)")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--decode-only", action="store_true",
                   help="our decode kernel alone (no FA2 objects): for kernels --kinds decode")
    b.add_argument("--fa4", action="store_true",
                   help="also link the hopper provider's ragged prefill (FA4 var-len objects; needs flash-attn-4)")
    k = sub.add_parser("kernels", help="our paged attention kernels vs FlashInfer's, on the same pages (GPU)")
    k.add_argument("--native", type=Path, required=True, help="the folder build-native wrote")
    k.add_argument("--out", type=Path, required=True, help="results JSON (cases already in it are kept, not rerun)")
    k.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    k.add_argument("--dtypes", nargs="*", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    k.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    k.add_argument("--lengths", nargs="*", default=["mixed", "uniform16k"], choices=["mixed", "uniform16k"],
                   help="mixed: 16k, 1k and random lengths between (batch 1: 16k); uniform16k: every sequence 16k")
    k.add_argument("--kinds", nargs="*", default=["decode", "paged_prefill", "ragged_prefill"],
                   choices=["decode", "paged_prefill", "ragged_prefill"])
    k.add_argument("--chunk", type=int, default=256, help="new tokens per sequence of the paged prefill")
    k.add_argument("--max-prefill-batch", type=int, default=64, help="ragged prefill only up to this batch")
    k.add_argument("--prefill-backends", nargs="*", default=["fa2", "fa3"])
    k.add_argument("--iters", type=int, default=20)
    k.add_argument("--no-flashinfer", action="store_true", help="time our kernels alone")
    k.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new case after this many seconds (the results so far are written)")
    r = sub.add_parser("report", help="markdown (and PNG) of a kernels run, with commit, date and command")
    r.add_argument("results", type=Path)
    r.add_argument("--out", type=Path, required=True, help="the markdown file (the PNG beside it)")
    r.add_argument("--commit", required=True)
    r.add_argument("--date", required=True)
    r.add_argument("--command", dest="run_command", required=True)
    args = ap.parse_args(argv)
    if args.command == "build-native":
        print(json.dumps(build_native(args.out, args.arch, fa4=args.fa4, decode_only=args.decode_only), indent=1))
    elif args.command == "kernels":
        bench_kernels(args)
        print(f"wrote {args.out}")
    else:
        results = json.loads(args.results.read_text())
        results["meta"] = {"commit": args.commit, "date": args.date, "command": args.run_command}
        args.results.write_text(json.dumps(results, indent=1) + "\n")
        png = args.out.with_suffix(".png")
        text = report(results, results["meta"])
        if plot(results, png):
            text += f"\n![decode / bytes limit]({png.name})\n"
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
