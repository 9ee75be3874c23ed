#pragma once
#include <tuple>
#include <ATen/cuda/CUDAGeneratorImpl.h>
namespace at { namespace cuda { namespace philox {
__host__ __device__ inline std::tuple<uint64_t, uint64_t> unpack(const at::PhiloxCudaState& s) {
  return std::make_tuple(s.seed_, s.offset_);
}
}}}  // namespace at::cuda::philox
