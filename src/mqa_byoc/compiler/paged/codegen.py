"""C++ for the TVM-FFI functions that replace TVM's paged-KV attention PrimFuncs.

TVM's runtime (``vm.builtin.paged_attention_kv_cache_create``) calls each attention entry with the
parameter list of its TIR PrimFunc; the functions emitted here take exactly those lists:

==========  ===============================================================================
kind        parameters (TVM 0.27 ``_prefill_kernels.py`` / ``_decode_kernels.py``)
==========  ===============================================================================
prefill     q, qo_indptr, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
            q_rope_position, output, lse, causal, rotary_mode, rope_scale, rope_theta, sm_scale
decode      q, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
            q_rope_position, output, lse, rotary_mode, rope_scale, rope_theta, sm_scale
ragged      q, qo_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, output, lse,
            causal, rotary_mode, rope_scale, rope_theta, sm_scale
merge       v, s, v_other, s_other (``_merge_state_inplace``: in place into v, s; base-2 LSEs)
==========  ===============================================================================

Each checks its tensors against the cache's heads, head dim and dtype (baked in) and calls the C API
of ``mqa_byoc/native/fa2_paged.h``, linked in by :func:`mqa_byoc.export_library` (marker
:data:`~mqa_byoc.compiler.paged.build.PAGED_MARKER`, kernel families in the usual marker line).
With ``fa4_ragged`` (the hopper provider) the ragged entry runs FA4's sm90 var-len forward instead
(``native/fa4_ragged.cu`` around the "varlen" / "varlen_causal" objects of
:func:`fa4_ragged_keys`, named in the hopper marker line), and FA2 when the operands are not aligned
for FA4's TMA loads. This module does not import TVM.
"""

from __future__ import annotations

from dataclasses import dataclass

from mqa_byoc.compiler.paged.build import PAGED_MARKER
from mqa_byoc.kernels import KernelKey, kernel_head_dim, marker_line
from mqa_byoc.kernels import hopper as _hopper

#: the attention entries served, by the ``global_symbol`` of TVM's TIR kernel
KINDS = {"batch_prefill_paged_kv": "prefill", "batch_decode_paged_kv": "decode",
         "batch_prefill_ragged_kv": "ragged", "tir_attention_merge_state": "merge"}
# (causal, split) FA2 families per entry: decode is never causal; TVM passes causal as a run-time flag
_FAMILIES = {"prefill": ((False, True), (True, True)), "decode": ((False, True),),
             "ragged": ((False, False), (True, False)), "merge": ()}
_DTYPES = {"float16": ("fp16", "kDLFloat", 0), "bfloat16": ("bf16", "kDLBfloat", 1)}


@dataclass(frozen=True)
class PagedConfig:
    """The attention geometry of one PagedKVCache (what its wrappers are compiled for)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int  # the cache's page size (the wrappers check it)

    @property
    def tag(self) -> str:
        return f"h{self.num_q_heads}kv{self.num_kv_heads}d{self.head_dim}p{self.page_size}_{_DTYPES[self.dtype][0]}"

    def symbol(self, kind: str) -> str:
        """The exported name of the ``kind`` entry (``mqa_byoc_paged_decode_h64kv8d128p128_fp16``)."""
        return f"mqa_byoc_paged_{kind}_{self.tag}"

    def kernel_keys(self, kinds=tuple(_FAMILIES)) -> tuple[KernelKey, ...]:
        """FA2 families the ``kinds`` entries use (the paged ones read pages only in the split kernel)."""
        hd, dt = kernel_head_dim(self.head_dim), _DTYPES[self.dtype][0]
        return tuple(sorted({KernelKey(hd, dt, c, s) for k in kinds for c, s in _FAMILIES[k]}))


def fa4_ragged_keys(cfg: PagedConfig) -> tuple:
    """The FA4 objects of the ragged entry on the hopper provider: (non-causal, causal) var-len
    (TVM passes causal at run time), or () when FA4 has no object for the cache's head dim."""
    if cfg.head_dim not in _hopper.HEAD_DIMS or cfg.dtype not in _DTYPES:
        return ()
    group = cfg.num_q_heads // cfg.num_kv_heads
    return tuple(_hopper.HopperKernelKey(_DTYPES[cfg.dtype][0], cfg.head_dim, group, m) for m in _hopper.VARLEN_MASKS)


def emit_paged_source(cfg: PagedConfig, kinds, fa4_ragged: bool = False) -> str:
    """C++ of the TVM-FFI functions for ``kinds`` (a subset of prefill / decode / ragged / merge) of
    ``cfg``; ``fa4_ragged``: the ragged entry on FA4 (:func:`fa4_ragged_keys` must have its objects)."""
    if cfg.dtype not in _DTYPES:
        raise ValueError(f"paged FA2 supports {tuple(_DTYPES)}, got {cfg.dtype!r}")
    fa4_keys = fa4_ragged_keys(cfg) if fa4_ragged and "ragged" in kinds else ()
    if fa4_ragged and "ragged" in kinds and not fa4_keys:
        raise ValueError(f"no FA4 var-len object for head dim {cfg.head_dim} (FA4 objects: {_hopper.HEAD_DIMS})")
    short, code, is_bf16 = _DTYPES[cfg.dtype]
    body = _PRELUDE + (_FA4_RAGGED_DECL.replace("@RAGGED_DECL@", _hopper.RAGGED_DECL) if fa4_keys else "")
    for kind in sorted(set(kinds)):
        text = _BODIES[kind]
        if kind == "ragged":
            text = text.replace("@FA4_CALL@", _FA4_RAGGED_CALL if fa4_keys else "")
        body += text.replace("@SYMBOL@", cfg.symbol(kind))
    if fa4_keys:
        body = body.replace("@FA4N@", fa4_keys[0].symbol).replace("@FA4C@", fa4_keys[1].symbol)
    fields = {"@MARKER@": marker_line(cfg.kernel_keys(kinds)) + (
                  "\n" + _hopper.marker_line(fa4_keys) if fa4_keys else ""),
              "@PAGED@": PAGED_MARKER, "@H@": str(cfg.num_q_heads),
              "@HKV@": str(cfg.num_kv_heads), "@D@": str(cfg.head_dim), "@PAGE@": str(cfg.page_size), "@DTYPE_CODE@": code,
              "@DTYPE_NAME@": cfg.dtype, "@IS_BF16@": str(is_bf16), "@TAG@": cfg.tag}
    for key, value in fields.items():
        body = body.replace(key, value)
    return body


_PRELUDE = r"""// Generated by mqa_byoc.compiler.paged.codegen: FA2 attention entries of a TVM PagedKVCache.
@MARKER@
@PAGED@
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

// mqa_byoc/native/fa2_paged.h (weak: a library exported without it fails here with a message)
extern "C" __attribute__((weak)) int mqa_byoc_fa2_paged_forward(
    const void* q, const int32_t* qo_indptr, const void* pages, const int32_t* page_indptr,
    const int32_t* page_values, const int32_t* last_page_len, void* out, float* lse, int64_t batch,
    int64_t total_q, int64_t nnz_pages, int64_t page_size, int64_t num_heads, int64_t num_heads_k,
    int64_t head_dim, const int64_t* q_stride, const int64_t* page_stride, const int64_t* o_stride,
    int is_bf16, float softmax_scale, int causal, int device_id, void* stream);
extern "C" __attribute__((weak)) int mqa_byoc_fa2_ragged_forward(
    const void* q, const void* k, const void* v, void* out, float* lse, const int32_t* qo_indptr,
    const int32_t* kv_indptr, int64_t batch, int64_t total_q, int64_t total_k, int64_t num_heads,
    int64_t num_heads_k, int64_t head_dim, const int64_t* q_stride, const int64_t* k_stride,
    const int64_t* v_stride, const int64_t* o_stride, int is_bf16, float softmax_scale, int causal,
    int device_id, void* stream);
extern "C" __attribute__((weak)) int mqa_byoc_fa2_paged_merge_state(
    void* v, float* s, const void* v_other, const float* s_other, int64_t rows, int64_t num_heads,
    int64_t head_dim, const int64_t* v_stride, const int64_t* s_stride, const int64_t* vo_stride,
    const int64_t* so_stride, int is_bf16, int device_id, void* stream);
extern "C" __attribute__((weak)) const char* mqa_byoc_fa2_paged_last_error(void);

namespace {
namespace paged_@TAG@ {
constexpr int64_t kHeads = @H@, kKvHeads = @HKV@, kHeadDim = @D@, kPageSize = @PAGE@;
constexpr int kIsBf16 = @IS_BF16@;

template <typename T>
T* ptr(const DLTensor* t) { return reinterpret_cast<T*>(static_cast<char*>(t->data) + t->byte_offset); }

void strides_of(const DLTensor* t, int64_t* st) {
  if (t->strides != nullptr) {
    for (int i = 0; i < t->ndim; ++i) st[i] = t->strides[i];
    return;
  }
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; --i) { st[i] = s; s *= t->shape[i]; }
}

void need(bool ok, const char* sym, const char* what) {
  if (!ok) TVM_FFI_THROW(ValueError) << sym << ": " << what;
}

// (rows, heads, D) of the cache's dtype on CUDA.
void check_rows(const DLTensor* t, int64_t heads, const char* sym, const char* name) {
  if (t->ndim != 3 || t->shape[1] != heads || t->shape[2] != kHeadDim) {
    TVM_FFI_THROW(ValueError) << sym << ": " << name << " must be (rows, " << heads << ", " << kHeadDim
                              << "), got " << t->ndim << "-D";
  }
  if (t->dtype.code != @DTYPE_CODE@ || t->dtype.bits != 16 || t->dtype.lanes != 1) {
    TVM_FFI_THROW(TypeError) << sym << ": " << name << " must be @DTYPE_NAME@";
  }
  need(t->device.device_type == kDLCUDA, sym, "tensors must be on a CUDA device");
}

void check_i32(const DLTensor* t, const char* sym, const char* name) {
  if (t->ndim != 1 || t->dtype.code != kDLInt || t->dtype.bits != 32) {
    TVM_FFI_THROW(TypeError) << sym << ": " << name << " must be a 1-D int32 tensor";
  }
}

void check_lse(const DLTensor* lse, int64_t rows, const char* sym) {
  int64_t st[2];
  need(lse->ndim == 2 && lse->shape[0] == rows && lse->shape[1] == kHeads, sym, "lse must be (rows, H)");
  need(lse->dtype.code == kDLFloat && lse->dtype.bits == 32, sym, "lse must be float32");
  strides_of(lse, st);
  need(st[1] == 1 && st[0] == kHeads, sym, "lse must be compact");
}

void check_rope(int64_t rotary_mode, const char* sym) {
  if (rotary_mode != 0) {
    TVM_FFI_THROW(ValueError) << sym << ": RoPE inline mode (rotary_mode=" << rotary_mode
                              << ") has no FA2 kernel; build the cache with rope_mode NORMAL or NONE";
  }
}

void raise_last(const char* sym, int rc) {
  if (rc != 0) TVM_FFI_THROW(RuntimeError) << sym << ": " << mqa_byoc_fa2_paged_last_error();
}

void require_linked(const char* sym) {
  if (&mqa_byoc_fa2_paged_forward == nullptr || &mqa_byoc_fa2_ragged_forward == nullptr ||
      &mqa_byoc_fa2_paged_merge_state == nullptr || &mqa_byoc_fa2_paged_last_error == nullptr) {
    TVM_FFI_THROW(RuntimeError) << sym << ": the paged FA2 object is not linked into this library; export "
                                << "it with mqa_byoc.export_library(executable, path)";
  }
}

// pages (num_pages, 2, H_kv, page_size, D); page list checks; then FA2.
int paged(const char* sym, DLTensor* q, DLTensor* qo_indptr, DLTensor* pages, DLTensor* page_indptr,
          DLTensor* page_values, DLTensor* length_info, DLTensor* output, DLTensor* lse, int64_t causal,
          int64_t rotary_mode, double sm_scale) {
  require_linked(sym);
  check_rope(rotary_mode, sym);
  check_rows(q, kHeads, sym, "q");
  check_rows(output, kHeads, sym, "output");
  need(output->shape[0] == q->shape[0], sym, "q and output row counts differ");
  if (pages->ndim != 5 || pages->shape[1] != 2 || pages->shape[2] != kKvHeads || pages->shape[4] != kHeadDim) {
    TVM_FFI_THROW(ValueError) << sym << ": pages must be (num_pages, 2, " << kKvHeads << ", page_size, "
                              << kHeadDim << ")";
  }
  need(pages->dtype.code == q->dtype.code && pages->dtype.bits == 16, sym, "pages must have q's dtype");
  if (pages->shape[3] != kPageSize) {
    TVM_FFI_THROW(ValueError) << sym << ": the cache has pages of " << pages->shape[3] << " tokens; this module "
                              << "was compiled (UseFlashAttentionForPagedKVCache) for page_size=" << kPageSize;
  }
  check_i32(page_indptr, sym, "page_indptr");
  check_i32(page_values, sym, "page_values");
  if (length_info->ndim != 1) {
    TVM_FFI_THROW(ValueError) << sym << ": length_info must be (batch,) last-page lengths; the sliding-window "
                              << "form (3, batch) stays on TVM's kernels";
  }
  check_i32(length_info, sym, "length_info");
  const int64_t batch = page_indptr->shape[0] - 1;
  need(length_info->shape[0] == batch, sym, "length_info and page_indptr disagree on the batch");
  const int64_t rows = q->shape[0];
  check_lse(lse, rows, sym);
  if (qo_indptr != nullptr) {
    check_i32(qo_indptr, sym, "qo_indptr");
    need(qo_indptr->shape[0] == batch + 1, sym, "qo_indptr and page_indptr disagree on the batch");
  } else {
    need(rows == batch, sym, "decode needs one query row per sequence");
  }
  int64_t qs[3], os[3], ps[5];
  strides_of(q, qs);
  strides_of(output, os);
  strides_of(pages, ps);
  const int dev = q->device.device_id;
  void* stream = TVMFFIEnvGetStream(kDLCUDA, dev);
  raise_last(sym, mqa_byoc_fa2_paged_forward(
      ptr<void>(q), qo_indptr ? ptr<int32_t>(qo_indptr) : nullptr, ptr<void>(pages), ptr<int32_t>(page_indptr),
      ptr<int32_t>(page_values), ptr<int32_t>(length_info), ptr<void>(output), ptr<float>(lse), batch, rows,
      page_values->shape[0], pages->shape[3], kHeads, kKvHeads, kHeadDim, qs, ps, os, kIsBf16,
      static_cast<float>(sm_scale), causal != 0, dev, stream));
  return 0;
}
}  // namespace paged_@TAG@
}  // namespace
"""

_PREFILL = r"""
namespace {
int run_@SYMBOL@(DLTensor* q, DLTensor* qo_indptr, DLTensor* pages, DLTensor* page_indptr, DLTensor* page_values,
                 DLTensor* length_info, DLTensor* k_rope_pos_offset, DLTensor* q_rope_position, DLTensor* output,
                 DLTensor* lse, int64_t causal, int64_t rotary_mode, double rope_scale, double rope_theta,
                 double sm_scale) {
  return paged_@TAG@::paged("@SYMBOL@", q, qo_indptr, pages, page_indptr, page_values, length_info, output, lse,
                            causal, rotary_mode, sm_scale);
}
}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run_@SYMBOL@);
"""

_DECODE = r"""
namespace {
int run_@SYMBOL@(DLTensor* q, DLTensor* pages, DLTensor* page_indptr, DLTensor* page_values, DLTensor* length_info,
                 DLTensor* k_rope_pos_offset, DLTensor* q_rope_position, DLTensor* output, DLTensor* lse,
                 int64_t rotary_mode, double rope_scale, double rope_theta, double sm_scale) {
  return paged_@TAG@::paged("@SYMBOL@", q, nullptr, pages, page_indptr, page_values, length_info, output, lse,
                            0, rotary_mode, sm_scale);
}
}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run_@SYMBOL@);
"""

_RAGGED = r"""
namespace {
int run_@SYMBOL@(DLTensor* q, DLTensor* qo_indptr, DLTensor* k, DLTensor* v, DLTensor* kv_indptr,
                 DLTensor* q_rope_position, DLTensor* k_rope_pos_offset, DLTensor* output, DLTensor* lse,
                 int64_t causal, int64_t rotary_mode, double rope_scale, double rope_theta, double sm_scale) {
  using namespace paged_@TAG@;
  const char* sym = "@SYMBOL@";
  require_linked(sym);
  check_rope(rotary_mode, sym);
  check_rows(q, kHeads, sym, "q");
  check_rows(k, kKvHeads, sym, "k");
  check_rows(v, kKvHeads, sym, "v");
  check_rows(output, kHeads, sym, "output");
  check_i32(qo_indptr, sym, "qo_indptr");
  check_i32(kv_indptr, sym, "kv_indptr");
  need(qo_indptr->shape[0] == kv_indptr->shape[0], sym, "qo_indptr and kv_indptr disagree on the batch");
  need(output->shape[0] == q->shape[0] && v->shape[0] == k->shape[0], sym, "inconsistent row counts");
  check_lse(lse, q->shape[0], sym);
  int64_t qs[3], ks[3], vs[3], os[3];
  strides_of(q, qs);
  strides_of(k, ks);
  strides_of(v, vs);
  strides_of(output, os);
  const int dev = q->device.device_id;
  void* stream = TVMFFIEnvGetStream(kDLCUDA, dev);@FA4_CALL@
  raise_last(sym, mqa_byoc_fa2_ragged_forward(
      ptr<void>(q), ptr<void>(k), ptr<void>(v), ptr<void>(output), ptr<float>(lse), ptr<int32_t>(qo_indptr),
      ptr<int32_t>(kv_indptr), qo_indptr->shape[0] - 1, q->shape[0], k->shape[0], kHeads, kKvHeads, kHeadDim,
      qs, ks, vs, os, kIsBf16, static_cast<float>(sm_scale), causal != 0, dev, stream));
  return 0;
}
}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run_@SYMBOL@);
"""

_MERGE = r"""
namespace {
// TVM's merge_state (v, s, v_other, s_other): in place into v (rows, H, D) and s (rows, H), every head.
int run_@SYMBOL@(DLTensor* v, DLTensor* s, DLTensor* v_other, DLTensor* s_other) {
  using namespace paged_@TAG@;
  const char* sym = "@SYMBOL@";
  require_linked(sym);
  check_rows(v, kHeads, sym, "v");
  check_rows(v_other, kHeads, sym, "v_other");
  const int64_t rows = v->shape[0];
  need(v_other->shape[0] == rows, sym, "v and v_other row counts differ");
  for (const DLTensor* t : {s, s_other}) {
    need(t->ndim == 2 && t->shape[0] == rows && t->shape[1] == kHeads, sym, "s and s_other must be (rows, H)");
    need(t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1, sym, "s and s_other must be float32");
    need(t->device.device_type == kDLCUDA, sym, "tensors must be on a CUDA device");
  }
  int64_t vs[3], os[3], ss[2], sos[2];
  strides_of(v, vs);
  strides_of(v_other, os);
  strides_of(s, ss);
  strides_of(s_other, sos);
  const int dev = v->device.device_id;
  void* stream = TVMFFIEnvGetStream(kDLCUDA, dev);
  raise_last(sym, mqa_byoc_fa2_paged_merge_state(ptr<void>(v), ptr<float>(s), ptr<void>(v_other), ptr<float>(s_other),
                                                 rows, kHeads, kHeadDim, vs, ss, os, sos, kIsBf16, dev, stream));
  return 0;
}
}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(@SYMBOL@, run_@SYMBOL@);
"""

_FA4_RAGGED_DECL = r"""
// FA4's sm90 var-len forward (hopper provider; flash-attn-4, compiled by mqa_byoc.kernels.hopper_aot) and
// native/fa4_ragged.cu around it. Weak: a library exported without them fails with a hint.
extern "C" __attribute__((weak)) int __tvm_ffi_@FA4N@(void* self, const TVMFFIAny* args, int32_t num_args,
                                                       TVMFFIAny* result);
extern "C" __attribute__((weak)) int __tvm_ffi_@FA4C@(void* self, const TVMFFIAny* args, int32_t num_args,
                                                       TVMFFIAny* result);
@RAGGED_DECL@
extern "C" __attribute__((weak)) const char* mqa_byoc_fa2_last_error(void);

namespace {
namespace paged_fa4 {
// FA4's TMA loads need 16-byte aligned operands and strides (multiples of 8 elements) within int32.
bool tma_ready(const DLTensor* const* ts, const int64_t* const* strides) {
  for (int i = 0; i < 4; ++i) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(static_cast<const char*>(ts[i]->data) + ts[i]->byte_offset);
    if ((p & 15) != 0 || ts[i]->shape[0] > INT32_MAX) return false;
    for (int d = 0; d < 2; ++d) {
      if (strides[i][d] % 8 != 0 || strides[i][d] > INT32_MAX) return false;
    }
  }
  return true;
}
}  // namespace paged_fa4
}  // namespace
"""

_FA4_RAGGED_CALL = r"""
  {
    const DLTensor* ts[4] = {q, k, v, output};
    const int64_t* st[4] = {qs, ks, vs, os};
    if (paged_fa4::tma_ready(ts, st)) {
      auto* fa4 = causal != 0 ? &__tvm_ffi_@FA4C@ : &__tvm_ffi_@FA4N@;
      if (fa4 == nullptr || &mqa_byoc_fa4_ragged_forward == nullptr || &mqa_byoc_fa2_last_error == nullptr) {
        TVM_FFI_THROW(RuntimeError) << sym << ": the FA4 var-len objects (@FA4N@, @FA4C@, fa4_ragged.cu) are not "
                                    << "linked into this library; export it with mqa_byoc.export_library(executable, "
                                    << "path), or build with provider=\"native\"";
      }
      const int rc = mqa_byoc_fa4_ragged_forward(
          fa4, ptr<void>(q), ptr<void>(k), ptr<void>(v), ptr<void>(output), ptr<float>(lse), ptr<int32_t>(qo_indptr),
          ptr<int32_t>(kv_indptr), qo_indptr->shape[0] - 1, q->shape[0], k->shape[0], kHeads, kKvHeads, kHeadDim,
          qs, ks, vs, os, kIsBf16, sm_scale, dev, stream);
      if (rc == -1) throw ::tvm::ffi::details::MoveFromSafeCallRaised();
      if (rc != 0) TVM_FFI_THROW(RuntimeError) << sym << ": FA4 var-len: " << mqa_byoc_fa2_last_error();
      return 0;
    }
  }"""

_BODIES = {"prefill": _PREFILL, "decode": _DECODE, "ragged": _RAGGED, "merge": _MERGE}
