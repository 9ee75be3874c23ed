"""Export against a prebuilt kernel dir (``build-kernels --out DIR``; ``MQA_BYOC_KERNEL_DIR=DIR``).

Objects made by earlier builds must still be found (same cache keys and object names), and export then
needs no nvcc and no flash-attn sources. Runs when ``MQA_BYOC_KERNEL_DIR`` names such a directory with
sm_90 hdim64 fp16 kernels; skips saying so otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from mqa_byoc import kernels as K
from mqa_byoc.compiler.graph.spec import AttentionSpec

SPEC = AttentionSpec(8, 2, 64, 64, "float16", AttentionSpec.default_scale(64), True)


def _prebuilt_or_skip():
    if not os.environ.get("MQA_BYOC_KERNEL_DIR"):
        pytest.skip("MQA_BYOC_KERNEL_DIR not set (a `mqa-byoc build-kernels --out DIR` directory)")
    keys = K.plan_kernels(SPEC)
    found = K.find_kernels(keys, "sm_90")
    if len(found) != len(keys):
        pytest.skip(f"MQA_BYOC_KERNEL_DIR has no sm_90 objects for {', '.join(k.label for k in keys)}")
    return keys, found


def test_prebuilt_dir_has_this_codes_dispatcher_and_kernels(monkeypatch):
    keys, found = _prebuilt_or_skip()
    monkeypatch.setenv("MQA_BYOC_NVCC", "")  # no toolchain needed
    (d,) = {p.parent for p in found.values()}
    assert (d / K.cache.dispatcher_name()).is_file()  # the dispatcher name has not changed
    objects, libs = K.link_inputs([SPEC], "sm_90", build=False, progress=None)
    assert objects[0] == str(d / K.cache.dispatcher_name())
    # the split-KV decode kernels, also from the prebuilt dir (copy_artifacts puts them there)
    assert objects[1] == str(K.build.support_object("sm_90", None)) and objects[1].startswith(str(d))
    assert sorted(objects[2:]) == sorted(str(d / f"{k.stem}.o") for k in keys)
    assert libs[0] == str(d / "libcudart_static.a")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_export_links_prebuilt_kernels_without_toolchain(monkeypatch, tmp_path):
    keys, _ = _prebuilt_or_skip()
    tvm = pytest.importorskip("tvm")
    from mqa_byoc.testing.graphs import import_c_source, site_call_executable
    from tvm import relax

    from mqa_byoc.compiler import export as E
    from mqa_byoc.compiler.codegen.native import emit_native_source

    monkeypatch.setenv("MQA_BYOC_NVCC", "")
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("MQA_BYOC_FLASH_ATTN_SRC", raising=False)

    ex, q, kv = site_call_executable("mqa_site0")
    import_c_source(ex, emit_native_source("mqa_site0", SPEC).code, ["mqa_site0"])
    path = tmp_path / "native.so"
    E.export_library(ex, path, arch="sm_90", build=False, progress=None)
    syms = subprocess.run(["nm", str(path)], capture_output=True, text=True).stdout
    for k in keys:  # every planned kernel is defined in the library, not left weak
        assert re.search(rf" [Tt] {k.entry_symbol}\b", syms), k.entry_symbol
    assert re.search(r" [Tt] mqa_byoc_fa2_forward\b", syms)
    lib = tvm.runtime.load_module(str(path))
    vm = relax.VirtualMachine(lib, tvm.cpu())
    with pytest.raises(Exception, match="mqa_site0: q must be on a CUDA device"):
        vm["main"](q, kv, kv)
