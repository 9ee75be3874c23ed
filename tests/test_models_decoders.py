"""Model builders: well-formedness of every kv_expand form and preset, CPU numerics, HF import.

CPU only (llvm target at LLVM opt-level 0 to keep compile times small), float32 where numerics
are compared, tiny hidden sizes with real attention shapes where that stays cheap.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from mqa_byoc.models import presets  # noqa: E402
from mqa_byoc.models.llama import (  # noqa: E402
    KV_EXPAND_FORMS,
    attention_reference,
    build_attention_block,
    build_decoder,
    random_caches,
    random_params,
)
from mqa_byoc.models.presets import PRESETS, scaled  # noqa: E402

CPU_TARGET = {"kind": "llvm", "opt-level": 0}


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def _legalize_grouped():
    """``LegalizeGroupedAttention`` if the compiler package has it yet, else None."""
    try:
        from mqa_byoc.compiler.graph.gqa_legalize import LegalizeGroupedAttention
    except ImportError:
        return None
    return LegalizeGroupedAttention


def _prepare(mod, form):
    if form == "native":
        legalize = _legalize_grouped()
        if legalize is None:
            pytest.skip("kv_expand='native' needs mqa_byoc.compiler.graph.gqa_legalize (not there yet)")
        mod = legalize()(mod)
    return mod


def _vm(mod):
    ex = tvm.compile(mod, target=tvm.target.Target(CPU_TARGET))
    return relax.VirtualMachine(ex, tvm.cpu())


def _to_tvm(x):
    if isinstance(x, np.ndarray):
        return tvm.runtime.tensor(x)
    return [_to_tvm(y) for y in x]


def _to_np(x):
    if hasattr(x, "numpy"):
        return x.numpy()
    return [_to_np(y) for y in x]


def _ops(func) -> list[str]:
    """Names of the operators called by the bindings of a Relax function, in order."""
    names = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op):
                names.append(v.op.name)
    return names


def _attention_calls(func):
    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.nn.attention":
                out.append(v)
    return out


def _shape(ty):
    return [int(x) if isinstance(x, tvm.tirx.IntImm) else str(x) for x in ty.shape.values]


# ------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------


def test_presets_have_the_real_shapes():
    want = {
        "llama2-70b": (64, 8, 128, 8192, 28672, 32000, 80, None),
        "codellama-34b": (64, 8, 128, 8192, 22016, 32000, 48, None),
        "llama3-8b": (32, 8, 128, 4096, 14336, 128256, 32, None),
        "mistral-7b": (32, 8, 128, 4096, 14336, 32000, 32, 4096),
        "falcon-7b-mqa": (71, 1, 64, 4544, 18176, 65024, 32, None),
    }
    assert set(PRESETS) == set(want)
    for name, shape in want.items():
        c = PRESETS[name]
        got = (
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
            c.num_layers,
            c.sliding_window,
        )
        assert got == shape, name
        assert 1 <= c.max_layers_default <= c.num_layers
    assert PRESETS["codellama-34b"].rope_theta == 1e6
    assert PRESETS["llama3-8b"].rope_theta == 5e5
    assert PRESETS["falcon-7b-mqa"].is_mqa and PRESETS["falcon-7b-mqa"].group_size == 71


def test_scaled_keeps_attention_shapes():
    s = scaled("mistral-7b", num_layers=2, vocab_size=64, hidden_size=96, intermediate_size=128)
    m = presets.MISTRAL_7B
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.rope_theta, s.sliding_window) == (
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.rope_theta,
        m.sliding_window,
    )
    assert (s.num_layers, s.vocab_size, s.hidden_size, s.intermediate_size) == (2, 64, 96, 128)
    assert s.max_layers_default == 2 and s.name == "mistral-7b-scaled"
    assert scaled(m, sliding_window=False).sliding_window is None
    assert scaled(m, sliding_window=16).sliding_window == 16
    with pytest.raises(ValueError):
        presets.DecoderConfig("bad", 64, 6, 4, 16, 64, 10, 1)


# ------------------------------------------------------------------------------------------
# well-formed modules
# ------------------------------------------------------------------------------------------


def _tiny(name, **kw):
    return scaled(name, num_layers=1, vocab_size=64, hidden_size=64, intermediate_size=64, **kw)


@pytest.mark.parametrize("form", KV_EXPAND_FORMS)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_decoder_well_formed(name, form):
    cfg = _tiny(name)
    mod, spec = build_decoder(cfg, kv_expand=form, functions=("prefill", "decode", "extend"))
    relax.analysis.well_formed(mod)  # raises on a violation
    h, hkv, d, r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
    names = [p.name for p in spec]
    assert names[0] == "embed_tokens.weight" and names[-1] == "lm_head.weight"
    qkv = next(p for p in spec if p.name == "layers.0.self_attn.qkv_proj.weight")  # fused by default
    assert qkv.shape == ((h + 2 * hkv) * d, cfg.hidden_size) and qkv.dtype == "float16"

    for fname in ("prefill", "decode", "extend"):
        func = mod[fname]
        n_in = int(func.attrs["num_input"])
        assert len(func.params) == n_in + len(spec)
        logits_ty, caches_ty = func.ret_ty.fields
        assert str(logits_ty.dtype) == "float32" and _shape(logits_ty)[-1] == cfg.vocab_size
        assert len(caches_ty.fields) == 2 * cfg.num_layers
        assert _shape(caches_ty.fields[0])[2:] == [hkv, d]
        ops = _ops(func)
        attn = _attention_calls(func)
        if form in ("repeat", "native"):
            assert len(attn) == cfg.num_layers
            q, k, _ = (a.ty for a in attn[0].args[:3])
            assert _shape(q)[2:] == [h, d]
            assert _shape(k)[2:] == [h if form == "repeat" else hkv, d]
            assert attn[0].attrs.causal_mask == "BottomRight"
            w = attn[0].attrs.window_size
            assert (None if w is None else int(w)) == cfg.sliding_window
        else:
            assert not attn and ops.count("relax.nn.softmax") == cfg.num_layers
        n_repeat = ops.count("relax.repeat")
        if form in ("repeat", "repeat-chain") and r > 1:
            assert n_repeat == 2 * cfg.num_layers
        else:
            assert n_repeat == 0
        if form == "hf-broadcast" and r > 1:
            assert ops.count("relax.expand_dims") >= 2 * cfg.num_layers
        if form == "repeat-chain":
            assert "relax.maximum" in ops and "relax.minimum" in ops and "relax.call_tir" in ops


@pytest.mark.parametrize("form", KV_EXPAND_FORMS)
@pytest.mark.parametrize("mode", ["prefill", "decode", "extend"])
def test_attention_block_well_formed(form, mode):
    mod = build_attention_block(71, 1, 64, kv_expand=form, mode=mode, sliding_window=8)
    relax.analysis.well_formed(mod)  # raises on a violation
    func = mod["main"]
    q, k, v = (p.ty for p in func.params)
    assert _shape(q)[1:] == [{"prefill": "seq_len", "decode": 1, "extend": "seq_len"}[mode], 71, 64]
    assert _shape(k)[1:] == [{"prefill": "seq_len", "decode": "kv_len", "extend": "kv_len"}[mode], 1, 64]
    assert _shape(func.ret_ty) == _shape(q) and str(func.ret_ty.dtype) == "float16"


def test_decoder_static_batch_and_logits_last():
    cfg = _tiny("llama3-8b")
    mod, _ = build_decoder(cfg, batch=4, logits="last", functions=("prefill",))
    logits_ty = mod["prefill"].ret_ty.fields[0]
    assert _shape(logits_ty) == [4, 1, cfg.vocab_size]
    with pytest.raises(ValueError):
        build_decoder(cfg, kv_expand="nope")


def test_random_params_are_seeded_and_small():
    cfg = _tiny("llama2-70b")
    _, spec = build_decoder(cfg, functions=("prefill",))
    a = random_params(spec, seed=3)
    b = random_params(spec, seed=3)
    assert len(a) == len(spec)
    for p, x, y in zip(spec, a, b):
        assert x.shape == p.shape and x.dtype == np.float16
        np.testing.assert_array_equal(x, y)
        if p.name.endswith("norm.weight"):
            assert abs(float(x.astype(np.float32).mean()) - 1.0) < 0.05
        else:
            assert float(np.abs(x.astype(np.float32)).max()) < 0.2
    caches = random_caches(cfg, 2, 5)
    assert len(caches) == 2 and caches[0].shape == (2, 5, 8, 128)


# ------------------------------------------------------------------------------------------
# CPU numerics
# ------------------------------------------------------------------------------------------

BLOCK_CASES = [
    # (H, H_kv, D, mode, S, S_kv, window)
    (8, 2, 16, "extend", 5, 9, None),
    (8, 2, 16, "prefill", 7, 7, 3),
    (71, 1, 64, "decode", 1, 6, None),
    (8, 2, 16, "decode", 1, 6, 4),
]


@pytest.mark.parametrize("form", KV_EXPAND_FORMS)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-w{c[6]}")
def test_attention_block_numerics(form, case):
    h, hkv, d, mode, s, skv, window = case
    if window is not None and form in ("repeat", "native"):
        pytest.skip("TVM cannot legalize a windowed R.nn.attention on CPU")
    mod = build_attention_block(
        h, hkv, d, kv_expand=form, dtype="float32", mode=mode, sliding_window=window
    )
    mod = _prepare(mod, form)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, s, h, d), dtype=np.float32)
    k = rng.standard_normal((2, skv, hkv, d), dtype=np.float32)
    v = rng.standard_normal((2, skv, hkv, d), dtype=np.float32)
    out = _vm(mod)["main"](*_to_tvm([q, k, v])).numpy()
    ref = attention_reference(q, k, v, window=window)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def _numerics_config():
    # llama3-8b attention shapes (32 heads, 8 K/V heads, D 128), tiny everything else
    return scaled("llama3-8b", num_layers=2, vocab_size=96, hidden_size=64, intermediate_size=96)


def _run_decoder(form, cfg, ids, split, *, extend=True, **kw):
    """prefill(all), prefill(:split), decode(split) [, extend(split + 1:)] on CPU."""
    functions = ("prefill", "decode", "extend") if extend else ("prefill", "decode")
    mod, spec = build_decoder(
        cfg, dtype="float32", kv_expand=form, logits="all", functions=functions, **kw
    )
    mod = _prepare(mod, form)
    vm = _vm(mod)
    params = _to_tvm(random_params(spec, seed=1, std=0.05))
    full = _to_np(vm["prefill"](_to_tvm(ids), *params))
    head = _to_np(vm["prefill"](_to_tvm(ids[:, :split]), *params))
    dec = _to_np(vm["decode"](_to_tvm(ids[:, split : split + 1]), _to_tvm(head[1]), *params))
    ext = None
    if extend:
        ext = _to_np(vm["extend"](_to_tvm(ids[:, split + 1 :]), _to_tvm(dec[1]), *params))
    return full, head, dec, ext


@pytest.fixture(scope="module")
def decoder_runs():
    cfg = _numerics_config()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)).astype("int32")
    return cfg, ids, {}


@pytest.mark.parametrize("form", KV_EXPAND_FORMS)
def test_decoder_kv_cache_and_forms_agree(decoder_runs, form):
    cfg, ids, seen = decoder_runs
    split = 5
    # extend (a multi-token chunk after a cache) only for one form: compile time on 2 cores
    full, head, dec, ext = _run_decoder(form, cfg, ids, split, extend=form == "repeat")
    logits, caches = full
    assert logits.shape == (2, 9, cfg.vocab_size)
    assert len(caches) == 2 * cfg.num_layers and caches[0].shape == (2, 9, 8, 128)
    # prefill of a prefix == the prefix of a longer prefill (causality), caches included
    np.testing.assert_allclose(head[0], logits[:, :split], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(head[1][0], caches[0][:, :split], rtol=1e-4, atol=1e-5)
    # prefill(S) then decode(1) [then extend(rest)] == prefill(all)
    np.testing.assert_allclose(dec[0][:, 0], logits[:, split], rtol=1e-4, atol=1e-5)
    assert dec[1][0].shape == (2, split + 1, 8, 128)
    if ext is not None:
        np.testing.assert_allclose(ext[0], logits[:, split + 1 :], rtol=1e-4, atol=1e-5)
        for a, b in zip(ext[1], caches):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # all forms compute the same logits
    for other, ref in seen.items():
        np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-5, err_msg=f"{form} vs {other}")
    seen[form] = logits


# ------------------------------------------------------------------------------------------
# Hugging Face
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mqa_byoc.models import hf as hf_mod

    return hf_mod


def _hf_tiny(hf, impl, **kw):
    args = dict(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=96,
                vocab_size=80, num_layers=2, attn_implementation=impl)
    args.update(kw)
    return hf.build_hf_model(hf.make_hf_config(**args), seed=0, std=0.05)


@pytest.mark.parametrize(
    "impl,mode,dynamic",
    [("eager", "prefill", True), ("sdpa", "prefill", False), ("eager", "decode", False)],
)
def test_hf_import_matches_torch(hf, impl, mode, dynamic):
    model = _hf_tiny(hf, impl)
    mod, params, reference = hf.import_hf(model, mode=mode, seq_len=6, past_len=5, dynamic=dynamic)
    relax.analysis.well_formed(mod)  # raises on a violation
    vm = _vm(mod)
    shapes = [(2, 6, 5), (3, 4, 5)] if dynamic else [(1, 6, 5)]
    for b, s, p in shapes:
        inputs = hf.example_inputs(model, mode=mode, batch=b, seq_len=s, past_len=p, seed=b)
        out = vm["main"](*_to_tvm(inputs), *_to_tvm(params))
        logits = out[0].numpy()
        np.testing.assert_allclose(logits, reference(*inputs), rtol=1e-4, atol=2e-5)
        if mode == "decode":
            assert out[1].numpy().shape == (b, 2, p + 1, 16)
            np.testing.assert_array_equal(out[1].numpy()[:, :, :p], inputs[1])


def test_hf_fp16_native_matmuls(hf):
    """fp16 import: the native-dtype map keeps every matmul in fp16, the frontend default not."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    model = _hf_tiny(hf, "eager", num_layers=1).half()
    ep = torch.export.export(hf.export_wrapper(model, "prefill", 1, True), (torch.zeros(1, 4).long(),))

    def matmul_dtypes(convert_map):
        mod = from_exported_program(ep, keep_params_as_input=True, custom_convert_map=convert_map)
        out = set()
        for block in mod["main"].body.blocks:
            for b in block.bindings:
                if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul":
                    out.add(str(b.var.ty.dtype))
        return out

    assert matmul_dtypes(hf.native_dtype_convert_map()) == {"float16"}
    assert matmul_dtypes(hf.fixes_convert_map()) == {"float32"}


def test_fixes_map_takes_negative_list_indices_from_the_end(hf):
    """``x[..., [-2], :]`` (Falcon's K from its fused qkv): the frontend's ``R.take(mode="fast")`` reads
    out of bounds for the negative index; with our convert map it is torch's element."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Index(torch.nn.Module):
        def forward(self, x, i):
            return x[..., [-2, 0], :] * 2 + x[:, [-1]].sum() + x[:, i].sum()

    x, i = torch.randn(2, 3, 5, 4), torch.tensor([2, -3])
    ep = torch.export.export(Index(), (x, i))
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    got = G.run_llvm(mod, [x.numpy(), i.numpy()])
    np.testing.assert_allclose(got, Index()(x, i).numpy(), rtol=1e-5, atol=1e-5)


def test_fixes_convert_map_selects_a_negative_index_as_torch_does(hf):
    """``x[..., -2, :]`` (Falcon-40B's K from its grouped qkv in newer transformers): the frontend's
    ``R.take(mode="fast")`` of the negative constant reads out of bounds; with our convert map it is
    torch's row (static axes counted from the end, a symbolic one wrapped); non-negative ones unchanged."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Select(torch.nn.Module):
        def forward(self, x):
            return x[..., -2, :] * 2 + x.select(0, -1).sum() + x.select(3, 1).sum()

    x = torch.randn(2, 3, 4, 5, 6)
    ep = torch.export.export(Select(), (x,))
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), Select()(x).numpy(), rtol=1e-5, atol=1e-5)
    seq = torch.export.Dim("seq", min=2, max=64)
    ep = torch.export.export(Select(), (torch.randn(2, 3, 4, 5, 6),), dynamic_shapes=({0: seq},))
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    x = torch.randn(7, 3, 4, 5, 6)
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), Select()(x).numpy(), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_convert_maps_import_a_biased_linear_in_half_precision(hf, dtype):
    """``addmm(bias, x, w)`` (a biased ``nn.Linear`` and GPT-2's ``Conv1D`` after torch.export's
    decompositions, ``alpha`` / ``beta`` too): the frontend adds the half-precision bias to its float32
    matmul and fails; both maps import it, the native one in the model's type, and compute torch's result."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 48)
            self.w, self.b = torch.nn.Parameter(torch.randn(48, 16) * 0.1), torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            h = self.fc(x)  # view, permute, addmm, view
            return torch.addmm(self.b, h.reshape(-1, 48), self.w, beta=0.5, alpha=2.0) + torch.addmm(
                self.b, h.reshape(-1, 48), self.w)

    torch.manual_seed(0)
    model = Biased().to(getattr(torch, dtype))
    x = torch.randn(2, 5, 32).to(model.w.dtype)
    ep = torch.export.export(model, (x,))
    with pytest.raises(TypeError, match="same datatype"):
        from_exported_program(ep)
    want = copy.deepcopy(model).float()(x.float()).detach().numpy()
    for convert_map, matmul_dtype in ((hf.fixes_convert_map(), "float32"), (hf.native_dtype_convert_map(), dtype)):
        mod = from_exported_program(ep, custom_convert_map=convert_map)
        matmuls = [b.var for block in mod["main"].body.blocks for b in block.bindings
                   if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul"]
        assert len(matmuls) == 3 and {str(v.ty.dtype) for v in matmuls} == {matmul_dtype}
        if dtype == "float16":  # llvm runs fp16 (bf16 inputs cannot be handed to it from numpy)
            got = G.run_llvm(mod, [x.numpy()])
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_fixes_map_divides_by_numbers_and_fills_with_inf_as_torch_does(hf):
    """``torch.div(t, c, rounding_mode=...)`` of an int64 tensor (the frontend's int32 constant fails the
    import) and of fp16, floor / trunc / true division by ints and floats, negative values included; ``full``
    and ``full_like`` of ``-inf`` (TVM cannot legalize the ``R.full`` the frontend emits for them)."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Divide(torch.nn.Module):
        def __init__(self, mode, c):
            super().__init__()
            self.mode, self.c = mode, c

        def forward(self, i, f):
            return torch.div(i, self.c, rounding_mode=self.mode).float() + torch.div(f, self.c, rounding_mode=self.mode)

    class Fill(torch.nn.Module):
        def forward(self, x):
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
            rest = torch.where(x > 0, x, torch.full_like(x, float("-inf")))
            return (x @ x.transpose(-1, -2) + mask).softmax(-1) + rest.max(-1, keepdim=True).values + torch.full_like(x, 2.0)

    i, f = torch.arange(-9, 9).reshape(2, 9), torch.linspace(-5, 5, 18).reshape(2, 9).half()
    for mode in ("floor", "trunc", None):
        for c in (4, 2.5, -3):
            ep = torch.export.export(Divide(mode, c), (i, f))
            with pytest.raises(TypeError, match="same datatype"):
                from_exported_program(ep)
            mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
            np.testing.assert_allclose(G.run_llvm(mod, [i.numpy(), f.numpy()]),
                                       Divide(mode, c)(i, f).float().numpy(), rtol=1e-3, atol=1e-3)
    x = torch.randn(2, 5, 5)
    ep = torch.export.export(Fill(), (x,))
    with pytest.raises(TypeError, match="PrimType"):
        G.run_llvm(from_exported_program(ep), [x.numpy()])
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), Fill()(x).numpy(), rtol=1e-5, atol=1e-5)


def test_fixes_map_computes_float_results_of_integer_tensors_as_torch_does(hf):
    """``positions / n`` of an int64 tensor is a float division in torch; the frontend divides as integers (wrong
    numbers, silently) and fails on ``log`` / ``exp`` / ... of an integer tensor. The map casts such operands
    to the result's float type first."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Divide(torch.nn.Module):
        def forward(self, i):
            return i / 4 + i / (i.abs() + 1) + (i > 0) / 2

    class Unary(torch.nn.Module):
        def forward(self, i, f):
            scale = 1 + 0.1 * torch.log(1 + torch.floor(i.abs() / 3))
            return (scale + torch.log1p(i.abs()) + torch.exp(-i.abs()) + torch.sin(i) + torch.cos(i) + torch.sigmoid(i)
                    + torch.tanh(i) + i / f)

    i, f = torch.arange(-9, 9).reshape(2, 9), torch.linspace(1, 5, 18).reshape(2, 9)
    ep = torch.export.export(Divide(), (i,))
    wrong = G.run_llvm(from_exported_program(ep), [i.numpy()])
    assert np.abs(wrong - Divide()(i).numpy()).max() > 0.5  # the frontend's integer division
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [i.numpy()]), Divide()(i).numpy(), rtol=1e-6, atol=1e-6)
    ep = torch.export.export(Unary(), (i, f))
    with pytest.raises(TypeError, match="requires the input tensor to have float dtype"):
        from_exported_program(ep)
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [i.numpy(), f.numpy()]), Unary()(i, f).numpy(), rtol=1e-5, atol=1e-5)


def test_fixes_map_takes_an_unsorted_topk_as_the_sorted_one(hf):
    """``topk(sorted=False)`` (an MoE router's): the frontend refuses it; the map's sorted top k, its values and
    indices paired, routes as torch does."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Route(torch.nn.Module):
        def forward(self, x):
            values, index = torch.topk(x, 3, dim=-1, sorted=False)
            return torch.zeros_like(x).scatter(-1, index, values.softmax(-1))

    x = torch.randn(4, 10)
    ep = torch.export.export(Route(), (x,))
    with pytest.raises(AssertionError, match="only sorted output for topk"):
        from_exported_program(ep)
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), Route()(x).numpy(), rtol=1e-6, atol=1e-6)


def test_fixes_map_clamps_integers_on_one_side_and_takes_amax(hf):
    """``positions.clamp(min=0)`` of an int64 tensor: the frontend's ``clip`` gets an infinite other bound and
    the graph builds for no target; ``torch.amax`` / ``amin`` have no converter. Both as torch computes them."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Clamp(torch.nn.Module):
        def forward(self, i):
            return i.clamp(min=1) + i.clamp(max=3) + i.clamp(-2, 3)

    class Extremes(torch.nn.Module):
        def forward(self, x):
            return x.amax(-1, keepdim=True) - x.amin((0, 1), keepdim=True) + x.amax()

    i = torch.arange(-9, 9).reshape(2, 9)
    ep = torch.export.export(Clamp(), (i,))
    with pytest.raises(RuntimeError, match="Cannot convert infinity to BigInt"):
        G.run_llvm(from_exported_program(ep), [i.numpy()])
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_array_equal(G.run_llvm(mod, [i.numpy()]), Clamp()(i).numpy())
    x = torch.randn(2, 3, 5)
    ep = torch.export.export(Extremes(), (x,))
    with pytest.raises(AssertionError, match="amax"):
        from_exported_program(ep)
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), Extremes()(x).numpy(), rtol=1e-6, atol=1e-6)


def test_fixes_map_clamps_floats_so_that_mixed_precision_applies(hf):
    """A float ``clamp`` of a matmul's output (DeepSeek-V4's SwiGLU limit): the frontend's ``clip`` carries
    float64 ``PrimValue`` bounds and ``ToMixedPrecision`` fails on them; the map's ``maximum`` / ``minimum`` of
    constants import, pass it, and compute torch's clamp (both sides, one side, bounds crossed)."""
    torch = pytest.importorskip("torch")
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class SwiGluLimit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 32)

        def forward(self, x):
            g = self.proj(x)
            return g.clamp(max=0.5) * g.clamp(-0.25, 0.25) + g.clamp(min=-0.1) + g.clamp(0.3, -0.3)

    torch.manual_seed(0)
    model, x = SwiGluLimit().eval(), torch.randn(4, 16)
    ep = torch.export.export(model, (x,))
    mixed = relax.transform.ToMixedPrecision(out_dtype="float16")
    with pytest.raises(Exception, match="Expected TensorType, but got T.float64"):
        mixed(from_exported_program(ep))
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    assert "R.clip" not in mod.script()
    params = [p.detach().numpy() for p in model.parameters()]
    want = model(x).detach().numpy()
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), want, rtol=1e-6, atol=1e-6)
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map(), keep_params_as_input=True)
    np.testing.assert_allclose(G.run_llvm(mixed(mod), [x.numpy(), *params]), want, rtol=0, atol=2e-2)


def test_fixes_map_computes_complex_rotary_and_refuses_other_complex_ops(hf):
    """A complex rotary embedding (Llama 4's and DeepSeek-V2's form: ``view_as_complex`` of pairs times
    ``polar(1, angles)``, unsqueezed at a negative axis, times a real scale, ``view_as_real``) computes torch's
    result; a complex tensor read by an op the map does not take fails the import naming that op."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc.testing import graphs as G

    class Rotary(torch.nn.Module):
        def forward(self, x, angles, scale):
            freqs = torch.polar(torch.ones_like(angles), angles) * 0.5  # (S, D/2)
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, S, H, D/2)
            return torch.view_as_real(xc * freqs.unsqueeze(-2) * scale.unsqueeze(-1)).flatten(3)

    class Conj(torch.nn.Module):
        def forward(self, x):
            return torch.view_as_real(torch.view_as_complex(x).sum(0, keepdim=True))

    x, angles, scale = torch.randn(2, 6, 4, 16), torch.randn(6, 8), torch.rand(2, 6, 4)
    ep = torch.export.export(Rotary(), (x, angles, scale))
    with pytest.raises(AssertionError, match="view_as_complex"):
        from_exported_program(ep)
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy(), angles.numpy(), scale.numpy()]),
                               Rotary()(x, angles, scale).numpy(), rtol=1e-5, atol=1e-5)
    ep = torch.export.export(Conj(), (torch.randn(3, 4, 2),))
    with pytest.raises(NotImplementedError, match="aten.sum.dim_IntList reads the complex tensor"):
        from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())


def test_meta_reference_llama_rotary_with_a_real_stored_table_imports_and_is_offloaded(hf):
    """Meta's reference Llama (``llama/model.py``): ``freqs_cis`` sliced at the start position and viewed for
    broadcasting, ``view_as_complex`` of the query/key pairs, ``repeat_kv`` by indexing + expand + reshape.
    With the table stored as ``view_as_real`` of itself (a complex buffer fails in the frontend, before any
    convert map), the fixes map imports it exactly; in fp16 the attention is offloaded on 2 K/V heads."""
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    from mqa_byoc import offload_report
    from mqa_byoc.testing import graphs as G

    def repeat_kv(x, n_rep):
        bs, slen, n_kv_heads, head_dim = x.shape
        return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
            bs, slen, n_kv_heads * n_rep, head_dim)

    class Attention(torch.nn.Module):
        def __init__(self, dim=128, heads=8, kv_heads=2):
            super().__init__()
            self.h, self.hkv, self.d = heads, kv_heads, dim // heads
            self.wq, self.wo = torch.nn.Linear(dim, dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
            self.wk = torch.nn.Linear(dim, kv_heads * self.d, bias=False)
            self.wv = torch.nn.Linear(dim, kv_heads * self.d, bias=False)
            freqs = torch.outer(torch.arange(64).float(), 1.0 / (1e4 ** (torch.arange(0, self.d, 2).float() / self.d)))
            self.register_buffer("freqs_real", torch.view_as_real(torch.polar(torch.ones_like(freqs), freqs)))

        def forward(self, x, start_pos: int = 3):
            b, n, _ = x.shape
            q = self.wq(x).view(b, n, self.h, self.d)
            k, v = self.wk(x).view(b, n, self.hkv, self.d), self.wv(x).view(b, n, self.hkv, self.d)
            freqs_cis = torch.view_as_complex(self.freqs_real)[start_pos:start_pos + n]
            qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
            kc = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
            freqs_cis = freqs_cis.view(1, n, 1, qc.shape[-1])
            q = torch.view_as_real(qc * freqs_cis).flatten(3).type_as(x)
            k = torch.view_as_real(kc * freqs_cis).flatten(3).type_as(x)
            k, v = repeat_kv(k, self.h // self.hkv), repeat_kv(v, self.h // self.hkv)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
            scores = torch.matmul(q, k.transpose(2, 3)) / self.d ** 0.5 + mask
            p = torch.nn.functional.softmax(scores.float(), dim=-1).type_as(q)
            return self.wo(torch.matmul(p, v).transpose(1, 2).contiguous().view(b, n, -1))

    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 12, 128)
    ep = torch.export.export(model, (x,))
    with pytest.raises(AssertionError, match="view_as_complex"):
        from_exported_program(ep)
    mod = from_exported_program(ep, custom_convert_map=hf.fixes_convert_map())
    np.testing.assert_allclose(G.run_llvm(mod, [x.numpy()]), model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    model = model.half()
    mod = from_exported_program(torch.export.export(model, (x.half(),)), custom_convert_map=hf.native_dtype_convert_map())
    [site] = offload_report(mod)
    assert site.offloaded and (site.num_q_heads, site.num_kv_heads, site.causal) == (8, 2, "BottomRight"), site.reason

@pytest.mark.parametrize("kind,fused", [("llama", True), ("mistral", True), ("llama", False)])
def test_builder_matches_hf(hf, kind, fused):
    """build_decoder with HF's weights computes HF's logits (RoPE, RMSNorm, SwiGLU, window); fused
    projections: HF's q/k/v and gate/up weights stacked into qkv_proj / gate_up_proj."""
    torch = pytest.importorskip("torch")
    window = 3 if kind == "mistral" else None
    cfg = presets.DecoderConfig(
        "tiny", hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=80, num_layers=2, rope_theta=500000.0, rms_eps=1e-6, sliding_window=window,
        fused_projections=fused,
    )
    model = hf.build_hf_model(hf.hf_config_from_decoder(cfg), seed=2, std=0.05)
    form = "hf-broadcast" if window else "repeat"
    mod, spec = build_decoder(cfg, dtype="float32", kv_expand=form, logits="all", functions=("prefill",))
    assert ("layers.1.mlp.gate_up_proj.weight" in [p.name for p in spec]) == fused
    params = hf.params_from_hf(model, spec)
    ids = np.random.default_rng(0).integers(0, 80, (2, 7)).astype("int64")
    out = _vm(mod)["prefill"](_to_tvm(ids.astype("int32")), *_to_tvm(params))
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(out[0].numpy(), want, rtol=1e-4, atol=2e-5)
