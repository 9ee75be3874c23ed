"""The CUDA build pipeline used for whole decoders.

TVM 0.27's default CUDA pipeline plus one pass in front of legalization: FuseTransposeMatmul.
nn.Linear is ``matmul(x, permute_dims(W))``; TVM's default leaves the transpose as its own kernel, so
every weight matrix is copied on every decode step (80% of decode GPU time in our decoders before
this pass). Attention is offloaded by ``partition_for_cutlass`` either way.

Needs ``apache-tvm-ffi==0.1.14.post0`` (pinned by this package): with 0.1.15.x dlight's
``gpu.Matmul`` rule segfaults in tensorize.
"""

from __future__ import annotations

import tvm
from tvm import relax


def cuda_decoder_pipeline(target: tvm.target.Target):
    """``relax.build(mod, target, relax_pipeline=cuda_decoder_pipeline(target))``."""
    from tvm.relax.backend.cuda import pipeline as cuda

    @tvm.transform.module_pass(opt_level=0, name="MqaByocCudaDecoderPipeline")
    def _pipeline(mod, _ctx):
        passes = (
            cuda.library_dispatch_passes(target)
            + [relax.transform.FuseTransposeMatmul()]
            + cuda.legalize_passes(target)
            + cuda.dataflow_lower_passes(target)
            + cuda.finalize_passes(target)
        )
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline
