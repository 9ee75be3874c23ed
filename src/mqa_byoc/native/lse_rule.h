// TVM's base-2 log-sum-exp from a flash-attention kernel's natural-log one, shared by fa2_paged.cu and
// fa4_ragged.cu. A row without keys (+inf or NaN from the kernel) gets -5e4, TVM's own "empty" value, so
// that TVM's merge of attention states gives that part no weight.
#pragma once

__host__ __device__ inline float mqa_byoc_lse_base2(float v) {
  return (isinf(v) || isnan(v)) ? -5e4f : v * 1.4426950408889634f;  // log2(e)
}
