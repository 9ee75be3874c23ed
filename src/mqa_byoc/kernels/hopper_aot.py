"""Compile FA4's sm90 forward into objects: ``python -m mqa_byoc.kernels.hopper_aot --out DIR LABEL...``.

Run by :func:`mqa_byoc.kernels.hopper.build_objects` in a subprocess (the DSL reads its target from
the environment at import). Needs flash-attn-4, nvidia-cutlass-dsl and torch; no GPU: the tensors are
torch fake tensors and the arch comes from ``CUTE_DSL_ARCH``.

For each key, flash-attn-4's own interface configures the kernel (tile sizes, GQA packing, pipeline
options) exactly as it would for a call with these head counts; we stop it at its ``cute.compile``
and compile instead a small entry of ours with a flat signature around that configured kernel
object, so that the exported TVM-FFI function takes plain tensors and numbers (no LSE, no var-len,
no paging), which C++ can call.
"""

# no `from __future__ import annotations`: the DSL evaluates the entry's annotations itself
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# SM count for flash-attn-4's split heuristics; the sm90 kernel reads the real one at run time
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

from mqa_byoc.kernels.hopper import (  # noqa: E402
    CUTLASS_DSL_VERSION,
    FA4_VERSION,
    RUNTIME_ARCHIVE,
    VARLEN_MASKS,
    HopperKernelKey,
    write_manifest,
)


class _Configured(Exception):
    """Raised from the intercepted ``cute.compile``: the interface has configured its kernel."""

    def __init__(self, args, kwargs):
        super().__init__("configured")
        self.args, self.kwargs = args, kwargs


def _configured_kernel(fi, torch, key: HopperKernelKey):
    """flash-attn-4's configured kernel object and its compile arguments for ``key``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[key.dtype]
    heads_kv = 2
    real = fi.cute.compile

    def intercept(*args, **kwargs):
        raise _Configured(args, kwargs)

    causal = key.mask == "causal"
    window = (128, 0) if key.mask == "local" else (None, None)
    fi.cute.compile = intercept
    try:
        with FakeTensorMode():
            if key.mask in VARLEN_MASKS:  # 2 sequences of 2048 rows (prefill-sized: FA4's two query stages)
                q = torch.empty(4096, heads_kv * key.group, key.head_dim, dtype=dtype, device="cuda")
                k = torch.empty(4096, heads_kv, key.head_dim, dtype=dtype, device="cuda")
                cu = torch.empty(3, dtype=torch.int32, device="cuda")
                fi._flash_attn_fwd(q, k, k.clone(), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2048,
                                   max_seqlen_k=2048, causal=key.mask == "varlen_causal", return_lse=True,
                                   disable_scheduler_metadata=True, _arch=90)
            elif key.mask == "splitkv":  # 16 chunks of 1024 keys, one query row each
                q = torch.empty(16, 1, heads_kv * key.group, key.head_dim, dtype=dtype, device="cuda")
                k = torch.empty(16 * 1024, heads_kv, key.head_dim, dtype=dtype, device="cuda")
                cu = torch.empty(17, dtype=torch.int32, device="cuda")
                fi._flash_attn_fwd(q, k, k.clone(), cu_seqlens_k=cu, max_seqlen_k=1024, return_lse=True, _arch=90)
            else:
                q = torch.empty(1, 256, heads_kv * key.group, key.head_dim, dtype=dtype, device="cuda")
                k = torch.empty(1, 256, heads_kv, key.head_dim, dtype=dtype, device="cuda")
                fi._flash_attn_fwd(q, k, k.clone(), causal=causal, window_size_left=window[0],
                                   window_size_right=window[1], _arch=90)
    except _Configured as c:
        return c.args, c.kwargs
    finally:
        fi.cute.compile = real
    raise RuntimeError(f"flash-attn-4 {FA4_VERSION} did not reach cute.compile for {key.label}")


def compile_key(key: HopperKernelKey, out_dir: Path) -> dict:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import flash_attn.cute.interface as fi
    import torch
    from flash_attn.cute.utils import AuxData

    t0 = time.time()
    (args, kwargs) = _configured_kernel(fi, torch, key)
    # positions of FlashAttentionForwardSm90.__call__'s compile arguments in flash-attn-4 4.0.0b36
    kernel, q, k, v, o, lse, cu_q, cu_k, stream = (args[0], args[1], args[2], args[3], args[4], args[5], args[7],
                                                   args[8], args[-1])
    if type(kernel).__name__ != "FlashAttentionForwardSm90":
        raise RuntimeError(f"{key.label}: flash-attn-4 chose {type(kernel).__name__}, not the sm90 kernel")

    if key.mask in VARLEN_MASKS:
        @cute.jit
        def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  softmax_scale: cutlass.Float32, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                  stream: cuda.CUstream):
            kernel(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, None, None, None, None, None,
                   None, None, AuxData(), None, None, stream)

        fn = cute.compile(entry, q, k, v, o, lse, cutlass.Float32(1.0), cu_q, cu_k, stream,
                          options=kwargs.get("options", "--enable-tvm-ffi"))
    elif key.mask == "splitkv":
        @cute.jit
        def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  softmax_scale: cutlass.Float32, mCuSeqlensK: cute.Tensor, stream: cuda.CUstream):
            kernel(mQ, mK, mV, mO, mLSE, softmax_scale, None, mCuSeqlensK, None, None, None, None, None,
                   None, None, AuxData(), None, None, stream)

        fn = cute.compile(entry, q, k, v, o, lse, cutlass.Float32(1.0), cu_k, stream,
                          options=kwargs.get("options", "--enable-tvm-ffi"))
    elif key.mask == "local":
        @cute.jit
        def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                  softmax_scale: cutlass.Float32, window_left: cutlass.Int32, window_right: cutlass.Int32,
                  stream: cuda.CUstream):
            kernel(mQ, mK, mV, mO, None, softmax_scale, None, None, None, None, None, window_left,
                   window_right, None, None, AuxData(), None, None, stream)

        extra = (cutlass.Int32(0), cutlass.Int32(0))
    else:
        @cute.jit
        def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                  softmax_scale: cutlass.Float32, stream: cuda.CUstream):
            kernel(mQ, mK, mV, mO, None, softmax_scale, None, None, None, None, None, None, None,
                   None, None, AuxData(), None, None, stream)

        extra = ()
    if key.mask not in ("splitkv", *VARLEN_MASKS):
        fn = cute.compile(entry, q, k, v, o, cutlass.Float32(1.0), *extra, stream,
                          options=kwargs.get("options", "--enable-tvm-ffi"))
    return _export(fn, key, out_dir, kernel, t0)


def _export(fn, key: HopperKernelKey, out_dir: Path, kernel, t0: float) -> dict:
    """Write the compiled ``fn`` as ``key``'s object in ``out_dir``; its manifest entry."""
    path = out_dir / key.filename
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.o")
    fn.export_to_c(object_file_path=str(tmp), function_name=key.symbol)
    tmp.replace(path)
    return {"label": key.label, "symbol": key.symbol, "seconds": round(time.time() - t0, 2),
            "tile": [int(kernel.tile_m), int(kernel.tile_n)], "pack_gqa": bool(kernel.pack_gqa),
            "bytes": path.stat().st_size}


def _runtime_archive() -> Path:
    """The static CUDA-runtime shim of the toolkit flavor the DSL loaded (cu12 or cu13)."""
    mod = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    import nvidia_cutlass_dsl

    root = Path(nvidia_cutlass_dsl.__path__[0])
    flavor = next((p for p in ("cu13", "cu12") if mod is not None and f".{p}." in Path(mod.__file__).name), "cu13")
    return root / flavor / "lib" / RUNTIME_ARCHIVE


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mqa_byoc.kernels.hopper_aot")
    p.add_argument("--out", required=True, help="directory for the objects (created)")
    p.add_argument("labels", nargs="+", help="kernel labels, e.g. 'fp16 h128 g8 causal'")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for label in a.labels:
        key = HopperKernelKey.parse(label)
        entries[key.filename] = compile_key(key, out)
        print(json.dumps(entries[key.filename]), flush=True)
    shutil.copy2(_runtime_archive(), out / RUNTIME_ARCHIVE)
    import cutlass

    write_manifest(out, entries, {"arch": "sm_90", "flash_attn_4": FA4_VERSION,
                                  "cutlass_dsl": getattr(cutlass, "__version__", CUTLASS_DSL_VERSION),
                                  "cute_dsl_arch": os.environ["CUTE_DSL_ARCH"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
