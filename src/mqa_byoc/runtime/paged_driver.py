"""Drive an exported :class:`~mqa_byoc.models.paged_llama.PagedLlama` library and its PagedKVCache.

Runtime only (``tvm.runtime`` + torch, no ``tvm.relax``): what the GPU test, the paged benchmark and
``mqa-byoc profile run`` (:class:`PagedDecoderRunner`) share. The cache is driven the way mlc-llm
drives it: ``vm.builtin.kv_state_add_sequence``, then per step ``kv_state_begin_forward(seq_ids,
append_lengths)``, one model call, ``kv_state_end_forward``.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..sidecar import read_sidecar
from .runner import StepRunner


class PagedModel:
    """One library (``tir.so`` / ``fa2.so``) of a build_paged case, on CUDA device 0 (or ``device``:
    "cpu" runs an llvm build, which the CPU test of this driver uses; ``path`` may be a loaded module)."""

    def __init__(self, tvm, torch, path, case: dict, impl: str, device: str = "cuda"):
        import tvm_ffi
        from tvm.runtime.vm import VirtualMachine

        self.tvm, self.torch, self.ffi = tvm, torch, tvm_ffi
        self.case, self.impl, self.device = case, impl, device
        self.cfg = case["config"]
        self.page_size = case["page_size"][impl]
        lib = tvm.runtime.load_module(str(path)) if isinstance(path, (str, Path)) else path
        self.vm = VirtualMachine(lib, tvm.cuda(0) if device == "cuda" else tvm.cpu(0))
        g = tvm.get_global_func
        self._add = g("vm.builtin.kv_state_add_sequence")
        self._remove = g("vm.builtin.kv_state_remove_sequence")
        self._begin = g("vm.builtin.kv_state_begin_forward")
        self._end = g("vm.builtin.kv_state_end_forward")
        self.params = None

    # -- cache ---------------------------------------------------------------------------------
    def new_cache(self, max_batch: int, max_total: int, chunk: int):
        """A fresh cache with room for ``max_total`` tokens (plus a page per sequence) of
        ``max_batch`` sequences, ``chunk`` tokens per forward at most."""
        shape = self.ffi.Shape
        total = max_total + (max_batch + 1) * self.page_size
        return self.vm["create_paged_kv_cache"](shape([max_batch]), shape([total]), shape([chunk]),
                                                 shape([self.page_size]), shape([0]))

    def add(self, cache, seq_ids):
        for s in seq_ids:
            self._add(cache, s)

    def remove(self, cache, seq_ids):
        for s in seq_ids:
            self._remove(cache, s)

    def begin(self, cache, seq_ids, lengths):
        self._begin(cache, self.ffi.Shape(list(seq_ids)), self.ffi.Shape(list(lengths)))

    def end(self, cache):
        self._end(cache)

    # -- calls ---------------------------------------------------------------------------------
    def attend(self, cache, qkv):
        """Layer 0's attention: qkv (b, s, H + 2 H_kv, D) torch -> (b, s, H, D) torch (a view)."""
        out = self.vm["attend"](self.tvm.runtime.from_dlpack(qkv), cache)
        return self.torch.from_dlpack(out[0])

    def set_params(self, seed: int = 0):
        """Random weights (normal, std 0.02; norms 1) of the case's parameter list, on the device."""
        torch, dev = self.torch, self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        tensors, self.weights = [], {}
        for name, shape, dtype in self.case["params"]:
            dt = getattr(torch, dtype)
            if "norm" in name:
                t = torch.ones(shape, dtype=dt, device=dev)
            else:
                t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dt)
            self.weights[name] = t
            tensors.append(self.tvm.runtime.from_dlpack(t))
        self.params = tensors

    def logits(self, fn: str, cache, ids, logit_positions=None):
        """``prefill`` ((1, total) ids), ``batch_prefill`` (the same and ``logit_positions``, (batch,)
        int32: each sequence's last position) or ``decode`` ((batch, 1) ids): float32 logits (torch)."""
        pos = None if logit_positions is None else self.tvm.runtime.from_dlpack(logit_positions)
        return self.torch.from_dlpack(self.call(fn, cache, self.tvm.runtime.from_dlpack(ids), pos)).float()

    def call(self, fn: str, cache, ids, logit_positions=None):
        """``fn``'s logits as the library returns them (a TVM tensor of the model's dtype; launches
        nothing but the model's kernels); ``ids`` (and ``batch_prefill``'s ``logit_positions``) TVM
        tensors, between :meth:`begin` and :meth:`end`."""
        if fn == "batch_prefill":
            if logit_positions is None:
                raise ValueError("batch_prefill needs logit_positions (each sequence's last position)")
            return self.vm[fn](ids, logit_positions, cache, self.params)[0]
        return self.vm[fn](ids, cache, self.params)[0]


def last_positions(lengths) -> list[int]:
    """The index of each sequence's last token among a prefill step's concatenated tokens: what
    ``batch_prefill`` takes as ``logit_positions``."""
    out, end = [], 0
    for n in lengths:
        if int(n) < 1:
            raise ValueError(f"every sequence of a prefill step needs a token, got lengths {list(lengths)}")
        end += int(n)
        out.append(end - 1)
    return out


def qkv_parts(cfg: dict, qkv):
    """q (b, s, H, D), k and v (b, s, H_kv, D) of a fused qkv."""
    h, hkv = cfg["num_q_heads"], cfg["num_kv_heads"]
    return qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]


class Reference:
    """fp32 attention over each sequence's whole K/V history (RoPE mode NONE): the test's oracle."""

    def __init__(self, torch, cfg: dict):
        self.torch, self.cfg = torch, cfg
        self.k, self.v = {}, {}

    def step(self, seq_ids, lengths, qkv):
        """Append this step's K/V and return the attention of its queries, laid out like ``attend``'s
        output: qkv (1, sum(lengths), ...) for a prefill step, (batch, 1, ...) for decode."""
        torch, cfg = self.torch, self.cfg
        q, k, v = (x.float() for x in qkv_parts(cfg, qkv))
        rows_q = q.reshape(-1, *q.shape[2:])
        rows_k, rows_v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        out, start = [], 0
        g = cfg["num_q_heads"] // cfg["num_kv_heads"]
        for s, n in zip(seq_ids, lengths):
            qs = rows_q[start:start + n]
            self.k[s] = torch.cat([self.k.get(s, rows_k[:0]), rows_k[start:start + n]])
            self.v[s] = torch.cat([self.v.get(s, rows_v[:0]), rows_v[start:start + n]])
            start += n
            kk = self.k[s].repeat_interleave(g, dim=1)  # (S_kv, H, D)
            vv = self.v[s].repeat_interleave(g, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs, kk) / math.sqrt(cfg["head_dim"])
            s_kv = kk.shape[0]
            mask = torch.arange(s_kv, device=qs.device)[None, :] > (s_kv - n + torch.arange(n, device=qs.device))[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        o = torch.cat(out)  # rows in sequence order: (1, total) for prefill, (batch, 1) for decode alike
        return o.reshape(qkv.shape[0], qkv.shape[1], *o.shape[1:])


class DecoderReference:
    """:class:`~mqa_byoc.models.paged_llama.PagedLlama` in fp32 torch on the model's weights
    (``PagedModel.weights`` after ``set_params``, widened to fp32), its K/V history in a
    :class:`Reference`: the oracle both libraries' logits are measured against. RoPE mode NONE (0) or
    NORMAL (1: TVM's ``rope_freq_default``, rotate-half pairs (i, i + D/2), position = the token's index
    in its sequence, applied to q and k before the cache)."""

    def __init__(self, torch, cfg: dict, weights: dict):
        if cfg.get("rope_mode", 0) not in (0, 1):
            raise ValueError(f"DecoderReference has RoPE modes NONE and NORMAL, not {cfg.get('rope_mode')}")
        self.torch, self.cfg = torch, cfg
        self.w = {name: t.float() for name, t in weights.items()}
        self.attn = [Reference(torch, cfg) for _ in range(cfg["layers"])]

    def _rope(self, x, pos):
        """x (rows, heads, D) at positions pos (rows,)."""
        torch, d = self.torch, self.cfg["head_dim"]
        half = d // 2
        inv = self.cfg.get("rope_theta", 10000.0) ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / d)
        ang = (pos.double()[:, None] * inv[None, :]).float()
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def _norm(self, x, name):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w[name]

    def step(self, seq_ids, lengths, ids):
        """fp32 logits of ``ids`` ((1, sum(lengths)) prefill, (batch, 1) decode), like ``logits``."""
        torch, c, w = self.torch, self.cfg, self.w
        x = w["embed.weight"][ids.long()]
        for i, ref in enumerate(self.attn):
            p = f"layers.{i}."
            qkv = self._norm(x, p + "attn_norm.weight") @ w[p + "attn.qkv_proj.weight"].t()
            qkv = qkv.reshape(*ids.shape, c["num_q_heads"] + 2 * c["num_kv_heads"], c["head_dim"])
            if c.get("rope_mode", 0) == 1:
                pos = torch.cat([torch.arange(n, device=qkv.device) + (len(ref.k[s]) if s in ref.k else 0)
                                 for s, n in zip(seq_ids, lengths)])
                rows = qkv.reshape(-1, *qkv.shape[2:])
                h, hk = c["num_q_heads"], c["num_kv_heads"]
                rows = torch.cat([self._rope(rows[:, :h + hk], pos), rows[:, h + hk:]], 1)
                qkv = rows.reshape(qkv.shape)
            o = ref.step(seq_ids, lengths, qkv).reshape(*ids.shape, -1)
            x = x + o @ w[p + "attn.o_proj.weight"].t()
            gate, up = (self._norm(x, p + "mlp_norm.weight") @ w[p + "gate_up.weight"].t()).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "down.weight"].t()
        return self._norm(x, "norm.weight") @ w["lm_head.weight"].t()


class PagedCaches:
    """A PagedKVCache holding one sequence (:data:`PagedDecoderRunner.SEQ`) and its length in tokens."""

    def __init__(self, cache, length: int):
        self.cache = cache
        self.length = int(length)


class PagedDecoderRunner(StepRunner):
    """A library of ``mqa-byoc profile build --kv-cache paged`` (sidecar ``kv_cache="paged"``) behind
    :class:`~mqa_byoc.runtime.runner.DecoderRunner`'s interface, batch 1: one sequence whose every step
    is ``kv_state_begin_forward`` / the model call / ``kv_state_end_forward`` (what mlc-llm does per
    step; the cache's host bookkeeping and its copies of page tables to the GPU are part of the step).

    The cache of :meth:`new_caches` has room for ``capacity`` tokens and takes them in one forward
    (prefill chunk = capacity), so a prompt is one ``prefill`` call, as with the in-place cache.
    """

    SEQ = 0

    def __init__(self, lib_path: str, device_id: int = 0, seed: int = 0, device: str = "cuda"):
        """``device``: "cuda" (device 0), or "cpu" for a library built for llvm (the CPU test)."""
        import torch
        import tvm
        import tvm.runtime.vm  # noqa: F401 - not loaded by tvm.runtime itself

        if device_id != 0:
            raise ValueError("PagedModel runs on CUDA device 0")
        self.meta = read_sidecar(lib_path)
        if self.meta.get("kv_cache") != "paged":
            raise ValueError(f"{lib_path}: not a paged-cache library (sidecar kv_cache={self.meta.get('kv_cache')!r})")
        impl = self.meta["paged_attention"]
        case = {"config": self.meta["paged_config"], "page_size": {impl: self.meta["page_size"]},
                "params": self.meta["params"]}
        self.torch, self.tvm, self.ids_device = torch, tvm, device
        self.dev = tvm.cuda(device_id) if device == "cuda" else tvm.cpu(0)
        self.model = PagedModel(tvm, torch, lib_path, case, impl, device=device)
        self.model.set_params(seed)
        self.model.params = self.model.ffi.convert(self.model.params)  # one Array, not a list per call
        self._keep = []
        self._last = None  # (length, TVM tensor, its torch owner): batch_prefill's logit_positions

    def new_caches(self, capacity: int) -> PagedCaches:
        """An empty cache with the sequence added, room for ``capacity`` tokens (make it before a
        profiled region: creating it launches kernels)."""
        capacity = max(int(capacity), 1)
        cache = self.model.new_cache(1, capacity, capacity)
        self.model.add(cache, [self.SEQ])
        return PagedCaches(cache, 0)

    def _step(self, fn, caches: PagedCaches, ids, length: int, logit_positions=None):
        m = self.model
        m.begin(caches.cache, [self.SEQ], [length])
        logits = m.call(fn, caches.cache, ids, logit_positions)
        m.end(caches.cache)
        return logits, PagedCaches(caches.cache, caches.length + length)

    def prefill(self, batch, length, ids=None, *, caches=None, max_new_tokens: int = 0):
        """Logits and the cache, holding ``length`` tokens: into ``caches`` (empty, from
        :meth:`new_caches`) or a new one with room for ``length + max_new_tokens``. The logits are the
        last position's ((1, 1, vocab), ``batch_prefill``) when the sidecar's ``logits`` is "last" (the
        default build), else every position's ((1, length, vocab), ``prefill``)."""
        if batch != 1:
            raise ValueError(f"the paged profile runs one sequence: batch must be 1, got {batch}")
        ids = self.make_ids(batch, length) if ids is None else ids
        caches = self.new_caches(length + max_new_tokens) if caches is None else caches
        if caches.length:
            raise ValueError(f"prefill needs an empty cache; this one holds {caches.length} tokens")
        if self.meta.get("logits", "all") == "last":
            if self._last is None or self._last[0] != length:
                pos = self.torch.tensor(last_positions([length]), dtype=self.torch.int32, device=self.ids_device)
                self._last = (length, self.tvm.runtime.from_dlpack(pos), pos)
            return self._step("batch_prefill", caches, ids, length, self._last[1])
        return self._step("prefill", caches, ids, length)

    def decode(self, caches: PagedCaches, batch=1, ids=None):
        if batch != 1:
            raise ValueError(f"the paged profile runs one sequence: batch must be 1, got {batch}")
        return self._step("decode", caches, self.make_ids(batch, 1) if ids is None else ids, 1)
