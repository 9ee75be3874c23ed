"""``run``: measure every case's variants on the GPU machine (runtime-only TVM, torch; no tvm.relax,
no matplotlib). Each variant is checked against FA2 called directly in the same run and timed with
CUDA events over back-to-back calls sized to a time budget; a failing variant is recorded and the
run goes on; the JSON is rewritten after every case."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import time
import traceback
from contextlib import ExitStack, nullcontext

from mqa_byoc.testing.fatbin_cache import serve_fatbins
from mqa_byoc.testing.header import run_header
from mqa_byoc.testing.setup import import_setup
from mqa_byoc.testing.gpu_clock import ClockSampler
from mqa_byoc.testing.timing import cuda_time_us, time_call_us

from .paged_kv import llm_kernel_args
from .suites import HBM_PEAK_TB_S, PAGE_SIZE, REL_TOL

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

class Libraries:
    """Libraries of the artifacts folder, loaded once (load times and failures recorded), and their VMs."""

    def __init__(self, folder, dev, record):
        self.folder, self.dev, self.record = folder, dev, record
        self.libs, self.vms = {}, {}

    def library(self, name):
        import tvm

        if name not in self.libs:
            t0 = time.time()
            try:
                self.libs[name] = tvm.runtime.load_module(os.path.join(self.folder, name))
                self.record[name] = {"load_s": round(time.time() - t0, 2)}
            except Exception as ex:  # noqa: BLE001
                self.libs[name] = ex
                self.record[name] = {"error": _short_error(ex)}
            print(f"loaded {name} in {time.time() - t0:.1f} s", flush=True)
        if isinstance(self.libs[name], Exception):
            raise RuntimeError(f"library {name} failed to load: {self.record[name]['error']}")
        return self.libs[name]

    def vm_function(self, lib, func):
        import tvm.runtime.vm  # noqa: F401 - not loaded by tvm.runtime itself

        if lib not in self.vms:
            self.vms[lib] = tvm.runtime.vm.VirtualMachine(self.library(lib), self.dev)
        return self.vms[lib][func]


def reference_fp32(q, k, v, causal, scale, rows=256):
    """fp32 attention of BSNH ``q`` (1, S_q, H, D) over ``k``/``v`` (1, S_kv, H_kv, D), query head h on
    K/V head h // (H / H_kv), causal bottom-right; computed ``rows`` query rows at a time."""
    import torch

    s_q, h, s_kv, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    kf = k[0].float().repeat_interleave(h // hkv, dim=1).transpose(0, 1)  # (H, S_kv, D)
    vf = v[0].float().repeat_interleave(h // hkv, dim=1).transpose(0, 1)
    out = torch.empty(s_q, h, v.shape[-1], device=q.device, dtype=torch.float32)
    cols = torch.arange(s_kv, device=q.device)
    for i in range(0, s_q, rows):
        qc = q[0, i:i + rows].float().transpose(0, 1)  # (H, r, D)
        sc = torch.matmul(qc, kf.transpose(1, 2)) * scale
        if causal:
            last = torch.arange(i, i + qc.shape[1], device=q.device) + (s_kv - s_q)
            sc.masked_fill_(cols[None, None, :] > last[None, :, None], float("-inf"))
        out[i:i + rows] = torch.matmul(torch.softmax(sc, dim=-1), vf).transpose(0, 1)
        del sc
    return out.reshape(1, s_q, h, -1)


def kernel_time_us(call, calls=3):
    """GPU kernel time of one call (CUPTI: every kernel and copy it launches, summed), over ``calls``."""
    from mqa_byoc.testing.cupti import capture_kernels

    call()
    with capture_kernels() as cap:
        for _ in range(calls):
            call()
    return sum(t for _, t in cap.events) / calls, sorted({n for n, _ in cap.events})


#: calls at least this long (µs, a second call's time) are timed with the SM clock sampled: long
#: tensor-core loops meet the power limit; a sampling thread would perturb the launch-bound loops of
#: short calls (decode: tens of µs a call, mostly the host's)
CLOCK_SAMPLE_MIN_US = 300.0


def measure(call, args, ref=None, dtype=None, warmup=3, extra=None, ref32=None):
    """One variant: the first call (checked against ``ref`` and the fp32 ``ref32``), then back-to-back
    calls for about ``args.budget_ms`` (and, with ``args.kernel_time``, its CUPTI kernel time).
    Returns its record entry (``error`` instead of a time when it fails)."""
    entry = dict(extra or {})
    budget_us, max_call_us = args.budget_ms * 1e3, args.max_call_s * 1e6
    try:
        o, first_us = time_call_us(call)
        if ref is not None:
            entry.update(compare_outputs(o, ref, dtype))
        if ref32 is not None:
            c = compare_outputs(o, ref32, dtype)
            entry.update(max_abs_err_vs_fp32=c["max_abs_err_vs_fa2"], rel_err_vs_fp32=c["rel_err_vs_fa2"],
                         numerics_ok_vs_fp32=c["numerics_ok"])
        del o
        est_us = first_us
        if CLOCK_SAMPLE_MIN_US < first_us <= max_call_us:
            # the first call may carry one-time costs (workspace allocation, module init): plan, and decide
            # on sampling the clock, from a second one
            est_us = min(first_us, time_call_us(call)[1])
        n, w = plan_iterations(est_us, budget_us, args.iters, warmup, max_call_us)
        if n == 0:
            us = first_us
            entry["note"] = "one cold call (slower than --max-call-s)"
        elif est_us >= CLOCK_SAMPLE_MIN_US:
            # long tensor-core calls can reach the power limit, which lowers the SM clock: record it, and
            # with --idle-s start every such loop from an idle GPU (not from the previous variant's heat)
            time.sleep(getattr(args, "idle_s", 0.0))
            with ClockSampler(period_s=0.005) as clock:
                us = cuda_time_us(call, n, warmup=w)
            entry.update(clock.summary())
        else:
            us = cuda_time_us(call, n, warmup=w)
        entry.update(us=us, iters=n, first_call_us=round(first_us, 2))
        if getattr(args, "kernel_time", False) and first_us <= max_call_us:
            sampler = None
            if est_us >= CLOCK_SAMPLE_MIN_US:
                time.sleep(getattr(args, "idle_s", 0.0))
                sampler = ClockSampler(period_s=0.001)
            with sampler or nullcontext():
                k_us, names = kernel_time_us(call)
            entry.update(kernel_us=round(k_us, 2), kernels=names[:8])
            clock = sampler.summary() if sampler else {}
            if clock:
                entry["kernel_sm_clock_mhz"] = clock["sm_clock_mhz"]
    except Exception as ex:  # noqa: BLE001
        entry["error"] = _short_error(ex)
        if args.verbose:
            traceback.print_exc()
    return entry


def run_case(case, meta, libs, args, skipped):
    """variant -> record entry, for one case: FA2 direct (the reference), SDPA, cuBLAS QK^T (prefill),
    the Relax VM variants, TVM's paged-KV kernels (last: a CUDA fault there poisons the context)."""
    import torch
    import tvm

    dt = getattr(torch, case["dtype"])
    s_q, s_kv, h, hkv, d = case["s_q"], case["s_kv"], case["h"], case["hkv"], case["d"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, s_q, h, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(1, s_kv, hkv, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(1, s_kv, hkv, d, device="cuda", dtype=dt, generator=g)
    scale = 1.0 / math.sqrt(d)
    results, ref = {}, None

    ref32 = reference_fp32(q, k, v, case["causal"], scale) if getattr(args, "fp32_reference", False) else None

    def run_variant(variant, call, check=True, warmup=3, extra=None):
        if not skipped(variant):
            results[variant] = measure(call, args, ref if check else None, case["dtype"], warmup, extra,
                                       ref32=ref32 if variant != "cublas-qk-gemm" else None)

    def fa2_direct():
        return torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, s_q, s_kv, 0.0, case["causal"], False, scale=scale)[0]

    run_variant("fa2-direct", fa2_direct, check=False)
    if "error" not in results.get("fa2-direct", {"error": 1}):
        ref = fa2_direct().float()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    run_variant("torch-sdpa-gqa", lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=case["causal"] and s_q > 1, scale=scale, enable_gqa=True).transpose(1, 2))
    if case["mode"] == "prefill" and not skipped("cublas-qk-gemm"):
        # a tensor-core GEMM of the Q@K^T shape, the ceiling prefill is compared with
        try:
            a = torch.randn(h, s_q, d, device="cuda", dtype=dt)
            b = torch.randn(h, d, s_kv, device="cuda", dtype=dt)
            c = torch.empty(h, s_q, s_kv, device="cuda", dtype=dt)
            run_variant("cublas-qk-gemm", lambda: torch.bmm(a, b, out=c), check=False)
            del a, b, c
            if s_q * s_kv >= 4096 * 4096:
                torch.cuda.empty_cache()  # the 16k GEMM output is tens of GB
        except Exception as ex:  # noqa: BLE001
            results["cublas-qk-gemm"] = {"error": _short_error(ex)}
    args_tvm = [tvm.runtime.from_dlpack(x) for x in (q, k, v)]
    relax_variants = [(n, vv) for n, vv in case["variants"].items() if vv.get("kind") == "relax"]
    relax_variants.sort(key=lambda nv: nv[0] == "stock-tvm")  # the slowest VM variant last
    for variant, vv in relax_variants:
        try:
            f = libs.vm_function(vv["lib"], vv["func"])
        except Exception as ex:  # noqa: BLE001
            results[variant] = {"error": _short_error(ex)}
            continue
        run_variant(variant, lambda f=f: f(*args_tvm), warmup=1 if variant == "stock-tvm" else 3)
    for variant, vv in case["variants"].items():
        if vv.get("kind") != "tvm-llm" or skipped(variant):
            continue
        try:
            f = libs.library(vv["lib"])[vv["func"]]
            args_llm, oi = llm_kernel_args(vv["kernel"], q.reshape(s_q, h, d), k.reshape(s_kv, hkv, d),
                                           v.reshape(s_kv, hkv, d), case["causal"], scale,
                                           meta.get("page_size", PAGE_SIZE))
            llm_out = args_llm[oi]
            targs = [tvm.runtime.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args_llm]
        except Exception as ex:  # noqa: BLE001
            results[variant] = {"error": _short_error(ex), "kernel": vv.get("kernel")}
            continue

        def call_llm(f=f, targs=targs, llm_out=llm_out):
            f(*targs)
            return llm_out

        run_variant(variant, call_llm, warmup=1,
                    extra={"kernel": vv["kernel"], "page_size": meta.get("page_size", PAGE_SIZE)})
        del args_llm, targs, llm_out
    elt = q.element_size()
    del q, k, v, qt, kt, vt, args_tvm, ref, ref32
    if s_q * s_kv >= 4096 * 4096:
        torch.cuda.empty_cache()
    return results, elt


def case_records(case, meta, results, elt):
    """The JSON records of one case's results: time, ratio to FA2 direct, TFLOP/s or HBM fraction."""
    s_q, s_kv, h, hkv, d = case["s_q"], case["s_kv"], case["h"], case["hkv"], case["d"]
    base = results.get("fa2-direct", {}).get("us")
    gemm = results.get("cublas-qk-gemm")
    kv_bytes = 2 * s_kv * hkv * d * elt
    flops = 4 * s_q * s_kv * h * d * (0.5 if case["causal"] else 1.0)
    common = {
        "benchmark": "attention", "suite": case.get("suite", meta.get("suite")), "case": case["name"],
        "shape": case.get("shape", f"h{h}-kv{hkv}-d{d}"), "presets": case.get("presets"),
        "model": "/".join(case.get("presets") or []) or None, "mode": case["mode"], "dtype": case["dtype"],
        "num_q_heads": h, "num_kv_heads": hkv, "head_dim": d, "seq_q": s_q, "seq_kv": s_kv, "causal": case["causal"],
    }
    if case.get("notes"):
        common["notes"] = case["notes"]
    records = []
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
                    rec["tflops_vs_cublas_qk_gemm"] = round((flops / us) / (2 * h * s_q * s_kv * d / gemm["us"]), 3)
        if variant == "fa2-direct":
            rec["max_abs_err_vs_fa2"] = 0.0
        records.append(rec)
        err, num = entry.get("error"), entry.get("rel_err_vs_fa2")
        if entry.get("kernel_us") is not None:
            rec["kernel_us"] = entry["kernel_us"]
            if case["mode"] == "decode":
                rec["kernel_hbm_limit_ratio"] = round(entry["kernel_us"] / (kv_bytes / (HBM_PEAK_TB_S * 1e12) * 1e6), 3)
            elif variant != "cublas-qk-gemm":
                rec["kernel_tflops"] = round(flops / (entry["kernel_us"] * 1e-6) / 1e12, 1)
        print(f"{case['name']:30s} {variant:16s} "
              + (f"{us:12.1f} us  x{us / base:8.3f} vs FA2" if (us is not None and base) else
                 f"{us:12.1f} us" if us is not None else f"{'FAILED':>12s}")
              + (f"  rel err {num:.1e}" if num is not None else "")
              + (f"  kernel {entry['kernel_us']:.1f} us" if entry.get("kernel_us") is not None else "")
              + (f"  vs fp32 {entry['rel_err_vs_fp32']:.1e}" if entry.get("rel_err_vs_fp32") is not None else "")
              + ("" if entry.get("numerics_ok_vs_fp32", True) else "  NUMERICS-FP32")
              + ("" if entry.get("numerics_ok", True) else "  NUMERICS")
              + (f"  [{err.splitlines()[0][:100]}]" if err else ""), flush=True)
    return records


def run(args):
    import_setup(args.setup)  # a runtime-only TVM's set-up (or run under `python3 -m <kit module>`)
    import torch
    import tvm

    with open(os.path.join(args.artifacts, "cases.json")) as f:
        meta = json.load(f)
    cases = _case_list(meta)
    provider_error = None
    if any("python" in name for c in cases for name in c["variants"]):
        try:
            import mqa_byoc.runtime.providers  # noqa: F401 - registers the python provider's entry point
        except Exception as ex:  # noqa: BLE001
            provider_error = _short_error(ex)
    cache_stats = {"hits": 0, "misses": 0, "miss_compile_s": 0.0}
    t_start = time.time()
    out = {"benchmark": "attention", "suite": meta.get("suite"), **run_header(),
           "hbm_peak_tb_s": HBM_PEAK_TB_S, "rel_tol": REL_TOL, "budget_ms": args.budget_ms,
           "idle_s": getattr(args, "idle_s", 0.0), "max_iters": args.iters,
           "build": _build_summary(meta),
           "flops_convention": "4*S_q*S_kv*H*D, halved for causal; GEMM: 2*H*S_q*S_kv*D",
           "hbm_bytes_convention": "K and V bytes: 2*S_kv*H_kv*D*sizeof(dtype)",
           "libraries": {}, "cuda_cache": cache_stats, "records": []}
    if provider_error:
        out["python_provider_error"] = provider_error
    libs = Libraries(args.artifacts, tvm.cuda(0), out["libraries"])

    def write():
        out["elapsed_s"] = round(time.time() - t_start, 1)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

    case_re = re.compile(args.cases) if args.cases else None
    skip = [s for s in (args.skip_variants or "").split(",") if s]

    def skipped(variant):
        return any(fnmatch.fnmatch(variant, p) for p in skip)

    cases = [c for c in cases if not case_re or case_re.search(c["name"])]
    with ExitStack() as stack:
        cache_dir = os.path.join(args.artifacts, "cuda-cache")
        if os.path.isdir(cache_dir):
            try:
                stack.enter_context(serve_fatbins(cache_dir, cache_stats))
            except Exception as ex:  # noqa: BLE001
                print(f"cuda cache not installed: {_short_error(ex)}", flush=True)
        for ci, case in enumerate(cases):
            t_case = time.time()
            results, elt = run_case(case, meta, libs, args, skipped)
            out["records"] += case_records(case, meta, results, elt)
            print(f"  [{ci + 1}/{len(cases)}] {case['name']} took {time.time() - t_case:.1f} s "
                  f"(total {time.time() - t_start:.0f} s)", flush=True)
            write()
    write()
    print(f"wrote {args.json} ({len(out['records'])} records; cuda cache {cache_stats}; {torch.cuda.get_device_name(0)})")
