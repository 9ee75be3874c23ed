#!/usr/bin/env python3
"""Build the GPU test artifacts on a machine with the full apache-tvm (no GPU needed).

For every case (see CASES) this writes into ``<out>/<case>/`` (default ``.gpu-artifacts``, git-ignored):

- ``reference.so``: the unpartitioned graph built by plain TVM for CUDA (a grouped ``R.nn.attention``
  gets :class:`LegalizeGroupedAttention` first: TVM's own lowering groups heads wrongly without it);
- ``mqa_<provider>.so``: ``partition_for_cutlass(mod, mqa=True, provider=...)``: FA2 on native K/V heads;
- ``nomqa_<provider>.so``: ``partition_for_cutlass(mod, mqa=False, provider=...)``: K/V expanded by TVM
  kernels, FA2 run as plain MHA (the A/B baseline);
- ``manifest.json``: input names/shapes/dtypes and the seed, attention parameters, module files, the
  offload report, and why a variant was skipped.

Providers: ``python`` always; ``native`` with ``--native`` (links FA2 kernels compiled from flash-attn's
sources via ``mqa_byoc.export_library``; ``--build-native-kernels`` allows building missing kernel
objects, minutes each, otherwise a missing kernel skips the native variants with the reason recorded).
Native libraries embed FA2 kernels (MBs each): watch the printed total against the 64 MiB carry limit.

Run ``tests/gpu/test_gpu_attention.py`` on the GPU machine to load and compare them (see README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

TARGET = {"kind": "cuda", "arch": "sm_90"}
DEFAULT_OUT = ROOT / ".gpu-artifacts"


@dataclass(frozen=True)
class Case:
    """One attention graph. Dims given as str are symbolic in the graph; ``run`` gives their values."""

    name: str
    form: str  # "repeat": attention(q, repeat(k), repeat(v)) in BSNH; "fewer": attention(q, k, v), H_kv < H
    b: int | str
    sq: int | str
    skv: int | str
    h: int
    hkv: int
    d: int
    dtype: str
    causal: str | None  # None / "TopLeft" / "BottomRight" (R.nn.attention's causal_mask)
    run: dict = field(default_factory=dict)  # values of the symbolic dims

    def dim(self, x) -> int:
        return self.run[x] if isinstance(x, str) else x

    def shapes(self) -> dict[str, list[int]]:
        b, sq, skv = self.dim(self.b), self.dim(self.sq), self.dim(self.skv)
        return {"q": [b, sq, self.h, self.d], "k": [b, skv, self.hkv, self.d], "v": [b, skv, self.hkv, self.d]}


# Small shapes (the reference is TVM's naive attention); head counts and head dim are realistic.
CASES = [
    Case("repeat_gqa_f16_causal_prefill_sym", "repeat", 2, "s", "s", 16, 4, 128, "float16", "TopLeft",
         run={"s": 192}),
    Case("fewer_gqa_bf16_noncausal_prefill", "fewer", 1, 128, 128, 16, 2, 128, "bfloat16", None),
    # BottomRight with S_q, S_kv both symbolic is (rightly) not offloaded: S_q <= S_kv is not provable.
    Case("fewer_gqa_f16_causal_chunked", "fewer", 2, 64, 256, 16, 4, 128, "float16", "BottomRight"),
    Case("repeat_mqa_bf16_causal_chunked", "repeat", 1, 32, 160, 16, 1, 128, "bfloat16", "BottomRight"),
    Case("fewer_mqa_f16_decode_sym", "fewer", 4, 1, "skv", 16, 1, 128, "float16", None, run={"skv": 200}),
    Case("repeat_gqa_bf16_decode", "repeat", 2, 1, 256, 16, 4, 128, "bfloat16", None),
]


def build_graph(case: Case):
    from tvm import relax, tirx

    syms: dict[str, tirx.Var] = {}

    def dim(x):
        if isinstance(x, str):
            syms.setdefault(x, tirx.Var(x, "int64"))
            return syms[x]
        return x

    b, sq, skv = dim(case.b), dim(case.sq), dim(case.skv)
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([b, sq, case.h, case.d], case.dtype))
    k = relax.Var("k", relax.TensorType([b, skv, case.hkv, case.d], case.dtype))
    v = relax.Var("v", relax.TensorType([b, skv, case.hkv, case.d], case.dtype))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = k, v
            if case.form == "repeat":
                r = case.h // case.hkv
                kk = bb.emit(relax.op.repeat(k, r, axis=2))
                vv = bb.emit(relax.op.repeat(v, r, axis=2))
            elif case.form != "fewer":
                raise ValueError(case.form)
            out = bb.emit_output(relax.op.nn.attention(q, kk, vv, causal_mask=case.causal))
        bb.emit_func_output(out)
    return bb.get()


def _export(ex, path: Path, provider: str, args) -> None:
    if provider == "native":
        import mqa_byoc

        mqa_byoc.export_library(ex, str(path), arch=TARGET["arch"], build=args.build_native_kernels,
                                jobs=args.jobs, progress=print)
    else:
        ex.export_library(str(path))


def build_case(case: Case, out_dir: Path, providers: list[str], args) -> dict:
    import tvm
    from tvm import relax

    import mqa_byoc
    from mqa_byoc.compiler.gqa_legalize import LegalizeGroupedAttention

    target = tvm.target.Target(TARGET)
    case_dir = out_dir / case.name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    mod = build_graph(case)
    manifest = {
        "case": asdict(case),
        "target": TARGET,
        "tvm_version": tvm.__version__,
        "seed": args.seed,
        "inputs": [{"name": n, "shape": s, "dtype": case.dtype} for n, s in case.shapes().items()],
        "scale": 1.0 / math.sqrt(case.d),
        "causal_mask": case.causal,
        "kv_expanded_in_graph": case.hkv < case.h,
        "modules": {},
        "skipped": {},
        "reports": {},
        "sizes": {},
    }

    t0 = time.time()
    ref = LegalizeGroupedAttention()(mod)  # no-op for the repeat form
    ex = tvm.compile(ref, target=target)
    ex.export_library(str(case_dir / "reference.so"))
    manifest["modules"]["reference"] = "reference.so"

    for provider in providers:
        for mqa in (True, False):
            key = f"{'mqa' if mqa else 'nomqa'}_{provider}"
            part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
            report = [s.as_dict() for s in mqa_byoc.offload_report(mod, mqa=mqa)]
            manifest["reports"][key] = report
            want = "flash_attn.attention_mqa" if (mqa and case.hkv < case.h) else "flash_attn.attention"
            if not report or not all(s["offloaded"] and s["composite"] == want for s in report):
                raise SystemExit(f"{case.name}/{key}: expected every site offloaded as {want}, report: {report}")
            lowered = relax.transform.RunCodegen()(part)
            ex = tvm.compile(lowered, target=target)
            path = case_dir / f"{key}.so"
            try:
                _export(ex, path, provider, args)
            except Exception as err:  # noqa: BLE001 - native kernels may be unavailable here
                if provider != "native":
                    raise
                manifest["skipped"][key] = f"{type(err).__name__}: {err}"
                print(f"  {case.name}/{key}: skipped ({err})")
                path.unlink(missing_ok=True)
                continue
            manifest["modules"][key] = path.name

    for name in manifest["modules"].values():
        manifest["sizes"][name] = (case_dir / name).stat().st_size
    (case_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(manifest["sizes"].values())
    print(f"{case.name}: {sorted(manifest['modules'])} {total / 2**20:.1f} MiB in {time.time() - t0:.1f}s")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="artifact folder (default .gpu-artifacts)")
    ap.add_argument("--cases", nargs="*", help="case names (default all); --list shows them")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--native", action="store_true", help="also build the native-provider variants")
    ap.add_argument("--build-native-kernels", action="store_true",
                    help="with --native: compile missing FA2 kernel objects (minutes each)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs for native kernels")
    ap.add_argument("--seed", type=int, default=0, help="seed for the random inputs (stored in the manifests)")
    args = ap.parse_args(argv)

    if args.list:
        for c in CASES:
            print(f"{c.name}: {c.shapes()} {c.dtype} causal={c.causal}")
        return 0
    selected = [c for c in CASES if not args.cases or c.name in args.cases]
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}")
    providers = ["python"] + (["native"] if args.native else [])
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.cases:  # a full build replaces stale case folders
        for stale in args.out.iterdir():
            if stale.is_dir() and (stale / "manifest.json").exists() and stale.name not in {c.name for c in CASES}:
                shutil.rmtree(stale)
    total = 0
    for case in selected:
        total += sum(build_case(case, args.out, providers, args)["sizes"].values())
    print(f"total {total / 2**20:.1f} MiB in {args.out} (carry limit 64 MiB, .devkit included)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
