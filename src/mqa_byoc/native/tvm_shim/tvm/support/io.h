// Stand-in for TVM's <tvm/support/io.h>, which the apache-tvm wheel's <tvm/runtime/tensor.h> includes
// but does not ship. Only declarations: tensor.h's (de)serialization helpers name support::Stream in
// inline functions that code built against this shim never calls (so nothing here is ever defined).
#ifndef MQA_BYOC_TVM_SHIM_SUPPORT_IO_H_
#define MQA_BYOC_TVM_SHIM_SUPPORT_IO_H_

#include <cstddef>

namespace tvm {
namespace support {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual size_t Read(void* ptr, size_t size) = 0;
  virtual size_t Write(const void* ptr, size_t size) = 0;
  template <typename T>
  void Write(const T& value);
  template <typename T>
  bool Read(T* out);
  template <typename T>
  void WriteArray(const T* data, size_t num_elems);
  template <typename T>
  bool ReadArray(T* data, size_t num_elems);
};

}  // namespace support
}  // namespace tvm

#endif  // MQA_BYOC_TVM_SHIM_SUPPORT_IO_H_
