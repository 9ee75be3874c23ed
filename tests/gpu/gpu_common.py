"""Shared by the GPU tests: the TVM runtime set-up (runtime kit, libraries, VMs), inputs as torch tensors,
the fp32 PyTorch reference. torch is imported lazily (the module is importable without it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# absolute: the standalone children run in a folder of their own, where a relative path would not resolve
ARTIFACTS = Path(os.environ.get("MQA_BYOC_GPU_ARTIFACTS", ROOT / ".gpu-artifacts" / "tests")).resolve()
# The GPU machine runs the tests from a checkout with a runtime-only TVM, where the package need not be
# installed: this checkout's src/ on the path (only the package, nothing of tools/ or benchmarks/).
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from mqa_byoc.testing import gpu_manifest as gi  # noqa: E402

MANIFESTS = gi.load_manifests(ARTIFACTS)
TIMING_ITERS = 10


def full_tvm() -> bool:
    """Is the TVM compiler here (tvm.relax importable)? Decided without importing tvm."""
    if os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        return False
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.origin:
        return False
    pkg = Path(spec.origin).parent
    return (pkg / "relax").is_dir() and any((pkg / "lib").glob("libtvm_compiler*"))


def skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU test needs torch with CUDA)"
    if not torch.cuda.is_available():
        where = " (full TVM with tvm.relax: this looks like the build machine)" if full_tvm() else ""
        return f"no CUDA GPU: torch {torch.__version__}, torch.cuda.is_available() is False{where}"
    return None


def no_artifacts_reason() -> str:
    return (f"no artifacts in {ARTIFACTS}: run `python tools/gpu/build_forms.py [--native]` on the build "
            "machine and copy .gpu-artifacts/tests")


def stale_case_reason(m: dict) -> str | None:
    """Why a graph-form case's artifacts were not built from its definition in
    ``mqa_byoc.testing.attention_cases`` (None: they were)."""
    from mqa_byoc.testing import attention_cases

    name = m["case"]["name"]
    try:
        case = attention_cases.case(name)
    except KeyError:
        return (f"{name}: built from a case that mqa_byoc.testing.attention_cases does not define: rebuild "
                "with tools/gpu/build_forms.py")
    defined = json.loads(json.dumps(case.as_dict()))
    # fields added to Case later, with their defaults, are what a manifest written before them means
    added = {f.name: f.default for f in dataclasses.fields(attention_cases.Case) if f.default is not dataclasses.MISSING}
    recorded = {**{k: v for k, v in added.items() if k not in m["case"]}, **m["case"]}
    if recorded != defined:
        return (f"{name}: built from another definition of the case ({m['case']}, now {defined}): rebuild with "
                "tools/gpu/build_forms.py")
    return None


def providers_of(m: dict) -> tuple[list[str], dict[str, str]]:
    """Providers with built variants, and {provider: why not built} for the others."""
    built = sorted(k.split("_", 1)[1] for k in m["modules"] if k.startswith("mqa_"))
    skipped = {}
    for key, why in m.get("skipped", {}).items():
        provider = key.split("_", 1)[1] if "_" in key else key  # "mqa_native" (format 1) or "native"
        if provider not in built:
            skipped.setdefault(provider, why)
    return built, skipped


# ---------------------------------------------------------------------------------------------
# the fp32 reference


def to_bsnh(x, layout: str, heads: int | None = None):
    if layout == "BSNH":
        return x
    if layout == "SBE":  # (S, B, H*D), sequence first (nn.MultiheadAttention)
        return x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads).permute(1, 0, 2, 3)
    if layout == "BNSH":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":  # (B, S, D): one head
        return x.unsqueeze(2)
    if layout == "H":  # one value per query head (attention sinks)
        return x
    raise ValueError(f"unknown layout {layout!r}")


def attention_mask(torch, sq: int, sk: int, causal: str | None, window: int | None, device=None,
                   chunk: int | None = None):
    """keep[i, j]: query i may see key j. BottomRight causal: j <= i + S_kv - S_q (FA2's); TopLeft:
    j <= i; window w (bottom-right aligned, diagonal included): i + S_kv - S_q - w < j <= i + S_kv - S_q;
    chunk c (with BottomRight): j in the block of c positions that holds i + S_kv - S_q."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    diag = i + (sk - sq)
    if causal == "TopLeft":
        keep &= j <= i
    elif causal == "BottomRight":
        keep &= j <= diag
    elif causal is not None:
        raise ValueError(f"causal mask {causal!r}")
    if window is not None:
        keep &= (j <= diag) & (j > diag - int(window))
    if chunk is not None:
        keep &= torch.div(j, int(chunk), rounding_mode="floor") == torch.div(diag, int(chunk), rounding_mode="floor")
    return keep


def torch_reference(torch, m: dict, tensors):
    """fp32 attention of case ``m`` on its inputs ``tensors`` (in the manifest's order and layouts).

    Inputs are turned to BSNH by their layout; query head h uses K/V head h // (H / H_kv) (R.repeat,
    FA2, HF repeat_kv); soft-capped (``softcap`` c) scores are ``c * tanh(s / c)`` before the mask; the mask
    is :func:`attention_mask` (with the case's ``chunk``); with ``sinks`` each row's softmax has the
    head's sink logit (input ``sinks``) besides the keys; the result is put back into the output's
    layout (BSNH or BNSH) and shape ((B, S, H*D) when heads are merged)."""
    att, out = m["attention"], m["output"]
    by_name = {spec["name"]: to_bsnh(t.float(), spec["layout"], spec.get("heads"))
               for spec, t in zip(m["inputs"], tensors)}
    q, k, v = by_name["q"], by_name["k"], by_name["v"]
    h, hkv = q.shape[2], k.shape[2]
    assert (h, hkv) == (att["num_q_heads"], att["num_kv_heads"]) and h % hkv == 0, (q.shape, k.shape, att)
    r = h // hkv
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * float(att["scale"])
    if att.get("softcap"):  # logit soft-capping (Gemma 2), before the mask
        s = torch.tanh(s / float(att["softcap"])) * float(att["softcap"])
    keep = attention_mask(torch, s.shape[-2], s.shape[-1], att["causal"], att["window"], device=s.device,
                          chunk=att.get("chunk"))
    s = s.masked_fill(~keep, float("-inf"))
    if att.get("sinks"):  # one more logit per query head in every row, of value zero, dropped after softmax
        col = by_name["sinks"][None, :, None, None].expand(s.shape[0], h, s.shape[2], 1)
        p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if out["layout"] == "BNSH":
        o = o.permute(0, 2, 1, 3)
    elif out["layout"] == "SBE":
        o = o.permute(1, 0, 2, 3)
    elif out["layout"] != "BSNH":
        raise ValueError(f"unknown output layout {out['layout']!r}")
    return o.reshape(out["shape"])


def torch_inputs(torch, m: dict, device):
    """The case's inputs (gpu_inputs.make_inputs) as torch tensors of the case dtype on ``device``."""
    out = []
    for spec, arr in zip(m["inputs"], gi.make_inputs(m)):
        if spec["dtype"] == "bfloat16":
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        out.append(t.to(device, copy=True))  # a fresh, aligned buffer (TVM's from_dlpack wants 64 bytes)
    return out


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------------------------------
# standalone native runs (test_native_standalone.py)

CHILD = Path(__file__).with_name("native_standalone_child.py")
CHILD_TIMEOUT_S = int(os.environ.get("MQA_BYOC_STANDALONE_TIMEOUT", "300"))


def native_libraries() -> dict[str, list[tuple[dict, str]]]:
    """Native library path -> [(manifest, variant key)] of the case functions it holds."""
    libs: dict[str, list[tuple[dict, str]]] = {}
    for m in MANIFESTS:
        for key in ("mqa_native", "nomqa_native", "mqa_hopper", "nomqa_hopper"):
            if key in m["modules"]:
                libs.setdefault(gi.module_path(m, key), []).append((m, key))
    return libs


class StandaloneRuns:
    """One ``native_standalone_child.py`` process per native library, started at once (they run while
    this process loads its own libraries); :meth:`result` waits for one."""

    def __init__(self, libraries: dict[str, list[tuple[dict, str]]], device: str = "cuda"):
        self.tmp = Path(tempfile.mkdtemp(prefix="mqa-byoc-standalone-"))
        env = dict(os.environ)
        self.procs, self.done = {}, {}
        for i, (path, entries) in enumerate(sorted(libraries.items())):
            job = {"library": path, "result": str(self.tmp / f"result{i}.json"), "calls": [], "device": device}
            for m, key in entries:
                fn = gi.function_name(m, key)
                job["calls"].append({"manifest": os.path.join(m["dir"], "manifest.json"), "function": fn,
                                     "out": str(self.tmp / f"{i}-{fn}.npy")})
            (self.tmp / f"job{i}.json").write_text(json.dumps(job, indent=2))
            proc = subprocess.Popen([sys.executable, str(CHILD), str(self.tmp / f"job{i}.json")], env=env,
                                    cwd=str(self.tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.procs[path] = (proc, job, time.time())

    def result(self, path: str):
        """(result dict or None, log, seconds, exit code) of the child that ran ``path``."""
        if path not in self.done:
            proc, job, t0 = self.procs[path]
            try:
                log, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                log, _ = proc.communicate()
                log += f"\n(killed after {CHILD_TIMEOUT_S}s)"
            res = Path(job["result"])
            self.done[path] = (json.loads(res.read_text()) if res.exists() else None, log, time.time() - t0,
                               proc.returncode)
        return self.done[path]

    def close(self):
        for proc, _job, _t0 in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


# ---------------------------------------------------------------------------------------------
# runtime


class Runtime:
    """TVM runtime + python providers + caches, set up once per session."""

    def __init__(self, fail):
        import torch

        if not full_tvm():
            from mqa_byoc.deploy import prepare_runtime

            prepare_runtime()  # the runtime kit's set-up: libtvm_runtime_cuda, the nvcc hook
        import tvm
        import tvm.runtime.vm  # noqa: F401 - not loaded by tvm.runtime itself
        import tvm_ffi

        import mqa_byoc.runtime.providers as providers

        self.torch, self.tvm, self.providers = torch, tvm, providers
        self._cache_cuda_compile(tvm_ffi)
        self.libs, self.vms, self.inputs, self.results = {}, {}, {}, {}
        self.load_seconds = 0.0
        self.standalone: StandaloneRuns | None = None
        jobs = int(os.environ.get("MQA_BYOC_GPU_LOAD_JOBS", "8"))
        if jobs > 1:  # loading compiles the libraries' CUDA kernels (nvcc): do it in parallel up front
            from concurrent.futures import ThreadPoolExecutor

            t0 = time.time()
            paths = sorted({gi.module_path(m, k) for m in MANIFESTS for k in m["modules"]})
            with ThreadPoolExecutor(jobs) as pool:
                for path, lib in zip(paths, pool.map(tvm.runtime.load_module, paths)):
                    self.libs[path] = lib
            self.load_seconds = time.time() - t0

    @staticmethod
    def _cache_cuda_compile(tvm_ffi):
        """Kernels are compiled when a library loads; identical kernels across libraries compile once
        (for the session: the hook stays registered)."""
        from mqa_byoc.testing.cuda_compile import HOOK, memoized_cuda_compile

        compile_fn = tvm_ffi.get_global_func(HOOK, allow_missing=True)
        if compile_fn is not None:
            tvm_ffi.register_global_func(HOOK, memoized_cuda_compile(compile_fn), override=True)

    def vm(self, m, key):
        path = gi.module_path(m, key)
        if path not in self.vms:
            lib = self.libs.get(path) or self.tvm.runtime.load_module(path)
            self.libs[path] = lib
            self.vms[path] = self.tvm.runtime.vm.VirtualMachine(lib, self.tvm.cuda(0))
        return self.vms[path][gi.function_name(m, key)]

    def case_inputs(self, m):
        name = m["case"]["name"]
        if name not in self.inputs:
            self.inputs[name] = torch_inputs(self.torch, m, "cuda")
        return self.inputs[name]

    def run(self, m, key, clone=True):
        fn = self.vm(m, key)
        args = [self.tvm.runtime.from_dlpack(t) for t in self.case_inputs(m)]
        out = fn(*args)
        # the clone (a device-to-device copy of the result) is ours, not the module's: kept out of
        # the profiled call
        return self.torch.from_dlpack(out).clone() if clone else out

    def kernels(self, m, key):
        """CUDA kernel / memcpy names launched by one call (after a warm-up call)."""
        from mqa_byoc.testing import capture_kernels

        self.run(m, key)
        self.torch.cuda.synchronize()
        with capture_kernels() as cap:
            self.run(m, key, clone=False)
        return cap.names()

    def time_us(self, m, key):
        torch = self.torch
        self.run(m, key)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(TIMING_ITERS):
            self.run(m, key)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / TIMING_ITERS * 1e6

    def record(self, m, provider) -> dict:
        return self.results.setdefault(f"{m['case']['name']}-{provider}", {})


# ---- decoders built by tools/gpu/build_decoders.py and build_inplace.py ----

def decoder_manifest(artifacts: Path) -> dict:
    """The manifest.json a decoder builder wrote into artifacts; {} when it has not run."""
    path = artifacts / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def decoder_runners(artifacts: Path, manifest: dict, builder: str) -> dict:
    """A DecoderRunner (seed 0: the same weights for every variant) per (case name, variant); skips
    the module when builder (tools/gpu/<builder>) has not written artifacts."""
    import pytest

    if not manifest:
        pytest.skip(f"no artifacts in {artifacts}: run `python tools/gpu/{builder}` on the build machine "
                    f"and copy .gpu-artifacts/{artifacts.name}")
    from mqa_byoc.runtime.runner import DecoderRunner

    return {(name, variant): DecoderRunner(os.path.join(artifacts, f), seed=0)
            for name, case in manifest.items() for variant, f in case["files"].items()}


def check_decoder_steps(torch, name, got_logits, want_logits, got_caches, want_caches) -> list[float]:
    """Offloaded decoder steps against the reference's: logits within a few fp16 ulps of their range
    and the same next token where the reference is decided; caches as close. The relative logit
    error per step."""
    errors = []
    for step, (g_l, w_l) in enumerate(zip(got_logits, want_logits)):
        assert g_l.shape == w_l.shape and torch.isfinite(g_l).all()
        scale = float(w_l.abs().max())
        err = float((g_l - w_l).abs().max())
        errors.append(err / scale)
        # fp16 attention with different accumulation orders: a few fp16 ulps of the logit range
        assert err <= 2e-2 * scale, (name, "prefill" if step == 0 else f"decode {step}", err, scale)
        top2 = w_l.topk(2, dim=-1).values  # the same next token, where the reference is not a near-tie
        decided = (top2[..., 0] - top2[..., 1]) > 4e-2 * scale
        assert torch.equal(g_l.argmax(-1)[decided], w_l.argmax(-1)[decided])
    for g_c, w_c in zip(got_caches, want_caches):
        assert g_c.shape == w_c.shape
        assert float((g_c.float() - w_c.float()).abs().max()) <= 2e-2 * float(w_c.abs().max().float())
    return errors


def decoder_ids(torch, mqa, ref, batch: int, length: int):
    """Random token ids (seed 1) for a pair of decoders built with one seed: their weights must be
    equal (same seed, same device), so any difference in their outputs is the offload's."""
    for a, b in zip(mqa._keep, ref._keep):
        assert torch.equal(a, b)
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(0, mqa.meta["vocab_size"], (batch, length), generator=g, device="cuda", dtype=torch.int32)
