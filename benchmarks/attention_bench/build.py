"""``build``: the benchmark libraries, on the build machine (full TVM; no GPU), each through
``mqa_byoc.build`` and ``mqa_byoc.export_library``."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from mqa_byoc.testing.fatbin_cache import precompile_cuda
from .paged_kv import check_llm_cpu, decode_head_coverage, llm_gpu_kernels
from .suites import (DT_SHORT, GROUPED_SUITES, PAGE_SIZE, STOCK_MAX_WORK, SUITES, case_variants, expand_suite,
                     function_name, llm_kernel_name)

def _module(case):
    from mqa_byoc.models.llama import build_attention_block

    return build_attention_block(
        case["h"], case["hkv"], case["d"], kv_expand="repeat", dtype=case["dtype"], mode="extend",
        batch=1, seq_len=case["s_q"], kv_len=case["s_kv"],
        causal_mask="BottomRight" if case["causal"] else None,
    )

def _symbolic_block(sh, dtype, mode, name):
    """q/k/v -> attention with K/V repeated to H heads (the graph a compile script hands us), symbolic
    lengths: prefill ``S_q = S_kv = seq_len`` causal, decode ``S_q = 1``, ``S_kv = kv_len``."""
    from mqa_byoc.models.llama import build_attention_block

    return build_attention_block(
        sh["h"], sh["hkv"], sh["d"], kv_expand="repeat", dtype=dtype, mode=mode, batch=1,
        causal_mask="BottomRight" if mode == "prefill" else None, func_name=name,
    )

def _codegen_functions(mod):
    from tvm import relax

    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and f.attrs is not None and f.attrs.get("Codegen") == "flash_attn"}

def _composite_of(func):
    from tvm import relax

    found = []

    def visit(e):
        if isinstance(e, relax.Function) and e.attrs is not None and "Composite" in e.attrs:
            found.append(str(e.attrs["Composite"]))

    relax.analysis.post_order_visit(func.body, visit)
    return found

def build_group_module(shapes, dtype, providers):
    """One IRModule holding, for every shape, ``{prefill, decode} x {mqa-<p>, repeat-<p> for p in
    providers} + stock-tvm``, partitioned, plus a summary of what was offloaded (checked)."""
    import tvm
    import tvm_ffi
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention

    funcs, attrs = {}, None
    provider_of, summary, snapshot = {}, {}, {}

    shape_of = {}

    def add(variant):
        nonlocal attrs
        names = []
        for sh in shapes:
            for mode in ("prefill", "decode"):
                name = function_name(sh["shape"], mode, variant)
                blk = _symbolic_block(sh, dtype, mode, name)
                attrs = attrs if attrs is not None else blk.attrs
                funcs.update(dict(blk.functions_items()))
                names.append(name)
                shape_of[name] = sh
        return names

    mod = None
    for provider in providers:
        for kind, mqa in (("mqa", True), ("repeat", False)):
            variant = f"{kind}-{provider}"
            names = add(variant)
            mod = tvm.IRModule(funcs, attrs=attrs)
            sites = {s.function: s for s in mqa_byoc.offload_report(mod, mqa=mqa) if s.function in names}
            before = set(_codegen_functions(mod))
            # functions partitioned by an earlier variant hold no attention any more: untouched
            mod = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
            for n, f in _codegen_functions(mod).items():
                if n not in before:
                    provider_of[n] = provider
                    snapshot[n] = f
            funcs = dict(mod.functions_items())
            for n in names:
                s = sites.get(n)
                summary[n] = dict(variant=variant, offloaded=bool(s and s.offloaded),
                                  composite=s.composite if s else None, reason=s.reason if s else "no site",
                                  expansion_ops_removed=s.expansion_ops_removed if s else 0)
    # each partition run names its C symbols from scratch: make them unique, restore each provider
    for gv, f in list(mod.functions_items()):
        if gv.name_hint in provider_of:
            mod[gv] = f.with_attr("mqa_byoc.provider", provider_of[gv.name_hint]).with_attr(
                "global_symbol", gv.name_hint)
    # a later partition run must leave the flash_attn functions of earlier ones as they were
    changed = [n for n, f in _codegen_functions(mod).items()
               if not tvm_ffi.structural_equal(f.without_attr("global_symbol").without_attr("mqa_byoc.provider"),
                                              snapshot[n].without_attr("global_symbol").without_attr("mqa_byoc.provider"))]
    if changed:
        raise RuntimeError(f"flash_attn functions changed by a later partition run: {changed}")
    funcs = dict(mod.functions_items())
    # check: every mqa/repeat function calls exactly one flash_attn function of the right composite,
    # and only the repeat path keeps the K/V expansion
    cg = _codegen_functions(mod)
    for name, info in summary.items():
        f = mod[name]
        called = [gv.name_hint for gv in relax.analysis.all_global_vars(f) if gv.name_hint in cg]
        comps = [c for n in called for c in _composite_of(cg[n])]
        info["codegen_functions"] = called
        info["composites"] = comps
        info["keeps_repeat"] = "R.repeat" in f.script()
        want = "flash_attn.attention" if info["variant"].startswith("repeat") else None
        ok = len(called) == 1 and len(comps) == 1 and info["keeps_repeat"] == (want is not None)
        if want:
            ok = ok and comps[0] == want
        else:
            sh = shape_of[name]
            ok = ok and comps[0] == ("flash_attn.attention_mqa" if sh["hkv"] < sh["h"] else "flash_attn.attention")
        info["check"] = "ok" if ok else "UNEXPECTED"
        if not ok:
            raise RuntimeError(f"{name}: unexpected partition result {info}")
    stock = add("stock-tvm")
    for n in stock:
        summary[n] = dict(variant="stock-tvm", offloaded=False)
    mod = LegalizeGroupedAttention()(tvm.IRModule(funcs, attrs=attrs))
    return mod, summary

def build_grouped(args):
    import tvm

    import mqa_byoc

    providers = (args.providers or "native").split(",")
    shapes_filter = args.shapes.split(",") if args.shapes else None
    cases = expand_suite(args.suite, shapes=shapes_filter)
    os.makedirs(args.out, exist_ok=True)
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    shapes = {c["shape"]: dict(shape=c["shape"], h=c["h"], hkv=c["hkv"], d=c["d"], presets=c["presets"]) for c in cases}
    meta = {"format": 2, "suite": args.suite, "arch": args.arch, "providers": providers, "page_size": PAGE_SIZE,
            "build_command": " ".join(["python"] + sys.argv),
            "build_date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "tvm": getattr(tvm, "__version__", None), "groups": {}, "cases": [],
            "kernel_options": getattr(args, "kernel_options", None)}
    t_all = time.time()
    if not args.skip_llm:
        print("checking TVM's paged-KV kernels' calling convention on the CPU (llvm) ...", flush=True)
        meta["llm_cpu_check"] = check_llm_cpu()
        if not all(r["ok"] for r in meta["llm_cpu_check"]):
            raise RuntimeError("TVM paged-KV CPU check failed: the argument builder does not match the kernels")
    for dtype in sorted({c["group"] for c in cases}, key=["float16", "bfloat16"].index):
        group_shapes = [shapes[s] for s in dict.fromkeys(c["shape"] for c in cases if c["group"] == dtype)]
        g = {"dtype": dtype, "shapes": group_shapes}
        t0 = time.time()
        mod, summary = build_group_module(group_shapes, dtype, providers)
        g["functions"] = summary
        g["partition_s"] = round(time.time() - t0, 1)
        print(f"[{dtype}] partitioned {len(summary)} functions in {g['partition_s']} s "
              f"({sum(1 for s in summary.values() if s['offloaded'])} offloaded)", flush=True)
        t0 = time.time()
        # each function carries its provider
        ex = mqa_byoc.build(mod, target, mqa=None, kernel_options=getattr(args, "kernel_options", None))
        g["relax_build_s"] = round(time.time() - t0, 1)
        lib = f"attn-{DT_SHORT[dtype]}.so"
        t0 = time.time()
        mqa_byoc.export_library(ex, os.path.join(args.out, lib), arch=args.arch)
        g["export_s"] = round(time.time() - t0, 1)
        g["lib"] = lib
        print(f"[{dtype}] relax.build {g['relax_build_s']} s, export {g['export_s']} s -> {lib} "
              f"({os.path.getsize(os.path.join(args.out, lib)) / 1e6:.1f} MB)", flush=True)
        if not args.no_precompile:
            g["cuda_cache"] = precompile_cuda(ex, os.path.join(args.out, "cuda-cache"), args.arch)
        llm_lib = None
        if not args.skip_llm:
            t0 = time.time()
            prims, coverage = {}, {}
            for sh in group_shapes:
                for kernel, f in llm_gpu_kernels(sh["h"], sh["hkv"], sh["d"], dtype, target).items():
                    name = llm_kernel_name(sh["shape"], kernel)
                    prims[name] = f.with_attr("global_symbol", name)
                    if kernel == "batch_decode_paged_kv":
                        cov = decode_head_coverage(f, sh["h"], sh["hkv"])
                        coverage[sh["shape"]] = cov
                        if cov is not None and cov < sh["h"] // sh["hkv"]:
                            print(f"  WARNING {sh['shape']}: TVM's decode kernel writes {cov} of "
                                  f"{sh['h'] // sh['hkv']} query heads per K/V head", flush=True)
            llm_ex = tvm.compile(tvm.IRModule(prims), target=target)
            llm_lib = f"tvm-llm-{DT_SHORT[dtype]}.so"
            llm_ex.export_library(os.path.join(args.out, llm_lib))
            g["llm_lib"] = llm_lib
            g["llm_build_s"] = round(time.time() - t0, 1)
            g["llm_decode_heads_written_per_kv_head"] = coverage
            print(f"[{dtype}] TVM paged-KV kernels {g['llm_build_s']} s -> {llm_lib}", flush=True)
            if not args.no_precompile:
                g["cuda_cache"] = g.get("cuda_cache", []) + precompile_cuda(
                    llm_ex, os.path.join(args.out, "cuda-cache"), args.arch)
        meta["groups"][dtype] = g
        for c in cases:
            if c["group"] == dtype:
                meta["cases"].append({**c, "variants": case_variants(c, providers, lib, llm_lib)})
    meta["build_s"] = round(time.time() - t_all, 1)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(meta, f, indent=1)
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(args.out) for fn in fns)
    print(f"{len(meta['cases'])} cases; artifacts {total / 2**20:.1f} MiB in {args.out}")

def build(args):
    if args.suite in GROUPED_SUITES:
        return build_grouped(args)
    import tvm

    import mqa_byoc
    from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention

    os.makedirs(args.out, exist_ok=True)
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    cases = []
    for case in SUITES[args.suite]:
        mod = _module(case)
        variants = {}
        for provider in (args.providers or "python").split(","):
            for mqa in (True, False):
                name = f"{'mqa' if mqa else 'repeat'}-{provider}"
                ex = mqa_byoc.build(mod, target, mqa=mqa, provider=provider)
                path = os.path.join(args.out, f"{case['name']}.{name}.so")
                mqa_byoc.export_library(ex, path, arch=args.arch)
                variants[name] = os.path.basename(path)
                print(f"built {path}", flush=True)
        if case["s_q"] * case["s_kv"] <= STOCK_MAX_WORK:
            ex = tvm.compile(LegalizeGroupedAttention()(mod), target=target)  # TVM's own lowering
            path = os.path.join(args.out, f"{case['name']}.stock-tvm.so")
            ex.export_library(path)
            variants["stock-tvm"] = os.path.basename(path)
        cases.append({**case, "variants": variants})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"arch": args.arch, "suite": args.suite, "cases": cases}, f, indent=1)
