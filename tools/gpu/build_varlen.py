"""Build the var-len GPU artifacts: run here (full TVM, nvcc), test on the GPU with
``tests/gpu/test_gpu_varlen.py`` (runtime-only TVM).

    python tools/gpu/build_varlen.py [--out .gpu-artifacts/varlen] [--no-native]

Writes into ``--out``:

- ``python.so`` / ``native.so`` / ``hopper.so``: one library per provider holding ``<case>__mqa`` (and, for cases whose
  graph expands K/V, ``<case>__nomqa``) for every case: each is ``partition_for_cutlass(<case graph>,
  mqa=..., provider=...)`` with ``main`` renamed; native links the FA2 kernels once
  (``MQA_BYOC_KERNEL_DIR`` / ``MQA_BYOC_FLASH_ATTN_SRC`` as for ``mqa_byoc.export_library``);
- ``inputs.npz``: per case the graph's inputs (``<case>/<param>``; bfloat16 as uint16 bit patterns);
- ``manifest.json``: per case the parameters in order (name, shape, dtype, device: max_seqlen lives on
  the host or on the GPU, both are tested), the sequence lengths, the attention semantics (heads,
  head dim, dtype, causal, window, scale), the functions per variant and the offload report.

Cases: batch 3 with different lengths, GQA 8/2 and MQA, causal (chunked: S_q <= S_kv; and one
sequence with S_q > S_kv, whose first rows see no key), non-causal, sliding window, TopLeft with one
seqstart, fp16/bf16, head dim 64/128, K/V expanded (repeat, broadcast_to, HF repeat_kv) or not,
upstream's merged (total, H*D) form.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from mqa_byoc.contract import COMPOSITE_VAR_LEN  # noqa: E402
from mqa_byoc.testing.varlen_cases import CASES, SEED, case_attention, case_graph, case_inputs  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90"}
EXPANSION_OPS = ("relax.repeat", "relax.broadcast_to", "relax.expand_dims", "relax.tile")

def _ops(func) -> list[str]:
    import tvm
    from tvm import relax

    return [b.value.op.name for blk in func.body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _partition(case, variant: str, mqa: bool, provider: str):
    """The case partitioned, ``main`` renamed ``<case>__<variant>``, offloaded functions with unique symbols."""
    import tvm
    from tvm import relax

    import mqa_byoc

    fname = f"{case['name']}__{variant}"
    mod = case_graph(case)
    (site,) = mqa_byoc.offload_report(mod, mqa=mqa)
    att = case_attention(case)
    got = {"num_q_heads": site.num_q_heads, "num_kv_heads": site.num_kv_heads if mqa else att["num_kv_heads"],
           "head_dim": site.head_dim, "dtype": site.dtype, "causal": site.causal, "window": site.window}
    want = {k: att[k] for k in got}
    if not site.offloaded or site.composite != COMPOSITE_VAR_LEN or got != want or \
            abs(site.scale - att["scale"]) > 1e-9:
        raise SystemExit(f"{fname}: report {site.as_dict()} does not match the case {att}")
    mod = tvm.IRModule({fname: mod["main"].with_attr("global_symbol", fname)})
    part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
    ops = _ops(part[fname])
    if "relax.nn.attention_var_len" in ops:
        raise SystemExit(f"{fname}: attention_var_len left in the graph: {ops}")
    if mqa and any(op in EXPANSION_OPS for op in ops):
        raise SystemExit(f"{fname}: K/V expansion left with mqa=True: {ops}")
    for gv, func in list(part.functions.items()):
        if func.attrs is not None and "Codegen" in func.attrs:
            part[gv] = func.with_attr("global_symbol", f"{fname}__{gv.name_hint}")
    return relax.transform.NormalizeGlobalVar()(part), fname, site.as_dict(), ops


def build_library(provider: str, out: Path, manifest: dict) -> None:
    import tvm

    import mqa_byoc

    t0 = time.time()
    funcs = {}
    for case in CASES:
        entry = manifest["cases"][case["name"]]
        variants = [("mqa", True)] + ([("nomqa", False)] if case["graph"]["expand"] != "none" else [])
        for variant, mqa in variants:
            part, fname, report, ops = _partition(case, variant, mqa, provider)
            funcs.update(part.functions)
            entry["functions"][f"{variant}_{provider}"] = fname
            entry["reports"][variant] = report
            entry["ops_after_partition"][f"{variant}_{provider}"] = ops
    # already partitioned (mqa=None), each function with its provider recorded
    ex = mqa_byoc.build(tvm.IRModule(funcs), TARGET, mqa=None, provider=provider)
    path = out / f"{provider}.so"
    if provider in ("native", "hopper"):
        mqa_byoc.export_library(ex, str(path), arch=TARGET["arch"], build=False, progress=print)
    else:
        ex.export_library(str(path))
    manifest["libraries"][provider] = {"file": path.name, "size": path.stat().st_size}
    print(f"{provider}.so: {len(funcs)} functions, {path.stat().st_size / 2**20:.2f} MiB, {time.time() - t0:.0f}s",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-artifacts" / "varlen")
    ap.add_argument("--no-native", action="store_true", help="python provider only")
    ap.add_argument("--no-hopper", action="store_true", help="no hopper provider library (FA4's var-len forward)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in ("python.so", "native.so", "hopper.so", "inputs.npz", "manifest.json"):
        (args.out / old).unlink(missing_ok=True)
    manifest = {"format": 1, "seed": SEED, "target": TARGET, "libraries": {}, "cases": {}}
    values = {}
    for case in CASES:
        specs, vals = case_inputs(case, case_graph(case))
        values.update(vals)
        manifest["cases"][case["name"]] = {
            "inputs": specs, "lens_q": case["lens_q"], "lens_k": case["lens_k"], "attention": case_attention(case),
            "expands_kv": case["graph"]["expand"] != "none", "merged": bool(case["graph"].get("merged")),
            "same_seqstart": bool(case["graph"].get("same_seqstart")),
            "functions": {}, "reports": {}, "ops_after_partition": {},
        }
    np.savez(args.out / "inputs.npz", **values)
    from mqa_byoc.kernels import hopper

    hopper_ok = not (args.no_native or args.no_hopper) and hopper.available(TARGET["arch"]) is None
    for provider in ("python",) + (() if args.no_native else ("native",)) + (("hopper",) if hopper_ok else ()):
        build_library(provider, args.out, manifest)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"{args.out}: {total / 2**20:.2f} MiB", flush=True)
    if total > 40 * 2**20:
        raise SystemExit(f"artifacts are {total / 2**20:.1f} MiB, more than 40 MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
