"""Our grouped-query decode kernel (``native/gqa_decode.cu``) alone on the GPU by the M tiles of 16 query
rows a warp carries (``row_tiles``: CTAs of 16, 32 or 48 query rows of a K/V head), against a baseline
build of an earlier ``gqa_decode.cu`` (one tile a warp, its C API without ``row_tiles``): batch 1 on a
contiguous cache, and TVM's pages at batch 1/8/32/64 (lengths as ``paged_attention.py``'s decode: mixed
1k-16k and every sequence 16k). GPU kernel time per call from CUPTI; every output checked against fp32.

    PYTHONPATH=src python benchmarks/decode_tiles.py --baseline-lib OLD.so --out benchmarks/results/DATE-x
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernel import hbm_bytes_per_s, kernel_us  # noqa: E402
from paged_attention import MAX_LEN, PagedInputs, mixed_lengths  # noqa: E402

SHAPES = {"mqa71_1_d64": (71, 1, 64), "mqa40_1_d64": (40, 1, 64), "gqa64_8_d128": (64, 8, 128),
          "gqa32_8_d128": (32, 8, 128)}
TOL = 2e-2  # of max |fp32 output| (bf16's rounding; fp16 is well inside)


def tile_options(h: int, hk: int, d: int) -> list[int]:
    """The row tiles the kernel carries for a shape: 1, and at head dim 64 with more than 16 query rows of a
    K/V head up to the group's tiles (at most 3)."""
    g = h // hk
    return [1] if d != 64 or g <= 16 else list(range(1, min(3, -(-g // 16)) + 1))


class Baseline:
    """A call on the baseline library (the C API before ``row_tiles``: no such arguments, no plan field)."""

    class Plan(ctypes.Structure):
        _fields_ = [("splits", ctypes.c_int), ("keys_per_split", ctypes.c_int), ("row_groups", ctypes.c_int),
                    ("o_part_floats", ctypes.c_int64), ("counters", ctypes.c_int64),
                    ("workspace_bytes", ctypes.c_size_t), ("merge", ctypes.c_int), ("warps", ctypes.c_int)]

    def __init__(self, lib, args, device):
        import torch

        self.lib, self.args = lib, args
        A = ctypes.POINTER(type(args))
        lib.mqa_byoc_decode_cluster_capacity.argtypes = [A, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.mqa_byoc_decode_make_plan.argtypes = [A, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                                  ctypes.POINTER(self.Plan)]
        lib.mqa_byoc_decode_launch.argtypes = [A, ctypes.POINTER(self.Plan), ctypes.c_void_p, ctypes.c_int,
                                               ctypes.c_void_p]
        cap = (ctypes.c_int * 16)()
        assert lib.mqa_byoc_decode_cluster_capacity(ctypes.byref(args), device, cap) == 0
        self.plan = self.Plan()
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        assert lib.mqa_byoc_decode_make_plan(ctypes.byref(args), sms, cap, ctypes.byref(self.plan)) == 0
        self.ws = torch.empty(max(1, self.plan.workspace_bytes), dtype=torch.uint8, device="cuda")

    def __call__(self):
        import torch

        rc = self.lib.mqa_byoc_decode_launch(ctypes.byref(self.args), ctypes.byref(self.plan), self.ws.data_ptr(),
                                             torch.cuda.current_device(),
                                             ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        assert rc == 0, f"baseline launch rc={rc}"


def _err(out, ref) -> float:
    return (out.float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())


#: other builds of the current source (same C API) to time with the plan's rule: name -> library
EXTRA_LIBS: dict = {}


def time_variants(make, out, ref, baseline_lib, iters: int) -> dict:
    """``make(row_tiles, lib=None)``: a Decode; times the baseline, each row-tiles option and the rule's
    plan on each of :data:`EXTRA_LIBS`; checks every output."""
    import torch

    rec = {"us": {}, "plans": {}, "max_err": {}}
    calls = {}
    for t in make.options:
        calls[f"tiles{t}"] = make(t)
    rule = make(0)
    if rule.plan.row_tiles > 1:
        calls.update({name: make(0, lib) for name, lib in EXTRA_LIBS.items()})
    rec["rule_tiles"] = rule.plan.row_tiles
    if baseline_lib is not None:
        calls["before"] = Baseline(baseline_lib, rule.args, torch.cuda.current_device())
    for name, call in calls.items():
        out.fill_(7.0)
        call()
        torch.cuda.synchronize()
        rec["max_err"][name] = e = _err(out, ref)
        assert e <= TOL, f"{name}: error {e}"
        rec["us"][name] = kernel_us(call, iters)
        p = call.plan
        rec["plans"][name] = {"splits": p.splits, "keys_per_split": p.keys_per_split, "warps": p.warps,
                              "row_groups": p.row_groups}
    rec["us"]["after"] = rec["us"][f"tiles{rec['rule_tiles']}"]
    return rec


def _contiguous_inputs(shape, n, dtype):
    """Batch 1 on a contiguous cache: q (1, H, D), k and v (1, n, H_kv, D), out; seeded by the shape."""
    import torch

    h, hk, d = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(n + h)
    q = torch.randn(1, h, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(1, n, hk, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(1, n, hk, d, generator=gen, device="cuda").to(dtype)
    return (h, hk, d), q, k, v, torch.empty_like(q)


def contiguous_case(shape, n, dtype, iters, baseline_lib):
    from mqa_byoc.testing import decode_kernel as dk

    (h, hk, d), q, k, v, out = _contiguous_inputs(shape, n, dtype)
    ref, _ = dk.reference(q, k, v, [n], hk)

    def make(t, lib=None):
        return dk.Decode(q, k, v, out, None, k_stride=k.stride()[:3], v_stride=v.stride()[:3], seqlen_k=n,
                         num_heads_k=hk, row_tiles=t, lib=lib)
    make.options = tile_options(h, hk, d)
    rec = time_variants(make, out, ref, baseline_lib, iters)
    rec.update({"layout": "contiguous", "shape": shape, "dtype": str(dtype).removeprefix("torch."), "batch": 1,
                "lengths_kind": f"{n}", "bytes_us": 2 * n * hk * d * q.element_size() / hbm_bytes_per_s() * 1e6})
    return rec


def paged_case(shape, batch, lengths_kind, dtype, iters, baseline_lib):
    import torch

    from mqa_byoc.testing import decode_kernel as dk

    h, hk, d = SHAPES[shape]
    page = 256 if d <= 64 else 128  # the pages paged_attention.py gives ours
    lengths = mixed_lengths(batch) if lengths_kind == "mixed" else [MAX_LEN] * batch
    inputs = PagedInputs(torch, lengths, hk, d, dtype, (page,), seed=batch + 7 * h)
    paged = inputs.paged[page]
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, h, d, generator=gen, device="cuda").to(dtype)
    out = torch.empty_like(q)
    ref = torch.empty(batch, h, d, device="cuda")
    g = h // hk
    for b, n in enumerate(lengths):  # fp32 attention of each sequence
        lo = inputs.kv_indptr[b]
        kb = inputs.k[lo:lo + n].float().repeat_interleave(g, dim=1)
        vb = inputs.v[lo:lo + n].float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) / math.sqrt(d)
        ref[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
        del kb, vb, s
    pages = paged["pages"]
    st = (pages.stride(0), pages.stride(3), pages.stride(2))  # (page, row in page, head)

    def make(t, lib=None):
        return dk.Decode(q, pages[:, 0], pages[:, 1], out, None, k_stride=st, v_stride=st, seqlen_k=0,
                         num_heads_k=hk, pages=(paged["indptr"], paged["values"], paged["last"], page), row_tiles=t,
                         lib=lib)
    make.options = tile_options(h, hk, d)
    rec = time_variants(make, out, ref, baseline_lib, iters)
    rec.update({"layout": f"pages of {page}", "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                "batch": batch, "lengths_kind": lengths_kind,
                "bytes_us": 2 * sum(lengths) * hk * d * q.element_size() / hbm_bytes_per_s() * 1e6})
    return rec


def split_sweep(shape, n, dtype, iters, tiles, sizes):
    """Batch 1, contiguous: the kernel at fixed split sizes for ``tiles``, both merges (how the split rule
    fits the tiles)."""
    from mqa_byoc.testing import decode_kernel as dk

    (h, hk, d), q, k, v, out = _contiguous_inputs(shape, n, dtype)
    res = {}
    for merge in ("auto", "global"):
        call = dk.Decode(q, k, v, out, None, k_stride=k.stride()[:3], v_stride=v.stride()[:3], seqlen_k=n,
                         num_heads_k=hk, merge=merge, row_tiles=tiles)
        res.setdefault("plan_kps", call.plan.keys_per_split)
        for kps in sizes:
            if -(-n // kps) <= 128 and kps <= 2 * n:
                call.set_keys_per_split(kps)
                res.setdefault(merge, {})[kps] = kernel_us(call, iters)
    return {"shape": shape, "keys": n, "tiles": tiles, **res}


def capacities(lib_dk) -> dict:
    """mqa_byoc_decode_cluster_capacity per (head dim, row tiles, pages) on this GPU (fp16)."""
    import torch

    from mqa_byoc.testing import decode_kernel as dk

    res = {}
    for d, heads, tiles in ((64, 71, 1), (64, 71, 2), (64, 71, 3), (128, 64, 1)):
        for paged in (False, True):
            a = dk.DecodeArgs()
            a.num_heads, a.num_heads_k, a.head_dim, a.batch = heads, 1 if heads == 71 else 8, d, 1
            if paged:
                a.page_values = 1
            cap = (ctypes.c_int * 16)()
            rc = lib_dk.mqa_byoc_decode_cluster_capacity(ctypes.byref(a), tiles, torch.cuda.current_device(), cap)
            res[f"d{d}_tiles{tiles}_{'paged' if paged else 'contiguous'}"] = list(cap) if rc == 0 else rc
    return res


def markdown(header, rows, sweeps, recorded) -> str:
    """The run as tables: per case the baseline, each row-tiles option, ratios to the baseline, the bytes
    limit and FlashInfer's recorded time; then the split sweeps."""
    lines = [f"# Decode kernel by M tiles a warp, {header['gpu']} ({header['date']})", "",
             f"`{header['command']}`; GPU kernel time per call (CUPTI, µs), every output checked against fp32. "
             "`before`: the baseline build (one 16-row M tile a warp, CTAs of 16 query rows of a K/V head); "
             "`N tiles`: the kernel with N tiles a warp (CTAs of 16 N query rows), each with make_plan's split "
             "rule for its CTAs; `now`: the plan's default, one tile. Bytes limit: the K and V bytes read once "
             f"at {hbm_bytes_per_s(header) / 1e12:g} TB/s. FlashInfer: its fastest decode variant as recorded on 2026-12-01 "
             "(`2026-12-01-paged-attention-flashinfer`: the same shapes, lengths and pages; not run here).", "",
             "| layout | shape | dtype | batch | lengths | before | 1 tile (now) | 2 tiles | 3 tiles | now / before | "
             "fastest of 2, 3 tiles / before | now / bytes | FlashInfer (recorded) | now / FlashInfer | "
             "row groups x splits: before; 3 tiles |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        u, plans = r["us"], r["plans"]
        now, before = u["tiles1"], u.get("before")
        more = [u[k] for k in ("tiles2", "tiles3") if k in u]
        fi = recorded.get((r["shape"], r["dtype"], r["batch"], r["lengths_kind"])) if "pages" in r["layout"] else None
        grid = "; ".join(f"{p['row_groups']} x {p['splits']}" for p in (plans.get("before"), plans.get("tiles3")) if p)
        cells = [r["layout"], r["shape"], r["dtype"], str(r["batch"]), r["lengths_kind"],
                 f"{before:.1f}" if before else "–", f"{now:.1f}",
                 *(f"{u[k]:.1f}" if k in u else "–" for k in ("tiles2", "tiles3")),
                 f"{now / before:.2f}" if before else "–", f"{min(more) / before:.2f}" if more and before else "–",
                 f"{now / r['bytes_us']:.2f}", f"{fi:.1f}" if fi else "–", f"{now / fi:.2f}" if fi else "–", grid]
        lines.append("| " + " | ".join(cells) + " |")
    extra = sorted({k for r in rows for k in r["us"]} - {"before", "after", "tiles1", "tiles2", "tiles3"})
    if extra:
        lines += ["", "## Other builds", "", "The plan of the run's rule (3 tiles where a shape has them) on other "
                  "builds of the source, µs (3 tiles on this build in brackets):", ""]
        for name in extra:
            pairs = [f"{r['shape']} b{r['batch']} {r['lengths_kind']}: {r['us'][name]:.1f} ({r['us']['tiles3']:.1f})"
                     for r in rows if name in r["us"] and "tiles3" in r["us"]]
            lines.append(f"- `{name}`: " + "; ".join(pairs))
    if sweeps:
        sizes = list(sweeps[0]["auto"])
        lines += ["", "## Split sizes (batch 1, contiguous)", "",
                  "µs at fixed keys per split; `auto`: merged in a cluster where the splits fit one, else through "
                  "the workspace; `global`: through the workspace. `plan`: make_plan's split size.", "",
                  "| shape | keys | tiles | plan | " + " | ".join(f"{k}: auto / global" for k in sizes) + " |",
                  "|---|---:|---:|---:|" + "---:|" * len(sizes)]
        for sw in sweeps:
            cells = [f"{sw['auto'][k]:.1f} / {sw['global'][k]:.1f}" if k in sw["auto"] else "–" for k in sizes]
            lines.append(f"| {sw['shape']} | {sw['keys']} | {sw['tiles']} | {sw['plan_kps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recorded_flashinfer(path: Path) -> dict:
    """(shape, dtype, batch, lengths kind) -> FlashInfer's fastest decode µs in a paged_attention.py run."""
    if not path.is_file():
        return {}
    res = {}
    for c in json.loads(path.read_text())["cases"]:
        if c["kind"] == "decode":
            fi = [v for k, v in c["us"].items() if k.startswith("flashinfer") and c["ok"].get(k)]
            if fi:
                res[(c["shape"], c["dtype"], c["batch"], c["lengths_kind"])] = min(fi)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--baseline-lib", help="the baseline kernel, built as testing/decode_kernel.library builds")
    ap.add_argument("--extra-lib", nargs="*", default=[], metavar="NAME=PATH",
                    help="other builds of the current source, timed with the plan's rule where it has row tiles")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float16"])
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--sweep", nargs="*", default=[], help="SHAPE:TILES pairs for a split-size sweep")
    ap.add_argument("--markdown-from", type=Path, help="only write OUT.md from this run's JSON")
    ap.add_argument("--recorded", type=Path,
                    default=Path(__file__).parent / "results" / "2026-12-01-paged-attention-flashinfer.json")
    args = ap.parse_args(argv)
    if args.markdown_from:
        run = json.loads(args.markdown_from.read_text())
        Path(args.out).with_suffix(".md").write_text(
            markdown(run, run["cases"], run["split_sweeps"], recorded_flashinfer(args.recorded)))
        return 0
    import torch

    from mqa_byoc.testing import decode_kernel as dk
    from mqa_byoc.testing.header import run_header

    base = ctypes.CDLL(args.baseline_lib) if args.baseline_lib else None
    for item in args.extra_lib:
        name, path = item.split("=", 1)
        EXTRA_LIBS[name] = dk.load_library(path)
    header = run_header(cluster_capacity=capacities(dk.library()))
    rows, sweeps = [], []

    def write():  # after every case: a run cut short keeps what it measured
        if args.out:
            Path(args.out).with_suffix(".json").write_text(
                json.dumps({**header, "cases": rows, "split_sweeps": sweeps}, indent=1) + "\n")

    for shape in args.shapes:
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            for n in args.lengths:
                rows.append(contiguous_case(shape, n, dtype, args.iters, base))
                print(rows[-1]["shape"], dt, n, rows[-1]["us"], flush=True)
                write()
            for batch in args.batches:
                for kind in ("mixed", "uniform16k"):
                    if batch == 1 and kind == "uniform16k":
                        continue  # batch 1 is one 16k sequence in both
                    rows.append(paged_case(shape, batch, kind, dtype, args.iters, base))
                    print(rows[-1]["shape"], dt, batch, kind, rows[-1]["us"], flush=True)
                    write()
                    torch.cuda.empty_cache()
    for item in args.sweep:
        shape, tiles = item.split(":")
        for n in (4096, 16384, 32768):
            sweeps.append(split_sweep(shape, n, torch.float16, args.iters, int(tiles),
                                      (128, 256, 512, 1024, 2048, 4096)))
            print("sweep", sweeps[-1], flush=True)
            write()
    if args.out:
        Path(args.out).with_suffix(".md").write_text(markdown(header, rows, sweeps, recorded_flashinfer(args.recorded)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
