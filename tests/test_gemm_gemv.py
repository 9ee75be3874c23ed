"""CUTLASS's GEMV for GEMMs of one row (native/cutlass_gemv.cu): its fatbin in the cuBLASLt dispatcher, where its
headers come from, what the build does without nvcc, and what the report says of the sites it may run.
Its numerics and which calls run it: tests/gpu/test_gpu_gemm.py."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mqa_byoc.compiler import cublaslt_build
from mqa_byoc.compiler.graph.gemm import GEMV_NOTE, gemm_report
from mqa_byoc.kernels import gemv, paths
from mqa_byoc.kernels.errors import NativeKernelsUnavailable
from mqa_byoc.testing.gemm_graphs import FORMS, gemm_graph

#: (index, threads, threads per row) of every configuration in native/cutlass_gemv.h
CONFIGS = [tuple(int(v) for v in m) for m in re.findall(r"X\((\d+), (\d+), (\d+)\)", paths.GEMV_HEADER.read_text())]


def test_the_configurations_are_whole_warps_of_rows():
    assert [c[0] for c in CONFIGS] == list(range(len(CONFIGS))) and len(CONFIGS) >= 2
    for _, threads, per_row in CONFIGS:
        assert per_row in (8, 16, 32) and threads % 32 == 0 and threads % per_row == 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_dispatcher_embeds_the_gemv_fatbin_with_every_entry():
    missing = cublaslt_build.headers_unavailable() or cublaslt_build.gemv_unavailable()
    if missing:
        pytest.skip(f"no CUTLASS GEMV here: {missing}")
    inc = gemv.fatbin_include(progress=None)
    data = bytes(int(b, 16) for b in re.findall(r"0x([0-9a-f]{2})", inc.read_text()))
    assert data[:4] == bytes.fromhex("50ed55ba")  # the fatbin header's magic (0xBA55ED50, little-endian)
    for i, _, _ in CONFIGS:
        for dtype in ("f16", "bf16"):
            assert f"mqa_byoc_gemv_{dtype}_{i}".encode() in data
    assert b"sm_90" in data or b"compute_90" in data
    obj = cublaslt_build.dispatcher_object(progress=None)
    syms = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True).stdout
    assert "kGemvFatbin" in syms
    undefined = [ln.split()[-1] for ln in syms.splitlines() if ln.split()[:1] == ["U"]]
    assert not [u for u in undefined if u.startswith(("cu", "__cuda"))]  # no CUDA runtime: launched via the driver


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_without_nvcc_the_dispatcher_runs_cublaslt_alone(monkeypatch, tmp_path):
    missing = cublaslt_build.headers_unavailable()
    if missing:
        pytest.skip(missing)
    monkeypatch.setenv("MQA_BYOC_NVCC", "")  # no nvcc (authoritative when set)
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path))
    assert cublaslt_build.gemv_flags() == []
    assert "nvcc" in cublaslt_build.gemv_unavailable().lower()
    obj = cublaslt_build.dispatcher_object(progress=None)
    syms = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True).stdout
    assert " T mqa_byoc_cublaslt_gemm" in syms and "kGemvFatbin" not in syms


def test_cutlass_headers_come_from_the_wheel_else_from_apache_tvm(monkeypatch):
    found = gemv.cutlass_include_dir()
    assert (found / "cutlass" / "gemm" / "kernel" / "gemv.h").is_file()
    real = importlib.util.find_spec

    def no_wheel(name, *args, **kwargs):
        return None if name == "cutlass_library" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", no_wheel)
    tvm_copy = gemv.cutlass_include_dir()
    assert tvm_copy.parts[-3:] == ("3rdparty", "cutlass", "include")

    def neither(name, *args, **kwargs):
        return None if name in ("cutlass_library", "tvm") else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", neither)
    with pytest.raises(NativeKernelsUnavailable, match=r'pip install "nvidia-cutlass=='):
        gemv.cutlass_include_dir()


# (form index, rows) -> whether the report notes CUTLASS's GEMV for the site
@pytest.mark.parametrize("form, rows, noted", [
    (5, (1,), True), (5, ("n",), True), (5, (1, 1), True), (3, ("n",), True), (4, (1,), True),
    (5, (4,), False),            # a static M that is not 1
    (5, (2, "n"), False),        # M = 2 n is never 1
    (0, (1,), False),            # bias and residual together
    (1, (1,), False),            # an activation
    (11, (1,), False),           # a (K, N) weight
])
def test_report_notes_the_gemv_where_a_call_of_one_row_fits_it(form, rows, noted):
    mod, _ = gemm_graph(*FORMS[form], rows=rows, k=128, n=256)
    (site,) = gemm_report(mod)
    assert site.offloaded and site.runs_on == "cuBLASLt"
    assert (GEMV_NOTE in (site.note or "")) == noted, site.note


def test_report_notes_the_gemv_for_a_float32_result_cast_back_but_not_for_a_float32_output():
    cast, _ = gemm_graph(*FORMS[5], rows=("n",), k=128, n=256, out_dtype="float32", cast="float16")
    f32, _ = gemm_graph(*FORMS[5], rows=("n",), k=128, n=256, out_dtype="float32")
    assert GEMV_NOTE in (gemm_report(cast)[0].note or "")
    assert GEMV_NOTE not in (gemm_report(f32)[0].note or "")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["cutlass_gemv.cu", "cublaslt_search.cu"])
def test_the_gemm_benchmarks_compile(source, tmp_path):
    """benchmarks/cutlass_gemv.cu and cublaslt_search.cu (no TVM: CUTLASS and cuBLASLt alone) compile as their
    headers say, against the CUTLASS headers found here (apache-tvm's copy in CI) and the nvidia-cublas wheel's."""
    from mqa_byoc.kernels import toolchain

    missing = cublaslt_build.headers_unavailable()
    if missing:
        pytest.skip(missing)
    try:
        nvcc = toolchain.find_nvcc()
    except NativeKernelsUnavailable as e:
        pytest.skip(str(e))
    include = gemv.cutlass_include_dir()
    if not (include / "cutlass" / "epilogue" / "collective" / "builders" / "sm90_builder.inl").is_file():
        pytest.skip(f"CUTLASS 3's collective builders are not in {include} (apache-tvm's copy): "
                    f"pip install \"{gemv.CUTLASS_REQUIREMENT}\"")
    src = Path(__file__).resolve().parents[1] / "benchmarks" / source
    cmd = [nvcc, "-O3", "-DNDEBUG", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr",
           f"-I{include}", f"-I{cublaslt_build.cublaslt_include_dir()}", "-c", str(src),
           "-o", str(tmp_path / "bench.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
