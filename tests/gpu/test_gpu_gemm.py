"""GEMMs offloaded to cuBLASLt on the GPU: every composite against TVM's own build of the same graph, and
the exported library in a process without torch and without mqa_byoc.

Artifacts from ``tools/gpu/build_gemm.py`` under ``$MQA_BYOC_GEMM_ARTIFACTS`` (default
``.gpu-artifacts/gemm``); the TVM runtime (full or runtime-only) and a CUDA GPU are needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ART = Path(os.environ.get("MQA_BYOC_GEMM_ARTIFACTS", ROOT / ".gpu-artifacts" / "gemm")) / "patterns"

pytestmark = pytest.mark.gpu


def _cases():
    path = ART / "manifest.json"
    return sorted(json.loads(path.read_text())["functions"]) if path.is_file() else []


def _cublaslt_lib_dir():
    """nvidia/cu13/lib of the nvidia-cublas wheel (found without importing torch)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        d = Path(root) / "cu13" / "lib"
        if (d / "libcublasLt.so.13").is_file():
            return d
    return None


@pytest.fixture(scope="module")
def vm():
    if not ART.is_dir():
        pytest.skip(f"no GEMM artifacts at {ART}: run tools/gpu/build_gemm.py")
    from mqa_byoc.deploy import prepare_runtime

    prepare_runtime()  # the runtime kit's set-up where TVM is runtime-only
    import tvm
    import tvm.runtime.vm

    dev = tvm.cuda(0)
    if not dev.exist:
        pytest.skip("no CUDA device")
    lib_dir = _cublaslt_lib_dir()
    if lib_dir is not None:  # the wheel's library loaded first: the dispatcher's dlopen by name finds it
        import ctypes

        ctypes.CDLL(str(lib_dir / "libcublasLt.so.13"), mode=ctypes.RTLD_GLOBAL)
    return tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(ART / "ours.so")), dev), dev


def _args(data, name, meta, dev):
    import ml_dtypes
    import tvm

    return [tvm.runtime.tensor(data[f"{name}.{i}"].astype(ml_dtypes.bfloat16) if dt == "bfloat16"
                               else data[f"{name}.{i}"], dev) for i, dt in enumerate(meta["dtypes"])]


def _close(got, ref, dtype):
    tol = 3e-2 if dtype == "bfloat16" else 1e-2
    scale = float(np.abs(ref).max()) + 1.0
    err = float(np.abs(got - ref).max())
    assert err <= tol * scale, f"max |ours - TVM| = {err:.4g} > {tol} x {scale:.3g}"
    return err


@pytest.mark.parametrize("name", _cases())
def test_gemm_pattern_matches_tvm(vm, name):
    machine, dev = vm
    data = np.load(ART / "inputs.npz")
    meta = json.loads(str(data["__meta__"]))[name]
    raw = machine[name](*_args(data, name, meta, dev))
    if meta.get("cast"):  # the cast fused: cuBLASLt wrote the operands' type
        assert str(raw.dtype) == meta["cast"]
    out = np.asarray(raw.numpy()).astype("float32")
    ref = data[f"{name}.ref"]
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    _close(out, ref, meta["dtype"])


def _child(name, tmp_path, env):
    out, res = tmp_path / f"{name}.npy", tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("gemm_standalone_child.py")),
                           str(ART / "ours.so"), str(ART / "inputs.npz"), name, str(out), str(res)],
                          env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads(res.read_text()), out


def test_gemm_library_runs_without_torch_and_mqa_byoc(vm, tmp_path):
    lib_dir = _cublaslt_lib_dir()
    if lib_dir is None:
        pytest.skip("nvidia-cublas is not installed here")
    name = _cases()[0]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{lib_dir}:{env.get('LD_LIBRARY_PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if "src" not in p)
    proc, result, out = _child(name, tmp_path, env)
    assert result["error"] is None, result["error"] + proc.stderr
    assert result["imported_blocked"] == []
    _close(np.load(out), np.load(ART / "inputs.npz")[f"{name}.ref"], "float16")


def test_gemm_library_without_cublaslt_names_the_fix(vm, tmp_path):
    name = _cases()[0]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    proc, result, _ = _child(name, tmp_path, env)
    if result["error"] is None:
        pytest.skip("libcublasLt.so.13 is on the loader's default path here")
    assert "pip install nvidia-cublas" in result["error"], result["error"]


# ------------------------------------------------------------------ GEMMs of one row: CUTLASS's GEMV

GEMV = ART.parent / "gemv"


def _gemv_cases():
    path = GEMV / "manifest.json"
    return sorted(json.loads(path.read_text())["functions"]) if path.is_file() else []


@pytest.fixture(scope="module")
def gemv_vm(vm):
    if not (GEMV / "ours.so").is_file():
        pytest.skip(f"no GEMV artifacts at {GEMV}: run tools/gpu/build_gemm.py")
    import tvm
    import tvm.runtime.vm

    _machine, dev = vm
    return tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(GEMV / "ours.so")), dev), dev


@pytest.mark.parametrize("name", _gemv_cases())
def test_one_row_runs_on_cutlass_gemv_where_it_fits_and_matches_tvm(gemv_vm, name):
    """Built with gemm_gemv=always: a GEMM of one row that CUTLASS's GEMV computes launches its kernel and
    nothing else; the others (bias and residual together, an activation, a (K, N) weight) run on cuBLASLt.
    Either way the result matches TVM's."""
    from mqa_byoc.testing.cupti import capture_kernels

    machine, dev = gemv_vm
    data = np.load(GEMV / "inputs.npz")
    meta = json.loads(str(data["__meta__"]))[name]
    args = _args(data, name, meta, dev)
    machine[name](*args)  # the first call plans (and times the GEMV's configurations)
    with capture_kernels() as cap:
        raw = machine[name](*args)
    names = cap.names()
    gemv = [n for n in names if "mqa_byoc_gemv_" in n]
    if meta["gemv"]:
        assert len(names) == 1 and len(gemv) == 1, names
        assert ("bf16" in gemv[0]) == (meta["dtype"] == "bfloat16"), gemv
    else:
        assert names and not gemv, names
    out = np.asarray(raw.numpy()).astype("float32")
    ref = data[f"{name}.ref"]
    assert out.shape == ref.shape and np.isfinite(out).all()
    _close(out, ref, meta["dtype"])
