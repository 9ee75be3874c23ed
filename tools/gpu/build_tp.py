"""Build the artifacts of tests/gpu/test_gpu_tp.py: disco with our NCCL, on one GPU.

    MQA_BYOC_KERNEL_DIR=.gpu-artifacts/fa2 python tools/gpu/build_tp.py [--out .gpu-artifacts/tp]

Writes into ``--out``:

- ``libmqa_byoc_disco_nccl.so``: :func:`mqa_byoc.tp.build_disco_nccl` (g++ against the nvidia-nccl-cu13
  wheel; the GPU machine's own libnccl.so.2 is loaded at run time);
- ``<config>.mqa.so`` (+ sidecar): a llama2-70b-headed decoder (64 / 8 heads, D 128, tiny width, 2 layers,
  fp16, functional K/V cache) built with ``tensor_parallel_shards=1``, partitioned (``mqa=True``) and built
  with the native provider, as :func:`mqa_byoc.models.decoder_libs.build_decoder_libraries` does;
- ``ccl.so``: a Relax function of TVM's collectives (``R.ccl.allreduce`` sum / avg, ``allgather``,
  ``broadcast_from_worker0``), which a compiled model reaches through disco's ``runtime.disco.*``;
- ``inputs.npz``: the decoder's weights seed, tokens and the fp32 CPU logits of the same weights
  (prefill's last position, one decode step) as the reference;
- ``fatbins/``: TVM's CUDA kernels of both libraries compiled here (they are kept as source in the
  libraries and compiled at load); ``manifest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import builder_paths  # noqa: E402,F401 - sys.path for mqa_byoc

ROOT = Path(__file__).resolve().parents[2]
SEED = 7
PROMPT = 24


def config():
    from mqa_byoc.models.presets import scaled

    return scaled("llama2-70b", num_layers=2, vocab_size=256, hidden_size=256, intermediate_size=512,
                  name="llama2-70b-tp-small")


def ccl_module():
    """``main(x: (4, 64) fp16) -> (allreduce sum, allreduce avg, allgather, broadcast_from_worker0)``."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.ccl.allreduce(x, "sum")), bb.emit(relax.op.ccl.allreduce(x, "avg")),
                    bb.emit(relax.op.ccl.allgather(x, 1)), bb.emit(relax.op.ccl.broadcast_from_worker0(x))]
            res = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(res)
    return bb.get()


def reference(cfg, spec, ids, nxt):
    """fp32 CPU logits of the same decoder and weights: prefill's last position and one decode step."""
    import numpy as np
    import tvm
    from tvm import relax

    from mqa_byoc.models.llama import build_decoder, random_params

    mod, spec32 = build_decoder(cfg, dtype="float32", kv_expand="repeat", batch=1, functions=("prefill", "decode"))
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "opt-level": 0}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    w16 = random_params(spec, seed=SEED)
    params = [tvm.runtime.tensor(w.astype("float32")) for w in w16]  # the fp16 weights, in fp32
    logits, caches = vm["prefill"](tvm.runtime.tensor(ids), *params)
    step, _ = vm["decode"](tvm.runtime.tensor(nxt), caches, *params)
    return logits.numpy().astype(np.float32), step.numpy().astype(np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".gpu-artifacts" / "tp"))
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import tvm

    from mqa_byoc.testing.fatbin_cache import precompile_cuda

    from mqa_byoc.compiler.build import build
    from mqa_byoc.compiler.export import export_library
    from mqa_byoc.compiler.partition import partition_for_cutlass
    from mqa_byoc.compiler.pipeline import cuda_decoder_pipeline
    from mqa_byoc.models.decoder_libs import library_name, offloaded_composites
    from mqa_byoc.models.llama import build_decoder
    from mqa_byoc.sidecar import read_sidecar, write_sidecar
    from mqa_byoc.tp import build_disco_nccl

    lib = build_disco_nccl(out, force=True)
    cfg = config()
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    # what build_decoder_libraries(cfg, out, kv_cache="functional", modes=(True,), tensor_parallel_shards=1)
    # does, keeping the executable: its CUDA source is precompiled below
    mod, dspec = build_decoder(cfg, batch=1, functions=("prefill", "decode"), kv_cache="functional",
                               tensor_parallel_shards=1)
    part = partition_for_cutlass(mod, mqa=True)
    offloaded = offloaded_composites(part)
    ex = build(part, target, mqa=None, provider="native", pipeline=cuda_decoder_pipeline(target))
    path = str(out / library_name(cfg.name, True))
    export_library(ex, path, arch=args.arch)
    write_sidecar(path, cfg, dspec, "float16", {"mqa": True, "provider": "native", "kv_cache": "functional",
                                                "offloaded": offloaded, "tensor_parallel_shards": 1,
                                                "num_heads": cfg.num_heads, "hidden_size": cfg.hidden_size,
                                                "intermediate_size": cfg.intermediate_size})
    side = read_sidecar(path)
    ccl_ex = tvm.compile(ccl_module(), target=target, relax_pipeline=cuda_decoder_pipeline(target))
    ccl_ex.export_library(str(out / "ccl.so"))

    from types import SimpleNamespace

    spec = [SimpleNamespace(name=n, shape=tuple(s), dtype=d) for n, s, d in side["params"]]
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, cfg.vocab_size, (1, PROMPT)).astype("int32")
    nxt = rng.integers(0, cfg.vocab_size, (1, 1)).astype("int32")
    ref_prefill, ref_decode = reference(cfg, spec, ids, nxt)
    np.savez(out / "inputs.npz", ids=ids, nxt=nxt, ref_prefill=ref_prefill, ref_decode=ref_decode)

    fatbins = []
    for executable in (ex, ccl_ex):
        fatbins += precompile_cuda(executable, str(out / "fatbins"), args.arch)
    manifest = {"nccl_library": lib.name, "decoder": os.path.basename(path), "ccl": "ccl.so", "seed": SEED,
                "prompt": PROMPT, "config": {"name": cfg.name, "num_heads": cfg.num_heads,
                                             "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim},
                "offloaded": side["offloaded"], "tensor_parallel_shards": 1, "fatbins": fatbins}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
