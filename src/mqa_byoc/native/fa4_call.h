// Calling an FA4 object (a TVM-FFI function compiled by mqa_byoc.kernels.hopper_aot) from C++: DLTensor
// views of raw device pointers and the TVM-FFI argument that passes one. Shared by fa4_decode.cu and
// fa4_ragged.cu.
#pragma once
#include <dlpack/dlpack.h>
#include <stdint.h>
#include <tvm/ffi/c_api.h>

typedef int (*mqa_byoc_ffi_fn)(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result);

// A view of `data` on CUDA device `device_id` (shape and strides in elements, kept by the caller).
inline DLTensor mqa_byoc_cuda_view(void* data, DLDataType dtype, int device_id, int ndim, int64_t* shape,
                                   int64_t* strides) {
  DLTensor t;
  t.data = data;
  t.device = DLDevice{kDLCUDA, device_id};
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = 0;
  return t;
}

inline TVMFFIAny mqa_byoc_tensor_arg(DLTensor* t) {
  TVMFFIAny a;
  a.type_index = kTVMFFIDLTensorPtr;
  a.zero_padding = 0;
  a.v_ptr = t;
  return a;
}

inline TVMFFIAny mqa_byoc_float_arg(double v) {
  TVMFFIAny a;
  a.type_index = kTVMFFIFloat;
  a.zero_padding = 0;
  a.v_float64 = v;
  return a;
}

inline TVMFFIAny mqa_byoc_none_result() {
  TVMFFIAny a;
  a.type_index = kTVMFFINone;
  a.zero_padding = 0;
  a.v_int64 = 0;
  return a;
}
