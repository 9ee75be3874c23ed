"""Kernel keys: which FA2 forward kernel families exist, which ones an attention needs, and their names.

A :class:`KernelKey` names one compiled kernel family (head dim, dtype, causal, split-KV, soft-capping); the arch
(``sm_90``) is chosen at build or export time. The codegen writes the keys a wrapper needs into a
:data:`MARKER` line of its source; export reads them back with :func:`parse_markers`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

#: head dims FA2 has forward kernels for; a head dim D runs on the smallest one >= D
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
#: short dtype names used in kernel names, with the CUTLASS element type
DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}  # fmt: skip
DEFAULT_ARCH = "sm_90"
#: marker line the codegen puts into each emitted wrapper; export reads it back
MARKER = "// mqa_byoc-kernels:"
#: the namespace flash-attn's templates of the soft-capping families are compiled into: the same
#: templates as the other families' (same names) with soft-capping compiled in, kept apart at link time
SOFTCAP_NAMESPACE = "mqa_byoc_flash_softcap"


@dataclasses.dataclass(frozen=True, order=True)
class KernelKey:
    """One FA2 forward kernel family: ``run_mha_fwd_`` (split=False) or the split-KV dispatch.

    ``softcap``: the family compiled with FA2's logit soft-capping (without
    ``FLASHATTENTION_DISABLE_SOFTCAP``, into a namespace of its own, :data:`SOFTCAP_NAMESPACE`); built
    only for models that soft-cap their scores (Gemma 2), the other families stay as they are.
    """

    head_dim: int  # a member of KERNEL_HEAD_DIMS
    dtype: str  # "fp16" | "bf16"
    causal: bool
    split: bool
    softcap: bool = False

    def __post_init__(self):
        if self.head_dim not in KERNEL_HEAD_DIMS:
            raise ValueError(f"no FA2 kernel for head dim {self.head_dim}; have {KERNEL_HEAD_DIMS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {tuple(DTYPES)}")

    @property
    def stem(self) -> str:
        """``fwd[_split]_hdim128_fp16[_causal][_softcap]``: object file stem."""
        split = "_split" if self.split else ""
        causal = "_causal" if self.causal else ""
        softcap = "_softcap" if self.softcap else ""
        return f"fwd{split}_hdim{self.head_dim}_{self.dtype}{causal}{softcap}"

    @property
    def entry_symbol(self) -> str:
        """The extern "C" entry the dispatcher calls (weakly referenced)."""
        return "mqa_byoc_fa2_" + self.stem

    @property
    def flash_attn_file(self) -> str:
        """flash-attn's own translation unit instantiating this kernel family (the soft-capping family
        compiles the same unit with soft-capping on)."""
        split = "_split" if self.split else ""
        causal = "_causal" if self.causal else ""
        return f"flash_fwd{split}_hdim{self.head_dim}_{self.dtype}{causal}_sm80.cu"

    @property
    def label(self) -> str:
        """``hdim128 fp16 causal split [softcap]`` (the form used in markers and messages)."""
        words = [f"hdim{self.head_dim}", self.dtype]
        if self.causal:
            words.append("causal")
        if self.split:
            words.append("split")
        if self.softcap:
            words.append("softcap")
        return " ".join(words)

    @classmethod
    def parse(cls, label: str) -> KernelKey:
        """Inverse of :attr:`label`; an ``sm_XX`` word, if present, is ignored."""
        words = label.split()
        hdim = dtype = None
        causal = split = softcap = False
        for w in words:
            if w.startswith("hdim"):
                hdim = int(w[4:])
            elif w in DTYPES:
                dtype = w
            elif w == "causal":
                causal = True
            elif w == "split":
                split = True
            elif w == "softcap":
                softcap = True
            elif re.fullmatch(r"sm_?\d+a?", w):
                continue
            else:
                raise ValueError(f"bad kernel label {label!r}: unknown word {w!r}")
        if hdim is None or dtype is None:
            raise ValueError(f"bad kernel label {label!r}")
        return cls(hdim, dtype, causal, split, softcap)


def kernel_head_dim(head_dim: int) -> int:
    """The FA2 kernel head dim that runs head dim ``head_dim``.

    Returns
    -------
    int
        The smallest member of :data:`KERNEL_HEAD_DIMS` that is ``>= head_dim``.

    Raises
    ------
    ValueError
        ``head_dim`` is not a positive multiple of 8 up to 256.
    """
    if head_dim <= 0 or head_dim % 8 or head_dim > KERNEL_HEAD_DIMS[-1]:
        raise ValueError(f"FA2 needs 0 < head dim <= 256 and a multiple of 8, got {head_dim}")
    return next(d for d in KERNEL_HEAD_DIMS if d >= head_dim)


def normalize_dtype(dtype: str) -> str:
    """The short kernel dtype name of ``dtype`` (``float16``, ``half``, ``bf16``, ...).

    Returns
    -------
    str
        ``"fp16"`` or ``"bf16"``.

    Raises
    ------
    ValueError
        Any other dtype (FA2 has no float32 kernels).
    """
    try:
        return _DTYPE_ALIASES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"FA2 supports float16 and bfloat16 only, got {dtype!r}") from None


def normalize_arch(arch: str | int) -> str:
    """Canonical arch name: ``sm_90`` from ``sm_90``, ``sm90``, ``90``, ``9.0`` or ``compute_90``.

    Returns
    -------
    str
        ``sm_<major><minor>[a]``.

    Raises
    ------
    ValueError
        Unparseable, or older than sm_80 (FA2's minimum).
    """
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

    ``spec`` is an :class:`mqa_byoc.compiler.graph.spec.AttentionSpec` or anything with ``head_dim``,
    ``head_dim_v``, ``dtype``, ``causal``, ``window_left`` and ``window_right``.

    Both split-KV and plain kernels are planned (the choice depends on B, S_q, S_kv at run time).
    Non-causal kernels are always planned: FA2 switches causal off for S_q == 1 (decode) and uses
    its local (non-causal) instantiation for sliding windows. Causal kernels are planned when the
    spec is causal, or has window_right == 0 (a window wider than S_kv degenerates to causal).
    A spec with ``softcap > 0`` needs the soft-capping families (:attr:`KernelKey.softcap`).

    Returns
    -------
    tuple of KernelKey
        Sorted keys (2 or 4).
    """
    d, dv = int(spec.head_dim), int(getattr(spec, "head_dim_v", spec.head_dim))
    if d != dv:
        raise ValueError(f"FA2 needs equal q/k and v head dims, got {d} and {dv}")
    hdim = kernel_head_dim(d)
    dtype = normalize_dtype(spec.dtype)
    causal_flags = [False]
    if spec.causal or int(getattr(spec, "window_right", -1)) == 0:
        causal_flags.append(True)
    softcap = float(getattr(spec, "softcap", 0.0) or 0.0) > 0
    return tuple(
        sorted(KernelKey(hdim, dtype, c, s, softcap) for c in causal_flags for s in (False, True))
    )


def keys_for(
    head_dims: Iterable[int],
    dtypes: Iterable[str],
    causal: Sequence[bool] = (False, True),
    split: Sequence[bool] = (False, True),
    softcap: Sequence[bool] = (False,),
) -> tuple[KernelKey, ...]:
    """Keys of the cross product of the arguments, head dims rounded up to kernel head dims.

    Returns
    -------
    tuple of KernelKey
        Sorted, without duplicates.
    """
    out = {
        KernelKey(kernel_head_dim(int(d)), normalize_dtype(t), bool(c), bool(s), bool(f))
        for d in head_dims
        for t in dtypes
        for c in causal
        for s in split
        for f in softcap
    }
    return tuple(sorted(out))


def marker_line(keys: Iterable[KernelKey]) -> str:
    """The :data:`MARKER` comment line listing ``keys`` (read back by :func:`parse_markers`).

    Returns
    -------
    str
        ``// mqa_byoc-kernels: hdim128 fp16; hdim128 fp16 split; ...``
    """
    return f"{MARKER} " + "; ".join(k.label for k in sorted(set(keys)))


def parse_markers(source: str) -> tuple[KernelKey, ...]:
    """Kernel keys listed by :data:`MARKER` lines in a C/C++ source.

    Returns
    -------
    tuple of KernelKey
        Sorted, without duplicates; empty when the source has no marker.
    """
    keys = set()
    for line in source.splitlines():
        line = line.strip()
        if line.startswith(MARKER):
            for label in line[len(MARKER) :].split(";"):
                if label.strip():
                    keys.add(KernelKey.parse(label))
    return tuple(sorted(keys))


def build_command_hint(keys: Iterable[KernelKey], arch: str | None = None) -> str:
    """The ``mqa-byoc build-kernels`` command line that builds ``keys``.

    Returns
    -------
    str
        e.g. ``mqa-byoc build-kernels --arch sm_90 --head-dims 128 --dtypes bf16`` (``--softcap`` when
        the keys are soft-capping families).
    """
    keys = list(keys)
    hdims = ",".join(str(d) for d in sorted({k.head_dim for k in keys}))
    dtypes = ",".join(sorted({k.dtype for k in keys}))
    arch_opt = f" --arch {arch}" if arch else ""
    softcap = " --softcap" if any(k.softcap for k in keys) else ""
    return f"mqa-byoc build-kernels{arch_opt} --head-dims {hdims} --dtypes {dtypes}{softcap}"
