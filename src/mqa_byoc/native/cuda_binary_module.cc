// A "cuda" runtime module holding compiled device code (fatbin), made from one holding CUDA source.
//
// On a machine without the CUDA driver TVM's codegen keeps its generated kernels as CUDA source in a
// "cuda" module (format "cuda") and the runtime that loads the exported library compiles them through
// the Python hook tvm_callback_cuda_compile. The runtime loads a "cuda" module by reading
// [format][function table][code] from its saved bytes and takes "fatbin" / "cubin" / "ptx" code as it
// is. mqa_byoc.compiler.cuda_binary compiles the source with nvcc and calls the global function
// registered here, which keeps the module's saved function table and replaces its format and code, so
// the exported library loads with TVM's C++ runtime alone. The module made here is for saving only
// (export_library); it is not runnable in this process.
//
// Built with g++ against tvm-ffi's headers and library; nothing of TVM's own.

#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

using tvm::ffi::Bytes;
using tvm::ffi::Function;
using tvm::ffi::Module;
using tvm::ffi::ModuleObj;
using tvm::ffi::Optional;
using tvm::ffi::String;

uint64_t read_u64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void append_sized(std::string* out, const char* data, uint64_t n) {
  out->append(reinterpret_cast<const char*>(&n), sizeof(n));
  out->append(data, n);
}

class BinaryCudaModule : public ModuleObj {
 public:
  BinaryCudaModule(std::string saved, std::string fmt, std::string code)
      : saved_(std::move(saved)), fmt_(std::move(fmt)), code_(std::move(code)) {}

  const char* kind() const final { return "cuda"; }
  int GetPropertyMask() const final { return Module::kBinarySerializable; }
  Optional<Function> GetFunction(const String&) final { return std::nullopt; }
  Bytes SaveToBytes() const final { return Bytes(saved_.data(), saved_.size()); }
  String InspectSource(const String& format) const final {
    return format == fmt_ ? String(code_.data(), code_.size()) : String();
  }

 private:
  std::string saved_, fmt_, code_;
};

// `source_module`: a "cuda" module whose saved code is its CUDA source; `code`: that source compiled
// (`fmt`: "fatbin" or "cubin"). Throws when the saved bytes are not [fmt "cuda"][table][source].
Module binary_cuda_module(Module source_module, Bytes code, String fmt) {
  ModuleObj* m = const_cast<ModuleObj*>(source_module.operator->());
  if (std::strcmp(m->kind(), "cuda") != 0) {
    TVM_FFI_THROW(ValueError) << "expected a cuda module, got " << m->kind();
  }
  const Bytes saved = m->SaveToBytes();
  const String source = m->InspectSource("cuda");
  const char* p = saved.data();
  const uint64_t n = saved.size(), src_n = source.size();
  // [u64 4]["cuda"] ... [u64 len(source)][source]
  if (n < 8 + 4 + 8 + src_n || read_u64(p) != 4 || std::memcmp(p + 8, "cuda", 4) != 0 ||
      read_u64(p + n - src_n - 8) != src_n || std::memcmp(p + n - src_n, source.data(), src_n) != 0) {
    TVM_FFI_THROW(ValueError) << "the cuda module does not hold CUDA source in the layout this TVM saves "
                              << "([format][function table][code]); it may hold compiled code already";
  }
  std::string out;
  append_sized(&out, fmt.data(), fmt.size());
  out.append(p + 12, n - 12 - 8 - src_n);  // the function table, as saved
  append_sized(&out, code.data(), code.size());
  auto node = tvm::ffi::make_object<BinaryCudaModule>(std::move(out), std::string(fmt),
                                                      std::string(code.data(), code.size()));
  return Module(node);
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  tvm::ffi::reflection::GlobalDef().def("mqa_byoc.binary_cuda_module", binary_cuda_module);
}
