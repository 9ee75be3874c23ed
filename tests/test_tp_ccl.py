"""Our NCCL library for TVM's disco: it builds against the nvidia-nccl-cu13 wheel, loads, and registers
every ``runtime.disco.nccl.*`` function disco routes to, in the controller, in worker threads and in
worker processes. CPU only: nothing here initializes NCCL (that needs a GPU, see tools/gpu)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("tvm")
pytest.importorskip("nvidia.nccl", reason="the tp extra (nvidia-nccl-cu13) is not installed")

from mqa_byoc import tp  # noqa: E402
from mqa_byoc.tp import ccl  # noqa: E402


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    try:
        path = tp.build_disco_nccl(tmp_path_factory.mktemp("disco_nccl"), progress=None)
    except tp.DiscoNcclUnavailable as e:  # no C++ compiler / CUDA headers: say so, do not pass
        pytest.skip(f"cannot build the disco NCCL library here: {e}")
    assert tp.load_disco_nccl(path) == path.resolve()
    return path


def test_the_stock_wheel_has_no_nccl_for_disco():
    code = ("import tvm, tvm_ffi, tvm.runtime.disco; "
            "print(tvm_ffi.get_global_func('runtime.disco.nccl.init_ccl', allow_missing=True) is None, "
            "tvm_ffi.get_global_func('runtime.disco.allreduce', allow_missing=True) is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_builds_against_the_nccl_wheel(library):
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True).stdout
    assert "[libnccl.so.2]" in needed and "[libtvm_runtime_extra.so]" in needed
    # cached: a second build returns the same file without compiling
    assert tp.build_disco_nccl(library.parent, progress=lambda m: pytest.fail(m)) == library


def test_registers_every_function_disco_routes_to(library):
    import tvm

    for name in tp.CCL_FUNCTIONS:
        assert callable(tvm.get_global_func(f"runtime.disco.nccl.{name}")), name
    header = (tp.nccl_dirs()[0] / "nccl.h").read_text()
    code = int(re.search(r"#define NCCL_VERSION_CODE (\d+)", header).group(1))
    assert tvm.get_global_func(ccl.VERSION_FUNCTION)() == code
    # loading again is a no-op that names the same library
    assert tp.load_disco_nccl() == library.resolve()


def test_collectives_before_init_name_the_fix(library):
    import tvm

    with pytest.raises(Exception, match=r"sync_worker: NCCL is not initialized.*init_ccl\(\"nccl\""):
        tvm.get_global_func("runtime.disco.nccl.sync_worker")()
    with pytest.raises(Exception, match=r"not a DiscoWorker thread"):
        tvm.get_global_func("runtime.disco.nccl.init_ccl_per_worker")(tvm.runtime.ShapeTuple([0]), b"x" * 128)


def _version_on_worker(sess, worker):
    ref = sess.call_packed(sess.get_global_func(ccl.VERSION_FUNCTION))
    return ref.debug_get_from_remote(worker)


def test_worker_threads_see_it(library):
    import tvm

    sess = tp.disco().ThreadedSession(2)
    try:
        for name in ("allreduce", "init_ccl_per_worker", "sync_worker"):
            sess.get_global_func(f"runtime.disco.nccl.{name}")  # a missing name would abort the worker
        assert _version_on_worker(sess, 1) == tvm.get_global_func(ccl.VERSION_FUNCTION)()
    finally:
        sess.shutdown()


@pytest.mark.slow
def test_worker_processes_load_it(library):
    import tvm

    sess = tp.disco().ProcessSession(2, entrypoint="mqa_byoc.tp.disco_worker")
    try:
        sess.get_global_func("runtime.disco.nccl.allgather")
        assert _version_on_worker(sess, 1) == tvm.get_global_func(ccl.VERSION_FUNCTION)()
    finally:
        sess.shutdown()


@pytest.mark.slow
def test_runtime_only_tvm_gets_disco_and_the_library(library):
    """A runtime-only TVM (TVM_USE_RUNTIME_LIB=1, what a deployment without the compiler runs) loads no disco
    library at import and leaves a half-made tvm.runtime.disco; tp.disco() repairs it, in the controller and
    in worker processes."""
    code = (
        "from mqa_byoc import tp\n"
        f"tp.load_disco_nccl({str(library)!r})\n"
        "d = tp.disco()\n"
        "s = d.ThreadedSession(1); s.get_global_func('runtime.disco.nccl.allreduce'); s.shutdown()\n"
        "p = d.ProcessSession(2, entrypoint='mqa_byoc.tp.disco_worker')\n"
        "ref = p.call_packed(p.get_global_func('" + ccl.VERSION_FUNCTION + "'))\n"
        "print('worker1', ref.debug_get_from_remote(1)); p.shutdown()\n")
    import os

    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    env.pop(tp.LIBRARY_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["worker1", str(_nccl_version_here())]


def _nccl_version_here():
    import tvm

    return tvm.get_global_func(ccl.VERSION_FUNCTION)()
