"""Where the build's inputs and outputs live: our native sources and the kernel cache."""

from __future__ import annotations

import os
from pathlib import Path

#: our C++/CUDA sources (package data of ``mqa_byoc``)
NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"
ENTRY_SOURCE = NATIVE_DIR / "fa2_kernel_entry.cu"
DISPATCH_SOURCE = NATIVE_DIR / "fa2_dispatch.cc"
DISPATCH_HEADER = NATIVE_DIR / "fa2_dispatch.h"
#: the MQA_BYOC_NVTX switch, shared by the dispatcher and the disco NCCL library
NVTX_HEADER = NATIVE_DIR / "nvtx_switch.h"
LINK_CHECK_SOURCE = NATIVE_DIR / "fa2_link_check.cc"
#: our decode kernels, device code compiled per arch into one support object (SUPPORT_SOURCE includes
#: both): the grouped-query decode kernel, and the chunk lengths + combine of the FA2 chunked decode
COMBINE_SOURCE = NATIVE_DIR / "split_kv_combine.cu"
GQA_DECODE_SOURCE = NATIVE_DIR / "gqa_decode.cu"
GQA_DECODE_HEADER = NATIVE_DIR / "gqa_decode.h"
#: the C API of the PagedKVCache attention (fa2_paged.cu)
PAGED_HEADER = NATIVE_DIR / "fa2_paged.h"
#: calling an FA4 object from C++ (fa4_decode.cu, fa4_ragged.cu)
FA4_CALL_HEADER = NATIVE_DIR / "fa4_call.h"
#: TVM's base-2 LSE rule, shared by fa2_paged.cu and fa4_ragged.cu
LSE_RULE_HEADER = NATIVE_DIR / "lse_rule.h"
SUPPORT_SOURCE = NATIVE_DIR / "decode_support.cu"
#: the sink epilogue of attention with sinks (output * sigmoid(lse - sink)), in the support object too
SINK_EPILOGUE_SOURCE = NATIVE_DIR / "sink_epilogue.cu"
#: CUTLASS's GEMV for GEMMs of one row (a fatbin the cuBLASLt dispatcher embeds and launches itself)
GEMV_SOURCE = NATIVE_DIR / "cutlass_gemv.cu"
GEMV_HEADER = NATIVE_DIR / "cutlass_gemv.h"
#: stand-ins for the three torch headers flash-attn's forward kernels include
SHIM_DIR = NATIVE_DIR / "shim"


def cache_root() -> Path:
    """Root of the kernel cache: ``$MQA_BYOC_CACHE``, else ``~/.cache/mqa_byoc``.

    Returns
    -------
    Path
        Not necessarily existing yet.
    """
    env = os.environ.get("MQA_BYOC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mqa_byoc"
