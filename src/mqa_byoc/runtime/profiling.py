"""``mqa-byoc profile run``: run exported decoder libraries (prefill + N decode steps) on the GPU and
summarize their kernels in the layout of nsys's ``cuda_gpu_kern_sum`` (CUPTI through
``torch.profiler``), with per-step timings; writes a JSON record that
:mod:`mqa_byoc.runtime.kernel_plot` draws.

Run time only: ``tvm.runtime`` and torch, never ``tvm.relax`` or ``mqa_byoc.compiler`` (the GPU
machine has a runtime-only TVM). The libraries and their sidecars come from ``mqa-byoc profile build``.

Per library:

1. warm-up: prefill + a few decode steps (loads the CUDA modules, fills allocator pools);
2. timed: prefill + N decode steps, wall time per step (host clock, device synchronized after each
   step), no profiler attached;
3. profiled: the same again under ``torch.profiler`` (CUDA activity only), one session for the
   prefill and one for the decode steps, so each phase gets its own kernel table (skipped with
   ``--no-cupti``, for runs under nsys, which needs CUPTI for itself).

NVTX ranges: ``prefill[L]`` and ``decode[i]`` around the model steps (:class:`DecoderRunner`), and,
with ``MQA_BYOC_NVTX=1`` (set by this command unless ``--no-nvtx``), ``flash_attn[h=..,kv=..,d=..]``
around each offloaded attention (both providers), so ``nsys profile`` of this command shows the same
structure where nsys works.

A directory of ``profile build --kv-cache paged`` holds the PagedKVCache pair instead (sidecar
``kv_cache="paged"``): FA2 through ``UseFlashAttentionForPagedKVCache`` as ``mqa=True``, TVM's TIR
kernels as ``mqa=False``, run by :class:`~mqa_byoc.runtime.paged_driver.PagedDecoderRunner` through
the same phases, tables and comparison (its steps include the cache's ``begin_forward`` /
``end_forward``; the JSON keys of the modes stay ``mqa`` / ``repeat``). Its FA2 entries open
``flash_attn_paged[...]`` / ``flash_attn_ragged[...]`` ranges (decode on our kernel: ``flash_attn[...]``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics

from ..sidecar import read_sidecar
from ..testing.cupti import capture_kernels
from ..testing.header import run_header
from ..testing.setup import import_setup
from .gemm_rates import format_gemm_table, gemm_table
from .gpu_limits import GpuLimits, record_limits, this_gpu_limits
from .paged_driver import PagedDecoderRunner
from .providers import NVTX_ENV_VAR, nvtx_requested  # also registers the Python FA2 provider
from .runner import DecoderRunner, format_summary, is_memory_op, stat_row

MODE_LABELS = {"mqa": "mqa=True", "repeat": "mqa=False"}
PAGED_ATTENTION_LABELS = {"fa2": "FA2 (UseFlashAttentionForPagedKVCache)", "tir": "TVM's TIR kernels"}
#: a paged library of the hopper provider: its ragged prefill runs FA4, the other entries as the native's
HOPPER_PAGED_LABEL = "FA4 for the ragged prefill, FA2 for the rest (UseFlashAttentionForPagedKVCache, hopper provider)"


def _paged_kernels(rec: dict) -> tuple[str, str]:
    """The kernel families a paged ``mqa=True`` library's entries run on, and the verb they take."""
    return ("FA4 and FA2", "serve") if rec.get("provider") == "hopper" else ("FA2", "serves")


class ProfileError(RuntimeError):
    """A profile run cannot start (reported as a one-line error by the CLI)."""


class NoGpu(ProfileError):
    """No CUDA device (or a torch without CUDA) here."""


def find_libraries(directory: str, kv_cache: str | None = None) -> list[str]:
    """Exported libraries in ``directory`` that have a sidecar, ``mqa=True`` first.

    ``kv_cache``: only the libraries of that cache (the sidecar's ``kv_cache``: inplace, functional,
    paged). Without it the directory must hold one cache's libraries: a run compares the two modes of
    one cache, and a mixed directory (``profile build --kv-cache paged`` into a directory of the
    in-place pair) raises :class:`ProfileError` naming the caches.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory (build it with `mqa-byoc profile build --out DIR`)")
    libs = []
    for f in sorted(os.listdir(directory)):
        path = os.path.join(directory, f)
        if f.endswith(".so") and os.path.isfile(path + ".json"):
            with open(path + ".json") as fh:
                meta = json.load(fh)
            libs.append((0 if meta.get("mqa") else 1, f, path, cache_of(meta)))
    if not libs:
        raise FileNotFoundError(f"no libraries with sidecars (<lib>.so + <lib>.so.json) in {directory}")
    caches = sorted({c for *_, c in libs})
    if kv_cache is not None:
        libs = [lib for lib in libs if lib[3] == kv_cache]
        if not libs:
            raise FileNotFoundError(f"no {kv_cache}-cache libraries in {directory} (it has: {', '.join(caches)})")
    elif len(caches) > 1:
        raise ProfileError(f"{directory} holds libraries of several KV caches ({', '.join(caches)}); choose one "
                           "with --kv-cache")
    return [p for _, _, p, _ in sorted(libs)]


def cache_of(meta: dict) -> str:
    """The KV cache of a library's sidecar (``functional`` for sidecars older than the field)."""
    return meta.get("kv_cache", "functional")


def open_runner(lib_path: str, meta: dict):
    """The runner of a library: :class:`PagedDecoderRunner` for the paged cache, else :class:`DecoderRunner`."""
    return PagedDecoderRunner(lib_path) if cache_of(meta) == "paged" else DecoderRunner(lib_path)


def mode_of(meta: dict, lib_path: str) -> str:
    """``mqa`` / ``repeat`` from the sidecar, else the library's file name."""
    if "mqa" in meta:
        return "mqa" if meta["mqa"] else "repeat"
    return os.path.basename(lib_path)


def phase_record(stats, wall_s: list[float], steps: int, events=None) -> dict:
    """Kernel rows (ns, nsys columns), memory operations and wall times of one phase; with ``events``
    (the capture's ``(name, µs)`` in launch order) also ``launches``: ``[kernel row index, ns]`` per
    kernel launch, in order (what maps each GEMM kernel onto its GEMM, :mod:`.gemm_rates`)."""
    kernels = sorted((stat_row(s) for s in stats if not is_memory_op(s.name)), key=lambda r: -r["total_ns"])
    memory = sorted((stat_row(s) for s in stats if is_memory_op(s.name)), key=lambda r: -r["total_ns"])
    kernel_ns = sum(r["total_ns"] for r in kernels)
    index = {r["name"]: i for i, r in enumerate(kernels)}
    launches = [[index[n], round(t * 1e3)] for n, t in (events or ()) if n in index and t > 0]
    return {
        "steps": steps,
        "wall_ms": [round(t * 1e3, 4) for t in wall_s],
        "wall_ms_median": round(statistics.median(wall_s) * 1e3, 4) if wall_s else None,
        "kernel_ms_per_step": round(kernel_ns / 1e6 / max(steps, 1), 4),
        "kernels": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in kernels],
        "memory_ops": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in memory],
        **({"launches": launches} if launches else {}),
    }


def _profiled_phases(runner: DecoderRunner, prompt_len: int, steps: int, nvtx: bool):
    """Prefill and ``steps`` decode steps, each phase under its own CUPTI capture."""
    torch = runner.torch
    rng = torch.cuda.nvtx.range if nvtx else (lambda _name: contextlib.nullcontext())
    prompt = runner.make_ids(1, prompt_len)
    tokens = [runner.make_ids(1, 1) for _ in range(steps)]
    caches = runner.new_caches(prompt_len + steps)  # in-place caches: made outside the profile
    torch.cuda.synchronize()
    with capture_kernels() as prefill:
        with rng(f"prefill[{prompt_len}]"):
            _, caches = runner.prefill(1, prompt_len, ids=prompt, caches=caches)
    with capture_kernels() as decode:
        for i in range(steps):
            with rng(f"decode[{i}]"):
                _, caches = runner.decode(caches, ids=tokens[i])
    return prefill, decode


def profile_library(lib_path: str, prompt_len: int, steps: int, *, warmup: int = 2, nvtx: bool = True,
                    cupti: bool = True, limits: GpuLimits | None = None) -> dict:
    """Warm up, time and profile one library; the JSON record of it. ``cupti=False`` skips the
    profiled run (for running under nsys, which wants CUPTI to itself); ``limits``: the GPU's, which the
    GEMM tables measure against (default: :func:`~.gpu_limits.this_gpu_limits`)."""
    sidecar = read_sidecar(lib_path)
    functions = sidecar.get("functions", ["prefill", "decode"])
    if not {"prefill", "decode"} <= set(functions):
        raise ProfileError(f"{lib_path} has only {functions}; `mqa-byoc profile build` makes prefill + decode")
    runner = open_runner(lib_path, sidecar)
    meta = runner.meta
    runner.run(prompt_len, warmup, nvtx=nvtx)
    times, _ = runner.run(prompt_len, steps, nvtx=nvtx)
    loop_ms = runner.decode_loop_ms(prompt_len, steps) if steps else None
    prefill, decode = _profiled_phases(runner, prompt_len, steps, nvtx) if cupti else (None, None)
    del runner
    gc.collect()
    keys = ("preset", "mqa", "provider", "kv_expand", "kv_cache", "dtype", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "hidden_size", "intermediate_size", "vocab_size", "logits", "arch", "offloaded",
            "paged_attention", "page_size", "paged_served", "fused_projections", "gemm")
    rec = {"library": os.path.basename(lib_path), "mode": mode_of(meta, lib_path),
           **{k: meta[k] for k in keys if k in meta},
           "limits": (limits or this_gpu_limits()).as_dict(),
           "phases": {"prefill": phase_record(prefill.stats() if prefill else [], times["prefill"], 1,
                                              prefill.events if prefill else None),
                      "decode": phase_record(decode.stats() if decode else [], times["decode"], steps,
                                             decode.events if decode else None)}}
    add_gemm_tables(rec, prompt_len)
    med = rec["phases"]["decode"]["wall_ms_median"]
    rec["decode_tokens_per_s"] = round(1000 / med, 1) if med else None
    if loop_ms:  # back to back, CUDA events: what a serving loop gets (no host sync per step)
        rec["decode_loop_ms_per_token"] = round(loop_ms, 4)
        rec["decode_loop_tokens_per_s"] = round(1000 / loop_ms, 1)
    return rec


def add_gemm_tables(rec: dict, prompt_len: int, batch: int = 1) -> dict:
    """Each phase's GEMM table (:func:`~mqa_byoc.runtime.gemm_rates.gemm_table`) as its ``gemms``, where
    the record has kernels and the model's shapes."""
    for ph in ("prefill", "decode"):
        try:
            table = gemm_table(rec, ph, prompt_len, batch)
        except ValueError:  # a record without the model's shapes
            table = None
        if table:
            rec["phases"][ph]["gemms"] = table
    return rec


def _describe(rec: dict) -> str:
    words = [MODE_LABELS.get(rec["mode"], rec["mode"])]
    if "provider" in rec:
        words.append(f"{rec['provider']} provider")
    if "num_layers" in rec:
        words.append(f"{rec['num_layers']} layers")
    if "num_kv_heads" in rec:
        words.append(f"H={rec.get('num_heads', '?')} H_kv={rec['num_kv_heads']} D={rec.get('head_dim', '?')}")
    if "dtype" in rec:
        words.append(rec["dtype"])
    if rec.get("kv_cache") == "paged":
        label = PAGED_ATTENTION_LABELS.get(rec.get("paged_attention"), "?")
        if rec.get("paged_attention") == "fa2" and rec.get("provider") == "hopper":
            label = HOPPER_PAGED_LABEL
        words.append(f"paged KV cache (page size {rec.get('page_size', '?')}), attention on {label}")
    elif "kv_cache" in rec:
        words.append(f"{rec['kv_cache']} KV cache")
    if rec.get("offloaded"):
        words.append("offloaded " + ", ".join(f"{n} x {c}" for c, n in rec["offloaded"].items()))
    if rec.get("paged_served"):
        kernels, verb = _paged_kernels(rec)
        words.append(f"{kernels} {verb} " + ", ".join(rec["paged_served"]))
    return ", ".join(words)


def format_record(rec: dict, prompt_len: int) -> str:
    """The text printed for one library: per phase the timings and the kernel table."""
    out = [f"== {rec['library']}: {_describe(rec)} =="]
    p, d = rec["phases"]["prefill"], rec["phases"]["decode"]
    out.append(f"prefill, {prompt_len} tokens: {p['wall_ms'][0]:.3f} ms wall; GPU kernels {p['kernel_ms_per_step']:.3f} ms")

    def table(rows):
        return format_summary(rows) if rows else "(no kernels recorded: run without --no-cupti)"

    out.append(table(p["kernels"]))
    if p.get("gemms"):
        out.append(format_gemm_table(p["gemms"]))
    if d["wall_ms"]:
        out.append("")
        out.append(f"decode, {d['steps']} steps at context {prompt_len + 1}..{prompt_len + d['steps']}: "
                   f"median {d['wall_ms_median']:.3f} ms/token wall ({rec['decode_tokens_per_s']} tokens/s), "
                   f"min {min(d['wall_ms']):.3f}, max {max(d['wall_ms']):.3f}; "
                   f"GPU kernels {d['kernel_ms_per_step']:.3f} ms/step")
        out.append("per-step wall ms: " + " ".join(f"{t:.3f}" for t in d["wall_ms"]))
        if rec.get("decode_loop_tokens_per_s"):
            out.append(f"decode back to back (CUDA events, no sync per step): {rec['decode_loop_ms_per_token']:.3f} "
                       f"ms/token, {rec['decode_loop_tokens_per_s']} tokens/s")
        out.append(table(d["kernels"]))
        if d.get("gemms"):
            out.append(format_gemm_table(d["gemms"]))
    for name, ph in (("prefill", p), ("decode", d)):
        if ph["memory_ops"]:
            out.append(f"{name} memory operations (not kernels): "
                       + "; ".join(f"{r['name']} x{r['instances']} {r['total_ns'] / 1e3:.1f} us" for r in ph["memory_ops"]))
    return "\n".join(out)


def compare(modes: dict) -> dict:
    """``mqa`` vs ``repeat``: speedups and the kernels only one of them runs (per decode step)."""
    if not ("mqa" in modes and "repeat" in modes):
        return {}
    a, b = modes["mqa"]["phases"], modes["repeat"]["phases"]
    out = {}
    ta, tb = modes["mqa"].get("decode_loop_tokens_per_s"), modes["repeat"].get("decode_loop_tokens_per_s")
    if ta and tb:
        out["decode_loop_tokens_per_s_ratio"] = round(ta / tb, 3)
    for ph in ("prefill", "decode"):
        ta, tb = a[ph]["wall_ms_median"], b[ph]["wall_ms_median"]
        if ta and tb:
            out[f"{ph}_speedup"] = round(tb / ta, 3)
        ka, kb = a[ph]["kernel_ms_per_step"], b[ph]["kernel_ms_per_step"]
        if ka and kb:
            out[f"{ph}_kernel_time_ratio"] = round(kb / ka, 3)
        na = {r["name"]: r["total_ns"] / max(a[ph]["steps"], 1) for r in a[ph]["kernels"]}
        nb = {r["name"]: r["total_ns"] / max(b[ph]["steps"], 1) for r in b[ph]["kernels"]}
        out[f"{ph}_only_repeat"] = {n: round(t / 1e3, 1) for n, t in sorted(nb.items(), key=lambda x: -x[1]) if n not in na}
        out[f"{ph}_only_mqa"] = {n: round(t / 1e3, 1) for n, t in sorted(na.items(), key=lambda x: -x[1]) if n not in nb}
    return out


def format_comparison(cmp: dict, modes: dict) -> str:
    if not cmp:
        return ""
    lines = ["== mqa=True vs mqa=False =="]
    if any(m.get("kv_cache") == "paged" for m in modes.values()):
        lines[0] = (f"== mqa=True vs mqa=False (paged KV cache: attention on {_paged_kernels(modes.get('mqa', {}))[0]} "
                    "vs on TVM's TIR kernels) ==")
    if "decode_loop_tokens_per_s_ratio" in cmp:
        lines.append(f"decode tokens/s (back to back): {modes['mqa']['decode_loop_tokens_per_s']} with mqa=True vs "
                     f"{modes['repeat']['decode_loop_tokens_per_s']} with mqa=False "
                     f"({cmp['decode_loop_tokens_per_s_ratio']:.2f}x)")
    for ph in ("prefill", "decode"):
        if f"{ph}_speedup" in cmp:
            a = modes["mqa"]["phases"][ph]["wall_ms_median"]
            b = modes["repeat"]["phases"][ph]["wall_ms_median"]
            lines.append(f"{ph}: {a:.3f} vs {b:.3f} ms/step wall ({cmp[ph + '_speedup']:.2f}x); GPU kernel time "
                         f"{cmp.get(ph + '_kernel_time_ratio', float('nan')):.2f}x")
        for side, label in (("only_repeat", "mqa=False"), ("only_mqa", "mqa=True")):
            only = cmp.get(f"{ph}_{side}") or {}
            if only:
                total = modes["repeat" if side == "only_repeat" else "mqa"]["phases"][ph]["kernel_ms_per_step"] * 1e3
                top = list(only.items())[:5]
                lines.append(f"  {ph} kernels only with {label}: "
                             + "; ".join(f"{n[:60]} {t:.1f} us/step ({100 * t / total:.1f}%)" for n, t in top))
    return "\n".join(lines)


def gemm_report(data: dict, limits: GpuLimits | None = None) -> str:
    """The GEMM tables of every library and phase of a ``profile run`` JSON (``mqa-byoc profile gemms``),
    computed from its kernels against ``limits`` (default: those the record names, else those of the GPU
    the run names, :func:`~.gpu_limits.record_limits`); a record's stored table where it has no shapes."""
    out = []
    for key, rec in data.get("modes", {}).items():
        out.append(f"== {rec.get('library', key)}: {_describe(rec)} ==")
        lim = limits or record_limits(rec if "limits" in rec else data)
        for ph in ("prefill", "decode"):
            table = rec["phases"][ph].get("gemms")
            if rec["phases"][ph].get("kernels"):
                try:
                    table = gemm_table(rec, ph, data["prompt_len"], limits=lim) or table
                except ValueError as e:
                    if table is None:
                        out.append(f"{ph}: {e}")
                        continue
            out.append(format_gemm_table(table) if rec["phases"][ph].get("kernels") else f"{ph}: no kernels recorded")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_png(data: dict, json_path: str, png_path: str, *, top: int = 15, printer=print) -> bool:
    """Draw the chart; without matplotlib say how to draw it elsewhere instead of failing the run."""
    from .kernel_plot import MatplotlibMissing, plot_profile

    try:
        plot_profile(data, png_path, top=top)
    except MatplotlibMissing as e:
        printer(f"no PNG: {e}. The JSON has everything; draw it where matplotlib is installed: "
                f"mqa-byoc profile plot {json_path} --png {os.path.basename(png_path)}")
        return False
    except ValueError as e:  # nothing to draw (--no-cupti)
        printer(f"no PNG: {e}")
        return False
    printer(f"wrote {png_path}")
    return True


def run_profile(directory: str, prompt_len: int, steps: int, *, warmup: int = 2, nvtx: bool = True,
                cupti: bool = True, json_path: str | None = None, png_path: str | None = None, top: int = 15,
                command: str | None = None, setup=None, kv_cache: str | None = None, limits: GpuLimits | None = None,
                printer=print) -> dict:
    """Profile every library in ``directory`` (those of ``kv_cache`` only, when given: see
    :func:`find_libraries`); print the tables, write the JSON (and PNG).

    ``setup``: modules to import first (a runtime-only TVM's set-up; default ``$MQA_BYOC_RUNTIME_SETUP``);
    ``limits``: what the GEMM tables measure against (default: this GPU's, :func:`~.gpu_limits.this_gpu_limits`).
    """
    import_setup(setup)
    import torch

    if not torch.cuda.is_available():
        raise NoGpu(f"no CUDA GPU here (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                    "run `mqa-byoc profile run` on the GPU machine")
    libs = find_libraries(directory, kv_cache)
    limits = limits or this_gpu_limits(torch)
    if nvtx:
        os.environ.setdefault(NVTX_ENV_VAR, "1")  # before the first offloaded call reads it
    cache = cache_of(read_sidecar(libs[0]))  # one cache per run (find_libraries)
    data = {**run_header(command), "kv_cache": cache, "prompt_len": prompt_len, "decode_steps": steps,
            "warmup_steps": warmup, "nvtx_steps": bool(nvtx), "limits": limits.as_dict(),
            "nvtx_flash_attn": nvtx_requested(), "cupti": bool(cupti), "modes": {}}
    json_path = json_path or os.path.join(directory, "profile.json")
    for lib in libs:
        rec = profile_library(lib, prompt_len, steps, warmup=warmup, nvtx=nvtx, cupti=cupti, limits=limits)
        data["modes"][rec["mode"] if rec["mode"] not in data["modes"] else rec["library"]] = rec
        printer(format_record(rec, prompt_len))
        printer("")
        torch.cuda.empty_cache()
        data["comparison"] = compare(data["modes"])
        with open(json_path, "w") as f:  # after each library: a later failure keeps what was measured
            json.dump(data, f, indent=1)
    text = format_comparison(data["comparison"], data["modes"])
    if text:
        printer(text)
    printer(f"wrote {json_path}")
    if png_path:
        write_png(data, json_path, png_path, top=top, printer=printer)
    return data
