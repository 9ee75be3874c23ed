"""The ``hopper`` provider's part of a native wrapper: FA4's sm90 kernel for prefill, native's for decode.

A native wrapper emitted for the hopper provider (:func:`mqa_byoc.compiler.codegen.native.emit_native_source`
with ``hopper=True``) calls the FA4 object of its :class:`~mqa_byoc.kernels.hopper.HopperKernelKey`
when the call has enough query rows to fill the GPU, and FA2 (the native provider's dispatcher, with its
decode kernels) otherwise: FA4's sm90 forward has no split-KV, so at decode one CTA per K/V head would
read the whole cache alone. :func:`fa4_rejection` says why a site stays on FA2 altogether.

This module does not import TVM.
"""

from __future__ import annotations

from mqa_byoc.compiler.graph.spec import AttentionSpec
from mqa_byoc.kernels import hopper
from mqa_byoc.kernels.decode_rule import decode_kernel_serves

#: FA4 runs a call when it has at least this many query tiles (batch x K/V heads x tiles of packed
#: query rows): about half the SMs of an H100/H200 (132), since FA4's sm90 kernel has no split-KV and
#: fewer tiles leave SMs idle. An estimate: decode (one tile per K/V head) is measured faster on FA2's
#: split-KV (benchmarks/results/2026-11-30-attention-hopper.md), the crossover for short prefill chunks
#: is not measured.
MIN_FA4_TILES = 66
#: query rows per tile of the FA4 kernels we build (tile_m of flash-attn-4's sm90 config, hdim 64/128)
FA4_TILE_M = 128


def describe_kernel(provider: str, *, dtype, head_dim, num_q_heads, num_kv_heads, causal, window,
                    var_len: bool = False, options=None, sinks: bool = False, softcap: bool = False,
                    arch: str | None = None) -> str:
    """What an offloaded site runs on with ``provider`` (the ``kernel`` of ``offload_report``) and the
    kernel options the library is built with (:class:`~.kernel_options.KernelOptions`, None: defaults);
    ``sinks``: attention with sinks (FA2 and our sink epilogue); ``softcap``: logit soft-capping (FA2's
    soft-capping kernel families)."""
    from mqa_byoc.compiler.kernel_options import KernelOptions

    options = KernelOptions.of(options)
    if provider == "python":
        if softcap:
            return ("soft-capped attention through the python provider: flash-attn's FA2 with its softcap, or "
                    "with the torch backend plain PyTorch ops in float32 (PyTorch's FA2 has no soft-capping)")
        return "FA2 through the python provider (flash-attn or PyTorch at run time)" + (
            "; the sinks applied to its output by its log-sum-exp" if sinks else "")
    fa2_split = "FA2 split-KV" + (" with FA2's combine" if options.split_combine == "fa2" else "")
    own = options.decode_kernel == "auto" and decode_kernel_serves(head_dim, num_q_heads, num_kv_heads, arch)
    decode = "our grouped-query decode kernel" if own else fa2_split
    if softcap:
        out = (f"FA2's soft-capping kernel families (decode: {fa2_split}; our decode kernel does not soft-cap), "
               "linked")
        return out + (" (hopper provider: " + SOFTCAP_ON_FA2 + ")" if provider == "hopper" else "")
    if sinks:
        out = f"FA2 with its log-sum-exp (decode: {decode}) and our sink epilogue kernel, linked"
        return out + (" (hopper provider: FA4's sink path is not compiled ahead of time; FA2 for sinks)"
                      if provider == "hopper" else "")
    fa2 = "FA2 var-len forward" if var_len else f"FA2 (decode: {decode})"
    if provider != "hopper":
        return fa2 + ", linked"
    why = _rejection(dtype, head_dim, head_dim)
    if var_len:
        if why or window:
            return f"{fa2}, linked (hopper provider: no FA4 var-len object for " + (why or "a sliding window") + ")"
        if options.hopper_fa4 == "never":
            return f"{fa2}, linked (hopper provider with the kernel option hopper_fa4=never)"
        group = num_q_heads // num_kv_heads
        return (f"FA4 sm90 var-len forward (flash-attn-4 {hopper.FA4_VERSION}, group {group}, "
                f"{'causal' if causal else 'no mask'}) when the operands suit its TMA loads"
                + (" and q and K/V share one seqstart" if causal else "") + f"; otherwise {fa2}, linked")
    if why:
        return f"{fa2}, linked (hopper provider: no FA4 object for {why})"
    if options.hopper_fa4 == "never":
        return f"{fa2}, linked (hopper provider with the kernel option hopper_fa4=never)"
    group = num_q_heads // num_kv_heads
    mask = "local" if window else ("causal" if causal else "none")
    if options.hopper_fa4 == "always":
        return (f"FA4 sm90 (flash-attn-4 {hopper.FA4_VERSION}, group {group}, {mask}) for every call it can "
                f"compute (kernel option hopper_fa4=always); otherwise FA2 (decode: {decode})")
    out = (f"FA4 sm90 (flash-attn-4 {hopper.FA4_VERSION}, group {group}, {mask}) for calls with >= "
           f"{MIN_FA4_TILES} query tiles")
    return out + f"; otherwise FA2 (decode: {decode})"


def _rejection(dtype, head_dim, head_dim_v) -> str | None:
    if dtype not in ("float16", "bfloat16"):
        return f"dtype {dtype}"
    if head_dim not in hopper.HEAD_DIMS or head_dim_v != head_dim:
        return f"head dim {head_dim}/{head_dim_v} (FA4 objects are built for {hopper.HEAD_DIMS})"
    return None


#: why the hopper provider runs soft-capped attention on FA2
SOFTCAP_ON_FA2 = ("soft-capping on FA2: flash-attn-4 compiles the cap into its kernel as a score modification, "
                  "one object per cap value, not built ahead of time; Gemma 2's head dim 256 has no FA4 object either")


def fa4_rejection(spec: AttentionSpec) -> str | None:
    """Why the hopper provider runs this attention on FA2 only; None when FA4 can take its prefill."""
    if spec.softcap > 0:
        return SOFTCAP_ON_FA2
    if spec.sinks_dtype is not None:
        return "attention sinks (FA4's sink path is not compiled ahead of time: FA2 and our sink epilogue)"
    return _rejection(spec.dtype, spec.head_dim, spec.head_dim_v)


def kernel_key(spec: AttentionSpec) -> hopper.HopperKernelKey | None:
    """The FA4 object a site needs, or None when it stays on FA2 (:func:`fa4_rejection`)."""
    if fa4_rejection(spec) is not None:
        return None
    return hopper.HopperKernelKey(
        spec.dtype, int(spec.head_dim), int(spec.num_q_heads // spec.num_kv_heads),
        hopper.mask_kind(bool(spec.causal), int(spec.window_left), int(spec.window_right)),
    )


def decode_key(spec: AttentionSpec) -> hopper.HopperKernelKey | None:
    """The "splitkv" FA4 object of the split-KV decode (``native/fa4_decode.cu``): sites without a
    sliding window (a causal mask lets a single query row see every key). It runs only with
    the kernel option ``hopper_fa4="always"`` (:mod:`.kernel_options`): on the H200 it is 1.1-1.7x slower than FA2's split-KV (one query
    row per CTA leaves FA4's wgmma pipeline mostly idle), so decode stays on FA2 by default."""
    key = kernel_key(spec)
    if key is None or key.mask == "local":
        return None
    return hopper.HopperKernelKey(key.dtype, key.head_dim, key.group, "splitkv")


def fragments(key: hopper.HopperKernelKey | None, decode: hopper.HopperKernelKey | None = None) -> dict[str, str]:
    """Template fields of the wrapper: the FA4 declarations, marker and calls (empty for FA2 only)."""
    if key is None:
        return {"@HOPPER_MARKER@": "", "@HOPPER_DECL@": "", "@HOPPER_CALL@": ""}
    # FA2's windows use -1 for "unbounded" and causal means a right window of 0; FA4 takes both bounds
    window_args = ("\n  args[5] = kWindowLeft < 0 ? unbounded : static_cast<int64_t>(kWindowLeft);"
                   "\n  args[6] = kCausal ? 0 : (kWindowRight < 0 ? unbounded : static_cast<int64_t>(kWindowRight));"
                   if key.mask == "local" else "")
    decl = _DECL.replace("@FA4SYM@", key.symbol).replace("@NARGS@", str(key.num_args)).replace(
        "@WINDOW_ARGS@", window_args).replace("@MIN_TILES@", str(MIN_FA4_TILES)).replace(
        "@TILE_M@", str(FA4_TILE_M)).replace("@CAUSAL_CHECK@", "true" if key.mask != "none" else "false")
    call = _CALL
    if decode is not None:
        decl += _DECODE_DECL.replace("@DECSYM@", decode.symbol)
        call = _DECODE_CALL + call
    return {
        "@HOPPER_MARKER@": hopper.marker_line([key] + ([decode] if decode is not None else [])),
        "@HOPPER_DECL@": decl,
        "@HOPPER_CALL@": call,
    }


_DECL = r"""
// FA4's sm90 forward (flash-attn-4, compiled by mqa_byoc.kernels.hopper_aot): a TVM-FFI function of
// (q, k, v, out, scale[, window_left, window_right]) over (B, S, N, D) tensors; it launches on TVM's
// current stream. Weak, like the FA2 dispatcher: a library exported without it fails with a hint.
extern "C" __attribute__((weak)) int __tvm_ffi_@FA4SYM@(void* self, const TVMFFIAny* args, int32_t num_args,
                                                         TVMFFIAny* result);
constexpr int64_t kFa4MinTiles = @MIN_TILES@;
constexpr int64_t kFa4TileM = @TILE_M@;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The library's hopper_fa4 kernel option (mqa_byoc.build(kernel_options=...), compiled into it as the
// constant of fa2_dispatch.h's mqa_byoc_kernel_options; none: the default): 0 "auto" (the tile rule below,
// decode on FA2), 1 "always" (every call FA4 can compute correctly, batch-1 decode through fa4_decode.cu:
// tests, benchmarks), 2 "never" (FA2 only).
extern "C" __attribute__((weak, visibility("hidden"))) const struct mqa_byoc_fa4_options_view {
  int decode_kernel, decode_merge, split_combine, hopper_fa4;
} mqa_byoc_library_kernel_options;

int fa4_mode() { return &mqa_byoc_library_kernel_options != nullptr ? mqa_byoc_library_kernel_options.hopper_fa4 : 0; }

// FA4 takes the call when it has a GPU's worth of query tiles (pack_gqa: the query heads of a K/V head
// share a tile); its TMA loads need 16-byte aligned data and strides. Otherwise FA2 (split-KV for decode).
bool use_fa4(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, const DLTensor* const* ts,
             const int64_t* const* strides) {
  const int mode = fa4_mode();
  if (mode == 2) return false;
  const int64_t rows = seqlen_q * (kHeads / kKvHeads);
  const int64_t tiles = batch * kKvHeads * ((rows + kFa4TileM - 1) / kFa4TileM);
  if (mode == 0 && (tiles < kFa4MinTiles || rows <= kFa4TileM)) return false;
  // a causal query row with no key (S_q > S_kv) is FA2's case: it writes zeros there
  if (@CAUSAL_CHECK@ && seqlen_q > seqlen_k) return false;
  if (seqlen_q > INT32_MAX || seqlen_k > INT32_MAX || batch > INT32_MAX) return false;
  for (int i = 0; i < 4; ++i) {
    if (!aligned16(data_of(ts[i]))) return false;
    for (int d = 0; d < 3; ++d) {
      if (strides[i][d] % 8 != 0 || strides[i][d] > INT32_MAX) return false;
    }
  }
  return true;
}

// unbounded: a window bound no row reaches (S_q + S_kv)
void run_fa4(DLTensor* const* ts, int64_t* const* shapes, int64_t* const* strides, int64_t unbounded) {
  if (&__tvm_ffi_@FA4SYM@ == nullptr) {
    TVM_FFI_THROW(RuntimeError)
        << kSymbol << ": the FA4 sm90 object @FA4SYM@ is not linked into this library. Export it with "
        << "mqa_byoc.export_library(executable, path), or build with provider=\"native\".";
  }
  DLTensor views[4];
  for (int i = 0; i < 4; ++i) {  // (B, S, N, D) views of the operands: BNSH ones through their strides
    views[i] = *ts[i];
    views[i].data = const_cast<void*>(data_of(ts[i]));
    views[i].byte_offset = 0;
    views[i].shape = shapes[i];
    views[i].strides = strides[i];
  }
  tvm::ffi::AnyView args[@NARGS@];
  for (int i = 0; i < 4; ++i) args[i] = &views[i];
  args[4] = static_cast<double>(kScale);@WINDOW_ARGS@
  (void)unbounded;
  tvm::ffi::Any result;
  TVM_FFI_CHECK_SAFE_CALL(__tvm_ffi_@FA4SYM@(nullptr, reinterpret_cast<const TVMFFIAny*>(args), @NARGS@,
                                             reinterpret_cast<TVMFFIAny*>(&result)));
}
"""

_CALL = r"""
  {
    DLTensor* ts[4] = {q, k, v, out};
    int64_t* shapes[4] = {qn, kn, vn, on};
    int64_t* strides[4] = {qs, ks, vs, os};
    if (use_fa4(batch, seqlen_q, seqlen_k, ts, strides)) {
      run_fa4(ts, shapes, strides, seqlen_q + seqlen_k);
      return 0;
    }
  }"""

_DECODE_DECL = r"""
// Split-KV decode around FA4 (native/fa4_decode.cu) with the "splitkv" object: batch 1, one query row.
extern "C" __attribute__((weak)) int __tvm_ffi_@DECSYM@(void* self, const TVMFFIAny* args, int32_t num_args,
                                                         TVMFFIAny* result);
extern "C" __attribute__((weak)) int mqa_byoc_fa4_decode(
    int (*fa4)(void*, const TVMFFIAny*, int32_t, TVMFFIAny*), const void* q, int64_t q_head_stride, const void* k,
    const int64_t* k_stride, const void* v, const int64_t* v_stride, void* out, int64_t out_head_stride,
    int64_t s_kv, int64_t num_heads, int64_t num_heads_k, int64_t head_dim, int is_bf16, double scale, int num_sms,
    int device_id, void* stream);
extern "C" __attribute__((weak)) int mqa_byoc_fa2_num_sms(int device_id);

bool use_fa4_decode(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, const DLTensor* k, const DLTensor* v,
                    const int64_t* ks, const int64_t* vs) {
  // measured slower than FA2's split-KV on the H200 (benchmarks/results/2026-11-30-attention-hopper-*):
  // only the kernel option hopper_fa4="always" takes it
  if (fa4_mode() != 1 || batch != 1 || seqlen_q != 1 || seqlen_k < 1 || seqlen_k > INT32_MAX) return false;
  if (!aligned16(data_of(k)) || !aligned16(data_of(v))) return false;
  for (int d = 1; d < 3; ++d) {
    if (ks[d] % 8 != 0 || vs[d] % 8 != 0) return false;
  }
  return true;
}

void run_fa4_decode(DLTensor* q, DLTensor* k, DLTensor* v, DLTensor* out, const int64_t* qs, const int64_t* ks,
                    const int64_t* vs, const int64_t* os, int64_t seqlen_k, int dev) {
  if (&__tvm_ffi_@DECSYM@ == nullptr || &mqa_byoc_fa4_decode == nullptr || &mqa_byoc_fa2_num_sms == nullptr) {
    TVM_FFI_THROW(RuntimeError)
        << kSymbol << ": the FA4 split-KV decode (@DECSYM@, fa4_decode.cu) is not linked into this library. "
        << "Export it with mqa_byoc.export_library(executable, path), or build with provider=\"native\".";
  }
  const int64_t kst[2] = {ks[1], ks[2]}, vst[2] = {vs[1], vs[2]};
  int rc = mqa_byoc_fa4_decode(&__tvm_ffi_@DECSYM@, data_of(q), qs[2], data_of(k), kst, data_of(v), vst,
                               const_cast<void*>(data_of(out)), os[2], seqlen_k, kHeads, kKvHeads, kHeadDim, kIsBf16,
                               static_cast<double>(kScale), mqa_byoc_fa2_num_sms(dev), dev,
                               TVMFFIEnvGetStream(kDLCUDA, dev));
  if (rc == -1) throw ::tvm::ffi::details::MoveFromSafeCallRaised();
  if (rc != 0) TVM_FFI_THROW(RuntimeError) << kSymbol << ": FA4 split-KV decode: " << mqa_byoc_fa2_last_error();
}
"""

_DECODE_CALL = r"""
  if (use_fa4_decode(batch, seqlen_q, seqlen_k, k, v, ks, vs)) {
    run_fa4_decode(q, k, v, out, qs, ks, vs, os, seqlen_k, dev);
    return 0;
  }"""
