// The decode kernels the dispatcher calls, compiled per arch into one object (mqa_byoc.kernels.build
// .support_object): our grouped-query decode kernel, and the chunk lengths + combine of the FA2 chunked
// decode that serves the groupings it does not; and the sink epilogue of attention with sinks.
#include "gqa_decode.cu"
#include "sink_epilogue.cu"
#include "split_kv_combine.cu"
