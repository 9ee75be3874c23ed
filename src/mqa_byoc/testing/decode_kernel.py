"""ctypes access to ``native/gqa_decode.cu`` for the GPU test and benchmark of the decode kernel alone
(no TVM): nvcc builds it into a shared library on the GPU machine, torch tensors pass by pointer."""
from __future__ import annotations

import ctypes
import functools
import math
import os
import pathlib
import subprocess
import tempfile

NATIVE = pathlib.Path(__file__).resolve().parent.parent / "native"


class DecodeArgs(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("q_stride", ctypes.c_int64 * 2), ("o_stride", ctypes.c_int64 * 2),
        ("k_stride", ctypes.c_int64 * 3), ("v_stride", ctypes.c_int64 * 3),
        ("page_indptr", ctypes.c_void_p), ("page_values", ctypes.c_void_p), ("last_page_len", ctypes.c_void_p),
        ("page_size", ctypes.c_int64), ("nnz_pages", ctypes.c_int64), ("seqlen_k", ctypes.c_int64),
        ("batch", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("num_heads_k", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("is_bf16", ctypes.c_int), ("softmax_scale", ctypes.c_float),
        ("window_left", ctypes.c_int), ("lse_empty", ctypes.c_float),
    ]


class DecodePlan(ctypes.Structure):
    _fields_ = [
        ("splits", ctypes.c_int), ("keys_per_split", ctypes.c_int), ("row_groups", ctypes.c_int),
        ("o_part_floats", ctypes.c_int64), ("counters", ctypes.c_int64), ("workspace_bytes", ctypes.c_size_t),
        ("merge", ctypes.c_int), ("warps", ctypes.c_int), ("row_tiles", ctypes.c_int),
        ("shared_tiles", ctypes.c_int), ("overlap", ctypes.c_int),
    ]


MERGES = {"auto": 0, "global": 1, "cluster": 2}  # gqa_decode.h's MQA_BYOC_DECODE_MERGE_*
#: ``row_tiles`` asking for SharedTiles (gqa_decode.h's MQA_BYOC_DECODE_SHARED_TILES): the group's row tiles
#: as the warps of one CTA, whatever the batch (head dim 64, more than 16 query rows a K/V head)
SHARED_TILES = -1


#: M tiles a warp may carry in this build (the packaged libraries compile one): the tests and benchmarks of
#: the kernel measure up to three
ROW_TILES = 3


@functools.lru_cache(maxsize=None)
def library(arch: str = "sm_90a", lineinfo: bool = False, phases: bool = False) -> ctypes.CDLL:
    """The kernel built for ``arch`` (once per process); ``lineinfo`` for ncu's source view; ``phases``: with
    the classic blocks' phase timestamps (``-DMQA_BYOC_DECODE_PHASES``, :func:`set_phase_buffer`). A library
    built ahead of time from this source (:func:`build_command`) is taken from ``MQA_BYOC_DECODE_LIB``
    instead, or with ``phases`` from ``MQA_BYOC_DECODE_PHASES_LIB`` (not for ``lineinfo``)."""
    prebuilt = os.environ.get("MQA_BYOC_DECODE_PHASES_LIB" if phases else "MQA_BYOC_DECODE_LIB")
    if prebuilt and not lineinfo:
        return load_library(prebuilt)
    out = pathlib.Path(tempfile.mkdtemp(prefix="gqa_decode_")) / "libgqa_decode.so"
    subprocess.run(build_command(out, arch, lineinfo=lineinfo, phases=phases), check=True)
    return load_library(out)


def build_command(out, arch: str = "sm_90a", lineinfo: bool = False, phases: bool = False) -> list[str]:
    """The nvcc command that builds ``gqa_decode.cu`` into the shared library ``out``."""
    return ["nvcc", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
            f"-DMQA_BYOC_DECODE_ROW_TILES={ROW_TILES}", *(["-lineinfo"] if lineinfo else []),
            *(["-DMQA_BYOC_DECODE_PHASES"] if phases else []), "-shared", "-o", str(out), str(NATIVE / "gqa_decode.cu")]


#: words a CTA writes into a phase buffer (gqa_decode.cu's MQA_BYOC_PHASE)
PHASE_WORDS = 16
#: the points of a CTA's work its phase timestamps mark, in order
PHASES = ("start", "sequence range", "prologue", "first tile", "last tile", "CTA merge", "end")


def set_phase_buffer(lib: ctypes.CDLL, buffer) -> None:
    """Points a ``phases=True`` build's timestamps at ``buffer`` (a torch int64 tensor of at least
    ``PHASE_WORDS`` words a CTA of the next launches), or at nothing (``None``)."""
    lib.mqa_byoc_decode_set_phase_buffer.argtypes = [ctypes.c_void_p]
    rc = lib.mqa_byoc_decode_set_phase_buffer(None if buffer is None else buffer.data_ptr())
    if rc != 0:
        raise RuntimeError(f"mqa_byoc_decode_set_phase_buffer: CUDA error {rc}")


def set_plan_argtypes(lib: ctypes.CDLL) -> None:
    """The argument types of the kernel's host-side plan functions (``gqa_decode.h``) on ``lib``."""
    lib.mqa_byoc_decode_make_plan.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_int), ctypes.POINTER(DecodePlan)]
    lib.mqa_byoc_decode_plan_split.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int64, ctypes.c_int,
                                               ctypes.POINTER(DecodePlan)]
    if hasattr(lib, "mqa_byoc_decode_plan_grid"):  # a build from before it (a benchmark's baseline) has none
        lib.mqa_byoc_decode_plan_grid.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int64, ctypes.c_int64,
                                                  ctypes.c_int, ctypes.POINTER(DecodePlan)]
    lib.mqa_byoc_decode_rows_per_cta.argtypes = [ctypes.c_int64]
    lib.mqa_byoc_decode_supported.argtypes = [ctypes.c_int64] * 3


def load_library(path) -> ctypes.CDLL:
    """A built decode-kernel library with its C API's argument types set."""
    lib = ctypes.CDLL(str(path))
    set_plan_argtypes(lib)
    lib.mqa_byoc_decode_cluster_capacity.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int, ctypes.c_int,
                                                     ctypes.POINTER(ctypes.c_int)]
    lib.mqa_byoc_decode_launch.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.POINTER(DecodePlan), ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_void_p]
    return lib


def _args(q, k, v, out, lse, *, k_stride, v_stride, seqlen_k, num_heads_k, scale, window_left, pages=None):
    import torch

    a = DecodeArgs()
    a.q, a.k, a.v, a.out = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    a.lse = lse.data_ptr() if lse is not None else None
    a.q_stride[:] = [q.stride(0), q.stride(1)]
    a.o_stride[:] = [out.stride(0), out.stride(1)]
    a.k_stride[:] = list(k_stride)
    a.v_stride[:] = list(v_stride)
    if pages is not None:
        indptr, values, last, page_size = pages
        a.page_indptr, a.page_values, a.last_page_len = indptr.data_ptr(), values.data_ptr(), last.data_ptr()
        a.page_size, a.nnz_pages = page_size, values.numel()
    a.seqlen_k = seqlen_k
    a.batch, a.num_heads, a.num_heads_k, a.head_dim = q.shape[0], q.shape[1], num_heads_k, q.shape[2]
    a.is_bf16 = int(q.dtype == torch.bfloat16)
    a.softmax_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[2])
    a.window_left = window_left
    a.lse_empty = -5e4
    return a


class Decode:
    """One prepared call: ``plan`` holds the grid; ``__call__`` launches on torch's current stream."""

    def __init__(self, q, k, v, out, lse=None, *, k_stride, v_stride, seqlen_k, num_heads_k, scale=None,
                 window_left=-1, pages=None, merge: str = "auto", row_tiles: int = 0, lib=None,
                 overlap: bool = False):
        """``merge``: how the splits merge (:data:`MERGES`; "cluster" fails the launch with rc 4 where the
        grid's clusters are not co-resident); ``row_tiles``: the M tiles of 16 query rows a warp carries
        (0: the kernel's rule; :data:`SHARED_TILES`: SharedTiles); ``lib``: a library of :func:`load_library` (default: :func:`library`);
        ``overlap``: launch as a programmatic dependent (the plan's ``overlap``, what a library built with
        ``launch_overlap`` on does). Off by default: back-to-back calls of one kernel launched so would
        overlap one another, which a model's attention (after TVM's kernels) never does, so a call's time
        would not be its own."""
        import torch

        self.lib = lib if lib is not None else library()
        self.merge = MERGES[merge]
        self.overlap = int(overlap)
        self.row_tiles = row_tiles
        self.keep = (q, k, v, out, lse, pages)
        self.args = _args(q, k, v, out, lse, k_stride=k_stride, v_stride=v_stride, seqlen_k=seqlen_k,
                          num_heads_k=num_heads_k, scale=scale, window_left=window_left, pages=pages)
        self.plan = DecodePlan()
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        self.capacity = (ctypes.c_int * 16)()
        device = q.device.index if q.device.index is not None else torch.cuda.current_device()
        rc = self.lib.mqa_byoc_decode_cluster_capacity(ctypes.byref(self.args), row_tiles, device, self.capacity)
        assert rc == 0, f"cluster_capacity rc={rc}"
        rc = self.lib.mqa_byoc_decode_make_plan(ctypes.byref(self.args), row_tiles, sms, self.capacity,
                                                ctypes.byref(self.plan))
        self._take_plan(rc, "make_plan", q.device)

    def _take_plan(self, rc: int, what: str, device) -> None:
        """The plan a plan function just wrote (rc its return code): this call's merge, a workspace for it."""
        import torch

        assert rc == 0, f"{what} rc={rc}"
        self.plan.merge = self.merge
        self.plan.overlap = self.overlap
        self.ws = torch.empty(max(1, self.plan.workspace_bytes), dtype=torch.uint8, device=device)

    def set_keys_per_split(self, kps: int) -> None:
        """Replaces the plan's split size (the benchmark's sweep; the kernel's own rule for the rest)."""
        rc = self.lib.mqa_byoc_decode_plan_split(ctypes.byref(self.args), kps, self.row_tiles, ctypes.byref(self.plan))
        self._take_plan(rc, f"plan_split({kps})", self.ws.device)

    def set_grid(self, kps: int, splits: int) -> None:
        """Splits of ``kps`` keys in a grid of ``splits`` a slot (a sequence longer than that covers cuts
        larger splits): the benchmark's sweep of grids."""
        rc = self.lib.mqa_byoc_decode_plan_grid(ctypes.byref(self.args), kps, splits, self.row_tiles,
                                                ctypes.byref(self.plan))
        self._take_plan(rc, f"plan_grid({kps}, {splits})", self.ws.device)

    def set_packed(self) -> None:
        """SharedTiles' packed splits on pages (``row_tiles`` :data:`SHARED_TILES`): the plan as the rule makes it
        where a slot's splits would not merge in a cluster, whatever the batch."""
        import torch

        sms = torch.cuda.get_device_properties(self.ws.device).multi_processor_count
        rc = self.lib.mqa_byoc_decode_make_plan(ctypes.byref(self.args), self.row_tiles, sms, None,
                                                ctypes.byref(self.plan))
        self._take_plan(rc, "make_plan(packed)", self.ws.device)
        assert self.plan.shared_tiles == 2, self.plan.shared_tiles

    def set_key_groups(self, n: int) -> None:
        """SharedTiles with ``n`` key groups (1 or 2): the CTA's warps ``n`` times its row tiles, warp w running
        row tile w % tiles over one of each 64-key tile's two 32-key steps; the launch refuses 2 past 5 row
        tiles (rc 2: both groups' outputs must fit the kernel's main buffer)."""
        assert self.plan.shared_tiles in (1, 2) and n in (1, 2), (self.plan.shared_tiles, n)
        group = self.args.num_heads // self.args.num_heads_k
        self.plan.warps = min(8, -(-group // 16)) * n

    def __call__(self):
        import torch

        stream = torch.cuda.current_stream().cuda_stream
        rc = self.lib.mqa_byoc_decode_launch(ctypes.byref(self.args), ctypes.byref(self.plan), self.ws.data_ptr(),
                                             torch.cuda.current_device(), ctypes.c_void_p(stream))
        assert rc == 0, f"launch rc={rc}"


def reference(q, k, v, lengths, num_heads_k, scale=None, window_left=-1):
    """fp32 attention of q (B, H, D) over k/v lists of (len_b, H_kv, D); returns out (B, H, D), base-2 LSE (B, H)."""
    import torch

    b_, h, d = q.shape
    g = h // num_heads_k
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(b_, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b_, h), -5e4, dtype=torch.float32, device=q.device)
    for b in range(b_):
        n = lengths[b]
        lo = max(0, n - 1 - window_left) if window_left >= 0 else 0
        if n - lo <= 0:
            continue
        kb = k[b][lo:n].float().repeat_interleave(g, dim=1)  # (n, H, D): head h uses K/V head h // g
        vb = v[b][lo:n].float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
        lse[b] = torch.logsumexp(s, dim=-1) / math.log(2.0)
    return out, lse
