// mqa_byoc's NCCL collectives for TVM's disco runtime.
//
// The apache-tvm wheel ships disco (libtvm_runtime_extra.so) but no NCCL library: disco's builtins
// (`runtime.disco.allreduce`, ...) forward every collective to `runtime.disco.<ccl>.<name>`, and with
// `ccl = "nccl"` nothing answers. This library supplies those names, built against the NCCL of the
// `nvidia-nccl-cu13` wheel. Loaded once in a process (see mqa_byoc.tp.ccl), it serves the controller
// (`init_ccl`) and every worker thread of that process.
//
// Contract (what disco's builtins and Session::InitCCL call):
//   init_ccl(Session, Shape device_ids)                  controller: one NCCL id, sent to all workers
//   init_ccl_per_worker(Shape device_ids, Bytes id)      worker: device device_ids[local_worker_id],
//                                                        the world communicator and, with several
//                                                        groups, one communicator per group
//   allreduce(send, int kind, bool in_group, recv)       kind: sum, prod, min, max, avg = 0..4
//   allgather(send, in_group, recv)
//   broadcast_from_worker0(Optional send, in_group, recv)
//   scatter_from_worker0(Optional send, in_group, recv)  send split evenly, shard i to rank i
//   gather_to_worker0(send, in_group, Optional recv)
//   recv_from_worker0(buf), send_to_next_group(buf), recv_from_prev_group(buf),
//   send_to_worker(buf, int to), recv_from_worker(buf, int from), sync_worker()
// "Worker 0" of a group is its first worker (worker_id % group_size == 0). Collectives are enqueued on
// the stream TVM's CUDA runtime has set for the thread (`runtime.get_cuda_stream`), else on a stream of
// ours created with cudaStreamCreate (a blocking stream: ordered with the legacy default stream that
// TVM's kernels use when no stream is set). Errors throw tvm::ffi::Error naming the call.
//
// NVTX: with MQA_BYOC_NVTX=1 (read once; the rule of nvtx_switch.h) every collective's host call is an
// NVTX range "nccl.<name>[<bytes> B]" (NVTX3, header-only), so a profile can attribute a step's time to its
// collectives; unset, one check of a static flag.

#include "nvtx_switch.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <nvtx3/nvToolsExt.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>
#include <tvm/runtime/disco/builtin.h>
#include <tvm/runtime/disco/disco_worker.h>
#include <tvm/runtime/disco/session.h>
#include <tvm/runtime/tensor.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mqa_byoc {
namespace disco_nccl {

using tvm::ffi::Optional;
using tvm::ffi::Shape;
using tvm::runtime::DiscoWorker;
using tvm::runtime::Session;
using tvm::runtime::Tensor;

#define MQA_NCCL_OK(what, expr)                                                              \
  do {                                                                                       \
    ncclResult_t rc_ = (expr);                                                               \
    if (rc_ != ncclSuccess) {                                                                \
      TVM_FFI_THROW(RuntimeError) << "runtime.disco.nccl." << (what) << ": " #expr " failed: " \
                                  << ncclGetErrorString(rc_);                                \
    }                                                                                        \
  } while (0)

#define MQA_CUDA_OK(what, expr)                                                              \
  do {                                                                                       \
    cudaError_t rc_ = (expr);                                                                \
    if (rc_ != cudaSuccess) {                                                                \
      TVM_FFI_THROW(RuntimeError) << "runtime.disco.nccl." << (what) << ": " #expr " failed: " \
                                  << cudaGetErrorString(rc_);                                \
    }                                                                                        \
  } while (0)

// ---- dtypes ---------------------------------------------------------------------------------------

bool Is(DLDataType t, uint8_t code, uint8_t bits) { return t.code == code && t.bits == bits && t.lanes == 1; }

bool IsFloat8(DLDataType t) {
  return t.lanes == 1 && t.bits == 8 && (t.code == kDLFloat8_e4m3fn || t.code == kDLFloat8_e5m2);
}

// NCCL's type for `t`; fp8 moves as bytes (`reducing` rejects it: a byte-wise sum is meaningless).
ncclDataType_t NcclType(DLDataType t, const char* what, bool reducing) {
  if (IsFloat8(t)) {
    if (reducing) {
      TVM_FFI_THROW(TypeError) << "runtime.disco.nccl." << what
                               << ": float8 tensors cannot be reduced (NCCL has no float8 arithmetic); "
                                  "reduce in float16 / bfloat16 and cast";
    }
    return ncclUint8;
  }
  if (Is(t, kDLFloat, 16)) return ncclFloat16;
  if (Is(t, kDLBfloat, 16)) return ncclBfloat16;
  if (Is(t, kDLFloat, 32)) return ncclFloat32;
  if (Is(t, kDLFloat, 64)) return ncclFloat64;
  if (Is(t, kDLInt, 8)) return ncclInt8;
  if (Is(t, kDLUInt, 8)) return ncclUint8;
  if (Is(t, kDLInt, 32)) return ncclInt32;
  if (Is(t, kDLUInt, 32)) return ncclUint32;
  if (Is(t, kDLInt, 64)) return ncclInt64;
  if (Is(t, kDLUInt, 64)) return ncclUint64;
  TVM_FFI_THROW(TypeError) << "runtime.disco.nccl." << what << ": no NCCL type for dtype " << t;
  throw;  // unreachable
}

ncclRedOp_t NcclOp(int kind) {
  switch (kind) {
    case 0: return ncclSum;
    case 1: return ncclProd;
    case 2: return ncclMin;
    case 3: return ncclMax;
    case 4: return ncclAvg;
    default:
      TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.allreduce: reduce kind " << kind
                                << " is not one of sum, prod, min, max, avg (0..4)";
  }
  throw;  // unreachable
}

int64_t Numel(const Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

int64_t ElemBytes(DLDataType t) { return (static_cast<int64_t>(t.bits) * t.lanes + 7) / 8; }

// ---- NVTX ranges -----------------------------------------------------------------------------------

// "nccl.<what>[<bytes> B]" around one collective's host call, when MQA_BYOC_NVTX is on.
class CollectiveRange {
 public:
  CollectiveRange(const char* what, const Tensor& t) : on_(mqa_byoc::nvtx_enabled()) {
    if (!on_) return;
    char name[96];
    std::snprintf(name, sizeof(name), "nccl.%s[%lld B]", what, static_cast<long long>(Numel(t) * ElemBytes(t->dtype)));
    nvtxRangePushA(name);
  }
  ~CollectiveRange() {
    if (on_) nvtxRangePop();
  }
  CollectiveRange(const CollectiveRange&) = delete;
  CollectiveRange& operator=(const CollectiveRange&) = delete;

 private:
  bool on_;
};

// ---- the state of one worker thread ---------------------------------------------------------------

struct WorkerComm {
  DiscoWorker* worker = nullptr;
  int device_id = -1;
  cudaStream_t own_stream = nullptr;
  ncclComm_t world = nullptr;
  ncclComm_t group = nullptr;  // == world with one group

  ~WorkerComm() { Release(); }

  // Destroys what init made; never throws (it runs at thread exit).
  void Release() noexcept {
    if (group != nullptr && group != world) ncclCommDestroy(group);
    if (world != nullptr) ncclCommDestroy(world);
    if (own_stream != nullptr) cudaStreamDestroy(own_stream);
    group = world = nullptr;
    own_stream = nullptr;
    worker = nullptr;
    device_id = -1;
  }

  int group_size() const { return worker->num_workers / worker->num_groups; }
  ncclComm_t comm(bool in_group) const { return in_group ? group : world; }
  int ranks(bool in_group) const { return in_group ? group_size() : worker->num_workers; }
  bool is_root(bool in_group) const {
    return in_group ? worker->worker_id % group_size() == 0 : worker->worker_id == 0;
  }

  cudaStream_t stream() const {
    static const Optional<tvm::ffi::Function> get = tvm::ffi::Function::GetGlobal("runtime.get_cuda_stream");
    if (get.has_value()) {
      void* s = (*get)().cast<void*>();
      if (s != nullptr) return static_cast<cudaStream_t>(s);
    }
    return own_stream;
  }
};

WorkerComm& ThreadComm() {
  thread_local WorkerComm comm;
  return comm;
}

// The initialized state of this thread, or an error saying what to call first.
WorkerComm& Ready(const char* what) {
  WorkerComm& c = ThreadComm();
  if (c.world == nullptr) {
    TVM_FFI_THROW(RuntimeError) << "runtime.disco.nccl." << what
                                << ": NCCL is not initialized on this thread; call "
                                   "sess.init_ccl(\"nccl\", *device_ids) on the disco session first";
  }
  return c;
}

// ---- initialization -------------------------------------------------------------------------------

void InitCCL(Session sess, Shape device_ids) {
  int64_t workers = sess->GetNumWorkers();
  if (static_cast<int64_t>(device_ids.size()) < workers) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.init_ccl: " << workers << " workers but "
                              << device_ids.size() << " device ids; give one device id per worker";
  }
  ncclUniqueId id;
  MQA_NCCL_OK("init_ccl", ncclGetUniqueId(&id));
  tvm::runtime::DRef per_worker = sess->GetGlobalFunc("runtime.disco.nccl.init_ccl_per_worker");
  sess->CallPacked(per_worker, device_ids, tvm::ffi::Bytes(id.internal, NCCL_UNIQUE_ID_BYTES));
}

void InitCCLPerWorker(Shape device_ids, tvm::ffi::Bytes unique_id) {
  DiscoWorker* worker = DiscoWorker::ThreadLocal();  // throws outside a worker thread
  WorkerComm& c = ThreadComm();
  if (c.world != nullptr) {
    TVM_FFI_THROW(RuntimeError) << "runtime.disco.nccl.init_ccl_per_worker: NCCL is already "
                                   "initialized on worker "
                                << worker->worker_id << "; init_ccl once per session";
  }
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.init_ccl_per_worker: an NCCL id has "
                              << NCCL_UNIQUE_ID_BYTES << " bytes, got " << unique_id.size();
  }
  if (worker->num_groups < 1 || worker->num_workers % worker->num_groups != 0) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.init_ccl_per_worker: " << worker->num_workers
                              << " workers do not split into " << worker->num_groups << " groups";
  }
  if (worker->local_worker_id < 0 ||
      worker->local_worker_id >= static_cast<int>(device_ids.size())) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.init_ccl_per_worker: no device id for local "
                                 "worker "
                              << worker->local_worker_id << " in " << device_ids;
  }
  int device_id = static_cast<int>(device_ids[worker->local_worker_id]);
  DLDevice device{kDLCUDA, device_id};
  if (worker->default_device.device_type != kDLCPU &&
      (worker->default_device.device_type != device.device_type ||
       worker->default_device.device_id != device.device_id)) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.init_ccl_per_worker: worker "
                              << worker->worker_id << " already uses device "
                              << worker->default_device.device_type << ":" << worker->default_device.device_id
                              << " (DLPack type:id), not cuda:" << device_id;
  }
  MQA_CUDA_OK("init_ccl_per_worker", cudaSetDevice(device_id));
  MQA_CUDA_OK("init_ccl_per_worker", cudaStreamCreate(&c.own_stream));
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  c.worker = worker;
  c.device_id = device_id;
  ncclResult_t rc = ncclCommInitRank(&c.world, worker->num_workers, id, worker->worker_id);
  if (rc != ncclSuccess) {
    c.world = nullptr;
    c.Release();
    TVM_FFI_THROW(RuntimeError) << "runtime.disco.nccl.init_ccl_per_worker: ncclCommInitRank(rank "
                                << worker->worker_id << " of " << worker->num_workers
                                << ") failed: " << ncclGetErrorString(rc);
  }
  if (worker->num_groups == 1) {
    c.group = c.world;
  } else {
    int gs = worker->num_workers / worker->num_groups;
    MQA_NCCL_OK("init_ccl_per_worker",
                ncclCommSplit(c.world, worker->worker_id / gs, worker->worker_id % gs, &c.group, nullptr));
  }
  worker->default_device = device;
  worker->ccl = "nccl";  // disco's builtins route collectives by this name
}

// ---- collectives ----------------------------------------------------------------------------------

void AllReduce(Tensor send, int kind, bool in_group, Tensor recv) {
  WorkerComm& c = Ready("allreduce");
  CollectiveRange range("allreduce", send);
  ncclRedOp_t op = NcclOp(kind);
  if (Numel(send) != Numel(recv)) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.allreduce: send has " << Numel(send)
                              << " elements, recv " << Numel(recv);
  }
  MQA_NCCL_OK("allreduce", ncclAllReduce(send->data, recv->data, Numel(send),
                                         NcclType(send->dtype, "allreduce", true), op,
                                         c.comm(in_group), c.stream()));
}

void AllGather(Tensor send, bool in_group, Tensor recv) {
  WorkerComm& c = Ready("allgather");
  CollectiveRange range("allgather", recv);
  if (Numel(send) * c.ranks(in_group) != Numel(recv)) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.allgather: recv must hold " << c.ranks(in_group)
                              << " x " << Numel(send) << " elements, has " << Numel(recv);
  }
  MQA_NCCL_OK("allgather", ncclAllGather(send->data, recv->data, Numel(send),
                                         NcclType(send->dtype, "allgather", false), c.comm(in_group),
                                         c.stream()));
}

void BroadcastFromWorker0(Optional<Tensor> send, bool in_group, Tensor recv) {
  WorkerComm& c = Ready("broadcast_from_worker0");
  CollectiveRange range("broadcast_from_worker0", recv);
  const void* src = nullptr;
  if (c.is_root(in_group)) {
    if (!send.has_value() || Numel(send.value()) != Numel(recv)) {
      TVM_FFI_THROW(ValueError) << "runtime.disco.nccl.broadcast_from_worker0: the sending worker needs "
                                   "a send tensor of "
                                << Numel(recv) << " elements";
    }
    src = send.value()->data;
  }
  MQA_NCCL_OK("broadcast_from_worker0",
              ncclBroadcast(src, recv->data, Numel(recv), NcclType(recv->dtype, "broadcast_from_worker0", false),
                            /*root=*/0, c.comm(in_group), c.stream()));
}

// Worker 0 of the communicator sends shard i of `whole` to rank i (itself included) and every rank
// receives its shard into `part` (scatter), or the reverse (gather), in one NCCL group.
void ShardExchange(const char* what, bool scatter, const Optional<Tensor>& whole, const Tensor& part,
                   bool in_group) {
  WorkerComm& c = Ready(what);
  CollectiveRange range(what, part);
  ncclComm_t comm = c.comm(in_group);
  cudaStream_t stream = c.stream();
  ncclDataType_t type = NcclType(part->dtype, what, false);
  int64_t n = Numel(part);
  bool root = c.is_root(in_group);
  if (root) {
    if (!whole.has_value()) {
      TVM_FFI_THROW(ValueError) << "runtime.disco.nccl." << what << ": worker 0 of the "
                                << (in_group ? "group" : "session") << " needs the whole tensor";
    }
    const Tensor& w = whole.value();
    if (Numel(w) != n * c.ranks(in_group) || w->dtype != part->dtype) {
      TVM_FFI_THROW(ValueError) << "runtime.disco.nccl." << what << ": the whole tensor must hold "
                                << c.ranks(in_group) << " shards of " << n << " elements of the shard's "
                                << "dtype, has " << Numel(w) << " of " << w->dtype;
    }
  }
  MQA_NCCL_OK(what, ncclGroupStart());
  if (root) {
    auto* base = static_cast<uint8_t*>(whole.value()->data);
    int64_t step = n * ElemBytes(part->dtype);
    for (int r = 0; r < c.ranks(in_group); ++r) {
      if (scatter) {
        MQA_NCCL_OK(what, ncclSend(base + r * step, n, type, r, comm, stream));
      } else {
        MQA_NCCL_OK(what, ncclRecv(base + r * step, n, type, r, comm, stream));
      }
    }
  }
  if (scatter) {
    MQA_NCCL_OK(what, ncclRecv(part->data, n, type, 0, comm, stream));
  } else {
    MQA_NCCL_OK(what, ncclSend(part->data, n, type, 0, comm, stream));
  }
  MQA_NCCL_OK(what, ncclGroupEnd());
}

void PointToPoint(const char* what, bool sending, const Tensor& buf, int peer) {
  WorkerComm& c = Ready(what);
  CollectiveRange range(what, buf);
  int me = c.worker->worker_id;
  if (peer < 0 || peer >= c.worker->num_workers || peer == me) {
    TVM_FFI_THROW(ValueError) << "runtime.disco.nccl." << what << ": worker " << me
                              << " cannot exchange with worker " << peer << " (session of "
                              << c.worker->num_workers << ")";
  }
  ncclDataType_t type = NcclType(buf->dtype, what, false);
  MQA_NCCL_OK(what, ncclGroupStart());
  if (sending) {
    MQA_NCCL_OK(what, ncclSend(buf->data, Numel(buf), type, peer, c.world, c.stream()));
  } else {
    MQA_NCCL_OK(what, ncclRecv(buf->data, Numel(buf), type, peer, c.world, c.stream()));
  }
  MQA_NCCL_OK(what, ncclGroupEnd());
}

void SyncWorker() {
  WorkerComm& c = Ready("sync_worker");
  MQA_CUDA_OK("sync_worker", cudaStreamSynchronize(c.stream()));
}

int NcclVersion() {
  int v = 0;
  MQA_NCCL_OK("version", ncclGetVersion(&v));
  return v;
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("runtime.disco.nccl.init_ccl", InitCCL)
      .def("runtime.disco.nccl.init_ccl_per_worker", InitCCLPerWorker)
      .def("runtime.disco.nccl.allreduce", AllReduce)
      .def("runtime.disco.nccl.allgather", AllGather)
      .def("runtime.disco.nccl.broadcast_from_worker0", BroadcastFromWorker0)
      .def("runtime.disco.nccl.scatter_from_worker0",
           [](Optional<Tensor> send, bool in_group, Tensor recv) {
             ShardExchange("scatter_from_worker0", true, send, recv, in_group);
           })
      .def("runtime.disco.nccl.gather_to_worker0",
           [](Tensor send, bool in_group, Optional<Tensor> recv) {
             ShardExchange("gather_to_worker0", false, recv, send, in_group);
           })
      .def("runtime.disco.nccl.recv_from_worker0",
           [](Tensor buf) {
             PointToPoint("recv_from_worker0", false, buf, 0);
           })
      .def("runtime.disco.nccl.send_to_next_group",
           [](Tensor buf) {
             WorkerComm& c = Ready("send_to_next_group");
             PointToPoint("send_to_next_group", true, buf, c.worker->worker_id + c.group_size());
           })
      .def("runtime.disco.nccl.recv_from_prev_group",
           [](Tensor buf) {
             WorkerComm& c = Ready("recv_from_prev_group");
             PointToPoint("recv_from_prev_group", false, buf, c.worker->worker_id - c.group_size());
           })
      .def("runtime.disco.nccl.send_to_worker",
           [](Tensor buf, int receiver) { PointToPoint("send_to_worker", true, buf, receiver); })
      .def("runtime.disco.nccl.recv_from_worker",
           [](Tensor buf, int sender) { PointToPoint("recv_from_worker", false, buf, sender); })
      .def("runtime.disco.nccl.sync_worker", SyncWorker)
      // ours: which NCCL this library runs on (ncclGetVersion; needs no GPU)
      .def("mqa_byoc.disco_nccl.nccl_version", NcclVersion);
}

}  // namespace disco_nccl
}  // namespace mqa_byoc
