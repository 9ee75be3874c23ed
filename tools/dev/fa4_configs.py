"""flash-attn-4's sm90 forward in other configurations than the one its interface picks, timed against
cuDNN (benchmarks/results/2026-12-01-prefill-fa4-configs.md):

    # here (flash-attn-4 installed, no GPU): one directory of objects per configuration
    python tools/dev/fa4_configs.py build --out DIR "fp16 h128 g8 causal" "fp16 h128 g4 causal"
    # on the GPU (runtime-only TVM from `mqa-byoc runtime-kit`, torch): link each, call it through TVM-FFI, time it
    python3 tools/dev/fa4_configs.py run DIR --cases '[[64,8,128,16384]]' --json OUT.json
    # a few calls after a second idle each: the clock before the board's power limit lowers it
    python3 tools/dev/fa4_configs.py run DIR --cases '[[64,8,128,16384]]' --budget-ms 20 --idle-s 1

A configuration overrides keyword arguments of flash-attn-4's ``_flash_attn_fwd`` (``tile_mn``,
``mma_pv_is_rs``, ``intra_wg_overlap``, ``pack_gqa``), which then configures the kernel as it would for a
call; ``mqa_byoc.kernels.hopper_aot.compile_key`` compiles and exports it exactly as the provider's own.
``persistent`` (causal only) compiles it with ``fa4_persistent``'s schedule instead: one CTA per SM
(``benchmarks/results/2026-12-01-prefill-fa4-persistent.md``)."""
import argparse
import concurrent.futures as cf
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"base": {}, "t128x144": {"tile_mn": [128, 144]}, "t128x160": {"tile_mn": [128, 160]},
           "t128x176": {"tile_mn": [128, 176]}, "t128x192": {"tile_mn": [128, 192]},
           "t128x176noRS": {"tile_mn": [128, 176], "mma_pv_is_rs": False}, "noRS": {"mma_pv_is_rs": False},
           "noOL": {"intra_wg_overlap": False}, "nopack": {"pack_gqa": False},
           "persistent": {"persistent": True}, "stages3": {"num_stages": 3}}


def build(out: Path, labels, configs):
    from mqa_byoc.kernels import hopper_aot as aot  # sets the DSL's target before flash-attn-4 loads
    from mqa_byoc.kernels.hopper import HopperKernelKey
    import flash_attn.cute.interface as fi

    sys.path.insert(0, str(Path(__file__).parent))
    import fa4_persistent

    real, real_cls = fi._flash_attn_fwd, fi.FlashAttentionForwardSm90
    try:
        for name, over in configs.items():
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "config.json").write_text(json.dumps(over))
            persistent = bool(over.get("persistent"))  # ours (fa4_persistent), not an interface keyword
            stages = over.get("num_stages")  # the kernel's K/V pipeline depth (the interface passes 2)
            over = {k: tuple(v) if k == "tile_mn" else v for k, v in over.items()
                    if k not in ("persistent", "num_stages")}
            fi.FlashAttentionForwardSm90 = real_cls if stages is None else type(
                real_cls.__name__, (real_cls,), {"__init__": lambda self, *a, _n=stages, **kw:
                                            real_cls.__init__(self, *a, **{**kw, "num_stages": _n})})

            def configured(*a, _over=over, **kw):
                return real(*a, **{**kw, **_over})

            configured.__dict__.update(real.__dict__)  # the interface keeps its compile cache there
            fi._flash_attn_fwd = configured
            for label in labels:
                compile_key = fa4_persistent.compile_key if persistent else aot.compile_key
                print(name, json.dumps(compile_key(HopperKernelKey.parse(label), out / name)), flush=True)
    finally:
        fi._flash_attn_fwd, fi.FlashAttentionForwardSm90 = real, real_cls
    import shutil

    shutil.copy2(aot._runtime_archive(), out / aot.RUNTIME_ARCHIVE)


def run(objs: Path, cases, rounds: int, budget_ms: float, idle_s: float = 0.0):
    import torch
    import torch.nn.functional as F
    import tvm_ffi
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mqa_byoc.kernels.hopper import RUNTIME_ARCHIVE
    from mqa_byoc.testing.gpu_clock import ClockSampler
    from mqa_byoc.testing.timing import cuda_time_us

    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    ffi_dir = next(Path(tvm_ffi.__file__).parent.rglob("libtvm_ffi.so")).parent

    def link(name):
        so = f"/tmp/fa4_config_{name}.so"
        subprocess.run(["g++", "-shared", "-fPIC", "-o", so, *map(str, sorted((objs / name).glob("*.o"))),
                        str(REPO / "src/mqa_byoc/native/fa4_glue.cc"), str(objs / RUNTIME_ARCHIVE),
                        f"-I{cuda}/include", f"-L{cuda}/lib64", "-lcudart", "-lcuda", f"-L{ffi_dir}", "-ltvm_ffi",
                        f"-Wl,-rpath,{ffi_dir}"], check=True)
        return name, tvm_ffi.load_module(so)

    names = sorted(p.name for p in objs.iterdir() if p.is_dir())
    with cf.ThreadPoolExecutor(8) as ex:
        mods = dict(ex.map(link, names))

    def timed(fn, n):
        torch.cuda.synchronize()
        time.sleep(idle_s)  # from an idle GPU: the clock before the power limit pulls it down
        with ClockSampler() as clock:
            us = cuda_time_us(fn, n, warmup=0)
        return us, clock.summary()

    results, sms = [], torch.cuda.get_device_properties(0).multi_processor_count
    for h, hk, d, s in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, s, n, d, device="cuda", dtype=torch.float16, generator=g) for n in (h, hk, hk))
        scale, flops = 1 / math.sqrt(d), 2 * s * s * h * d  # causal: half of 4·S²·H·D
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)

        ref = cudnn().transpose(1, 2).float()
        calls, case = {"cudnn": cudnn}, {"shape": f"{h}/{hk}/{d}", "S": s, "variants": {"cudnn": {}}}
        symbol = f"mqa_byoc_fa4_sm90_fp16_h{d}_g{h // hk}_causal"
        tq, tk, tv = (tvm_ffi.from_dlpack(x) for x in (q, k, v))
        for name, mod in mods.items():
            out = torch.empty_like(q)
            to = tvm_ffi.from_dlpack(out)
            extra = (sms,) if json.loads((objs / name / "config.json").read_text()).get("persistent") else ()
            try:
                f = mod[symbol]
                f(tq, tk, tv, to, scale, *extra)
                torch.cuda.synchronize()
                case["variants"][name] = {"err": (out.float() - ref).abs().max().item()}
                calls[name] = lambda f=f, to=to, extra=extra: f(tq, tk, tv, to, scale, *extra)
            except Exception as ex:  # noqa: BLE001  (a configuration the GPU refuses: recorded)
                case["variants"][name] = {"error": repr(ex)[:200]}
        n = max(3, int(budget_ms * 1e3 / timed(cudnn, 2)[0]))
        for _ in range(rounds):  # interleaved: every configuration sees the same thermal history
            for name, fn in calls.items():
                us, clock = timed(fn, n)
                rec = case["variants"][name]
                rec.setdefault("us", []).append(round(us, 1))
                rec.setdefault("mhz", []).append(clock.get("sm_clock_mhz"))
                rec.setdefault("limits", []).append(clock.get("clock_limits"))
        for rec in case["variants"].values():
            if "us" in rec:
                rec["best_us"] = min(rec["us"])
                rec["tflops"] = round(flops / rec["best_us"] / 1e6, 1)
        print(case["shape"], s, {k: (r.get("best_us"), r.get("tflops"), r.get("error")) for k, r in
                                 case["variants"].items()}, flush=True)
        results.append(case)
    return {"cases": results}


def main(argv=None):
    p = argparse.ArgumentParser(prog="tools/dev/fa4_configs.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--configs", default=None, help="JSON {name: overrides}; default: the table above")
    b.add_argument("labels", nargs="+")
    r = sub.add_parser("run")
    r.add_argument("objs", type=Path)
    r.add_argument("--cases", default="[[64,8,128,4096],[64,8,128,16384],[32,8,128,16384]]")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--budget-ms", type=float, default=150.0)
    r.add_argument("--idle-s", type=float, default=0.0, help="seconds idle before each timed loop")
    r.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    if a.cmd == "build":
        build(a.out, a.labels, json.loads(a.configs) if a.configs else CONFIGS)
    else:
        res = run(a.objs, json.loads(a.cases), a.rounds, a.budget_ms, a.idle_s)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
