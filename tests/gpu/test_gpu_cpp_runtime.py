"""GPU test: an exported decoder loads and runs with TVM's C++ runtime alone (no Python, no compiler).

Artifacts from ``python tools/gpu/build_cpp_runtime.py`` (``.gpu-artifacts/cpp-runtime``, or
``MQA_BYOC_CPP_RUNTIME_ARTIFACTS``): a two-layer decoder built with ``mqa_byoc.build(...,
cuda_binary=True)`` (native provider) and exported with TVM's own ``export_library``, its weights and a
prompt. The test

- compiles ``tools/cpp/run_decoder.cc`` with g++ against tvm-ffi's headers and TVM's runtime libraries
  (found from the installed packages) and runs it in a process with no Python: prefill, then greedy
  decode steps, printing each step's logits checksums and next token;
- runs the same steps through the Python runtime (``relax.VirtualMachine`` of a runtime-only TVM) with
  a ``tvm_callback_cuda_compile`` that fails if it is ever called: the library holds compiled kernels;
- compares the two: same greedy tokens, logits equal to fp32 rounding.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("MQA_BYOC_CPP_RUNTIME_ARTIFACTS", ROOT / ".gpu-artifacts" / "cpp-runtime"))
SOURCE = ROOT / "tools" / "cpp" / "run_decoder.cc"
STEPS = 6


def _build_info():
    path = ARTIFACTS / "build.json"
    return json.loads(path.read_text()) if path.is_file() else None


INFO = _build_info()
needs_artifacts = pytest.mark.skipif(
    INFO is None, reason=f"no artifacts in {ARTIFACTS}: run `python tools/gpu/build_cpp_runtime.py` on the build "
                         "machine and carry .gpu-artifacts/cpp-runtime")


def _runtime_libs():
    import tvm
    import tvm_ffi.libinfo as ffi_info

    tvm_lib = Path(tvm.__file__).resolve().parent / "lib"
    ffi_lib = Path(ffi_info.find_libtvm_ffi()).parent
    return tvm_lib, ffi_lib, Path(ffi_info.find_include_path()), Path(ffi_info.find_dlpack_include_path())


def _cudart_dirs() -> list[str]:
    """Directories holding the CUDA runtime libtvm_runtime_cuda.so links (toolkit, or the wheels torch uses)."""
    out = []
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/lib"):
        if any(Path(d).glob("libcudart.so*")):
            out.append(d)
    try:
        import nvidia

        for base in map(Path, nvidia.__path__):
            out += sorted(str(p.parent) for p in base.glob("*/lib/libcudart.so*"))
    except ImportError:
        pass
    return out


@pytest.fixture(scope="module")
def run_decoder(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    tvm_lib, ffi_lib, inc, dlpack = _runtime_libs()
    exe = tmp_path_factory.mktemp("cpp") / "run_decoder"
    cmd = ["g++", "-std=c++17", "-O2", "-o", str(exe), str(SOURCE), f"-I{inc}", f"-I{dlpack}", f"-L{ffi_lib}",
           f"-L{tvm_lib}", "-Wl,--no-as-needed", "-ltvm_ffi", "-ltvm_runtime", "-ltvm_runtime_cuda",
           f"-Wl,-rpath,{ffi_lib}:{tvm_lib}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def _parse(stdout: str) -> list[tuple[str, float, float, int]]:
    rows = re.findall(r"^(prefill|decode) \d+ sum=(\S+) sumsq=(\S+) next=(\d+)$", stdout, re.M)
    return [(k, float(a), float(b), int(n)) for k, a, b, n in rows]


@needs_artifacts
def test_library_holds_no_cuda_source_and_links_fa2():
    lib = (ARTIFACTS / INFO["library"]).read_bytes()
    assert b'extern "C" __global__' not in lib and not INFO["cuda_source_in_library"]  # TVM's kernels as source
    assert INFO["defines_dispatcher"] and "mqa_byoc_fa2_fwd_split_hdim128_fp16" in INFO["fa2_kernels_linked"]
    if shutil.which("nm"):  # TVM's own export linked the attached objects, the static CUDA runtime among them
        syms = subprocess.run(["nm", "--defined-only", str(ARTIFACTS / INFO["library"])], capture_output=True,
                              text=True, check=True).stdout
        for name in ("mqa_byoc_fa2_forward", "mqa_byoc_fa2_fwd_hdim128_fp16_causal", "cudaMalloc",
                     "mqa_byoc_library_kernel_options"):
            assert re.search(rf" [TtRr] {name}$", syms, re.M), name


@needs_artifacts
def test_cpp_runtime_runs_prefill_and_decode_like_python(rt, run_decoder, tmp_path):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from mqa_byoc.testing.cuda_compile import cuda_compile_hook

    work = tmp_path / "io"
    work.mkdir()
    for name in ("params.txt", "params.bin", "prompt.txt"):
        shutil.copy(ARTIFACTS / name, work / name)
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": os.pathsep.join(_cudart_dirs())}  # no Python, no nvcc
    proc = subprocess.run([str(run_decoder), str(ARTIFACTS / INFO["library"]), str(work), str(STEPS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    cpp = _parse(proc.stdout)
    assert [k for k, *_ in cpp] == ["prefill"] + ["decode"] * STEPS, proc.stdout
    cpp_logits = np.fromfile(work / "cpp_logits.bin", dtype="float32").reshape(STEPS + 1, -1)

    # the Python runtime, with a compile hook that must never run
    def refuse(_previous):
        def compile_cuda(*_args):
            raise AssertionError("the library asked for its CUDA kernels to be compiled at load")
        return compile_cuda

    dev = tvm.cuda(0)
    with cuda_compile_hook(refuse):
        vm = VirtualMachine(tvm.runtime.load_module(str(ARTIFACTS / INFO["library"])), dev)
        lines = (work / "params.txt").read_text().split("\n")
        blob, offset, weights = (work / "params.bin").read_bytes(), 0, []
        for line in filter(None, lines):
            dtype, *shape = line.split()
            n = int(np.prod([int(s) for s in shape])) * np.dtype(dtype).itemsize
            arr = np.frombuffer(blob[offset:offset + n], dtype=dtype).reshape([int(s) for s in shape])
            weights.append(tvm.runtime.tensor(arr, dev))
            offset += n
        prompt = np.array([int(t) for t in (work / "prompt.txt").read_text().split()], "int32")[None]
        logits, caches = vm["prefill"](tvm.runtime.tensor(prompt, dev), *weights)
        py = [logits.numpy()[0, -1]]
        for _ in range(STEPS):
            nxt = np.array([[int(np.argmax(py[-1]))]], "int32")
            logits, caches = vm["decode"](tvm.runtime.tensor(nxt, dev), caches, *weights)
            py.append(logits.numpy()[0, -1])
    py = np.stack(py)

    assert np.isfinite(py).all() and float(np.abs(py).max()) > 0
    assert [n for *_, n in cpp] == [int(np.argmax(x)) for x in py]
    np.testing.assert_allclose(cpp_logits, py, rtol=1e-5, atol=1e-5)
    for (_k, s, sq, _n), x in zip(cpp, py):
        assert abs(s - float(x.astype(np.float64).sum())) <= 1e-3 * max(1.0, abs(s))
        assert abs(sq - float((x.astype(np.float64) ** 2).sum())) <= 1e-3 * max(1.0, sq)
    rt.results["cpp_runtime"] = {"steps": STEPS, "tokens": [n for *_, n in cpp],
                                 "checksums": [[s, sq] for _k, s, sq, _n in cpp],
                                 "max_abs_diff": float(np.abs(cpp_logits - py).max())}
    print(proc.stdout)


# ---- kernel options compiled into a library (tools/gpu/build_cpp_runtime.py, options/*.so) ----

#: (kernels launched, kernels not launched) by each variant for one decode call (batch 1, S_kv = 4096):
#: our grouped-query decode kernel; FA2's split-KV kernel over key chunks and our combine kernel
#: (split_kv_combine.cu); FA2's split-KV kernel and its own combine kernel
EXPECTED_KERNELS = {
    "default": ([r"gqa_decode_kernel"], [r"flash_fwd"]),
    "fa2-decode": ([r"flash_fwd_splitkv_kernel", r"\bcombine<"], [r"gqa_decode_kernel", r"splitkv_combine"]),
    "fa2-decode-fa2-combine": ([r"flash_fwd_splitkv_kernel", r"flash_fwd_splitkv_combine_kernel"],
                               [r"gqa_decode_kernel", r"\bcombine<"]),
}


@needs_artifacts
@pytest.mark.parametrize("variant", sorted(EXPECTED_KERNELS))
def test_kernel_options_are_compiled_in(rt, variant, monkeypatch):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from mqa_byoc.testing.cupti import capture_kernels

    entry = INFO["options"][variant]
    lib = tvm.runtime.load_module(str(ARTIFACTS / entry["library"]))
    described = lib.get_function("mqa_byoc_kernel_options", True)()
    for key, value in entry["kernel_options"].items():
        assert f"{key}={value}" in described
    # the variables that once switched kernels at run time change nothing now
    for name in ("MQA_BYOC_DECODE_KERNEL", "MQA_BYOC_FA2_COMBINE"):
        monkeypatch.setenv(name, "fa2")
    monkeypatch.setenv("MQA_BYOC_DECODE_MERGE", "cluster")
    torch = rt.torch
    dev = tvm.cuda(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.float16, generator=g)
    vm = VirtualMachine(lib, dev)
    args = [tvm.runtime.from_dlpack(x) for x in (q, k, v)]
    vm["main"](*args)  # warm-up
    torch.cuda.synchronize()
    with capture_kernels() as cap:
        out = vm["main"](*args)
        torch.cuda.synchronize()
    names = "\n".join(cap.names())
    launched, absent = EXPECTED_KERNELS[variant]
    for pattern in launched:
        assert re.search(pattern, names), f"{variant}: {pattern} not launched: {cap.names()}"
    for pattern in absent:
        assert not re.search(pattern, names), f"{variant}: {pattern} launched: {cap.names()}"
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), enable_gqa=True)
    got = torch.from_dlpack(out).float().transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    rt.results[f"kernel_options_{variant}"] = {"described": described, "kernels": sorted(set(cap.names()))}
