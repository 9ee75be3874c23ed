"""Write a runtime-only TVM kit: what a machine needs to run exported libraries without TVM's compiler.

The kit (``mqa-byoc runtime-kit --out DIR``)::

    DIR/site/tvm/               the installed tvm package without libtvm_compiler.so, headers and sources
    DIR/site/tvm_runtime_kit.py the set-up module (CUDA backend + nvcc hook), see tvm_runtime_kit.py
    DIR/wheels/                 apache-tvm-ffi and ml_dtypes for the run machine's Python (pip download)
    DIR/setup.sh                source it there: installs the wheels, sets PYTHONPATH and TVM_USE_RUNTIME_LIB=1
    DIR/kit.json                what the kit holds and for which Python and platform

On the run machine: ``source DIR/setup.sh``, then ``import tvm_runtime_kit`` before
``tvm.runtime.load_module`` (or ``python3 -m tvm_runtime_kit script.py``). ``tvm.relax`` does not
import there; load with ``tvm.runtime.load_module`` and ``tvm.runtime.vm.VirtualMachine``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: the set-up module's name in the kit (``import tvm_runtime_kit``)
KIT_MODULE = "tvm_runtime_kit"

#: the run machine's packages the runtime-only TVM imports (distribution names)
RUNTIME_WHEELS = ("apache-tvm-ffi", "ml_dtypes")

#: manylinux tags pip may pick for x86-64 Linux (newest first)
LINUX_X86_64 = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                "manylinux_2_17_x86_64", "manylinux2014_x86_64")

#: parts of the tvm package a runtime does not need (relative paths; the compiler library is most of it)
COMPILER_ONLY = ("lib/libtvm_compiler.so", "3rdparty", "include", "src", "web")

_SETUP_SH = """\
# Source this on the machine that runs the libraries: installs the kit's wheels and points Python at
# its runtime-only TVM. Then `import tvm_runtime_kit` before loading a library.
_kit=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
_deps="$_kit/deps"
if ! mkdir -p "$_deps" 2>/dev/null || [ ! -w "$_deps" ]; then _deps=$(mktemp -d); fi
if ls "$_kit"/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_deps" \\
    "$_kit"/wheels/*.whl || return 1
fi
export PYTHONPATH="$_kit/site:$_deps${PYTHONPATH:+:$PYTHONPATH}"
export TVM_USE_RUNTIME_LIB=1
"""


@dataclasses.dataclass
class RuntimeKit:
    """What :func:`write_runtime_kit` wrote."""

    path: Path
    tvm_version: str
    python_version: str
    platforms: tuple[str, ...]
    wheels: list[str]
    left_out: list[str]
    size_bytes: int

    def summary(self) -> str:
        """Lines for the command's output."""
        wheels = ", ".join(self.wheels) or "none (the run machine must have them installed)"
        return (f"wrote {self.path} ({self.size_bytes / 2**20:.1f} MiB): runtime-only tvm {self.tvm_version}, "
                f"wheels for Python {self.python_version}: {wheels}\n"
                f"left out of tvm: {', '.join(self.left_out)}\n"
                f"on the run machine: source {self.path}/setup.sh, then `import {KIT_MODULE}` before "
                "tvm.runtime.load_module (or python3 -m tvm_runtime_kit script.py)")


def tvm_package_dir() -> Path:
    """The installed ``tvm`` package (found without importing it)."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("apache-tvm is not installed: the kit is a copy of the installed tvm package")
    return Path(next(iter(spec.submodule_search_locations)))


def runtime_copy_ignored(root: Path):
    """A :func:`shutil.copytree` ``ignore`` that leaves out :data:`COMPILER_ONLY` and ``__pycache__``."""
    skip = {(root / p).resolve() for p in COMPILER_ONLY}

    def ignore(directory, names):
        d = Path(directory).resolve()
        return {n for n in names if n == "__pycache__" or (d / n) in skip}

    return ignore


def _download_wheels(dest: Path, python_version: str, platforms: Sequence[str], pip: Sequence[str]) -> list[str]:
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in RUNTIME_WHEELS]
    cmd = [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", *[a for p in platforms for a in ("--platform", p)], "-d", str(dest), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}\n"
                           "Offline: pass --no-wheels and install apache-tvm-ffi and ml_dtypes on the run machine")
    return sorted(p.name for p in dest.glob("*.whl"))


def write_runtime_kit(out, *, python_version: str = "3.12", platforms: Sequence[str] = LINUX_X86_64,
                      wheels: bool = True, pip: Sequence[str] | None = None) -> RuntimeKit:
    """Write the runtime-only kit to ``out`` (replaced if it exists).

    Parameters
    ----------
    out : path
        The kit's folder.
    python_version : str
        The run machine's Python (``X.Y``), for the wheels.
    platforms : sequence of str
        pip platform tags of the run machine.
    wheels : bool
        Download the wheels of :data:`RUNTIME_WHEELS` (pip, so index and proxy settings apply); False:
        the run machine has them.
    pip : sequence of str, optional
        The pip command (default ``python -m pip`` of this interpreter).

    Returns
    -------
    RuntimeKit
    """
    out = Path(out)
    tvm_dir = tvm_package_dir()
    if out.resolve() == tvm_dir.resolve() or tvm_dir.resolve() in out.resolve().parents:
        raise ValueError(f"the kit cannot go inside the tvm package ({tvm_dir})")
    if out.exists():
        shutil.rmtree(out)
    site = out / "site"
    shutil.copytree(tvm_dir, site / "tvm", ignore=runtime_copy_ignored(tvm_dir))
    shutil.copy2(Path(__file__).with_name(f"{KIT_MODULE}.py"), site / f"{KIT_MODULE}.py")
    (out / "wheels").mkdir()
    names = (_download_wheels(out / "wheels", python_version, platforms, pip or [sys.executable, "-m", "pip"])
             if wheels else [])
    (out / "setup.sh").write_text(_SETUP_SH)
    kit = RuntimeKit(path=out, tvm_version=importlib.metadata.version("apache-tvm"), python_version=python_version,
                     platforms=tuple(platforms), wheels=names,
                     left_out=[p for p in COMPILER_ONLY if (tvm_dir / p).exists()], size_bytes=0)
    record = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(kit).items()
              if k not in ("path", "size_bytes")}
    (out / "kit.json").write_text(json.dumps({**record, "module": KIT_MODULE}, indent=2) + "\n")
    kit.size_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return kit


def main_args(args) -> int:
    """``mqa-byoc runtime-kit`` with parsed arguments."""
    try:
        kit = write_runtime_kit(args.out, python_version=args.python_version, platforms=args.platform or LINUX_X86_64,
                                wheels=not args.no_wheels)
    except (RuntimeError, ValueError) as e:
        print(f"mqa-byoc runtime-kit: error: {e}", file=sys.stderr)
        return 1
    print(kit.summary())
    return 0

