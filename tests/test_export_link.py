"""Export: kernel options compiled into the library, kernel objects attached as static-library modules
(so TVM's own ``export_library`` links them), TVM's CUDA kernels compiled ahead of time.

Runs on CPU. The ``slow`` tests compile the dispatcher and our support objects (seconds to a minute,
cached) and skip without nvcc / flash-attn's sources / g++; the FA2 kernel objects they link are
stand-ins that define the kernel entry symbols (what is linked is checked, nothing runs).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

tvm = pytest.importorskip("tvm")

from mqa_byoc.testing import graphs  # noqa: E402
import mqa_byoc  # noqa: E402
from mqa_byoc import kernels as K  # noqa: E402
from mqa_byoc.compiler import cuda_binary, kernel_options, link  # noqa: E402
from mqa_byoc.compiler.kernel_options import KernelOptions  # noqa: E402
from mqa_byoc.compiler.graph.spec import AttentionSpec  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90"}


def _available(fn):
    try:
        fn()
        return True
    except K.NativeKernelsUnavailable:
        return False


HAVE_NVCC = _available(K.find_nvcc)
HAVE_FA = _available(lambda: K.flash_attn_source(download=False, progress=lambda _m: None))
needs_dispatcher = pytest.mark.skipif(
    not (HAVE_NVCC and HAVE_FA and shutil.which("g++")),
    reason="needs nvcc, flash-attn's sources (MQA_BYOC_FLASH_ATTN_SRC) and g++ to compile the dispatcher")
needs_nvcc = pytest.mark.skipif(not (HAVE_NVCC and shutil.which("g++")), reason="nvcc or g++ not found")


def _defined(path) -> str:
    return subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout


# ------------------------------------------------------------------------------------ kernel options


def test_kernel_options_forms_and_codes():
    assert KernelOptions.of(None) == KernelOptions() and KernelOptions().is_default()
    a = KernelOptions.of({"hopper_fa4": "always", "decode_kernel": "fa2"})
    assert a == KernelOptions.of("hopper_fa4=always, decode_kernel=fa2") == KernelOptions.of(a)
    assert a.codes() == (1, 0, 0, 1, 0, 0, 0)  # field order of fa2_dispatch.h's mqa_byoc_kernel_options
    assert KernelOptions(decode_merge="cluster", split_combine="fa2", hopper_fa4="never").codes() == (0, 2, 1, 2, 0, 0, 0)
    assert KernelOptions(gemm_algorithm="heuristic").codes() == (0, 0, 0, 0, 1, 0, 0)
    assert KernelOptions(gemm_gemv="always").codes() == (0, 0, 0, 0, 0, 2, 0)
    assert KernelOptions(launch_overlap="prefetch").codes() == (0, 0, 0, 0, 0, 0, 2)
    assert KernelOptions.of(a.describe()) == a


@pytest.mark.parametrize("bad,match", [
    ({"decode_kernel": "fast"}, r"decode_kernel='fast': expected one of \('auto', 'fa2'\)"),
    ({"hopper": "always"}, r"unknown choice\(s\) \['hopper'\]"),
    ("hopper_fa4", "name=value pairs"),
])
def test_kernel_options_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        KernelOptions.of(bad)


def test_struct_layout_matches_the_dispatcher_header():
    header = (K.NATIVE_DIR / "fa2_dispatch.h").read_text()
    struct = re.search(r"typedef struct \{(.*?)\} mqa_byoc_kernel_options;", header, re.S).group(1)
    assert re.findall(r"int (\w+);", struct) == [f for f in kernel_options.CHOICES]
    assert list(KernelOptions.__dataclass_fields__) == list(kernel_options.CHOICES)


def test_no_kernel_switch_is_read_from_the_environment():
    """The library reads one variable (MQA_BYOC_NVTX, a profiling aid); the hopper wrappers none."""
    dispatcher = (K.NATIVE_DIR / "fa2_dispatch.cc").read_text()
    assert "getenv" not in dispatcher and '#include "nvtx_switch.h"' in dispatcher
    assert re.findall(r'getenv\("(\w+)"\)', (K.NATIVE_DIR / "nvtx_switch.h").read_text()) == ["MQA_BYOC_NVTX"]
    for name in ("fa2_paged.cu", "gqa_decode.cu", "fa4_decode.cu", "split_kv_combine.cu", "fa4_glue.cc"):
        assert "getenv" not in (K.NATIVE_DIR / name).read_text(), name
    from mqa_byoc.compiler.codegen import hopper as hopper_codegen

    spec = AttentionSpec(32, 8, 128, 128, "float16", AttentionSpec.default_scale(128), True, -1, -1)
    code = "".join(hopper_codegen.fragments(hopper_codegen.kernel_key(spec), hopper_codegen.decode_key(spec)).values())
    assert "getenv" not in code and kernel_options.SYMBOL in code


def test_offload_report_names_the_kernel_options():
    mod = graphs.attention_repeat_bsnh(h=32, hkv=8, d=128, b=1, s=1, s_kv=64)
    [default] = mqa_byoc.offload_report(mod, target=TARGET, provider="native")
    assert "decode: our grouped-query decode kernel" in default.kernel
    assert default.kernel_options == KernelOptions().describe()
    [fa2] = mqa_byoc.offload_report(mod, target=TARGET, provider="native",
                                    kernel_options={"decode_kernel": "fa2", "split_combine": "fa2"})
    assert "decode: FA2 split-KV with FA2's combine" in fa2.kernel and "decode_kernel=fa2" in fa2.kernel_options
    [hop] = mqa_byoc.offload_report(mod, target=TARGET, provider="hopper", kernel_options="hopper_fa4=always")
    assert "for every call it can compute (kernel option hopper_fa4=always)" in hop.kernel
    [py] = mqa_byoc.offload_report(mod, target=TARGET, provider="python", kernel_options="hopper_fa4=always")
    assert py.kernel_options is None


def test_build_attaches_the_options_module():
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    ex = mqa_byoc.build(mod, TARGET, provider="native", kernel_options={"decode_merge": "global"})
    sources = [m.inspect_source() for m in link.iter_modules(ex) if m.kind == "c"]
    opts = [s for s in sources if kernel_options.SYMBOL in s and "TVM_FFI_DLL_EXPORT_TYPED_FUNC" in s]
    assert len(opts) == 1 and "= {0, 1, 0, 0, 0, 0, 0};" in opts[0] and '"decode_kernel=auto,decode_merge=global,' in opts[0]
    # the python provider links nothing and gets no options module
    ex = mqa_byoc.build(mod, TARGET, provider="python", kernel_options={"decode_merge": "global"})
    assert not any(kernel_options.SYMBOL in m.inspect_source() for m in link.iter_modules(ex) if m.kind == "c")
    with pytest.raises(ValueError, match="expected one of"):
        mqa_byoc.build(mod, TARGET, provider="native", kernel_options={"decode_merge": "sometimes"})


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_exported_library_reports_its_options(tmp_path):
    ex, _q, _kv = graphs.site_call_executable("mqa_site0")
    opts = KernelOptions(hopper_fa4="always", split_combine="fa2")
    graphs.import_c_source(ex, kernel_options.c_source(opts), [kernel_options.QUERY_FUNCTION])
    path = tmp_path / "opts.so"
    ex.export_library(str(path))
    lib = tvm.runtime.load_module(str(path))
    assert lib.get_function(kernel_options.QUERY_FUNCTION, True)() == opts.describe()
    syms = _defined(path)
    assert re.search(rf" [rR] {kernel_options.SYMBOL}$", syms, re.M)  # the constant, read-only, in the library


# ------------------------------------------------------------------------------------ static-library modules


def _stand_in_kernel_dir(root, keys):
    """A prebuilt-kernel directory (``MQA_BYOC_KERNEL_DIR`` layout) whose objects define the kernel
    entry symbols of ``keys`` with empty bodies: enough to test what is linked, nothing to run."""
    d = root / "sm_90-standin"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text('{"arch": "sm_90"}')
    for key in keys:
        src = d / f"{key.stem}.cc"
        src.write_text(f'extern "C" void {key.entry_symbol}(void*, void*) {{}}\n')
        subprocess.run(["g++", "-c", "-fPIC", str(src), "-o", str(d / f"{key.stem}.o")], check=True)
    return root


@pytest.mark.slow
@needs_dispatcher
def test_plain_export_links_the_attached_kernel_objects(tmp_path, monkeypatch):
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    keys = K.plan_kernels(AttentionSpec(8, 2, 64, 64, "float16", AttentionSpec.default_scale(64), True))
    assert len(keys) >= 2  # causal and non-causal families of hdim64 fp16
    first, rest = keys[:1], keys[1:]
    # a kernel cache without FA2 kernel objects (this machine's may hold them all): its dispatcher, decode
    # support object and flash-attn sources are the user cache's, the kernels only the stand-ins below
    real = K.cache_root()
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    for sub in ("fa2/dispatch", "fa2/support", "src"):
        (real / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / sub).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / sub).symlink_to(real / sub, target_is_directory=True)
    monkeypatch.setenv("MQA_BYOC_KERNEL_DIR", str(_stand_in_kernel_dir(tmp_path / "some", first)))
    ex = mqa_byoc.build(mod, TARGET, provider="native", kernel_options={"decode_kernel": "fa2"})
    assert link.Needs.of(ex).fa2 == keys
    libs = [m for m in link.iter_modules(ex) if m.kind == "static_library"]
    assert len(libs) == 1 and libs[0].implements_function(link.DISPATCHER_SYMBOL)
    assert link.attached_names(ex, link.Needs.of(ex).names()) == {link.DISPATCHER_SYMBOL, first[0].entry_symbol}

    path = tmp_path / "plain.so"
    ex.export_library(str(path))  # TVM's own export
    syms = _defined(path)
    for name in ("mqa_byoc_fa2_forward", "mqa_byoc_combine_chunks", "cudaLaunchKernel", first[0].entry_symbol):
        assert re.search(rf" [Tt] {name}$", syms, re.M), name  # dispatcher, decode support, static cudart, kernel
    assert re.search(rf" [rR] {kernel_options.SYMBOL}$", syms, re.M)
    assert not any(re.search(rf" [Tt] {k.entry_symbol}$", syms, re.M) for k in rest)  # not built: left out
    assert "libcudart" not in subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)  # every symbol resolves

    # mqa_byoc.export_library links only what the build could not attach
    with pytest.raises(K.NativeKernelsUnavailable, match="mqa-byoc build-kernels"):
        mqa_byoc.export_library(ex, tmp_path / "x.so", arch="sm_90", build=False, progress=None)
    monkeypatch.setenv("MQA_BYOC_KERNEL_DIR", str(_stand_in_kernel_dir(tmp_path / "all", keys)))
    mqa_byoc.export_library(ex, tmp_path / "full.so", arch="sm_90", build=False, progress=None)
    syms = _defined(tmp_path / "full.so")
    for key in keys:
        assert len(re.findall(rf" [Tt] {key.entry_symbol}$", syms, re.M)) == 1, key
    assert len(re.findall(r" [Tt] mqa_byoc_fa2_forward$", syms, re.M)) == 1


def test_attached_names_and_needs_of_a_python_build():
    mod = graphs.attention_repeat_bsnh(h=8, hkv=2, d=64, b=1, s=32)
    ex = mqa_byoc.build(mod, TARGET, provider="python")
    assert not link.Needs.of(ex) and link.attached_names(ex, {link.DISPATCHER_SYMBOL}) == set()


# ------------------------------------------------------------------------------------ TVM's CUDA kernels


def _add_module():
    from tvm.script import relax as R

    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", R.Tensor((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(tvm.relax.op.add(tvm.relax.op.exp(x), x))
        bb.emit_func_output(y)
    return bb.get()


@pytest.mark.slow
@needs_nvcc
def test_cuda_binary_leaves_no_cuda_source_in_the_library(tmp_path):
    plain = mqa_byoc.build(_add_module(), TARGET, mqa=None)
    assert cuda_binary.cuda_source_modules(plain)  # what TVM keeps without a CUDA driver: source
    plain.export_library(str(tmp_path / "source.so"))
    assert b'extern "C" __global__' in (tmp_path / "source.so").read_bytes()  # each of TVM's kernels

    ex = mqa_byoc.build(_add_module(), TARGET, mqa=None, cuda_binary=True)
    assert not cuda_binary.cuda_source_modules(ex)
    cuda = [m for m in link.iter_modules(ex) if m.kind == "cuda"]
    assert len(cuda) == 1 and cuda_binary.binary_format(cuda[0]) == "fatbin" and not cuda[0].inspect_source("cuda")
    ex.export_library(str(tmp_path / "binary.so"))
    data = (tmp_path / "binary.so").read_bytes()
    assert b'extern "C" __global__' not in data and b"__global__" not in data
    # the saved module: format "fatbin", then the function table, then the fatbin (its magic 0xBA55ED50)
    assert b"\x06\x00\x00\x00\x00\x00\x00\x00fatbin" in data and b"\x50\xed\x55\xba" in data
    assert cuda_binary.compile_cuda_modules(ex, "sm_90") == 0  # nothing left to compile


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_cpp_decoder_runner_builds_against_the_runtime_alone(tmp_path):
    """tools/cpp/run_decoder.cc (run on the GPU by tests/gpu/test_gpu_cpp_runtime.py) needs tvm-ffi's
    headers and TVM's runtime library only: no TVM compiler headers, no Python."""
    import tvm_ffi.libinfo as ffi_info

    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ffi_lib = Path(ffi_info.find_libtvm_ffi()).parent
    tvm_lib = Path(tvm.__file__).resolve().parent / "lib"
    exe = tmp_path / "run_decoder"
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-o", str(exe),
                        str(root / "tools" / "cpp" / "run_decoder.cc"), f"-I{ffi_info.find_include_path()}",
                        f"-I{ffi_info.find_dlpack_include_path()}", f"-L{ffi_lib}", f"-L{tvm_lib}",
                        "-Wl,--no-as-needed", "-ltvm_ffi", "-ltvm_runtime", f"-Wl,-rpath,{ffi_lib}:{tvm_lib}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 2 and "usage: run_decoder" in out.stderr
    needed = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert "libtvm_runtime.so" in needed and "libpython" not in needed and "libtvm_compiler" not in needed
