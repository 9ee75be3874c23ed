#pragma once
// Stand-in for ATen's Philox state: inference never uses dropout, the struct only has to exist.
#include <cstdint>
namespace at {
struct PhiloxCudaState {
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};
}  // namespace at
