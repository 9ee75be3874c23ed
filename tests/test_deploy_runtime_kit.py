"""``mqa-byoc runtime-kit``: the runtime-only TVM kit of the cross-compiling flow, written and used on the CPU.

The kit is written without wheels (the test's interpreter has apache-tvm-ffi and ml_dtypes); a fresh
shell sources its ``setup.sh`` and, with the kit's tvm copy first on ``PYTHONPATH`` and
``TVM_USE_RUNTIME_LIB=1``, imports the set-up module, finds the nvcc hook registered and ``tvm.relax``
absent, and runs a library compiled here by the full TVM (llvm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mqa_byoc.cli import build_parser, main
from mqa_byoc.deploy import KIT_MODULE, write_runtime_kit
from mqa_byoc.deploy import runtime_kit as rk


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit") / "runtime-kit"
    assert main(["runtime-kit", "--out", str(out), "--no-wheels"]) == 0
    return out


def test_kit_holds_a_runtime_only_tvm(kit):
    tvm_copy = kit / "site" / "tvm"
    assert (tvm_copy / "__init__.py").is_file()
    assert (tvm_copy / "lib" / "libtvm_runtime.so").is_file()
    assert (tvm_copy / "lib" / "libtvm_runtime_cuda.so").is_file()
    assert not (tvm_copy / "lib" / "libtvm_compiler.so").exists()
    for part in ("include", "3rdparty", "src"):
        assert not (tvm_copy / part).exists(), part
    assert not list(kit.rglob("__pycache__"))
    assert (kit / "site" / f"{KIT_MODULE}.py").read_text() == Path(rk.__file__).with_name(f"{KIT_MODULE}.py").read_text()
    record = json.loads((kit / "kit.json").read_text())
    assert record["module"] == KIT_MODULE and record["wheels"] == []
    assert "lib/libtvm_compiler.so" in record["left_out"]
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    assert size < 40 * 2**20, size  # the compiler library (~260 MB) is what makes the wheel large


def test_set_up_module_stands_alone():
    """The kit's module imports nothing of mqa_byoc: the run machine need not have the project."""
    source = Path(rk.__file__).with_name(f"{KIT_MODULE}.py").read_text()
    assert "mqa_byoc" not in source.split('"""', 2)[2]  # the code after the docstring


_IN_KIT = textwrap.dedent("""
    import os, sys, warnings
    warnings.simplefilter("ignore", RuntimeWarning)  # no CUDA driver on the CPU machine: said, not fatal
    import tvm_runtime_kit
    import tvm, tvm_ffi
    assert tvm.__file__.startswith(os.environ["KIT"]), tvm.__file__
    assert tvm_ffi.get_global_func("tvm_callback_cuda_compile") is not None
    import tvm.support.nvcc  # noqa: F401 - TVM's own hook, which needs the compiler library, must not win
    try:
        tvm_ffi.get_global_func("tvm_callback_cuda_compile")("__global__ void k() {}", "fatbin")
    except Exception as err:  # no GPU (or no nvcc) here: the kit's hook says so in its own words
        assert "tvm_runtime_kit:" in str(err), err
    try:
        import tvm.relax  # noqa: F401
        raise SystemExit("tvm.relax imported from the runtime-only kit")
    except (ImportError, AttributeError):
        pass
    import numpy as np
    from tvm.runtime.vm import VirtualMachine
    vm = VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
    x = np.arange(6, dtype="float32").reshape(2, 3)
    out = vm["main"](tvm.runtime.tensor(x, tvm.cpu()), tvm.runtime.tensor(x, tvm.cpu())).numpy()
    assert np.array_equal(out, x + x), out
    print("RAN", tvm_runtime_kit.runtime_only())
""")


def test_library_compiled_here_runs_in_the_kit(kit, tmp_path):
    from tvm import relax

    bb = relax.BlockBuilder()
    a, b = (relax.Var(n, relax.TensorType((2, 3), "float32")) for n in "ab")
    with bb.function("main", [a, b]):
        bb.emit_func_output(bb.emit(relax.op.add(a, b)))
    lib = tmp_path / "add.so"
    relax.build(bb.get(), target="llvm").export_library(str(lib))
    script = tmp_path / "run.py"
    script.write_text(_IN_KIT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TVM_USE_RUNTIME_LIB")}
    env.update(KIT=str(kit), PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    proc = subprocess.run(["bash", "-c", f'source "{kit}/setup.sh" && python3 "{script}" "{lib}"'], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "RAN True" in proc.stdout


def test_wheels_are_downloaded_for_the_run_machine(tmp_path):
    """The pip command asks for the run machine's Python and platform and this machine's versions."""
    fake_pip = tmp_path / "pip.py"
    fake_pip.write_text(textwrap.dedent("""
        import pathlib, sys
        args = sys.argv[1:]
        dest = pathlib.Path(args[args.index("-d") + 1])
        (dest / "args.txt").write_text(" ".join(args))
        for spec in args[args.index("-d") + 2:]:
            name, version = spec.split("==")
            (dest / f"{name.replace('-', '_')}-{version}-cp39-cp39-manylinux_2_28_x86_64.whl").write_text("")
    """))
    kit = write_runtime_kit(tmp_path / "k", python_version="3.9", platforms=["manylinux_2_28_x86_64"],
                            pip=[sys.executable, str(fake_pip)])
    args = (tmp_path / "k" / "wheels" / "args.txt").read_text()
    assert "--python-version 3.9" in args and "--platform manylinux_2_28_x86_64" in args
    assert "--only-binary=:all:" in args and "--no-deps" in args
    import importlib.metadata as md
    assert f"apache-tvm-ffi=={md.version('apache-tvm-ffi')}" in args
    assert len(kit.wheels) == 2 and all(w.endswith(".whl") for w in kit.wheels)


def test_failed_download_names_the_offline_way(tmp_path, capsys):
    failing = tmp_path / "pip.py"
    failing.write_text("import sys; sys.exit('no index')\n")
    with pytest.raises(RuntimeError, match="--no-wheels"):
        write_runtime_kit(tmp_path / "k", pip=[sys.executable, str(failing)])


def test_command_line():
    ns = build_parser().parse_args(["runtime-kit", "--out", "kit", "--python-version", "3.11",
                                    "--platform", "manylinux_2_28_x86_64"])
    assert ns.out == "kit" and ns.python_version == "3.11" and ns.platform == ["manylinux_2_28_x86_64"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["runtime-kit"])  # --out is required
