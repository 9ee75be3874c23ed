"""Native FA2 forward kernels: fetch flash-attn's sources, compile kernel objects with nvcc, cache them.

Nothing here imports TVM. The pieces:

- :class:`KernelKey` names one compiled kernel family (head dim, dtype, causal, split-KV); the arch
  (``sm_90``) is chosen at build/export time. :func:`plan_kernels` says which keys one attention needs.
- :func:`flash_attn_source` finds or fetches flash-attn's source tree (pinned version, sha256 checked).
- :func:`build_kernels` / :func:`build_dispatcher` compile objects into the cache
  (``$MQA_BYOC_CACHE`` or ``~/.cache/mqa_byoc``), keyed by flash-attn version, arch, nvcc and host
  compiler versions, flags and our own native sources.
- :func:`link_inputs` returns everything ``export_library`` must link (dispatcher, kernels, static cudart).
- :func:`main` is the ``mqa-byoc build-kernels`` command.

A directory of prebuilt objects (``build-kernels --out DIR``, e.g. ``.gpu-artifacts/fa2``) can be used
on another machine with ``MQA_BYOC_KERNEL_DIR=DIR``; it is searched before the cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures as _futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

FLASH_ATTN_VERSION = "2.8.3"
FLASH_ATTN_URL = (
    "https://files.pythonhosted.org/packages/3b/b2/"
    "8d76c41ad7974ee264754709c22963447f7f8134613fd9ce80984ed0dab7/flash_attn-2.8.3.tar.gz"
)
FLASH_ATTN_SHA256 = "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d"

#: head dims FA2 has forward kernels for; a head dim D runs on the smallest one >= D
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
#: short dtype names used in kernel names, with the CUTLASS element type
DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}  # fmt: skip
DEFAULT_ARCH = "sm_90"
#: namespace flash-attn's templates are compiled into (keeps them apart from a flash_attn wheel's)
FLASH_NAMESPACE = "mqa_byoc_flash"
#: marker line the codegen puts into each emitted wrapper; export reads it back
MARKER = "// mqa_byoc-kernels:"

NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"
_ENTRY_SOURCE = NATIVE_DIR / "fa2_kernel_entry.cu"
_DISPATCH_SOURCE = NATIVE_DIR / "fa2_dispatch.cc"
_LINK_CHECK_SOURCE = NATIVE_DIR / "fa2_link_check.cc"
_SHIM_DIR = NATIVE_DIR / "shim"

_NVCC_CANDIDATES = ("/usr/local/cuda/bin/nvcc",)


class NativeKernelsUnavailable(RuntimeError):
    """The native FA2 kernels cannot be built or found here (no nvcc, no sources, not built)."""


# ---------------------------------------------------------------------------------------------
# kernel keys and planning


@dataclasses.dataclass(frozen=True, order=True)
class KernelKey:
    """One FA2 forward kernel family: ``run_mha_fwd_`` (split=False) or the split-KV dispatch."""

    head_dim: int  # a member of KERNEL_HEAD_DIMS
    dtype: str  # "fp16" | "bf16"
    causal: bool
    split: bool

    def __post_init__(self):
        if self.head_dim not in KERNEL_HEAD_DIMS:
            raise ValueError(f"no FA2 kernel for head dim {self.head_dim}; have {KERNEL_HEAD_DIMS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {tuple(DTYPES)}")

    @property
    def stem(self) -> str:
        """``fwd[_split]_hdim128_fp16[_causal]``: object file stem."""
        split = "_split" if self.split else ""
        causal = "_causal" if self.causal else ""
        return f"fwd{split}_hdim{self.head_dim}_{self.dtype}{causal}"

    @property
    def entry_symbol(self) -> str:
        """The extern "C" entry the dispatcher calls (weakly referenced)."""
        return "mqa_byoc_fa2_" + self.stem

    @property
    def flash_attn_file(self) -> str:
        """flash-attn's own translation unit instantiating this kernel family."""
        split = "_split" if self.split else ""
        causal = "_causal" if self.causal else ""
        return f"flash_fwd{split}_hdim{self.head_dim}_{self.dtype}{causal}_sm80.cu"

    @property
    def label(self) -> str:
        """``hdim128 fp16 causal split`` (the form used in markers and messages)."""
        words = [f"hdim{self.head_dim}", self.dtype]
        if self.causal:
            words.append("causal")
        if self.split:
            words.append("split")
        return " ".join(words)

    @classmethod
    def parse(cls, label: str) -> KernelKey:
        """Inverse of :attr:`label`; an ``sm_XX`` word, if present, is ignored."""
        words = label.split()
        hdim = dtype = None
        causal = split = False
        for w in words:
            if w.startswith("hdim"):
                hdim = int(w[4:])
            elif w in DTYPES:
                dtype = w
            elif w == "causal":
                causal = True
            elif w == "split":
                split = True
            elif re.fullmatch(r"sm_?\d+a?", w):
                continue
            else:
                raise ValueError(f"bad kernel label {label!r}: unknown word {w!r}")
        if hdim is None or dtype is None:
            raise ValueError(f"bad kernel label {label!r}")
        return cls(hdim, dtype, causal, split)


def kernel_head_dim(head_dim: int) -> int:
    """The FA2 kernel head dim that runs head dim ``head_dim`` (the smallest available >= it)."""
    if head_dim <= 0 or head_dim % 8 or head_dim > KERNEL_HEAD_DIMS[-1]:
        raise ValueError(f"FA2 needs 0 < head dim <= 256 and a multiple of 8, got {head_dim}")
    return next(d for d in KERNEL_HEAD_DIMS if d >= head_dim)


def normalize_dtype(dtype: str) -> str:
    try:
        return _DTYPE_ALIASES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"FA2 supports float16 and bfloat16 only, got {dtype!r}") from None


def normalize_arch(arch: str | int) -> str:
    """``sm_90`` from ``sm_90``, ``sm90``, ``90``, ``9.0`` or ``compute_90``."""
    s = str(arch).strip().lower()
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)\.?(\d)?(a?)", s)
    if not m:
        raise ValueError(f"bad CUDA arch {arch!r}; expected e.g. sm_90")
    major_minor = m.group(1) + (m.group(2) or "")
    if int(major_minor) < 80:
        raise ValueError(f"FA2 needs sm_80 or newer, got {arch!r}")
    return f"sm_{major_minor}{m.group(3)}"


def plan_kernels(spec) -> tuple[KernelKey, ...]:
    """The kernel keys one attention needs at run time.

    ``spec`` is an :class:`mqa_byoc.compiler.spec.AttentionSpec` or anything with ``head_dim``,
    ``head_dim_v``, ``dtype``, ``causal``, ``window_left`` and ``window_right``.

    Both split-KV and plain kernels are planned (the choice depends on B, S_q, S_kv at run time).
    Non-causal kernels are always planned: FA2 switches causal off for S_q == 1 (decode) and uses
    its local (non-causal) instantiation for sliding windows. Causal kernels are planned when the
    spec is causal, or has window_right == 0 (a window wider than S_kv degenerates to causal).
    """
    d, dv = int(spec.head_dim), int(getattr(spec, "head_dim_v", spec.head_dim))
    if d != dv:
        raise ValueError(f"FA2 needs equal q/k and v head dims, got {d} and {dv}")
    hdim = kernel_head_dim(d)
    dtype = normalize_dtype(spec.dtype)
    causal_flags = [False]
    if spec.causal or int(getattr(spec, "window_right", -1)) == 0:
        causal_flags.append(True)
    return tuple(
        sorted(KernelKey(hdim, dtype, c, s) for c in causal_flags for s in (False, True))
    )


def keys_for(
    head_dims: Iterable[int],
    dtypes: Iterable[str],
    causal: Sequence[bool] = (False, True),
    split: Sequence[bool] = (False, True),
) -> tuple[KernelKey, ...]:
    """The cross product, with head dims rounded to kernel head dims."""
    out = {
        KernelKey(kernel_head_dim(int(d)), normalize_dtype(t), bool(c), bool(s))
        for d in head_dims
        for t in dtypes
        for c in causal
        for s in split
    }
    return tuple(sorted(out))


def marker_line(keys: Iterable[KernelKey]) -> str:
    return f"{MARKER} " + "; ".join(k.label for k in sorted(set(keys)))


def parse_markers(source: str) -> tuple[KernelKey, ...]:
    """Kernel keys listed by :data:`MARKER` lines in a C/C++ source."""
    keys = set()
    for line in source.splitlines():
        line = line.strip()
        if line.startswith(MARKER):
            for label in line[len(MARKER) :].split(";"):
                if label.strip():
                    keys.add(KernelKey.parse(label))
    return tuple(sorted(keys))


def build_command_hint(keys: Iterable[KernelKey], arch: str | None = None) -> str:
    keys = list(keys)
    hdims = ",".join(str(d) for d in sorted({k.head_dim for k in keys}))
    dtypes = ",".join(sorted({k.dtype for k in keys}))
    arch_opt = f" --arch {arch}" if arch else ""
    return f"mqa-byoc build-kernels{arch_opt} --head-dims {hdims} --dtypes {dtypes}"


# ---------------------------------------------------------------------------------------------
# toolchain


def cache_root() -> Path:
    env = os.environ.get("MQA_BYOC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mqa_byoc"


def find_nvcc() -> str:
    """Path of nvcc, or :class:`NativeKernelsUnavailable`.

    ``MQA_BYOC_NVCC`` (if set, even empty) is authoritative; otherwise ``PATH``, ``$CUDA_HOME/bin``,
    ``$CUDA_PATH/bin`` and ``/usr/local/cuda/bin``.
    """
    hint = 'nvcc not found; install the CUDA toolkit (or set MQA_BYOC_NVCC) or use provider="python"'
    if "MQA_BYOC_NVCC" in os.environ:
        p = os.environ["MQA_BYOC_NVCC"]
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
        raise NativeKernelsUnavailable(f"{hint} (MQA_BYOC_NVCC={p!r} is not an executable)")
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = [
        os.path.join(os.environ[v], "bin", "nvcc")
        for v in ("CUDA_HOME", "CUDA_PATH")
        if os.environ.get(v)
    ] + list(_NVCC_CANDIDATES)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise NativeKernelsUnavailable(hint)


def cuda_home(nvcc: str | None = None) -> Path:
    """The CUDA toolkit root of ``nvcc`` (which may be a wrapper script)."""
    nvcc = nvcc or find_nvcc()
    cands = [Path(os.path.realpath(nvcc)).parent.parent]
    out = _run_version([nvcc, "--dryrun", "--version"]) + "\n" + _run_version([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull])
    m = re.search(r"^#\$ TOP=(.+)$", out, re.M)
    if m:
        cands.insert(0, Path(os.path.realpath(m.group(1).strip())))
    cands += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands.append(Path("/usr/local/cuda"))
    for c in cands:
        if (c / "include" / "cuda_runtime.h").is_file():
            return c
    raise NativeKernelsUnavailable(f"cannot locate the CUDA toolkit of {nvcc}")


def _cuda_lib_dir(nvcc: str | None = None) -> Path:
    home = cuda_home(nvcc)
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        if (home / sub / "libcudart_static.a").exists():
            return home / sub
    raise NativeKernelsUnavailable(f"libcudart_static.a not found under {home}")


def _run_version(cmd: Sequence[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        out = r.stdout + (r.stderr if r.returncode == 0 or not r.stdout else "")
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return out.strip()


_version_cache: dict[tuple[str, ...], str] = {}


def toolchain_versions(nvcc: str) -> dict[str, str]:
    key = (nvcc,)
    if key not in _version_cache:
        nv = _run_version([nvcc, "--version"]).splitlines()
        release = next((ln for ln in nv if "release" in ln), nv[-1] if nv else "unknown")
        host = os.environ.get("NVCC_CCBIN") or "g++"
        _version_cache[key] = json.dumps(
            {"nvcc": release.strip(), "host": _run_version([host, "-dumpfullversion"])}
        )
    return json.loads(_version_cache[key])


def detect_arch() -> str:
    """``$MQA_BYOC_ARCH``, else the first GPU's compute capability via nvidia-smi, else sm_90."""
    env = os.environ.get("MQA_BYOC_ARCH")
    if env:
        return normalize_arch(env)
    smi = shutil.which("nvidia-smi")
    if smi:
        out = _run_version([smi, "--query-gpu=compute_cap", "--format=csv,noheader"])
        first = out.splitlines()[0].strip() if out else ""
        if re.fullmatch(r"\d+\.\d", first):
            return normalize_arch(first)
    return DEFAULT_ARCH


# ---------------------------------------------------------------------------------------------
# flash-attn sources


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_fa_tree(root: Path) -> bool:
    return (root / "csrc/flash_attn/src/flash.h").is_file() and (
        root / "csrc/cutlass/include/cutlass/cutlass.h"
    ).is_file()


def _fa_tree_version(root: Path) -> str | None:
    pkg = root / "PKG-INFO"
    if pkg.is_file():
        m = re.search(r"^Version:\s*(\S+)", pkg.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    init = root / "flash_attn/__init__.py"
    if init.is_file():
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", init.read_text(errors="replace"))
        if m:
            return m.group(1)
    return None


def _extract(tarball: Path, dest_parent: Path) -> Path:
    digest = _sha256(tarball)
    if digest != FLASH_ATTN_SHA256:
        raise NativeKernelsUnavailable(
            f"{tarball}: sha256 {digest} != expected {FLASH_ATTN_SHA256} (flash-attn {FLASH_ATTN_VERSION})"
        )
    dest_parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest_parent))
    try:
        with tarfile.open(tarball) as tf:
            if sys.version_info >= (3, 12) or hasattr(tarfile, "data_filter"):
                tf.extractall(tmp, filter="data")
            else:  # pragma: no cover - old Pythons without extraction filters
                for m in tf.getmembers():
                    if m.name.startswith("/") or ".." in Path(m.name).parts:
                        raise NativeKernelsUnavailable(f"unsafe path in {tarball}: {m.name}")
                tf.extractall(tmp)
        inner = tmp / f"flash_attn-{FLASH_ATTN_VERSION}"
        if not _is_fa_tree(inner):
            raise NativeKernelsUnavailable(f"{tarball} does not hold a flash-attn source tree")
        final = dest_parent / f"flash_attn-{FLASH_ATTN_VERSION}"
        if not _is_fa_tree(final):
            if final.exists():
                shutil.rmtree(final)
            os.replace(inner, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def flash_attn_source(
    src: str | os.PathLike | None = None, *, download: bool = True, progress=print
) -> Path:
    """Root of a flash-attn source tree (the directory holding ``csrc/``).

    ``src`` or ``$MQA_BYOC_FLASH_ATTN_SRC`` may name an extracted tree or the sdist tarball; otherwise
    the cache is used, downloading the pinned sdist (sha256 checked) when ``download``.
    """
    src = src or os.environ.get("MQA_BYOC_FLASH_ATTN_SRC")
    src_cache = cache_root() / "src"
    if src:
        p = Path(src).expanduser()
        if p.is_dir():
            for cand in (p, p / f"flash_attn-{FLASH_ATTN_VERSION}"):
                if _is_fa_tree(cand):
                    return cand.resolve()
            raise NativeKernelsUnavailable(f"{p} is not a flash-attn source tree (no csrc/flash_attn/src/flash.h)")
        if p.is_file():
            cached = src_cache / f"flash_attn-{FLASH_ATTN_VERSION}"
            if _is_fa_tree(cached):
                return cached
            return _extract(p, src_cache)
        raise NativeKernelsUnavailable(f"flash-attn source {p} does not exist")
    cached = src_cache / f"flash_attn-{FLASH_ATTN_VERSION}"
    if _is_fa_tree(cached):
        return cached
    tarball = src_cache / f"flash_attn-{FLASH_ATTN_VERSION}.tar.gz"
    if not tarball.is_file():
        if not download:
            raise NativeKernelsUnavailable(
                f"flash-attn {FLASH_ATTN_VERSION} sources are not in {src_cache}; set "
                "MQA_BYOC_FLASH_ATTN_SRC to an extracted tree or the sdist, or allow the download"
            )
        src_cache.mkdir(parents=True, exist_ok=True)
        progress(f"[mqa-byoc] downloading flash-attn {FLASH_ATTN_VERSION} sources from {FLASH_ATTN_URL}")
        tmp = tarball.with_suffix(f".part{os.getpid()}")
        try:
            with urllib.request.urlopen(FLASH_ATTN_URL, timeout=120) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise NativeKernelsUnavailable(
                f"could not download flash-attn sources ({e}); on an offline machine set "
                "MQA_BYOC_FLASH_ATTN_SRC to an extracted flash_attn-2.8.3 tree or its sdist"
            ) from e
        os.replace(tmp, tarball)
    return _extract(tarball, src_cache)


# ---------------------------------------------------------------------------------------------
# build configuration and cache layout


def _tree_hash(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        if p.is_dir():
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                h.update(str(f.relative_to(p)).encode())
                h.update(f.read_bytes())
        else:
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def kernel_flags(arch: str) -> list[str]:
    """nvcc flags for kernel objects (without -I, -D for the key and -o)."""
    num = normalize_arch(arch)[3:]
    return [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        f"-gencode=arch=compute_{num},code=sm_{num}",
        "-Xcompiler=-fPIC,-fvisibility=hidden",
        "-Wno-deprecated-gpu-targets",
        f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}",
        "-DFLASHATTENTION_DISABLE_BACKWARD",
        "-DFLASHATTENTION_DISABLE_DROPOUT",
        "-DFLASHATTENTION_DISABLE_ALIBI",
        "-DFLASHATTENTION_DISABLE_SOFTCAP",
    ]


def dispatcher_flags() -> list[str]:
    return [
        "-O2",
        "-std=c++17",
        "-Xcompiler=-fPIC,-fvisibility=hidden",
        f"-DFLASH_NAMESPACE={FLASH_NAMESPACE}",
    ]


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Where and how objects for one arch are built."""

    arch: str
    nvcc: str
    fa_root: Path
    fa_version: str
    tag: str  # hash of everything that changes kernel objects
    dir: Path  # cache directory of this tag

    @property
    def include_flags(self) -> list[str]:
        return [
            f"-I{_SHIM_DIR}",
            f"-I{self.fa_root / 'csrc/flash_attn/src'}",
            f"-I{self.fa_root / 'csrc/cutlass/include'}",
        ]


def build_config(arch: str | None = None, *, fa_src=None, download: bool = True, progress=print) -> BuildConfig:
    arch = normalize_arch(arch or detect_arch())
    nvcc = find_nvcc()
    fa_root = flash_attn_source(fa_src, download=download, progress=progress)
    fa_version = _fa_tree_version(fa_root) or FLASH_ATTN_VERSION
    tv = toolchain_versions(nvcc)
    ident = {
        "flash_attn": fa_version,
        "arch": arch,
        "nvcc": tv["nvcc"],
        "host": tv["host"],
        "flags": kernel_flags(arch),
        "native": _tree_hash([_SHIM_DIR, _ENTRY_SOURCE]),
    }
    tag = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    d = cache_root() / "fa2" / f"flash_attn-{fa_version}" / f"{arch}-{tag}"
    return BuildConfig(arch, nvcc, fa_root, fa_version, tag, d)


def _dispatcher_name() -> str:
    h = hashlib.sha256()
    h.update(_DISPATCH_SOURCE.read_bytes())
    h.update(_tree_hash([_SHIM_DIR]).encode())
    h.update(json.dumps(dispatcher_flags()).encode())
    return f"fa2_dispatch-{h.hexdigest()[:12]}.o"


def _prebuilt_dirs(arch: str) -> list[Path]:
    """Directories given by MQA_BYOC_KERNEL_DIR (os.pathsep separated) whose manifest matches arch."""
    out = []
    for d in filter(None, os.environ.get("MQA_BYOC_KERNEL_DIR", "").split(os.pathsep)):
        p = Path(d).expanduser()
        for cand in [p] + sorted(p.glob(f"*/{arch}-*")) + sorted(p.glob(f"{arch}-*")):
            m = cand / "manifest.json"
            if m.is_file():
                try:
                    if json.loads(m.read_text()).get("arch") == arch:
                        out.append(cand)
                except (OSError, ValueError):
                    pass
    return out


# ---------------------------------------------------------------------------------------------
# compiling


_manifest_lock = threading.Lock()


def _update_manifest(cfg: BuildConfig, entries: dict) -> None:
    with _manifest_lock:
        path = cfg.dir / "manifest.json"
        data = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except ValueError:
                data = {}
        tv = toolchain_versions(cfg.nvcc)
        data.update(
            {
                "flash_attn": cfg.fa_version,
                "arch": cfg.arch,
                "tag": cfg.tag,
                "nvcc": tv["nvcc"],
                "host": tv["host"],
                "kernel_flags": kernel_flags(cfg.arch),
                "flash_namespace": FLASH_NAMESPACE,
            }
        )
        for section, items in entries.items():
            data.setdefault(section, {}).update(items)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)


class _Killed(RuntimeError):
    """A compiler process was killed (usually by the OOM killer)."""


def _compile(cmd: list[str], out: Path, log: Path, niceness: int = 0) -> float:
    """Run one compile to a temp name, then rename; returns seconds. Raises with the log tail."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    full = cmd + ["-o", str(tmp)]
    if niceness > 0 and shutil.which("nice"):
        full = ["nice", "-n", str(niceness)] + full
    t0 = time.monotonic()
    with open(log, "w") as lf:
        lf.write(" ".join(full) + "\n\n")
        lf.flush()
        rc = subprocess.run(full, stdout=lf, stderr=subprocess.STDOUT).returncode
    dt = time.monotonic() - t0
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        if rc in (137, -9):
            raise _Killed(f"compiling {out.name} was killed (exit {rc}; out of memory? use fewer --jobs); log {log}")
        raise RuntimeError(f"compiling {out.name} failed (exit {rc}); log {log}:\n{tail}")
    os.replace(tmp, out)
    return dt


def _kernel_cmd(cfg: BuildConfig, key: KernelKey) -> list[str]:
    return (
        [cfg.nvcc, "-c"]
        + kernel_flags(cfg.arch)
        + cfg.include_flags
        + [
            f'-DMQA_BYOC_FA_FILE="{key.flash_attn_file}"',
            f"-DMQA_BYOC_ENTRY={key.entry_symbol}",
            f"-DMQA_BYOC_ELEM={DTYPES[key.dtype]}",
            f"-DMQA_BYOC_HDIM={key.head_dim}",
            f"-DMQA_BYOC_CAUSAL={'true' if key.causal else 'false'}",
            f"-DMQA_BYOC_SPLIT={int(key.split)}",
            "-x",
            "cu",
            str(_ENTRY_SOURCE),
        ]
    )


def default_jobs() -> int:
    cpus = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gb = 8
    return max(1, min(cpus, int(mem_gb // 3), 32))


def find_kernels(keys: Iterable[KernelKey], arch: str, cfg: BuildConfig | None = None) -> dict[KernelKey, Path]:
    """Already-built objects for ``keys``: prebuilt dirs first, then the cache dir of ``cfg``."""
    arch = normalize_arch(arch)
    dirs = _prebuilt_dirs(arch) + ([cfg.dir] if cfg is not None else [])
    found = {}
    for k in keys:
        for d in dirs:
            p = d / f"{k.stem}.o"
            if p.is_file():
                found[k] = p
                break
    return found


def build_kernels(
    keys: Iterable[KernelKey],
    arch: str | None = None,
    *,
    jobs: int | None = None,
    niceness: int = 0,
    build: bool = True,
    fa_src=None,
    progress: Callable[[str], None] | None = print,
) -> dict[KernelKey, Path]:
    """Objects for ``keys`` on ``arch``, compiling those not found (in parallel, one line per file)."""
    progress = progress or (lambda _msg: None)
    keys = list(dict.fromkeys(keys))  # keep the caller's order: it is the build order
    arch = normalize_arch(arch or detect_arch())
    found = find_kernels(keys, arch)  # prebuilt dirs need no toolchain and no sources
    if len(found) == len(keys):
        return found
    cfg = build_config(arch, fa_src=fa_src, download=build, progress=progress)
    found = find_kernels(keys, arch, cfg)
    missing = [k for k in keys if k not in found]
    if not missing:
        return found
    if not build:
        labels = ", ".join(k.label for k in missing)
        raise NativeKernelsUnavailable(
            f"FA2 kernels not built for {arch}: {labels}; run `{build_command_hint(missing, arch)}`"
        )
    cfg.dir.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(jobs or default_jobs(), len(missing)))
    progress(
        f"[mqa-byoc] compiling {len(missing)} FA2 kernel file(s) for {arch} with {jobs} job(s) "
        f"into {cfg.dir} (a few minutes each)"
    )
    done = 0
    lock = threading.Lock()
    errors = []

    def one(key: KernelKey):
        nonlocal done
        out = cfg.dir / f"{key.stem}.o"
        try:
            try:
                dt = _compile(_kernel_cmd(cfg, key), out, cfg.dir / f"{key.stem}.log", niceness)
            except _Killed as e:  # one retry: memory pressure is often transient
                progress(f"[mqa-byoc] {arch} {key.label}: {e}; retrying once")
                time.sleep(30)
                dt = _compile(_kernel_cmd(cfg, key), out, cfg.dir / f"{key.stem}.log", niceness)
        except Exception as e:  # noqa: BLE001 - reported below
            with lock:
                done += 1
                errors.append(e)
                progress(f"[mqa-byoc] [{done}/{len(missing)}] {arch} {key.label}: FAILED")
            return
        _update_manifest(cfg, {"kernels": {key.label: {"file": out.name, "seconds": round(dt, 1),
                                                        "bytes": out.stat().st_size}}})
        with lock:
            done += 1
            found[key] = out
            progress(f"[mqa-byoc] [{done}/{len(missing)}] {arch} {key.label}: {dt:.0f}s -> {out.name}")

    with _futures.ThreadPoolExecutor(jobs) as ex:
        list(ex.map(one, missing))
    if errors:
        raise RuntimeError(f"{len(errors)} FA2 kernel compile(s) failed; first:\n{errors[0]}")
    return found


def build_dispatcher(
    *, build: bool = True, fa_src=None, progress: Callable[[str], None] | None = print, arch: str | None = None
) -> Path:
    """The dispatcher object (host code, arch independent), compiling it if needed."""
    progress = progress or (lambda _msg: None)
    name = _dispatcher_name()
    for d in _prebuilt_dirs(normalize_arch(arch or detect_arch())):
        if (d / name).is_file():
            return d / name
    nvcc = find_nvcc()
    fa_root = flash_attn_source(fa_src, download=build, progress=progress)
    out = cache_root() / "fa2" / "dispatch" / name
    if out.is_file():
        return out
    if not build:
        raise NativeKernelsUnavailable(f"FA2 dispatcher {name} not built; run `mqa-byoc build-kernels`")
    cmd = (
        [nvcc, "-c"]
        + dispatcher_flags()
        + [f"-I{_SHIM_DIR}", f"-I{fa_root / 'csrc/flash_attn/src'}", str(_DISPATCH_SOURCE)]
    )
    dt = _compile(cmd, out, out.with_suffix(".log"))
    progress(f"[mqa-byoc] dispatcher: {dt:.0f}s -> {out}")
    return out


def static_cudart(arch: str | None = None) -> list[str]:
    """Linker inputs for the static CUDA runtime; put them after every object.

    A ``libcudart_static.a`` in a prebuilt dir (MQA_BYOC_KERNEL_DIR) wins, so a machine with only
    the driver can export; otherwise the one of the local CUDA toolkit.
    """
    lib = None
    if arch is not None:
        lib = next((d / "libcudart_static.a" for d in _prebuilt_dirs(normalize_arch(arch))
                    if (d / "libcudart_static.a").is_file()), None)
    if lib is None:
        lib = _cuda_lib_dir() / "libcudart_static.a"
    return [str(lib), "-ldl", "-lpthread", "-lrt"]


def link_inputs(
    specs_or_keys: Iterable,
    arch: str | None = None,
    *,
    build: bool = True,
    jobs: int | None = None,
    niceness: int = 0,
    fa_src=None,
    progress: Callable[[str], None] | None = print,
) -> tuple[list[str], list[str]]:
    """``(objects, libs)`` to link for these attention specs (or kernel keys).

    ``objects``: dispatcher + kernel objects (link them as files, not through an archive: the
    dispatcher only references kernels weakly). ``libs``: static cudart and friends, to be placed
    after all objects on the link line.
    """
    keys = set()
    for s in specs_or_keys:
        keys.update([s] if isinstance(s, KernelKey) else plan_kernels(s))
    arch = normalize_arch(arch or detect_arch())
    kernels = build_kernels(keys, arch, jobs=jobs, niceness=niceness, build=build, fa_src=fa_src, progress=progress)
    disp = build_dispatcher(build=build, fa_src=fa_src, progress=progress, arch=arch)
    objects = [str(disp)] + [str(kernels[k]) for k in sorted(keys)]
    return objects, static_cudart(arch)


def copy_artifacts(
    dest: str | os.PathLike, keys: Iterable[KernelKey], arch: str, *, link_check_binary: bool = False, progress=print
) -> Path:
    """Copy dispatcher + kernel objects + static cudart + manifest to ``dest/<arch>-<tag>/``.

    Point ``MQA_BYOC_KERNEL_DIR`` at ``dest`` on another machine: export then needs neither nvcc nor
    flash-attn's sources there. With ``link_check_binary``, also ``fa2_link_check`` (static, needs only
    the driver; ``fa2_link_check --run`` checks the kernels on GPU 0 against a CPU reference).
    """
    keys = list(keys)
    arch = normalize_arch(arch)
    cfg = build_config(arch, download=False, progress=progress)
    kernels = find_kernels(keys, arch, cfg)
    missing = [k.label for k in keys if k not in kernels]
    if missing:
        raise NativeKernelsUnavailable(f"not built: {', '.join(missing)}")
    out = Path(dest).expanduser() / f"{arch}-{cfg.tag}"
    out.mkdir(parents=True, exist_ok=True)
    disp = build_dispatcher(build=False, arch=arch, progress=progress)
    cudart = _cuda_lib_dir(cfg.nvcc) / "libcudart_static.a"
    for p in [disp, *kernels.values(), cudart]:
        shutil.copy2(p, out / p.name)
    manifest = json.loads((cfg.dir / "manifest.json").read_text()) if (cfg.dir / "manifest.json").is_file() else {}
    manifest.update({"arch": arch, "tag": cfg.tag, "flash_attn": cfg.fa_version, "dispatcher": disp.name,
                     "cudart": cudart.name})
    manifest["kernels"] = {k: v for k, v in manifest.get("kernels", {}).items() if KernelKey.parse(k) in kernels}
    if link_check_binary:
        link_check([str(out / disp.name)] + [str(out / p.name) for p in kernels.values()],
                   out=out / "fa2_link_check", progress=progress)
        manifest["link_check"] = "fa2_link_check"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    progress(f"[mqa-byoc] copied {len(kernels) + 1} object(s) and libcudart_static.a to {out}")
    return out


def link_check(objects: Sequence[str], *, out: str | os.PathLike | None = None, progress=print) -> Path:
    """Link a tiny C++ program (not run) against ``objects`` + static cudart: proves the symbols resolve."""
    nvcc = find_nvcc()
    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="mqa_byoc_link_")) / "fa2_link_check"
    cmd = (
        [nvcc, "-std=c++17", "-O2", f"-I{NATIVE_DIR}", "-o", str(out), str(_LINK_CHECK_SOURCE)]
        + list(objects)
        + ["-cudart=static", "-ldl", "-lpthread", "-lrt"]
    )
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"link check failed:\n{r.stdout}\n{r.stderr}\n{' '.join(cmd)}")
    progress(f"[mqa-byoc] link check ok: {out}")
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def _flag3(value: str, what: str) -> tuple[bool, ...]:
    v = value.lower()
    if v in ("both", "all"):
        return (False, True)
    if v in ("yes", "true", "on", "1", what):
        return (True,)
    if v in ("no", "false", "off", "0", "non" + what, "no-" + what):
        return (False,)
    raise argparse.ArgumentTypeError(f"--{what}: expected both|yes|no, got {value!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """``mqa-byoc build-kernels``: compile FA2 forward kernels into the cache."""
    ap = argparse.ArgumentParser(
        prog="mqa-byoc build-kernels",
        description="Compile Flash Attention 2 forward kernels (from flash-attn's sources) for the native provider.",
    )
    ap.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90 (default: $MQA_BYOC_ARCH, the GPU, or sm_90)")
    ap.add_argument("--head-dims", default="64,128", help="comma separated head dims; rounded up to 32,64,96,128,192,256")
    ap.add_argument("--dtypes", default="fp16,bf16", help="comma separated: fp16,bf16")
    ap.add_argument("--causal", default="both", help="both|yes|no")
    ap.add_argument("--split", default="both", help="split-KV kernels: both|yes|no")
    ap.add_argument("--jobs", "-j", type=int, default=None, help="parallel nvcc processes")
    ap.add_argument("--nice", type=int, default=0, help="run nvcc under `nice -n N`")
    ap.add_argument("--flash-attn-src", default=None, help="extracted flash-attn tree or sdist (else $MQA_BYOC_FLASH_ATTN_SRC / download)")
    ap.add_argument("--out", default=None, help="also copy dispatcher + objects to DIR (use with MQA_BYOC_KERNEL_DIR=DIR)")
    ap.add_argument("--link-check", action="store_true",
                    help="link fa2_link_check (a Python-free test program; `fa2_link_check --run` needs a GPU) "
                    "against the objects; into --out DIR when given")
    ap.add_argument("--print-dir", action="store_true", help="print the cache directory and exit")
    args = ap.parse_args(argv)

    try:
        arch = normalize_arch(args.arch or detect_arch())
        if args.print_dir:
            print(build_config(arch, fa_src=args.flash_attn_src, download=False).dir)
            return 0
        keys = keys_for(
            [int(x) for x in args.head_dims.split(",") if x.strip()],
            [x for x in args.dtypes.split(",") if x.strip()],
            _flag3(args.causal, "causal"),
            _flag3(args.split, "split"),
        )
        t0 = time.monotonic()
        print(f"[mqa-byoc] {len(keys)} kernel(s) for {arch}: " + "; ".join(k.label for k in keys), flush=True)
        _print = lambda m: print(m, flush=True)  # noqa: E731
        objs, libs = link_inputs(keys, arch, jobs=args.jobs, niceness=args.nice, fa_src=args.flash_attn_src, progress=_print)
        cfg = build_config(arch, fa_src=args.flash_attn_src, download=False)
        print(f"[mqa-byoc] done in {time.monotonic() - t0:.0f}s; objects in {cfg.dir}", flush=True)
        if args.out:
            copy_artifacts(args.out, keys, arch, link_check_binary=args.link_check, progress=_print)
        elif args.link_check:
            link_check(objs, progress=_print)
    except (NativeKernelsUnavailable, ValueError, RuntimeError) as e:
        print(f"mqa-byoc build-kernels: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
