"""What the GPU artifact builders share: one library holding many VM functions (a "bundle"),
each a partitioned graph with its offloaded functions given unique symbols, built through
``mqa_byoc.build`` and exported with ``mqa_byoc.export_library``; the checks of what a library
exports and of the ops a partitioned function keeps."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from pathlib import Path

TARGET = {"kind": "cuda", "arch": "sm_90"}


def main_ops(mod, function="main") -> list[str]:
    """Op names (and called functions, as ``call:<name>``) in ``function``, in order of appearance."""
    from tvm import relax

    names = []

    def visit(e):
        if isinstance(e, relax.Call):
            if isinstance(e.op, relax.GlobalVar):
                names.append(f"call:{e.op.name_hint}")
            elif hasattr(e.op, "name"):
                names.append(str(e.op.name))

    relax.analysis.post_order_visit(mod[function].body, visit)
    return names


def codegen_symbols(mod, codegen: str | None = None) -> list[str]:
    """Global symbols of the offloaded functions (of one ``codegen`` only, e.g. the attention's, where given:
    the GEMMs are offloaded to cuBLASLt too)."""
    return sorted(str(f.attrs["global_symbol"]) for f in mod.functions.values()
                  if f.attrs is not None and "Codegen" in f.attrs
                  and (codegen is None or str(f.attrs["Codegen"]) == codegen))


def _defined_symbols(path: Path, dynamic: bool) -> set[str]:
    cmd = ["nm", "-D", "--defined-only", str(path)] if dynamic else ["nm", "--defined-only", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {f[-1] for f in (line.split() for line in out.splitlines()) if len(f) == 3 and f[1] not in "Uuvw"}


def check_exports(path: Path, symbols: list[str], kernel_entries: list[str] | None = None) -> list[str]:
    """The library exports a TVM-FFI function per offloaded attention; native: the FA2 dispatcher and
    the kernel entries it references weakly are defined in it (linked, not left to resolve to null);
    and it loads with RTLD_NOW."""
    want = [f"__tvm_ffi_{s}" for s in symbols]
    missing = sorted(set(want) - _defined_symbols(path, dynamic=True))
    if kernel_entries is not None:
        inner = ["mqa_byoc_fa2_forward", "mqa_byoc_fa2_last_error"] + list(kernel_entries)
        missing += sorted(set(inner) - _defined_symbols(path, dynamic=False))
        want += inner
    if missing:
        raise SystemExit(f"{path}: symbols not defined: {missing}")
    try:  # every undefined symbol resolves (against the TVM runtime loaded here); no CUDA driver needed
        ctypes.CDLL(str(path.resolve()), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as err:
        raise SystemExit(f"{path} does not load: {err}") from err
    return want


def cuda_kernel_names(ex) -> list[str]:
    from mqa_byoc.compiler.link import iter_modules, root_module

    names = set()
    for m in iter_modules(root_module(ex)):
        if m.kind == "cuda":
            names.update(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", m.inspect_source()))
    return sorted(names)


def vm_calls(ex) -> dict[str, list[str]]:
    """{VM function: the functions it calls (PrimFunc launchers, offloaded FA2 wrappers, other VM
    functions), in order, ``vm.builtin.*`` left out}, from the executable's text form."""
    calls, cur = {}, None
    for line in ex.as_text().splitlines():
        if line.startswith("@") and line.rstrip().endswith(":"):
            cur = line[1:].rstrip()[:-1]
            calls[cur] = []
        elif cur is not None and line.strip().startswith("call "):
            name = line.split()[1]
            if not name.startswith("vm.builtin."):
                calls[cur].append(name)
    return calls


def unique_symbols(part, fname: str):
    """``part`` (partitioned, one VM function ``fname``) with its offloaded functions named
    ``<fname>__<function>``, so that several partitions share one library."""
    from tvm import relax

    for gv, func in list(part.functions.items()):
        if func.attrs is not None and "Codegen" in func.attrs:
            part[gv] = func.with_attr("global_symbol", f"{fname}__{gv.name_hint}")
    return relax.transform.NormalizeGlobalVar()(part)


def add_functions(funcs: dict, mod, where: str) -> None:
    """Add ``mod``'s functions to ``funcs`` (GlobalVar -> function); a name twice is an error."""
    names = {g.name_hint for g in funcs}
    for gv, func in mod.functions.items():
        if gv.name_hint in names:
            raise SystemExit(f"{where}: duplicate function {gv.name_hint}")
        funcs[gv] = func


def kernel_options(provider: str) -> dict | None:
    """The kernel options of the test libraries: the hopper provider's run FA4 on every call it can
    compute (not only prefill-sized ones), so that the tests' small shapes exercise the FA4 objects."""
    return {"hopper_fa4": "always"} if provider == "hopper" else None


def build_library(funcs: dict, path: Path, provider: str, args, pipeline=None):
    """``mqa_byoc.build`` of the already partitioned ``funcs`` for :data:`TARGET` (each offloaded
    function carries its provider), exported to ``path`` (native: FA2 kernels linked; compiled when
    missing only with ``args.build_native_kernels``). ``pipeline``: a function of the target giving
    ``relax.build``'s pipeline (default TVM's). Returns ``(executable, {"build": s, "export": s})``."""
    import time

    import tvm

    import mqa_byoc

    t0 = time.time()
    target = tvm.target.Target(TARGET)
    ex = mqa_byoc.build(tvm.IRModule(funcs), target, mqa=None, provider=provider,
                        pipeline=pipeline(target) if pipeline else None, kernel_options=kernel_options(provider))
    t1 = time.time()
    mqa_byoc.export_library(ex, str(path), arch=TARGET["arch"], build=args.build_native_kernels,
                            jobs=args.jobs, progress=print)
    return ex, {"build": round(t1 - t0, 1), "export": round(time.time() - t1, 1)}


# ---- decoder builders (build_decoders.py, build_inplace.py): one decoder per case, two libraries ----

def decoder_manifest(out: Path, cases) -> tuple[Path, dict]:
    """``out/manifest.json`` and what it holds for the cases still in ``cases``."""
    import json

    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {}
    return path, {k: v for k, v in manifest.items() if k in cases}


def export_decoder_variants(out: Path, name: str, target, arch: str, cfg, spec, mqa_mod, ref_mod,
                            mqa=True, meta=None) -> tuple[dict, dict]:
    """``<name>.mqa.so``: ``mqa_mod`` through ``mqa_byoc.build`` (``mqa`` passed on; native provider)
    and ``mqa_byoc.export_library``; ``<name>.reference.so``: ``ref_mod`` through TVM's ``relax.build``
    alone; both with the decoders' CUDA pipeline and a sidecar (``meta`` added to its case entry).
    Returns ``({variant: file name}, {variant: executable})``."""
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.sidecar import write_sidecar

    files, executables = {}, {}
    for variant in ("mqa", "reference"):
        path = out / f"{name}.{variant}.so"
        if variant == "mqa":
            ex = mqa_byoc.build(mqa_mod, target, mqa=mqa, provider="native", pipeline=cuda_decoder_pipeline(target))
            mqa_byoc.export_library(ex, str(path), arch=arch)
        else:
            with target:
                ex = relax.build(ref_mod, target=target, relax_pipeline=cuda_decoder_pipeline(target))
            ex.export_library(str(path))
        write_sidecar(str(path), cfg, spec, "float16", {"case": name, "variant": variant, **(meta or {})})
        files[variant], executables[variant] = path.name, ex
    return files, executables


def decoder_builder_main(doc: str, out_name: str, cases, build, argv=None) -> int:
    """The command line of a decoder builder: ``--out`` (default ``.gpu-artifacts/<out_name>``),
    ``--arch``, ``--cases``; calls ``build(out, arch, names)``."""
    import argparse

    from builder_paths import ROOT

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".gpu-artifacts" / out_name))
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--cases", nargs="*", help=f"build only these (of {', '.join(cases)})")
    args = p.parse_args(argv)
    build(Path(args.out), args.arch, args.cases)
    return 0
