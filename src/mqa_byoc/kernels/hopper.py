"""Hopper (sm_90) forward kernels: flash-attn-4's CuTe DSL kernel, compiled ahead of time into objects.

The ``hopper`` provider runs prefill on flash-attn-4's ``FlashAttentionForwardSm90`` (wgmma, TMA, warp
specialization, native K/V heads through its GQA packing). :mod:`mqa_byoc.kernels.hopper_aot`
compiles one object per :class:`HopperKernelKey` with ``nvidia-cutlass-dsl`` (``cute.compile(...,
options="--enable-tvm-ffi")`` then ``export_to_c``): no GPU is needed, a few seconds each. An object
exports one TVM-FFI function ``__tvm_ffi_<symbol>(q, k, v, out, scale[, window_left, window_right])``
(BSNH tensors, any strides with a contiguous last axis; TVM's current stream) and needs at link time
only the CuTe DSL's small static CUDA-runtime shim (``libcuda_dialect_runtime_static.a``, copied next
to the objects) and ``native/fa4_glue.cc``: the exported library needs no Python, no torch and none of
the DSL's shared libraries at run time.

Objects live in ``<dir>/fa4-<arch>-<flash-attn-4 version>/`` with a ``manifest.json``: under
``MQA_BYOC_KERNEL_DIR`` (prebuilt) or the kernel cache (built on demand when the packages are
installed: ``pip install "mqa-byoc[hopper]"``). Nothing here imports TVM or the DSL.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import NativeKernelsUnavailable
from .keys import normalize_arch, normalize_dtype
from .paths import DISPATCH_HEADER, FA4_CALL_HEADER, GQA_DECODE_HEADER, LSE_RULE_HEADER, NATIVE_DIR, cache_root

#: the flash-attn-4 release whose kernel the objects hold (pinned: its compile interface is internal)
FA4_VERSION = "4.0.0b36"
#: the nvidia-cutlass-dsl release that compiles them
CUTLASS_DSL_VERSION = "4.8.1"
PIP_REQUIREMENTS = (f"flash-attn-4=={FA4_VERSION}", f"nvidia-cutlass-dsl[cu13]=={CUTLASS_DSL_VERSION}", "triton")
#: head dims the hopper provider runs on FA4 (tested); others stay on FA2
HEAD_DIMS = (64, 128)
#: "none": no mask; "causal": bottom-right causal; "local": a sliding window (both bounds at run time);
#: "splitkv": no mask, K/V var-len (cu_seqlens_k) and the LSE written: one query row per chunk of the
#: keys, the split-KV decode of ``native/fa4_decode.cu`` (FA4's sm90 path has none of its own);
#: "varlen" / "varlen_causal": query and K/V var-len (cu_seqlens_q, cu_seqlens_k), the LSE written, no
#: mask / bottom-right causal: the ragged prefill of TVM's PagedKVCache (FA4's var-len tile scheduler
#: maps the tiles to sequences on the GPU, so no host-side longest length is needed)
MASKS = ("none", "causal", "local", "splitkv", "varlen", "varlen_causal")
#: the var-len masks (their objects take q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k)
VARLEN_MASKS = ("varlen", "varlen_causal")
#: arches the objects are built for (FA4's sm90 path needs sm_90a)
ARCHES = ("sm_90",)
#: marker line of the native wrappers that call an FA4 object; export reads it back
MARKER = "// mqa_byoc-hopper-kernels:"
MANIFEST = "manifest.json"
RUNTIME_ARCHIVE = "libcuda_dialect_runtime_static.a"
GLUE_SOURCE = NATIVE_DIR / "fa4_glue.cc"
DECODE_SOURCE = NATIVE_DIR / "fa4_decode.cu"
RAGGED_SOURCE = NATIVE_DIR / "fa4_ragged.cu"
#: the C declaration (weak) of fa4_ragged.cu's entry, for the generated wrappers that call it (the paged
#: cache's ragged prefill, var-len attention): they are compiled without our include path
RAGGED_DECL = r"""extern "C" __attribute__((weak)) int mqa_byoc_fa4_ragged_forward(
    int (*fa4)(void*, const TVMFFIAny*, int32_t, TVMFFIAny*), const void* q, const void* k, const void* v, void* out,
    float* lse, const int32_t* qo_indptr, const int32_t* kv_indptr, int64_t batch, int64_t total_q, int64_t total_k,
    int64_t num_heads, int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride, const int64_t* k_stride,
    const int64_t* v_stride, const int64_t* o_stride, int is_bf16, double scale, int device_id, void* stream);
"""


@dataclasses.dataclass(frozen=True, order=True)
class HopperKernelKey:
    """One compiled FA4 sm90 forward: dtype, head dim, query heads per K/V head, mask kind.

    The kernel's shapes (batch, lengths, head counts) are run-time values; the group size is
    compiled in because FA4 packs the query heads of one K/V head into one tile (``pack_gqa``).
    """

    dtype: str
    head_dim: int
    group: int
    mask: str

    def __post_init__(self):
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"no FA4 kernel for head dim {self.head_dim}; the hopper provider has {HEAD_DIMS}")
        if int(self.group) < 1:
            raise ValueError(f"group (query heads per K/V head) must be >= 1, got {self.group}")
        if self.mask not in MASKS:
            raise ValueError(f"mask {self.mask!r}: expected one of {MASKS}")

    @property
    def label(self) -> str:
        """``fp16 h128 g8 causal``: the form of markers, messages and the command line."""
        return f"{self.dtype} h{self.head_dim} g{self.group} {self.mask}"

    @property
    def symbol(self) -> str:
        """The exported function's name (the object's C symbol is ``__tvm_ffi_`` + this)."""
        return f"mqa_byoc_fa4_sm90_{self.dtype}_h{self.head_dim}_g{self.group}_{self.mask}"

    @property
    def filename(self) -> str:
        return self.symbol + ".o"

    @property
    def num_args(self) -> int:
        """Arguments of the exported function: q, k, v, out, scale (+ window_left, window_right;
        splitkv: q, k, v, out, lse, scale, cu_seqlens_k; varlen: q, k, v, out, lse, scale, cu_seqlens_q,
        cu_seqlens_k)."""
        return {"local": 7, "splitkv": 7, "varlen": 8, "varlen_causal": 8}.get(self.mask, 5)

    @classmethod
    def parse(cls, label: str) -> HopperKernelKey:
        """Inverse of :attr:`label`."""
        m = re.fullmatch(r"\s*(\w+)\s+h(\d+)\s+g(\d+)\s+(\w+)\s*", label)
        if not m:
            raise ValueError(f"bad hopper kernel label {label!r}; expected e.g. 'fp16 h128 g8 causal'")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4))


def mask_kind(causal: bool, window_left: int, window_right: int) -> str:
    """The :data:`MASKS` entry of an attention's mask (windows as in FA2: -1 = unbounded)."""
    if window_left >= 0 or (window_right >= 0 and not causal):
        return "local"
    return "causal" if causal else "none"


def marker_line(keys: Iterable[HopperKernelKey]) -> str:
    return MARKER + " " + "; ".join(k.label for k in sorted(set(keys)))


def parse_markers(source: str) -> set[HopperKernelKey]:
    """The keys named by every :data:`MARKER` line of ``source``."""
    keys = set()
    for line in source.splitlines():
        if line.startswith(MARKER):
            keys.update(HopperKernelKey.parse(x) for x in line[len(MARKER):].split(";") if x.strip())
    return keys


# ----------------------------------------------------------------------------- where objects live

def _dir_name(arch: str) -> str:
    return f"fa4-{normalize_arch(arch)}-{FA4_VERSION}"


def cache_dir(arch: str = "sm_90") -> Path:
    return cache_root() / _dir_name(arch)


def prebuilt_dirs(arch: str = "sm_90") -> list[Path]:
    """Directories under ``MQA_BYOC_KERNEL_DIR`` holding FA4 objects for ``arch`` (the dir itself,
    or ``fa4-<arch>-<version>`` one or two levels down)."""
    name = _dir_name(arch)
    out = []
    for d in filter(None, os.environ.get("MQA_BYOC_KERNEL_DIR", "").split(os.pathsep)):
        p = Path(d).expanduser()
        for cand in [p, p / name] + sorted(p.glob(f"*/{name}")):
            if (cand / MANIFEST).is_file() and cand not in out:
                try:
                    if json.loads((cand / MANIFEST).read_text()).get("family") == "fa4":
                        out.append(cand)
                except (OSError, ValueError):
                    pass
    return out


def find_objects(keys: Iterable[HopperKernelKey], arch: str = "sm_90") -> dict[HopperKernelKey, Path]:
    """Built objects for ``keys``: prebuilt dirs first, then the cache."""
    dirs = prebuilt_dirs(arch) + [cache_dir(arch)]
    found = {}
    for k in keys:
        for d in dirs:
            if (d / k.filename).is_file() and (d / RUNTIME_ARCHIVE).is_file():
                found[k] = d / k.filename
                break
    return found


def compiler_available() -> bool:
    """Whether flash-attn-4 and nvidia-cutlass-dsl are installed here (objects can be compiled)."""
    return all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "cutlass", "quack"))


def install_hint() -> str:
    return "pip install " + " ".join(f'"{r}"' for r in PIP_REQUIREMENTS)


def available(arch: str | None, keys: Iterable[HopperKernelKey] = ()) -> str | None:
    """None when the hopper provider can link ``keys`` for ``arch``; else the reason it cannot."""
    if arch is None:
        return "the target names no CUDA arch (add \"arch\": \"sm_90\")"
    try:
        arch = normalize_arch(arch)
    except ValueError as err:
        return str(err)
    if arch not in ARCHES:
        return f"FA4's Hopper kernel needs sm_90, the target is {arch}"
    missing = [k for k in keys if k not in find_objects([k], arch)]
    if (missing or not keys) and not compiler_available() and not prebuilt_dirs(arch):
        return (f"flash-attn-4 and nvidia-cutlass-dsl are not installed to compile its kernels ({install_hint()}) "
                "and MQA_BYOC_KERNEL_DIR holds no prebuilt fa4 objects")
    if missing and not compiler_available():
        return (f"no prebuilt object for {', '.join(k.label for k in missing)} and flash-attn-4 is not installed "
                f"to compile it ({install_hint()})")
    return None


# ----------------------------------------------------------------------------- building

def build_objects(
    keys: Iterable[HopperKernelKey],
    arch: str = "sm_90",
    *,
    out: str | os.PathLike | None = None,
    build: bool = True,
    progress: Callable[[str], None] | None = print,
) -> dict[HopperKernelKey, Path]:
    """Objects for ``keys`` (found, or compiled into ``out`` / the cache in one subprocess).

    Raises
    ------
    NativeKernelsUnavailable
        A key is missing and it cannot be compiled here (``build=False`` or no flash-attn-4).
    """
    progress = progress or (lambda _m: None)
    keys = sorted(set(keys))
    arch = normalize_arch(arch)
    found = {} if out is not None else find_objects(keys, arch)
    missing = [k for k in keys if k not in found]
    if not missing:
        return found
    if not build or not compiler_available():
        why = "build=False" if not build else f"flash-attn-4 is not installed ({install_hint()})"
        raise NativeKernelsUnavailable(
            f"FA4 sm90 objects missing for {', '.join(k.label for k in missing)} ({why}). Compile them with "
            f"`mqa-byoc build-kernels --hopper {' '.join(repr(k.label) for k in missing)}` (seconds each, no GPU "
            "needed), or point MQA_BYOC_KERNEL_DIR at a directory holding them, or build with provider=\"native\"."
        )
    target = Path(out) / _dir_name(arch) if out is not None else cache_dir(arch)
    target.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cmd = [sys.executable, "-m", "mqa_byoc.kernels.hopper_aot", "--out", str(target), *[k.label for k in missing]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeKernelsUnavailable(
            f"compiling FA4 objects failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
        )
    progress(f"[mqa-byoc] FA4 sm90 objects: {len(missing)} in {time.time() - t0:.1f}s -> {target}")
    found.update({k: target / k.filename for k in missing})
    return found


def support_objects(arch: str = "sm_90", progress: Callable[[str], None] | None = print) -> list[Path]:
    """Our sources around the FA4 objects, compiled (seconds) and cached by content: ``fa4_glue.cc``
    (the DSL's error hooks), ``fa4_decode.cu`` (the split-KV decode: prepare and combine kernels) and
    ``fa4_ragged.cu`` (the PagedKVCache's ragged prefill: host code around a "varlen" object)."""
    import tvm_ffi.libinfo

    from .build import gencode_flags, source_object
    from .toolchain import cuda_home, find_nvcc

    def cuda_include():
        return [f"-I{cuda_home(find_nvcc()) / 'include'}"]

    def ffi_includes():
        return [f"-I{tvm_ffi.libinfo.find_include_path()}", f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}"]

    return [
        source_object(GLUE_SOURCE, arch, ["-O2", "-std=c++17", "-Xcompiler=-fPIC"], subdir="fa4",
                      includes=cuda_include, progress=progress),
        source_object(DECODE_SOURCE, arch, gencode_flags(arch), subdir="fa4",
                      inputs=(DISPATCH_HEADER, GQA_DECODE_HEADER, FA4_CALL_HEADER), includes=ffi_includes,
                      progress=progress),
        source_object(RAGGED_SOURCE, arch, gencode_flags(arch), subdir="fa4",
                      inputs=(DISPATCH_HEADER, LSE_RULE_HEADER, FA4_CALL_HEADER), includes=ffi_includes,
                      progress=progress),
    ]


def preset_keys(shapes, dtypes=("fp16", "bf16"), masks=MASKS) -> list[HopperKernelKey]:
    """The objects a set of attention shapes needs: each (head dim, group) FA4 serves and group 1
    (``mqa=False`` and plain MHA) for each dtype and mask kind. The model presets' shapes are
    :func:`mqa_byoc.models.presets.attention_shapes` (the caller passes them: this layer does not
    import the models)."""
    shapes = {(d, g) for d, g in shapes if d in HEAD_DIMS}
    shapes |= {(d, 1) for d, _ in shapes}
    return sorted({HopperKernelKey(dt, d, g, m) for dt in dtypes for d, g in shapes for m in masks})


def run_build(labels, *, shapes=(), arch: str | None = None, out: str | None = None, dry_run: bool = False,
              progress=print) -> int:
    """``mqa-byoc build-kernels --hopper [LABEL ...]``: compile FA4 objects (no labels:
    :func:`preset_keys` of ``shapes``, the (head dim, group) pairs the command was given)."""
    keys = [HopperKernelKey.parse(x) for x in labels] if labels else preset_keys(shapes)
    arch = normalize_arch(arch or "sm_90")
    if arch not in ARCHES:
        progress(f"mqa-byoc build-kernels --hopper: FA4's sm90 kernel is for sm_90, not {arch}")
        return 2
    if dry_run:
        where = Path(out) / _dir_name(arch) if out else cache_dir(arch)
        found = {} if out else find_objects(keys, arch)
        for k in keys:
            progress(f"{k.label}: " + (f"found {found[k]}" if k in found else f"compile -> {where / k.filename}"))
        progress("compiler: " + ("flash-attn-4 installed" if compiler_available() else f"missing ({install_hint()})"))
        return 0
    objs = build_objects(keys, arch, out=out, progress=progress)
    support_objects(arch, progress)
    progress(f"{len(objs)} FA4 objects in {next(iter(objs.values())).parent}")
    return 0


def link_inputs(keys: Iterable[HopperKernelKey], arch: str = "sm_90", *, build: bool = True,
                progress=print) -> list[str]:
    """Objects to link for ``keys``: the FA4 objects, :func:`support_objects` and the DSL's static
    runtime shim (an archive: put it after the objects, before the static CUDA runtime it calls)."""
    objs = build_objects(keys, arch, build=build, progress=progress)
    archive = next(iter(objs.values())).parent / RUNTIME_ARCHIVE
    return [str(p) for _, p in sorted(objs.items())] + [str(p) for p in support_objects(arch, progress)] + [str(archive)]


def write_manifest(directory: Path, entries: dict[str, dict], header: dict) -> None:
    path = directory / MANIFEST
    data = {"family": "fa4", **header, "kernels": {}}
    if path.is_file():
        try:
            data["kernels"] = json.loads(path.read_text()).get("kernels", {})
        except ValueError:
            pass
    data["kernels"].update(entries)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
