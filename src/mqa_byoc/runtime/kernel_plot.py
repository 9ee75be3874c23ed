"""The PNG of ``mqa-byoc profile``: GPU time per kernel, ``mqa=True`` vs ``mqa=False``.

Drawn from the JSON that ``mqa-byoc profile run`` writes (so it also runs on a machine without a GPU:
``mqa-byoc profile plot profile.json --png profile.png``). One panel per phase (prefill, decode); each
a horizontal bar chart of the top kernels by time per step, one bar per mode. Needs matplotlib,
nothing else (no TVM, no torch).
"""

from __future__ import annotations

import re

MODE_STYLE = {"mqa": ("mqa=True", "#1f77b4"), "repeat": ("mqa=False", "#ff7f0e")}


class MatplotlibMissing(RuntimeError):
    """matplotlib does not import here."""


def _strip_templates(s: str) -> str:
    out, depth = [], 0
    for ch in s:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _first_template_args(s: str) -> str:
    start = s.find("<")
    if start < 0:
        return ""
    depth = 0
    for i in range(start, len(s)):
        depth += {"<": 1, ">": -1}.get(s[i], 0)
        if depth == 0:
            return s[start + 1 : i]
    return s[start + 1 :]  # cut off


def short_name(name: str, width: int = 48) -> str:
    """A readable label for a kernel name: no ``void``, namespaces, template or call arguments; the
    first integers of its template arguments are kept (``flash_fwd_splitkv_kernel<128,64,128,4>``),
    since they tell instantiations apart (FA2: head dim, block M, block N, warps)."""
    s = re.sub(r"^\s*void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    base = _strip_templates(s).split("(")[0].strip()  # drop call arguments
    base = base.split("::")[-1].strip() or s[:width]
    nums = re.findall(r"(?<![\w.#])(\d+)(?![\w.])", _first_template_args(s))[:4]
    if nums:
        base += "<" + ",".join(nums) + ">"
    return base if len(base) <= width else base[: width - 1] + "\u2026"


def series(data: dict, phase: str, top: int = 15) -> tuple[list[str], list[str], dict[str, list[float]]]:
    """``(full names, labels, {mode: µs per step})`` of the ``top`` kernels of ``phase``, ranked by
    the larger of the modes' times; the rest summed into one ``other (N kernels)`` row."""
    modes = [m for m in ("mqa", "repeat") if m in data["modes"]] + \
        [m for m in data["modes"] if m not in ("mqa", "repeat")]
    per = {}
    for m in modes:
        ph = data["modes"][m]["phases"][phase]
        steps = max(int(ph.get("steps", 1)), 1)
        per[m] = {r["name"]: r["total_ns"] / 1e3 / steps for r in ph["kernels"]}
    names = sorted({n for d in per.values() for n in d}, key=lambda n: (-max(d.get(n, 0.0) for d in per.values()), n))
    shown, rest = names[:top], names[top:]
    values = {m: [per[m].get(n, 0.0) for n in shown] for m in modes}
    labels = [short_name(n) for n in shown]
    seen = {}
    for i, lab in enumerate(labels):  # distinct instantiations that shorten alike
        seen[lab] = seen.get(lab, 0) + 1
        if seen[lab] > 1:
            labels[i] = f"{lab} #{seen[lab]}"
    if rest:
        shown = shown + ["other"]
        labels.append(f"other ({len(rest)} kernels)")
        for m in modes:
            values[m].append(sum(per[m].get(n, 0.0) for n in rest))
    return shown, labels, values


def plot_profile(data: dict, png_path: str, top: int = 15) -> str:
    """Write the comparison chart of a ``profile run`` JSON (a dict) to ``png_path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MatplotlibMissing(f"matplotlib is not installed here ({e})") from e

    phases = [p for p in ("prefill", "decode")
              if any(data["modes"][m]["phases"].get(p, {}).get("kernels") for m in data["modes"])]
    if not phases:
        raise ValueError("the profile holds no kernels to plot")
    rows = {p: series(data, p, top) for p in phases}
    heights = [max(len(rows[p][1]), 1) * 0.42 + 1.4 for p in phases]
    fig, axes = plt.subplots(len(phases), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, p in zip(axes[:, 0], phases):
        _names, labels, values = rows[p]
        modes = list(values)
        n = len(modes)
        bar_h = 0.8 / max(n, 1)
        ys = list(range(len(labels)))
        for i, m in enumerate(modes):
            label, color = MODE_STYLE.get(m, (m, None))
            ph = data["modes"][m]["phases"][p]
            total = ph.get("kernel_ms_per_step")
            wall = ph.get("wall_ms_median")
            extra = f" — kernels {total:.3f} ms/step" if total is not None else ""
            extra += f", wall {wall:.3f} ms" if wall else ""
            bars = ax.barh([y + (i - (n - 1) / 2) * bar_h for y in ys], values[m], height=bar_h, color=color,
                           label=label + extra)
            biggest = max((v for vs in values.values() for v in vs), default=0.0)
            ax.bar_label(bars, labels=[f"{v:,.1f}" if v >= 0.01 * biggest and v > 0 else "" for v in values[m]],
                         fontsize=6, padding=2)
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("GPU time per step (µs)")
        steps = data["modes"][modes[0]]["phases"][p].get("steps", 1)
        what = f"prefill, {data.get('prompt_len', '?')} tokens" if p == "prefill" else \
            f"decode, {steps} steps after {data.get('prompt_len', '?')} tokens"
        ax.set_title(what, fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.08)
    first = data["modes"][next(iter(data["modes"]))]
    model = first.get("preset") or first.get("library", "")
    heads = f"H={first.get('num_heads', '?')} H_kv={first.get('num_kv_heads', '?')} D={first.get('head_dim', '?')}"
    cache = " (FA2 vs TVM's TIR attention), paged KV cache" if first.get("kv_cache") == "paged" else ""
    fig.suptitle(f"{model}, {first.get('num_layers', '?')} layers, {heads}, {first.get('provider', '')} provider"
                 f"{cache} — {data.get('gpu', '')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def plot_file(json_path: str, png_path: str, top: int = 15) -> str:
    import json

    with open(json_path) as f:
        return plot_profile(json.load(f), png_path, top=top)
