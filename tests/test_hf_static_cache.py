"""HF's StaticCache through torch.export (2.13, strict=False) and TVM 0.27's
``from_exported_program`` (see docs/hf_kv_caches.md).

Pinned here, so that a torch / transformers / TVM upgrade that changes one shows up:
- HF's own ``TorchExportableModuleWithStaticCache`` does not import (torch's decomposition fails on
  the cache tensors, lifted as mutated constants);
- TVM's ``index_put`` converter rejects the functionalized cache write (``convert="standard"``);
- the frontend drops mutation outputs (an updated buffer is not returned);
- ``import_hf(cache="static")`` (caches as inputs, returned as outputs, our index_put converter)
  imports and matches torch; its attention runs over ``max_cache_len`` keys with a mask built from
  the ``cache_position`` input, which the partition rejects with that reason."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402

from mqa_byoc.testing import graphs as G  # noqa: E402
from mqa_byoc import offload_report, partition_for_cutlass  # noqa: E402
from mqa_byoc.models import hf  # noqa: E402
from mqa_byoc.models.hf_static import index_put_converter, static_example_inputs, static_wrapper  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 2, 4, 2, 32, 16


def _model(impl="eager", dtype="float32", window=None):
    cfg = hf.make_hf_config("mistral" if window else "llama", hidden_size=128, num_heads=HEADS,
                            num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=128, vocab_size=128,
                            num_layers=LAYERS, attn_implementation=impl, sliding_window=window)
    return hf.build_hf_model(cfg, dtype=dtype)


def _run(mod, args):
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args])
    return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]


# ----------------------------------------------------------------------------- what fails, and where
def test_hf_exportable_module_fails_in_torch_decomposition():
    """HF's executorch recipe exports (non-strict), but its cache tensors live in the StaticCache
    object, not the module's state: torch lifts them as constants and keeps the in-place
    ``index_copy_`` on them; the decomposition the frontend runs then fails inside torch."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model = _model()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    w = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_LEN).eval()
    with torch.no_grad():
        ep = torch.export.export(w, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long),
                                         "cache_position": torch.tensor([0])}, strict=False)
    writes = [n.args[0].name for n in ep.graph.nodes if n.target == torch.ops.aten.index_copy_.default]
    assert len(writes) == 2 * LAYERS and all(name.startswith("c_") for name in writes), writes  # constants
    assert not ep.graph_signature.buffers_to_mutate
    with pytest.raises(AssertionError, match="expected compiled_fn to be GraphModule"):
        from_exported_program(ep)


def test_frontend_index_put_rejects_cache_write():
    """Without our converter: the functionalized write ``index_put(cache, [None, None, pos], k)``
    becomes 3 index tensors for a 4-D cache, which R.index_put rejects."""
    with pytest.raises(ValueError, match=r"IndexPut requires the number of index tensors \(3\) to match "
                                         r"the data tensor dimensions \(4\)"):
        hf.import_hf(_model(), mode="decode", cache="static", past_len=5, max_cache_len=MAX_LEN,
                     convert="standard")


def test_frontend_drops_mutated_buffers():
    """A buffer written in place comes out of torch's functionalization as a mutation output; the
    frontend returns the user outputs only, so the write is lost (hence the wrapper returns the
    caches as ordinary outputs)."""

    class Write(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 2, 8, 4))

        def forward(self, pos, x):
            self.cache.index_copy_(2, pos, x)
            return self.cache.sum(dim=2)

    ep = torch.export.export(Write(), (torch.tensor([3]), torch.ones(1, 2, 1, 4)))
    assert ep.run_decompositions().graph_signature.buffers_to_mutate  # torch: a mutation output
    mod = from_exported_program(ep, custom_convert_map={"index_put.default": index_put_converter})
    ret = mod["main"].ret_ty
    assert len(ret.fields) == 1, ret  # the sum only: the mutated buffer is gone
    assert [int(x) for x in ret.fields[0].shape] == [1, 2, 4]


@pytest.mark.parametrize("shape, axis, n_given", [((2, 3, 6, 4), 2, 3), ((5, 3), 0, 1), ((2, 7, 3), 1, 2),
                                                  ((2, 3, 6, 4), 3, 4)])
def test_index_put_converter_numerics(shape, axis, n_given):
    """``index_put(x, [None] * axis + [idx] (+ omitted trailing axes), v)`` is index_copy along
    ``axis``; the converter's result matches torch's."""
    idx = torch.tensor([4, 1]) % shape[axis]
    vshape = list(shape)
    vshape[axis] = 2

    class Put(torch.nn.Module):
        def forward(self, x, v):
            return torch.ops.aten.index_put.default(x, [None] * axis + [idx] + [None] * (n_given - axis - 1), v)

    x, v = torch.randn(*shape), torch.randn(*vshape)
    ep = torch.export.export(Put(), (x, v))
    mod = from_exported_program(ep, custom_convert_map={"index_put.default": index_put_converter})
    (got,) = _run(mod, [x.numpy(), v.numpy()])
    np.testing.assert_array_equal(got, Put()(x, v).numpy())


# ----------------------------------------------------------------------------- import_hf(cache="static")
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_static_cache_import_matches_torch(impl, mode):
    """Logits and every updated cache (written rows and untouched ones) match torch on TVM's CPU build."""
    model = _model(impl)
    imp = hf.import_hf(model, mode=mode, cache="static", seq_len=6, past_len=5, max_cache_len=MAX_LEN)
    x = static_example_inputs(model, mode=mode, seq_len=6, past_len=5, max_cache_len=MAX_LEN, seed=3)
    params = [p for p in imp.mod["main"].params]
    assert [p.name for p in params[:2]] == ["input_ids", "cache_position"]
    got = _run(imp.mod, [*x, *imp.params])
    assert len(got) == 1 + 2 * LAYERS
    with torch.no_grad():
        want = static_wrapper(model, LAYERS)(torch.from_numpy(x[0]), torch.from_numpy(x[1]),
                                             *[torch.tensor(c) for c in x[2:]])
    np.testing.assert_allclose(got[0], imp.reference(*x), rtol=1e-4, atol=1e-4)
    for g, w, before in zip(got[1:], want[1:], x[2:]):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)
        written = np.any(g != before, axis=(0, 1, 3))  # the positions of this call, nothing else
        assert list(np.flatnonzero(written)) == list(x[1])


@pytest.mark.parametrize("convert, mixed_precision, impl", [("native", False, "eager"), ("native", False, "sdpa"),
                                                            ("fixes", True, "eager")])
def test_static_cache_attention_rejected_runtime_mask(convert, mixed_precision, impl):
    """Attention runs over all max_cache_len rows (S_kv = MAX_LEN) with a mask computed from the
    ``cache_position`` input: not a mask FA2 can take, so every site stays, with that reason."""
    dtype = "float16" if convert == "native" else "float32"
    imp = hf.import_hf(_model(impl, dtype), mode="decode", cache="static", past_len=5,
                       max_cache_len=MAX_LEN, convert=convert, mixed_precision=mixed_precision)
    report = offload_report(imp.mod)
    assert len(report) == LAYERS
    for site in report:
        assert not site.offloaded
        assert site.reason.startswith("the mask depends on the runtime input 'cache_position':"), site.reason
        assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.dtype) == (
            HEADS, KV_HEADS, HEAD_DIM, "float16")
    softmax_kv = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", None) == "relax.nn.softmax":
            softmax_kv.append(int(e.args[0].ty.shape[-1]))

    relax.analysis.post_order_visit(imp.mod["main"].body, visit)
    assert softmax_kv == [MAX_LEN] * LAYERS
    assert G.composites(partition_for_cutlass(imp.mod)) == []


def test_static_cache_limits_are_typed_errors():
    with pytest.raises(NotImplementedError, match="sliding-window"):
        hf.import_hf(_model(window=8), mode="decode", cache="static", max_cache_len=MAX_LEN)
    with pytest.raises(NotImplementedError, match="static shapes"):
        hf.import_hf(_model(), mode="decode", cache="static", dynamic=True, max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="exceed max_cache_len"):
        hf.import_hf(_model(), mode="prefill", cache="static", seq_len=20, max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="cache must be"):
        hf.import_hf(_model(), cache="paged")


# ----------------------------------------------------------------------------- the in-place route
def test_hf_weights_on_the_inplace_cache_match_hf():
    """No export of an HF cache reaches TVM's in-place cache; the HF weights do, through
    build_decoder(kv_cache="inplace"): prefill then decode steps match HF's logits."""
    from mqa_byoc.models.hf_static import decoder_config_from_hf
    from mqa_byoc.models.llama import build_decoder

    model = _model()
    cfg = decoder_config_from_hf(model.config)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    mod, spec = build_decoder(cfg, dtype="float32", logits="all", kv_cache="inplace",
                              functions=("prefill", "decode"))
    params = [tvm.runtime.tensor(p) for p in hf.params_from_hf(model, spec)]
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "opt-level": 0})),
                              tvm.cpu())
    ids = np.random.default_rng(4).integers(0, 128, (1, 7)).astype("int64")
    t, shape = tvm.runtime.tensor, tvm.runtime.ShapeTuple
    out = vm["prefill"](t(ids[:, :5].astype("int32")), vm["create_kv_cache"](shape([7])), *params)
    got = [out[0].numpy()]
    for n in (5, 6):
        out = vm["decode"](t(ids[:, n:n + 1].astype("int32")), shape([n]), out[1], *params)
        got.append(out[0].numpy())
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-4, atol=1e-4)


def test_decoder_config_from_hf_rejects_rope_scaling():
    model = _model()
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    from mqa_byoc.models.hf_static import decoder_config_from_hf

    with pytest.raises(NotImplementedError, match="llama3"):
        decoder_config_from_hf(model.config)
