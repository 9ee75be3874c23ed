"""``mqa-byoc profile build --cuda-graph``: the paged decoder built with TVM's ``relax.backend.use_cuda_graph``
captures the static regions of its decode step (per value of the batch), GEMMs on cuBLASLt included;
without the option nothing is captured. CPU only: the libraries are built and read, not run."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("tvm")

from mqa_byoc.models.decoder_libs import CUDA_GRAPH_MAX_BATCH, _capture_decode_batch, build_paged_decoder_libraries
from mqa_byoc.models.presets import get_preset, scaled


def _config():
    return scaled(get_preset("codellama-34b"), num_layers=1, vocab_size=512)


def test_decode_is_marked_for_capture_per_batch():
    import tvm

    from mqa_byoc.models.decoder_libs import paged_config_of
    from mqa_byoc.models.paged_llama import export_paged_llama

    mod, _params, _ = export_paged_llama(paged_config_of(_config(), "float16"), tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    assert "relax.rewrite_cuda_graph.capture_symbolic_vars" not in (mod["decode"].attrs or {})
    marked = _capture_decode_batch(mod)
    attrs = marked["decode"].attrs
    batch = str(marked["decode"].params[0].ty.shape[0])
    assert [str(v) for v in attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"]] == [batch]
    assert int(attrs["tir_var_upper_bound"][batch]) == CUDA_GRAPH_MAX_BATCH
    assert "relax.rewrite_cuda_graph.capture_symbolic_vars" not in (marked["prefill"].attrs or {})


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_built_library_captures_only_with_the_option(tmp_path, cuda_graph):
    # the TIR-attention library: no FA2 kernels needed; its GEMMs are on cuBLASLt
    (path,) = build_paged_decoder_libraries(_config(), str(tmp_path), modes=(False,), progress=None,
                                            cuda_graph=cuda_graph)
    data = open(path, "rb").read()
    captured = data.count(b"decode_cuda_graph_capture")
    assert (captured > 0) == cuda_graph
    assert b"vm.builtin.cuda_graph.run_or_capture" in data or not cuda_graph
    assert b"prefill_cuda_graph_capture" not in data  # the prompt length is not captured
    # a captured region takes a projection weight: the GEMM's cuBLASLt call is inside it
    assert bool(re.search(rb"fn=decode_cuda_graph_capture\d*, loc=param\[\d+\], param=\w*qkv_proj_weight", data)) == cuda_graph
    meta = json.load(open(path + ".json"))
    assert meta.get("cuda_graph", False) == cuda_graph and meta["gemm_offloaded"] > 0
