// Error hooks the FA4 objects (compiled by mqa_byoc.kernels.hopper_aot) call when a CUDA call fails.
//
// The CuTe DSL declares them in its CuteDSLRuntime.h and defines them in its shared runtime library
// (43 MB). The objects need nothing else from that library, so the exported module carries these
// small definitions instead and needs no CuTe DSL library at run time. Each turns the failure into a
// TVM-FFI error through the setter the object passes (TVMFFIErrorSetRaisedFromCStrParts).
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

extern "C" {

typedef void (*mqa_byoc_set_error_fn)(const char* kind, const char** parts, int32_t num_parts);

__attribute__((visibility("default"))) void CuteDSLRT_TVMFFISetRaisedCudaError(mqa_byoc_set_error_fn set_error,
                                                                              int32_t code) {
  char head[96];
  snprintf(head, sizeof(head), "FA4 sm90 kernel: CUDA error %d (", static_cast<int>(code));
  const char* parts[] = {head, cudaGetErrorName(static_cast<cudaError_t>(code)), "): ",
                         cudaGetErrorString(static_cast<cudaError_t>(code))};
  set_error("RuntimeError", parts, 4);
}

__attribute__((visibility("default"))) void CuteDSLRT_TVMFFISetRaisedCudaLaunchError(
    mqa_byoc_set_error_fn set_error, int32_t grid_x, int32_t grid_y, int32_t grid_z, int32_t block_x,
    int32_t block_y, int32_t block_z, int32_t block_threads, int64_t dynamic_smem, int32_t device,
    int32_t max_threads, int32_t max_block_x, int32_t max_block_y, int32_t max_block_z, int32_t max_grid_x,
    int32_t max_grid_y, int32_t max_grid_z, int32_t max_smem, int32_t max_smem_optin, const char* violation,
    const char* source_file, int32_t source_line, int32_t source_col, int32_t source_end_col) {
  char detail[512];
  snprintf(detail, sizeof(detail),
           "FA4 sm90 kernel launch rejected on device %d: grid (%d, %d, %d), block (%d, %d, %d) = %d threads, "
           "%lld B shared memory; limits: %d threads, grid (%d, %d, %d), block (%d, %d, %d), %d B shared "
           "(%d opt-in) at %s:%d:%d-%d: ",
           device, grid_x, grid_y, grid_z, block_x, block_y, block_z, block_threads,
           static_cast<long long>(dynamic_smem), max_threads, max_grid_x, max_grid_y, max_grid_z, max_block_x,
           max_block_y, max_block_z, max_smem, max_smem_optin, source_file ? source_file : "?", source_line,
           source_col, source_end_col);
  const char* parts[] = {detail, violation ? violation : "unknown violation"};
  set_error("RuntimeError", parts, 2);
}

}  // extern "C"
