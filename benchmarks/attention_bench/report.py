"""``report``: markdown tables and plots from a run's JSON (here; plots need matplotlib)."""

from __future__ import annotations

import datetime
import json
import os
import re

from .suites import DT_SHORT, HBM_PEAK_TB_S, REL_TOL, VARIANT_DOC, VARIANT_ORDER, seq_label

def _variant_key(v):
    return (VARIANT_ORDER.index(v) if v in VARIANT_ORDER else len(VARIANT_ORDER), v)

def _fmt_us(us):
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"

def _fmt_tflops(t):
    return f"{t:.0f}" if t >= 10 else f"{t:.2g}"

def format_cell(rec):
    """'µs (ratio vs FA2, TFLOP/s or % of HBM peak)' with a mark when the numerics are off."""
    if rec is None:
        return "–"
    if rec.get("error"):
        return "error"
    us = rec.get("us")
    if us is None:
        return "–"
    parts = []
    ratio = rec.get("ratio_vs_fa2_direct")
    if rec.get("variant") != "fa2-direct" and ratio is not None:
        parts.append(f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:,.0f}x")
    hbm = rec.get("hbm_fraction")
    if hbm is None and rec.get("hbm_tb_s") is not None:  # records of older runs
        hbm = rec["hbm_tb_s"] / HBM_PEAK_TB_S
    if hbm is not None:
        frac = 100 * hbm
        parts.append(f"{frac:.0f}% HBM" if frac >= 1 else f"{frac:.1g}% HBM")
    elif rec.get("tflops") is not None:
        parts.append(f"{_fmt_tflops(rec['tflops'])} TF/s")
    cell = _fmt_us(us) + (f" ({', '.join(parts)})" if parts else "")
    if rec.get("numerics_ok") is False:
        cell += " ✗"
    return cell

def _case_order(rec, shape_order):
    return (shape_order.get(rec.get("shape"), 99), ["float16", "bfloat16"].index(rec["dtype"])
            if rec.get("dtype") in ("float16", "bfloat16") else 9, rec.get("seq_kv", 0))

def _cell_legend(mode):
    if mode == "prefill":
        return ["ratio to FA2 direct", "attention TFLOP/s (cuBLAS column: the GEMM's own TFLOP/s)"]
    return ["ratio to FA2 direct", "K/V bytes per µs as % of the HBM peak"]

KERNEL_VARIANTS = ("mqa-hopper", "mqa-native", "torch-sdpa-gqa", "fa2-direct", "mqa-native-fa2-combine",
                   "mqa-hopper-fa4-decode")


def kernel_time_section(recs):
    """With ``run --kernel-time``: GPU kernel µs per call (CUPTI) of our providers vs cuDNN (SDPA), the
    speedup over SDPA, and for decode the ratio to the HBM limit; fp32-reference numerics."""
    by_case = {}
    for r in recs:
        if r.get("kernel_us") is not None:
            by_case.setdefault(r["case"], {})[r["variant"]] = r
    if not by_case:
        return []
    cols = [v for v in KERNEL_VARIANTS if any(v in c for c in by_case.values())]
    lines = ["## GPU kernel time per call (CUPTI)", "",
             "µs of every kernel one call launches, summed; `x SDPA`: SDPA's kernel time / ours (> 1: ours is "
             "faster); decode: our kernel time / the HBM limit (K/V bytes at 4.8 TB/s); `fp32`: max |Δ| / max |ref| "
             "against an fp32 reference (worst variant).", "",
             "| case | " + " | ".join(f"`{v}`" for v in cols) + " | hopper x SDPA | native x SDPA | HBM limit x | fp32 |",
             "|---|" + "---:|" * (len(cols) + 4)]
    for case, vs in by_case.items():
        sdpa = vs.get("torch-sdpa-gqa", {}).get("kernel_us")

        def ratio(v):
            k = vs.get(v, {}).get("kernel_us")
            return f"{sdpa / k:.2f}" if (k and sdpa) else "–"

        hbm = vs.get("mqa-hopper", vs.get("mqa-native", {})).get("kernel_hbm_limit_ratio")
        errs = [r.get("rel_err_vs_fp32") for r in vs.values() if r.get("rel_err_vs_fp32") is not None]
        lines.append(f"| {case} | " + " | ".join(_fmt_us(vs[v]["kernel_us"]) if v in vs else "–" for v in cols)
                     + f" | {ratio('mqa-hopper')} | {ratio('mqa-native')} | {hbm if hbm is not None else '–'} | "
                     + (f"{max(errs):.1e}" if errs else "–") + " |")
    return lines + [""]


CLOCK_VARIANTS = ("mqa-hopper", "torch-sdpa-gqa", "mqa-native", "fa2-direct")


def clock_section(recs, max_mhz=1980):
    """The SM clock (NVML, mean over the timed loop) beside the TFLOP/s of each long call: under the power
    limit the clock drops, and TFLOP/s of two runs compare only at the same clock."""
    by_case = {}
    for r in recs:
        if r.get("sm_clock_mhz") and r.get("tflops") is not None and r.get("variant") in CLOCK_VARIANTS:
            by_case.setdefault(r["case"], {})[r["variant"]] = r
    if not by_case:
        return []
    cols = [v for v in CLOCK_VARIANTS if any(v in c for c in by_case.values())]
    lines = ["## SM clock during the timed loops", "",
             f"TFLOP/s at the mean SM clock NVML read while the loop ran (MHz; the H200's boost clock is {max_mhz:,}), "
             "and the clock during the CUPTI kernel timing where sampled; `limits`: the clock-limit reasons NVML "
             "reported in any sample (`sw_power_cap`: the board's power limit).", "",
             "| case | " + " | ".join(f"`{v}`" for v in cols) + " | limits |", "|---|" + "---:|" * len(cols) + "---|"]
    for case, vs in by_case.items():
        cells = [(f"{_fmt_tflops(vs[v]['tflops'])} TF/s at {vs[v]['sm_clock_mhz']:,} MHz"
                  + (f"; CUPTI at {vs[v]['kernel_sm_clock_mhz']:,}" if vs[v].get("kernel_sm_clock_mhz") else ""))
                 if v in vs else "–" for v in cols]
        limits = sorted({x for r in vs.values() for x in (r.get("clock_limits") or [])})
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {', '.join(limits) or 'none'} |")
    return lines + [""]


def render_markdown(data, plots=()):
    """Markdown report of one run's JSON (``run``'s output)."""
    recs = [r for r in data["records"] if r.get("benchmark", "attention") == "attention"]
    shape_order = {}
    for r in recs:
        shape_order.setdefault(r.get("shape"), len(shape_order))
    peak = data.get("hbm_peak_tb_s", HBM_PEAK_TB_S)
    lines = [f"# Attention microbenchmarks — suite `{data.get('suite')}`", ""]
    lines += [f"- GPU: {data.get('gpu')}; date (UTC): {data.get('date')}",
              f"- run: `{data.get('command')}`"]
    b = data.get("build") or {}
    if b.get("build_command"):
        lines.append(f"- build: `{b['build_command']}` ({b.get('build_date')}, TVM {b.get('tvm')}, {b.get('arch')})")
    off = b.get("offload") or {}
    if off:
        ours = [f for f in off.values() if (f.get("variant") or "").startswith("mqa")]
        rep_ = [f for f in off.values() if (f.get("variant") or "").startswith("repeat")]
        ok = all(f.get("check") == "ok" for f in ours + rep_)
        lines.append(f"- partition (symbolic lengths, one library per dtype): {len(ours)} `mqa=True` functions, each one "
                     f"`flash_attn.attention_mqa` call with the K/V `repeat` removed; {len(rep_)} `mqa=False` "
                     f"functions keep `repeat` and call `flash_attn.attention`"
                     + ("" if ok else " — CHECK FAILED, see the JSON"))
    cpu = b.get("llm_cpu_check") or []
    if cpu:
        worst = max(x["max_abs_err"] for x in cpu)
        lines.append(f"- TVM paged-KV kernels: argument order, page table and scale checked at build time on the CPU "
                     f"(llvm `*_cpu` kernels, same signatures) against numpy: max abs err {worst:.1e}")
    for dtype, cov in (b.get("llm_decode_heads_written_per_kv_head") or {}).items():
        for shape, n in cov.items():
            m = re.match(r"h(\d+)-kv(\d+)-", shape)
            if n is not None and m and n < int(m.group(1)) // int(m.group(2)):
                lines.append(f"- {shape} {DT_SHORT.get(dtype, dtype)}: TVM's `batch_decode_paged_kv` thread layout writes "
                             f"only {n} of the {int(m.group(1)) // int(m.group(2))} query heads of each K/V head "
                             f"(`bdy` is halved until it fits 512 threads; `group // bdy` drops the remainder)")
    lines += [
        f"- torch {data.get('torch')}, CUDA {data.get('cuda')}; timing: CUDA events over back-to-back calls "
        f"(per variant about {data.get('budget_ms')} ms, at most {data.get('max_iters')} calls"
        + (f"; {data['idle_s']:g} s idle before the loop and the kernel timing of every call of 300 µs or more"
           if data.get("idle_s") else "") + ")",
        "- cell: µs (ratio to FA2 direct; prefill: TFLOP/s with FLOPs = 4·S_q·S_kv·H·D, halved for causal; "
        f"decode: K/V bytes / time as a fraction of the H200's {peak} TB/s HBM3e peak)",
        "- ✗: output differs from FA2 direct by more than the tolerance (max |Δ| / max |FA2| > "
        + ", ".join(f"{v:g} {DT_SHORT.get(k, k)}" for k, v in (data.get("rel_tol") or REL_TOL).items())
        + "); `error`: the variant failed (see the JSON); –: not run",
        "",
        "Variants:", "",
    ]
    variants_all = sorted({r["variant"] for r in recs}, key=_variant_key)
    for v in variants_all:
        lines.append(f"- `{v}`: {VARIANT_DOC.get(v, '')}")
    lines.append("")
    for mode, title in (("prefill", "Prefill (causal, S_q = S_kv)"), ("decode", "Decode (S_q = 1)")):
        mrecs = [r for r in recs if r.get("mode") == mode or (r.get("variant") == "cublas-qk-gemm" and mode == "prefill"
                                                                and r.get("mode") in (None, "prefill"))]
        if not mrecs:
            continue
        variants = sorted({r["variant"] for r in mrecs}, key=_variant_key)
        cases = {}
        for r in mrecs:
            cases.setdefault(r["case"], {})[r["variant"]] = r
        lines += [f"## {title}", ""]
        seq = "S" if mode == "prefill" else "S_kv"
        lines.append(f"µs per call ({', '.join(_cell_legend(mode))}):")
        lines.append("")
        lines.append(f"| shape (presets) | dtype | {seq} | " + " | ".join(f"`{v}`" for v in variants) + " |")
        lines.append("|---|---|---:|" + "---:|" * len(variants))
        ordered = sorted(cases.values(), key=lambda vs: _case_order(next(iter(vs.values())), shape_order))
        for vs in ordered:
            r0 = vs.get("fa2-direct") or next(iter(vs.values()))
            shape = r0.get("shape") or f"h{r0.get('num_q_heads')}-kv{r0.get('num_kv_heads')}-d{r0.get('head_dim')}"
            model = r0.get("model")
            label = seq_label(r0.get("seq_kv") or 0)
            dt = DT_SHORT.get(r0.get("dtype"), r0.get("dtype"))
            cells = " | ".join(format_cell(vs.get(v)) for v in variants)
            lines.append(f"| {shape}" + (f" ({model})" if model else "") + f" | {dt} | {label} | {cells} |")
        lines.append("")
    lines += kernel_time_section(recs)
    lines += clock_section(recs)
    notes = sorted({n for r in recs for n in (r.get("notes") or [])})
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    bad = [r for r in recs if r.get("numerics_ok") is False]
    errs = [r for r in recs if r.get("error")]
    if bad or errs:
        lines += ["## Numerics and failures", ""]
        for r in bad:
            heads = r.get("bad_heads") or []
            rel = r.get("rel_err_vs_fa2")
            lines.append(
                f"- {r['case']} `{r['variant']}`: max |Δ| {r.get('max_abs_err_vs_fa2')} (max |FA2| "
                f"{r.get('ref_max_abs') or 0:.3g}, relative {'n/a' if rel is None else format(rel, '.2g')})"
                + (f", {r.get('nonfinite_outputs')} non-finite outputs" if r.get("nonfinite_outputs") else "")
                + (f", {r.get('num_bad_heads')} query heads off (first: {heads})" if heads else ""))
        for r in errs:
            first = r["error"].splitlines()[0][:200]
            lines.append(f"- {r['case']} `{r['variant']}` failed: {first}")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] + [""]
    return "\n".join(lines)

def render_plots(data, prefix):
    """PNG per dtype: µs vs sequence length per variant, log-log, one panel per shape x mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    recs = [r for r in data["records"] if r.get("us") is not None and r.get("shape")]
    paths = []
    for dtype in [d for d in ("float16", "bfloat16") if any(r.get("dtype") == d for r in recs)]:
        drecs = [r for r in recs if r.get("dtype") == dtype]
        shapes = list(dict.fromkeys(r["shape"] for r in drecs))
        modes = [m for m in ("prefill", "decode") if any(r.get("mode") == m for r in drecs)]
        fig, axes = plt.subplots(len(shapes), len(modes), figsize=(6.2 * len(modes), 3.8 * len(shapes)), squeeze=False)
        for i, shape in enumerate(shapes):
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                rs = [r for r in drecs if r["shape"] == shape and r.get("mode") == mode]
                for variant in sorted({r["variant"] for r in rs}, key=_variant_key):
                    pts = sorted((r["seq_kv"], r["us"], r.get("numerics_ok") is not False)
                                 for r in rs if r["variant"] == variant)
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    color = f"C{_variant_key(variant)[0] % 10}"
                    style = "--" if variant == "cublas-qk-gemm" else "-"
                    ax.plot(xs, ys, style, marker="o", ms=4, label=variant, color=color)
                    bad = [(x, y) for x, y, ok in pts if not ok]
                    if bad:
                        ax.plot([b[0] for b in bad], [b[1] for b in bad], "x", ms=11, mew=2, color=color)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ticks = sorted({r["seq_kv"] for r in rs})
                ax.set_xticks(ticks, [seq_label(t) for t in ticks])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                model = next((r.get("model") for r in rs if r.get("model")), "")
                ax.set_title(f"{shape} ({model}) {DT_SHORT[dtype]} {mode}", fontsize=9)
                ax.set_xlabel("S (prefill, causal)" if mode == "prefill" else "S_kv (decode, S_q = 1)")
                ax.set_ylabel("µs per call")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(f"attention, {data.get('gpu')}, {DT_SHORT[dtype]} (x: numerics off vs FA2)", fontsize=10)
        fig.tight_layout()
        path = f"{prefix}-{DT_SHORT[dtype]}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

def merge_runs(runs):
    """One run's JSON from several: the first one's metadata; records keyed by (case, variant), a later
    run replacing an earlier one's (e.g. a rerun of some cases or variants with ``--cases`` /
    ``--skip-variants``); the commands of all runs are kept."""
    data = dict(runs[0])
    recs = {}
    for r in runs:
        for rec in r.get("records", []):
            recs[(rec.get("case"), rec.get("variant"))] = rec
    data["records"] = list(recs.values())
    if len(runs) > 1:
        data["command"] = " ; ".join(str(r.get("command")) for r in runs)
        data["merged_runs"] = [{k: r.get(k) for k in ("command", "date", "gpu")} for r in runs]
    return data

def report(args):
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    data = merge_runs(runs)
    date = (data.get("date") or datetime.date.today().isoformat())[:10]
    name = args.name or f"{date}-attention-{data.get('suite') or 'run'}"
    os.makedirs(args.out_dir, exist_ok=True)
    prefix = os.path.join(args.out_dir, name)
    if len(args.json) > 1 or os.path.abspath(args.json[0]) != os.path.abspath(prefix + ".json"):
        with open(prefix + ".json", "w") as f:
            json.dump(data, f, indent=1)
    plots = [] if args.no_plots else render_plots(data, prefix)
    with open(prefix + ".md", "w") as f:
        f.write(render_markdown(data, plots))
    print("wrote", prefix + ".md", prefix + ".json", *plots)
