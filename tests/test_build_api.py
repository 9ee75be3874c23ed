"""``mqa_byoc.build``: one call for partition -> RunCodegen -> relax.build, the same as the explicit steps.

Built for a CUDA target on the CPU machine: nothing runs, the executables' generated FA2 sources are compared.
"""

from __future__ import annotations

import re

import pytest

tvm = pytest.importorskip("tvm")
relax = pytest.importorskip("tvm.relax")

from mqa_byoc.testing import graphs  # noqa: E402
import mqa_byoc  # noqa: E402
from mqa_byoc.compiler import kernel_options  # noqa: E402
from mqa_byoc.compiler.provider import build_provider  # noqa: E402
from mqa_byoc.compiler.link import iter_modules, root_module  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90"}


def fa2_sources(ex) -> dict[str, str]:
    """{exported FA2 function: the generated source that defines it} of an executable."""
    out = {}
    for m in iter_modules(root_module(ex)):
        if m.kind in ("c", "source"):
            src = m.inspect_source()
            out.update({sym: src for sym in re.findall(r"TVM_FFI_DLL_EXPORT_TYPED_FUNC\((\w+),", src)})
    out.pop(kernel_options.QUERY_FUNCTION, None)  # the library's kernel options, not an FA2 function
    return out


def explicit(mod, mqa: bool, provider: str):
    """The README's long form."""
    target = tvm.target.Target(TARGET)
    part = mqa_byoc.partition_for_cutlass(mod, mqa=mqa, provider=provider)
    with target:
        part = relax.transform.RunCodegen()(part)
        return relax.build(part, target=target)


@pytest.mark.parametrize("mqa", [True, False])
def test_build_equals_explicit_steps(mqa):
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    ours = fa2_sources(mqa_byoc.build(mod, TARGET, mqa=mqa, provider="python"))
    want = fa2_sources(explicit(mod, mqa, "python"))
    assert ours and ours == want
    src = next(iter(ours.values()))
    assert "provider: python" in src
    # mqa=True passes the 2 K/V heads natively; mqa=False the expanded 8
    assert f"kNumKVHeads = {2 if mqa else 8};" in src


def test_build_offloads_with_native_heads():
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    ex = mqa_byoc.build(mod, TARGET, provider="python")
    text = ex.as_text()
    assert "flash_attn" in text  # the VM calls the offloaded function
    assert "repeat" not in text  # the K/V expansion is gone with mqa=True
    ex_nomqa = mqa_byoc.build(mod, TARGET, mqa=False, provider="python")
    assert "repeat" in ex_nomqa.as_text()


def test_build_provider_resolved_once():
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    native = fa2_sources(mqa_byoc.build(mod, TARGET, provider="native"))
    assert native and all("mqa_byoc-kernels: hdim64 fp16" in s for s in native.values())
    python = fa2_sources(mqa_byoc.build(mod, TARGET, provider="python"))
    assert python and all("provider: python" in s for s in python.values())
    # no provider: the default rule for the build's target, decided once by the provider module
    chosen = build_provider(None, TARGET)
    assert chosen in ("native", "hopper", "python")
    assert fa2_sources(mqa_byoc.build(mod, TARGET)) == fa2_sources(mqa_byoc.build(mod, TARGET, provider=chosen))
    with pytest.raises(ValueError, match="unknown flash_attn provider"):
        mqa_byoc.build(mod, TARGET, provider="cuda")


def test_build_of_a_partitioned_module():
    """mqa=None: the module is already partitioned; a provider recorded by the partition wins."""
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    part = mqa_byoc.partition_for_cutlass(mod, mqa=True, provider="python")
    ours = fa2_sources(mqa_byoc.build(part, TARGET, mqa=None, provider="native"))
    assert ours == fa2_sources(explicit(mod, True, "python"))


@pytest.mark.parametrize("target", ["llvm", {"kind": "llvm"}])
def test_build_for_a_target_that_is_not_cuda_is_refused_naming_the_fix(target):
    mod = graphs.hf_repeat_kv_chain(h=8, hkv=2, d=64, s=16)
    with pytest.raises(ValueError, match=r"the target is 'llvm'.*give a CUDA target"):
        mqa_byoc.build(mod, target)


@pytest.mark.parametrize("what", ["module", "path"])
def test_export_library_of_something_else_than_an_executable_is_a_type_error(what, tmp_path):
    arg = graphs.hf_repeat_kv_chain(h=8, hkv=2, d=64, s=16) if what == "module" else str(tmp_path / "x.so")
    with pytest.raises(TypeError, match="expected the executable mqa_byoc.build"):
        mqa_byoc.export_library(arg, tmp_path / "model.so")


@pytest.mark.parametrize("call, match", [
    (lambda mod: mqa_byoc.build(mod, TARGET, pipeline=42), r"pipeline=\) takes None, a pipeline name"),
    (lambda mod: mqa_byoc.build(mod, TARGET, mqa="yes"), r"build\(mqa=\) takes True, False or None, got 'yes'"),
    (lambda mod: mqa_byoc.build(mod, TARGET, gemm=1), r"build\(gemm=\) takes True or False, got 1"),
    (lambda mod: mqa_byoc.partition_for_cutlass(mod, mqa="False"), r"partition_for_cutlass\(mqa=\) takes"),
    (lambda mod: mqa_byoc.partition_for_cutlass(mod, use_flash_mqa=0), r"use_flash_mqa=\) takes"),
    (lambda mod: mqa_byoc.partition_for_cutlass(mod, gemm="no"), r"partition_for_cutlass\(gemm=\) takes"),
    (lambda mod: mqa_byoc.offload_report(mod, mqa="yes"), r"offload_report\(mqa=\) takes"),
])
def test_switches_and_pipeline_of_a_wrong_type_are_type_errors(call, match):
    """A string "False" would count as True, a number as a pipeline fails deep inside relax.build: both are
    refused up front, naming the argument."""
    with pytest.raises(TypeError, match=match):
        call(graphs.hf_repeat_kv_chain(h=8, hkv=2, d=64, s=16))


def test_switches_take_numpy_bools():
    import numpy as np

    mod = graphs.hf_repeat_kv_chain(h=8, hkv=2, d=64, s=16)
    assert [s.offloaded for s in mqa_byoc.offload_report(mod, mqa=np.bool_(True))] == [True]


@pytest.mark.parametrize("target", ["llvm", {"kind": "llvm"}])
def test_offload_report_for_a_target_that_is_not_cuda_is_refused(target):
    """What build refuses is not reported as offloaded."""
    mod = graphs.hf_repeat_kv_chain(h=8, hkv=2, d=64, s=16)
    with pytest.raises(ValueError, match=r"offload_report: the target is 'llvm'.*give a CUDA target"):
        mqa_byoc.offload_report(mod, target=target)
