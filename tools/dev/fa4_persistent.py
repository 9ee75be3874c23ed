"""A persistent tile schedule for FA4's sm90 forward with a causal mask: an experiment of
``tools/dev/fa4_configs.py`` (config ``persistent``), not used by the provider
(``benchmarks/results/2026-12-01-prefill-fa4-persistent.md``: faster at 1k-4k, slower at 16k).

flash-attn-4 launches its sm90 causal forward with one CTA per (m block, K/V head) tile, heaviest tiles
first (``SingleTileLPTScheduler``). Its kernel already loops over the tiles a scheduler hands out; this
scheduler launches one CTA per SM instead and walks the same longest-first order in a snake (even
waves left to right, odd waves right to left), so every CTA gets tiles of nearly equal total length and
the next tile's loads start without a CTA launch.

The kernel keeps its output staging (``sO``) in the storage of Q and releases Q before the epilogue,
which is safe only when the CTA ends after the epilogue. So the producer warp waits, before it loads the
next tile's Q, until the epilogue's TMA store has read ``sO``: a named barrier between the first
consumer warp (the one that issues and waits for that store) and the load warp.

The number of CTAs is a run-time value (:data:`num_ctas`, set by the entry being traced), so one object
runs on a GPU of any SM count: the compiled function takes it after the scale.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, TileSchedulerArguments, WorkTileInfo
from quack.cute_dsl_utils import ParamsBase

#: the CTA count of the launch being traced: an Int32 argument of the entry (:func:`compile_key`)
num_ctas = None
#: a named barrier id beyond flash-attn-4's own (``NamedBarrierFwd``); sm_90 has 16
EPILOGUE_DONE_BARRIER = max(int(b) for b in NamedBarrierFwd) + 1
#: the consumer warp that stores O (flash-attn-4's epilogue: warps 0-3 load, 4 issues the TMA store)
STORE_WARP = 4


class PersistentLPTScheduler:
    @dataclass
    class Params(ParamsBase):
        lpt: SingleTileLPTScheduler.Params
        total_blocks: Int32
        num_ctas: Int32

        @staticmethod
        def create(args: TileSchedulerArguments, *, loc=None, ip=None) -> "PersistentLPTScheduler.Params":
            if num_ctas is None:
                raise RuntimeError("fa4_persistent.num_ctas is not set: trace through hopper_aot's entry")
            lpt = SingleTileLPTScheduler.Params.create(args)
            return PersistentLPTScheduler.Params(lpt, lpt.total_blocks, num_ctas)

    def __init__(self, params: Params, wave: Int32, *, loc=None, ip=None):
        self.params = params
        self._wave = wave
        self._loc = loc

    @staticmethod
    def to_underlying_arguments(args: TileSchedulerArguments, *, loc=None, ip=None) -> Params:
        return PersistentLPTScheduler.Params.create(args)

    @staticmethod
    def create(params: Params, ctx=None, *, loc=None, ip=None) -> "PersistentLPTScheduler":
        return PersistentLPTScheduler(params, Int32(0), loc=loc)

    @staticmethod
    def get_grid_shape(params: Params, *, loc=None, ip=None):
        return (cutlass.min(params.num_ctas, params.total_blocks), Int32(1), Int32(1))

    def _tile(self):
        """The position in the longest-first order of this CTA's current tile (snake over waves)."""
        ctas = cute.arch.grid_dim()[0]
        cta = cute.arch.block_idx()[0]
        odd = self._wave & 1
        return self._wave * ctas + cta + odd * (ctas - 1 - 2 * cta)

    def get_current_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        return SingleTileLPTScheduler(self.params.lpt, self._tile(), Int32(0)).get_current_work()

    def initial_work_tile_info(self, *, loc=None, ip=None) -> WorkTileInfo:
        return self.get_current_work()

    def prefetch_next_work(self, *, loc=None, ip=None):
        # called by the load warp only, after its last load of a tile: wait for that tile's epilogue
        cute.arch.barrier(barrier_id=EPILOGUE_DONE_BARRIER, number_of_threads=2 * cute.arch.WARP_SIZE)

    @cute.jit
    def advance_to_next_work(self, *, loc=None, ip=None):
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
            cute.arch.barrier_arrive(barrier_id=EPILOGUE_DONE_BARRIER, number_of_threads=2 * cute.arch.WARP_SIZE)
        self._wave += 1
        return self.get_current_work()

    def producer_tail(self, *, loc=None, ip=None):
        pass

    def __extract_mlir_values__(self):
        values, self._values_pos = [], []
        for obj in (self.params, self._wave):
            v = cutlass.extract_mlir_values(obj)
            values += v
            self._values_pos.append(len(v))
        return values

    def __new_from_mlir_values__(self, values):
        objs = []
        for obj, n in zip((self.params, self._wave), self._values_pos):
            objs.append(cutlass.new_from_mlir_values(obj, values[:n]))
            values = values[n:]
        return PersistentLPTScheduler(*objs, loc=self._loc)


def _set_num_ctas(value):
    global num_ctas
    num_ctas = value


def compile_key(key, out_dir):
    """``hopper_aot.compile_key`` for a causal key, with this schedule: the exported function takes
    ``(q, k, v, out, scale, num_ctas)``."""
    import time

    import cuda.bindings.driver as cuda
    import flash_attn.cute.flash_fwd_sm90 as sm90
    import flash_attn.cute.interface as fi
    import torch
    from flash_attn.cute.utils import AuxData

    from mqa_byoc.kernels import hopper_aot as aot

    if key.mask != "causal":
        raise ValueError(f"{key.label}: the persistent schedule is for the causal mask only")
    t0 = time.time()
    args, kwargs = aot._configured_kernel(fi, torch, key)
    kernel = args[0]
    sm90.SingleTileLPTScheduler = PersistentLPTScheduler
    try:
        @cute.jit
        def entry(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                  softmax_scale: cutlass.Float32, ctas: cutlass.Int32, stream: cuda.CUstream):
            _set_num_ctas(ctas)
            kernel(mQ, mK, mV, mO, None, softmax_scale, None, None, None, None, None, None, None,
                   None, None, AuxData(), None, None, stream)

        fn = cute.compile(entry, *args[1:5], cutlass.Float32(1.0), cutlass.Int32(132), args[-1],
                          options=kwargs.get("options", "--enable-tvm-ffi"))
    finally:
        sm90.SingleTileLPTScheduler = SingleTileLPTScheduler
        _set_num_ctas(None)
    return aot._export(fn, key, out_dir, kernel, t0)
