"""Build the GEMM libraries for tests/gpu/test_gpu_gemm.py and benchmarks/gemm.py.

    python tools/gpu/build_gemm.py [--out .gpu-artifacts/gemm] [--arch sm_90] [--no-bench]

``patterns/``: every GEMM composite (fp16 and bf16, symbolic and static M, a constant weight), each as
one function of one module: ``ours.so`` (``partition_for_cutlass(gemm=True)``, cuBLASLt, exported with
``mqa_byoc.export_library``), random inputs and the unpartitioned module's outputs as TVM computes them
on the CPU (``inputs.npz``: ``<function>.<i>`` and ``<function>.ref``).

``gemv/``: GEMMs of one row (:func:`gemv_cases`), built with ``kernel_options gemm_gemv=always`` and
``launch_overlap=prefetch``: those CUTLASS's GEMV computes run on it (launched as programmatic dependents,
with its L2 prefetch), the rest on cuBLASLt; the same files as ``patterns/``.

``bench/``: the CodeLlama-34B GEMM shapes (nn.Linear: x @ W^T, fp16): ``ours.so`` with symbolic M on
cuBLASLt, ``tvm_sym.so`` the same functions on TVM (decoder pipeline: FuseTransposeMatmul + dlight) and
``tvm_static.so`` one function per (shape, M) on TVM (where dlight's GEMV rule applies to M = 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

#: (name, N, K) of the CodeLlama-34B preset's GEMMs (hidden 8192, intermediate 22016, 64/8 heads x 128,
#: vocabulary 32000)
BENCH_SHAPES = (("qkv", (64 + 2 * 8) * 128, 8192), ("o_proj", 8192, 8192), ("gate_up", 2 * 22016, 8192),
                ("down", 8192, 22016), ("lm_head", 32000, 8192))
BENCH_M = (1, 8, 32, 2048, 16384)


def pattern_cases():
    from mqa_byoc.testing.gemm_graphs import FORMS

    cases = []
    for i, form in enumerate(FORMS):
        cases.append((f"f{i}_fp16_sym", form, dict(dtype="float16", rows=(2, "n"), k=128, n=256)))
    for i, form in enumerate(FORMS[:6]):
        cases.append((f"f{i}_bf16_sym", form, dict(dtype="bfloat16", rows=("n",), k=256, n=256)))
    cases.append(("static_fp16", FORMS[3], dict(dtype="float16", rows=(4, 33), k=128, n=256)))
    cases.append(("const_fp16", FORMS[5], dict(dtype="float16", rows=("n",), k=256, n=512, weight_const=True)))
    # float32 output (R.matmul(..., out_dtype="float32"), ToMixedPrecision's default): C, D and bias in float32
    for i, form in enumerate(FORMS[:6]):
        cases.append((f"f{i}_{'bf16' if i % 2 else 'fp16'}_out_fp32", form,
                      dict(dtype="bfloat16" if i % 2 else "float16", rows=(2, "n"), k=128, n=256, out_dtype="float32")))
    # batched GEMMs (both operands batched over the same axes: one strided-batched call)
    cases.append(("batched_nt_fp16", FORMS[5], dict(batched=True, dtype="float16", batch=(2, "h"), rows=("m",),
                                                    k=128, n=64)))
    cases.append(("batched_bias_residual_bf16", FORMS[6], dict(batched=True, dtype="bfloat16", batch=(3,),
                                                                rows=(1,), k=64, n=128)))
    # astype of the float32 result to the operands' type (ToMixedPrecision's form): cuBLASLt writes that type
    cases.append(("cast_fp16_sym", FORMS[5], dict(dtype="float16", rows=(2, "n"), k=128, n=256, out_dtype="float32",
                                                  cast="float16")))
    cases.append(("cast_bf16_plain", FORMS[11], dict(dtype="bfloat16", rows=("n",), k=256, n=128, out_dtype="float32",
                                                     cast="bfloat16")))
    cases.append(("cast_batched_fp16", FORMS[5], dict(batched=True, dtype="float16", batch=(2, "h"), rows=("m",),
                                                      k=128, n=64, out_dtype="float32", cast="float16")))
    cases.append(("cast_fp16_nt_matmul", FORMS[5], dict(dtype="float16", rows=(2, "n"), k=128, n=256,
                                                        out_dtype="float32", cast="float16",
                                                        lowered="FuseTransposeMatmul")))
    # a weight dequantized in the graph from packed int4 (relax ops; one TIR function, as mlc-llm emits it):
    # TVM's dequantize kernel, then cuBLASLt on the fp16 weight it writes
    for q in ("int4_ops", "int4_call_tir"):
        cases.append((f"dequant_{q}", FORMS[5], dict(dtype="float16", rows=(1,), quantized=q)))
    # the same sites after TVM lowered their matmuls (FuseTransposeMatmul's NT_matmul, LegalizeOps' matmul)
    for i, form in enumerate(FORMS[:6]):
        cases.append((f"f{i}_fp16_nt_matmul", form, dict(dtype="float16", rows=(2, "n"), k=128, n=256,
                                                         lowered="FuseTransposeMatmul")))
    cases.append(("legalized_bf16", FORMS[0], dict(dtype="bfloat16", rows=("n",), k=256, n=256, lowered="LegalizeOps")))
    # torch.export's linear layers: rows flattened for the matmul and the bias, the epilogue after the reshape back
    for i in (0, 1, 2, 10):
        cases.append((f"f{i}_fp16_flattened", FORMS[i], dict(dtype="float16", rows=(2, "n"), k=128, n=256,
                                                            flattened=True)))
    return cases


def merged(cases, dtype=None, lower=True):
    """One module of every case's function; a case with ``lowered`` has been through that TVM pass
    (``lower=False``: the graph before it, as the reference computes it)."""
    import tvm
    from tvm import relax

    from mqa_byoc.testing.gemm_graphs import gemm_graph, quantized_weight_graph

    groups, specs = {}, {}
    for name, form, kw in cases:
        kw = dict(kw)
        how = kw.pop("lowered", None)
        kw.update({"dtype": dtype} if dtype else {})
        if dtype and kw.get("cast"):  # the reference computes in float32 throughout
            kw["cast"] = dtype
        kw.pop("batched", None)  # a case with ``batch`` axes; the manifest keeps the flag
        if "quantized" in kw:
            mod, spec = quantized_weight_graph(kw["quantized"], dtype=kw["dtype"], function=name)
        else:
            mod, spec = gemm_graph(*form, function=name, **kw)
        group = groups.setdefault(how if lower else None, {})
        group[tvm.ir.GlobalVar(name)] = mod[name].with_attr("global_symbol", name)
        group.update((gv, f) for gv, f in mod.functions.items() if gv.name_hint != name)  # its TIR functions
        specs[name] = spec
    functions = {}
    for how, funcs in groups.items():
        mod = tvm.IRModule(funcs)
        functions.update((getattr(relax.transform, how)()(mod) if how else mod).functions)
    return tvm.IRModule(functions), specs


def gemv_cases():
    """GEMMs of one row, as decode runs them: (name, form, kw, whether CUTLASS's GEMV computes it). Built
    with ``kernel_options gemm_gemv=always``, so that each one the GEMV can compute runs on it (the others
    on cuBLASLt): symbolic rows run with one row."""
    from mqa_byoc.testing.gemm_graphs import FORMS

    plain, bias, residual = FORMS[5], FORMS[3], FORMS[4]  # (transposed, bias, activation, residual)
    cases = []
    for dt, tag in (("float16", "fp16"), ("bfloat16", "bf16")):
        cases += [(f"gemv_{tag}_plain_sym", plain, dict(dtype=dt, rows=("n",), k=1024, n=768), True),
                  (f"gemv_{tag}_bias_static", bias, dict(dtype=dt, rows=(1,), k=512, n=256), True),
                  (f"gemv_{tag}_residual_sym", residual, dict(dtype=dt, rows=("n",), k=2048, n=520), True),
                  # what the GEMV does not compute stays on cuBLASLt: bias and residual together, an
                  # activation, a (K, N) weight
                  (f"gemv_{tag}_bias_residual", FORMS[0], dict(dtype=dt, rows=(1,), k=256, n=256), False),
                  (f"gemv_{tag}_gelu", FORMS[1], dict(dtype=dt, rows=(1,), k=256, n=256), False),
                  (f"gemv_{tag}_weight_kn", FORMS[11], dict(dtype=dt, rows=(1,), k=256, n=256), False)]
    # decode's hidden state (1, 1, K); N not a multiple of any configuration's rows per block
    cases.append(("gemv_fp16_rows_1x1", plain, dict(dtype="float16", rows=(1, 1), k=4096, n=1000), True))
    return cases


def build_patterns(out: Path, arch: str, cases=None, kernel_options=None, sizes_of=None):
    """``cases`` (default: :func:`pattern_cases`) into ``out``: ``ours.so`` built with ``kernel_options``,
    ``inputs.npz`` and ``manifest.json``. ``sizes_of(name)``: the symbolic axes' sizes of a case."""
    import ml_dtypes
    import numpy as np
    import tvm
    import tvm.runtime.vm

    import mqa_byoc
    from mqa_byoc.testing.gemm_graphs import draw_inputs
    from mqa_byoc.compiler.graph.gemm import gemm_report

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    runs_gemv = {c[0]: c[3] for c in cases if len(c) == 4} if cases else {}
    cases = [c[:3] for c in cases] if cases else pattern_cases()
    mod, specs = merged(cases)
    report = gemm_report(mod)
    not_offloaded = [s for s in report if not s.offloaded]
    if not_offloaded or len(report) != len(cases):
        raise SystemExit(f"not every pattern case offloaded: {not_offloaded}")
    out.mkdir(parents=True, exist_ok=True)
    ex = mqa_byoc.build(mod, target, mqa=True,  # partition_for_cutlass(gemm=True) + RunCodegen + build
                        kernel_options=kernel_options)
    mqa_byoc.export_library(ex, out / "ours.so")
    # the reference: the unpartitioned graph as TVM builds it for the CPU, in float32 on the inputs rounded
    # to their type (TVM's llvm matmul sums in the operands' type, a bf16 sum is off by a few %; TVM's CUDA
    # default pipeline fails in dlight's Matmul rule on the fused transposed-weight + bias forms)
    ref_mod, _ = merged(cases, dtype="float32", lower=False)
    ref_vm = tvm.runtime.vm.VirtualMachine(tvm.compile(ref_mod, target="llvm"), tvm.cpu())
    manifest = {"functions": {}, "kernel_options": str(kernel_options or "")}
    arrays = {}
    for name, form, kw in cases:
        if sizes_of is not None:
            sizes = sizes_of(name)
        else:
            sizes = {"n": 37, "m": 19, "h": 3} if "sym" in name or "const" in name or "batched" in name else {}
        ins = draw_inputs(specs[name], sizes, seed=len(arrays))
        for j, a in enumerate(ins):
            arrays[f"{name}.{j}"] = a
        rounded = [a.astype(ml_dtypes.bfloat16).astype("float32") if dt == "bfloat16"
                   else a if dt.startswith(("int", "uint")) else a.astype("float32")
                   for a, dt in zip(ins, (s[2] for s in specs[name]))]
        args = [tvm.runtime.tensor(a) for a in rounded]
        arrays[f"{name}.ref"] = np.asarray(ref_vm[name](*args).numpy()).astype("float32")
        manifest["functions"][name] = {"form": list(form), **{k: v for k, v in kw.items() if k != "rows"},
                                       "rows": [str(r) for r in kw["rows"]], "sizes": sizes,
                                       "dtypes": [s[2] for s in specs[name]], "num_inputs": len(ins),
                                       "composite": next(s.composite for s in report if s.function == name),
                                       **({"gemv": runs_gemv[name]} if name in runs_gemv else {})}
    arrays["__meta__"] = np.array(json.dumps(manifest["functions"]))
    np.savez(out / "inputs.npz", **arrays)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"patterns: {len(cases)} functions -> {out}", flush=True)


#: the forms of a bench function: x @ W^T in fp16; ToMixedPrecision's default form (a float32 result cast
#: to fp16 at once: one composite that writes fp16); the same with the float32 result also returned (the
#: cast not fused: a float32-output GEMM, then TVM's cast kernel: what that form ran before the fusion)
BENCH_FORMS = {"": None, "_cast": "fused", "_cast_unfused": "unfused"}


def bench_module(static_m=None, forms=("",)):
    import tvm
    from tvm import relax, tirx

    funcs = {}
    for name, n, k in BENCH_SHAPES:
        for m, form in ((m, f) for m in ([None] if static_m is None else static_m) for f in forms):
            rows = tirx.Var("m", "int64") if m is None else m
            bb = relax.BlockBuilder()
            x = relax.Var("x", relax.TensorType([rows, k], "float16"))
            w = relax.Var("w", relax.TensorType([n, k], "float16"))
            fname = (name if m is None else f"{name}_m{m}") + form
            with bb.function(fname, [x, w]):
                with bb.dataflow():
                    cast = BENCH_FORMS[form]
                    y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32" if cast else None))
                    if cast:
                        c = bb.emit(relax.op.astype(y, "float16"))
                        y = relax.Tuple([c, y]) if cast == "unfused" else c
                    y = bb.emit_output(y)
                bb.emit_func_output(y)
            funcs[fname] = bb.get()[fname]
    return tvm.IRModule({tvm.ir.GlobalVar(n): f.with_attr("global_symbol", n) for n, f in funcs.items()})


def build_bench(out: Path, arch: str):
    import tvm

    import mqa_byoc
    from mqa_byoc.compiler.graph.gemm import PartitionGemm
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    out.mkdir(parents=True, exist_ok=True)
    sym = bench_module()
    t0 = time.time()
    ex = mqa_byoc.build(PartitionGemm()(bench_module(forms=tuple(BENCH_FORMS))), target, mqa=None,
                        pipeline=cuda_decoder_pipeline(target))
    mqa_byoc.export_library(ex, out / "ours.so")
    tvm.compile(sym, target=target, relax_pipeline=cuda_decoder_pipeline(target)).export_library(str(out / "tvm_sym.so"))
    print(f"bench: ours + tvm_sym in {time.time() - t0:.0f}s", flush=True)
    t0 = time.time()
    static = bench_module(BENCH_M)
    tvm.compile(static, target=target, relax_pipeline=cuda_decoder_pipeline(target)).export_library(
        str(out / "tvm_static.so"))
    (out / "manifest.json").write_text(json.dumps({"shapes": [list(s) for s in BENCH_SHAPES], "m": list(BENCH_M),
                                                   "forms": BENCH_FORMS}))
    print(f"bench: tvm_static in {time.time() - t0:.0f}s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-artifacts" / "gemm")
    ap.add_argument("--arch", default=os.environ.get("MQA_BYOC_ARCH", "sm_90"))
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-patterns", action="store_true")
    args = ap.parse_args(argv)
    if not args.no_patterns:
        build_patterns(args.out / "patterns", args.arch)
        build_patterns(args.out / "gemv", args.arch, gemv_cases(),
                       kernel_options={"gemm_gemv": "always", "launch_overlap": "prefetch"}, sizes_of=lambda name: {"n": 1} if "sym" in name else {})
    if not args.no_bench:
        build_bench(args.out / "bench", args.arch)


if __name__ == "__main__":
    os.environ.setdefault("TVM_NUM_THREADS", "2")
    main()
