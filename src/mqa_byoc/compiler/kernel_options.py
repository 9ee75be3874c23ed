"""Kernel choices fixed when a library is built: ``mqa_byoc.build(..., kernel_options=...)``.

A deployed library never reads the environment to pick a kernel: the choices below are compiled into
it, as one constant (``mqa_byoc_library_kernel_options``, hidden, a struct of ``native/fa2_dispatch.h``)
that the FA2 dispatcher, the paged-KV wrappers and the hopper provider's wrappers read; a library
without one (the codegen run by hand, without :func:`mqa_byoc.build`) runs the defaults. The library
also exports ``mqa_byoc_kernel_options()``, returning :meth:`KernelOptions.describe`, so what a
library was built with can be read back from it (``tvm.runtime.load_module(path)`` then
``lib["mqa_byoc_kernel_options"]()``, or the C++ runtime's ``GetFunction``).

This module does not import TVM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from collections.abc import Mapping

#: The choices, their allowed values (the first is the default) and what each value means.
CHOICES: dict[str, dict[str, str]] = {
    "decode_kernel": {
        "auto": "one query row per sequence runs on our grouped-query decode kernel where it serves "
                "(head dims 64 and 128), FA2 otherwise",
        "fa2": "decode always on FA2 (split-KV)",
    },
    "decode_merge": {
        "auto": "the grouped-query decode kernel merges its splits as its plan says",
        "global": "through a workspace in global memory",
        "cluster": "inside a thread-block cluster only (a launch whose clusters cannot be co-resident fails)",
    },
    "split_combine": {
        "own": "batch-1 FA2 split-KV decode: chunked calls and our combine kernel",
        "fa2": "FA2's own split-KV and combine kernel",
    },
    "hopper_fa4": {
        "auto": "hopper provider: FA4 for calls with enough query tiles (prefill), FA2 for the rest",
        "always": "FA4 for every call it can compute, batch-1 decode through our split-KV around FA4",
        "never": "FA2 only",
    },
    "gemm_algorithm": {
        "measure": "a cuBLASLt GEMM of at most 64 rows times up to 16 of the heuristic's algorithms and the "
                   "split-count-1 form of each split-K one, from a cold L2, once per shape, and keeps the fastest; "
                   "larger GEMMs keep the heuristic's first choice",
        "heuristic": "every cuBLASLt GEMM keeps the heuristic's first choice",
    },
    "gemm_gemv": {
        "measure": "a GEMM of one row that CUTLASS's GEMV can compute (fp16/bf16 out of an (N, K) weight, "
                   "no batch, a bias or a residual but not both, no activation, K a multiple of 8, 16-byte "
                   "aligned) also times its configurations with cuBLASLt's candidates and keeps the fastest "
                   "(with gemm_algorithm=measure)",
        "off": "every GEMM on cuBLASLt",
        "always": "a GEMM of one row that CUTLASS's GEMV can compute runs on it (its fastest configuration, "
                  "cuBLASLt not timed)",
    },
    "launch_overlap": {
        "off": "plain launches: a kernel starts when the one before it has ended",
        "pdl": "on sm_90 and later our decode kernel and CUTLASS's GEMV launch as programmatic dependents "
               "(PDL: their CTAs may start while the kernel before them ends, and wait for its results before "
               "reading any operand); the decode kernel lets the next kernel start once all its CTAs run",
        "prefetch": "as pdl, and each GEMV CTA asks the L2 for the first bytes of its weight rows before it waits",
    },
}

#: Name of the constant the build defines and the dispatcher reads (weakly).
SYMBOL = "mqa_byoc_library_kernel_options"
#: Name of the TVM-FFI function a built library exports, returning :meth:`KernelOptions.describe`.
QUERY_FUNCTION = "mqa_byoc_kernel_options"


@dataclass(frozen=True)
class KernelOptions:
    """The kernel choices of one library (see :data:`CHOICES`); the defaults are the measured best."""

    decode_kernel: str = "auto"
    decode_merge: str = "auto"
    split_combine: str = "own"
    hopper_fa4: str = "auto"
    gemm_algorithm: str = "measure"
    gemm_gemv: str = "measure"
    launch_overlap: str = "off"

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value not in CHOICES[f.name]:
                raise ValueError(f"kernel_options {f.name}={value!r}: expected one of {tuple(CHOICES[f.name])}")

    @classmethod
    def of(cls, value: KernelOptions | Mapping | str | None) -> KernelOptions:
        """``value`` as options: an instance, a mapping (``{"hopper_fa4": "always"}``), a string
        ``"hopper_fa4=always,decode_kernel=fa2"`` (the form :meth:`describe` writes) or None (defaults).

        Raises
        ------
        ValueError
            An unknown choice or value (the message lists the allowed ones).
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            items = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                key, sep, val = part.partition("=")
                if not sep:
                    raise ValueError(f"kernel_options {value!r}: expected name=value pairs separated by commas")
                items[key.strip()] = val.strip()
            value = items
        if not isinstance(value, Mapping):
            raise TypeError(f"kernel_options must be a KernelOptions, a dict or a string, got {type(value).__name__}")
        unknown = sorted(set(value) - set(CHOICES))
        if unknown:
            raise ValueError(f"kernel_options: unknown choice(s) {unknown}; known: {sorted(CHOICES)}")
        return cls(**{k: str(v) for k, v in value.items()})

    def codes(self) -> tuple[int, ...]:
        """The struct's fields, in order: each choice's index in :data:`CHOICES` (0 = default)."""
        return tuple(list(CHOICES[f.name]).index(getattr(self, f.name)) for f in fields(self))

    def describe(self) -> str:
        """``decode_kernel=auto,decode_merge=auto,split_combine=own,hopper_fa4=auto,gemm_algorithm=measure,gemm_gemv=measure,launch_overlap=off``."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def is_default(self) -> bool:
        return self == KernelOptions()


def c_source(options: KernelOptions) -> str:
    """C++ of the library's options module: the constant and its query function."""
    codes = ", ".join(str(c) for c in options.codes())
    members = ", ".join(f.name for f in fields(options))
    text = options.describe()
    return f"""// Generated by mqa_byoc.compiler.kernel_options: the kernel choices of this library.
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

// mqa_byoc/native/fa2_dispatch.h's mqa_byoc_kernel_options: {text}
extern "C" {{
struct mqa_byoc_kernel_options_def {{
  int {members};
}};
__attribute__((visibility("hidden"))) extern const mqa_byoc_kernel_options_def {SYMBOL};
__attribute__((visibility("hidden"))) const mqa_byoc_kernel_options_def {SYMBOL} = {{{codes}}};
}}

namespace {{
tvm::ffi::String kernel_options() {{ return "{text}"; }}
}}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC({QUERY_FUNCTION}, kernel_options);
"""
