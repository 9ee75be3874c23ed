"""UseFlashAttentionForPagedKVCache on TVM's PagedKVCache (relax.frontend.nn LLM): what it rewrites,
what it keeps and why, typed errors, the CUDA build and the exported symbols."""

from __future__ import annotations

import re
import subprocess

import pytest
import tvm
from tvm import relax

from mqa_byoc.testing import graphs
from mqa_byoc.compiler.paged.transform import (
    CREATE,
    UseFlashAttentionForPagedKVCache,
    format_paged_report,
    page_unit,
    paged_kv_cache_report,
    tir_merge_heads,
)
from mqa_byoc.models.paged_llama import PagedLlamaConfig, export_paged_llama

ATTENTION = {"batch_prefill_ragged_kv": "ragged", "batch_prefill_paged_kv": "prefill", "batch_decode_paged_kv": "decode"}
MERGE = "tir_attention_merge_state"
SERVED = {**ATTENTION, MERGE: "merge"}
MERGE_ARG = 23  # the attn-merge tuple of the create call (after the callee)
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
    """{kernel or symbol name: argument} of the ("tirx", f) tuples and the attn-merge tuple of the create call."""
    out = {}
    for i, a in enumerate(_create_args(mod)):
        if isinstance(a, relax.Tuple) and (len(a.fields) == 2 or i == MERGE_ARG):
            for f in a.fields[1:] if i != MERGE_ARG else a.fields:
                out[f.global_symbol if isinstance(f, relax.ExternFunc) else f.name_hint] = f
    return out


@pytest.fixture(scope="module")
def gqa():
    return _module(num_q_heads=8, num_kv_heads=2, head_dim=64)


def test_report_serves_prefill_decode_ragged_and_keeps_the_rest(gqa):
    report = paged_kv_cache_report(gqa, provider="native")
    assert {d.kernel for d in report} == set(SERVED) | KEPT
    for d in report:
        if d.kernel in SERVED:
            assert d.offloaded and d.reason is None
            assert d.symbol == f"mqa_byoc_paged_{SERVED[d.kernel]}_h8kv2d64p256_fp16"
            if d.kernel == MERGE:
                assert "replaces TVM's TIR merge_state" in d.note and "merges 8 of 8" in d.note
            elif d.kernel == "batch_prefill_ragged_kv":  # the native provider: FA2's var-len forward
                assert d.note == "FA2 var-len forward; create the cache with page_size=256, support_sliding_window=0"
            else:
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
        if isinstance(a, relax.Tuple) and len(a.fields) == 2 and a.fields[1].name_hint in ATTENTION:
            assert isinstance(b.fields[1], relax.ExternFunc) and b.fields[0].value == "tirx"
            assert ATTENTION[a.fields[1].name_hint] in b.fields[1].global_symbol
    # the attn-merge tuple holds the merge bare (no "tirx" tag): (GlobalVar,) -> (ExternFunc,)
    assert [f.name_hint for f in args_before[MERGE_ARG].fields] == [MERGE]
    (merge,) = args_after[MERGE_ARG].fields
    assert isinstance(merge, relax.ExternFunc) and merge.global_symbol == "mqa_byoc_paged_merge_h8kv2d64p256_fp16"
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
    for bad in (0, -256, 256.0, "256", True):
        with pytest.raises(ValueError, match="page_size must be a positive int"):
            UseFlashAttentionForPagedKVCache(page_size=bad)
        with pytest.raises(ValueError, match="page_size must be a positive int"):
            paged_kv_cache_report(gqa, page_size=bad)
    with pytest.raises(TypeError, match="expects a tvm.IRModule"):
        paged_kv_cache_report(gqa["create_paged_kv_cache"])
    with pytest.raises(ValueError, match="the target is 'llvm'.*give a CUDA target"):
        UseFlashAttentionForPagedKVCache(target="llvm")(gqa)
    # a target given as a dict or a string is a target (the regenerated compaction kernel is built for it)
    for target in ({"kind": "cuda", "arch": "sm_90"}, "cuda"):
        served = UseFlashAttentionForPagedKVCache(target=target)(gqa)
        assert any(d.offloaded for d in paged_kv_cache_report(served))


def test_a_cache_created_for_a_cpu_target_stays_on_its_kernels():
    # TVM's CPU cache has the CUDA cache's create call and its ragged prefill's symbol; its other kernels are
    # the *_cpu ones: nothing of it runs on our CUDA kernels
    mod = export_paged_llama(PagedLlamaConfig(**SMALL, num_q_heads=8, num_kv_heads=2, head_dim=64),
                             target=tvm.target.Target("llvm"))[0]
    decisions = paged_kv_cache_report(mod)
    assert decisions and not any(d.offloaded for d in decisions), format_paged_report(decisions)
    ragged = next(d for d in decisions if d.kernel == "batch_prefill_ragged_kv")
    assert "created for a CPU target" in ragged.reason and "batch_decode_paged_kv_cpu" in ragged.reason
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        tvm.ir.assert_structural_equal(UseFlashAttentionForPagedKVCache()(mod), mod)


@pytest.mark.skipif(graphs.native_export_skip_reason() is not None, reason=str(graphs.native_export_skip_reason()))
def test_served_module_builds_for_cuda_and_exports_the_wrappers(tmp_path):
    import mqa_byoc

    mod = _module(num_q_heads=8, num_kv_heads=1, head_dim=128)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        served = UseFlashAttentionForPagedKVCache(provider="native")(mod)
    lib = tmp_path / "paged.so"
    mqa_byoc.export_library(tvm.compile(served, target=target), lib, arch="sm_90", build=False, progress=None)
    dynamic = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for kind in SERVED.values():
        assert f"__tvm_ffi_mqa_byoc_paged_{kind}_h8kv1d128p128_fp16" in dynamic
    symbols = subprocess.run(["nm", str(lib)], capture_output=True, text=True).stdout
    for sym in ("mqa_byoc_fa2_paged_forward", "mqa_byoc_fa2_ragged_forward", "mqa_byoc_fa2_paged_merge_state",
                "mqa_byoc_fa2_fwd_split_hdim128_fp16",
                "mqa_byoc_fa2_fwd_split_hdim128_fp16_causal", "mqa_byoc_fa2_fwd_hdim128_fp16_causal"):
        assert f" {sym}\n" in symbols, sym


def _tir_merge_grid(num_heads, head_dim):
    """(heads per block, blocks in y) of TVM's own merge PrimFunc, read from its thread bindings."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    script = _merge_state_inplace(num_heads, head_dim, "float16", target).script()
    ext = {tag: int(n) for n, tag in re.findall(r'T\.thread_binding\((\d+), thread="(\w+\.y)"\)', script)}
    return ext["threadIdx.y"], ext["blockIdx.y"]


@pytest.mark.parametrize("num_heads, head_dim", [(71, 64), (8, 64), (64, 128), (40, 128), (32, 256), (1, 64)])
def test_tir_merge_heads_reads_tvm_grid(num_heads, head_dim):
    """The heads TVM's TIR merge covers = its blocks in y times its heads per block (TVM 0.27)."""
    bdy, gdy = _tir_merge_grid(num_heads, head_dim)
    assert tir_merge_heads(num_heads, head_dim) == bdy * gdy <= num_heads


def test_merge_is_replaced_for_71_heads_and_the_report_says_why():
    mod = _module(num_q_heads=71, num_kv_heads=1, head_dim=64)
    (merge,) = [d for d in paged_kv_cache_report(mod) if d.kernel == MERGE]
    assert _tir_merge_grid(71, 64) == (35, 2)  # TVM's grid: 2 blocks of 35 heads, head 70 never merged
    assert merge.offloaded and merge.symbol == "mqa_byoc_paged_merge_h71kv1d64p256_fp16"
    assert "merges 70 of 71" in merge.note and "every (row, head)" in merge.note
    line = [x for x in format_paged_report(paged_kv_cache_report(mod)).splitlines() if MERGE in x]
    assert line and "-> mqa_byoc_paged_merge_h71kv1d64p256_fp16" in line[0] and "70 of 71" in line[0]
    after = UseFlashAttentionForPagedKVCache()(mod)
    assert MERGE not in {gv.name_hint for gv in after.get_global_vars()}
    src = after.attrs["external_mods"][0].inspect_source()
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(mqa_byoc_paged_merge_h71kv1d64p256_fp16" in src
    assert "mqa_byoc_fa2_paged_merge_state(" in src


def test_mla_cache_keeps_both_merges(gqa):
    """An MLA cache (attn_kind 1) stays on TIR entirely, its merge and MLA's own merge included."""
    def edit(args):
        args[6] = relax.ShapeExpr([1])
        mla = relax.Tuple([args[MERGE_ARG].fields[0], args[MERGE_ARG].fields[0]])
        return args[:MERGE_ARG] + [mla] + args[MERGE_ARG + 1:]

    mod = _with_create_args(gqa, edit)
    merges = [d for d in paged_kv_cache_report(mod) if d.kernel == MERGE]
    assert len(merges) == 2 and not any(d.offloaded for d in merges)
    assert all("MLA" in d.reason for d in merges)
    tvm.ir.assert_structural_equal(UseFlashAttentionForPagedKVCache()(mod), mod)


def test_hopper_provider_runs_the_ragged_prefill_on_fa4_varlen():
    from mqa_byoc.kernels import hopper

    mod = _module(num_q_heads=8, num_kv_heads=1, head_dim=128)
    notes = {d.kernel: d.note for d in paged_kv_cache_report(mod, provider="hopper")}
    if hopper.compiler_available() or hopper.prebuilt_dirs("sm_90"):
        assert notes["batch_prefill_ragged_kv"].startswith(f"FA4 sm90 var-len forward (flash-attn-4 {hopper.FA4_VERSION}, group 8)")
    else:
        assert "hopper provider: flash-attn-4" in notes["batch_prefill_ragged_kv"]
    # the other entries are the native provider's
    native = {d.kernel: d.note for d in paged_kv_cache_report(mod, provider="native")}
    assert {k: v for k, v in notes.items() if k != "batch_prefill_ragged_kv"} == {
        k: v for k, v in native.items() if k != "batch_prefill_ragged_kv"}
    assert native["batch_prefill_ragged_kv"].startswith("FA2 var-len forward;")
    if not (hopper.compiler_available() or hopper.prebuilt_dirs("sm_90")):
        return
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        served = UseFlashAttentionForPagedKVCache(provider="hopper")(mod)
    (ext,) = served.attrs["external_mods"]
    src = ext.inspect_source()
    assert "// mqa_byoc-hopper-kernels: fp16 h128 g8 varlen; fp16 h128 g8 varlen_causal" in src
    assert src.count("mqa_byoc_fa4_ragged_forward(") == 2  # declared, called in the ragged entry only
    assert "__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h128_g8_varlen_causal" in src
    # the native provider's source has no FA4 at all
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        (plain,) = UseFlashAttentionForPagedKVCache(provider="native")(mod).attrs["external_mods"]
    assert "fa4" not in plain.inspect_source()


def test_hopper_provider_keeps_fa2_for_head_dims_without_fa4_objects():
    mod = _module(num_q_heads=8, num_kv_heads=2, head_dim=256)
    (note,) = [d.note for d in paged_kv_cache_report(mod, provider="hopper") if d.kernel == "batch_prefill_ragged_kv"]
    assert note.startswith("FA2 var-len forward (hopper provider: head dim 256 has no FA4 object")
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        (ext,) = UseFlashAttentionForPagedKVCache(provider="hopper")(mod).attrs["external_mods"]
    assert "fa4" not in ext.inspect_source()
    # an arch FA4's objects are not built for: FA2, and the report says why
    (note,) = [d.note for d in paged_kv_cache_report(_module(num_q_heads=8, num_kv_heads=1, head_dim=128),
                                                     provider="hopper", arch="sm_80") if d.kernel == "batch_prefill_ragged_kv"]
    assert "hopper provider: FA4's Hopper kernel needs sm_90" in note


def test_paged_provider_argument_is_checked(gqa):
    with pytest.raises(ValueError, match="python provider has no PagedKVCache attention"):
        UseFlashAttentionForPagedKVCache(provider="python")
    with pytest.raises(ValueError, match="provider"):
        paged_kv_cache_report(gqa, provider="cudnn")


@pytest.mark.skipif(graphs.native_export_skip_reason() is not None, reason=str(graphs.native_export_skip_reason()))
def test_hopper_paged_module_links_the_fa4_varlen_objects(tmp_path):
    import mqa_byoc
    from mqa_byoc.kernels import hopper

    if not (hopper.compiler_available() or hopper.prebuilt_dirs("sm_90")):
        pytest.skip(f"no FA4 objects and no compiler for them ({hopper.install_hint()})")
    mod = _module(num_q_heads=8, num_kv_heads=1, head_dim=128)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        served = UseFlashAttentionForPagedKVCache(provider="hopper")(mod)
    lib = tmp_path / "paged_hopper.so"
    mqa_byoc.export_library(tvm.compile(served, target=target), lib, arch="sm_90", build=False, progress=None)
    symbols = subprocess.run(["nm", str(lib)], capture_output=True, text=True).stdout
    for sym in ("__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h128_g8_varlen", "__tvm_ffi_mqa_byoc_fa4_sm90_fp16_h128_g8_varlen_causal",
                "mqa_byoc_fa4_ragged_forward", "mqa_byoc_fa2_ragged_forward"):
        assert f" {sym}\n" in symbols, sym
    # every symbol of ours the library calls is in it (FA4's glue, the ragged C API, the dispatcher)
    assert not re.findall(r" U (mqa_byoc_\w+|__tvm_ffi_mqa_byoc_\w+)", symbols)


def test_default_provider_is_hopper_where_its_fa4_objects_can_be_had():
    from mqa_byoc.kernels import hopper

    mod = _module(num_q_heads=8, num_kv_heads=1, head_dim=128)

    def ragged(**kw):
        (d,) = [d for d in paged_kv_cache_report(mod, **kw) if d.kernel == "batch_prefill_ragged_kv"]
        return d.note

    want = "hopper" if (hopper.compiler_available() or hopper.prebuilt_dirs("sm_90")) else "native"
    assert ragged() == ragged(provider=want)
    # not Hopper: the default is the native provider's FA2, and the report says why not FA4
    assert ragged(arch="sm_80").startswith("FA2 var-len forward (provider auto, FA4 not used: FA4's Hopper kernel needs sm_90")
    assert ragged(arch="sm_80", provider="native").startswith("FA2 var-len forward;")


def test_build_warns_when_a_cache_it_could_serve_is_left_on_tir(gqa):
    import warnings

    from mqa_byoc.compiler.build import _warn_unserved_paged_caches

    with pytest.warns(UserWarning, match="PagedKVCache attention .* stays on TVM's TIR kernels; apply"):
        _warn_unserved_paged_caches(gqa)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        served = UseFlashAttentionForPagedKVCache()(gqa)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_unserved_paged_caches(served)
