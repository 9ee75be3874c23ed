#!/usr/bin/env python3
"""Build the GPU test artifacts on a machine with the full apache-tvm (no GPU needed).

Every case (``--list``) is one entry of ``mqa_byoc.testing.attention_cases.CASES``: a graph from
``mqa_byoc.testing.graphs`` in one of the forms ``partition_for_cutlass`` matches (README "What is matched"), small
shapes with realistic head counts, with the composite it must be offloaded as and the tolerances the GPU
test checks it with (the case is defined there once; this script builds it).
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
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from builder_paths import ROOT  # noqa: E402 - this checkout's mqa_byoc
from bundle import (TARGET, add_functions, build_library, check_exports, codegen_symbols,  # noqa: E402
                    main_ops, unique_symbols)
from mqa_byoc.contract import LINKED_PROVIDERS  # noqa: E402
from mqa_byoc.testing.attention_cases import BUILDERS, CASES, Case, build_graph, describe_io  # noqa: E402
from mqa_byoc.testing.gpu_manifest import MANIFEST_FORMAT  # noqa: E402

DEFAULT_OUT = ROOT / ".gpu-artifacts" / "tests"
EXPANSION_OPS = {"relax.repeat", "relax.broadcast_to", "relax.tile", "relax.concat", "relax.expand_dims"}


def partition_checked(case: Case, mod, mqa: bool, provider: str, function: str = "main"):
    """``partition_for_cutlass`` + its offload report; every site must be offloaded as expected."""
    import mqa_byoc

    part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
    report = [s.as_dict() for s in mqa_byoc.offload_report(mod, mqa=mqa)]
    want = case.expected_composite(mqa)
    if not report or not all(s["offloaded"] and s["composite"] == want for s in report):
        raise SystemExit(f"{case.name}/mqa={mqa}: expected every site offloaded as {want}, report: {report}")
    att = case.attention()
    for s in report:
        if bool(s["causal"]) != bool(att["causal"]) or s["window"] != att["window"] or s["chunk"] != att["chunk"] or \
                not math.isclose(s["scale"], att["scale"], rel_tol=2e-3):
            raise SystemExit(f"{case.name}/mqa={mqa}: report {s} disagrees with the case semantics {att}")
    ops = main_ops(part, function)
    if mqa:
        # a chunked mask's blocks are concatenated on the sequence axis (their outputs, not K/V)
        left = sorted(set(ops) & (EXPANSION_OPS - ({"relax.concat"} if att["chunk"] else set())))
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
        "case": case.as_dict(),
        "target": TARGET,
        "tvm_version": tvm.__version__,
        "seed": args.seed,
        "input_generation": "numpy default_rng([seed, crc32(case name), input index]).standard_normal(shape, "
                            "float32) rounded to dtype (mqa_byoc.testing.gpu_manifest)",
        "inputs": inputs,
        "output": output,
        "attention": attention,
        "kv_expanded_in_graph": case.kv_expanded_in_graph,
        "nomqa_expands_kv": case.nomqa_expands_kv,  # mqa=False: K/V expanded by TVM kernels before FA2
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
