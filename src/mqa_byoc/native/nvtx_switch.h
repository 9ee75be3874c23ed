// The one run-time switch a library of ours reads: MQA_BYOC_NVTX, a profiling aid that changes no kernel.
//
// Set, non-empty and not 0/false/off/no (case and surrounding blanks ignored; the rule of
// mqa_byoc.runtime.backends.nvtx_requested too): our host calls wrap their launches in NVTX ranges
// (NVTX3, header-only from the CUDA toolkit; without a tool such as nsys attached a push/pop is a call
// into an empty stub). Read once, at the first call; unset, the cost is one check of a static flag.
// Included by fa2_dispatch.cc and disco_nccl.cc (each keeps its flag in its own library).

#ifndef MQA_BYOC_NVTX_SWITCH_H_
#define MQA_BYOC_NVTX_SWITCH_H_

#include <cctype>
#include <cstdlib>
#include <string>

namespace mqa_byoc {

inline bool nvtx_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("MQA_BYOC_NVTX");
    if (v == nullptr) return false;
    std::string s(v);
    s.erase(0, s.find_first_not_of(" \t"));
    s.erase(s.find_last_not_of(" \t") + 1);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return !(s.empty() || s == "0" || s == "false" || s == "off" || s == "no");
  }();
  return enabled;
}

}  // namespace mqa_byoc

#endif  // MQA_BYOC_NVTX_SWITCH_H_
