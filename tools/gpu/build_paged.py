"""Build the PagedKVCache decoders for tests/gpu/test_gpu_paged.py and benchmarks/paged_attention.py.

    MQA_BYOC_KERNEL_DIR=.gpu-artifacts/fa2 MQA_BYOC_FLASH_ATTN_SRC=<flash_attn-2.8.3.tar.gz> \\
        python tools/gpu/build_paged.py [--out .gpu-artifacts/paged] [--cases gqa64_8_d128 ...]

For each case, :class:`mqa_byoc.models.paged_llama.PagedLlama` (``relax.frontend.nn`` with a
``TIRPagedKVCache``) twice: ``tir.so`` as TVM builds it (TVM's TIR attention kernels, page size 16)
and ``fa2.so`` after :class:`~mqa_byoc.compiler.paged.UseFlashAttentionForPagedKVCache` (FA2, page
size = FA2's tile for the head dim) with its GEMMs on cuBLASLt (``offload_gemms``), exported with :func:`mqa_byoc.export_library`;
and ``fa4.so``, the same with ``provider="hopper"`` (the ragged prefill on FA4's var-len forward) where
the hopper provider can have its objects (flash-attn-4 installed, or prebuilt). RoPE mode NONE,
so that the test's fp32 reference needs no RoPE (the attention is what is compared). ``manifest.json``
holds the config, page sizes, parameter shapes and the pass's report per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builder_paths  # noqa: E402,F401 - sys.path for mqa_byoc

CASES = {
    # name: PagedLlamaConfig fields (GQA like CodeLlama-34B / Llama-3-70B, MQA like Falcon-7B, MQA 8/1)
    "gqa64_8_d128": dict(num_q_heads=64, num_kv_heads=8, head_dim=128, hidden=2048, intermediate=4096, layers=4,
                         vocab=4096),
    "mqa71_1_d64": dict(num_q_heads=71, num_kv_heads=1, head_dim=64, hidden=1024, intermediate=2048, layers=2,
                        vocab=1024),
    "mqa8_1_d128": dict(num_q_heads=8, num_kv_heads=1, head_dim=128, hidden=1024, intermediate=2048, layers=2,
                        vocab=1024),
    "gqa32_4_d128_bf16": dict(num_q_heads=32, num_kv_heads=4, head_dim=128, hidden=512, intermediate=1024, layers=1,
                              vocab=256, dtype="bfloat16"),
}
TIR_PAGE = 16  # TVM 0.27 generates its TIR cache kernels for this page size only


def build(out: Path, arch: str, names=None) -> None:
    import tvm

    import mqa_byoc
    from mqa_byoc.compiler.paged.codegen import PagedConfig
    from mqa_byoc.compiler.paged.transform import (UseFlashAttentionForPagedKVCache, fa4_ragged_reason,
                                                   format_paged_report, page_unit, paged_kv_cache_report)
    from mqa_byoc.compiler.build import offload_gemms
    from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for name, fields in CASES.items():
        if names and name not in names:
            continue
        t0 = time.time()
        cfg = PagedLlamaConfig(rope_mode=0, **fields)
        mod, params, _ext = export_paged_llama(cfg, target)
        fa2_page = page_unit(cfg.head_dim)
        report = paged_kv_cache_report(mod, fa2_page, provider="native")  # fa2.so's
        paged_config = PagedConfig(cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, fa2_page)
        served = sorted(d.kernel for d in report if d.offloaded)
        if served != ["batch_decode_paged_kv", "batch_prefill_paged_kv", "batch_prefill_ragged_kv",
                      "tir_attention_merge_state"]:
            raise SystemExit(f"{name}: not served as expected:\n{format_paged_report(report)}")
        case_dir = out / name
        case_dir.mkdir(parents=True, exist_ok=True)
        tvm.compile(mod, target=target).export_library(str(case_dir / "tir.so"))
        libs = {"fa2": "native"}
        if fa4_ragged_reason(paged_config, "hopper", arch) is None:
            libs["fa4"] = "hopper"
        else:
            print(f"[build_paged] {name}: no fa4.so ({fa4_ragged_reason(paged_config, 'hopper', arch)})", flush=True)
        for impl, provider in libs.items():
            with target:
                lib_mod = UseFlashAttentionForPagedKVCache(page_size=fa2_page, provider=provider)(mod)
            lib_mod = offload_gemms(lib_mod, target)  # and its GEMMs on cuBLASLt (tir.so: TVM's own throughout)
            mqa_byoc.export_library(tvm.compile(lib_mod, target=target), case_dir / f"{impl}.so", arch=arch,
                                    build=False)
        manifest[name] = {
            "config": dataclasses.asdict(cfg),
            "page_size": {"tir": TIR_PAGE, **{impl: fa2_page for impl in libs}},
            "libraries": {"tir": f"{name}/tir.so", **{impl: f"{name}/{impl}.so" for impl in libs}},
            "params": [[pname, [int(s) for s in p.shape], str(p.dtype)] for pname, p in params],
            "report": format_paged_report(report).splitlines(),
            "build_seconds": round(time.time() - t0, 1),
        }
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        print(f"[build_paged] {name}: {time.time() - t0:.0f}s", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[2]
    ap.add_argument("--out", type=Path, default=root / ".gpu-artifacts" / "paged")
    ap.add_argument("--arch", default=os.environ.get("MQA_BYOC_ARCH", "sm_90"))
    ap.add_argument("--cases", nargs="*", choices=sorted(CASES))
    args = ap.parse_args(argv)
    build(args.out, args.arch, args.cases)


if __name__ == "__main__":
    main()
