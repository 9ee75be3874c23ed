"""UseFlashAttentionForPagedKVCache on TVM's PagedKVCache (relax.frontend.nn LLM): what it rewrites,
what it keeps and why, typed errors, the CUDA build and the exported symbols."""

from __future__ import annotations

import re
import subprocess

import pytest
import tvm
from tvm import relax

import graphs
from mqa_byoc.compiler.paged import (
    CREATE,
    UseFlashAttentionForPagedKVCache,
    format_paged_report,
    page_unit,
    paged_kv_cache_report,
)
from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama

SERVED = {"batch_prefill_ragged_kv": "ragged", "batch_prefill_paged_kv": "prefill", "batch_decode_paged_kv": "decode"}
KEPT = {"batch_prefill_paged_kv_sliding_window", "batch_decode_paged_kv_sliding_window", "tree_attn_paged_kv",
        "batch_tree_attn"}
SMALL = dict(hidden=64, intermediate=128, layers=1, vocab=32, rope_mode=0)


def _module(**fields):
    return export_paged_llama(PagedLlamaConfig(**{**SMALL, **fields}))[0]


def _create_args(mod):
    found = []
    relax.analysis.post_order_visit(
        mod["create_paged_kv_cache"].body,
        lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(e.args[0], relax.ExternFunc)
        and e.args[0].global_symbol == CREATE else None)
    assert len(found) == 1
    return list(found[0].args[1:])


def _entries(mod):
    """{kernel or symbol name: argument} of the ("tirx", f) tuples of the create call."""
    out = {}
    for a in _create_args(mod):
        if isinstance(a, relax.Tuple) and len(a.fields) == 2:
            f = a.fields[1]
            out[f.global_symbol if isinstance(f, relax.ExternFunc) else f.name_hint] = f
    return out


@pytest.fixture(scope="module")
def gqa():
    return _module(num_q_heads=8, num_kv_heads=2, head_dim=64)


def test_report_serves_prefill_decode_ragged_and_keeps_the_rest(gqa):
    report = paged_kv_cache_report(gqa)
    assert {d.kernel for d in report} == set(SERVED) | KEPT
    for d in report:
        if d.kernel in SERVED:
            assert d.offloaded and d.reason is None
            assert d.symbol == f"mqa_byoc_paged_{SERVED[d.kernel]}_h8kv2d64p256_fp16"
            assert d.note == "create the cache with page_size=256, support_sliding_window=0"
        else:
            assert not d.offloaded and d.symbol is None
            assert "page size 16" in d.reason  # TVM's TIR kernels cannot run in a cache of 256-token pages
    text = format_paged_report(report)
    assert "tree attention" in text and "sliding-window" in text


def test_pass_rewrites_exactly_the_served_entries(gqa):
    before = _entries(gqa)
    after_mod = UseFlashAttentionForPagedKVCache()(gqa)
    after = _entries(after_mod)
    # served: ExternFuncs with the same tuple position, the rest: the same GlobalVars
    assert set(after) == {f"mqa_byoc_paged_{k}_h8kv2d64p256_fp16" for k in SERVED.values()} | KEPT
    for name in KEPT:
        assert after[name].same_as(before[name])
    args_before, args_after = _create_args(gqa), _create_args(after_mod)
    assert len(args_before) == len(args_after)
    for i, (a, b) in enumerate(zip(args_before, args_after)):
        if isinstance(a, relax.Tuple) and len(a.fields) == 2 and a.fields[1].name_hint in SERVED:
            assert isinstance(b.fields[1], relax.ExternFunc) and b.fields[0].value == "tirx"
            assert SERVED[a.fields[1].name_hint] in b.fields[1].global_symbol
    # the append / compaction kernels regenerated for 256-token pages; the TIR attention PrimFuncs gone
    names = {gv.name_hint for gv in after_mod.get_global_vars()}
    assert not names & set(SERVED)
    assert {"kv_cache_transpose_append_h8kv2d64p256_fp16", "kv_cache_compact_kv_copy_h8kv2d64p256_fp16"} <= names
    for name in ("kv_cache_transpose_append", "kv_cache_compact_kv_copy"):  # pages (num_pages, 2, 2, 256, 64)
        assert re.search(r"T\.Buffer\(\(\"?num_pages\"?, 2, 2, 256, 64\)", after_mod[f"{name}_h8kv2d64p256_fp16"].script())
    assert re.search(r"T\.Buffer\(\(\"?num_pages\"?, 2, 2, 16, 64\)", gqa["tir_kv_cache_transpose_append"].script())
    # the caller's module is untouched; the wrappers travel as an external C++ module
    assert set(SERVED) <= {gv.name_hint for gv in gqa.get_global_vars()}
    (ext,) = after_mod.attrs["external_mods"]
    src = ext.inspect_source()
    assert "// mqa_byoc-paged: fa2_paged" in src and "kPageSize = 256" in src
    for kind in SERVED.values():
        assert f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(mqa_byoc_paged_{kind}_h8kv2d64p256_fp16" in src
    # idempotent: a second run finds nothing left to serve
    again = UseFlashAttentionForPagedKVCache()(after_mod)
    assert len(again.attrs["external_mods"]) == 1
    assert all(d.note == "already rewritten" for d in paged_kv_cache_report(again) if d.offloaded)


@pytest.mark.parametrize("fields, page, reason", [
    (dict(rope_mode=2), None, "RoPE inline mode"),
    (dict(dtype="float32"), None, "dtype float32"),
    (dict(num_q_heads=8, num_kv_heads=2, head_dim=60), None, "head dim 60"),
    (dict(), 100, "page size 100 is not a multiple of 128"),
])
def test_unservable_caches_stay_on_tir_with_a_reason(fields, page, reason):
    mod = _module(**{"num_q_heads": 4, "num_kv_heads": 1, "head_dim": 128, **fields})
    report = paged_kv_cache_report(mod, page)
    assert report and not any(d.offloaded for d in report)
    assert all(reason in d.reason for d in report if d.kernel in SERVED)
    after = UseFlashAttentionForPagedKVCache(page_size=page)(mod)
    tvm.ir.assert_structural_equal(after, mod)


def _with_create_args(mod, edit):
    """``mod`` with the create call's arguments replaced by ``edit(args)`` (args after the callee)."""
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class Edit(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == CREATE:
                return relax.Call(call.op, [call.args[0], *edit(list(call.args[1:]))], call.attrs, call.ty_args)
            return call

    out = mod.clone()
    gv = out.get_global_var("create_paged_kv_cache")
    out[gv] = Edit(out).visit_expr(out[gv])
    return out


@pytest.mark.parametrize("what, reason", [
    ("mha_sliding layer", "sliding-window attention (mha_sliding)"),
    ("support_sliding_window=1", "support_sliding_window=1"),
    ("page size 64 in the call", "the create call fixes page size 64"),
])
def test_sliding_window_caches_and_fixed_page_sizes(gqa, what, reason):
    def edit(args):
        shapes = list(args[0].values)
        if what == "mha_sliding layer":
            args[6] = relax.ShapeExpr([3])
        elif what == "support_sliding_window=1":
            args[0] = relax.ShapeExpr(shapes[:4] + [1] + shapes[5:])
        else:
            args[0] = relax.ShapeExpr(shapes[:3] + [64] + shapes[4:])
        return args

    mod = _with_create_args(gqa, edit)
    page = 256 if what.startswith("page") else None
    report = paged_kv_cache_report(mod, page)
    assert not any(d.offloaded for d in report)
    assert all(reason in d.reason for d in report if d.kernel in SERVED)
    if what.startswith("page"):  # a constant page size that is FA2's tile is served as is
        ok = _with_create_args(gqa, lambda a: [relax.ShapeExpr(list(a[0].values)[:3] + [256] + list(a[0].values)[4:])]
                               + a[1:])
        assert {d.symbol for d in paged_kv_cache_report(ok) if d.offloaded} == {
            f"mqa_byoc_paged_{k}_h8kv2d64p256_fp16" for k in SERVED.values()}


def test_page_unit_is_fa2_split_kernel_tile():
    assert [page_unit(d) for d in (32, 64, 80, 128, 192, 256)] == [256, 256, 128, 128, 64, 64]


def test_bad_arguments_are_typed_errors(gqa):
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        UseFlashAttentionForPagedKVCache(page_size=0)
    with pytest.raises(TypeError, match="expects a tvm.IRModule"):
        paged_kv_cache_report(gqa["create_paged_kv_cache"])


@pytest.mark.skipif(graphs.native_export_skip_reason() is not None, reason=str(graphs.native_export_skip_reason()))
def test_served_module_builds_for_cuda_and_exports_the_wrappers(tmp_path):
    import mqa_byoc

    mod = _module(num_q_heads=8, num_kv_heads=1, head_dim=128)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        served = UseFlashAttentionForPagedKVCache()(mod)
    lib = tmp_path / "paged.so"
    mqa_byoc.export_library(tvm.compile(served, target=target), lib, arch="sm_90", build=False, progress=None)
    dynamic = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for kind in SERVED.values():
        assert f"__tvm_ffi_mqa_byoc_paged_{kind}_h8kv1d128p128_fp16" in dynamic
    symbols = subprocess.run(["nm", str(lib)], capture_output=True, text=True).stdout
    for sym in ("mqa_byoc_fa2_paged_forward", "mqa_byoc_fa2_ragged_forward", "mqa_byoc_fa2_fwd_split_hdim128_fp16",
                "mqa_byoc_fa2_fwd_split_hdim128_fp16_causal", "mqa_byoc_fa2_fwd_hdim128_fp16_causal"):
        assert f" {sym}\n" in symbols, sym
