"""The read floor: the least GPU time in which a kernel reads a buffer (``read_floor.cu``), the bound under
any kernel that must read the same bytes. The decode benchmark reports it next to the HBM time (bytes /
peak bandwidth): a buffer that fits in L2 stays there across back-to-back calls, and a small read is
dominated by the launch and the ramp-up, so the floor can sit on either side of the HBM time."""
from __future__ import annotations

import ctypes
import functools
import itertools
import pathlib
import subprocess
import tempfile

SOURCE = pathlib.Path(__file__).resolve().parent / "read_floor.cu"
#: launch shapes tried (blocks per SM, threads a block); the floor is the fastest
SHAPES = [(bps, t) for bps in (1, 2, 4, 8, 16) for t in (256, 512, 1024) if bps * t <= 2048]


@functools.lru_cache(maxsize=None)
def library(arch: str = "sm_90a") -> ctypes.CDLL:
    out = pathlib.Path(tempfile.mkdtemp(prefix="read_floor_")) / "libread_floor.so"
    subprocess.run(["nvcc", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-O3", "-Xcompiler", "-fPIC", "-shared",
                    "-o", str(out), str(SOURCE)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.mqa_byoc_read_floor_launch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_void_p]
    return lib


def reader(bufs, blocks: int, threads: int):
    """A callable whose n-th call reads all of ``bufs[n % len(bufs)]`` (contiguous CUDA tensors, a multiple
    of 16 bytes each); ``blocks=0``: an empty kernel (the launch alone)."""
    import torch

    for b in bufs:
        if not b.is_contiguous() or b.numel() * b.element_size() % 16:
            raise ValueError("read_floor needs contiguous buffers of a multiple of 16 bytes")
    lib, sink = library(), torch.zeros(1, dtype=torch.int32, device=bufs[0].device)
    turns = itertools.cycle([(b.data_ptr(), b.numel() * b.element_size()) for b in bufs])

    def call():
        ptr, nbytes = next(turns)
        rc = lib.mqa_byoc_read_floor_launch(ptr, nbytes, sink.data_ptr(), blocks, threads,
                                            torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"read_floor launch failed: CUDA error {rc}")

    call.keep = (bufs, sink)
    return call


def cold_copies(buf, l2_bytes: int = 50 << 20) -> list:
    """``buf`` and as many clones of it as make them together exceed twice ``l2_bytes``: taken in turns, no
    read finds its buffer in L2."""
    return [buf] + [buf.clone() for _ in range(-(-2 * l2_bytes // (buf.numel() * buf.element_size())))]


def read_floor_us(buf, time_us, l2_bytes: int = 50 << 20) -> dict:
    """The fastest of :data:`SHAPES` at reading ``buf``, timed by ``time_us(fn)``: ``warm``, the same buffer
    every call (as a decode loop reads its cache), and ``cold``, copies taking turns that together exceed
    ``l2_bytes`` (each read comes from HBM); and an empty kernel's time."""
    import torch

    sms = torch.cuda.get_device_properties(buf.device).multi_processor_count
    copies = cold_copies(buf, l2_bytes)
    rec = {"empty_kernel_us": time_us(reader([buf], 0, 32))}
    for name, bufs in (("warm", [buf]), ("cold", copies)):
        times = {(bps, t): time_us(reader(bufs, bps * sms, t)) for bps, t in SHAPES}
        (bps, t), best = min(times.items(), key=lambda kv: kv[1])
        rec[f"read_floor_{name}_us"], rec[f"read_floor_{name}_shape"] = best, f"{bps * sms}x{t}"
    return rec
