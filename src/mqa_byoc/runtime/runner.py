"""Run an exported decoder library (prefill + decode steps) and summarize its GPU kernels.

Run time only: needs ``tvm.runtime`` and torch (for random weights on the GPU, CUPTI through
``torch.profiler`` and NVTX), never ``tvm.relax``. The library comes with a JSON sidecar
(``<lib>.json``, :mod:`mqa_byoc.sidecar`: functions, parameter shapes, cache shape) written when it
was built.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from ..sidecar import read_sidecar
from ..testing.cupti import KernelStat, capture_kernels
from ..testing.timing import cuda_time_us


MEMORY_OPS = ("Memcpy", "Memset")


def is_memory_op(name: str) -> bool:
    """CUPTI's copy / set activities (``Memcpy DtoD (Device -> Device)``, ``Memset (Device)``): nsys
    reports them apart from kernels (``cuda_gpu_mem_time_sum``)."""
    return name.startswith(MEMORY_OPS)


def stat_row(s: KernelStat) -> dict:
    """One kernel's statistics in nanoseconds, the columns of nsys's ``cuda_gpu_kern_sum``."""
    t = [x * 1e3 for x in s.times_us]
    return {"name": s.name, "instances": len(t), "total_ns": sum(t), "avg_ns": statistics.mean(t),
            "med_ns": statistics.median(t), "min_ns": min(t), "max_ns": max(t), "stddev_ns": statistics.pstdev(t)}


SUMMARY_HEADER = ["Time (%)", "Total Time (ns)", "Instances", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)",
                  "StdDev (ns)", "Name"]


def format_summary(rows: list[dict], name_width: int = 120) -> str:
    """Rows of :func:`stat_row` as an nsys ``cuda_gpu_kern_sum`` table, largest total first."""
    total = sum(r["total_ns"] for r in rows) or 1.0
    lines = []
    for r in sorted(rows, key=lambda r: -r["total_ns"]):
        lines.append([f"{100 * r['total_ns'] / total:.1f}", f"{r['total_ns']:,.0f}", str(r["instances"]),
                      f"{r['avg_ns']:,.1f}", f"{r['med_ns']:,.1f}", f"{r['min_ns']:,.0f}", f"{r['max_ns']:,.0f}",
                      f"{r['stddev_ns']:,.1f}", r["name"][:name_width]])
    header = SUMMARY_HEADER
    widths = [max(len(r[i]) for r in lines + [header]) for i in range(len(header) - 1)]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1]  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths] + ["-" * 4])] + [fmt(r) for r in lines])


def kernel_summary(stats: list[KernelStat]) -> str:
    """Kernels in the layout of nsys's ``cuda_gpu_kern_sum`` report (times in ns)."""
    return format_summary([stat_row(s) for s in stats])


class InplaceCaches:
    """The cache objects of a decoder built with ``kv_cache="inplace"`` and how many tokens they hold
    (the ``past_len`` its decode takes); the objects are appended to in place by every call."""

    def __init__(self, objects, length: int):
        self.objects = objects
        self.length = int(length)


class StepRunner:
    """The timing loops of a decoder runner (and its token ids), on what a subclass gives:
    ``new_caches(capacity)``, ``prefill(batch, length, ids=, caches=, max_new_tokens=)`` and
    ``decode(caches, batch, ids=)`` (both returning ``(logits, caches)``); ``torch``, ``tvm``, ``dev``,
    ``meta`` (the sidecar) and ``_keep`` (tensors kept alive while TVM holds views of them).
    :class:`DecoderRunner` (functional and in-place caches) and
    :class:`mqa_byoc.runtime.paged_driver.PagedDecoderRunner` (TVM's PagedKVCache) are the two."""

    ids_device = "cuda"  # torch's name of the device the token ids are made on

    def make_ids(self, batch, length):
        """Random token ids on the GPU, as a TVM tensor (make them before a profiled region: the
        random-number kernel would show in the profile)."""
        ids = self.torch.randint(0, self.meta["vocab_size"], (batch, length), dtype=self.torch.int32,
                                 device=self.ids_device)
        self._keep.append(ids)
        return self.tvm.runtime.from_dlpack(ids)

    def run(self, prompt_len: int, steps: int, batch: int = 1, nvtx: bool = True):
        """Prefill ``prompt_len`` tokens then ``steps`` decode steps; returns per-step seconds."""
        torch = self.torch
        # NVTX ranges make the model steps visible in an nsys timeline
        rng = torch.cuda.nvtx.range if nvtx else (lambda _name: contextlib.nullcontext())
        times = {"prefill": [], "decode": []}
        prompt = self.make_ids(batch, prompt_len)
        tokens = [self.make_ids(batch, 1) for _ in range(steps)]
        caches = self.new_caches(prompt_len + steps)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with rng(f"prefill[{prompt_len}]"):
            logits, caches = self.prefill(batch, prompt_len, ids=prompt, caches=caches)
        self.dev.sync()
        times["prefill"].append(time.perf_counter() - t0)
        for i in range(steps):
            t0 = time.perf_counter()
            with rng(f"decode[{i}]"):
                logits, caches = self.decode(caches, batch, ids=tokens[i])
            self.dev.sync()
            times["decode"].append(time.perf_counter() - t0)
        return times, logits

    def decode_loop_ms(self, prompt_len: int, steps: int, batch: int = 1, warmup: int = 3) -> float:
        """ms per decode step at context ``prompt_len``: ``steps`` steps back to back between CUDA
        events (no host synchronization between steps, as a serving loop runs), after a prefill
        of ``prompt_len`` tokens and ``warmup`` steps."""
        _, caches = self.prefill(batch, prompt_len, ids=self.make_ids(batch, prompt_len),
                                 max_new_tokens=steps + warmup)
        tokens = [self.make_ids(batch, 1) for _ in range(max(steps, warmup))]
        state = {"caches": caches, "i": 0}

        def step():
            _, state["caches"] = self.decode(state["caches"], batch, ids=tokens[state["i"] % len(tokens)])
            state["i"] += 1

        return cuda_time_us(step, steps, warmup=warmup) / 1e3

    def profile(self, prompt_len: int, steps: int, batch: int = 1):
        """Run once to warm up, then under CUPTI; returns (times, kernel stats)."""
        self.run(prompt_len, 1, batch)
        with capture_kernels(cpu=True) as cap:
            times, _ = self.run(prompt_len, steps, batch)
        return times, cap.stats()


class DecoderRunner(StepRunner):
    """Prefill + decode through the Relax VM, with random weights made on the GPU.

    Both caches of :func:`mqa_byoc.models.llama.build_decoder` (the sidecar's ``kv_cache``): the
    functional one passes K/V tensors in and out; the in-place one passes :class:`InplaceCaches`,
    made by the library's ``create_kv_cache`` with room for the prompt and ``max_new_tokens``
    (beyond it the runtime reallocates and copies the cache: correct, but not what to time).
    """

    def __init__(self, lib_path: str, device_id: int = 0, seed: int = 0):
        import torch
        import tvm
        import tvm.runtime.vm  # noqa: F401 - not loaded by tvm.runtime itself

        self.meta = read_sidecar(lib_path)
        self.kv_cache = self.meta.get("kv_cache", "functional")
        self.torch = torch
        self.tvm = tvm
        self.dev = tvm.cuda(device_id)
        lib = tvm.runtime.load_module(lib_path)
        self.lib = lib
        self.vm = tvm.runtime.vm.VirtualMachine(lib, self.dev)
        gen = torch.Generator(device=f"cuda:{device_id}").manual_seed(seed)
        self.params = []
        self._keep = []
        for name, shape, dtype in self.meta["params"]:
            t = torch.randn(shape, generator=gen, device=f"cuda:{device_id}", dtype=torch.float32) * 0.02
            if name.endswith("norm.weight"):
                t += 1.0
            t = t.to(getattr(torch, {"float16": "float16", "bfloat16": "bfloat16"}.get(dtype, "float32")))
            self._keep.append(t)
            self.params.append(tvm.runtime.from_dlpack(t))

    def new_caches(self, capacity: int):
        """Empty in-place caches with room for ``capacity`` tokens (``create_kv_cache``); None for a
        functional-cache library. Make them before a profiled region: creating them launches kernels."""
        if self.kv_cache != "inplace":
            return None
        shape = self.tvm.runtime.ShapeTuple([max(int(capacity), 1)])
        return InplaceCaches(self.vm["create_kv_cache"](shape), 0)

    def prefill(self, batch, length, ids=None, *, caches=None, max_new_tokens: int = 0):
        """Logits and caches of a prompt of ``length`` tokens. In-place: into ``caches`` (empty, from
        :meth:`new_caches`), or new ones with room for ``length + max_new_tokens`` tokens."""
        ids = self.make_ids(batch, length) if ids is None else ids
        if self.kv_cache != "inplace":
            out = self.vm["prefill"](ids, *self.params)
            return out[0], out[1]
        if batch != 1:
            raise ValueError(f"the in-place cache holds one sequence: batch must be 1, got {batch}")
        caches = self.new_caches(length + max_new_tokens) if caches is None else caches
        if caches.length:
            raise ValueError(f"prefill needs empty caches; these hold {caches.length} tokens")
        out = self.vm["prefill"](ids, caches.objects, *self.params)
        return out[0], InplaceCaches(out[1], length)

    def decode(self, caches, batch=1, ids=None):
        ids = self.make_ids(batch, 1) if ids is None else ids
        if isinstance(caches, InplaceCaches):
            past_len = self.tvm.runtime.ShapeTuple([caches.length])
            out = self.vm["decode"](ids, past_len, caches.objects, *self.params)
            return out[0], InplaceCaches(out[1], caches.length + 1)
        out = self.vm["decode"](ids, caches, *self.params)
        return out[0], out[1]


def run_and_profile(lib_path, config, param_spec, args) -> None:
    """The GPU half of ``mqa-byoc demo``."""
    from ..sidecar import write_sidecar

    write_sidecar(lib_path, config, param_spec, args.dtype, {"kv_cache": args.kv_cache})
    runner = DecoderRunner(lib_path)
    times, stats = runner.profile(args.prompt_len, args.decode_steps)
    print(f"\nprefill {args.prompt_len} tokens: {times['prefill'][0] * 1e3:.2f} ms; "
          f"decode: {statistics.median(times['decode']) * 1e3:.3f} ms/token (median of {len(times['decode'])})")
    print(kernel_summary(stats))
