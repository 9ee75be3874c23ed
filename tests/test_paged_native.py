"""The bridging rules of native/fa2_paged.cu (TVM's CSR page list -> FA2's block table and K lengths,
FA2's natural-log LSE -> TVM's base-2 LSE, the merge of two attention states) against NumPy, through their host twins (the kernels and the
twins share the per-element functions), and the wrappers' C++ compiled the way export compiles it."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from mqa_byoc import kernels as K

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not K.nvcc_available(), reason="needs g++ and nvcc")


def _source_reason():
    try:
        K.flash_attn_source(download=False, progress=lambda _m: None)
    except K.NativeKernelsUnavailable as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if _source_reason():
        pytest.skip(_source_reason())
    from mqa_byoc.compiler.paged.build import paged_object
    from mqa_byoc.kernels.build import static_cudart, support_object

    obj = paged_object("sm_90", build=False, progress=None)
    # the paged object uses the dispatcher's kernel table, workspace pool and split rule
    disp = K.build_dispatcher(build=False, progress=None, arch="sm_90")
    out = tmp_path_factory.mktemp("paged") / "paged_host.so"
    subprocess.run(["g++", "-shared", "-o", str(out), str(obj), str(disp), str(support_object("sm_90", None)),
                    *static_cudart("sm_90")], check=True)
    return ctypes.CDLL(str(out))


def _p(a, t):
    return a.ctypes.data_as(ctypes.POINTER(t))


def test_block_table_and_lengths_match_numpy(lib):
    rng = np.random.default_rng(0)
    page = 128
    lengths = [0, 1, 127, 128, 129, 1000, 256]
    n_pages = [-(-n // page) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    values = rng.permutation(int(indptr[-1]) + 5)[: indptr[-1]].astype(np.int32)
    last = np.array([n - (p - 1) * page if p else 0 for n, p in zip(lengths, n_pages)], np.int32)
    stride = int(indptr[-1])
    table = np.full((len(lengths), stride), -7, np.int32)
    seqlens = np.zeros(len(lengths), np.int32)
    empty = np.full(len(lengths), -1, np.int32)
    lib.mqa_byoc_fa2_paged_host_block_table(_p(indptr, ctypes.c_int32), _p(values, ctypes.c_int32),
                                            _p(last, ctypes.c_int32), ctypes.c_int64(len(lengths)),
                                            ctypes.c_int(page), ctypes.c_int(stride),
                                            _p(table, ctypes.c_int32), _p(seqlens, ctypes.c_int32),
                                            _p(empty, ctypes.c_int32))
    lengths = np.array(lengths)
    np.testing.assert_array_equal(empty, lengths == 0)
    # a sequence without K/V reads one key of page 0 (its rows are zeroed afterwards): FA2 never sees 0 keys
    np.testing.assert_array_equal(seqlens, np.where(lengths == 0, 1, lengths))
    for b in range(len(lengths)):
        row = values[indptr[b]:indptr[b + 1]] if lengths[b] else np.array([0], np.int32)
        np.testing.assert_array_equal(table[b, :len(row)], row)
        assert (table[b, len(row):] == -7).all()  # padding is never written (nor read by FA2)


@pytest.mark.parametrize("layout", ["heads_major", "rows_major"])
def test_lse_becomes_base_2_and_empty_rows_get_tvm_value(lib, layout):
    rng = np.random.default_rng(1)
    rows, heads = 5, 3
    nat = rng.normal(size=(rows, heads)).astype(np.float32) * 4
    nat[2, 1] = np.inf  # FA2: a row without keys
    src = np.ascontiguousarray(nat.T) if layout == "heads_major" else nat  # (H, total) var-len / (B, H) decode
    row_stride, head_stride = (1, rows) if layout == "heads_major" else (heads, 1)
    out = np.zeros((rows, heads), np.float32)
    lib.mqa_byoc_fa2_paged_host_lse(_p(src, ctypes.c_float), ctypes.c_int64(rows), ctypes.c_int(heads),
                                    ctypes.c_int64(row_stride), ctypes.c_int64(head_stride), _p(out, ctypes.c_float))
    want = np.where(np.isinf(nat), -5e4, nat / np.log(2)).astype(np.float32)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    # what the base-2 value means: log2 of the sum of exp of the scores (TVM's merge_state reads it so)
    scores = rng.normal(size=7)
    assert np.isclose(np.log(np.exp(scores).sum()) / np.log(2), np.log2(np.exp(scores).sum()))


def test_wrappers_compile_with_tvm_ffi_headers(tmp_path):
    """The emitted TVM-FFI wrappers compile as export compiles them (g++, TVM's include paths)."""
    import tvm_ffi.libinfo

    from mqa_byoc.compiler.paged.codegen import PagedConfig, emit_paged_source

    src = tmp_path / "w.cc"
    src.write_text(emit_paged_source(PagedConfig(71, 1, 64, "bfloat16", 256), ["prefill", "decode", "ragged", "merge"]))
    inc = tvm_ffi.libinfo.find_include_path()
    dl = tvm_ffi.libinfo.find_dlpack_include_path() if hasattr(tvm_ffi.libinfo, "find_dlpack_include_path") else inc
    subprocess.run(["g++", "-std=c++17", "-fPIC", "-c", str(src), f"-I{inc}", f"-I{dl}", "-o", str(tmp_path / "w.o")],
                   check=True)
    syms = subprocess.run(["nm", str(tmp_path / "w.o")], capture_output=True, text=True).stdout
    for kind in ("prefill", "decode", "ragged", "merge"):
        assert f"__tvm_ffi_mqa_byoc_paged_{kind}_h71kv1d64p256_bf16" in syms


def test_extern_func_in_a_tuple_resolves_to_the_library_function(tmp_path):
    """What the rewritten create call relies on: an ``R.ExternFunc`` inside a ``("tirx", f)`` tuple
    reaches the callee (here a Python stand-in for the cache) as the exported library's TVM-FFI
    function, defined by an external C++ module of the IRModule (as the paged wrappers are)."""
    import numpy as np
    import tvm
    import tvm_ffi
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        entry = relax.Tuple([tvm.ir.StringImm("tirx"), relax.ExternFunc("mqa_byoc_test_twice")])
        bb.emit_func_output(bb.emit(relax.call_pure_packed("mqa_byoc_test_apply", entry, x,
                                                           ty_args=relax.TensorType((4,), "float32"))))
    code = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
namespace {
int twice(DLTensor* a) {
  float* p = static_cast<float*>(a->data);
  for (int i = 0; i < a->shape[0]; ++i) p[i] *= 2;
  return 0;
}
}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(mqa_byoc_test_twice, twice);
"""
    ext = tvm.get_global_func("runtime.CSourceModuleCreate")(code, "cc", ["mqa_byoc_test_twice"], [])
    mod = bb.get().with_attr("external_mods", [ext])
    tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})).export_library(str(tmp_path / "m.so"))
    seen = []

    def apply(entry, arr):
        seen.append(str(entry[0]))
        entry[1](arr)
        return arr

    tvm_ffi.register_global_func("mqa_byoc_test_apply", apply, override=True)
    try:
        vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "m.so")), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(np.arange(4, dtype="float32")))
    finally:
        tvm_ffi.remove_global_func("mqa_byoc_test_apply")
    assert seen == ["tirx"]
    np.testing.assert_array_equal(out.numpy(), np.arange(4, dtype="float32") * 2)


def _attention_of(scores, values):
    """Softmax attention of one query row: (output, base-2 LSE of its scaled scores), float64."""
    p = np.exp(scores - scores.max())
    return p @ values / p.sum(), np.log2(np.exp(scores).sum())


def _attention(rng, n_keys, d):
    scores, values = rng.normal(size=n_keys) * 3, rng.normal(size=(n_keys, d))
    return (*_attention_of(scores, values), scores, values)


def test_merge_state_matches_attention_over_both_parts(lib):
    """Merging two parts' (V, base-2 LSE) gives attention over the union of their keys, for every head of
    H=71 (TVM's TIR merge leaves head 70 out there); a part without keys (LSE -inf, or TVM's empty -5e4
    against a real part) gets no weight, even when its V is not finite."""
    rng = np.random.default_rng(2)
    rows, heads, d = 4, 71, 64
    v = np.zeros((rows, heads, d), np.float32)
    vo = np.zeros_like(v)
    s = np.zeros((rows, heads), np.float32)
    so = np.zeros_like(s)
    want_v = np.zeros_like(v)
    want_s = np.zeros_like(s)
    for r in range(rows):
        for h in range(heads):
            o1, l1, sc1, v1 = _attention(rng, 1 + r * 5 + h % 7, d)
            o2, l2, sc2, v2 = _attention(rng, 1 + h % 11, d)
            v[r, h], s[r, h], vo[r, h], so[r, h] = o1, l1, o2, l2
            want_v[r, h], want_s[r, h] = _attention_of(np.concatenate([sc1, sc2]), np.concatenate([v1, v2]))
    # row 1: the ragged part has no keys (FA2's empty rows get TVM's -5e4 and V 0); row 2: the paged part
    # has LSE -inf and garbage V; row 3, heads 0-9: both parts empty (-inf and -5e4), heads 10-19: both -inf
    s[1], v[1] = -5e4, 0
    want_v[1], want_s[1] = vo[1], so[1]
    so[2], vo[2] = -np.inf, np.nan
    want_v[2], want_s[2] = v[2], s[2]
    s[3, :10], so[3, :10], v[3, :10], vo[3, :10] = -np.inf, -5e4, np.nan, 0
    want_v[3, :10], want_s[3, :10] = 0, -5e4
    s[3, 10:20], so[3, 10:20] = -np.inf, -np.inf
    want_v[3, 10:20], want_s[3, 10:20] = 0, -np.inf
    lib.mqa_byoc_fa2_paged_host_merge(_p(v, ctypes.c_float), _p(s, ctypes.c_float), _p(vo, ctypes.c_float),
                                      _p(so, ctypes.c_float), ctypes.c_int64(rows), ctypes.c_int64(heads),
                                      ctypes.c_int64(d))
    np.testing.assert_allclose(v, want_v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-4)
    assert np.isfinite(v).all()

