"""The CUDA build pipeline used for whole decoders.

TVM 0.27's default CUDA pipeline schedules every PrimFunc with dlight; its ``gpu.Matmul`` rule
segfaults on the prefill projections of our decoders (a (1, seq_len, K) x (K, N) matmul with a
symbolic seq_len; seen on this wheel, decode's GEMVs are fine). This pipeline is TVM's own, minus
that one rule: prefill matmuls get dlight's fallback schedule (slower, correct); decode, the phase
the benchmarks measure, is unchanged (GEMV). Attention is offloaded either way. It also fuses each
weight transpose into its matmul (FuseTransposeMatmul), which TVM's default leaves out.
"""

from __future__ import annotations

import tvm
from tvm import relax


def cuda_decoder_pipeline(target: tvm.target.Target):
    """``relax.build(mod, target, relax_pipeline=cuda_decoder_pipeline(target))``."""
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.s_tir import dlight as dl

    legalize = [
        # nn.Linear is permute_dims(W) + matmul: without this the weights are transposed on every
        # step (a copy of every weight matrix per token)
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()),
    ]

    @tvm.transform.module_pass(opt_level=0, name="MqaByocCudaDecoderPipeline")
    def _pipeline(mod, _ctx):
        passes = cuda.library_dispatch_passes(target) + legalize + cuda.dataflow_lower_passes(target) \
            + cuda.finalize_passes(target)
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline
