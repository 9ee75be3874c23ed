"""R.nn.attention_var_len: report, partition, rejections, rewrite numerics, codegen.

CPU only. TVM cannot lower attention_var_len, so the numerics replace every var-len call (before and
after the rewrite) by the NumPy reference of mqa_byoc.testing.varlen_graphs through ``call_dps_packed``: the
original graph runs it on the expanded K/V (plain MHA), the rewritten one on the un-expanded K/V
(query head h reads K/V head h // group); the reference itself is checked against PyTorch's SDPA.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

import mqa_byoc
from mqa_byoc.compiler.codegen import varlen as varlen_codegen
from mqa_byoc.compiler.graph import varlen
from mqa_byoc.compiler.partition import canonicalize_attention
from mqa_byoc.contract import PY_VAR_LEN_FORWARD_FUNC
from mqa_byoc.testing import graphs as G
from mqa_byoc.testing.varlen_graphs import seqstarts, var_len_attention, var_len_reference

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
EXPANSION_OPS = {"relax.repeat", "relax.broadcast_to", "relax.expand_dims", "relax.tile"}


def _ops(func):
    return [b.value.op.name for blk in func.body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _codegen_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs}


# ----------------------------------------------------------------------------- report + partition
FORMS = {
    "gqa_repeat": dict(h=8, hkv=2, expand="repeat"),
    "mqa_broadcast": dict(h=8, hkv=1, expand="broadcast"),
    "mqa_repeat": dict(h=8, hkv=1, expand="repeat"),
    "gqa_hf_repeat_kv": dict(h=8, hkv=2, expand="hf"),
    "gqa_native": dict(h=8, hkv=2, expand="none"),
    "upstream_merged": dict(h=32, hkv=4, d=128, expand="repeat", merged=True, same_seqstart=True),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal, window", [("BottomRight", None), (None, None), ("BottomRight", 16)])
def test_report_lists_var_len_sites(form, causal, window):
    kw = FORMS[form]
    mod = var_len_attention(causal=causal, window=window, scale=0.1, dtype="bfloat16", **kw)
    (site,) = mqa_byoc.offload_report(mod)
    assert site.offloaded, site.reason
    assert (site.form, site.composite) == ("R.nn.attention_var_len", "flash_attn.attention_var_len")
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (kw["h"], kw["hkv"], kw.get("d", 64))
    assert (site.causal, site.window, site.dtype) == (causal, window, "bfloat16")
    assert site.scale == pytest.approx(0.1)
    expands = kw["expand"] != "none"
    assert (site.expansion is not None) == expands
    assert (site.expansion_ops_removed > 0) == expands


def _partitioned_site(kw, mqa):
    """The graph of FORMS entry ``kw`` partitioned with ``mqa``, and its one var-len site."""
    mod = mqa_byoc.partition_for_cutlass(var_len_attention(**kw), mqa=mqa)
    (func,) = _codegen_funcs(mod).values()
    return mod, varlen_codegen.find_var_len_site(func)


@pytest.mark.parametrize("form", FORMS)
def test_partition_removes_expansion_with_mqa(form):
    kw = FORMS[form]
    mod, site = _partitioned_site(kw, mqa=True)
    assert (site.spec.num_q_heads, site.spec.num_kv_heads) == (kw["h"], kw["hkv"])
    assert not EXPANSION_OPS & set(_ops(mod["main"])), mod["main"]
    assert "relax.nn.attention_var_len" not in _ops(mod["main"])


@pytest.mark.parametrize("form", [f for f in FORMS if FORMS[f]["expand"] != "none"])
def test_partition_keeps_expansion_without_mqa(form):
    kw = FORMS[form]
    mod, site = _partitioned_site(kw, mqa=False)
    assert (site.spec.num_q_heads, site.spec.num_kv_heads) == (kw["h"], kw["h"])
    assert EXPANSION_OPS & set(_ops(mod["main"]))
    (report,) = mqa_byoc.offload_report(var_len_attention(**kw), mqa=False)
    assert report.offloaded and report.num_kv_heads == kw["h"] and report.expansion_ops_removed == 0


def test_topleft_offloaded_only_with_one_seqstart():
    (same,) = mqa_byoc.offload_report(var_len_attention(causal="TopLeft", same_seqstart=True))
    assert same.offloaded and same.causal == "TopLeft"
    (other,) = mqa_byoc.offload_report(var_len_attention(causal="TopLeft"))
    assert not other.offloaded and "TopLeft" in other.reason and "seqstart" in other.reason


def test_tile_keeps_expansion_and_offloads_mha():
    (site,) = mqa_byoc.offload_report(var_len_attention(expand="tile"))
    assert site.offloaded and site.num_kv_heads == 8 and "tile" in site.note
    mod = mqa_byoc.partition_for_cutlass(var_len_attention(expand="tile"))
    assert "relax.tile" in _ops(mod["main"]) and len(_codegen_funcs(mod)) == 1


REJECTED = {
    "float32": (dict(dtype="float32"), "dtype float32"),
    "seqstart_int64": (dict(seqstart_dtype="int64"), "seqstart_q must be a 1-D int32"),
    "max_int64": (dict(max_dtype="int64"), "max_seqlen_q must be an int32"),
    "batch_symbolic": (dict(batch="b"), "(1, total_q, H, D)"),
    "batch_2": (dict(batch=2), "(1, total_q, H, D)"),
    "topleft_two_seqstarts": (dict(causal="TopLeft"), "TopLeft causal mask"),
    "window_without_causal": (dict(causal=None, window=8), "window_size without a causal mask"),
    "head_dim_not_multiple_of_8": (dict(d=60), "head dim 60"),
    "head_dim_over_256": (dict(d=320, h=2, hkv=1), "head dim 320"),
}


@pytest.mark.parametrize("name", REJECTED)
def test_rejections_say_why_and_leave_the_graph(name):
    kw, words = REJECTED[name]
    mod = var_len_attention(**kw)
    (site,) = mqa_byoc.offload_report(mod)
    assert not site.offloaded and site.composite is None
    assert words in site.reason, site.reason
    assert varlen.NOT_LOWERABLE in site.reason  # TVM cannot build what stays
    out = mqa_byoc.partition_for_cutlass(mod)
    assert not _codegen_funcs(out) and "relax.nn.attention_var_len" in _ops(out["main"])
    # what the reason promises: stock TVM cannot lower the op that is left
    with pytest.raises(Exception, match="attention_var_len"):
        with CUDA:
            relax.transform.LegalizeOps()(out)


# ----------------------------------------------------------------------------- numerics
def _reference_func(name, causal, window, scale):
    def run(q, k, v, sq, sk, out):
        sq, sk = sq.numpy(), sk.numpy()
        dtype = q.numpy().dtype
        o = var_len_reference(q.numpy(), k.numpy(), v.numpy(), np.diff(sq), np.diff(sk), causal, window, scale)
        out.copyfrom(o.astype(dtype))

    tvm_ffi.register_global_func(name, run, override=True)


@mutator
class _VarLenToReference(PyExprMutator):
    """Every ``R.nn.attention_var_len`` becomes a ``call_dps_packed`` of the NumPy reference."""

    counter = itertools.count()

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.attention_var_len"):
            return call
        a = call.attrs
        name = f"test.var_len_ref_{next(self.counter)}"
        _reference_func(name, a.causal_mask, int(a.window_size) if a.window_size is not None else None,
                        float(a.scale.value) if a.scale is not None else None)
        return relax.call_dps_packed(name, list(call.args[:5]), out_ty=call.ty)


def _run_cpu(mod, args):
    mut = _VarLenToReference(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mut.builder_.update_func(gv, mut.visit_expr(func))
    mod = mut.builder_.get()
    ex = relax.build(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


# mla: V's head dim smaller than Q's and K's, padded with zeros to theirs and the output sliced back
NUMERIC_FORMS = dict(FORMS, gqa_tile=dict(h=8, hkv=2, expand="tile"),
                     mla=dict(h=8, hkv=2, d=96, dv=64, expand="repeat"))


@pytest.mark.parametrize("form", NUMERIC_FORMS)
@pytest.mark.parametrize("mqa", [True, False])
def test_rewrite_numerics_match_the_original(form, mqa):
    kw = dict(NUMERIC_FORMS[form])
    mod = var_len_attention(causal="BottomRight", window=4, **kw)
    h, hkv, d = kw["h"], kw["hkv"], kw.get("d", 64)
    dv = kw.get("dv", d)
    lens_q, lens_k = [5, 1, 9], ([5, 1, 9] if kw.get("same_seqstart") else [7, 3, 9])
    rng = np.random.default_rng(0)
    tq, tk = sum(lens_q), sum(lens_k)
    if kw.get("merged"):
        shapes = [(tq, h * d), (tk, hkv * d), (tk, hkv * d)]
    else:
        shapes = [(1, tq, h, d), (1, tk, hkv, d), (1, tk, hkv, dv)]
    args = [rng.standard_normal(s).astype("float16") for s in shapes]
    args.append(seqstarts(lens_q))
    if not kw.get("same_seqstart"):
        args.append(seqstarts(lens_k))
    args.append(np.array(max(lens_q), "int32"))
    if not kw.get("same_seqstart"):
        args.append(np.array(max(lens_k), "int32"))
    canon = canonicalize_attention(mod, mqa=mqa)
    calls = [b.value for blk in canon["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.nn.attention_var_len"]
    (call,) = calls
    want_kv = hkv if mqa and kw["expand"] != "tile" else h
    assert int(call.args[1].ty.shape[2]) == want_kv  # the rewrite really attends on un-expanded K/V
    assert int(call.args[2].ty.shape[3]) == d  # V padded to Q's and K's head dim
    expected = _run_cpu(mod, args)
    got = _run_cpu(canon, args)
    np.testing.assert_allclose(got.astype("float32"), expected.astype("float32"), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("causal, window, same", [(None, None, False), ("BottomRight", None, False),
                                                  ("BottomRight", 3, False), ("TopLeft", None, True),
                                                  ("TopLeft", 2, True)])
def test_reference_matches_torch_sdpa(causal, window, same):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    h, hkv, d = 8, 2, 16
    lens_q = [4, 1, 6]
    lens_k = lens_q if same else [6, 3, 6]
    q = rng.standard_normal((1, sum(lens_q), h, d))
    k = rng.standard_normal((1, sum(lens_k), hkv, d))
    v = rng.standard_normal((1, sum(lens_k), hkv, d))
    got = var_len_reference(q, k, v, lens_q, lens_k, causal, window, scale=0.3)
    cq, ck = seqstarts(lens_q), seqstarts(lens_k)
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        qi = torch.from_numpy(q[0, cq[i]:cq[i + 1]]).permute(1, 0, 2)
        ki = torch.from_numpy(k[0, ck[i]:ck[i + 1]]).permute(1, 0, 2)
        vi = torch.from_numpy(v[0, ck[i]:ck[i + 1]]).permute(1, 0, 2)
        row, col = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        diag = row if causal == "TopLeft" else row + sk - sq
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            keep &= col <= diag
        if window:
            keep &= col > diag - window
        want = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep, scale=0.3,
                                                                enable_gqa=True)
        np.testing.assert_allclose(got[0, cq[i]:cq[i + 1]], want.permute(1, 0, 2).numpy(), atol=1e-10)


def test_reference_zero_rows_without_keys():
    q = np.ones((1, 3, 2, 8))
    k = np.ones((1, 1, 2, 8))
    out = var_len_reference(q, k, k, [3], [1], "BottomRight")
    assert (out[0, :2] == 0).all() and np.allclose(out[0, 2], 1.0)  # rows 0, 1 see no key (FA2: zeros)


# ----------------------------------------------------------------------------- codegen
def _build(mod, provider):
    mod = mqa_byoc.partition_for_cutlass(mod, mqa=True, provider=provider)
    with CUDA:
        mod = relax.transform.RunCodegen()(mod)
        return relax.build(mod, target=CUDA)


def _sources(ex):
    out = []
    stack = [ex.mod]
    while stack:
        m = stack.pop()
        stack.extend(m.imports)
        if m.kind in ("c", "source"):
            try:
                out.append(m.inspect_source())
            except Exception:  # noqa: BLE001
                pass
    return "\n".join(out)


def test_arg_map_follows_deduplicated_parameters():
    mod = mqa_byoc.partition_for_cutlass(var_len_attention(same_seqstart=True, causal="TopLeft"))
    (func,) = _codegen_funcs(mod).values()
    site = varlen_codegen.find_var_len_site(func)
    assert site.num_inputs == 5 and site.arg_map[3] == site.arg_map[4] and site.arg_map[5] == site.arg_map[6]
    names = [p.name for p in func.params]
    assert [names[i] for i in site.arg_map[3:]] == ["seqstart_q"] * 2 + ["max_seqlen_q"] * 2
    assert site.spec.causal and (site.spec.window_left, site.spec.window_right) == (-1, -1)


def test_python_provider_builds_and_exports(tmp_path):
    ex = _build(var_len_attention(window=8, scale=0.2), "python")
    src = _sources(ex)
    assert PY_VAR_LEN_FORWARD_FUNC in src and "0.2" in src
    ex.export_library(str(tmp_path / "varlen_python.so"))  # compiles the forwarder
    assert (tmp_path / "varlen_python.so").stat().st_size > 0


def test_native_wrapper_plans_plain_kernels_only():
    mod = mqa_byoc.partition_for_cutlass(var_len_attention(dtype="bfloat16", d=128), provider="native")
    site = varlen_codegen.find_var_len_site(next(iter(_codegen_funcs(mod).values())))
    source = varlen_codegen.emit_native_source(site)
    assert source.kernels and not any(k.split for k in source.kernels)
    assert {k.dtype for k in source.kernels} == {"bf16"} and {k.head_dim for k in source.kernels} == {128}
    assert "mqa_byoc_fa2_varlen_forward" in source.code and "var_len=1" in source.code


@pytest.mark.skipif(G.native_export_skip_reason() is not None, reason=str(G.native_export_skip_reason()))
def test_native_provider_exports_and_links(tmp_path):
    ex = _build(var_len_attention(h=8, hkv=1, expand="broadcast", d=64), "native")
    path = tmp_path / "varlen_native.so"
    mqa_byoc.export_library(ex, str(path), arch="sm_90", build=False, progress=None)
    import subprocess

    syms = subprocess.run(["nm", str(path)], capture_output=True, text=True, check=True).stdout
    assert "mqa_byoc_fa2_varlen_forward" in syms
    assert "mqa_byoc_fa2_fwd_hdim64_fp16_causal" in syms and "__tvm_ffi_fused" in syms


def _kv_cache_graph():
    """BNSH query (transposed outside the composite), K = V = concat(past, new) repeated: S_kv is an
    expression, so the fused function gets a ``tir_vars`` shape parameter, and K and V are one operand."""
    from tvm import tirx
    from tvm.relax import op as R

    p, n, tq, ns = (tirx.Var(x, "int64") for x in ("p", "n", "tq", "nseq"))
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType([1, 4, tq, 64], "float16"))
    pk = relax.Var("pk", relax.TensorType([1, p, 2, 64], "float16"))
    nk = relax.Var("nk", relax.TensorType([1, n, 2, 64], "float16"))
    sq, sk = (relax.Var(x, relax.TensorType([ns], "int32")) for x in ("sq", "sk"))
    mq, mk = (relax.Var(x, relax.TensorType([], "int32")) for x in ("mq", "mk"))
    with bb.function("main", [q, pk, nk, sq, sk, mq, mk]):
        with bb.dataflow():
            k = bb.emit(R.concat([pk, nk], axis=1))
            kk = bb.emit(R.repeat(k, 2, axis=2))
            qq = bb.emit(R.permute_dims(q, [0, 2, 1, 3]))
            o = bb.emit_output(R.nn.attention_var_len(qq, kk, kk, sq, mq, sk, mk, causal_mask="BottomRight"))
        bb.emit_func_output(o)
    return bb.get()


def test_kv_cache_bnsh_query_shared_kv(tmp_path):
    mod = _kv_cache_graph()
    (site,) = mqa_byoc.offload_report(mod)
    assert site.offloaded and (site.num_q_heads, site.num_kv_heads) == (4, 2)
    part = mqa_byoc.partition_for_cutlass(mod)
    (func,) = _codegen_funcs(part).values()
    vl = varlen_codegen.find_var_len_site(func)
    assert vl.shape_params and vl.arg_map[1] == vl.arg_map[2] and vl.num_inputs == 7
    assert "relax.repeat" not in _ops(part["main"])
    lens_q, lens_k = [3, 6], [5, 9]
    rng = np.random.default_rng(2)
    args = [rng.standard_normal((1, 4, 9, 64)).astype("float16"), rng.standard_normal((1, 6, 2, 64)).astype("float16"),
            rng.standard_normal((1, 8, 2, 64)).astype("float16"), seqstarts(lens_q), seqstarts(lens_k),
            np.array(6, "int32"), np.array(9, "int32")]
    np.testing.assert_allclose(_run_cpu(canonicalize_attention(mod), args).astype("float32"),
                               _run_cpu(mod, args).astype("float32"), atol=2e-3, rtol=2e-3)
    _build(mod, "python").export_library(str(tmp_path / "python.so"))
    if G.native_export_skip_reason() is None:
        mqa_byoc.export_library(_build(mod, "native"), str(tmp_path / "native.so"), arch="sm_90", build=False,
                                progress=None)


def test_hopper_wrapper_runs_fa4_var_len_with_fa2_behind_it():
    mod = mqa_byoc.partition_for_cutlass(var_len_attention(h=8, hkv=2, d=64), provider="hopper")
    site = varlen_codegen.find_var_len_site(next(iter(_codegen_funcs(mod).values())))
    code = varlen_codegen.emit_native_source(site, hopper=True).code
    assert "// mqa_byoc-hopper-kernels: fp16 h64 g4 varlen_causal" in code
    assert "mqa_byoc_fa4_ragged_forward(" in code and "mqa_byoc_fa2_varlen_forward(" in code  # FA2 behind it
    assert "data_of(seqstart_q) == data_of(seqstart_k)" in code  # causal: FA4 only with one seqstart
    assert "fa4" not in varlen_codegen.emit_native_source(site).code  # the native provider: FA2 only
    # a window, or a head dim without an FA4 object: FA2 only, and the report says why
    for kw, why in ((dict(window=16), "a sliding window"), (dict(d=32), "head dim 32")):
        m = mqa_byoc.partition_for_cutlass(var_len_attention(**kw), provider="hopper")
        s = varlen_codegen.find_var_len_site(next(iter(_codegen_funcs(m).values())))
        assert "fa4" not in varlen_codegen.emit_native_source(s, hopper=True).code
        (rep,) = mqa_byoc.offload_report(var_len_attention(**kw), target=CUDA, provider="hopper")
        assert rep.offloaded and why in rep.kernel, rep.kernel
    (rep,) = mqa_byoc.offload_report(var_len_attention(h=8, hkv=2, d=64, causal=None), target=CUDA, provider="hopper")
    assert rep.kernel.startswith("FA4 sm90 var-len forward") and "no mask" in rep.kernel


@pytest.mark.skipif(G.native_export_skip_reason() is not None, reason=str(G.native_export_skip_reason()))
def test_hopper_provider_exports_and_links_the_fa4_var_len_object(tmp_path):
    from mqa_byoc.kernels import hopper

    if not (hopper.compiler_available() or hopper.prebuilt_dirs("sm_90")):
        pytest.skip(f"no FA4 objects and no compiler for them ({hopper.install_hint()})")
    ex = _build(var_len_attention(h=8, hkv=1, expand="broadcast", d=64), "hopper")
    path = tmp_path / "varlen_hopper.so"
    mqa_byoc.export_library(ex, str(path), arch="sm_90", build=False, progress=None)
    import subprocess

    syms = subprocess.run(["nm", str(path)], capture_output=True, text=True, check=True).stdout
    for sym in ("__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h64_g8_varlen_causal", "mqa_byoc_fa4_ragged_forward",
                "mqa_byoc_fa2_varlen_forward"):
        assert f" {sym}\n" in syms, sym
    import re

    assert not re.findall(r" U (mqa_byoc_\w+|__tvm_ffi_mqa_byoc_\w+)", syms)  # nothing of ours left unresolved


def test_two_constant_seqstarts_are_the_same_sequences_only_when_their_values_are():
    from tvm import relax as rx

    from mqa_byoc.compiler.graph.varlen import same_sequences

    a, b = rx.const(np.array([0, 5, 6], "int32")), rx.const(np.array([0, 5, 6], "int32"))
    assert not a.same_as(b) and same_sequences(a, b)
    assert not same_sequences(a, rx.const(np.array([0, 4, 6], "int32")))
