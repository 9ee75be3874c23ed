// Stand-in for TVM's <tvm/support/serializer.h> (not in the apache-tvm wheel): see io.h beside it.
#ifndef MQA_BYOC_TVM_SHIM_SUPPORT_SERIALIZER_H_
#define MQA_BYOC_TVM_SHIM_SUPPORT_SERIALIZER_H_

#include <tvm/support/io.h>

#endif  // MQA_BYOC_TVM_SHIM_SUPPORT_SERIALIZER_H_
